"""Block-sparse attention forward: kernel and launcher. Derivation notes: kernels/README.md."""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch
import triton
import triton.language as tl

from . import autotune, buffers, launch, tma
from .bounds import all_seen, keeps_offsets, key_norm_parts, score_bounds, sums_within
from .quant import quantize_columns, quantize_rows
from .primitives import (dot, element_keep, gather_mode, head_tile, int32_to_float, kv_list_start, kv_list_tiles,
                         kv_walk_split, needs_element_tests, query_tile_program, round_to_int8, to_float8)
from .varlen import Varlen

LOG2E = 1.4426950408889634
LOG2_FP8_MAX: tl.constexpr = tl.constexpr(8.807354922057604)  # log2(448), quant.FP8_MAX
LOG2_INT8_MAX: tl.constexpr = tl.constexpr(6.988684686772166)  # log2(127), quant.INT8_MAX
# The kernels' QUANT_PV flag for each quant scheme that rounds P @ V too, and the narrowest key tile those take: the
# GPU's 8-bit products reduce over 32 at a time (P @ V reduces over the tile's keys).
PV_FORMATS = {"int8-fp8": "fp8", "int8-int8": "int8"}
PV_MIN_TILE_KV = 32
# The kv-list walks (forward, dQ) and the dK/dV walk run the blocks that need no element test in a loop without
# tests, when the only tests are the causal diagonal and the sequence's end (SPLIT_WALK; kernels/README.md).
# Benchmarks and tests set False to run the single tested walk.
SPLIT_WALKS = True
# Head dims whose walk keeps each row's exponent offset fixed after its first key tile (kernels/README.md, "Fixed
# offsets"): the later tiles then take no row maxima and no rescale of the accumulator. fp16 keeps them where a bound
# on the rows' scores shows no later score rises above them by more than bounds.FIXED_HEADROOM (as
# forward_ws.FIXED_OFFSET_DIMS does); bf16 and fp32, whose P reach 2^128, keep them wherever every row has a key in
# the first tile, and check the rise after the walk instead (bounds.sums_within), walking again with running maxima
# where a row's sum passed 2^bounds.RISE_LIMIT: no bound, so no pass over k, and no norms too large for one (random
# directions rise 4-38 log2 units where the bound's gap reaches 144: benchmarks/offset_bounds.py). Not for quant.
# None yet. Its GPU tests pass (tests/test_fixed_offsets.py, forty-sixth session), and at D=64 B1 H24 S32k it ran
# 1.05-1.13x as fast as the running maxima (`benchmarks/ws_forward.py --cases d64 --triton-fixed-offsets`), but
# there the warp-specialized forward runs; the sizes this kernel serves at D=64 (under MIN_KEYS, B8 S1024-4096) and
# the other head dims are not timed yet, and a first call compiles up to four loops instead of one or two: fp32 with
# its products on the FMA units (D=80, kv_valid) took 20-90 s a candidate tile to compile with them, 5-17 s without
# (Triton 3.6 for sm_90, offline, fifty-eighth session), minutes for the autotuner's five.
FIXED_OFFSET_DIMS: tuple = ()


def whole_blocks(seq: int, block: int, packed: bool) -> bool:
    """The kernels' EVEN_Q / EVEN_KV flag: every tile of a listed block lies inside the sequence (a padded batch
    whose length is a multiple of the block; a packed batch's sequences end anywhere)."""
    return seq % block == 0 and not packed


def split_walk(is_causal: bool, even_kv: bool, token_mask, block_mask, kv_valid) -> bool:
    """The kernels' SPLIT_WALK flag: SPLIT_WALKS is on and the only element tests are the causal diagonal and
    the sequence's end (a ragged or packed last key block)."""
    return (SPLIT_WALKS and (bool(is_causal) or not even_kv) and token_mask is None and block_mask is None
            and kv_valid is None)


@triton.jit
def _log2_pv_max(QUANT_PV: tl.constexpr):
    """log2 of V's format's largest value (QUANT_PV "fp8": FP8_MAX, "int8": INT8_MAX), the factor P carries."""
    if QUANT_PV == "fp8":
        log2_max = LOG2_FP8_MAX
    else:
        log2_max = LOG2_INT8_MAX
    return log2_max


def full_tiles_first(gathered: bool, key_tiles: bool, token_mask, kv_valid, varlen) -> bool:
    """The kernels' FULL_TILES_FIRST flag, which blockattn.api asks too to build the lists to match
    (BlockSparsity.full_first): no token mask (its elements vary inside any tile) and not a packed batch (each
    sequence ends elsewhere while the lists are shared), and either a gathered block mask (gathered: the lists are
    its tile view, cached on the BlockSparsity) without kv_valid, or kv_valid with the lists over key tiles split
    from its wider blocks (key_tiles), so that padding-only tiles drop out. kv_valid's lists are rebuilt on every
    call; over unsplit blocks or a gathered view that cost more than the untested walk saved (BENCHMARKS.md,
    fourteenth session), so those keep the plain lists and test every tile."""
    if token_mask is not None or varlen is not None:
        return False
    if kv_valid is None:
        return gathered
    return key_tiles and not gathered


