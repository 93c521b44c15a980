"""How often the fixed-offset rule would hold on queries and keys shaped like real models' (no GPU needed): for each
synthetic distribution, the share of 64-row query tiles whose every row's bound exceeds its first key tile's
largest scaled score by at most the bf16 headroom (kernels/README.md, "Fixed offsets"; bounds.FIXED_HEADROOM), the
rule the forwards apply, with the bound as they take it (scale * log2(e) * |q| * the head's largest |k|) and with
the keys centred on their mean first (softmax ignores a score shared by a row's keys, so the bound may use
q . mean + |q| * max |k - mean| instead), the median gap (bound minus offset, log2 units), and how far any row's
scores actually rise past its first tile's largest (what a rule checking the rise itself, not a bound, would meet).

    python benchmarks/offset_bounds.py [--dim 64] [--seq 4096] [--tile-keys 256] [--causal]

Distributions (per head): "randn", the benchmarks' inputs; "qk-norm gain G", RMS-normalized rows times a per-channel
gain around G (diffusion transformers normalize q and k so); "key mean M", keys sharing a mean direction of norm M
(rows of one head often do); "outlier channels", a few channels 10x larger with a fixed sign in the keys.
"""

import argparse
import math

import torch

from blockattn.kernels import bounds


def distributions(heads: int, seq: int, dim: int, gen: torch.Generator) -> dict:
    """name -> (q, k) fp32 [1, heads, seq, dim]."""
    def randn():
        return torch.randn(1, heads, seq, dim, generator=gen)

    def rms_normed(x, gain):
        channel_gain = gain * (1 + 0.3 * torch.randn(1, heads, 1, dim, generator=gen)).abs()
        return x / x.pow(2).mean(-1, keepdim=True).sqrt() * channel_gain
    out = {"randn": (randn(), randn())}
    for gain in (1.0, 2.0, 3.0):
        out[f"qk-norm gain {gain:g}"] = (rms_normed(randn(), gain), rms_normed(randn(), gain))
    for norm in (8.0, 24.0):
        direction = torch.randn(1, heads, 1, dim, generator=gen)
        direction = direction / direction.norm(dim=-1, keepdim=True)
        out[f"key mean {norm:g}"] = (randn(), randn() + norm * direction)
    sign = torch.randn(1, heads, 1, 4, generator=gen).sign()
    k = randn()
    k[..., :4] = 10 * (k[..., :4].abs() * sign)
    q = randn()
    q[..., :4] *= 3
    out["outlier channels"] = (q, k)
    return out


def share_kept(q, k, tile_keys: int, causal: bool, centred: bool) -> tuple[float, float, float]:
    """(share of 64-row query tiles that keep their offsets, median of the rows' gap, the largest rise of a row's
    scores past its first tile's largest; log2 units): every query tile's list is all its keys (causal: up to the
    tile's last row), its first tile the first tile_keys of them."""
    dim = q.shape[-1]
    c = dim ** -0.5 * math.log2(math.e)
    scores = (q @ k.transpose(-1, -2)) * c  # [1, H, S, S]
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    if centred:
        mean = k.mean(-2, keepdim=True)  # [1, H, 1, D]
        bound = c * ((q * mean).sum(-1) + q.norm(dim=-1) * (k - mean).norm(dim=-1).amax(-1, keepdim=True))
    else:
        bound = c * q.norm(dim=-1) * k.norm(dim=-1).amax(-1, keepdim=True)
    offsets = scores[..., :tile_keys].amax(-1)  # the first key tile's largest score per row
    gap = bound - offsets  # [1, H, S]
    tiles = gap.unflatten(-1, (-1, 64)).amax(-1)  # [1, H, S / 64]: a consumer's 64 rows decide together
    rise = (scores.amax(-1) - offsets).amax().item()
    return (tiles <= bounds.FIXED_HEADROOM[torch.bfloat16]).float().mean().item(), gap.median().item(), rise


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tile-keys", type=int, default=256)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"D={args.dim} H={args.heads} S={args.seq}, first tile {args.tile_keys} keys"
          f"{', causal' if args.causal else ''}; bf16 headroom {bounds.FIXED_HEADROOM[torch.bfloat16]:g}")
    print("| inputs | tiles kept (bound as taken) | median gap | tiles kept (keys centred) | median gap "
          "| largest rise |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (q, k) in distributions(args.heads, args.seq, args.dim, gen).items():
        plain = share_kept(q, k, args.tile_keys, args.causal, centred=False)
        centred = share_kept(q, k, args.tile_keys, args.causal, centred=True)
        print(f"| {name} | {plain[0]:.2f} | {plain[1]:.1f} | {centred[0]:.2f} | {centred[1]:.1f} | {plain[2]:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
