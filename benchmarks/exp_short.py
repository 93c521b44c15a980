"""Where a short sequence's backward goes: B8 H16 S1024 D128 (the case of issue 6 that runs far behind
FlexAttention). Prints do_bench times per dQ mode, the host time per call (enqueue without waiting), and a
torch.profiler table of the GPU kernels.

    python benchmarks/exp_short.py --seq 1024
"""

import argparse
import cProfile
import pstats
import time

import torch
import triton.testing

import blockattn
from blockattn.bench import Case, block_mask
from blockattn.kernels import backward


def short_inputs(batch: int, heads: int, seq: int, density: float, block: tuple = (128, 128)):
    """(q, k, v, blocks, grad): a B x H x S, D=128 bf16 case with `block` blocks on the GPU, inputs requiring grad."""
    case = Case(batch=batch, heads=heads, kv_heads=heads, seq=seq, density=density, block=tuple(block))
    device = torch.device("cuda")
    blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), case.block, case.seq, case.seq)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(case.batch, case.heads, case.seq, case.dim, device=device, dtype=torch.bfloat16,
                           generator=gen).requires_grad_(True) for _ in range(3))
    return q, k, v, blocks, torch.randn_like(q)


def short_case(batch: int, heads: int, seq: int, density: float, block: tuple = (128, 128)):
    """(fwd, fwd_bwd): closures running blockattn on short_inputs(), the forward without gradients and
    forward+backward through autograd."""
    q, k, v, blocks, grad = short_inputs(batch, heads, seq, density, block)

    def fwd():
        with torch.no_grad():
            return blockattn.attention(q, k, v, blocks)

    def fwd_bwd():
        return torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), grad)
    return fwd, fwd_bwd


def calling_thread(fn):
    """fn with autograd's multithreading off: its backward runs on the calling thread, not autograd's device
    thread (torch.autograd.set_multithreading_enabled)."""
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            return fn()
    return run


def host_ms(fn, calls: int = 100) -> float:
    """Host time per call (ms): calls enqueued back to back, without waiting for the GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def print_profile(fn, calls: int, rows: int = 25) -> None:
    """A cProfile table (own time first) of calls of fn, enqueued back to back."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.5)
    args = parser.parse_args()
    fwd, fwd_bwd = short_case(args.batch, args.heads, args.seq, args.density)

    for mode in ("atomic", "kernel"):
        backward.DQ_MODE_DEFAULT = mode
        t_fwd = triton.testing.do_bench(fwd, warmup=50, rep=200, return_mode="median")
        t_all = triton.testing.do_bench(fwd_bwd, warmup=50, rep=200, return_mode="median")
        for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            print(f"dq {mode} {name}: host enqueue {host_ms(fn):.3f} ms/call", flush=True)
        print(f"dq {mode}: do_bench fwd {t_fwd:.3f} ms, fwd+bwd {t_all:.3f} ms, bwd {t_all - t_fwd:.3f} ms",
              flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fwd_bwd()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60),
              flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60),
              flush=True)
        print_profile(fwd_bwd, 50)


if __name__ == "__main__":
    main()