@triton.jit
def _running_step(qk, m_i, l_i, acc, score_scale, scale_log2, MASKED: tl.constexpr, QUANT_PV: tl.constexpr):
    """One step of the online softmax on scores qk [BM, BN] (-inf where masked): (p [BM, BN], the running max m_i,
    sum l_i [BM] and accumulator acc [BM, BDV] after it, acc rescaled but without this step's P @ V)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    if MASKED:
        # A row that has seen only masked keys keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    if QUANT_PV is not None:  # P times V's format's largest value, folded into the shift: P spans the format
        p = tl.math.exp2(qk * score_scale - (m_shift - _log2_pv_max(QUANT_PV))[:, None])  # [BM, BN]
    else:
        p = tl.math.exp2(qk * score_scale - m_shift[:, None])  # [BM, BN]
    alpha = tl.math.exp2(m_i - m_shift)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def _forward_walk(lo, hi, m_i, l_i, acc, walk, block_offset,
                  BLOCK_KV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  HAS_TOKEN_MASK: tl.constexpr, GATHER_BLOCK_MASK: tl.constexpr, HAS_KV_VALID: tl.constexpr,
                  FP32_PRECISION: tl.constexpr, TMA_LOADS: tl.constexpr, QUANT_QK: tl.constexpr,
                  QUANT_PV: tl.constexpr, FIXED: tl.constexpr):
    """Steps lo..hi of the walk over a kv list (entries: the blocks plus block_offset): the online softmax state
    (m_i, l_i [BM], acc [BM, BDV]) after them. walk: the program's query tile, list and tensors (as the kernel packs
    them). The flags say which element tests these steps need (none: a plain loop).
    FIXED: the offsets m_i stay (finite; no score rises far past them, by a bound or checked after the walk:
    FIXED_OFFSET_DIMS), so a step takes no row maxima and the accumulator no rescale.
    QUANT_QK: q and K are int8, each key's scale at k_scale_base + n * stride_kss, and scale_log2 is a row
    vector [BM] (each query's scale times scale * log2(e)) instead of a scalar. QUANT_PV "fp8": V is float8 e4m3
    and P is too, scaled by FP8_MAX; "int8": V is int8 and P is too, scaled by INT8_MAX and rounded to an integer
    (l_i and acc carry that factor)."""
    (q, start_m, offs_m, index_row, seq_q, seq_kv, kv_start, off_b, off_h, off_hkv, K_DESC, V_DESC, k_base, v_base,
     scale_log2, TOKEN_MASK, BLOCK_MASK, KV_VALID, mask_block_q, mask_block_kv, stride_ks, stride_kd, stride_vs,
     stride_vd, stride_tb, stride_th, stride_tq, stride_tk, stride_mb, stride_mh, stride_mq, stride_vvb, offs_n0,
     offs_d, offs_dv, d_ok, dv_ok, k_scale_base, stride_kss) = walk
    MASKED: tl.constexpr = needs_element_tests(EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID)
    for it in range(lo, hi):
        start_n, offs_n, k, v = kv_list_tiles(
            it, index_row, block_offset, seq_kv, kv_start, off_b, off_hkv, K_DESC, V_DESC, k_base, v_base, stride_ks,
            stride_kd, stride_vs, stride_vd, offs_n0, offs_d, offs_dv, d_ok, dv_ok, BLOCK_KV, BLOCK_N, BLOCK_D,
            BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_KV, TMA_LOADS)  # [BN], [BN, BD], [BN, BDV]
        if QUANT_QK:
            if EVEN_KV:
                k_scale = tl.load(k_scale_base + offs_n * stride_kss)  # [BN]
            else:
                k_scale = tl.load(k_scale_base + offs_n * stride_kss, mask=offs_n < seq_kv, other=0.0)
            qk = int32_to_float(tl.dot(q, tl.trans(k), out_dtype=tl.int32)) * k_scale[None, :]  # [BM, BN]
            score_scale = scale_log2[:, None]
        else:
            qk = dot(q, tl.trans(k), None, FP32_PRECISION)  # [BM, BN]
            score_scale = scale_log2
        if MASKED:
            keep = element_keep(offs_m[:, None], offs_n[None, :], start_m, start_n, seq_q, seq_kv, off_b, off_h,
                                TOKEN_MASK, stride_tb, stride_th, stride_tq, stride_tk,
                                BLOCK_MASK, stride_mb, stride_mh, stride_mq, mask_block_q, mask_block_kv,
                                KV_VALID, stride_vvb,
                                EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID)
            qk = tl.where(keep, qk, float("-inf"))
        if FIXED:
            p = tl.math.exp2(qk * score_scale - m_i[:, None])  # [BM, BN]
            l_i = l_i + tl.sum(p, 1)
        else:
            p, m_i, l_i, acc = _running_step(qk, m_i, l_i, acc, score_scale, scale_log2, MASKED, QUANT_PV)
        if QUANT_PV == "fp8":
            acc = dot(to_float8(p, FP32_PRECISION == "upcast"), v, acc, FP32_PRECISION)  # [BM, BDV]
        elif QUANT_PV == "int8":
            # exact in int32 and through int32_to_float: 127 * 127 * BLOCK_N < 2^22 for BLOCK_N <= 256
            acc += int32_to_float(tl.dot(round_to_int8(p), v, out_dtype=tl.int32))  # [BM, BDV]
        else:
            acc = dot(p.to(v.dtype), v, acc, FP32_PRECISION)  # [BM, BDV]
    return m_i, l_i, acc


@triton.jit
def _walk_parts(lo_plain, hi_plain, lo_tested, hi_tested, tested_offset, m_i, l_i, acc, walk,
                BLOCK_KV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr,
                HAS_TOKEN_MASK: tl.constexpr, GATHER_BLOCK_MASK: tl.constexpr, HAS_KV_VALID: tl.constexpr,
                FP32_PRECISION: tl.constexpr, TMA_LOADS: tl.constexpr, QUANT_QK: tl.constexpr,
                QUANT_PV: tl.constexpr, SPLIT: tl.constexpr, FIXED: tl.constexpr):
    """Steps lo_plain..hi_plain of a split walk's untested part (SPLIT), then lo_tested..hi_tested of its tested
    part (every step, without SPLIT), entries stored plus tested_offset: the state after them (_forward_walk)."""
    if SPLIT:
        m_i, l_i, acc = _forward_walk(lo_plain, hi_plain, m_i, l_i, acc, walk, 0, BLOCK_KV, BLOCK_N, BLOCK_D,
                                      BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, False, False, 0, False, FP32_PRECISION,
                                      TMA_LOADS, QUANT_QK, QUANT_PV, FIXED)
    return _forward_walk(lo_tested, hi_tested, m_i, l_i, acc, walk, tested_offset, BLOCK_KV, BLOCK_N, BLOCK_D,
                         BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK,
                         HAS_KV_VALID, FP32_PRECISION, TMA_LOADS, QUANT_QK, QUANT_PV, FIXED)


@triton.jit(do_not_specialize=["seq_bucket"])
def attention_fwd_kernel(
    Q, K, V, K_DESC, V_DESC, Out, Lse, KV_COUNT, KV_INDEX, TOKEN_MASK, BLOCK_MASK, KV_VALID, CU_SEQLENS_Q, CU_SEQLENS_KV,
    Q_SCALE, Q_ROW_DOT, K_SCALE, V_SCALE, KEY_NORMS,
    scale_log2, seq_q, seq_kv, num_heads, group_size, mask_block_q, mask_block_kv, seq_bucket,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_cb, stride_ch,
    stride_ib, stride_ih, stride_iq,
    stride_tb, stride_th, stride_tq, stride_tk,
    stride_mb, stride_mh, stride_mq,
    stride_vvb,
    stride_qsb, stride_qsh, stride_qss,
    stride_ksb, stride_ksh, stride_kss,
    stride_vqb, stride_vqh,
    stride_nb, stride_nh,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_TOKEN_MASK: tl.constexpr,
    GATHER_BLOCK_MASK: tl.constexpr, HAS_KV_VALID: tl.constexpr, FP32_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, TMA_LOADS: tl.constexpr, SPLIT_WALK: tl.constexpr, FULL_TILES_FIRST: tl.constexpr,
    QUANT_QK: tl.constexpr, QUANT_PV: tl.constexpr, FIXED_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: a BLOCK_M query tile of one (batch, head), walking only the key blocks its query block kept.

    Q [B, H, Sq, D], K [B, Hkv, Sk, D], V [B, Hkv, Sk, Dv], Out [B, H, Sq, Dv], Lse fp32 [B, H, Sq] (natural log);
    KV_COUNT int32 [Bm, Hm, nq], KV_INDEX int32 [Bm, Hm, nq, L] (size-1 mask dims come with stride 0).
    IS_VARLEN: a packed batch; "batch" b is sequence b, whose tokens start at CU_SEQLENS_Q[b] / CU_SEQLENS_KV[b]
    along the token stride (the batch strides are 0), seq_q / seq_kv are the longest lengths.
    TMA_LOADS: K and V tiles come through K_DESC / V_DESC, host descriptors of K and V (kernels/tma.py).
    SPLIT_WALK: split_walk() on the host: the walk runs the tiles before the tested blocks without tests.
    FULL_TILES_FIRST: full_tiles_first() on the host: the lists hold first the tiles needing no test, then the
    others stored plus nk = cdiv(seq_kv, BLOCK_KV) (BlockSparsity.full_first).
    QUANT_QK: Q and K are int8 (kernels/quant.py) with per-token scales Q_SCALE fp32 [B, H, Sq] and K_SCALE fp32
    [B, Hkv, Sk]; the scores are their int32 products times both scales, and the LSE gets Q_ROW_DOT fp32 [B, H, Sq]
    (strides as Q_SCALE's: each query's dot product with the keys' mean) times scale back. QUANT_PV: None, or V's
    format ("fp8": float8 e4m3, "int8"), each channel's scale in V_SCALE fp32 [B, Hkv, Dv] (strides stride_vq*).
    FIXED_OFFSETS (FIXED_OFFSET_DIMS; not with QUANT_QK or QUANT_PV): the rows keep their exponent offsets after the
    walk's first step; fp16 where KEY_NORMS fp32 [B|1, Hkv, KEY_NORM_PARTS] (bounds.key_norm_parts, last dim
    contiguous) bounds their scores, bf16 and fp32 where every row has a key there, with the rise checked after the
    walk (a program whose rows' sums passed 2^bounds.RISE_LIMIT walks again with running maxima)."""
    tl.static_assert(BLOCK_Q % BLOCK_M == 0, "the query tile must nest in the block")
    tl.static_assert(BLOCK_KV % BLOCK_N == 0, "the key tile must nest in the block")
    tl.static_assert(QUANT_PV != "int8" or BLOCK_N <= 256, "int8 P @ V is exact in int32 up to 256 keys a tile")
    tl.static_assert(not (FIXED_OFFSETS and (QUANT_QK or QUANT_PV is not None)), "fixed offsets take no quant")
    TILES_PER_BLOCK: tl.constexpr = BLOCK_KV // BLOCK_N

    off_b, off_h, off_hkv, start_m, q_block, q_start, seq_q, kv_start, seq_kv = query_tile_program(
        CU_SEQLENS_Q, CU_SEQLENS_KV, seq_q, seq_kv, num_heads, group_size, BLOCK_Q, BLOCK_M, IS_VARLEN)
    if IS_VARLEN:
        if start_m >= seq_q:  # this sequence is shorter than the longest
            return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V

    q_ptrs = head_tile(Q, off_b, off_h, (q_start + offs_m[:, None]).to(tl.int64), offs_d, stride_qb, stride_qh,
                       stride_qs, stride_qd)
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < seq_q) & d_ok[None, :], other=0)  # [BM, BD]
    k_scale_base = K_SCALE + off_b.to(tl.int64) * stride_ksb + off_hkv.to(tl.int64) * stride_ksh \
        + kv_start.to(tl.int64) * stride_kss
    if QUANT_QK:
        q_scale = tl.load(Q_SCALE + off_b.to(tl.int64) * stride_qsb + off_h.to(tl.int64) * stride_qsh
                          + (q_start + offs_m).to(tl.int64) * stride_qss, mask=offs_m < seq_q, other=0.0)  # [BM]
        # an all-zero query row (scale 0) scores 0 whatever its scale: 1 keeps a masked row's -inf from 0 * -inf
        walk_scale = tl.where(q_scale > 0, q_scale, 1.0) * scale_log2
    else:
        walk_scale = scale_log2

    count, index_row, k_base, v_base = kv_list_start(
        KV_COUNT, KV_INDEX, K, V, off_b, off_h, off_hkv, q_block, kv_start, stride_cb, stride_ch, stride_ib, stride_ih,
        stride_iq, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of scaled scores, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    total = count * TILES_PER_BLOCK
    # SPLIT_WALK: the only element tests are the causal diagonal and the sequence's end, so the blocks that need
    # them end the (ascending) list; the walk runs the tiles before them without any test. FULL_TILES_FIRST: the
    # tile lists of a gathered block mask hold the tiles needing no test first, then the others plus nk.
    if SPLIT_WALK or FULL_TILES_FIRST:
        plain, tested_offset = kv_walk_split(index_row, count, start_m, seq_kv, BLOCK_KV, TILES_PER_BLOCK, EVEN_KV,
                                             IS_CAUSAL, FULL_TILES_FIRST)
    else:
        plain = 0
        tested_offset = 0
    walk = (q, start_m, offs_m, index_row, seq_q, seq_kv, kv_start, off_b, off_h, off_hkv, K_DESC, V_DESC, k_base,
            v_base, walk_scale, TOKEN_MASK, BLOCK_MASK, KV_VALID, mask_block_q, mask_block_kv, stride_ks, stride_kd,
            stride_vs, stride_vd, stride_tb, stride_th, stride_tq, stride_tk, stride_mb, stride_mh, stride_mq,
            stride_vvb, offs_n0, offs_d, offs_dv, d_ok, dv_ok, k_scale_base, stride_kss)
    SPLIT: tl.constexpr = SPLIT_WALK or FULL_TILES_FIRST
    if FIXED_OFFSETS:
        # step 0 with the running maxima, in whichever part holds it; then the rest of the walk in one of two loops
        # (a branch inside one loop fails Triton 3.6's software pipelining): with the offsets fixed where they may
        # stay, else with the running maxima
        first = tl.minimum(total, 1)
        rest_plain, rest_tested = tl.minimum(plain, first), tl.maximum(plain, first)
        m_i, l_i, acc = _walk_parts(
            0, rest_plain, plain, rest_tested, tested_offset, m_i, l_i, acc, walk, BLOCK_KV, BLOCK_N, BLOCK_D,
            BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID,
            FP32_PRECISION, TMA_LOADS, QUANT_QK, QUANT_PV, SPLIT, False)
        counted = offs_m < seq_q
        if q.dtype == tl.float16:  # fp16 P overflows past 65504: the rows' bounds must hold the rise
            keep = keeps_offsets(score_bounds(q, KEY_NORMS + off_b * stride_nb + off_hkv * stride_nh, scale_log2),
                                 m_i, counted, q.dtype)
        else:  # bf16 and fp32 P reach 2^128: the rise is checked after the walk instead
            keep = all_seen(m_i, counted)
        if keep:
            m_i, l_i, acc = _walk_parts(
                rest_plain, plain, rest_tested, total, tested_offset, m_i, l_i, acc, walk, BLOCK_KV, BLOCK_N,
                BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK,
                HAS_KV_VALID, FP32_PRECISION, TMA_LOADS, QUANT_QK, QUANT_PV, SPLIT, True)
            if q.dtype != tl.float16:
                if not sums_within(l_i, acc, counted):  # a rise past 2^RISE_LIMIT: the walk again, running maxima
                    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
                    m_i, l_i, acc = _walk_parts(
                        0, plain, plain, total, tested_offset, m_i, l_i, acc, walk, BLOCK_KV, BLOCK_N, BLOCK_D,
                        BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK,
                        HAS_KV_VALID, FP32_PRECISION, TMA_LOADS, QUANT_QK, QUANT_PV, SPLIT, False)
        else:
            m_i, l_i, acc = _walk_parts(
                rest_plain, plain, rest_tested, total, tested_offset, m_i, l_i, acc, walk, BLOCK_KV, BLOCK_N,
                BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK,
                HAS_KV_VALID, FP32_PRECISION, TMA_LOADS, QUANT_QK, QUANT_PV, SPLIT, False)
    else:
        m_i, l_i, acc = _walk_parts(
            0, plain, plain, total, tested_offset, m_i, l_i, acc, walk, BLOCK_KV, BLOCK_N, BLOCK_D, BLOCK_DV,
            HEAD_DIM, HEAD_DIM_V, EVEN_KV, IS_CAUSAL, HAS_TOKEN_MASK, GATHER_BLOCK_MASK, HAS_KV_VALID, FP32_PRECISION,
            TMA_LOADS, QUANT_QK, QUANT_PV, SPLIT, False)

    m_ok = offs_m < seq_q
    rows = (q_start + offs_m).to(tl.int64)
    seen = l_i > 0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    log2_l = tl.math.log2(tl.where(seen, l_i, 1.0))
    if QUANT_PV is not None:
        v_scale = tl.load(V_SCALE + off_b.to(tl.int64) * stride_vqb + off_hkv.to(tl.int64) * stride_vqh + offs_dv,
                          mask=dv_ok, other=0.0)  # [BDV]
        acc = acc * v_scale[None, :]
        log2_l = log2_l - _log2_pv_max(QUANT_PV)
    if QUANT_QK:  # the scores' share of the keys' mean, q . mean * scale, which the smoothed keys left out
        row_dot = tl.load(Q_ROW_DOT + off_b.to(tl.int64) * stride_qsb + off_h.to(tl.int64) * stride_qsh
                          + rows * stride_qss, mask=m_ok, other=0.0)  # [BM]
        log2_l = log2_l + row_dot * scale_log2
    lse = tl.where(seen, (m_i + log2_l) / 1.4426950408889634, float("-inf"))
    o_ptrs = head_tile(Out, off_b, off_h, rows[:, None], offs_dv, stride_ob, stride_oh, stride_os, stride_od)
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + rows * stride_ls, lse, mask=m_ok)


