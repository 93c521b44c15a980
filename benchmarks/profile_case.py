"""One case's forward and backward, run a few times, for a profiler (Nsight Compute) to read the kernels' hardware
counters: B1 H24 S32768 D128 bf16 on a random block mask.

    ncu --clock-control none --kernel-name regex:attention_bwd_ws --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis python benchmarks/profile_case.py --block 128 64
    # the forward alone at D=64, its 128x64 lists made from a 128x128 mask (the same keys as --block 128 128
    # --as-listed, which the fifty-sixth session profiled before SPLIT_KEY_BLOCK_DIMS)
    ncu --clock-control none --kernel-name regex:attention_fwd_ws --launch-skip 2 --launch-count 1 --section \
        WarpStateStats python benchmarks/profile_case.py --block 128 64 --mask-keys 128 --dim 64 --forward-only
"""

import argparse

import torch

import blockattn
from blockattn.kernels import forward_ws


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, nargs=2, default=[128, 64])
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=None, help="kv heads (GQA); default: --heads")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=4, help="forward+backward calls (the first ones tune and compile)")
    parser.add_argument("--forward-only", action="store_true", help="forward calls only, no backward")
    parser.add_argument("--mask-keys", type=int, default=None,
                        help="keys a random choice keeps (a multiple of the key block; default the key block)")
    parser.add_argument("--as-listed", action="store_true",
                        help="the forward walks key blocks as listed (forward_ws.SPLIT_KEY_BLOCK_DIMS empty)")
    parser.add_argument("--no-claims", action="store_true",
                        help="the warp-specialized forward a program a tile (forward_ws.CLAIMED_DIMS empty)")
    args = parser.parse_args()
    if args.no_claims:
        forward_ws.CLAIMED_DIMS = ()
    if args.as_listed:
        forward_ws.SPLIT_KEY_BLOCK_DIMS = ()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    block_q, block_kv = args.block
    nq, nk = -(-args.seq // block_q), -(-args.seq // block_kv)
    per_choice = (args.mask_keys or block_kv) // block_kv
    keep = torch.rand(1, args.heads, nq, -(-nk // per_choice), generator=gen, device=device) < args.density
    keep = keep.repeat_interleave(per_choice, dim=-1)[..., :nk]
    blocks = blockattn.BlockSparsity.from_mask(keep, (block_q, block_kv), args.seq, args.seq)
    q, k, v = (torch.randn(1, heads, args.seq, args.dim, generator=gen, device=device, dtype=torch.bfloat16)
               .requires_grad_() for heads in (args.heads, args.kv_heads or args.heads, args.kv_heads or args.heads))
    grad = torch.randn_like(q)
    for _ in range(args.calls):
        if args.forward_only:
            with torch.no_grad():
                blockattn.attention(q, k, v, blocks)
        else:
            torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), grad)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
