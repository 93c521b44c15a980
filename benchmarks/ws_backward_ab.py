"""The warp-specialized backward with one of its settings each way, timed in turns (A, B, A, B, ...) so that drift
on the machine falls on both ways alike, and the two ways' gradients compared.

Settings (module attributes of blockattn.kernels.backward_ws):
  split-causal    the causal walk's steps that cross the diagonal in a loop of their own, the rest without the
                  causal test, or every step in one loop with it (SPLIT_CAUSAL_DIMS for MHA walks,
                  SPLIT_CAUSAL_GROUPED_DIMS for GQA ones: both at the case's head dim)

    cd benchmarks && python ws_backward_ab.py --setting split-causal --rounds 3
"""

import argparse
import statistics

import torch

from blockattn.bench import Case, _flops, _set_head_dim, _time_ms, backward_inputs
from blockattn.kernels import backward_ws

SUITES = {
    # is_causal over the block-causal mask: MHA and GQA walks of 128-key blocks, D=128 and 64, long and short
    "causal": [Case(pattern="causal", density=0.5), Case(dim=64, pattern="causal", density=0.5),
               Case(heads=32, kv_heads=8, seq=16384, pattern="causal", density=0.5),
               Case(heads=32, kv_heads=8, seq=16384, dim=64, pattern="causal", density=0.5),
               Case(batch=8, heads=16, kv_heads=16, seq=4096, pattern="causal", density=0.5)],
}
# each setting's module attributes (head dims), and its two ways' names
SETTINGS = {"split-causal": (("SPLIT_CAUSAL_DIMS", "SPLIT_CAUSAL_GROUPED_DIMS"), "split", "one loop")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="split-causal")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", choices=sorted(SUITES), nargs="+", default=["causal"])
    args = parser.parse_args()
    attributes, on_name, off_name = SETTINGS[args.setting]
    saved = {attribute: getattr(backward_ws, attribute) for attribute in attributes}
    device = torch.device("cuda")
    print(f"{args.setting} each way (backward only, effective TFLOP/s in brackets)")
    print(f"| case | {on_name} ms (each round) | {off_name} ms (each round) | {off_name} / {on_name} (medians) | "
          "relative gap dq/dk/dv |")
    print("| --- | --- | --- | --- | --- |")
    for case in [case for name in args.cases for case in SUITES[name]]:
        blocks, q, k, v, grad, out = backward_inputs(case, device)
        times, grads = {True: [], False: []}, {}
        try:
            for _ in range(args.rounds):
                for on in (True, False):
                    for attribute in attributes:
                        _set_head_dim(backward_ws, attribute, case.dim, on)
                    grads[on] = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
                    times[on].append(_time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)))
        finally:
            for attribute, value in saved.items():
                setattr(backward_ws, attribute, value)
        med = {key: statistics.median(value) for key, value in times.items()}
        flops = 2.5 * _flops(case, blocks.density())
        gaps = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads[True], grads[False])]
        print(f"| {case.label} | {' / '.join(f'{t:.3f}' for t in times[True])} ({flops / med[True] / 1e9:.0f}) | "
              f"{' / '.join(f'{t:.3f}' for t in times[False])} ({flops / med[False] / 1e9:.0f}) | "
              f"{med[False] / med[True]:.3f} | {'/'.join(f'{g:.1e}' for g in gaps)} |", flush=True)


if __name__ == "__main__":
    main()
