"""Where a training step's attention time goes, 128x64 blocks at B1 H24 S32k D128 bf16: the forward without
gradients, the forward with inputs that require them (it saves the q lists and the LSE), the backward alone
(autograd.grad over a kept graph), and forward+backward, whose difference with the forward is what flex_variants.py
and the bench call "bwd".

    python benchmarks/train_split.py [--density 0.25 0.1]
"""

import argparse

import torch

import blockattn
from blockattn.bench import Case, _inputs, _time_ms, block_mask


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", nargs="+", type=float, default=[0.25, 0.1])
    args = parser.parse_args()
    device = torch.device("cuda")
    for density in args.density:
        case = Case(block=(128, 64), density=density)
        blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=True)
        grad = torch.randn_like(q)
        with torch.no_grad():
            plain = _time_ms(lambda: blockattn.attention(q, k, v, blocks))
        training = _time_ms(lambda: blockattn.attention(q, k, v, blocks))
        out = blockattn.attention(q, k, v, blocks)
        alone = _time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
        both = _time_ms(lambda: torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), grad))
        print(f"d={density}: forward {plain:.3f} ms, with grad {training:.3f}, backward alone {alone:.3f}, "
              f"forward+backward {both:.3f} (minus the forward with grad: {both - training:.3f})", flush=True)


if __name__ == "__main__":
    main()
