"""Per-kernel GPU time (torch.profiler) next to do_bench's time, for blockattn and FlexAttention on one case, and
the registers, spills and shared memory of each kernel blockattn launched.

Registers at 255 with spills mark a register-bound tile config; the kernel times split the backward into its
kernels and show how much of do_bench's time (events around each call, L2 flushed before it) is kernel time.

    python benchmarks/kernel_resources.py --dim 128 --density 0.25
"""

import argparse
from collections import defaultdict

import torch

from blockattn.bench import Case, _inputs, _runners, _time_ms, block_mask
from blockattn.kernels import launch

from exp_short import host_ms


def kernel_ms(fn, steps: int = 5) -> dict:
    """Kernel name -> GPU ms per call of fn, from the profiler's CUDA events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / steps / 1e3
    return totals


def hidden_host_ms(fn, reps: int = 30) -> float:
    """Median ms between events around fn, as do_bench takes them (L2 flushed first), but with the GPU kept busy
    (torch.cuda._sleep) while the host prepares the call, so host time before the first kernel is not counted."""
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        cache.zero_()
        torch.cuda._sleep(2_000_000)  # about 1 ms at the H200's clock
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--block", default="128x128")
    parser.add_argument("--impls", nargs="+", default=["blockattn", "flex"])
    args = parser.parse_args()
    case = Case(heads=args.heads, kv_heads=args.kv_heads or args.heads, seq=args.seq, dim=args.dim,
                block=tuple(int(x) for x in args.block.split("x")), density=args.density)
    device = torch.device("cuda")
    q, k, v = _inputs(case, device, requires_grad=True)
    grad = torch.randn_like(q)
    runners = _runners(case, block_mask(case, device), device)
    print(f"== {case.label}")
    for name in args.impls:
        fn, _ = runners[name]
        passes = {"fwd": lambda: fn(q, k, v),
                  "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)}
        for mode, run_pass in passes.items():
            with torch.set_grad_enabled(mode != "fwd"):
                for _ in range(3):  # tune, compile, make plans
                    run_pass()
                bench_ms = _time_ms(run_pass)
                kernels = kernel_ms(run_pass)
                busy_ms = hidden_host_ms(run_pass)
                host = host_ms(run_pass, 10)
            print(f"{name} {mode}: do_bench {bench_ms:.3f} ms, host hidden {busy_ms:.3f} ms, kernels "
                  f"{sum(kernels.values()):.3f} ms, host {host:.3f} ms per call")
            for kernel, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
                print(f"    {ms:8.3f} ms  {kernel[:100]}")
    if "blockattn" in args.impls:
        for plan in launch.plans().values():
            kernel = plan.kernel
            print(f"{kernel.name}: grid {plan.grid} warps {kernel.metadata.num_warps} stages "
                  f"{kernel.metadata.num_stages} regs {kernel.n_regs} spills {kernel.n_spills} shared "
                  f"{kernel.metadata.shared} B")


if __name__ == "__main__":
    main()
