"""Causal attention with and without the split walks (forward.SPLIT_WALKS): the blocks off the diagonal run
without element tests, or every block runs the tested loop. FlexAttention (full/partial blocks) and SDPA
(is_causal) in the same process.

    python benchmarks/split_walks.py --out causal
"""

import argparse

import torch

from blockattn.bench import Case, Row, _flops, _inputs, _runners, _time_ms, bench_case, block_mask, markdown
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
        fn, density = _runners(case, block_mask(case, device), device)["blockattn"]
        q, k, v = _inputs(case, device, requires_grad=True)
        grad = torch.randn_like(q)
        with torch.no_grad():
            fwd = _time_ms(lambda: fn(q, k, v))
        both = _time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad))
        flops = _flops(case, density)
        for mode, ms, work in (("fwd", fwd, 1.0), ("fwd+bwd", both, 3.5), ("bwd", both - fwd, 2.5)):
            rows.append(Row(case.label, "blockattn, tested walk", mode, density, ms, work * flops / ms / 1e9))
        forward.SPLIT_WALKS = True
    table = markdown(rows)
    print(table)
    if args.out:
        with open(f"{args.out}.md", "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
