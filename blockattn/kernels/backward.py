"""Block-sparse attention backward: a delta preprocess, a dQ kernel over the kv lists and a dK/dV kernel over the
q lists, and their launcher. Derivation notes: kernels/README.md."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import autotune, buffers, forward, launch, tma
from .forward import (LOG2E, TUNING_KEY, fp32_precision, head_dims, optional_tensors, site_key, stride_args,
                      strides)
from .varlen import Varlen
from .primitives import (batch_and_head, dot, element_keep, first_entry_at_or_after, gather_mode, head_tile,
                         kv_list_start, kv_list_tiles, kv_walk_split, load_tile_or_box, needs_element_tests,
                         query_tile_program, sequence_span)

# How the backward produces dQ:
#   "kernel": a separate dQ kernel walks the kv lists and recomputes P and dP (7 tile products per tile pair in
#             all, deterministic);
#   "atomic": the dK/dV kernel adds each tile's dS K into an fp32 buffer with element atomics (5 products);
#   "tma":    the same, through Hopper's bulk tensor reductions (a tensor descriptor's atomic_add), which leave
#             the adds to the TMA unit instead of one atomic per element.
# The default, "auto", is chosen by measurement (BENCHMARKS.md, fourth session): "kernel" for every block shape. With
# the dK/dV kernel's Q/dO tiles read through descriptors (its loop then has no atomics), it ran 79.3 / 19.4 / 8.1 ms
# at densities 1 / 0.25 / 0.1 (128x128 blocks) against 87.7 / 21.0 / 9.0 for "atomic", which is bound by the
# atomic traffic. It is also deterministic. Deterministic mode always runs "kernel".
# On Hopper, calls without element tests at head dim 64 or 128 and the default mode take the warp-specialized Gluon
# backward instead (kernels/backward_ws.py: 5 products, dQ added through the TMA unit; warp_specialized_module).
DQ_MODES = ("kernel", "atomic", "tma")
DQ_MODE_DEFAULT = "auto"
# The buffers attention_backward allocates (their layouts follow from its inputs'): left out of plan keys.
_FRESH = ("Lse2", "Delta", "DQ", "DK", "DV", "DQ_ACC", "DQ_DESC")


@triton.jit
def attention_bwd_preprocess_kernel(Out, DO, GradLse, Lse, Lse2, Delta, DQ_ACC, seq_q, num_heads,
                                    stride_ob, stride_oh, stride_os, stride_od,
                                    stride_db, stride_dh, stride_ds, stride_dd,
                                    stride_gb, stride_gh, stride_gs,
                                    stride_lb, stride_lh, stride_ls,
                                    stride_eb, stride_eh, stride_es,
                                    stride_ab, stride_ah, stride_as,
                                    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
                                    ZERO_DQ_ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The backward's row terms (_row_terms) from Lse fp32 [B, H, Sq] (strides stride_l*) into Lse2 and Delta, fp32 [B,
    H, Sq] each with strides stride_e* (Lse's, or backward_ws.row_terms_buffer's), for the accumulating dQ modes and the
    warp-specialized backward; in dQ mode "kernel" the dQ kernel computes them itself. Packed batches run as one
    sequence of all their tokens. ZERO_DQ_ACC: also zero the same rows of DQ_ACC, fp32 [B, H, Sq, BLOCK_D] (last stride
    1), the buffer the dQ tiles are then added into (one pass over the rows instead of a fill launch)."""
    pid_m = tl.program_id(0)
    off_b, off_h = batch_and_head(num_heads)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < seq_q
    ok = m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    rows = offs_m.to(tl.int64)
    if ZERO_DQ_ACC:
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(head_tile(DQ_ACC, off_b, off_h, rows[:, None], offs_d, stride_ab, stride_ah, stride_as, 1),
                 tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=m_ok[:, None])
    o = tl.load(head_tile(Out, off_b, off_h, rows[:, None], offs_dv, stride_ob, stride_oh, stride_os, stride_od),
                mask=ok, other=0.0)
    do = tl.load(head_tile(DO, off_b, off_h, rows[:, None], offs_dv, stride_db, stride_dh, stride_ds, stride_dd),
                 mask=ok, other=0.0)
    _row_terms(o, do, GradLse, Lse, Lse2, Delta,
               off_b.to(tl.int64) * stride_gb + off_h.to(tl.int64) * stride_gh + rows * stride_gs,
               off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + rows * stride_ls,
               off_b.to(tl.int64) * stride_eb + off_h.to(tl.int64) * stride_eh + rows * stride_es, m_ok, HAS_GRAD_LSE)


