"""Sweep the tile candidates of every kernel at one shape and print what each config measured (ms), best first.

    python benchmarks/tune_sweep.py --block 128x128 --density 0.25
"""

import argparse
import os

import torch

DEFAULT_SWEEP = {
    "FWD": ("64,128", "64,128", "4,8", "2,3,4"),
    "BWD_DQ": ("64,128", "32,64,128", "4,8", "2,3"),
    "BWD_DKDV": ("32,64,128", "64,128", "4,8", "2,3"),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", default="128x128")
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    for kernel, lists in DEFAULT_SWEEP.items():
        for field, value in zip(("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES"), lists):
            os.environ.setdefault(f"BLOCKATTN_{kernel}_{field}", value)

    import blockattn
    from blockattn.bench import Case, block_mask
    from blockattn.kernels import autotune

    autotune.DISK_CACHE = False  # benchmark every candidate this run prints, not a stored choice
    block = tuple(int(x) for x in args.block.split("x"))
    case = Case(heads=args.heads, kv_heads=args.kv_heads or args.heads, seq=args.seq, dim=args.dim, block=block,
                density=args.density)
    device = torch.device("cuda")
    blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), block, case.seq, case.seq)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, case.heads, case.seq, case.dim, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, case.kv_heads, case.seq, case.dim, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_(True)
    import triton.testing

    from blockattn.kernels import backward
    grad = torch.randn_like(q)
    for mode in backward.DQ_MODES:
        backward.DQ_MODE_DEFAULT = mode
        ms = triton.testing.do_bench(lambda: torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), grad),
                                     warmup=50, rep=200, return_mode="median")
        print(f"fwd+bwd with dQ mode {mode}: {ms:.3f} ms")
    torch.cuda.synchronize()
    flops = 4.0 * case.heads * case.seq * case.seq * case.dim * blocks.density()
    for name, rows in autotune.measured():
        work = 1.0 if "fwd" in name else (1.0 if "dq" in name else 1.5)  # dq ~ 2 dots, dkdv ~ 3 dots of 5 in bwd
        print(f"== {case.label}: {name}")
        for config, ms in rows:
            print(f"  {config.kwargs} warps={config.num_warps} stages={config.num_stages}: {ms:.3f} ms "
                  f"({work * flops / ms / 1e9:.0f} TFLOP/s of its share)")


if __name__ == "__main__":
    main()
