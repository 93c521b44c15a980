"""Video sparse attention over a T x H x W latent: tiles, a coarse branch, top-k selection and a gate.

A latent of `grid` = (T, H, W) tokens, in raster order (w fastest), is cut into tiles of `tile` = (t, h, w)
tokens. `TileLayout` moves a sequence into *tile order*: tiles in row-major tile order, each tile's real tokens
contiguous (raster order within the tile) and followed by zeros up to t*h*w slots when the grid's edge cuts the
tile. Each tile is then one attention block, and `TileLayout.valid` (real tokens per tile) is attention()'s
kv_valid.

`video_sparse_attention` runs the video sparse attention scheme (VSA; FastVideo's `video_sparse_attn`) on
tile-ordered tensors:

- coarse: the mean of each tile's real tokens of q, k and v (fp32); dense attention between those means; each
  query tile's coarse output is given to all of its tokens;
- select: each query tile keeps the `topk` key tiles with the highest coarse scores (per query head);
- fine: exact attention over the kept tiles (`blockattn.attention`, padding keys masked through kv_valid);
- out = fine + gate * coarse, with gate a tensor shaped like out (FastVideo's compress_attn_weight) or 1.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from .api import attention
from .masks import three_positive
from .select import block_means
from .sparsity import BlockSparsity


class TileLayout:
    """The tile order of a (T, H, W) grid cut into (t, h, w) tiles.

    slots: int64 [T*H*W], the tile-order position of each raster-order token; valid: int32 [num_tiles], the real
    tokens of each tile (t*h*w unless the grid's edge cuts it); seq = num_tiles * t*h*w, the tile-ordered length."""

    def __init__(self, grid: Sequence[int], tile: Sequence[int], device=None):
        self.grid, self.tile = three_positive("grid", grid), three_positive("tile", tile)
        self.tiles_per_axis = tuple(math.ceil(g / t) for g, t in zip(self.grid, self.tile))
        self.num_tiles = math.prod(self.tiles_per_axis)
        self.tile_tokens = math.prod(self.tile)
        self.seq = self.num_tiles * self.tile_tokens
        axes = [torch.arange(g, device=device) for g in self.grid]
        coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)   # [T*H*W, 3], raster order
        size = torch.tensor(self.tile, device=device)
        tile_coord, inside = coords // size, coords % size
        # a tile cut by the grid's edge spans only its real extent, so its tokens stay contiguous at its start
        extent = torch.minimum(size, torch.tensor(self.grid, device=device) - tile_coord * size)   # [T*H*W, 3]
        tile_index = (tile_coord[:, 0] * self.tiles_per_axis[1] + tile_coord[:, 1]) * self.tiles_per_axis[2] \
            + tile_coord[:, 2]
        rank = (inside[:, 0] * extent[:, 1] + inside[:, 1]) * extent[:, 2] + inside[:, 2]
        self.slots = tile_index * self.tile_tokens + rank
        edges = [torch.clamp(g - torch.arange(n, device=device) * t, max=t)
                 for g, t, n in zip(self.grid, self.tile, self.tiles_per_axis)]
        self.valid = (edges[0][:, None, None] * edges[1][None, :, None] * edges[2][None, None, :]).reshape(-1).to(
            torch.int32)

    def _check(self, x: torch.Tensor, dim: int, length: int, what: str) -> int:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        if not -x.ndim <= dim < x.ndim:
            raise ValueError(f"dim {dim} is out of range for a {x.ndim}-D tensor")
        if x.shape[dim] != length:
            raise ValueError(f"x must have {length} {what} along dim {dim}, got {x.shape[dim]} "
                             f"(grid {self.grid}, tile {self.tile})")
        return dim % x.ndim

    def to_tiles(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Raster order [.., T*H*W (at dim), ..] -> tile order [.., seq, ..], padding slots zero. Differentiable."""
        dim = self._check(x, dim, len(self.slots), "raster-order tokens")
        shape = list(x.shape)
        shape[dim] = self.seq
        return x.new_zeros(shape).index_copy(dim, self.slots.to(x.device), x)

    def from_tiles(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Tile order [.., seq (at dim), ..] -> raster order [.., T*H*W, ..], padding slots dropped."""
        dim = self._check(x, dim, self.seq, "tile-ordered slots")
        return x.index_select(dim, self.slots.to(x.device))


def _tile_tokens(tile_size) -> int:
    if isinstance(tile_size, (tuple, list)):
        return math.prod(three_positive("tile_size", tile_size))
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size <= 0:
        raise ValueError(f"tile_size must be a positive int (tokens per tile) or (t, h, w), got {tile_size!r}")
    return tile_size


def _valid_counts(name: str, valid, batch: int, tiles: int, tile_tokens: int,
                  device) -> Optional[torch.Tensor]:
    """int32 [B|1, tiles]: the given real-token counts per tile; None when not given (every tile full)."""
    if valid is None:
        return None
    if not isinstance(valid, torch.Tensor) or valid.dtype.is_floating_point or valid.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor [{tiles}] or [B, {tiles}], got "
                        f"{getattr(valid, 'dtype', type(valid).__name__)}")
    if valid.shape not in ((tiles,), (1, tiles), (batch, tiles)):
        raise ValueError(f"{name} must be shaped [{tiles}] or [B={batch}, {tiles}] (one count per tile), got "
                         f"{tuple(valid.shape)}")
    if valid.device != device:
        raise ValueError(f"{name} is on {valid.device} but q is on {device}")
    return valid.reshape(-1, tiles).to(torch.int32).clamp(0, tile_tokens)  # a tile holds at most tile_tokens


