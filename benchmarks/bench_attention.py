"""One run: blockattn vs FlexAttention (compiled, same block mask) vs dense SDPA (cuDNN, flash), forward and
forward+backward. Writes <out>.md/.json/.png; BENCHMARKS.md records the results.

    python benchmarks/bench_attention.py --suite design --out bench-design
    python benchmarks/bench_attention.py --suite targets --out bench-targets
    python benchmarks/bench_attention.py --suite causal --out bench-causal
"""

import argparse

from blockattn.bench import Case, run

DENSITIES = (1.0, 0.5, 0.25, 0.1)


def design_suite():
    """DESIGN.md's table: B1 H24 S32768 D128 bf16, blocks 128x128 and 128x64, densities 1 .. 0.1."""
    return [Case(block=block, density=d) for block in ((128, 128), (128, 64)) for d in DENSITIES]


def target_suite():
    """The speed issue's other targets: D=64 and D=256, short sequences at B=8, GQA 32/8, a skewed mask."""
    cases = [Case(dim=64, density=d) for d in (0.5, 0.25, 0.1)]
    cases += [Case(dim=256, heads=16, kv_heads=16, seq=16384, density=d) for d in (0.5, 0.1)]
    cases += [Case(batch=8, heads=16, kv_heads=16, seq=s, density=0.5) for s in (1024, 2048, 4096)]
    cases += [Case(heads=32, kv_heads=8, seq=16384, density=d) for d in (0.5, 0.1)]
    cases += [Case(heads=32, kv_heads=32, seq=16384, density=d) for d in (0.5, 0.1)]
    cases += [Case(density=0.25, pattern="skewed")]
    return cases


def causal_suite():
    """Causal attention (long-context language models): the block-causal mask run with is_causal, against
    FlexAttention with its full/partial block split and SDPA with is_causal, at S=32k and a batch of short ones."""
    return [Case(pattern="causal", density=0.5), Case(batch=8, heads=16, kv_heads=16, seq=4096, pattern="causal",
                                                      density=0.5)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("design", "targets", "causal", "all"), default="design")
    parser.add_argument("--out", default="bench")
    parser.add_argument("--forward-only", action="store_true")
    args = parser.parse_args()
    cases = {"design": design_suite, "targets": target_suite, "causal": causal_suite,
             "all": lambda: design_suite() + target_suite() + causal_suite()}[args.suite]()
    run(cases, backward=not args.forward_only, out_prefix=args.out)


if __name__ == "__main__":
    main()