TUNING_KEY = ("BLOCK_Q", "BLOCK_KV", "HEAD_DIM", "HEAD_DIM_V", "EVEN_Q", "EVEN_KV", "IS_CAUSAL", "HAS_TOKEN_MASK",
              "GATHER_BLOCK_MASK", "HAS_KV_VALID", "IS_VARLEN", "TMA_LOADS", "SPLIT_WALK", "FULL_TILES_FIRST",
              "QUANT_QK", "QUANT_PV", "FIXED_OFFSETS", "seq_bucket")


def output_buffers(q: torch.Tensor, head_dim_v: int, packed: bool):
    """out [B, H, Sq, Dv] and lse fp32 [B, H, Sq]; for a packed q ([1, H, T, D] view) the views of token-major
    [T, H, Dv] and [T, H] buffers, so "thd" callers get their layout without a copy."""
    batch, heads, seq_q = q.shape[:3]
    if packed:
        out = buffers.empty(seq_q, heads, head_dim_v, device=q.device, dtype=q.dtype).permute(1, 0, 2).unsqueeze(0)
        lse = buffers.empty(seq_q, heads, device=q.device, dtype=torch.float32).t().unsqueeze(0)
        return out, lse
    return (buffers.empty(batch, heads, seq_q, head_dim_v, device=q.device, dtype=q.dtype),
            buffers.empty(batch, heads, seq_q, device=q.device, dtype=torch.float32))


