"""Times the tenth session's new paths on a GPU (written before any GPU run; --small checks it on the CPU).

1. A packed ("thd") batch, forward+backward, with and without max_seqlen_q / max_seqlen_kv: without them every call
   reads the offsets back (a synchronization); eager time per step and host time to enqueue it.
2. Video sparse attention (blockattn.video) at a Wan-like latent, forward and forward+backward, against its own
   fine branch alone (attention() on the selected tiles) and dense SDPA over the same (padded) tile-ordered slots.

    python benchmarks/new_paths.py                 # on the GPU
    python benchmarks/new_paths.py --small         # a CPU smoke run (PyTorch backend)
"""

import argparse
import math
import time

import torch

import blockattn
from blockattn.video import TileLayout, video_sparse_attention


def timed(step, device, repeats: int) -> tuple[float, float]:
    """(ms per step, host ms to enqueue one): mean over repeats after one warm-up."""
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    host = 0.0
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        host += time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3, host / repeats * 1e3


def packed(device, dtype, small: bool, repeats: int):
    lengths = [96, 40, 130, 64] if small else [2048, 1536, 4096, 512, 3072, 2048, 1024, 2048]
    heads, dim, block = (2, 32, (32, 32)) if small else (16, 128, (128, 128))
    total = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(total, heads, dim, device=device, dtype=dtype, generator=gen).requires_grad_(True)
               for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    longest = max(lengths)
    n = math.ceil(longest / block[0])
    keep = torch.rand(len(lengths), heads, n, n, device=device, generator=gen) < 0.5
    blocks = blockattn.BlockSparsity.from_mask(keep, block, longest, longest)
    print(f"packed: {len(lengths)} sequences, {total} tokens, H{heads} D{dim} {dtype}, block {block}, d=0.5 causal")
    for given in (False, True):
        extra = dict(max_seqlen_q=longest, max_seqlen_kv=longest) if given else {}

        def step():
            out = blockattn.attention(q, k, v, blocks, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                      is_causal=True, **extra)
            torch.autograd.grad(out.sum(), (q, k, v))
        ms, host = timed(step, device, repeats)
        print(f"  longest lengths {'given' if given else 'read back'}: fwd+bwd {ms:.3f} ms/step, host {host:.3f} ms")


def video(device, dtype, small: bool, repeats: int):
    grid, tile = ((3, 5, 6), (2, 4, 4)) if small else ((21, 45, 80), (4, 8, 8))
    heads, dim = (2, 32) if small else (12, 128)
    layout = TileLayout(grid, tile, device=device)
    topk = max(1, layout.num_tiles // 10)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (layout.to_tiles(torch.randn(1, heads, math.prod(grid), dim, device=device, dtype=dtype,
                                           generator=gen)).requires_grad_(True) for _ in range(3))
    gate = torch.rand(q.shape, device=device, dtype=dtype, generator=gen)
    kwargs = dict(q_valid=layout.valid, kv_valid=layout.valid, gate=gate)
    _, blocks = video_sparse_attention(q, k, v, topk, tile, return_blocks=True, **kwargs)
    print(f"video: grid {grid}, tile {tile} ({layout.tile_tokens} tokens, {layout.num_tiles} tiles, "
          f"{layout.seq} slots), H{heads} D{dim} {dtype}, top-{topk} tiles (density {topk / layout.num_tiles:.3f})")
    runs = {
        "video_sparse_attention": lambda: video_sparse_attention(q, k, v, topk, tile, **kwargs),
        "fine branch alone": lambda: blockattn.attention(q, k, v, blocks, kv_valid=layout.valid[None]),
        "dense SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
    }
    for name, call in runs.items():
        with torch.no_grad():
            fwd, _ = timed(call, device, repeats)
        both, _ = timed(lambda: torch.autograd.grad(call().sum(), (q, k, v)), device, repeats)
        print(f"  {name}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU (PyTorch backend)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    dtype = torch.float32 if args.small else torch.bfloat16
    packed(device, dtype, args.small, args.repeats)
    video(device, dtype, args.small, args.repeats)


if __name__ == "__main__":
    main()
