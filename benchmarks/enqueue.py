"""Host enqueue time of an eager B8 H16 S1024 D128 forward, and forward+backward (d=0.5, 128x128 blocks), for
whichever blockattn PYTHONPATH selects: the fastest of 7 rounds of calls back to back, without waiting for the GPU.
Run alternately on two trees to compare their host cost, since this host's noise between processes is large:

    mkdir -p /tmp/old && git archive HEAD~1 blockattn | tar -x -C /tmp/old
    for r in 1 2 3; do PYTHONPATH=/tmp/old python benchmarks/enqueue.py before; \\
        PYTHONPATH=$PWD python benchmarks/enqueue.py after; done
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exp_short import short_case  # noqa: E402
from host_cost import per_call_us  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label", nargs="?", default="blockattn")
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    fwd, fwd_bwd = short_case(8, 16, args.seq, 0.5)
    for _ in range(10):
        fwd()
        fwd_bwd()
    forward, both = per_call_us(fwd, 200), per_call_us(fwd_bwd, 100)
    print(f"{args.label}: forward {forward:.1f} us, forward+backward {both:.1f} us a call (host enqueue, fastest "
          "of 7)", flush=True)


if __name__ == "__main__":
    main()
