"""The fixed-offset forwards' pass over k (bounds.key_norm_parts): its time and read bandwidth on the GPU at the
target shape, for the package's launch and for other launches of the same kernel (keys a step, warps, pipeline
stages, parts a head), each checked against torch's norms. A pass that reads k near the memory's rate costs
k's bytes / bandwidth: at B1 Hkv24 S32768 D128 bf16, 201 MB, about 2.6% of a d=0.1 forward.

    python benchmarks/key_norms.py [--dims 64 128]
"""

import argparse

import torch
import triton

from blockattn.kernels import bounds


def launch(k: torch.Tensor, parts: int, keys: int, warps: int, stages: int) -> torch.Tensor:
    batch, kv_heads, seq_kv, dim = k.shape
    out = torch.empty(batch, kv_heads, parts, device=k.device, dtype=torch.float32)
    bounds.key_norm_parts_kernel[(batch * kv_heads, parts)](
        k, out, seq_kv, kv_heads, *k.stride(), out.stride(0), out.stride(1), HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim), KEYS=keys, PARTS=parts, num_warps=warps, num_stages=stages)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--kv-heads", type=int, default=24)
    args = parser.parse_args()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| D | launch (parts, keys, warps, stages) | us | GB/s | largest error |")
    print("| --- | --- | --- | --- | --- |")
    for dim in args.dims:
        k = torch.randn(1, args.kv_heads, args.seq, dim, device="cuda", dtype=torch.bfloat16)
        want = torch.linalg.vector_norm(k.float(), dim=-1).amax(-1)                       # [B, Hkv]
        variants = ["package"] + [(parts, keys, warps, stages) for parts in (32, 128) for keys in (64, 128)
                                  for warps in (4, 8) for stages in (1, 3)]
        for name in variants:
            if name == "package":
                fn = lambda: bounds.key_norm_parts(k)                                      # noqa: E731
            else:
                fn = lambda name=name: launch(k, *name)                                    # noqa: E731
            try:
                got = fn().amax(-1)
                error = (got - want).abs().max().item() / want.abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            except Exception as e:  # a launch that does not compile (too many registers, shared memory)
                print(f"| {dim} | {name} | failed: {type(e).__name__} | | |")
                continue
            print(f"| {dim} | {name} | {ms * 1e3:.1f} | {k.numel() * 2 / ms / 1e6:.0f} | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
