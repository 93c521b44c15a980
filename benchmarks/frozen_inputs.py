"""Backward time when some inputs are frozen: B1 H24 S32768 D128 bf16, 128x128 blocks, at two densities. Times
forward+backward through autograd with every input requiring grad, with frozen keys and values (only q requires
grad: the dK/dV kernel is skipped) and with a frozen query (the dQ kernel is skipped), and the forward alone.

    python benchmarks/frozen_inputs.py --density 0.25 0.1
"""

import argparse

import torch
import triton.testing

import blockattn
from blockattn.bench import Case, block_mask


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, nargs="+", default=[0.25])
    parser.add_argument("--seq", type=int, default=32768)
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| density | fwd ms | fwd+bwd all ms | bwd all | bwd, frozen k/v | bwd, frozen q |")
    print("| --- | --- | --- | --- | --- | --- |")
    for density in args.density:
        case = Case(batch=1, heads=24, kv_heads=24, seq=args.seq, density=density, block=(128, 128))
        blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), case.block, case.seq, case.seq)
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, 24, args.seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        grad = torch.randn_like(q)

        def timed(*trainable):
            leaves = [x.detach().requires_grad_(any(x is t for t in trainable)) for x in (q, k, v)]
            wanted = [leaf for leaf in leaves if leaf.requires_grad]

            def step():
                out = blockattn.attention(*leaves, blocks)
                if wanted:
                    torch.autograd.grad(out, wanted, grad)
            return triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median")

        forward = timed()
        times = [timed(q, k, v), timed(q), timed(k, v)]
        print(f"| {density} | {forward:.2f} | {times[0]:.2f} | "
              + " | ".join(f"{t - forward:.2f}" for t in times) + " |")


if __name__ == "__main__":
    main()