def strides(tensor: Optional[torch.Tensor], ndim: int) -> tuple:
    """The first ndim strides of an optional tensor, 0 for size-1 dims (they broadcast) and for an absent one."""
    if tensor is None:
        return (0,) * ndim
    return tuple(st if n > 1 else 0 for st, n in zip(tensor.stride()[:ndim], tensor.shape[:ndim]))


@functools.lru_cache(maxsize=None)
def _stride_names(prefix: str, suffixes: str) -> tuple:
    return tuple(f"stride_{prefix}{s}" for s in suffixes)


def stride_args(prefix: str, tensor: Optional[torch.Tensor], suffixes: str) -> dict:
    """Keyword stride arguments ``stride_<prefix><suffix>`` for a kernel, as strides() gives them (written out:
    launchers call this a score of times per plan miss)."""
    names = _stride_names(prefix, suffixes)
    if tensor is None:
        return dict.fromkeys(names, 0)
    return {name: st if n > 1 else 0 for name, st, n in zip(names, tensor.stride(), tensor.shape)}


def fp32_precision(dtype: torch.dtype, kernel_fn):
    """The kernels' FP32_PRECISION flag (see primitives.dot): tf32 only where PyTorch allows it for matmuls."""
    if dtype in (torch.bfloat16, torch.float8_e4m3fn) and autotune.is_interpreted(kernel_fn):
        return "upcast"
    if dtype != torch.float32:
        return None
    return "tf32" if tf32_allowed() else "ieee"


