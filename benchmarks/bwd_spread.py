"""Why the paired backward's time moves between processes (up to 6% at 128x64, d=0.25): in one process, the
backward alone timed with its fp32 dQ buffer placed at several byte offsets from a fresh allocation, and with
inputs allocated afresh (other addresses), in interleaved rounds, with the SM clock sampled during each timing.
If the spread follows an offset, the buffer's placement is a lever; if it follows the clock, it is not ours.

    python benchmarks/bwd_spread.py [--density 0.25 0.1] [--offsets 0 4096 65536 1052672 2097152] [--rounds 3]
"""

import argparse
import statistics
import time

import torch

import blockattn
from blockattn.bench import Case, _inputs, _time_ms, block_mask
from blockattn.kernels import backward

from clocks import Sampler

_plain_empty = backward.buffers.empty


def offset_empty(offset_bytes: int):
    """buffers.empty whose fp32 3-d buffers (the backward's dQ accumulator) start offset_bytes into a fresh
    allocation; every other buffer as before."""
    def empty(*shape, dtype, device):
        if dtype != torch.float32 or len(shape) != 3:
            return _plain_empty(*shape, dtype=dtype, device=device)
        count = shape[0] * shape[1] * shape[2]
        skip = offset_bytes // 4
        return torch.empty(count + skip, dtype=dtype, device=device)[skip:].view(*shape)
    return empty


def timed(fn, sampler: Sampler) -> tuple:
    """(ms, median SM clock MHz while it was timed)."""
    begin = time.perf_counter()
    ms = _time_ms(fn)
    return ms, sampler.medians(begin, time.perf_counter())[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", nargs="+", type=float, default=[0.25, 0.1])
    parser.add_argument("--offsets", nargs="+", type=int, default=[0, 4096, 65536, 1052672, 2097152])
    parser.add_argument("--inputs", type=int, default=2, help="sets of inputs allocated afresh (offset 0)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    sampler = Sampler()
    try:
        for density in args.density:
            case = Case(block=(128, 64), density=density)
            blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), case.block, case.seq, case.seq)
            graphs = []
            for _ in range(args.inputs):  # each set of inputs at other addresses (the earlier sets stay allocated)
                q, k, v = _inputs(case, device, requires_grad=True)
                grad = torch.randn_like(q)
                graphs.append((blockattn.attention(q, k, v, blocks), (q, k, v), grad))
            variants = [(f"dQ buffer +{o} B", o, 0) for o in args.offsets]
            variants += [(f"inputs set {i}", 0, i) for i in range(1, args.inputs)]
            results = {label: [] for label, _, _ in variants}
            for _ in range(args.rounds):
                for label, offset, which in variants:
                    out, inputs, grad = graphs[which]
                    backward.buffers.empty = offset_empty(offset)
                    try:
                        step = lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)  # noqa: E731
                        results[label].append(timed(step, sampler))
                    finally:
                        backward.buffers.empty = _plain_empty
            print(f"d={density}, 128x64, B1 H24 S32k D128 bf16, backward alone, ms (SM MHz) per round:", flush=True)
            for label, rows in results.items():
                cells = ", ".join(f"{ms:.3f} ({mhz:.0f})" for ms, mhz in rows)
                print(f"  {label}: {cells}; median {statistics.median(ms for ms, _ in rows):.3f}", flush=True)
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
