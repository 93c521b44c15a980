"""Scored block selection: which key blocks matter to each query block, from mean-pooled queries and keys."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .sparsity import BlockSparsity, check_block_size

# Query tokens scored per chunk: bounds the [B, H, chunk / block_q, nk] score tensor.
_CHUNK_TOKENS = 128 * 1024


# Bytes of input block_means copies at a time when it zeroes padding tokens (a few heads at a time).
_POOL_CHUNK_BYTES = 256 << 20


def block_means(x: torch.Tensor, block: int, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean of each block of `block` tokens, summed in fp32 straight from x's dtype: [B, H, S, D] -> fp32
    [B, H, ceil(S / block), D]. Without counts, over each block's tokens inside the sequence (the last block may be
    ragged). counts: int [B|1, n] (S whole blocks), the real tokens at the start of each block, the rest padding
    that may hold anything; a block with none gives zeros."""
    batch, heads, seq, dim = x.shape
    whole, tail = divmod(seq, block)
    if counts is None:
        sums = x[:, :, :whole * block].reshape(batch, heads, whole, block, dim).sum(3, dtype=torch.float32)
        sizes = torch.full((whole + bool(tail),), block, dtype=torch.float32, device=x.device)
        if tail:
            sums = torch.cat([sums, x[:, :, whole * block:].sum(2, keepdim=True, dtype=torch.float32)], dim=2)
            sizes[-1] = tail
        return sums / sizes[:, None]
    tiled = x.view(batch, heads, whole, block, dim)
    real = (torch.arange(block, device=x.device) < counts[..., None])[:, None, :, :, None]   # [B|1, 1, n, block, 1]
    per_head = batch * seq * dim * x.element_size()
    sums = torch.cat([torch.where(real, part, 0).sum(3, dtype=torch.float32)
                      for part in tiled.split(max(1, _POOL_CHUNK_BYTES // per_head), dim=1)], dim=1)
    return sums / counts.clamp(min=1)[:, None, :, None].to(torch.float32)


def _broadcastable(name: str, mask, shape) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool block mask, got {getattr(mask, 'dtype', type(mask).__name__)}")
    try:
        return mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"{name} must broadcast to {list(shape)} ([B, H, nq, nk]), got {tuple(mask.shape)}") from None


def select_blocks(q: torch.Tensor, k: torch.Tensor, budget: Optional[float] = 0.25, block_size=(128, 64), *,
                  mass: Optional[float] = None, keep_diagonal: bool = True, head_shared: bool = False,
                  pins: Optional[torch.Tensor] = None, drops: Optional[torch.Tensor] = None,
                  scale: Optional[float] = None) -> BlockSparsity:
    """Pick the key blocks each query block attends to.

    q: [B, Hq, Sq, D], k: [B, Hkv, Sk, D] ("bhsd"; Hq a multiple of Hkv). Queries and keys are mean-pooled per
    block (a ragged last block over its real tokens, in fp32) and scored as pooled_q @ pooled_k^T * scale per
    query head (GQA maps each kv head onto its query heads; head_shared averages the scores over heads and returns
    one mask for all). Per query block it keeps either the ceil(budget * nk) best blocks (ties to the lower
    index), or with `mass` the fewest best blocks whose softmaxed pooled scores sum to at least `mass`; then adds the
    diagonal blocks (token ranges overlapping the query block's) if keep_diagonal, adds `pins`, removes `drops`
    (bool masks broadcastable to [B, H, nq, nk]); a row left empty by that gets its best block not dropped.
    Runs on q's device without host synchronization; scores are built 128k query tokens at a time.
    Returns a BlockSparsity [B, H or 1, nq, nk]."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, S, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head dim, with query "
                         "heads a multiple of key heads")
    if mass is None:
        if budget is None or not 0 < budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {budget!r}")
    elif not 0 < mass <= 1:
        raise ValueError(f"mass must be in (0, 1], got {mass!r}")
    block_q, block_kv = check_block_size(block_size)
    batch, heads, seq_q, dim = q.shape
    seq_kv = k.shape[2]
    group = heads // k.shape[1]
    nq, nk = math.ceil(seq_q / block_q), math.ceil(seq_kv / block_kv)
    scale = dim ** -0.5 if scale is None else float(scale)
    out_heads = 1 if head_shared else heads
    shape = (batch, out_heads, nq, nk)
    pins = _broadcastable("pins", pins, shape)
    drops = _broadcastable("drops", drops, shape)

    pooled_k = block_means(k, block_kv).repeat_interleave(group, 1)            # [B, H, nk, D]
    keep = torch.zeros(shape, dtype=torch.bool, device=q.device)
    q_first = torch.arange(nq, device=q.device) * block_q
    q_last = torch.clamp(q_first + block_q, max=seq_q) - 1
    k_first = torch.arange(nk, device=q.device) * block_kv
    k_last = torch.clamp(k_first + block_kv, max=seq_kv) - 1
    rows_per_chunk = max(1, _CHUNK_TOKENS // block_q)
    for start in range(0, nq, rows_per_chunk):
        stop = min(nq, start + rows_per_chunk)
        pooled_q = block_means(q[:, :, start * block_q:stop * block_q], block_q)  # [B, H, c, D]
        scores = pooled_q @ pooled_k.transpose(-1, -2) * scale              # [B, H, c, nk]
        if head_shared:
            scores = scores.mean(1, keepdim=True)
        order = torch.sort(scores, dim=-1, descending=True, stable=True)
        if mass is None:
            take = torch.arange(nk, device=q.device) < max(1, math.ceil(budget * nk))
            take = take.expand_as(order.indices)
        else:
            probs = torch.softmax(order.values, -1)
            take = (probs.cumsum(-1) - probs) < mass                       # the fewest reaching the mass
        chunk = torch.zeros_like(take).scatter_(-1, order.indices, take)
        if keep_diagonal:
            overlap = (k_first[None, :] <= q_last[start:stop, None]) & (q_first[start:stop, None] <= k_last[None, :])
            chunk = chunk | overlap
        if pins is not None:
            chunk = chunk | pins[:, :, start:stop]
        if drops is not None:
            allowed = ~drops[:, :, start:stop]
            chunk = chunk & allowed
            # a row the drops emptied gets its best allowed block
            best = torch.where(allowed, scores, float("-inf")).argmax(-1, keepdim=True)
            rescue = torch.zeros_like(chunk).scatter_(-1, best, True) & allowed
            chunk = chunk | (rescue & ~chunk.any(-1, keepdim=True))
        keep[:, :, start:stop] = chunk
    return BlockSparsity.from_mask(keep, (block_q, block_kv), seq_q, seq_kv)
