"""Target 4: is GQA (Hq=32, Hkv=8) at least as fast per FLOP as MHA (H=32)? Same query heads, sequence, mask and
density, so the same FLOPs: the two are timed alternately for several rounds, so that clock drift during the run
falls on both.

    python benchmarks/gqa_per_flop.py --seq 16384 --density 0.1 0.5 --rounds 3 [--block 128 64]

--block sets the block shape (128x128 by default; 128x64 runs the backward's paired programs, whose GQA walk
spills more registers than MHA's under Triton 3.6).
"""

import argparse

import torch

from blockattn.bench import Case, _inputs, _runners, _time_ms, block_mask


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--density", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("BLOCK_Q", "BLOCK_KV"))
    args = parser.parse_args()
    device = torch.device("cuda")
    for density in args.density:
        passes = {}
        for kv_heads in (8, 32):
            case = Case(heads=32, kv_heads=kv_heads, seq=args.seq, density=density, block=tuple(args.block))
            q, k, v = _inputs(case, device, requires_grad=True)
            grad = torch.randn_like(q)
            fn, _ = _runners(case, block_mask(case, device), device)["blockattn"]
            passes[kv_heads] = (lambda fn=fn, q=q, k=k, v=v: fn(q, k, v),
                                lambda fn=fn, q=q, k=k, v=v, g=grad: torch.autograd.grad(fn(q, k, v), (q, k, v), g))
        times = {(h, mode): [] for h in passes for mode in ("fwd", "fwd+bwd")}
        for _ in range(args.rounds):
            for kv_heads, (fwd, fwd_bwd) in passes.items():
                with torch.no_grad():
                    times[(kv_heads, "fwd")].append(_time_ms(fwd))
                times[(kv_heads, "fwd+bwd")].append(_time_ms(fwd_bwd))
        for mode in ("fwd", "bwd"):
            def ms(h):
                if mode == "fwd":
                    return times[(h, "fwd")]
                return [b - f for f, b in zip(times[(h, "fwd")], times[(h, "fwd+bwd")])]
            gqa, mha = ms(8), ms(32)
            print(f"{args.block[0]}x{args.block[1]} d={density} {mode}: GQA 32/8 "
                  + " ".join(f"{t:.3f}" for t in gqa) + " ms; MHA 32 "
                  + " ".join(f"{t:.3f}" for t in mha) + f" ms; GQA/MHA time (median of rounds) "
                  f"{sorted(gqa)[len(gqa) // 2] / sorted(mha)[len(mha) // 2]:.3f}", flush=True)


if __name__ == "__main__":
    main()
