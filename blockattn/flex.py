"""Interop with FlexAttention (torch.nn.attention.flex_attention)."""

from __future__ import annotations

from typing import Optional

import torch

from .sparsity import BlockSparsity

_COMPILED = {}


def to_block_mask(blocks: BlockSparsity):
    """A FlexAttention BlockMask keeping exactly these blocks, with the exact sequence lengths. Kept blocks are
    marked full, so compiled FlexAttention runs no mask_mod on them (its fastest path); the mask_mod it carries
    looks the block up, so paths that evaluate it (FlexAttention's eager reference) agree. FlexAttention derives
    the q lists for its backward."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(blocks, BlockSparsity):
        raise TypeError(f"blocks must be a BlockSparsity, got {type(blocks).__name__}")
    nk = blocks.num_blocks[1]
    kv_index = blocks.kv_index[..., :nk].contiguous()
    keep = blocks.mask
    block_q, block_kv = blocks.block_size
    per_batch, per_head = keep.shape[0] > 1, keep.shape[1] > 1

    def block_lookup(b, h, q_idx, kv_idx):
        return keep[b if per_batch else 0, h if per_head else 0, q_idx // block_q, kv_idx // block_kv]

    return BlockMask.from_kv_blocks(torch.zeros_like(blocks.kv_count), kv_index, blocks.kv_count, kv_index,
                                    BLOCK_SIZE=blocks.block_size, mask_mod=block_lookup,
                                    seq_lengths=(blocks.seq_q, blocks.seq_kv))


def from_block_mask(block_mask) -> BlockSparsity:
    """The blocks a FlexAttention BlockMask visits (full and partial). A partial block's mask_mod is not carried:
    pass the equivalent token mask to attention() if the partial blocks matter."""
    dense = block_mask.to_dense()
    seq_q, seq_kv = block_mask.seq_lengths
    block_q, block_kv = block_mask.BLOCK_SIZE
    return BlockSparsity.from_mask(dense != 0, (int(block_q), int(block_kv)), int(seq_q), int(seq_kv))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: BlockSparsity, *,
           scale: Optional[float] = None, compiled: Optional[bool] = None) -> torch.Tensor:
    """FlexAttention over the same blocks: q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] -> [B, Hq, Sq, Dv].

    compiled: torch.compile'd flex_attention (the fast path; the default on CUDA) or FlexAttention's eager
    reference (slow; the default elsewhere, since inductor's CPU template fails on some block masks)."""
    from torch.nn.attention.flex_attention import flex_attention

    function = flex_attention
    if compiled is None:
        compiled = q.device.type == "cuda"
    if compiled:
        if "flex" not in _COMPILED:
            _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
        function = _COMPILED["flex"]
    return function(q, k, v, block_mask=to_block_mask(blocks), scale=scale, enable_gqa=q.shape[1] != k.shape[1])
