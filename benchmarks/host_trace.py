"""Where an eager short forward+backward spends its host time, blockattn against compiled FlexAttention
(B8 H16 S1024 D128, d=0.5, 128x128 blocks): torch.profiler's CPU events on every thread (autograd runs a CUDA
backward on its own device thread), each implementation's table of self CPU time per op, the CUDA runtime calls
among them (launches, allocations), and a Chrome trace per implementation under --out.

    python benchmarks/host_trace.py --out traces
"""

import argparse
import os

import torch

from exp_short import host_ms, short_case
from short_host import flex_case


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default="traces")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    impls = {"blockattn": short_case(8, 16, args.seq, 0.5)[1], "flex": flex_case(8, 16, args.seq, 0.5)[1]}
    for name, fwd_bwd in impls.items():
        for _ in range(20):
            fwd_bwd()
        torch.cuda.synchronize()
        print(f"{name}: host enqueue {host_ms(fwd_bwd):.3f} ms a forward+backward", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                fwd_bwd()
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(args.out, f"{name}.json"))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70),
              flush=True)


if __name__ == "__main__":
    main()
