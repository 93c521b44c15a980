"""A short cross-section of the design and target cases (one device call's worth), against FlexAttention.

    python benchmarks/quick_cases.py --out quick
"""

import argparse

from blockattn.bench import Case, run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="quick")
    args = parser.parse_args()
    cases = [Case(block=(128, 128), density=d) for d in (1.0, 0.25)]
    cases += [Case(block=(128, 64), density=0.25), Case(dim=64, density=0.25)]
    cases += [Case(batch=8, heads=16, kv_heads=16, seq=s, density=0.5) for s in (1024, 2048)]
    cases += [Case(heads=32, kv_heads=8, seq=16384, density=0.1)]
    run(cases, out_prefix=args.out)


if __name__ == "__main__":
    main()
