"""What walking the full tiles untested (FULL_TILES_FIRST, kernels/README.md) saves, case by case: each case timed
with the package as it is and with every listed tile tested (the flag forced off), in one process.

Cases:
  video     blockattn.video at a Wan-like latent (grid 21x45x80, tile 4x8x8: 256-token tiles, 31% of them padded),
            top 10% of tiles: video_sparse_attention, and its fine branch alone (attention() with kv_valid), also
            with kv_valid's lists over key tiles of 128 and 256 keys (the package's: 64);
  kv_valid  the design shape (B1 H24 S32768 D128, 128x128 blocks, d=0.25) with kv_valid marking 90% of the key
            blocks whole and the rest half real, against the same mask without kv_valid (and key tiles of 128);
  video64   the same with FastVideo's default tile 4x4x4 (64-token blocks: no key tile to drop);
  8x128     torch_npu's 8x128 blocks (B1 H16 S16384, d=0.25), where about 1% of the tiles are full;
  lists     the GPU time of building kv_valid's lists for one call at the design shape.

    python benchmarks/full_first.py [--cases video,video64,kv_valid,8x128,lists] [--widths 128,256]
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
import triton

import blockattn
from blockattn import api, bench
from blockattn.kernels import forward, launch, ops
from blockattn.video import TileLayout, video_sparse_attention


@contextlib.contextmanager
def all_tiles_tested():
    """FULL_TILES_FIRST off: the launchers and blockattn.api both ask forward.full_tiles_first (api through
    kernels.ops), so replacing it in both keeps lists and flag in step; launch plans are dropped on the way in and
    out, since their keys do not hold the flag."""
    saved = forward.full_tiles_first

    def never(*args):
        return False

    launch._PLANS.clear()
    forward.full_tiles_first = ops.full_tiles_first = never
    try:
        yield
    finally:
        forward.full_tiles_first = ops.full_tiles_first = saved
        launch._PLANS.clear()


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def fwd_and_bwd(call, leaves) -> tuple[float, float]:
    """(forward ms, backward ms = forward+backward - forward) of call()."""
    with torch.no_grad():
        fwd = time_ms(call)
    both = time_ms(lambda: torch.autograd.grad(call().float().sum(), leaves))
    return fwd, both - fwd


def report(name: str, runs: dict) -> None:
    """runs: label -> (fwd, bwd) ms, the first one with full tiles first."""
    (base_label, (f0, b0)), *others = runs.items()
    print(f"{name}: {base_label}: fwd {f0:.3f} ms, bwd {b0:.3f} ms", flush=True)
    for label, (fwd, bwd) in others:
        print(f"{name}: {label}: fwd {fwd:.3f} ms ({fwd / f0:.2f}x), bwd {bwd:.3f} ms ({bwd / b0:.2f}x)", flush=True)


@contextlib.contextmanager
def kv_valid_tiles(width: int):
    """kv_valid's lists over key tiles of at most width keys (api.KV_VALID_TILE_KV) instead of the package's."""
    saved = api.KV_VALID_TILE_KV
    launch._PLANS.clear()
    api.KV_VALID_TILE_KV = width
    try:
        yield
    finally:
        api.KV_VALID_TILE_KV = saved
        launch._PLANS.clear()


def both_ways(call, leaves, widths=()) -> dict:
    """Full tiles first and every tile tested; widths: also kv_valid's lists over key tiles of these widths."""
    out = {"full tiles first": fwd_and_bwd(call, leaves)}
    with all_tiles_tested():
        out["every tile tested"] = fwd_and_bwd(call, leaves)
    for width in widths:
        with kv_valid_tiles(width):
            out[f"key tiles of {width}"] = fwd_and_bwd(call, leaves)
    return out


WIDTHS = (128, 256)  # --widths


