"""Causal attention with and without the split walks (forward.SPLIT_WALKS): the blocks off the diagonal run
without element tests, or every block runs the tested loop. FlexAttention (full/partial blocks) and SDPA
(is_causal) in the same process.

    python benchmarks/split_walks.py --out causal
"""

import argparse
from dataclasses import replace

import torch

from blockattn.bench import Case, bench_case, markdown
from blockattn.kernels import forward


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for case in (Case(pattern="causal", density=0.5), Case(batch=8, heads=16, kv_heads=16, seq=4096,
                                                            pattern="causal", density=0.5)):
        rows += bench_case(case, device)
        forward.SPLIT_WALKS = False
        rows += [replace(row, impl="blockattn, tested walk")
                 for row in bench_case(case, device, impls=("blockattn",))]
        forward.SPLIT_WALKS = True
    table = markdown(rows)
    print(table)
    if args.out:
        with open(f"{args.out}.md", "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
