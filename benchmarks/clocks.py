"""SM clock and board power while each implementation's forward (or fwd+bwd) runs back to back at one case:
whether a faster kernel pays for its speed in clock (the H200 holds its power limit by lowering the clock).

    python benchmarks/clocks.py --density 0.25 [--backward] [--dim 64]
"""

import argparse
import statistics
import subprocess
import threading
import time

import torch

from blockattn.bench import Case, _inputs, _runners, block_mask


class Sampler:
    """nvidia-smi's SM clock (MHz) and board power (W) every `period_ms` (its --loop-ms, one process for the whole
    run), each sample stamped with time.perf_counter(). nvidia-smi's power reading averages about a second."""

    def __init__(self, period_ms: int = 20):
        self.samples: list[tuple[float, float, float]] = []
        self.process = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             f"--loop-ms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.process.stdout:
            try:
                clock, power = (float(x) for x in line.split(",")[:2])
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), clock, power))

    def between(self, start: float, end: float) -> list[tuple[float, float]]:
        """(clock, power) of the samples taken in [start, end] (perf_counter times)."""
        return [(clock, power) for stamp, clock, power in list(self.samples) if start <= stamp <= end]

    def medians(self, start: float, end: float) -> tuple[float, float, int]:
        """Median clock and power of the samples taken in [start, end], and their number (nan where none)."""
        inside = self.between(start, end)
        if not inside:
            return float("nan"), float("nan"), 0
        return statistics.median(c for c, _ in inside), statistics.median(p for _, p in inside), len(inside)

    def close(self):
        self.process.terminate()
        self.process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--dim", type=int, default=128, help="head dim (the design case's other sizes)")
    args = parser.parse_args()
    case = Case(density=args.density, dim=args.dim)
    device = torch.device("cuda")
    q, k, v = _inputs(case, device, requires_grad=args.backward)
    grad = torch.randn_like(q)
    runners = _runners(case, block_mask(case, device), device)
    print(f"== {case.label} {'fwd+bwd' if args.backward else 'fwd'}")
    sampler = Sampler()
    try:
        for name in ("blockattn", "flex", "sdpa-cudnn"):
            fn, _ = runners[name]
            step = ((lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)) if args.backward
                    else (lambda: fn(q, k, v)))
            with torch.set_grad_enabled(args.backward):
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                time.sleep(2.0)  # let the clock recover between implementations
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                calls, begin = 0, time.perf_counter()
                start.record()
                while time.perf_counter() - begin < args.seconds:
                    for _ in range(4):
                        step()
                    calls += 4
                    torch.cuda.synchronize()
                end.record()
                torch.cuda.synchronize()
            # the samples from the first second on, once the implementation has run long enough to set the clock
            samples = sampler.between(begin + 1.0, time.perf_counter())
            clocks = sorted(c for c, _ in samples)
            power = sorted(p for _, p in samples)
            print(f"{name}: {start.elapsed_time(end) / calls:.3f} ms per call over {calls} calls; SM clock median "
                  f"{clocks[len(clocks) // 2]:.0f} MHz (min {clocks[0]:.0f}), power median "
                  f"{power[len(power) // 2]:.0f} W ({len(samples)} samples)", flush=True)
    finally:
        sampler.close()

if __name__ == "__main__":
    main()