def video_case(device, tile=(4, 8, 8)):
    grid, heads, dim = (21, 45, 80), 12, 128
    layout = TileLayout(grid, tile, device=device)
    topk = max(1, layout.num_tiles // 10)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (layout.to_tiles(torch.randn(1, heads, math.prod(grid), dim, device=device, dtype=torch.bfloat16,
                                           generator=gen)).requires_grad_(True) for _ in range(3))
    kwargs = dict(q_valid=layout.valid, kv_valid=layout.valid)
    _, blocks = video_sparse_attention(q, k, v, topk, tile, return_blocks=True, **kwargs)
    whole = (layout.valid == layout.tile_tokens).float().mean().item()
    print(f"video: grid {grid}, tile {tile}, {layout.num_tiles} tiles ({whole:.2f} whole), H{heads} D{dim}, "
          f"top-{topk}")
    widths = WIDTHS if layout.tile_tokens > 128 else ()
    report("video_sparse_attention", both_ways(lambda: video_sparse_attention(q, k, v, topk, tile, **kwargs),
                                               (q, k, v), widths=widths))
    report("video fine branch", both_ways(lambda: blockattn.attention(q, k, v, blocks, kv_valid=layout.valid),
                                          (q, k, v), widths=widths))


def kv_valid_case(device):
    case = bench.Case(heads=24, kv_heads=24, seq=32768, block=(128, 128), density=0.25)
    keep = bench.block_mask(case, device)
    blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(1, case.heads, case.seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
               .requires_grad_(True) for _ in range(3))
    nk = blocks.num_blocks[1]
    half = torch.rand(nk, device=device, generator=gen) < 0.1
    kv_valid = torch.where(half, 64, 128).to(torch.int32)
    runs = both_ways(lambda: blockattn.attention(q, k, v, blocks, kv_valid=kv_valid), (q, k, v), widths=(128,))
    runs["no kv_valid"] = fwd_and_bwd(lambda: blockattn.attention(q, k, v, blocks), (q, k, v))
    report(f"kv_valid {case.label}", runs)


def narrow_case(device):
    case = bench.Case(heads=16, kv_heads=16, seq=16384, block=(8, 128), density=0.25)
    blocks = blockattn.BlockSparsity.from_mask(bench.block_mask(case, device), case.block, case.seq, case.seq)
    gen = torch.Generator(device=device).manual_seed(3)
    q, k, v = (torch.randn(1, case.heads, case.seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
               .requires_grad_(True) for _ in range(3))
    report(f"8x128 {case.label}", both_ways(lambda: blockattn.attention(q, k, v, blocks), (q, k, v)))


def list_cost(device):
    """Time of building kv_valid's lists for one call (api._kernel_inputs with q lists), which kv_valid's calls pay
    each time, at the design shape: do_bench's median, in ms."""
    case = bench.Case(heads=24, kv_heads=24, seq=32768, block=(128, 128), density=0.25)
    blocks = blockattn.BlockSparsity.from_mask(bench.block_mask(case, device), case.block, case.seq, case.seq)
    kv_valid = torch.full((1, blocks.num_blocks[1]), 128, dtype=torch.int32, device=device)
    kv_valid[0, -3:] = 64

    def build():
        lists, _ = api._kernel_inputs(blocks, False, 16, None, kv_valid, None)
        return lists.q_lists()
    print(f"kv_valid's lists at {case.label}: {time_ms(build):.3f} ms per call (do_bench)", flush=True)


CASES = {"video": video_case, "video64": lambda device: video_case(device, (4, 4, 4)), "kv_valid": kv_valid_case,
         "8x128": narrow_case, "lists": list_cost}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--widths", default="128,256", help="kv_valid key-tile widths the video case also times")
    args = parser.parse_args()
    global WIDTHS
    WIDTHS = tuple(int(w) for w in args.widths.split(",") if w)
    print(bench.environment())
    for name in args.cases.split(","):
        CASES[name](torch.device("cuda"))


if __name__ == "__main__":
    main()
