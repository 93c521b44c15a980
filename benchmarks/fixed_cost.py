"""The forward's (or the backward's) time against the number of key blocks each query block keeps, and the line
fitted to it.

Each query block keeps exactly n key blocks (random positions), so every program walks the same number of key
tiles. The line t(n) = a + b n: `a` is what a call costs whatever the walks' length (per program: its start, its
first and last tiles, the epilogue; per call: the launch), `b` one more kept block a row over the whole grid. `a` is
the part of t(d) = F + W d over random masks that does not scale with density (BENCHMARKS.md, thirty-fifth session).

    python benchmarks/fixed_cost.py [--blocks 128 128] [--heads 24] [--seq 32768] [--dim 128] [--counts 2 4 8 ...]
    python benchmarks/fixed_cost.py --random      # also random masks keeping n blocks a row on average
    python benchmarks/fixed_cost.py --backward --blocks 128 64   # the backward alone (autograd.grad, graph kept)

For the backward, whose programs walk a key tile's q list, a query block's exact count leaves the key tiles' counts
random (n * nq / nk on average); `a` then also holds its two small kernels (row terms and zeroed dQ buffer before,
dQ's conversion after), which move bytes in proportion to Sq, not to n.
"""

import argparse

import numpy as np
import torch

import blockattn
from blockattn.bench import Case, _inputs, _time_ms


def exact_keep(heads: int, nq: int, nk: int, count: int, device, seed: int = 0) -> torch.Tensor:
    """A [1, heads, nq, nk] bool mask in which each query block keeps exactly `count` key blocks, at random."""
    gen = torch.Generator(device=device).manual_seed(seed)
    order = torch.rand(heads, nq, nk, generator=gen, device=device).argsort(-1)[..., :count]
    keep = torch.zeros(heads, nq, nk, dtype=torch.bool, device=device)
    return keep.scatter_(-1, order, True)[None]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs=2, default=[128, 128])
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--random", action="store_true",
                        help="also time a random mask of density n / nk (n kept blocks a row on average) for each n")
    parser.add_argument("--backward", action="store_true", help="time the backward alone instead of the forward")
    args = parser.parse_args()
    device = torch.device("cuda")
    block_q, block_kv = args.blocks
    nq, nk = args.seq // block_q, args.seq // block_kv
    q, k, v = _inputs(Case(heads=args.heads, kv_heads=args.heads, seq=args.seq, dim=args.dim), device,
                      requires_grad=args.backward)
    grad = torch.randn_like(q) if args.backward else None
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {'backward' if args.backward else 'forward'}, "
          f"B1 H{args.heads} S{args.seq} D{args.dim} bf16, "
          f"blocks {block_q}x{block_kv}; {args.heads * nq} query tiles of {block_q} rows", flush=True)
    times = []
    for count in args.counts:
        masks = {"exactly": exact_keep(args.heads, nq, nk, count, device)}
        if args.random:
            gen = torch.Generator(device=device).manual_seed(count)
            masks["on average"] = torch.rand(1, args.heads, nq, nk, generator=gen, device=device) < count / nk
        for label, keep in masks.items():
            blocks = blockattn.BlockSparsity.from_mask(keep, (block_q, block_kv), args.seq, args.seq)
            if args.backward:
                out = blockattn.attention(q, k, v, blocks)
                ms = _time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
            else:
                ms = _time_ms(lambda: blockattn.attention(q, k, v, blocks))
            # (the mask counts every head's blocks; the backward's five products to the forward's two)
            flops = (10.0 if args.backward else 4.0) * int(keep.sum()) * block_q * block_kv * args.dim
            if label == "exactly":
                times.append(ms)
            print(f"{count} key blocks a row {label} (density {count / nk:.4f}): {ms:.3f} ms, "
                  f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    slope, intercept = np.polyfit(np.array(args.counts, dtype=float), np.array(times), 1)
    print(f"fit: t = {intercept:.3f} ms + {slope * 1e3:.2f} us x blocks a row", flush=True)


if __name__ == "__main__":
    main()
