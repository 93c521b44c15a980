"""The warp-specialized forward's grid tail, a program a query tile against the persistent grid: a simulation on the
CPU, beside tail_sim.py's of the backward.

A work item (a 128-row query tile of one head) takes its kv list's length in 128-key blocks plus a fixed overhead.
A program a tile: the hardware starts the items in launch order (tile fastest, the last tiles first under is_causal)
on the first of 132 multiprocessors to come free (tail_sim.makespan). The persistent grid (forward_ws.PERSISTENT_DIMS):
132 programs take the items at positions p, p + 132, ... of an order in turn, so a program's share is fixed before
it starts: in launch order, or longest list first by powers of two (forward_ws.query_tile_order); or
(forward_ws.CLAIMED_DIMS) each program claims the next item of that order as it frees up, as the hardware hands out
a program a tile. The table gives each makespan over the ideal (total work / 132). A model only: no L2 (which made
a strict sort by length lose under is_causal: it ran a tile position across every head at once), no clock, and no
gain from the persistent grid's overlap of one item's end with the next one's start (the reason it exists).

    python benchmarks/persistent_sim.py [--overhead 1]
"""

import argparse
import math

import torch

from blockattn.bench import Case, block_mask
from tail_sim import MULTIPROCESSORS, makespan

CASES = [Case(density=0.25, pattern="skewed"), Case(density=0.25), Case(density=0.1),
         Case(dim=64, density=0.1, block=(128, 64)), Case(pattern="causal", density=0.5),
         Case(batch=8, heads=16, kv_heads=16, seq=4096, pattern="causal", density=0.5),
         Case(batch=8, heads=16, kv_heads=16, seq=2048, density=0.5)]


def item_lengths(case: Case) -> list:
    """Each work item's kv list in 128-key blocks, in launch order (the last tiles first under is_causal)."""
    keep = block_mask(case, torch.device("cpu"))
    keep = keep.expand(case.batch, case.heads, *keep.shape[-2:])
    lengths = keep.sum(-1).float() * case.block[1] / 128  # [B, H, nq]; 128-row blocks: an item a block
    if case.pattern == "causal":
        lengths = lengths.flip(-1)
    return lengths.reshape(-1).tolist()


def fixed_turns(lengths: list, overhead: float) -> float:
    """When the last program ends, each of MULTIPROCESSORS programs taking the items at positions p, p + programs,
    ... in turn."""
    load = [0.0] * MULTIPROCESSORS
    for position, length in enumerate(lengths):
        load[position % MULTIPROCESSORS] += length + overhead
    return max(load)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overhead", type=float, default=1.0, help="fixed cost of an item, in 128-key blocks")
    args = parser.parse_args()
    print("| case | items | a program a tile | persistent, launch order | persistent, longest first "
          "| persistent, longest first claimed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in CASES:
        lengths = item_lengths(case)
        # longest first by powers of two, launch order within each: the stable sort query_tile_order makes
        longest = [lengths[i] for i in sorted(range(len(lengths)), key=lambda i: -math.floor(math.log2(lengths[i]))
                                              if lengths[i] > 0 else 1)]
        ideal = (sum(lengths) + args.overhead * len(lengths)) / MULTIPROCESSORS
        cells = [f"+{span / ideal - 1:.1%}" for span in (makespan(lengths, args.overhead),
                                                          fixed_turns(lengths, args.overhead),
                                                          fixed_turns(longest, args.overhead),
                                                          makespan(longest, args.overhead))]
        print(f"| {case.label} | {len(lengths)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
