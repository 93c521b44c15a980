"""Short sequences with and without descriptor (TMA) loads: host time per call (enqueue 100 calls, no waiting)
and do_bench time, forward and forward+backward, B8 H16 S1024..4096, twice each to show the spread.

    python benchmarks/exp_short_tma.py
"""

import triton.testing

from blockattn.kernels import tma
from exp_short import host_ms, short_case


def main():
    for seq in (1024, 2048, 4096):
        fwd, fwd_bwd = short_case(8, 16, seq, 0.5)
        for _ in range(2):
            for tma_loads in (True, False):
                tma.TMA_LOADS = tma_loads
                cells = []
                for fn in (fwd, fwd_bwd):
                    fn()  # compile and tune outside the timing
                    device_ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    cells.append(f"host {host_ms(fn):.3f} do_bench {device_ms:.3f}")
                print(f"S{seq} tma={tma_loads} fwd: {cells[0]} | fwd+bwd: {cells[1]}", flush=True)
        tma.TMA_LOADS = True


if __name__ == "__main__":
    main()
