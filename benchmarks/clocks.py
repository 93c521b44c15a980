"""SM clock and board power while each implementation's forward (or fwd+bwd) runs back to back at one case:
whether a faster kernel pays for its speed in clock (the H200 holds its power limit by lowering the clock).

    python benchmarks/clocks.py --density 0.25 [--backward] [--dim 64]
"""

import argparse
import subprocess
import threading
import time

import torch

from blockattn.bench import Case, _inputs, _runners, block_mask


def sample_gpu(stop: threading.Event, samples: list) -> None:
    while not stop.is_set():
        line = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.split("\n")[0]
        samples.append(tuple(float(x) for x in line.split(",")))
        time.sleep(0.2)


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
    for name in ("blockattn", "flex", "sdpa-cudnn"):
        fn, _ = runners[name]
        step = ((lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)) if args.backward
                else (lambda: fn(q, k, v)))
        with torch.set_grad_enabled(args.backward):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            time.sleep(2.0)  # let the clock recover between implementations
            samples, stop = [], threading.Event()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            calls, begin = 0, time.perf_counter()
            start.record()
            sampler = None
            while time.perf_counter() - begin < args.seconds:
                for _ in range(4):
                    step()
                calls += 4
                torch.cuda.synchronize()
                if sampler is None and time.perf_counter() - begin > 1.0:
                    sampler = threading.Thread(target=sample_gpu, args=(stop, samples))
                    sampler.start()
            end.record()
            torch.cuda.synchronize()
            stop.set()
            sampler.join()
        clocks = sorted(s[0] for s in samples)
        power = sorted(s[1] for s in samples)
        print(f"{name}: {start.elapsed_time(end) / calls:.3f} ms per call over {calls} calls; SM clock median "
              f"{clocks[len(clocks) // 2]:.0f} MHz (min {clocks[0]:.0f}), power median {power[len(power) // 2]:.0f} W "
              f"({len(samples)} samples)", flush=True)


if __name__ == "__main__":
    main()
