"""Experiment: variants of the dK/dV loop at one shape, timed kernel by kernel (not part of the package).

Knobs: ROTATE (each program starts its q-list walk at a different entry, spreading reads of one Q/dO tile over
time), QT_LOAD (load Q^T directly instead of transposing the loaded tile), LSE_EARLY (row stats loaded before the
first product, delta after the dV product), GROUP_CONST (group size as a compile-time constant).

    python benchmarks/exp_dkdv.py
"""


import torch
import triton
import triton.language as tl
import triton.testing

import blockattn
from blockattn.bench import Case, block_mask
from blockattn.kernels.forward import LOG2E


@triton.jit
def dkdv_variant(Q, K, V, DO, DK, DV, Lse, Delta, Q_COUNT, Q_INDEX, scale_log2, scale, seq, heads, kv_heads,
                 group_size, n_list,
                 HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 ROTATE: tl.constexpr, QT_LOAD: tl.constexpr, LSE_EARLY: tl.constexpr, GROUP: tl.constexpr):
    TILES: tl.constexpr = BLOCK_Q // BLOCK_M
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_hkv = pid_bh % kv_heads
    off_b = pid_bh // kv_heads
    start_n = pid_n * BLOCK_N
    kv_block = start_n // BLOCK_Q  # square blocks here
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m0 = tl.arange(0, BLOCK_M)
    kv_base = (off_b * kv_heads + off_hkv).to(tl.int64) * seq * HEAD_DIM
    k = tl.load(K + kv_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
    v = tl.load(V + kv_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    groups = GROUP if GROUP > 0 else group_size
    for g in range(0, groups):
        off_h = off_hkv * groups + g
        bh = off_b * heads + off_h
        q_base = bh.to(tl.int64) * seq * HEAD_DIM
        row_base = bh.to(tl.int64) * seq
        count = tl.load(Q_COUNT + bh * (seq // BLOCK_Q) + kv_block)
        index_row = Q_INDEX + (bh * (seq // BLOCK_Q) + kv_block).to(tl.int64) * n_list
        total = count * TILES
        first = (pid_n % tl.maximum(count, 1)) * TILES if ROTATE else 0
        for step in range(0, total):
            it = step + first
            it = tl.where(it >= total, it - total, it)
            q_block = tl.load(index_row + it // TILES)
            offs_m = q_block * BLOCK_Q + (it % TILES) * BLOCK_M + offs_m0
            if LSE_EARLY:
                lse = tl.load(Lse + row_base + offs_m) * 1.4426950408889634
            if QT_LOAD:
                q_t = tl.load(Q + q_base + offs_m[None, :] * HEAD_DIM + offs_d[:, None])
                kq = tl.dot(k, q_t)
            else:
                q = tl.load(Q + q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
                kq = tl.dot(k, tl.trans(q))
            if not LSE_EARLY:
                lse = tl.load(Lse + row_base + offs_m) * 1.4426950408889634
                delta = tl.load(Delta + row_base + offs_m)
            p_t = tl.math.exp2(kq * scale_log2 - lse[None, :])
            do = tl.load(DO + q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            if LSE_EARLY:
                delta = tl.load(Delta + row_base + offs_m)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = (p_t * (dp_t - delta[None, :])).to(do.dtype)
            if QT_LOAD:
                dk = tl.dot(ds_t, tl.trans(q_t), dk)
            else:
                dk = tl.dot(ds_t, q, dk)
    tl.store(DK + kv_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + kv_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty))


def main():
    device = torch.device("cuda")
    for density in (1.0, 0.25):
        case = Case(density=density)
        blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), case.block, case.seq, case.seq)
        q_count, q_index = blocks.q_lists()
        q_count, q_index = q_count.contiguous(), q_index.contiguous()
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (torch.randn(1, 24, case.seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
                       for _ in range(4))
        scale = 128 ** -0.5
        out, lse = blockattn.attention(q, k, v, blocks, return_lse=True)
        delta = (out.float() * do.float()).sum(-1)
        ref = None
        flops = 4 * 2.0 * 24 * case.seq * case.seq * 128 * blocks.density()
        for rotate, qt, early, group in [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1),
                                         (1, 1, 1, 1), (0, 1, 1, 1)]:
            for stages in (2, 3):
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                grid = (case.seq // 128, 24)
                run = lambda: dkdv_variant[grid](
                    q, k, v, do, dk, dv, lse, delta, q_count, q_index, scale * LOG2E, scale, case.seq, 24, 24, 1,
                    q_index.shape[-1], HEAD_DIM=128, BLOCK_Q=128, BLOCK_M=64, BLOCK_N=128, ROTATE=rotate,
                    QT_LOAD=qt, LSE_EARLY=early, GROUP=group, num_warps=8, num_stages=stages)
                label = f"d={density} rotate={rotate} qt={qt} early={early} group={group} s{stages}"
                try:
                    ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
                except Exception as error:
                    print(f"{label}: failed {error}")
                    continue
                if ref is None:
                    ref = (dk.clone(), dv.clone())
                gap = max((got.float() - want.float()).abs().max().item() for got, want in zip((dk, dv), ref))
                print(f"{label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s of 4 products) gap {gap:.2e}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
