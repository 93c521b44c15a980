"""The backward's dQ modes side by side at one shape: fwd+bwd time of blockattn per mode next to FlexAttention
(compiled, same mask), each dK/dV tile config's time per mode, and a profiler breakdown of one backward.

    python benchmarks/bwd_modes.py --block 128x128 --density 0.25
"""

import argparse

import torch
import triton.testing

from blockattn.bench import Case, block_mask, _runners
from blockattn.kernels import autotune, backward, tma

DKDV_SWEEP = [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (128, 64, 8, 2),
              (128, 64, 8, 3), (32, 128, 8, 2)]


def time_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", default="128x128")
    parser.add_argument("--density", type=float, nargs="+", default=[0.25])
    parser.add_argument("--modes", default="kernel,atomic,tma")
    parser.add_argument("--sweep", action="store_true", help="tune the dK/dV kernel over DKDV_SWEEP")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dkdv-tma", action="store_true", help="run each mode with the dK/dV kernel's Q/dO tiles "
                        "through pointer loads and through descriptors (tma.DKDV_TMA_LOADS off and on)")
    args = parser.parse_args()
    device = torch.device("cuda")
    autotune.DISK_CACHE = False  # benchmark the candidates this run prints, not a stored choice
    print("tma reductions available:", tma.reductions_available(backward.attention_bwd_dkdv_kernel, device))
    if args.sweep:
        autotune._DEFAULTS["BWD_DKDV"] = DKDV_SWEEP
        autotune._MAX_TUNED["BWD_DKDV"] = len(DKDV_SWEEP)
    block = tuple(int(x) for x in args.block.split("x"))
    for density in args.density:
        case = Case(block=block, density=density)
        keep = block_mask(case, device)
        runners = _runners(case, keep, device)
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, case.heads, case.seq, case.dim, device=device, dtype=torch.bfloat16,
                               generator=gen).requires_grad_(True) for _ in range(3))
        grad = torch.randn_like(q)
        flops = 4.0 * case.heads * case.seq * case.seq * case.dim * runners["blockattn"][1]
        results, reference = {}, None
        loads = ("ptr", "tma") if args.dkdv_tma else ("",)
        for name in ("flex",) + tuple(f"blockattn-{m}{'-' + l if l else ''}" for m in args.modes.split(",")
                                      for l in loads):
            if name.startswith("blockattn"):
                backward.DQ_MODE_DEFAULT = name.split("-")[1]
                if args.dkdv_tma:  # otherwise the package's own choice
                    tma.DKDV_TMA_LOADS = name.endswith("-tma")
                fn = runners["blockattn"][0]
            else:
                fn = runners[name][0]
            try:
                fwd = time_ms(lambda: fn(q, k, v))
                both = time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad))
                grads = torch.autograd.grad(fn(q, k, v), (q, k, v), grad)
            except Exception as error:  # FlexAttention's backward does not compile for some block shapes
                print(f"{case.label} {name}: failed {type(error).__name__}: {str(error)[:120]}", flush=True)
                continue
            results[name] = both - fwd
            if reference is None:
                reference = (name, grads)
            gap = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference[1]))
            print(f"{case.label} {name}: fwd {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TFLOP/s), bwd {both - fwd:.3f} ms "
                  f"({2.5 * flops / (both - fwd) / 1e9:.0f} TFLOP/s), max |grad - {reference[0]}'s| {gap:.2e}",
                  flush=True)
            if args.profile and name.startswith("blockattn"):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    torch.autograd.grad(fn(q, k, v), (q, k, v), grad)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
        for name, ms in results.items():
            if "flex" in results:
                print(f"  {name}: bwd {results['flex'] / ms:.3f}x FlexAttention")
        for kname, rows in autotune.measured():
            if "bwd" not in kname:
                continue
            print(f"== {case.label}: {kname} (last tuned mode)")
            for config, ms in rows:
                print(f"  {config.kwargs} w{config.num_warps} s{config.num_stages}: {ms:.3f} ms")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