@triton.jit
def attention_bwd_dq_finish_kernel(DQ_ACC, DQ, scale, seq_q, num_heads, stride_ab, stride_ah, stride_as,
                                   stride_qb, stride_qh, stride_qs, stride_qd,
                                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """dq = scale * dq_acc[..., :HEAD_DIM] in DQ's dtype, for BLOCK_M rows of one (batch, head): DQ_ACC fp32
    [B, H, Sq, BLOCK_D] (last stride 1) holds the unscaled sums of the accumulating dQ modes; DQ [B, H, Sq, D]
    with any strides. (A fused pass: PyTorch's mixed-dtype multiply runs unvectorized, ~1.7x slower.)"""
    pid_m = tl.program_id(0)
    off_b, off_h = batch_and_head(num_heads)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    acc = tl.load(head_tile(DQ_ACC, off_b, off_h, rows[:, None], offs_d, stride_ab, stride_ah, stride_as, 1),
                  mask=ok, other=0.0)
    tl.store(head_tile(DQ, off_b, off_h, rows[:, None], offs_d, stride_qb, stride_qh, stride_qs, stride_qd),
             (acc * scale).to(DQ.dtype.element_ty), mask=ok)


@triton.jit
def _row_terms(o, do, GradLse, Lse, Lse2, Delta, grad_rows, lse_rows, rows, rows_ok, HAS_GRAD_LSE: tl.constexpr):
    """The backward's row terms for a tile of rows, from its O and dO tiles [BM, BDV] (zero past the end) and
    Lse + lse_rows: (lse2, delta) [BM], also stored at Lse2 + rows and Delta + rows (GradLse + grad_rows: the LSE's
    gradient).
    delta = rowsum(dO * O) - dLSE, the softmax-backward term (dLSE folds in here because d lse / d s = p, the
    same shape as the dO term); lse2 = LSE in log2 units, +inf where a row saw nothing or lies past the end (so
    p = exp2(s - lse2) is exactly 0), which spares the dK/dV loop a multiply and a select per element."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_GRAD_LSE:
        delta -= tl.load(GradLse + grad_rows, mask=rows_ok, other=0.0)
    lse = tl.load(Lse + lse_rows, mask=rows_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(Delta + rows, delta, mask=rows_ok)
    tl.store(Lse2 + rows, lse2, mask=rows_ok)
    return lse2, delta


@triton.jit
def _row_stats(Lse2, Delta, row_ptr, rows_ok, EVEN_ROWS: tl.constexpr):
    """The stored row terms (_row_terms) of rows row_ptr: (lse2, delta); rows past the end get +inf (so p = 0)
    and 0."""
    if EVEN_ROWS:
        lse2 = tl.load(Lse2 + row_ptr)
        delta = tl.load(Delta + row_ptr)
    else:
        lse2 = tl.load(Lse2 + row_ptr, mask=rows_ok, other=float("inf"))
        delta = tl.load(Delta + row_ptr, mask=rows_ok, other=0.0)
    return lse2, delta


@triton.jit
def _dq_walk(lo, hi, dq, q, do, lse2, delta, start_m, offs_m, index_row, block_offset, seq_q, seq_kv, kv_start, off_b,
             off_h, off_hkv, K_DESC, V_DESC, k_base, v_base, scale_log2, TOKEN_MASK, BLOCK_MASK, KV_VALID, mask_block_q,
             mask_block_kv, stride_ks, stride_kd, stride_vs, stride_vd, stride_tb, stride_th, stride_tq, stride_tk,
             stride_mb, stride_mh, stride_mq, stride_vvb, offs_n0, offs_d, offs_dv, d_ok, dv_ok,
             BLOCK_KV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr,
             HAS_TOKEN_MASK: tl.constexpr, GATHER_BLOCK_MASK: tl.constexpr, HAS_KV_VALID: tl.constexpr,
             FP32_PRECISION: tl.constexpr, TMA_LOADS: tl.constexpr):
    """Steps lo..hi of the dQ kernel's walk over a kv list (entries: the blocks plus block_offset): dq [BM, BD]
    (unscaled) after them; the flags say which element tests these steps need."""
    MASKED: tl.constexpr = needs_element_tests(EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID)
    for it in range(lo, hi):
        start_n, offs_n, k, v = kv_list_tiles(
            it, index_row, block_offset, seq_kv, kv_start, off_b, off_hkv, K_DESC, V_DESC, k_base, v_base, stride_ks,
            stride_kd, stride_vs, stride_vd, offs_n0, offs_d, offs_dv, d_ok, dv_ok, BLOCK_KV, BLOCK_N, BLOCK_D,
            BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_KV, TMA_LOADS)  # [BN], [BN, BD], [BN, BDV]
        qk = dot(q, tl.trans(k), None, FP32_PRECISION)  # [BM, BN]
        p = tl.math.exp2(qk * scale_log2 - lse2[:, None])
        if MASKED:
            keep = element_keep(offs_m[:, None], offs_n[None, :], start_m, start_n, seq_q, seq_kv, off_b, off_h,
                                TOKEN_MASK, stride_tb, stride_th, stride_tq, stride_tk,
                                BLOCK_MASK, stride_mb, stride_mh, stride_mq, mask_block_q, mask_block_kv,
                                KV_VALID, stride_vvb,
                                EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID)
            p = tl.where(keep, p, 0.0)
        dp = dot(do, tl.trans(v), None, FP32_PRECISION)  # [BM, BN]
        ds = p * (dp - delta[:, None])
        dq = dot(ds.to(k.dtype), k, dq, FP32_PRECISION)  # [BM, BD]
    return dq


@triton.jit(do_not_specialize=["seq_bucket"])
def attention_bwd_dq_kernel(
    Q, K, V, K_DESC, V_DESC, DO, DQ, Out, GradLse, Lse, Lse2, Delta, KV_COUNT, KV_INDEX, TOKEN_MASK, BLOCK_MASK,
    KV_VALID, CU_SEQLENS_Q, CU_SEQLENS_KV,
    scale_log2, scale, seq_q, seq_kv, num_heads, group_size, mask_block_q, mask_block_kv, seq_bucket,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_gb, stride_gh, stride_gs,
    stride_lb, stride_lh, stride_ls,
    stride_cb, stride_ch,
    stride_ib, stride_ih, stride_iq,
    stride_tb, stride_th, stride_tq, stride_tk,
    stride_mb, stride_mh, stride_mq,
    stride_vvb,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_Q: tl.constexpr, EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_TOKEN_MASK: tl.constexpr,
    GATHER_BLOCK_MASK: tl.constexpr, HAS_KV_VALID: tl.constexpr, FP32_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, TMA_LOADS: tl.constexpr, SPLIT_WALK: tl.constexpr, FULL_TILES_FIRST: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: dQ [BM, D] of one query tile of one (batch, head), walking its query block's kv list.

    It first computes its rows' terms (_row_terms, from Out, dO, Lse and GradLse [B, H, Sq] with strides
    stride_g*) and stores them in Lse2 and Delta, which share Lse's layout (strides stride_l*), for the dK/dV
    kernel launched after it. IS_VARLEN, TMA_LOADS (K_DESC, V_DESC), SPLIT_WALK and FULL_TILES_FIRST as in the forward
    kernel."""
    tl.static_assert(BLOCK_Q % BLOCK_M == 0, "the query tile must nest in the block")
    tl.static_assert(BLOCK_KV % BLOCK_N == 0, "the key tile must nest in the block")
    TILES_PER_BLOCK: tl.constexpr = BLOCK_KV // BLOCK_N

    off_b, off_h, off_hkv, start_m, q_block, q_start, seq_q, kv_start, seq_kv = query_tile_program(
        CU_SEQLENS_Q, CU_SEQLENS_KV, seq_q, seq_kv, num_heads, group_size, BLOCK_Q, BLOCK_M, IS_VARLEN)
    if IS_VARLEN:
        if start_m >= seq_q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    m_ok = offs_m < seq_q
    rows = (q_start + offs_m[:, None]).to(tl.int64)
    q = tl.load(head_tile(Q, off_b, off_h, rows, offs_d, stride_qb, stride_qh, stride_qs, stride_qd),
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
    do = tl.load(head_tile(DO, off_b, off_h, rows, offs_dv, stride_dob, stride_doh, stride_dos, stride_dod),
                 mask=m_ok[:, None] & dv_ok[None, :], other=0.0)  # [BM, BDV]
    o = tl.load(head_tile(Out, off_b, off_h, rows, offs_dv, stride_ob, stride_oh, stride_os, stride_od),
                mask=m_ok[:, None] & dv_ok[None, :], other=0.0)  # [BM, BDV]
    row_index = (q_start + offs_m).to(tl.int64)
    row_offsets = off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + row_index * stride_ls
    lse2, delta = _row_terms(o, do, GradLse, Lse, Lse2, Delta,
                             off_b.to(tl.int64) * stride_gb + off_h.to(tl.int64) * stride_gh + row_index * stride_gs,
                             row_offsets, row_offsets, m_ok, HAS_GRAD_LSE)  # [BM] each

    count, index_row, k_base, v_base = kv_list_start(
        KV_COUNT, KV_INDEX, K, V, off_b, off_h, off_hkv, q_block, kv_start, stride_cb, stride_ch, stride_ib, stride_ih,
        stride_iq, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    total = count * TILES_PER_BLOCK
    if SPLIT_WALK or FULL_TILES_FIRST:  # as in the forward: the tiles before the tested ones run without tests
        plain, tested_offset = kv_walk_split(index_row, count, start_m, seq_kv, BLOCK_KV, TILES_PER_BLOCK, EVEN_KV,
                                             IS_CAUSAL, FULL_TILES_FIRST)
        dq = _dq_walk(0, plain, dq, q, do, lse2, delta, start_m, offs_m, index_row, 0, seq_q, seq_kv, kv_start, off_b,
                      off_h, off_hkv, K_DESC, V_DESC, k_base, v_base, scale_log2, TOKEN_MASK, BLOCK_MASK, KV_VALID,
                      mask_block_q, mask_block_kv, stride_ks, stride_kd, stride_vs, stride_vd, stride_tb, stride_th,
                      stride_tq, stride_tk, stride_mb, stride_mh, stride_mq, stride_vvb, offs_n0, offs_d, offs_dv,
                      d_ok, dv_ok, BLOCK_KV, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, False, False,
                      0, False, FP32_PRECISION, TMA_LOADS)
    else:
        plain = 0
        tested_offset = 0
    dq = _dq_walk(plain, total, dq, q, do, lse2, delta, start_m, offs_m, index_row, tested_offset, seq_q, seq_kv,
                  kv_start, off_b, off_h, off_hkv, K_DESC, V_DESC, k_base, v_base, scale_log2, TOKEN_MASK, BLOCK_MASK,
                  KV_VALID, mask_block_q, mask_block_kv, stride_ks, stride_kd, stride_vs, stride_vd, stride_tb,
                  stride_th, stride_tq, stride_tk, stride_mb, stride_mh, stride_mq, stride_vvb, offs_n0, offs_d,
                  offs_dv, d_ok, dv_ok, BLOCK_KV, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_KV, IS_CAUSAL,
                  HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID, FP32_PRECISION, TMA_LOADS)
    dq = dq * scale
    tl.store(head_tile(DQ, off_b, off_h, rows, offs_d, stride_dqb, stride_dqh, stride_dqs, stride_dqd),
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _dkdv_walk(lo, hi, first, dk, dv, k, v, start_n, offs_n, offs_m0, offs_d, offs_dv, d_ok, dv_ok, dq_tile,
               q_base, do_base, row_base, dq_base, index_row, block_offset, seq_q, seq_kv, q_start, off_b, off_h,
               kv_heads, group_size, scale_log2, Q_DESC, DO_DESC, DQ_DESC, Lse2, Delta, TOKEN_MASK, BLOCK_MASK,
               KV_VALID, mask_block_q, mask_block_kv, stride_qs, stride_qd, stride_dos, stride_dod, stride_ls,
               stride_tb, stride_th, stride_tq, stride_tk, stride_mb, stride_mh, stride_mq, stride_vvb,
               BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, EVEN_Q: tl.constexpr, EVEN_KV: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_TOKEN_MASK: tl.constexpr, GATHER_BLOCK_MASK: tl.constexpr,
               HAS_KV_VALID: tl.constexpr, FP32_PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
               DQ_MODE: tl.constexpr, TMA_LOADS: tl.constexpr):
    """Steps lo..hi of the dK/dV kernel's walk over one query head's q list (entries: the blocks plus block_offset),
    visited from step lo + first on, wrapping from hi back to lo: dk [BN, BD] and dv [BN, BDV] after them (and,
    outside DQ_MODE "kernel", their dQ shares added to DQ_ACC); the flags say which element tests these steps
    need."""
    TILES_PER_BLOCK: tl.constexpr = BLOCK_Q // BLOCK_M
    MASKED: tl.constexpr = needs_element_tests(EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID)
    for step in range(lo, hi):
        it = step + first
        it = tl.where(it >= hi, it - (hi - lo), it)
        q_block = tl.load(index_row + it // TILES_PER_BLOCK) - block_offset
        start_m = q_block * BLOCK_Q + (it % TILES_PER_BLOCK) * BLOCK_M
        offs_m = start_m + offs_m0
        m_ok = offs_m < seq_q
        rows = offs_m[:, None].to(tl.int64)
        q = load_tile_or_box(Q_DESC, off_b, off_h, q_start + start_m,
                             q_base + rows * stride_qs + offs_d[None, :] * stride_qd,
                             m_ok, d_ok, EVEN_Q, HEAD_DIM == BLOCK_D, TMA_LOADS, BLOCK_M, BLOCK_D)  # [BM, BD]
        do = load_tile_or_box(DO_DESC, off_b, off_h, q_start + start_m,
                              do_base + rows * stride_dos + offs_dv[None, :] * stride_dod,
                              m_ok, dv_ok, EVEN_Q, HEAD_DIM_V == BLOCK_DV, TMA_LOADS, BLOCK_M, BLOCK_DV)  # [BM, BDV]
        lse2, delta = _row_stats(Lse2, Delta, row_base + offs_m.to(tl.int64) * stride_ls, m_ok, EVEN_Q)
        kq = dot(k, tl.trans(q), None, FP32_PRECISION)  # [BN, BM]
        p_t = tl.math.exp2(kq * scale_log2 - lse2[None, :])
        if MASKED:
            keep = element_keep(offs_m[None, :], offs_n[:, None], start_m, start_n, seq_q, seq_kv, off_b, off_h,
                                TOKEN_MASK, stride_tb, stride_th, stride_tq, stride_tk,
                                BLOCK_MASK, stride_mb, stride_mh, stride_mq, mask_block_q, mask_block_kv,
                                KV_VALID, stride_vvb,
                                EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID)
            p_t = tl.where(keep, p_t, 0.0)
        dv = dot(p_t.to(do.dtype), do, dv, FP32_PRECISION)  # [BN, BDV]
        dp_t = dot(v, tl.trans(do), None, FP32_PRECISION)  # [BN, BM]
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dot(ds_t.to(q.dtype), q, dk, FP32_PRECISION)  # [BN, BD]
        if DQ_MODE != "kernel":
            dq_part = dot(tl.trans(ds_t.to(k.dtype)), k, None, FP32_PRECISION)  # [BM, BD], unscaled
            if DQ_MODE == "tma":
                # Rows past this sequence's end carry exact zeros (their P is 0), so the bulk add may cover
                # them; the descriptor clips at the buffer's edges.
                acc_head = off_h if IS_VARLEN else off_b * kv_heads * group_size + off_h
                DQ_DESC.atomic_add([acc_head, q_start + start_m, 0],
                                   dq_part.reshape(1, BLOCK_M, BLOCK_D))
            else:
                # The accumulator's rows are BD wide, so a tile is one base pointer plus fixed offsets; columns
                # past D add zeros into padding, and only rows past the buffer's end need a mask.
                dq_ptrs = dq_base + start_m * BLOCK_D + dq_tile
                if EVEN_Q:
                    tl.atomic_add(dq_ptrs, dq_part, sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq_part, mask=m_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["seq_bucket"])
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, Q_DESC, DO_DESC, DK, DV, DQ_ACC, DQ_DESC, Lse2, Delta, Q_COUNT, Q_INDEX, TOKEN_MASK, BLOCK_MASK, KV_VALID,
    CU_SEQLENS_Q, CU_SEQLENS_KV,
    scale_log2, scale, seq_q, seq_kv, kv_heads, group_size, mask_block_q, mask_block_kv, seq_bucket,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_qab, stride_qah,
    stride_lb, stride_lh, stride_ls,
    stride_cb, stride_ch,
    stride_ib, stride_ih, stride_iq,
    stride_tb, stride_th, stride_tq, stride_tk,
    stride_mb, stride_mh, stride_mq,
    stride_vvb,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_Q: tl.constexpr, EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_TOKEN_MASK: tl.constexpr,
    GATHER_BLOCK_MASK: tl.constexpr, HAS_KV_VALID: tl.constexpr, FP32_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, DQ_MODE: tl.constexpr, TMA_LOADS: tl.constexpr, SPLIT_WALK: tl.constexpr,
    FULL_TILES_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: dK [BN, D] and dV [BN, Dv] of one key tile of one (batch, kv head), summed over the query heads
    of its group in a fixed order, each walking its q list for this key block.

    DQ_MODE "atomic" / "tma" (see DQ_MODES): also add this tile's share of dQ, without the softmax scale, into
    DQ_ACC (fp32 [B * H, Sq, BD], rows BD apart, zeroed; [H, T, BD] for a packed batch) with element atomics, or
    through DQ_DESC, a tensor descriptor of DQ_ACC with block [1, BLOCK_M, BD]. That saves the dQ kernel's
    recomputation of P and dP, but dQ's summation order then varies between runs. TMA_LOADS: Q and dO tiles come
    through Q_DESC / DO_DESC (kernels/tma.py). SPLIT_WALK: forward.split_walk() and IS_CAUSAL, on the host.
    FULL_TILES_FIRST: as in the forward, the q lists stored plus nq = cdiv(seq_q, BLOCK_Q) past their full tiles."""
    tl.static_assert(BLOCK_Q % BLOCK_M == 0, "the query tile must nest in the block")
    tl.static_assert(BLOCK_KV % BLOCK_N == 0, "the key tile must nest in the block")
    TILES_PER_BLOCK: tl.constexpr = BLOCK_Q // BLOCK_M

    pid_n = tl.program_id(0)
    off_b, off_hkv = batch_and_head(kv_heads)
    start_n = pid_n * BLOCK_N
    kv_block = start_n // BLOCK_KV
    q_start, seq_q = sequence_span(CU_SEQLENS_Q, off_b, seq_q, IS_VARLEN)
    kv_start, seq_kv = sequence_span(CU_SEQLENS_KV, off_b, seq_kv, IS_VARLEN)
    if IS_VARLEN:
        if start_n >= seq_kv:
            return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_m0 = tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    n_ok = offs_n < seq_kv
    keys = (kv_start + offs_n[:, None]).to(tl.int64)

    k = tl.load(head_tile(K, off_b, off_hkv, keys, offs_d, stride_kb, stride_kh, stride_ks, stride_kd),
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BN, BD]
    v = tl.load(head_tile(V, off_b, off_hkv, keys, offs_dv, stride_vb, stride_vh, stride_vs, stride_vd),
                mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # [BN, BDV]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dq_tile = offs_m0[:, None] * BLOCK_D + offs_d[None, :]  # [BM, BD] offsets of a dQ tile in DQ_ACC

    for g in range(0, group_size):
        off_h = off_hkv * group_size + g
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qs
        do_base = (DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                   + q_start.to(tl.int64) * stride_dos)
        row_base = off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + q_start.to(tl.int64) * stride_ls
        dq_base = (DQ_ACC + off_b.to(tl.int64) * stride_qab + off_h.to(tl.int64) * stride_qah
                   + q_start.to(tl.int64) * BLOCK_D)
        count = tl.load(Q_COUNT + off_b * stride_cb + off_h * stride_ch + kv_block)
        index_row = Q_INDEX + off_b.to(tl.int64) * stride_ib + off_h.to(tl.int64) * stride_ih + kv_block * stride_iq
        total = count * TILES_PER_BLOCK
        if SPLIT_WALK:
            # A causal list starts at the diagonal, so the walk is the list in order, and only its first blocks
            # hold queries before this tile's last key: those steps test the diagonal, the rest run without.
            tested = first_entry_at_or_after(
                index_row, count, (start_n + BLOCK_N - 1 + BLOCK_Q - 1) // BLOCK_Q) * TILES_PER_BLOCK
            dk, dv = _dkdv_walk(
                0, tested, 0, dk, dv, k, v, start_n, offs_n, offs_m0, offs_d, offs_dv, d_ok, dv_ok, dq_tile,
                q_base, do_base, row_base, dq_base, index_row, 0, seq_q, seq_kv, q_start, off_b, off_h, kv_heads,
                group_size, scale_log2, Q_DESC, DO_DESC, DQ_DESC, Lse2, Delta, TOKEN_MASK, BLOCK_MASK, KV_VALID,
                mask_block_q, mask_block_kv, stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_tb,
                stride_th, stride_tq, stride_tk, stride_mb, stride_mh, stride_mq, stride_vvb, BLOCK_Q, BLOCK_M, BLOCK_D,
                BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_Q, EVEN_KV, True, False, False, False, FP32_PRECISION, IS_VARLEN,
                DQ_MODE, TMA_LOADS)
            dk, dv = _dkdv_walk(
                tested, total, 0, dk, dv, k, v, start_n, offs_n, offs_m0, offs_d, offs_dv, d_ok, dv_ok, dq_tile,
                q_base, do_base, row_base, dq_base, index_row, 0, seq_q, seq_kv, q_start, off_b, off_h, kv_heads,
                group_size, scale_log2, Q_DESC, DO_DESC, DQ_DESC, Lse2, Delta, TOKEN_MASK, BLOCK_MASK, KV_VALID,
                mask_block_q, mask_block_kv, stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_tb,
                stride_th, stride_tq, stride_tk, stride_mb, stride_mh, stride_mq, stride_vvb, BLOCK_Q, BLOCK_M,
                BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_Q, EVEN_KV, False, False, False, False,
                FP32_PRECISION, IS_VARLEN, DQ_MODE, TMA_LOADS)
        else:
            # Each walk starts at the query block on this key block's diagonal and wraps around within its part of
            # the list (a fixed order: deterministic), so that programs of neighbouring key tiles do not all read
            # the same query tile at once. FULL_TILES_FIRST: the full tiles first, without tests, then the others,
            # stored plus nq.
            diagonal = (kv_block * BLOCK_KV) // BLOCK_Q
            if FULL_TILES_FIRST:
                tested_offset = tl.cdiv(seq_q, BLOCK_Q)
                full = first_entry_at_or_after(index_row, count, tested_offset)
                plain = full * TILES_PER_BLOCK
                first = first_entry_at_or_after(index_row, full, diagonal) * TILES_PER_BLOCK
                dk, dv = _dkdv_walk(
                    0, plain, first, dk, dv, k, v, start_n, offs_n, offs_m0, offs_d, offs_dv, d_ok, dv_ok, dq_tile,
                    q_base, do_base, row_base, dq_base, index_row, 0, seq_q, seq_kv, q_start, off_b, off_h, kv_heads,
                    group_size, scale_log2, Q_DESC, DO_DESC, DQ_DESC, Lse2, Delta, TOKEN_MASK, BLOCK_MASK, KV_VALID,
                    mask_block_q, mask_block_kv, stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_tb,
                    stride_th, stride_tq, stride_tk, stride_mb, stride_mh, stride_mq, stride_vvb, BLOCK_Q, BLOCK_M,
                    BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, True, False, False, 0, False, FP32_PRECISION,
                    IS_VARLEN, DQ_MODE, TMA_LOADS)
            else:
                tested_offset = 0
                full = 0
                plain = 0
            first = first_entry_at_or_after(index_row + full, count - full, diagonal + tested_offset) * TILES_PER_BLOCK
            dk, dv = _dkdv_walk(
                plain, total, first, dk, dv, k, v, start_n, offs_n, offs_m0, offs_d, offs_dv, d_ok, dv_ok, dq_tile,
                q_base, do_base, row_base, dq_base, index_row, tested_offset, seq_q, seq_kv, q_start, off_b, off_h,
                kv_heads, group_size, scale_log2, Q_DESC, DO_DESC, DQ_DESC, Lse2, Delta, TOKEN_MASK, BLOCK_MASK,
                KV_VALID, mask_block_q, mask_block_kv, stride_qs, stride_qd, stride_dos, stride_dod, stride_ls,
                stride_tb, stride_th, stride_tq, stride_tk, stride_mb, stride_mh, stride_mq, stride_vvb, BLOCK_Q,
                BLOCK_M, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_Q, EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK,
                GATHER_BLOCK_MASK, HAS_KV_VALID, FP32_PRECISION, IS_VARLEN, DQ_MODE, TMA_LOADS)
    dk = dk * scale
    n_store = n_ok[:, None]
    tl.store(head_tile(DK, off_b, off_hkv, keys, offs_d, stride_dkb, stride_dkh, stride_dks, stride_dkd),
             dk.to(DK.dtype.element_ty), mask=n_store & d_ok[None, :])
    tl.store(head_tile(DV, off_b, off_hkv, keys, offs_dv, stride_dvb, stride_dvh, stride_dvs, stride_dvd),
             dv.to(DV.dtype.element_ty), mask=n_store & dv_ok[None, :])


def attention_backward(grad_out, q, k, v, out, lse, kv_count, kv_index, q_count, q_index, block_q: int,
                       block_kv: int, scale: float, grad_lse: Optional[torch.Tensor] = None,
                       token_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                       block_mask: Optional[torch.Tensor] = None, mask_block_q: int = 0, mask_block_kv: int = 0,
                       kv_valid: Optional[torch.Tensor] = None, varlen: Optional[Varlen] = None,
                       dq_mode: Optional[str] = None, needs: tuple = (True, True, True)):
    """Launch the backward: (dq, dk, dv) shaped (and strided) like (q, k, v), from the forward's out and lse
    (natural log).

    Lists, masks and varlen as in forward.attention_forward; q_count int32 [Bm, Hm, nk], q_index int32
    [Bm, Hm, nk, L]. dq_mode: one of DQ_MODES or "auto", None for DQ_MODE_DEFAULT (see resolve_dq_mode); with
    None and the default "auto", a call warp_specialized_module accepts runs kernels/backward_ws.py instead.
    needs: which of (dq, dk, dv) to compute. Without dq the dQ kernel does not run, without dk and dv the dK/dV
    kernel does not (either side alone runs in mode "kernel"); what was not computed comes back None."""
    need_dq, need_dkdv = needs[0], needs[1] or needs[2]
    if not need_dq and not need_dkdv:
        return None, None, None
    heads, kv_heads = q.shape[1], k.shape[1]
    packed = varlen is not None
    device = q.device
    if 0 in lse.stride():
        lse = lse.contiguous()
    warp_specialized = need_dq and need_dkdv and warp_specialized_module(
        q, k, v, grad_out, block_q, block_kv, is_causal, token_mask, block_mask, kv_valid, varlen, dq_mode)
    if warp_specialized:
        # the row terms in one buffer whose layout TMA can read (backward_ws.row_terms_buffer)
        terms = warp_specialized.row_terms_buffer(q.shape[0], heads, q.shape[2], device)
        lse2, delta = terms[:, :, 0], terms[:, :, 1]
        accumulate = True  # its dQ tiles go into dq_acc, through the TMA unit
    else:
        # The row terms in lse's layout (for "thd" batches a token-major one): the Triton kernels read all three with
        # one set of strides.
        delta = buffers.empty_strided(lse.shape, lse.stride(), dtype=torch.float32, device=device)
        lse2 = buffers.empty_strided(lse.shape, lse.stride(), dtype=torch.float32, device=device)
        dq_mode = resolve_dq_mode(dq_mode, attention_bwd_dkdv_kernel, device)
        if not (need_dq and need_dkdv):
            dq_mode = "kernel"  # one side alone: its own kernel, no atomics
        accumulate = dq_mode != "kernel"
    if grad_lse is not None:
        grad_lse = grad_lse.float()
    row_terms = dict(Out=out, GradLse=delta if grad_lse is None else grad_lse, Lse=lse, Lse2=lse2, Delta=delta)
    if accumulate:
        # fp32 [B * H, Sq, BD] (a packed batch: [H, T, BD]); BD-wide rows keep a descriptor's strides aligned. The
        # preprocess zeroes it.
        block_d = head_dims(q, v)[2]
        dq_acc = buffers.empty(q.shape[0] * heads, q.shape[2], block_d, device=device, dtype=torch.float32)
        dq_acc4 = dq_acc.view(q.shape[0], heads, q.shape[2], block_d)
    else:
        dq_acc = dq_acc4 = None
    seen = {}  # the tensors' plan keys, shared by this call's launches (launch.layout_key)
    if accumulate or not need_dq:  # (else the dQ kernel computes the row terms: a launch fewer)
        # (dq_acc4's layout follows from out's and its width BD, which the key holds)
        # (lse2's and delta's layout, left out of the plan key, follows from lse's and whether the Gluon kernel runs)
        launch.run(attention_bwd_preprocess_kernel,
                   (heads, grad_lse is None, dq_acc4.shape[3] if accumulate else 0, bool(warp_specialized)),
                   dict(row_terms, DO=grad_out, DQ_ACC=dq_acc4 if accumulate else delta),
                   lambda: _preprocess_spec(out, grad_out, grad_lse, lse, delta, heads, dq_acc4), fresh=_FRESH,
                   seen=seen)

    dq = buffers.empty_like(q) if need_dq else None
    dk, dv = (buffers.empty_like(k), buffers.empty_like(v)) if need_dkdv else (None, None)
    if warp_specialized:  # (D = BD, 64 or 128: dq_acc4 is the contiguous [B, H, Sq, D] buffer it adds into)
        warp_specialized.attention_backward_ws(q, k, v, grad_out, terms, q_count, q_index, block_q, block_kv,
                                               scale * LOG2E, bool(is_causal), dq_acc4, dk, dv)
        _finish_dq(dq_acc4, dq, scale)
        return dq, dk, dv
    shared = dict(Q=q, K=k, V=v, DO=grad_out, Lse2=lse2, Delta=delta,
                  **optional_tensors(lse, token_mask, block_mask, kv_valid, varlen))
    site = site_key(block_q, block_kv, scale, is_causal, token_mask, block_mask, mask_block_q, mask_block_kv,
                    kv_valid, varlen, q.dtype) + (dq_mode, tma.DKDV_TMA_LOADS)
    batch, seq_q, seq_kv = (varlen.batch, varlen.max_q, varlen.max_kv) if packed else (q.shape[0], q.shape[2],
                                                                                        k.shape[2])
    work = batch * heads * seq_q * seq_kv * q.shape[-1]  # the dense problem's, for tma.tile_args

    def common() -> dict:
        """The keyword arguments both kernels take beside their tensors (built on a plan miss only)."""
        head_dim, head_dim_v, block_d, block_dv = head_dims(q, v)
        gather = gather_mode(block_mask, block_q, block_kv, mask_block_q, mask_block_kv)
        even_kv = forward.whole_blocks(seq_kv, block_kv, packed)
        return dict(
            scale_log2=scale * LOG2E, scale=scale, seq_q=seq_q, seq_kv=seq_kv, group_size=heads // kv_heads,
            mask_block_q=mask_block_q if gather else block_q,
            mask_block_kv=mask_block_kv if gather or kv_valid is not None else block_kv,
            seq_bucket=autotune.seq_bucket(max(seq_q, seq_kv)),
            **stride_args("q", q, "bhsd"), **stride_args("k", k, "bhsd"), **stride_args("v", v, "bhsd"),
            **stride_args("do", grad_out, "bhsd"), **stride_args("l", lse, "bhs"),
            **stride_args("t", token_mask, "bhqk"), **stride_args("m", block_mask, "bhq"),
            stride_vvb=strides(kv_valid, 1)[0],
            BLOCK_Q=block_q, BLOCK_KV=block_kv, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d,
            BLOCK_DV=block_dv, EVEN_Q=forward.whole_blocks(seq_q, block_q, packed),
            EVEN_KV=even_kv, IS_CAUSAL=bool(is_causal),
            HAS_TOKEN_MASK=token_mask is not None, GATHER_BLOCK_MASK=gather, HAS_KV_VALID=kv_valid is not None,
            FP32_PRECISION=fp32_precision(q.dtype, attention_bwd_dq_kernel), IS_VARLEN=packed,
            SPLIT_WALK=forward.split_walk(is_causal, even_kv, token_mask, block_mask, kv_valid),
            FULL_TILES_FIRST=forward.full_tiles_first(block_mask is not None, mask_block_kv > block_kv, token_mask,
                                                      kv_valid, varlen))

    if need_dq and not accumulate:
        def build_dq() -> launch.LaunchSpec:
            static = common()
            block_d, block_dv, elt = static["BLOCK_D"], static["BLOCK_DV"], q.element_size()
            configs = autotune.nesting(
                "BWD_DQ", block_q, block_kv,
                smem_per_stage=lambda bm, bn: bn * (block_d + block_dv) * elt,
                fixed_smem=lambda bm, bn: bm * (block_d + block_dv) * elt, cache_key=(block_d, block_dv, elt),
                fp32_precision=static["FP32_PRECISION"])
            kv_tiles = tma.tile_args(attention_bwd_dq_kernel, packed, work, K_DESC=k, V_DESC=v)
            static.update(kv_tiles, num_heads=heads, HAS_GRAD_LSE=grad_lse is not None,
                          **stride_args("dq", dq, "bhsd"), **stride_args("o", out, "bhsd"),
                          **stride_args("g", row_terms["GradLse"], "bhs"),
                          **stride_args("c", kv_count, "bh"), **stride_args("i", kv_index, "bhq"))
            return launch.LaunchSpec(
                grid=lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), *launch.batch_head_axes(batch, heads)),
                configs=configs,
                tuning_key=TUNING_KEY, static=static, pre_hook=tma.set_boxes if kv_tiles["TMA_LOADS"] else None)
        # The dK/dV kernel, launched after this one on the same stream, reads the row terms it stores.
        launch.run(attention_bwd_dq_kernel, site + (grad_lse is None, autotune.env_key("BWD_DQ")),
                   dict(shared, **row_terms, K_DESC=k, V_DESC=v, DQ=dq, KV_COUNT=kv_count, KV_INDEX=kv_index),
                   build_dq, fresh=_FRESH, seen=seen)

    def build_dkdv() -> launch.LaunchSpec:
        static = common()
        block_d, block_dv, elt = static["BLOCK_D"], static["BLOCK_DV"], q.element_size()
        configs = autotune.nesting(
            "BWD_DKDV", block_q, block_kv,
            smem_per_stage=lambda bm, bn: bm * (block_d + block_dv) * elt,
            fixed_smem=lambda bm, bn: bn * (block_d + block_dv) * elt + (bm * block_d * 4 if dq_mode == "tma" else 0),
            cache_key=(block_d, block_dv, elt, dq_mode), fp32_precision=static["FP32_PRECISION"])
        q_tiles = tma.tile_args(attention_bwd_dkdv_kernel, packed, work,
                                use=tma.DKDV_TMA_LOADS and not accumulate, Q_DESC=q, DO_DESC=grad_out)
        dq_desc = tma.accumulator_descriptor(dq_acc) if dq_mode == "tma" else None
        # The dK/dV walk splits only for causal lists (the sequence's end is tested per key tile there).
        static.update(q_tiles, DQ_DESC=dq_desc, kv_heads=kv_heads, DQ_MODE=dq_mode,
                      SPLIT_WALK=static["SPLIT_WALK"] and bool(is_causal),
                      **stride_args("dk", dk, "bhsd"), **stride_args("dv", dv, "bhsd"),
                      **stride_args("c", q_count, "bh"), **stride_args("i", q_index, "bhq"),
                      **stride_args("qa", dq_acc4 if accumulate else None, "bh"))
        return launch.LaunchSpec(
            grid=lambda meta: (triton.cdiv(seq_kv, meta["BLOCK_N"]), *launch.batch_head_axes(batch, kv_heads)),
            configs=configs,
            tuning_key=TUNING_KEY + ("DQ_MODE",), static=static,
            pre_hook=tma.set_boxes if dq_desc is not None or q_tiles["TMA_LOADS"] else None,
            reset_to_zero=("DQ_ACC",) if accumulate else ())
    if not need_dkdv:
        return dq, None, None
    dkdv_tensors = dict(shared, Q_DESC=q, DO_DESC=grad_out, DK=dk, DV=dv, DQ_ACC=dq_acc4 if accumulate else delta,
                        Q_COUNT=q_count, Q_INDEX=q_index)
    if dq_mode == "tma":
        dkdv_tensors["DQ_DESC"] = dq_acc
    launch.run(attention_bwd_dkdv_kernel, site + (autotune.env_key("BWD_DKDV"),), dkdv_tensors, build_dkdv,
               fresh=_FRESH, seen=seen)
    if accumulate:
        _finish_dq(dq_acc4, dq, scale)
    return dq, dk, dv


def _finish_dq(dq_acc4: torch.Tensor, dq: torch.Tensor, scale: float) -> None:
    """dq = scale * dq_acc4[..., :D] in dq's dtype (the accumulating modes add their dQ tiles unscaled).
    dq_acc4 fp32 [B, H, Sq, BD] contiguous, dq [B, H, Sq, D] (a packed batch: B = 1, Sq = T)."""
    def spec() -> launch.LaunchSpec:
        static = dict(scale=scale, seq_q=dq.shape[2], num_heads=dq.shape[1], **stride_args("a", dq_acc4, "bhs"),
                      **stride_args("q", dq, "bhsd"), HEAD_DIM=dq.shape[3], BLOCK_D=dq_acc4.shape[3])
        return launch.LaunchSpec(grid=lambda meta: (triton.cdiv(dq.shape[2], meta["BLOCK_M"]),
                                                    *launch.batch_head_axes(dq.shape[0], dq.shape[1])),
                                 configs=_PREPROCESS_CONFIGS, tuning_key=(), static=static)
    # (both tensors in the plan key: their layouts follow from nothing else it holds)
    launch.run(attention_bwd_dq_finish_kernel, (scale,), dict(DQ_ACC=dq_acc4, DQ=dq), spec)


def warp_specialized_module(q, k, v, grad_out, block_q: int, block_kv: int, is_causal: bool, token_mask, block_mask,
                            kv_valid, varlen, dq_mode: Optional[str]):
    """kernels/backward_ws when its warp-specialized Gluon backward runs this call, else None: the dQ mode left to
    the default ("auto", and dq_mode None), compiled Triton on a CUDA tensor, descriptor loads allowed
    (tma.TMA_LOADS), a Triton from forward.GLUON_MIN_TRITON on, and backward_ws.plan's conditions."""
    if dq_mode is not None or DQ_MODE_DEFAULT != "auto":
        return None
    if not q.is_cuda or not tma.TMA_LOADS or autotune.is_interpreted(attention_bwd_dkdv_kernel):
        return None
    if forward._triton_version() < forward.GLUON_MIN_TRITON:
        return None
    backward_ws = forward.gluon_module("backward_ws")
    chosen = backward_ws.plan(q, k, v, grad_out, block_q, block_kv, is_causal=is_causal, token_mask=token_mask,
                              block_mask=block_mask, kv_valid=kv_valid, varlen=varlen,
                              min_work=tma.MIN_DESCRIPTOR_WORK)
    return backward_ws if chosen else None


# The preprocess kernel's one tile: 64 rows of O and dO per program.
_PREPROCESS_CONFIGS = [triton.Config({"BLOCK_M": 64}, num_warps=4)]


def _preprocess_spec(out, grad_out, grad_lse, lse, delta, heads: int, dq_acc4: Optional[torch.Tensor]
                     ) -> launch.LaunchSpec:
    head_dim_v, block_dv = out.shape[-1], head_dims(out, out)[3]
    rows = delta if grad_lse is None else grad_lse
    static = dict(seq_q=out.shape[2], num_heads=heads, **stride_args("o", out, "bhsd"),
                  **stride_args("d", grad_out, "bhsd"), **stride_args("g", rows, "bhs"),
                  **stride_args("l", lse, "bhs"), **stride_args("e", delta, "bhs"), **stride_args("a", dq_acc4, "bhs"),
                  HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, HAS_GRAD_LSE=grad_lse is not None,
                  ZERO_DQ_ACC=dq_acc4 is not None, BLOCK_D=1 if dq_acc4 is None else dq_acc4.shape[3])
    return launch.LaunchSpec(grid=lambda meta: (triton.cdiv(out.shape[2], meta["BLOCK_M"]),
                                                *launch.batch_head_axes(out.shape[0], heads)),
                             configs=_PREPROCESS_CONFIGS, tuning_key=(), static=static)


def resolve_dq_mode(dq_mode: Optional[str], kernel_fn, device: torch.device) -> str:
    """The dQ mode to run: "kernel" whenever torch.are_deterministic_algorithms_enabled(); otherwise dq_mode, or
    DQ_MODE_DEFAULT for None ("auto": the measured fastest, now "kernel"). "tma" needs
    compiled Triton with tensor-descriptor reductions on a GPU of compute capability 9 or more; where it is
    missing, a default of "tma" runs "atomic", an explicit "tma" raises."""
    if dq_mode is not None and dq_mode not in DQ_MODES + ("auto",):
        raise ValueError(f"dq_mode must be one of {DQ_MODES + ('auto',)} or None, got {dq_mode!r}")
    if torch.are_deterministic_algorithms_enabled():
        return "kernel"
    mode = DQ_MODE_DEFAULT if dq_mode is None else dq_mode
    if mode == "auto":
        mode = "kernel"
    if mode == "tma" and not tma.reductions_available(kernel_fn, device):
        if dq_mode == "tma":
            raise ValueError("dq_mode='tma' needs Triton tensor-descriptor reductions on a GPU of compute "
                             "capability >= 9 (not the interpreter)")
        mode = "atomic"
    return mode