def tf32_allowed() -> bool:
    """Whether PyTorch lets CUDA matmuls round fp32 inputs to tf32. Read through fp32_precision where PyTorch has
    it (2.9 and later): once a program sets that, reading allow_tf32 raises (PyTorch forbids mixing the two), while
    fp32_precision also reflects allow_tf32 and set_float32_matmul_precision."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    return bool(matmul.allow_tf32) if precision is None else precision == "tf32"


def head_dims(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    return head_dim, head_dim_v, max(16, triton.next_power_of_2(head_dim)), max(16, triton.next_power_of_2(head_dim_v))


def optional_tensors(dummy: torch.Tensor, token_mask, block_mask, kv_valid, varlen: Optional[Varlen]) -> dict:
    """The optional tensor arguments every attention kernel takes; dummy stands in for absent ones (their flags
    keep the kernels off them)."""
    packed = varlen is not None
    return dict(TOKEN_MASK=dummy if token_mask is None else token_mask,
                BLOCK_MASK=dummy if block_mask is None else block_mask,
                KV_VALID=dummy if kv_valid is None else kv_valid,
                CU_SEQLENS_Q=varlen.cu_q if packed else dummy, CU_SEQLENS_KV=varlen.cu_kv if packed else dummy)


def site_key(block_q: int, block_kv: int, scale: float, is_causal: bool, token_mask, block_mask, mask_block_q: int,
             mask_block_kv: int, kv_valid, varlen: Optional[Varlen], dtype: torch.dtype) -> tuple:
    """What every attention launcher's plan key holds besides its tensors (launch.run): the scalar arguments,
    which optional tensors are present, and the switches the launchers read (PyTorch's tf32 switch only for fp32
    inputs, dtype, the only ones it changes: reading it costs a microsecond a launch)."""
    return (block_q, block_kv, scale, bool(is_causal), token_mask is None, block_mask is None, mask_block_q,
            mask_block_kv, kv_valid is None, (varlen.batch, varlen.max_q, varlen.max_kv) if varlen else None,
            tma.TMA_LOADS, tma.MIN_DESCRIPTOR_WORK, dtype == torch.float32 and tf32_allowed(), SPLIT_WALKS,
            launch.MAX_GRID_AXIS)


# The oldest Triton the warp-specialized forward is known to compile and run with (3.6 on the H200; 3.8 compiles it
# for sm_90 in CI): Gluon's warp_specialize and TMA calls took other forms before.
GLUON_MIN_TRITON = (3, 6)


@functools.lru_cache(maxsize=None)
def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.lru_cache(maxsize=None)
def gluon_module(name: str):
    """The Gluon kernels' module kernels/<name> (forward_ws or backward_ws), imported on first use, behind the
    GLUON_MIN_TRITON check (older Tritons lack what it imports), then kept: an import statement in the launcher's
    check cost about 1.4 us of host time per call."""
    return importlib.import_module(f"{__package__}.{name}")


def warp_specialized_plan(q, k, v, block_q: int, block_kv: int, is_causal: bool, token_mask, block_mask, kv_valid,
                          varlen, quant):
    """(module, plan) when the warp-specialized Gluon forward (kernels/forward_ws.py) runs this call, else None:
    compiled Triton on a CUDA tensor, descriptor loads allowed (tma.TMA_LOADS), a Triton from GLUON_MIN_TRITON on
    (Gluon's API changed before it), and forward_ws.plan's conditions."""
    if not q.is_cuda or not tma.TMA_LOADS or autotune.is_interpreted(attention_fwd_kernel):
        return None
    if _triton_version() < GLUON_MIN_TRITON:
        return None
    forward_ws = gluon_module("forward_ws")
    chosen = forward_ws.plan(q, k, v, block_q, block_kv, is_causal=is_causal, token_mask=token_mask,
                             block_mask=block_mask, kv_valid=kv_valid, varlen=varlen, quant=quant,
                             min_work=tma.MIN_DESCRIPTOR_WORK)
    return None if chosen is None else (forward_ws, chosen)


def attention_forward(q, k, v, kv_count, kv_index, block_q: int, block_kv: int, scale: float,
                      token_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                      block_mask: Optional[torch.Tensor] = None, mask_block_q: int = 0, mask_block_kv: int = 0,
                      kv_valid: Optional[torch.Tensor] = None, varlen: Optional[Varlen] = None,
                      quant: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward. q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (any strides, last dim dense
    preferred) -> (out [B, H, Sq, Dv], lse fp32 [B, H, Sq]).

    kv lists at (block_q, block_kv) granularity. block_mask (uint8 [Bm, Hm, nq', nk'] at mask_block_q x
    mask_block_kv) is given only when the lists are a tile view of a block shape no tile nests in; every
    element is then tested against it. token_mask: uint8, expanded to [B, H, Sq, Sk] (stride 0 broadcasts);
    kv_valid: int32 [B|1, nk'] expanded to [B, nk'], per key block of mask_block_kv keys (without block_mask,
    the lists' key blocks nest in those).
    varlen: a packed batch; q, k, v are then [1, H, T, D] views of "thd" tensors, and out / lse come back as
    [1, H, Tq, Dv] / [1, H, Tq] views of "thd"-ordered [Tq, H, Dv] / [Tq, H] buffers.
    quant: None, "int8", "int8-fp8" or "int8-int8": q and k are quantized per token first (kernels/quant.py: the
    keys less their mean over the sequence), the scores come from their int8 product, and the LSE gets the mean's
    share back; "int8-fp8" / "int8-int8" also round V per channel and P to float8 e4m3 / int8 for P @ V."""
    packed = varlen is not None
    out, lse = output_buffers(q, v.shape[-1], packed)
    warp_specialized = warp_specialized_plan(q, k, v, block_q, block_kv, is_causal, token_mask, block_mask, kv_valid,
                                             varlen, quant)
    if warp_specialized is not None:
        module, chosen = warp_specialized
        module.attention_forward_ws(q, k, v, kv_count, kv_index, block_q, block_kv, scale * LOG2E, out, lse, chosen)
        return out, lse
    q_scale = k_scale = row_dot = v_scale = None
    pv_format = PV_FORMATS.get(quant)
    if pv_format is not None:
        # [B, Hkv, Sk, Dv] 8-bit view of a [B, Hkv, Dv, Sk] buffer, fp32 [B, Hkv, Dv]
        v, v_scale = quantize_columns(v, pv_format)
    if quant is not None:
        mean = k.mean(2, dtype=torch.float32)  # [B, Hkv, D]: the keys' smoothing (softmax ignores a shared shift)
        k, k_scale, _ = quantize_rows(k, mean, subtract_mean=True, dot_mean=False)
        q, q_scale, row_dot = quantize_rows(q, mean, subtract_mean=False, dot_mean=True)
    fixed = quant is None and q.shape[-1] in FIXED_OFFSET_DIMS
    # fp16: the largest key norms of each kv head's parts, which bound its scores (one pass over k); bf16 and fp32
    # check the rise after the walk instead
    key_norms = key_norm_parts(k) if fixed and q.dtype == torch.float16 else None
    tensors = dict(Q=q, K=k, V=v, K_DESC=k, V_DESC=v, Out=out, Lse=lse, KV_COUNT=kv_count, KV_INDEX=kv_index,
                   **optional_tensors(kv_count, token_mask, block_mask, kv_valid, varlen),
                   Q_SCALE=kv_count if q_scale is None else q_scale, Q_ROW_DOT=kv_count if row_dot is None else row_dot,
                   K_SCALE=kv_count if k_scale is None else k_scale,
                   V_SCALE=kv_count if v_scale is None else v_scale,
                   KEY_NORMS=kv_count if key_norms is None else key_norms)
    site = site_key(block_q, block_kv, scale, is_causal, token_mask, block_mask, mask_block_q, mask_block_kv,
                    kv_valid, varlen, v.dtype) + (autotune.env_key("FWD"), quant, fixed)

    def build() -> launch.LaunchSpec:
        heads, kv_heads = q.shape[1], k.shape[1]
        batch, seq_q, seq_kv = (varlen.batch, varlen.max_q, varlen.max_kv) if packed else (q.shape[0], q.shape[2],
                                                                                            k.shape[2])
        head_dim, head_dim_v, block_d, block_dv = head_dims(q, v)
        if quant is not None:
            block_d = max(32, block_d)  # the GPU's int8 products take 32 columns at a time
        gather = gather_mode(block_mask, block_q, block_kv, mask_block_q, mask_block_kv)
        even_kv = whole_blocks(seq_kv, block_kv, packed)
        elt, elt_v, precision = q.element_size(), v.element_size(), fp32_precision(v.dtype, attention_fwd_kernel)
        configs = autotune.nesting(
            "FWD", block_q, block_kv,
            smem_per_stage=lambda bm, bn: bn * (block_d * elt + block_dv * elt_v),
            fixed_smem=lambda bm, bn: bm * block_d * elt, cache_key=(block_d, block_dv, elt, elt_v),
            fp32_precision=precision, min_block_n=PV_MIN_TILE_KV if pv_format else 16)
        kv_tiles = tma.tile_args(attention_fwd_kernel, packed, batch * heads * seq_q * seq_kv * head_dim,
                                 K_DESC=k, V_DESC=v)
        static = dict(
            kv_tiles, scale_log2=scale * LOG2E, seq_q=seq_q, seq_kv=seq_kv, num_heads=heads,
            group_size=heads // kv_heads, mask_block_q=mask_block_q if gather else block_q,
            mask_block_kv=mask_block_kv if gather or kv_valid is not None else block_kv,
            seq_bucket=autotune.seq_bucket(max(seq_q, seq_kv)),
            **stride_args("q", q, "bhsd"), **stride_args("k", k, "bhsd"), **stride_args("v", v, "bhsd"),
            **stride_args("o", out, "bhsd"), **stride_args("l", lse, "bhs"),
            **stride_args("c", kv_count, "bh"), **stride_args("i", kv_index, "bhq"),
            **stride_args("t", token_mask, "bhqk"), **stride_args("m", block_mask, "bhq"),
            stride_vvb=strides(kv_valid, 1)[0],
            **stride_args("qs", q_scale, "bhs"), **stride_args("ks", k_scale, "bhs"), **stride_args("vq", v_scale, "bh"),
            **stride_args("n", key_norms, "bh"),
            BLOCK_Q=block_q, BLOCK_KV=block_kv, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d,
            BLOCK_DV=block_dv, EVEN_KV=even_kv,
            IS_CAUSAL=bool(is_causal), HAS_TOKEN_MASK=token_mask is not None, GATHER_BLOCK_MASK=gather,
            HAS_KV_VALID=kv_valid is not None, FP32_PRECISION=precision,
            IS_VARLEN=packed, SPLIT_WALK=split_walk(is_causal, even_kv, token_mask, block_mask, kv_valid),
            FULL_TILES_FIRST=full_tiles_first(block_mask is not None, mask_block_kv > block_kv, token_mask, kv_valid,
                                              varlen),
            QUANT_QK=quant is not None, QUANT_PV=pv_format, FIXED_OFFSETS=fixed)
        return launch.LaunchSpec(
            grid=lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), *launch.batch_head_axes(batch, heads)),
            configs=configs,
            tuning_key=TUNING_KEY, static=static, pre_hook=tma.set_boxes if kv_tiles["TMA_LOADS"] else None)

    launch.run(attention_fwd_kernel, site, tensors, build, fresh=("Out", "Lse"))
    return out, lse

