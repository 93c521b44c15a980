"""The host time of an eager short forward+backward, split by blockattn's own steps: each wrapped function's
time per call (inclusive, on whichever thread runs it; autograd runs a CUDA backward on its device thread), for
B8 H16 S1024 D128, d=0.5, 128x128 blocks; and a pure-Python loop's time, to compare hosts.

    python benchmarks/host_split.py [--seq 1024] [--calls 200]
"""

import argparse
import collections
import time

import torch

import blockattn
from blockattn import api
from blockattn.kernels import backward, forward, launch, ops

from exp_short import short_case

TOTALS = collections.defaultdict(float)
COUNTS = collections.Counter()


def timed(owner, name: str, label: str = ""):
    """Replace owner.name by a wrapper adding its inclusive time to TOTALS[label or name]."""
    inner = getattr(owner, name)
    label = label or name

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start
            COUNTS[label] += 1
    setattr(owner, name, wrapper)


def python_loop_us() -> float:
    """A fixed pure-Python workload (attribute reads, a dict, a tuple per step), in us."""
    start = time.perf_counter()
    for _ in range(20):
        table = {}
        for i in range(1000):
            table[i % 97] = (i, str(i), table.get(i % 89))
    return (time.perf_counter() - start) * 1e6 / 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"pure-Python loop: {min(python_loop_us() for _ in range(20)):.1f} us", flush=True)
    fwd, fwd_bwd = short_case(8, 16, args.seq, 0.5)
    for _ in range(20):
        fwd_bwd()
    torch.cuda.synchronize()
    for owner, name, label in [
            (blockattn, "attention", ""), (api, "_prepare", ""), (api, "_triton_attention", ""),
            (ops.EagerAttention, "apply", "EagerAttention.apply"), (ops, "forward_eager", ""),
            (ops, "_gradients", ""), (ops, "backward_some", ""), (ops, "attention_backward", ""),
            (backward, "warp_specialized_module", ""), (backward, "resolve_dq_mode", ""), (backward, "site_key", ""),
            (forward, "site_key", "forward.site_key"), (launch, "run", "launch.run"),
            (launch, "layout_key", ""), (launch.Plan, "relaunch", "Plan.relaunch"),
            (torch.autograd, "grad", "torch.autograd.grad")]:
        timed(owner, name, label)
    kernels = {id(plan.kernel): plan.kernel for plan in launch.plans().values()}  # plans may share a kernel
    for kernel in kernels.values():
        # CompiledKernel.run is a read-only property over _run (the launcher object) in Triton 3.6 and 3.9
        owner, name = (kernel, "_run") if getattr(kernel, "_run", None) is not None else (kernel, "run")
        try:
            timed(owner, name, "Triton launcher (kernel.run)")
        except (AttributeError, TypeError):
            print(f"(could not wrap {type(kernel).__name__}.{name}: the launcher's own time is not split out)")
    TOTALS.clear()
    COUNTS.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        fwd_bwd()
    enqueue = (time.perf_counter() - start) * 1e6 / args.calls
    torch.cuda.synchronize()
    print(f"forward+backward, {args.calls} calls back to back: host enqueue {enqueue:.1f} us a call", flush=True)
    for label, total in sorted(TOTALS.items(), key=lambda item: -item[1]):
        print(f"  {label}: {total * 1e6 / args.calls:.1f} us a call ({COUNTS[label] / args.calls:g} calls of "
              f"{total * 1e6 / COUNTS[label]:.1f} us)", flush=True)


if __name__ == "__main__":
    main()
