"""Which block shape blocks=None should use: dense and causal calls (every block kept) at 128x64 and 128x128, forward
and forward+backward, D=128 and D=64, in one process. The mask is the same either way, so only speed differs.

    python benchmarks/default_blocks.py
"""

import argparse

import torch

import blockattn
from blockattn.bench import _time_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| D | causal | blocks | forward ms | forward+backward ms |")
    print("| --- | --- | --- | --- | --- |")
    for dim in args.dims:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, args.heads, args.seq, dim, device=device, dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
        grad = torch.randn(q.shape, device=device, dtype=torch.bfloat16, generator=gen)
        for causal in (True, False):
            for block in ((128, 64), (128, 128)):
                def forward():
                    return blockattn.attention(q, k, v, None, block, is_causal=causal)

                def step():
                    torch.autograd.grad(forward(), (q, k, v), grad)
                print(f"| {dim} | {causal} | {block[0]}x{block[1]} | {_time_ms(forward):.3f} | {_time_ms(step):.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
