"""How much of the warp-specialized backward's grid is tail: a simulation of the hardware's scheduling, on the CPU.

Each program of the backward (one 128-key tile of one batch and kv head) walks the q lists of its key block for
the query heads it serves; its time is taken as its step count (64 query rows a step) plus a fixed overhead in
steps. Programs start in launch order (tile fastest, then batch and kv head) on the first of 132 multiprocessors to
come free, one at a time (a backward program fills a multiprocessor's shared memory). The table gives the makespan
over the ideal (total work / 132) for the launch order, for each (batch, kv head)'s tiles sorted longest first, and
for all programs sorted longest first. A model only: it ignores L2 (programs of one kv head running together share
its Q, dO and dQ rows in L2, which a global sort would break up) and the clock.

    python benchmarks/tail_sim.py [--overhead 5]
"""

import argparse
import heapq

import torch

from blockattn.bench import Case, block_mask

CASES = [Case(density=0.1), Case(heads=32, kv_heads=32, seq=16384, density=0.1),
         Case(heads=32, kv_heads=8, seq=16384, density=0.1), Case(heads=32, kv_heads=8, seq=16384, density=0.5),
         Case(batch=8, heads=16, kv_heads=16, seq=2048, density=0.5),
         Case(batch=8, heads=16, kv_heads=16, seq=4096, density=0.5)]
MULTIPROCESSORS = 132


def makespan(lengths: list, overhead: float) -> float:
    """When the last program ends, programs of the given lengths starting in order on the first free unit."""
    free = [0.0] * MULTIPROCESSORS
    for length in lengths:
        heapq.heappush(free, heapq.heappop(free) + length + overhead)
    return max(free)


def program_steps(case: Case) -> torch.Tensor:
    """float [B, Hkv, Sk / 128]: each program's steps (query blocks of 128 rows: 2 steps each)."""
    keep = block_mask(case, torch.device("cpu"))
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    keep = keep.expand(case.batch, case.heads, *keep.shape[-2:])
    per_head = keep.sum(-2) * (case.block[0] // 64)   # [B, H, nk] (block_kv = 128: one tile a key block)
    return per_head.view(case.batch, case.kv_heads, case.heads // case.kv_heads, -1).sum(2).float()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overhead", type=float, default=0.0, help="fixed cost of a program, in steps")
    args = parser.parse_args()
    print("| case | programs | mean steps | launch order | each kv head's tiles longest first | all longest first |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in CASES:
        steps = program_steps(case)
        launch = steps.reshape(-1).tolist()
        per_head = steps.reshape(-1, steps.shape[-1]).sort(-1, descending=True).values.reshape(-1).tolist()
        ideal = (sum(launch) + args.overhead * len(launch)) / MULTIPROCESSORS
        cells = [f"+{makespan(order, args.overhead) / ideal - 1:.1%}"
                 for order in (launch, per_head, sorted(launch, reverse=True))]
        print(f"| {case.label} | {len(launch)} | {sum(launch) / len(launch):.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
