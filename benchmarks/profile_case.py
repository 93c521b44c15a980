"""One case's forward and backward, run a few times, for a profiler (Nsight Compute) to read the kernels' hardware
counters: B1 H24 S32768 D128 bf16 on a random block mask.

    ncu --clock-control none --kernel-name regex:attention_bwd_ws --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis python benchmarks/profile_case.py --block 128 64
"""

import argparse

import torch

import blockattn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, nargs=2, default=[128, 64])
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=None, help="kv heads (GQA); default: --heads")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=4, help="forward+backward calls (the first ones tune and compile)")
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    block_q, block_kv = args.block
    nq, nk = -(-args.seq // block_q), -(-args.seq // block_kv)
    keep = torch.rand(1, args.heads, nq, nk, generator=gen, device=device) < args.density
    blocks = blockattn.BlockSparsity.from_mask(keep, (block_q, block_kv), args.seq, args.seq)
    q, k, v = (torch.randn(1, heads, args.seq, args.dim, generator=gen, device=device, dtype=torch.bfloat16)
               .requires_grad_() for heads in (args.heads, args.kv_heads or args.heads, args.kv_heads or args.heads))
    grad = torch.randn_like(q)
    for _ in range(args.calls):
        torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), grad)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
