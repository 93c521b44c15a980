"""Short-sequence forward+backward: do_bench time (eager and CUDA-graph replay), host enqueue time per call, and
a cProfile table of the host's own time, for blockattn on B8 H16 S1024 D128 (d=0.5, 128x128 blocks).

    python benchmarks/short_host.py --seq 1024
"""

import argparse

import triton.testing

from exp_short import host_ms, print_profile, short_case
from short_graphs import graphed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    fwd, fwd_bwd = short_case(8, 16, args.seq, 0.5)
    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        replay = triton.testing.do_bench(graphed(fn), warmup=25, rep=100, return_mode="median")
        print(f"S{args.seq} {name}: do_bench eager {eager:.3f} ms, replay {replay:.3f} ms, host enqueue "
              f"{host_ms(fn):.3f} ms/call", flush=True)
    print_profile(fwd_bwd, 100, rows=30)


if __name__ == "__main__":
    main()
