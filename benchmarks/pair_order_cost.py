"""What matching the paired backward's tiles by shared query blocks costs where a mask's lists are new (the order is
kept per lists tensor after that): backward_ws.paired_tile_order against tile_order, host time to return and time
until the GPU is done, on random masks of 64-key tiles; and the matching replayed from a CUDA graph
(kernels/replay.py, as the backward runs it on new lists).

    python benchmarks/pair_order_cost.py
"""

import time

import torch

from blockattn.kernels import backward_ws, replay
from blockattn.sparsity import build_lists

# (heads, kv heads, query blocks, 64-key tiles, density): B1 H24 S32k and S128k at 128x64, GQA 32/8 S16k
SHAPES = [(24, 24, 256, 512, 0.1), (32, 8, 128, 256, 0.25), (24, 24, 1024, 2048, 0.1)]


def main():
    device = torch.device("cuda")
    for heads, kv_heads, nq, tiles, density in SHAPES:
        keep = torch.rand(1, heads, nq, tiles, device=device) < density
        q_count, q_index = build_lists(keep.transpose(-1, -2))
        def matching(counts, index):
            return backward_ws.paired_tile_order(counts, index, kv_heads, 1)
        ways = {"tile_order": lambda: backward_ws.tile_order(q_count, kv_heads, 1),
                "paired_tile_order": lambda: matching(q_count, q_index),
                "paired_tile_order replayed": lambda: replay.run(matching, (q_count, q_index), ("bench", kv_heads))}
        for name, way in ways.items():
            way()
            torch.cuda.synchronize()
            start = time.perf_counter()
            way()
            host = time.perf_counter() - start
            torch.cuda.synchronize()
            done = time.perf_counter() - start
            print(f"H{heads}/{kv_heads}, {nq} query blocks, {tiles} tiles, d={density}: {name} host "
                  f"{host * 1e3:.2f} ms, done {done * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
