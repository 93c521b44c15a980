"""blockattn's forward and FlexAttention's on one mask, timed in alternating rounds while the SM clock and board
power are sampled: whether the rounds' spread (the D=64 forward's d=0.5 medians move 5.9-6.6 ms between rounds of
one process) follows the clock, and what each implementation does per clock cycle.

    python benchmarks/clock_rounds.py --dim 64 --density 0.5 0.1 --rounds 6

Each round times each implementation with bench._time_ms (do_bench, the L2 flushed before each call), then 40
calls back to back with a CUDA event pair each (no flush), whose spread tells a slow round from slow calls within
a round. The clock and power are nvidia-smi's, sampled every 20 ms (clocks.Sampler); a round's figures are the
medians of the samples taken while it ran. "Mcycles" is ms x MHz / 1000: the call's length in SM clock cycles, as
near as a clock that moves within a round allows. nvidia-smi's power reading is an average over about a second, so it
lags the rounds (121 W in a first round that began with the GPU idle).

Sixty-seventh session (H100, D=64 d=0.5): blockattn 5.94 ms at 1980 MHz in the first round, before the GPU reached its
700 W limit, then 6.76 / 6.40 ms at 1605 / 1455 MHz; FlexAttention 8.16-8.30 ms at 1785-1980 MHz: 1.37x, then
1.23x / 1.29x (BENCHMARKS.md).
"""

import argparse
import statistics
import time

import torch

from blockattn.bench import Case, _inputs, _runners, _time_ms, block_mask

from clocks import Sampler


def back_to_back_ms(fn, calls: int = 40) -> list[float]:
    """Each of `calls` calls' time by a CUDA event pair, the calls issued back to back."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--density", type=float, nargs="+", default=[0.5, 0.1])
    parser.add_argument("--block", type=int, nargs=2, default=[128, 128])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    device = torch.device("cuda")
    sampler = Sampler()
    try:
        for density in args.density:
            case = Case(dim=args.dim, density=density, block=tuple(args.block))
            q, k, v = _inputs(case, device, requires_grad=False)
            runners = _runners(case, block_mask(case, device), device)
            print(f"\n== {case.label}\n| round | impl | ms (do_bench) | MHz | W | Mcycles | back to back: min / median "
                  f"/ max ms | MHz | samples |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
            medians = {"blockattn": [], "flex": []}
            for index in range(args.rounds):
                for name in medians:
                    fn = runners[name][0]
                    begin = time.perf_counter()
                    ms = _time_ms(lambda: fn(q, k, v))
                    middle = time.perf_counter()
                    calls = back_to_back_ms(lambda: fn(q, k, v))
                    end = time.perf_counter()
                    clock, power, count = sampler.medians(begin, middle)
                    clock_b2b, _, count_b2b = sampler.medians(middle, end)
                    medians[name].append(ms)
                    print(f"| {index} | {name} | {ms:.3f} | {clock:.0f} | {power:.0f} | {ms * clock / 1e3:.2f} | "
                          f"{min(calls):.3f} / {statistics.median(calls):.3f} / {max(calls):.3f} | {clock_b2b:.0f} | "
                          f"{count} + {count_b2b} |", flush=True)
            ratios = [f / b for f, b in zip(medians["flex"], medians["blockattn"])]
            print(f"flex / blockattn by round: {' / '.join(f'{r:.3f}' for r in ratios)}; of the medians "
                  f"{statistics.median(medians['flex']) / statistics.median(medians['blockattn']):.3f}", flush=True)
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
