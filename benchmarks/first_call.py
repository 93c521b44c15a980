"""Time to the first result in a fresh process: one forward + backward at B1 H24 D128 bf16, 128x128 blocks, timed
from the first call (compilation, tile benchmarking, launch) to the synchronized result, then a second call. Run it
several times on one machine: later runs find the compiled kernels in Triton's cache and, unless
--no-disk-cache, the tile choices blockattn stored there (autotune.DISK_CACHE), so they skip the benchmarking.

    python benchmarks/first_call.py [--seq 32768] [--density 0.25] [--no-disk-cache]
"""

import argparse
import time

import torch

import blockattn
from blockattn.kernels import autotune

from exp_short import short_inputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--no-disk-cache", action="store_true")
    args = parser.parse_args()
    autotune.DISK_CACHE = not args.no_disk_cache
    q, k, v, blocks, grad = short_inputs(1, 24, args.seq, args.density)
    for call in ("first", "second"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), grad)
        torch.cuda.synchronize()
        print(f"S{args.seq} d={args.density} disk cache={autotune.DISK_CACHE}: {call} call "
              f"{time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
