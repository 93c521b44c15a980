"""FastVideo's video sparse attention and 256-token block-sparse attention entry points, on blockattn.

video_sparse_attn / video_sparse_attn_bshd: FastVideo's VSA signature over blockattn.video.video_sparse_attention
(one difference: the coarse branch's means and scores stay in fp32 where FastVideo rounds them to the input dtype,
so near-tied tiles may be selected differently).

block_sparse_attn_256 / _bshd: conventions kept: 256-token blocks; ``block_map`` [B, H, Qb, KVb] (a 3-D map is
unsqueezed at dim 0), nonzero = keep; ``variable_block_sizes`` [KVb] = the valid tokens at the start of each key
tile (the rest of the tile is padding and is masked); the second return value is the LSE [B, H, S] in log2 units
of the scaled scores. Forward and backward (autograd, including through the LSE).
"""

from __future__ import annotations

import torch

from ..api import attention
from ..video import video_sparse_attention

BLOCK = 256
_LOG2E = 1.4426950408889634


def _map(block_map: torch.Tensor) -> torch.Tensor:
    if not isinstance(block_map, torch.Tensor):
        raise TypeError(f"block_map must be a tensor [B, H, Qb, KVb], got {type(block_map).__name__}")
    return block_map.unsqueeze(0) if block_map.ndim == 3 else block_map


def _check_tiles(name: str, seq: int):
    if seq % BLOCK:
        raise ValueError(f"{name} must hold whole {BLOCK}-token tiles (pad each tile), got length {seq}")


def block_sparse_attn_256(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor,
                          variable_block_sizes: torch.Tensor):
    """q [B, H, Sq, D], k, v [B, H, Sk, D] with Sq, Sk multiples of 256 -> (out [B, H, Sq, D], lse_log2 [B, H, Sq])."""
    _check_tiles("q", q.shape[2])
    _check_tiles("k", k.shape[2])
    out, lse = attention(q, k, v, _map(block_map), (BLOCK, BLOCK), kv_valid=variable_block_sizes.to(torch.int32),
                         return_lse=True)
    return out, lse * _LOG2E


def block_sparse_attn_256_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor,
                               variable_block_sizes: torch.Tensor):
    """q [B, Sq, H, D], k, v [B, Sk, H, D] -> (out [B, Sq, H, D], lse_log2 [B, H, Sq])."""
    _check_tiles("q", q.shape[1])
    _check_tiles("k", k.shape[1])
    out, lse = attention(q, k, v, _map(block_map), (BLOCK, BLOCK), layout="bshd",
                         kv_valid=variable_block_sizes.to(torch.int32), return_lse=True)
    return out, lse * _LOG2E



def _tile(block_size):
    """FastVideo's block_size: (t, h, w), or an int b for a (b, b, b) cube."""
    return (block_size,) * 3 if isinstance(block_size, int) and not isinstance(block_size, bool) else block_size


def video_sparse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variable_block_sizes: torch.Tensor,
                      q_variable_block_sizes: torch.Tensor, topk: int, block_size=(4, 4, 4),
                      compress_attn_weight=None) -> torch.Tensor:
    """q, k, v [B, H, S, D] in tile order (S whole tiles of prod(block_size) tokens); variable_block_sizes /
    q_variable_block_sizes [tiles]: real tokens per key / query tile; topk key tiles per query tile;
    compress_attn_weight: the coarse branch's gate, shaped like q. -> out [B, H, Sq, D]."""
    return video_sparse_attention(q, k, v, topk, _tile(block_size), q_valid=q_variable_block_sizes,
                                  kv_valid=variable_block_sizes, gate=compress_attn_weight)


def video_sparse_attn_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variable_block_sizes: torch.Tensor,
                           q_variable_block_sizes: torch.Tensor, topk: int, block_size=(4, 8, 8),
                           compress_attn_weight=None) -> torch.Tensor:
    """video_sparse_attn on [B, S, H, D] tensors (FastVideo's default tile here: (4, 8, 8), 256 tokens)."""
    return video_sparse_attention(q, k, v, topk, _tile(block_size), q_valid=q_variable_block_sizes,
                                  kv_valid=variable_block_sizes, gate=compress_attn_weight, layout="bshd")
