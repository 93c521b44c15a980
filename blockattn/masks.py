"""Standard block-mask patterns. Each is the block-level reduction ("any token pair kept") of a token-level rule,
computed from block coordinates without building the token mask, and returned as a BlockSparsity.

Token rules (query i, key j, 0-based, top-left aligned like scaled_dot_product_attention):

- causal:          j <= i
- sliding_window:  |i - j| < window            (causal=True: 0 <= i - j < window)
- global_tokens:   i < n or j < n              (the first n tokens see and are seen by everything)
- sliding_tile:    tokens in tiles of a T x H x W video grid; tile a sees tile b when their tile coordinates
                   differ by at most window // 2 on every axis
- from_token_mask: any mask you have

Each returns a BlockSparsity whose mask is bool [1, 1, nq, nk] (nq = ceil(seq_q / block_q), nk likewise);
union and intersection broadcast batch and head dims. Blocks that are only partly inside a rule (the causal
diagonal, window edges) are kept whole: pass the matching token-level argument to attention() (is_causal=True,
or attn_mask) to make the result exact at token level.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .sparsity import BlockSparsity, _check_seq, _difference_range, _spans, check_block_size


def _wrap(keep: torch.Tensor, block_size, seq_q: int, seq_kv: int) -> BlockSparsity:
    return BlockSparsity.from_mask(keep, block_size, seq_q, seq_kv)


def causal(seq_q: int, seq_kv: int, block_size, device=None) -> BlockSparsity:
    """Blocks holding at least one pair with key <= query. Use with attention(..., is_causal=True)."""
    low, high = _difference_range(seq_q, seq_kv, block_size, device)
    return _wrap(high >= 0, block_size, seq_q, seq_kv)


def sliding_window(seq_q: int, seq_kv: int, block_size, window: int, *, causal: bool = False,
                   device=None) -> BlockSparsity:
    """Blocks holding a pair within `window` tokens (|i - j| < window, or 0 <= i - j < window when causal)."""
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive int (tokens), got {window!r}")
    low, high = _difference_range(seq_q, seq_kv, block_size, device)
    lowest_allowed = 0 if causal else -(window - 1)
    keep = (high >= lowest_allowed) & (low <= window - 1)
    return _wrap(keep, block_size, seq_q, seq_kv)


def global_tokens(seq_q: int, seq_kv: int, block_size, num_tokens: int, device=None) -> BlockSparsity:
    """Blocks touching the first `num_tokens` queries or keys (attention sinks, register or text tokens)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    block_q, block_kv = check_block_size(block_size)
    q_first, _ = _spans(_check_seq("seq_q", seq_q), block_q, device)
    k_first, _ = _spans(_check_seq("seq_kv", seq_kv), block_kv, device)
    keep = (q_first[:, None] < num_tokens) | (k_first[None, :] < num_tokens)
    return _wrap(keep, block_size, seq_q, seq_kv)


def three_positive(name: str, value) -> tuple[int, int, int]:
    """value as a (T, H, W) tuple of three positive ints (a list or tuple of Python ints), else a ValueError."""
    if (not isinstance(value, (tuple, list)) or len(value) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in value)):
        raise ValueError(f"{name} must be three positive ints (T, H, W), got {value!r}")
    return tuple(value)


