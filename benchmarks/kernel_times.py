"""Each kernel's GPU time in one call of blockattn's forward and of FlexAttention's (compiled, same mask), from
torch.profiler over 10 calls (ws_backward.profile, which also gives the calls' wall and host enqueue time back to
back): what a call launches besides the attention kernel (the key-norm pass of the fixed offsets' bound, the claims'
counter zeroed, list preparation) and what that costs. B1 H24 S32768 bf16, random block masks.

    cd benchmarks && python kernel_times.py                                   # D=64 and 128, d=0.1 and 0.5
    cd benchmarks && python kernel_times.py --dims 64 --densities 0.1 --blocks 128,64 --causal
"""

import argparse

import torch

from blockattn.bench import Case, _inputs, _runners, block_mask
from ws_backward import profile


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--blocks", nargs="+", default=["128,128"], help="block shapes as Q,KV")
    parser.add_argument("--causal", action="store_true", help="also the causal mask at each dim and block shape")
    args = parser.parse_args()
    device = torch.device("cuda")
    blocks = [tuple(int(x) for x in block.split(",")) for block in args.blocks]
    cases = [Case(dim=dim, density=density, block=block)
             for dim in args.dims for block in blocks for density in args.densities]
    if args.causal:
        cases += [Case(dim=dim, pattern="causal", density=0.5, block=block) for dim in args.dims for block in blocks]
    for case in cases:
        keep = block_mask(case, device)
        q, k, v = _inputs(case, device, requires_grad=False)
        runners = _runners(case, keep, device)
        for name in ("blockattn", "flex"):
            fn = runners[name][0]
            if isinstance(fn, Exception):
                print(f"{name} {case.label}: {fn}")
                continue
            profile(f"{name} {case.label}", lambda: fn(q, k, v))


if __name__ == "__main__":
    main()
