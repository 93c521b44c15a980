"""Short-sequence forward and forward+backward: do_bench time (eager and CUDA-graph replay) and host enqueue time
per call, for blockattn (and FlexAttention, compiled, with --flex) on B8 H16 S D128 (d=0.5, 128x128 blocks; --batch,
--heads, --density and --block change them);
--profile adds cProfile tables of the host's own time (forward, then forward+backward, then the backward on
autograd's thread).

    python benchmarks/short_host.py --seq 1024 2048 --flex
    python benchmarks/short_host.py --seq 1024 --descriptors both --rounds 3
    python benchmarks/short_host.py --seq 1024 --profile
    python benchmarks/short_host.py --seq 1024 --flex --threads both
    python benchmarks/short_host.py --seq 4096 8192 --batch 1 --heads 24 --density 0.1 --flex
"""

import argparse
import cProfile
import pstats
import time

import torch
import triton.testing

from blockattn.bench import flex_block_mask

from exp_short import calling_thread, host_ms, print_profile, short_case, short_inputs
from short_graphs import graphed


def flex_case(batch: int, heads: int, seq: int, density: float, block: tuple = (128, 128)):
    """(fwd, fwd_bwd) for compiled FlexAttention on short_inputs()' tensors and mask."""
    from torch.nn.attention.flex_attention import flex_attention
    q, k, v, blocks, grad = short_inputs(batch, heads, seq, density, block)
    mask = flex_block_mask(blocks)
    compiled = torch.compile(flex_attention, dynamic=False)

    def fwd():
        with torch.no_grad():
            return compiled(q, k, v, block_mask=mask)

    def fwd_bwd():
        return torch.autograd.grad(compiled(q, k, v, block_mask=mask), (q, k, v), grad)
    return fwd, fwd_bwd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--flex", action="store_true", help="FlexAttention too")
    parser.add_argument("--descriptors", choices=("auto", "always", "both"), default="auto",
                        help="always: tensor descriptors at every size (tma.MIN_DESCRIPTOR_WORK = 0); both: "
                        "blockattn measured both ways, alternating, --rounds times")
    parser.add_argument("--threads", choices=("device", "calling", "both"), default="device",
                        help="where autograd runs the backward: device (its worker thread, the default), calling "
                        "(torch.autograd.set_multithreading_enabled(False) around each forward+backward), both")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128),
                        help="blockattn's blocks (FlexAttention compiled with default options takes 128x128 only)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile tables of blockattn's forward and fwd+bwd, and of the backward alone")
    args = parser.parse_args()
    from blockattn.kernels import tma
    threshold = tma.MIN_DESCRIPTOR_WORK
    settings = {"auto": [("", threshold)], "always": [("", 0)],
                "both": [(" descriptors=auto", threshold), (" descriptors=always", 0)]}[args.descriptors]
    for seq in args.seq:
        shape = (args.batch, args.heads, seq, args.density)
        impls = {"blockattn": short_case(*shape, tuple(args.block))}
        if args.flex:
            impls["flex"] = flex_case(*shape)
        for _ in range(args.rounds):
            for impl, (fwd, fwd_bwd) in impls.items():
                for label, value in settings if impl == "blockattn" else [("", threshold)]:
                    tma.MIN_DESCRIPTOR_WORK = value
                    for name, fn in (("fwd", fwd), *fwd_bwd_threads(fwd_bwd, args.threads)):
                        eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                        replay = triton.testing.do_bench(graphed(fn), warmup=25, rep=100, return_mode="median")
                        print(f"S{seq} {impl}{label} {name}: do_bench eager {eager:.3f} ms, replay {replay:.3f} ms, "
                              f"host enqueue {host_ms(fn):.3f} ms/call", flush=True)
        tma.MIN_DESCRIPTOR_WORK = settings[0][1]
        if args.profile:
            for name, fn in zip(("forward", "forward+backward"), impls["blockattn"]):
                print(f"S{seq} blockattn {name}, 100 calls:", flush=True)
                print_profile(fn, 100, rows=30)
            profile_backward(impls["blockattn"][1], 100)


def fwd_bwd_threads(fwd_bwd, threads: str) -> list:
    """[(name, forward+backward)] for --threads: on autograd's device thread, on the calling thread, or both."""
    device, on_calling = ("fwd+bwd", fwd_bwd), ("fwd+bwd calling-thread", calling_thread(fwd_bwd))
    return {"device": [device], "calling": [on_calling], "both": [device, on_calling]}[threads]


def profile_backward(fwd_bwd, calls: int, rows: int = 30) -> None:
    """The backward's own share of the host time: a clock and a profile switched on only inside ops.backward_some
    (on autograd's device thread, where it runs), against the whole forward+backward call's."""
    from blockattn.kernels import ops
    profile, spent, original = cProfile.Profile(), [], ops.backward_some

    def profiled(*args):
        start = time.perf_counter()
        profile.enable()
        try:
            return original(*args)
        finally:
            profile.disable()
            spent.append(time.perf_counter() - start)
    ops.backward_some = profiled
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fwd_bwd()
        whole = (time.perf_counter() - start) / calls
        torch.cuda.synchronize()
    finally:
        ops.backward_some = original
    print(f"forward+backward {whole * 1e3:.3f} ms/call on the host (profiled), of it inside backward_some "
          f"{sum(spent) / calls * 1e3:.3f} ms", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(rows)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(rows)


if __name__ == "__main__":
    main()
