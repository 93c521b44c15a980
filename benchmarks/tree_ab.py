"""The warp-specialized backward's time per call (ms, best of three medians) for the blockattn on PYTHONPATH: run it
once per tree to compare two versions of the package in separate processes on the same machine, e.g. the current
one against a commit's:

    git archive <commit> blockattn | tar -x -C /tmp/old      # (on the GPU machine: a folder inside the checkout)
    for tree in /tmp/old .; do PYTHONPATH=$tree python benchmarks/tree_ab.py design gqa short causal d64; done

The twenty-second session compared the row terms read through the loader's ring against b588c7b this way.
"""

import argparse

import torch

import blockattn
from blockattn.bench import Case, _inputs, _time_ms, block_mask
from ws_backward import SUITES as WS_SUITES

# ws_backward.py's cases, but a shorter D=64 set (each tree runs every case three times)
SUITES = {**{name: WS_SUITES[name] for name in ("design", "gqa", "short", "causal", "paired")},
          "d64": [Case(dim=64, density=d) for d in (0.5, 0.1)]
          + [Case(dim=64, heads=32, kv_heads=8, seq=16384, density=0.25)]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="+", choices=list(SUITES))
    args = parser.parse_args()
    device = torch.device("cuda")
    print("tree:", blockattn.__file__)
    for case in [c for name in args.suites for c in SUITES[name]]:
        keep = block_mask(case, device)
        blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=True)
        grad = torch.randn_like(q)
        out = blockattn.attention(q, k, v, blocks, is_causal=case.pattern == "causal")

        def backward():
            return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        dq = backward()[0]
        ms = min(_time_ms(backward) for _ in range(3))
        # (dq's norm: the two trees' gradients should agree to rounding)
        print(f"{case.label} | {ms:.3f} ms | dq norm {dq.float().norm():.4f}", flush=True)


if __name__ == "__main__":
    main()