def video_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk: int,
                           tile_size: Union[int, Sequence[int]], *, q_valid: Optional[torch.Tensor] = None,
                           kv_valid: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
                           layout: str = "bhsd", scale: Optional[float] = None, backend: str = "auto",
                           return_blocks: bool = False):
    """Video sparse attention (coarse branch + top-k tiles + fine branch) on tile-ordered inputs.

    q: [B, Hq, Sq, D], k: [B, Hkv, Sk, D], v: [B, Hkv, Sk, Dv] ("bhsd"; [B, S, H, D] for "bshd"), in tile order
    (TileLayout.to_tiles), Sq and Sk whole tiles. tile_size: tokens per tile, or (t, h, w). topk: key tiles kept
    per query tile, 1..Sk / tile. q_valid / kv_valid: integer [n] or [B, n], real tokens at the start of each
    query / key tile (TileLayout.valid; default: all); padding keys are masked, padding queries get outputs that
    from_tiles drops. gate: shaped like out, multiplies the coarse branch (None: 1). Selection scores are
    pooled_q . pooled_k * scale in fp32 and take no gradient; everything else is differentiable.
    Returns out (layout, Dv last, q's dtype), and with return_blocks also the BlockSparsity of the kept tiles
    ([B, Hq, nq, nk] mask)."""
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f'layout must be "bhsd" or "bshd", got {layout!r}')
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor ({layout!r}), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v)) if layout == "bshd" else (q, k, v)
    batch, heads, seq_q, dim = qh.shape
    kv_heads, seq_kv = kh.shape[1], kh.shape[2]
    tile = _tile_tokens(tile_size)
    for name, seq in (("q", seq_q), ("k", seq_kv)):
        if seq == 0 or seq % tile:
            raise ValueError(f"{name}'s sequence must be whole tiles of {tile} tokens (TileLayout.to_tiles pads "
                             f"them), got length {seq}")
    if kv_heads == 0 or heads % kv_heads or kh.shape[0] != batch or vh.shape[:3] != kh.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share batch, k and v "
                         "their heads and length, with query heads a multiple of key heads")
    nq, nk = seq_q // tile, seq_kv // tile
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= nk:
        raise ValueError(f"topk must be an int in 1..{nk} (the key tiles), got {topk!r}")
    q_counts = _valid_counts("q_valid", q_valid, batch, nq, tile, q.device)
    kv_counts = _valid_counts("kv_valid", kv_valid, batch, nk, tile, q.device)
    if gate is not None:
        if not isinstance(gate, torch.Tensor):
            raise TypeError(f"gate must be a tensor shaped like the output, got {type(gate).__name__}")
        out_shape = (*q.shape[:3], v.shape[3])
        if tuple(gate.shape) != out_shape:
            raise ValueError(f"gate must be shaped like the output {list(out_shape)}, got {tuple(gate.shape)}")
    scale = dim ** -0.5 if scale is None else scale

    group = heads // kv_heads
    pooled_q = block_means(qh, tile, q_counts)                                             # [B, Hq, nq, D]
    pooled_k = block_means(kh, tile, kv_counts).repeat_interleave(group, 1)                # [B, Hq, nk, D]
    pooled_v = block_means(vh, tile, kv_counts).repeat_interleave(group, 1)                # [B, Hq, nk, Dv]
    scores = pooled_q @ pooled_k.transpose(-1, -2) * scale                                 # [B, Hq, nq, nk]
    if kv_counts is not None:
        empty = (kv_counts == 0)[:, None, None, :]                                          # no key in the tile
        scores = scores.masked_fill(empty, float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)       # a row with only empty tiles: zeros
    coarse = (weights @ pooled_v).to(q.dtype)                                              # [B, Hq, nq, Dv]

    with torch.no_grad():
        keep = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
        keep.scatter_(-1, scores.topk(topk, dim=-1).indices, True)
    blocks = BlockSparsity.from_mask(keep, (tile, tile), seq_q, seq_kv)
    # kv_valid only when given: full tiles need no per-element test (the kernels' plain loop)
    fine = attention(q, k, v, blocks, layout=layout, scale=scale, kv_valid=kv_counts, backend=backend)
    # each query tile's coarse row broadcast over its tokens, never materialized at full length
    dim_v = coarse.shape[-1]
    if layout == "bshd":
        tiled = (batch, nq, tile, heads, dim_v)
        coarse = coarse.permute(0, 2, 1, 3)[:, :, None]                                    # [B, nq, 1, Hq, Dv]
    else:
        tiled = (batch, heads, nq, tile, dim_v)
        coarse = coarse[:, :, :, None]                                                     # [B, Hq, nq, 1, Dv]
    fine = fine.view(tiled)
    out = fine + coarse if gate is None else torch.addcmul(fine, gate.reshape(tiled), coarse)
    out = out.reshape(*q.shape[:3], dim_v)
    return (out, blocks) if return_blocks else out
