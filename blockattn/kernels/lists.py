"""Building kv lists on the GPU in one pass: the kernel and launcher behind sparsity's list builders on CUDA.

A call with kv_valid rebuilds its full-first lists (and, for a backward, their q lists) from the mask on every call.
In PyTorch operations that is about a hundred elementwise, cumsum and scatter launches over the mask: 1.37 ms per
call at B1 H24 S32768 with 128x128 blocks (64-key tiles, [1, 24, 256, 512] masks; H200, BENCHMARKS.md), a fifth of
that call's forward. Here one program takes BLOCK_R rows and places each column in one pass over them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import launch

# Rows per program, and columns per step of its walk along them (the whole row up to this width).
_BLOCK_R = 16
_MAX_BLOCK_C = 512
_CONFIGS = [triton.Config({}, num_warps=4)]


@triton.jit
def _row_masks(rows_k, rows_f, row_ok, cols, columns, stride_kc, stride_fc):
    """(keep, full, ok) bool [BLOCK_R, BLOCK_C] at cols of the rows whose first entries rows_k / rows_f point to."""
    ok = row_ok[:, None] & (cols < columns)[None, :]
    keep = tl.load(rows_k[:, None] + cols[None, :] * stride_kc, mask=ok, other=0) != 0
    full = tl.load(rows_f[:, None] + cols[None, :] * stride_fc, mask=ok, other=0) != 0
    return keep, full & keep, ok


@triton.jit
def full_first_lists_kernel(KEEP, FULL, COUNT, INDEX, num_rows, rows_per_lead, columns,
                            stride_kl, stride_kr, stride_kc, stride_fl, stride_fr, stride_fc,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (cdiv(num_rows, BLOCK_R),). KEEP, FULL: uint8 [L, R, C] (any strides; nonzero = set, FULL read within
    KEEP); COUNT int32 [L * R] and INDEX int32 [L * R, C] (contiguous) get each row's count of kept columns and
    its columns in the order full ones, other kept ones (stored plus C), dropped ones, each group ascending. A
    column's slot is its group's start plus the number of its group's columns before it (running sums)."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = row < num_rows
    lead = (row // rows_per_lead).to(tl.int64)
    within = (row % rows_per_lead).to(tl.int64)
    rows_k = KEEP + lead * stride_kl + within * stride_kr
    rows_f = FULL + lead * stride_fl + within * stride_fr
    # first pass: the groups' sizes, where the later groups start
    n_full = tl.zeros([BLOCK_R], dtype=tl.int32)
    n_keep = tl.zeros([BLOCK_R], dtype=tl.int32)
    for start in range(0, columns, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        keep, full, ok = _row_masks(rows_k, rows_f, row_ok, cols, columns, stride_kc, stride_fc)
        n_full += tl.sum(full.to(tl.int32), 1)
        n_keep += tl.sum(keep.to(tl.int32), 1)
    # second pass: each column's slot
    before_full = tl.zeros([BLOCK_R], dtype=tl.int32)
    before_partial = n_full
    before_dropped = n_keep
    out_rows = INDEX + row.to(tl.int64) * columns
    for start in range(0, columns, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        keep, full, ok = _row_masks(rows_k, rows_f, row_ok, cols, columns, stride_kc, stride_fc)
        partial = keep & ~full
        dropped = ok & ~keep
        full_i, partial_i, dropped_i = full.to(tl.int32), partial.to(tl.int32), dropped.to(tl.int32)
        slot = tl.where(full, before_full[:, None] + tl.cumsum(full_i, 1),
                        tl.where(partial, before_partial[:, None] + tl.cumsum(partial_i, 1),
                                 before_dropped[:, None] + tl.cumsum(dropped_i, 1))) - 1
        value = tl.where(partial, cols[None, :] + columns, cols[None, :])
        tl.store(out_rows[:, None] + slot, value, mask=ok)
        before_full += tl.sum(full_i, 1)
        before_partial += tl.sum(partial_i, 1)
        before_dropped += tl.sum(dropped_i, 1)
    tl.store(COUNT + row, n_keep, mask=row_ok)


def full_first_lists(keep: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sparsity._full_first_lists in one launch: keep, full bool [..., R, C] (full within keep, any strides,
    broadcast dims included) -> count int32 [..., R], index int32 [..., R, C] (both contiguous)."""
    # (build_lists passes one tensor twice: no broadcast, whose Python check costs a new mask host time)
    shape = keep.shape if full is keep else torch.broadcast_shapes(keep.shape, full.shape)
    keep, full = keep.expand(shape), full.expand(shape)
    rows_per_lead, columns = shape[-2], shape[-1]
    leads = math.prod(shape[:-2])
    # [L, R, C] views (a reshape copies only where the leading dims do not merge)
    keep3, full3 = (t.reshape(leads, rows_per_lead, columns).view(torch.uint8) for t in (keep, full))
    count = torch.empty(shape[:-1], dtype=torch.int32, device=keep.device)
    index = torch.empty(shape, dtype=torch.int32, device=keep.device)
    num_rows = leads * rows_per_lead
    if num_rows == 0 or columns == 0:
        count.zero_()
        return count, index
    block_c = min(_MAX_BLOCK_C, triton.next_power_of_2(columns))

    def build() -> launch.LaunchSpec:
        return launch.LaunchSpec(
            grid=lambda meta: (triton.cdiv(num_rows, _BLOCK_R),), configs=_CONFIGS, tuning_key=(),
            static=dict(num_rows=num_rows, rows_per_lead=rows_per_lead, columns=columns,
                        stride_kl=keep3.stride(0), stride_kr=keep3.stride(1), stride_kc=keep3.stride(2),
                        stride_fl=full3.stride(0), stride_fr=full3.stride(1), stride_fc=full3.stride(2),
                        BLOCK_R=_BLOCK_R, BLOCK_C=block_c))
    launch.run(full_first_lists_kernel, (), dict(KEEP=keep3, FULL=full3, COUNT=count, INDEX=index), build,
               fresh=("COUNT", "INDEX"))
    return count, index
