"""Each kernel's GPU time in one call of blockattn's forward and of FlexAttention's (compiled, same mask), from
torch.profiler over 10 calls: what a call launches besides the attention kernel (the key-norm pass of the fixed
offsets' bound, the claims' counter zeroed, list preparation) and what that costs. B1 H24 S32768 bf16, random
block masks.

    cd benchmarks && python kernel_times.py                                   # D=64 and 128, d=0.1 and 0.5
    cd benchmarks && python kernel_times.py --dims 64 --densities 0.1 --blocks 128,64 --causal
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from blockattn.bench import Case, _inputs, _runners, block_mask


def kernel_times(fn, calls: int = 10) -> list:
    """[(GPU us a call, launches a call, kernel name)] for fn(), slowest first, after 5 calls to compile and tune."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(event.device_time_total / calls, event.count / calls, event.key) for event in prof.key_averages()
            if event.device_time_total > 0]
    return sorted(rows, reverse=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--blocks", nargs="+", default=["128,128"], help="block shapes as Q,KV")
    parser.add_argument("--causal", action="store_true", help="also the causal mask at each dim and block shape")
    args = parser.parse_args()
    device = torch.device("cuda")
    cases = [Case(dim=dim, density=density, block=tuple(int(x) for x in block.split(",")))
             for dim in args.dims for block in args.blocks for density in args.densities]
    if args.causal:
        cases += [Case(dim=dim, pattern="causal", density=0.5, block=tuple(int(x) for x in block.split(",")))
                  for dim in args.dims for block in args.blocks]
    for case in cases:
        keep = block_mask(case, device)
        q, k, v = _inputs(case, device, requires_grad=False)
        runners = _runners(case, keep, device)
        for name in ("blockattn", "flex"):
            fn = runners[name][0]
            if isinstance(fn, Exception):
                print(f"{case.label} {name}: {fn}")
                continue
            rows = kernel_times(lambda: fn(q, k, v))
            print(f"{case.label} {name}: {sum(us for us, _, _ in rows):.1f} us of GPU time a call", flush=True)
            for us, launches, key in rows:
                print(f"    {us:9.1f} us  x{launches:.1f}  {key[:90]}")


if __name__ == "__main__":
    main()
