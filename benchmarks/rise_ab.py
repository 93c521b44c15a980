"""The warp-specialized forward's two ways of keeping bf16's offsets fixed, timed in turns (A, B, A, B, ...) so that
drift on the machine falls on both: the rise checked after the walk (forward_ws.RISE_CHECKED_DTYPES and _DIMS)
against the rise bounded by the key norms. One-off runs of ws_forward.py --rise-checked at D=64 disagreed by up to
12% in either direction between runs; this says which is faster with the rounds beside each other.

    cd benchmarks && python rise_ab.py --rounds 3
"""

import argparse
import statistics

import torch

import blockattn
from blockattn.bench import Case, _flops, _inputs, _time_ms, block_mask
from blockattn.kernels import forward_ws

CASES = ([Case(dim=64, block=block, density=d) for block in ((128, 128), (128, 64)) for d in (0.5, 0.25, 0.1)]
         + [Case(dim=64, pattern="causal", density=0.5), Case(block=(128, 128), density=0.1)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    default = forward_ws.RISE_CHECKED_DTYPES, forward_ws.RISE_CHECKED_DIMS
    device = torch.device("cuda")
    print("| case | checked ms (each round) | bounded ms (each round) | bounded / checked (medians) |")
    print("| --- | --- | --- | --- |")
    for case in CASES:
        keep = block_mask(case, device)
        blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=False)
        causal = case.pattern == "causal"
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for checked in (True, False):
                forward_ws.RISE_CHECKED_DTYPES = (torch.bfloat16, ) if checked else ()
                forward_ws.RISE_CHECKED_DIMS = (case.dim, )
                times[checked].append(_time_ms(lambda: blockattn.attention(q, k, v, blocks, is_causal=causal)))
        forward_ws.RISE_CHECKED_DTYPES, forward_ws.RISE_CHECKED_DIMS = default
        med = {key: statistics.median(value) for key, value in times.items()}
        flops = _flops(case, blocks.density())
        print(f"| {case.label} | {' / '.join(f'{t:.3f}' for t in times[True])} ({flops / med[True] / 1e9:.0f}) | "
              f"{' / '.join(f'{t:.3f}' for t in times[False])} ({flops / med[False] / 1e9:.0f}) | "
              f"{med[False] / med[True]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
