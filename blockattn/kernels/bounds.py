"""Bounds on a row's scores for the forwards that keep each row's exponent offset fixed after its first key tile
(forward.FIXED_OFFSET_DIMS, forward_ws.FIXED_OFFSET_DIMS; kernels/README.md, "Fixed offsets"): the keys' largest
norms, how far above its offset a row's scaled scores may rise for each dtype of P, and the checks of the Triton
forward's bf16 and fp32 walks, which test the rise after the walk instead of bounding it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch

# How far above its fixed offset a row's scaled scores (log2 units) may rise, per dtype of P (the inputs'): bf16 P
# stays below 2^32, far from its (and fp32's) 2^128, and a row's sum below 2^32 * keys; fp16 P below 2^15, within
# its largest finite value, 65504. fp32 P (the Triton forward's fp32 inputs) has bf16's range.
BF16_HEADROOM, FP16_HEADROOM = 32.0, 15.0
FIXED_HEADROOM = {torch.bfloat16: BF16_HEADROOM, torch.float16: FP16_HEADROOM, torch.float32: BF16_HEADROOM}
# The largest row sum (log2) a walk with fixed offsets may end with when it checks the rise itself instead of a bound
# (the Triton forward, bf16 and fp32 P: sums_within): every P then stayed below 2^100, far from bf16's and fp32's
# 2^128, and the accumulator below 2^100 times the largest |v|, whose finiteness is checked too.
RISE_LIMIT = 100.0
# Parts a kv head's keys split into for key_norm_parts_kernel: its programs (B x Hkv x parts) fill the GPU, and each
# program of a forward takes the maximum of its head's parts once.
KEY_NORM_PARTS = 32


@triton.jit
def key_norm_parts_kernel(K, Out, seq_kv, kv_heads, stride_kb, stride_kh, stride_ks, stride_kd, stride_ob, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KEYS: tl.constexpr, PARTS: tl.constexpr):
    """Grid (B * Hkv, PARTS): Out fp32 [B, Hkv, PARTS] (last dim contiguous), the largest Euclidean norm (fp32) among
    each part's keys of k [B, Hkv, Sk, HEAD_DIM] (BLOCK_D: HEAD_DIM's next power of two); 0 for a part with no
    key."""
    part = tl.program_id(1)
    b = tl.program_id(0) // kv_heads
    h = tl.program_id(0) % kv_heads
    per_part = tl.cdiv(seq_kv, PARTS)
    start = part * per_part
    end = tl.minimum(start + per_part, seq_kv)
    base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    cols = tl.arange(0, BLOCK_D)
    largest = tl.zeros([KEYS], tl.float32)
    for first in range(start, end, KEYS):
        keys = first + tl.arange(0, KEYS)
        x = tl.load(base + keys.to(tl.int64)[:, None] * stride_ks + cols[None, :] * stride_kd,
                    mask=(keys < end)[:, None] & (cols < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.sum(x * x, 1))
    tl.store(Out + b * stride_ob + h * stride_oh + part, tl.sqrt(tl.max(largest, 0)))


def key_norm_parts(k: torch.Tensor) -> torch.Tensor:
    """fp32 [B, Hkv, KEY_NORM_PARTS]: the largest key norm of each part of each kv head of k [B, Hkv, Sk, D] (any
    strides), one pass over k; their maximum bounds the head's keys."""
    batch, kv_heads, seq_kv, dim = k.shape
    out = torch.empty(batch, kv_heads, KEY_NORM_PARTS, device=k.device, dtype=torch.float32)

    def spec() -> launch.LaunchSpec:
        stride_kb, stride_kh, stride_ks, stride_kd = k.stride()
        static = dict(seq_kv=seq_kv, kv_heads=kv_heads, stride_kb=stride_kb, stride_kh=stride_kh,
                      stride_ks=stride_ks, stride_kd=stride_kd, stride_ob=out.stride(0), stride_oh=out.stride(1),
                      HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), KEYS=64, PARTS=KEY_NORM_PARTS)
        return launch.LaunchSpec(grid=lambda meta: (batch * kv_heads, KEY_NORM_PARTS),
                                 configs=[triton.Config({}, num_warps=4)], tuning_key=(), static=static)
    launch.run(key_norm_parts_kernel, (), dict(K=k, Out=out), spec, fresh=("Out", ))
    return out


_PARTS = tl.constexpr(KEY_NORM_PARTS)
# (named, not looked up by torch dtype: benchmarks/sass_loop.py compiles the kernels with torch stubbed out)
_HEADROOM_BF16 = tl.constexpr(BF16_HEADROOM)
_HEADROOM_FP16 = tl.constexpr(FP16_HEADROOM)
_SUM_LIMIT = tl.constexpr(2.0 ** RISE_LIMIT)


@triton.jit
def score_bounds(q, key_norms, scale_log2):
    """Each row's bound on its scaled scores (log2 units), fp32 [BM]: scale_log2 times the row's norm in q [BM, BD]
    times the kv head's largest key norm, the maximum of its KEY_NORM_PARTS parts (key_norms: a pointer to them,
    as key_norm_parts writes them). Cauchy-Schwarz: s_ij * scale_log2 <= scale_log2 * |q_i| * max_j |k_j|."""
    key_norm = tl.max(tl.load(key_norms + tl.arange(0, _PARTS)), 0)
    rows = q.to(tl.float32)
    return scale_log2 * tl.sqrt(tl.sum(rows * rows, 1)) * key_norm


@triton.jit
def _every_counted(within, counted):
    """Whether within (bool [BM]) holds for every counted row (counted bool [BM]): a scalar over the program."""
    return tl.min(tl.where(counted, within, True).to(tl.int32), 0) > 0


@triton.jit
def keeps_offsets(bound, m_i, counted, DTYPE: tl.constexpr):
    """Whether a program's rows keep their offsets m_i [BM] (log2 units) for the rest of its walk: no counted row
    (counted bool [BM]: the rows inside the sequence) has its bound [BM] above its offset by more than
    FIXED_HEADROOM[DTYPE], P's dtype. A counted row with no key yet (m_i = -inf) fails, and so does one whose bound
    or offset is NaN (its comparison is false). A scalar: the decision covers the program, whose products are
    shared."""
    if DTYPE == tl.float16:
        within = bound - m_i <= _HEADROOM_FP16
    else:  # bf16, and fp32 with the same range
        within = bound - m_i <= _HEADROOM_BF16
    return _every_counted(within, counted)


@triton.jit
def all_seen(m_i, counted):
    """Whether every counted row (counted bool [BM]) has seen a key, its offset m_i [BM] finite: the condition for
    keeping the offsets when the rise is checked afterwards (sums_within) instead of bounded. A scalar."""
    return _every_counted((m_i > float("-inf")) & (m_i < float("inf")), counted)


@triton.jit
def sums_within(l_i, acc, counted):
    """Whether a walk with fixed offsets stayed in range: every counted row's sum l_i [BM] at most 2^RISE_LIMIT
    (so no P passed it) and its accumulator row acc [BM, BDV] finite. False also for NaN (comparisons are false):
    the walk is then done again with running maxima. A scalar."""
    row = tl.sum(acc, 1)
    return _every_counted((l_i <= _SUM_LIMIT) & (row > float("-inf")) & (row < float("inf")), counted)