def sliding_tile(grid: Sequence[int], tile: Sequence[int], window: Sequence[int], device=None) -> BlockSparsity:
    """Sliding-tile attention over a video latent of `grid` = (T, H, W) tokens laid out tile by tile (tiles in
    row-major (T, H, W) tile order, the t*h*w tokens of a tile contiguous): each tile is one block, and query tile a
    keeps key tile b when |a_x - b_x| <= window[x] // 2 on every axis (window counted in tiles). Blocks are
    t*h*w tokens square. A grid that does not divide into whole tiles has cut tiles at its far edges: lay the tokens
    out with video.TileLayout(grid, tile).to_tiles (which pads each cut tile) and pass its `valid` to attention() as
    kv_valid, so that padding keys are masked; from_tiles drops the padding rows of the output."""
    grid, tile, window = (three_positive(name, arg) for name, arg in (("grid", grid), ("tile", tile),
                                                                      ("window", window)))
    counts = [math.ceil(g / t) for g, t in zip(grid, tile)]
    coords = torch.stack(torch.meshgrid(*(torch.arange(c, device=device) for c in counts), indexing="ij"), -1)
    coords = coords.reshape(-1, 3)                                        # [tiles, 3], tile-major order
    reach = torch.tensor([w // 2 for w in window], device=device)
    keep = ((coords[:, None, :] - coords[None, :, :]).abs() <= reach).all(-1)
    tokens = math.prod(tile)
    seq = tokens * keep.shape[0]
    return _wrap(keep, (tokens, tokens), seq, seq)


def from_token_mask(token_mask: torch.Tensor, block_size) -> tuple[BlockSparsity, bool]:
    """Reduce a bool token mask [.., Sq, Sk] (2-D to 4-D) to blocks: a block is kept when any of its pairs is.

    Returns (blocks, needs_token_mask): needs_token_mask is True when some kept block is only partly visible, so
    attention() must also get attn_mask=token_mask to be exact (a host read of one flag)."""
    if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool:
        raise TypeError(f"token_mask must be a bool tensor, got {getattr(token_mask, 'dtype', type(token_mask))}")
    if token_mask.ndim not in (2, 3, 4):
        raise ValueError(f"token_mask must be 2-D to 4-D [.., Sq, Sk], got shape {tuple(token_mask.shape)}")
    block_q, block_kv = check_block_size(block_size)
    seq_q, seq_kv = token_mask.shape[-2:]
    nq, nk = math.ceil(seq_q / block_q), math.ceil(seq_kv / block_kv)
    mask = token_mask
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    padded = torch.zeros(*mask.shape[:2], nq * block_q, nk * block_kv, dtype=torch.int32, device=mask.device)
    padded[..., :seq_q, :seq_kv] = mask
    kept = padded.view(*mask.shape[:2], nq, block_q, nk, block_kv).sum((3, 5))
    rows = torch.clamp(torch.arange(1, nq + 1, device=mask.device) * block_q, max=seq_q) - \
        torch.arange(nq, device=mask.device) * block_q
    cols = torch.clamp(torch.arange(1, nk + 1, device=mask.device) * block_kv, max=seq_kv) - \
        torch.arange(nk, device=mask.device) * block_kv
    area = rows[:, None] * cols[None, :]
    keep = kept > 0
    needs_token_mask = bool(((kept > 0) & (kept < area)).any().item())
    return BlockSparsity.from_mask(keep, (block_q, block_kv), seq_q, seq_kv), needs_token_mask


def _combine(parts: Sequence[BlockSparsity], op) -> BlockSparsity:
    if not parts:
        raise ValueError("give at least one BlockSparsity")
    first = parts[0]
    for other in parts[1:]:
        if not isinstance(other, BlockSparsity):
            raise TypeError(f"expected BlockSparsity, got {type(other).__name__}")
        if (other.block_size, other.seq_q, other.seq_kv) != (first.block_size, first.seq_q, first.seq_kv):
            raise ValueError(f"cannot combine masks of different geometry: block_size/seq_q/seq_kv "
                             f"{first.block_size}/{first.seq_q}/{first.seq_kv} and "
                             f"{other.block_size}/{other.seq_q}/{other.seq_kv}")
    keep = first.mask
    for other in parts[1:]:
        keep = op(keep, other.mask)
    return BlockSparsity.from_mask(keep, first.block_size, first.seq_q, first.seq_kv)


def union(*parts: BlockSparsity) -> BlockSparsity:
    """Blocks kept by any part (same block size and lengths; batch and head dims broadcast)."""
    return _combine(parts, torch.logical_or)


def intersection(*parts: BlockSparsity) -> BlockSparsity:
    """Blocks kept by every part (same block size and lengths; batch and head dims broadcast)."""
    return _combine(parts, torch.logical_and)

