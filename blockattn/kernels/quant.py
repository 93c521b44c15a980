"""The quantized forwards' input passes: per-token int8 quantization of q and k (every quant scheme) and
per-channel float8 or int8 of V ("int8-fp8", "int8-int8"); kernels and launchers. What they compute and why:
kernels/README.md, "Quantized forward"."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import buffers, launch
from .autotune import is_interpreted
from .primitives import batch_and_head, round_half_away_to_int8, to_float8

# Rows one program quantizes; the head dim is whole in every row (BLOCK_D >= D).
_ROWS = 64
# The quantize kernels' one config (they are memory-bound passes, nothing to tune).
_CONFIGS = [triton.Config({}, num_warps=4)]


def _launch(kernel_fn, tensors: dict, x: torch.Tensor, **static) -> None:
    """Launch a quantize kernel over x [B, H, S, D]'s rows through a launch plan (kernels/launch.py: a relaunch
    skips Triton's argument binding, most of an eager call's host time at short sequences). static: the kernel's
    other non-tensor arguments (the plan's site key; X's shape and strides, from which the rest follow, are in the
    plan's key as a tensor's)."""
    batch, heads, seq, dim = x.shape
    site = tuple(sorted(static.items()))

    def build() -> launch.LaunchSpec:
        return launch.LaunchSpec(
            grid=lambda meta: (triton.cdiv(seq, _ROWS), *launch.batch_head_axes(batch, heads)), configs=_CONFIGS,
            tuning_key=(), static=dict(static, seq=seq, num_heads=heads, stride_xb=x.stride(0),
                                       stride_xh=x.stride(1), stride_xs=x.stride(2), stride_xd=x.stride(3),
                                       HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_S=_ROWS))
    launch.run(kernel_fn, site, tensors, build, fresh=tuple(name for name in tensors if name != "X"))


@triton.jit
def _row_tile(X, seq, num_heads, stride_xb, stride_xh, stride_xs, stride_xd, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """This program's BLOCK_S rows of one (batch, head) of X [B, H, S, D]: (off_b, off_h, rows [BS], cols [BD],
    row_ok, col_ok, x [BS, BD] in X's dtype, zero outside)."""
    off_b, off_h = batch_and_head(num_heads)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < seq
    col_ok = cols < HEAD_DIM
    x = tl.load(X + off_b.to(tl.int64) * stride_xb + off_h.to(tl.int64) * stride_xh
                + rows[:, None].to(tl.int64) * stride_xs + cols[None, :] * stride_xd,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    return off_b, off_h, rows, cols, row_ok, col_ok, x


@triton.jit
def quantize_rows_kernel(X, MEAN, X8, SCALE, ROW_DOT, seq, num_heads, group_size,
                         stride_xb, stride_xh, stride_xs, stride_xd, stride_mb, stride_mh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         SUBTRACT_MEAN: tl.constexpr, DOT_MEAN: tl.constexpr):
    """One program: BLOCK_S rows of one (batch, head) of X [B, H, S, D] (any strides).

    Each row x (less MEAN's row of its head when SUBTRACT_MEAN: the keys' smoothing) becomes int8 round(x * 127 /
    max|x|) (halves away from zero) in X8 [B, H, S, D] (dense) with SCALE = max|x| / 127 fp32 [B, H, S]; an
    all-zero row gives zeros and scale 0. DOT_MEAN (queries): ROW_DOT fp32 [B, H, S] gets the dequantized row's
    dot product with MEAN's row of its kv head (h // group_size), the LSE's share of the subtracted mean.
    MEAN: fp32 [B, H / group_size, D] with strides (stride_mb, stride_mh, 1)."""
    off_b, off_h, rows, cols, row_ok, col_ok, x = _row_tile(X, seq, num_heads, stride_xb, stride_xh, stride_xs,
                                                            stride_xd, HEAD_DIM, BLOCK_D, BLOCK_S)
    ok = row_ok[:, None] & col_ok[None, :]
    x = x.to(tl.float32)  # [BS, BD]
    if SUBTRACT_MEAN or DOT_MEAN:  # the mean's row of this head's kv head (h // group_size)
        mean = tl.load(MEAN + off_b.to(tl.int64) * stride_mb + (off_h // group_size).to(tl.int64) * stride_mh + cols,
                       mask=col_ok, other=0.0)  # [BD]
    if SUBTRACT_MEAN:
        x = tl.where(ok, x - mean[None, :], 0.0)
    amax = tl.max(tl.abs(x), 1)  # [BS]
    inverse = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    y = x * inverse[:, None]
    x8 = round_half_away_to_int8(y)
    scale = amax / 127.0
    out_rows = (off_b * num_heads + off_h).to(tl.int64) * seq + rows
    tl.store(X8 + out_rows[:, None] * HEAD_DIM + cols[None, :], x8, mask=ok)
    tl.store(SCALE + out_rows, scale, mask=row_ok)
    if DOT_MEAN:
        tl.store(ROW_DOT + out_rows, tl.sum(x8.to(tl.float32) * mean[None, :], 1) * scale, mask=row_ok)


def quantize_rows(x: torch.Tensor, mean: torch.Tensor, subtract_mean: bool,
                  dot_mean: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """x [B, H, S, D] (fp16/bf16/fp32, any strides) -> (int8 [B, H, S, D] dense, scale fp32 [B, H, S], row_dot
    fp32 [B, H, S] or None unless dot_mean). mean: fp32 [B, Hm, D], H a multiple of Hm (see the kernel)."""
    batch, heads, seq, dim = x.shape
    x8 = buffers.empty(batch, heads, seq, dim, dtype=torch.int8, device=x.device)
    scale = buffers.empty(batch, heads, seq, dtype=torch.float32, device=x.device)
    row_dot = buffers.empty(batch, heads, seq, dtype=torch.float32, device=x.device) if dot_mean else None
    if x.numel() == 0:
        return x8, scale, row_dot
    tensors = dict(X=x, MEAN=mean, X8=x8, SCALE=scale, ROW_DOT=scale if row_dot is None else row_dot)
    _launch(quantize_rows_kernel, tensors, x, group_size=heads // mean.shape[1], stride_mb=mean.stride(0),
            stride_mh=mean.stride(1), SUBTRACT_MEAN=subtract_mean, DOT_MEAN=dot_mean)
    return x8, scale, row_dot


# The largest finite float8 e4m3 value and int8's largest: V's channels and the probabilities P are scaled to the
# format's.
FP8_MAX = 448.0
INT8_MAX = 127.0
_COLUMN_FORMATS = {"fp8": (torch.float8_e4m3fn, FP8_MAX), "int8": (torch.int8, INT8_MAX)}


@triton.jit
def quantize_columns_kernel(X, INVERSE, X8, seq, num_heads, stride_xb, stride_xh, stride_xs, stride_xd,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                            FORMAT: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One program: BLOCK_S rows of one (batch, head) of X [B, H, S, D] (any strides): X8 = x * INVERSE[b, h, :]
    (fp32 [B, H, D] dense: the format's largest value / the column's max |x|, 0 for an all-zero column) in FORMAT
    ("fp8": float8 e4m3, rounded to nearest even; "int8": halves away from zero, as quantize_rows_kernel),
    stored column-major, X8's memory [B, H, D, S]: the layout the GPU's 8-bit products take for P @ V."""
    off_b, off_h, rows, cols, row_ok, col_ok, x = _row_tile(X, seq, num_heads, stride_xb, stride_xh, stride_xs,
                                                            stride_xd, HEAD_DIM, BLOCK_D, BLOCK_S)
    ok = row_ok[:, None] & col_ok[None, :]
    base = (off_b * num_heads + off_h).to(tl.int64)
    inverse = tl.load(INVERSE + base * HEAD_DIM + cols, mask=col_ok, other=0.0)  # [BD]
    y = x.to(tl.float32) * inverse[None, :]
    if FORMAT == "fp8":
        x8 = to_float8(y, ROUND_FIRST)
    else:
        x8 = round_half_away_to_int8(y)
    tl.store(X8 + base * HEAD_DIM * seq + cols[None, :].to(tl.int64) * seq + rows[:, None], x8, mask=ok)


def quantize_columns(x: torch.Tensor, fmt: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, S, D] (any strides) -> (fmt's [B, H, S, D] view of a [B, H, D, S] buffer, scale fp32 [B, H, D] =
    the column's max |x| / the format's largest value): V for quant="int8-fp8" (fmt "fp8", float8 e4m3, largest
    FP8_MAX) or "int8-int8" (fmt "int8", INT8_MAX), per channel over the sequence."""
    if fmt not in _COLUMN_FORMATS:
        raise ValueError(f"fmt must be one of {tuple(_COLUMN_FORMATS)}, got {fmt!r}")
    dtype, largest = _COLUMN_FORMATS[fmt]
    batch, heads, seq, dim = x.shape
    amax = x.abs().amax(2).to(torch.float32) if seq else x.new_zeros(batch, heads, dim, dtype=torch.float32)
    inverse = torch.where(amax > 0, largest / torch.where(amax > 0, amax, 1.0), 0.0).contiguous()
    x8 = buffers.empty(batch, heads, dim, seq, dtype=dtype, device=x.device)
    if x.numel():
        _launch(quantize_columns_kernel, dict(X=x, INVERSE=inverse, X8=x8), x, FORMAT=fmt,
                ROUND_FIRST=is_interpreted(quantize_columns_kernel))
    return x8.transpose(2, 3), amax / largest
