"""Experiment: the warp-specialized backward with dQ lagged a step and a staggered start (backward_ws.LAGGED_DQ: each
step computes the previous step's dQ, so the two consumer warpgroups need not meet within a step, and the second
starts once the first has its first scores) against the consumers meeting at every step's dS, for MHA and GQA
calls alike (GQA lags too from the twenty-first session on). Times each variant's backward (ms, effective TFLOP/s at
5 products) in two interleaved rounds (the faster of the two medians) and its largest relative gap to the Triton
backward's gradients. (The twentieth session ran earlier versions with the staggered start as a flag of its own and
with FA3-style turns: benchmarks/results-2026-12-02-h200-session20.md.)

    python benchmarks/exp_bwd_lag.py [--cases design gqa causal]
    python benchmarks/exp_bwd_lag.py --flag STAGES --values 2 3   # another of backward_ws's launch constants
    python benchmarks/exp_bwd_lag.py --cases paired --flag PAIRED_MHA_STAGES,PAIRED_STAGES --values "(3, 3)" "(2, 2)"
    # the paired programs' common steps (twenty-eighth session): none, dQ summed over both tiles, each its own dQ
    python benchmarks/exp_bwd_lag.py --cases paired paired_more paired_causal \
        --flag PAIRED_COMMON_FIRST,PAIRED_SUMMED_DQ --values "(False, False)" "(True, True)" "(True, False)"
    # with benchmarks/patches/paired-lagged-dq.patch applied to commit e917f70 (dQ lagged in paired programs;
    # dropped, slower):
    python benchmarks/exp_bwd_lag.py --cases paired paired_more --flag PAIRED_LAGGED_DQ,PAIRED_STAGES \
        --values "(False, 3)" "(True, 3)" "(True, 2)"
    python benchmarks/exp_bwd_lag.py --flag STAGES,LAGGED_DQ --values "(2, True)" "(3, False)"  # a tuple a variant
"""

import argparse
import ast
import torch

import blockattn
from blockattn.bench import Case, _flops, _inputs, _time_ms, block_mask
from blockattn.kernels import backward_ws

CASES = {
    "design": [Case(density=d) for d in (1.0, 0.5, 0.25, 0.1)],
    "gqa": [Case(heads=32, kv_heads=8, seq=16384, density=d) for d in (0.5, 0.1)],
    "causal": [Case(pattern="causal", density=0.5)],
    "short": [Case(batch=8, heads=16, kv_heads=16, seq=s, density=0.5) for s in (2048, 4096)]
    + [Case(batch=8, heads=16, kv_heads=16, seq=4096, pattern="causal", density=0.5)],
    # head dim 64: a ring stage is half as large, so STAGES 3 and 4 fit too
    "d64": [Case(dim=64, density=d) for d in (0.5, 0.1)] + [Case(dim=64, heads=32, kv_heads=8, seq=16384, density=0.25),
                                                             Case(dim=64, batch=8, heads=16, kv_heads=16, seq=4096,
                                                                  density=0.5)],
    # 128x64 blocks: paired programs
    "paired": [Case(block=(128, 64), density=d) for d in (0.5, 0.1)] + [
        Case(block=(128, 64), heads=32, kv_heads=8, seq=16384, density=0.25)],
    # 128x64 blocks: the paired programs' other cases (density 0.25, head dim 64, causal)
    "paired_more": [Case(block=(128, 64), density=0.25), Case(block=(128, 64), dim=64, density=0.25),
                    Case(block=(128, 64), pattern="causal", density=0.5)],
    # 128x64 blocks, GQA 32/8 and MHA 32 on the same query heads (target 4, per FLOP): the paired programs' merged
    # walks over the group (merge_group_lists) and the group split in parts (KV_SPLIT)
    "paired_gqa": [Case(block=(128, 64), heads=32, kv_heads=h, seq=16384, density=d)
                   for d in (0.5, 0.1) for h in (8, 32)],
    # 128x64 blocks, causal at head dim 64 and with GQA: every step of a paired program common to its two tiles
    "paired_causal": [Case(block=(128, 64), dim=64, pattern="causal", density=0.5),
                      Case(block=(128, 64), heads=32, kv_heads=8, seq=16384, pattern="causal", density=0.5)],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["design", "gqa", "causal"], choices=list(CASES))
    parser.add_argument("--flag", default="LAGGED_DQ",
                        help="the backward_ws constant to vary (each is part of the launch's plan key): LAGGED_DQ, "
                        "STAGES, ORDERED, PAIRED_STAGES (GQA), PAIRED_MHA_STAGES, PAIRED_COMMON_FIRST, "
                        "PAIRED_SUMMED_DQ; several joined by commas")
    parser.add_argument("--values", nargs="+", default=["False", "True"],
                        help="its values (Python literals; a tuple a variant for several constants)")
    args = parser.parse_args()
    device = torch.device("cuda")
    flags, variants = args.flag.split(","), [ast.literal_eval(v) for v in args.values]
    defaults = [getattr(backward_ws, flag) for flag in flags]

    def set_flags(values):
        for flag, value in zip(flags, values if len(flags) > 1 else (values, )):
            setattr(backward_ws, flag, value)
    print("| case | Triton backward | " + " | ".join(f"{args.flag}={value}" for value in variants) + " |")
    print("| --- | --- |" + " --- |" * len(variants))
    for case in [c for name in args.cases for c in CASES[name]]:
        keep = block_mask(case, device)
        blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=True)
        grad = torch.randn_like(q)
        flops = 2.5 * _flops(case, blocks.density())
        out = blockattn.attention(q, k, v, blocks, is_causal=case.pattern == "causal")

        def backward():
            return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        backward_ws.ENABLED = False
        reference = [g.float() for g in backward()]
        triton_ms = _time_ms(backward)
        backward_ws.ENABLED = True
        gaps, times = {}, {variant: [] for variant in variants}
        for round_ in range(2):
            for variant in variants:
                set_flags(variant)
                if round_ == 0:
                    gaps[variant] = max(((a.float() - b).norm() / b.norm()).item()
                                        for a, b in zip(backward(), reference))
                times[variant].append(_time_ms(backward))
        set_flags(defaults if len(flags) > 1 else defaults[0])
        cells = [f"{min(times[v]):.3f} ({flops / min(times[v]) / 1e9:.0f}; gap {gaps[v]:.1e})" for v in variants]
        print(f"| {case.label} | {triton_ms:.3f} ({flops / triton_ms / 1e9:.0f}) | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()
