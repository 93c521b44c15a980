"""The PyTorch backend: block-gathered sparse attention, differentiable through autograd.

For each chunk of query blocks it gathers only the kept key blocks (from the kv lists), so memory grows with the
kept blocks, never with Sq x Sk. It computes in float32 (float64 for float64 inputs) and follows the semantics of
DESIGN.md exactly: a row with no visible key gives zeros and LSE -inf.
"""

from __future__ import annotations

from typing import Optional

import torch

from .sparsity import BlockSparsity

# Bytes of fp32 scores one chunk of query blocks may hold; chunks keep the peak memory bounded.
_CHUNK_BYTES = 256 * 2**20


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: BlockSparsity, scale: float,
                           token_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                           kv_valid: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] -> (out [B, Hq, Sq, Dv] in q's dtype,
    lse float32 [B, Hq, Sq]). token_mask: bool, broadcastable to [B, Hq, Sq, Sk]; kv_valid: int [B|1, nk]."""
    batch, heads, seq_q, _ = q.shape
    kv_heads, seq_kv = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q, block_kv = blocks.block_size
    nq, nk = blocks.num_blocks
    compute = torch.promote_types(q.dtype, torch.float32)
    device = q.device

    count = blocks.kv_count.expand(batch, heads, nq)
    index = blocks.kv_index.expand(batch, heads, nq, blocks.kv_index.shape[-1])
    slots = max(int(count.max().item()), 1)  # the widest row: gathered width (a host read; this is the CPU path)
    index = index[..., :slots].long()

    pad_q, pad_kv = nq * block_q - seq_q, nk * block_kv - seq_kv
    q_blocks = torch.nn.functional.pad(q, (0, 0, 0, pad_q)).view(batch, heads, nq, block_q, -1)
    k_blocks = torch.nn.functional.pad(k, (0, 0, 0, pad_kv)).view(batch, kv_heads, nk, block_kv, -1)
    v_blocks = torch.nn.functional.pad(v, (0, 0, 0, pad_kv)).view(batch, kv_heads, nk, block_kv, -1)

    b_idx = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h_idx = torch.arange(heads, device=device).view(1, heads, 1, 1)
    kv_h_idx = h_idx // group
    offsets_kv = torch.arange(block_kv, device=device)
    if token_mask is not None:
        token_mask = token_mask.expand(batch, heads, seq_q, seq_kv)
    if kv_valid is not None:
        kv_valid = kv_valid.expand(batch, nk).long()

    per_q_block = batch * heads * block_q * slots * block_kv * 4
    chunk = max(1, _CHUNK_BYTES // max(per_q_block, 1))
    outs, lses = [], []
    for start in range(0, nq, chunk):
        stop = min(nq, start + chunk)
        idx = index[:, :, start:stop]                                     # [B, H, c, slots]
        keys = k_blocks[b_idx, kv_h_idx, idx].flatten(3, 4).to(compute)    # [B, H, c, slots*bkv, D]
        values = v_blocks[b_idx, kv_h_idx, idx].flatten(3, 4).to(compute)  # [B, H, c, slots*bkv, Dv]
        queries = q_blocks[:, :, start:stop].to(compute)                  # [B, H, c, bq, D]
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale    # [B, H, c, bq, slots*bkv]

        listed = torch.arange(slots, device=device) < count[:, :, start:stop, None]   # [B, H, c, slots]
        key_pos = idx[..., None] * block_kv + offsets_kv                   # [B, H, c, slots, bkv]
        visible = listed[..., None] & (key_pos < seq_kv)
        if kv_valid is not None:
            valid_len = kv_valid[b_idx, idx]                               # [B, H, c, slots]
            visible = visible & (offsets_kv < valid_len[..., None])
        visible = visible.flatten(3, 4)[..., None, :]                      # [B, H, c, 1, slots*bkv]
        key_pos = key_pos.flatten(3, 4)
        query_pos = torch.arange(start * block_q, stop * block_q, device=device).view(stop - start, block_q)
        if is_causal:
            visible = visible & (key_pos[..., None, :] <= query_pos[:, :, None])
        if token_mask is not None:
            rows = query_pos.clamp(max=seq_q - 1)[None, None, :, :, None]
            cols = key_pos.clamp(max=seq_kv - 1)[:, :, :, None, :]
            visible = visible & token_mask[b_idx[..., None], h_idx[..., None], rows, cols]
        scores = scores.masked_fill(~visible, float("-inf"))

        # Softmax that gives zeros (and finite gradients) on rows that see nothing.
        row_max = scores.amax(-1, keepdim=True).detach()
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(scores - row_max)
        total = weights.sum(-1, keepdim=True)
        seen = total > 0
        safe_total = torch.where(seen, total, torch.ones_like(total))
        outs.append(torch.matmul(weights / safe_total, values))
        lse = torch.where(seen, row_max + torch.log(safe_total), torch.full_like(total, float("-inf")))
        lses.append(lse.squeeze(-1))

    out = torch.cat(outs, dim=2).flatten(2, 3)[:, :, :seq_q].to(q.dtype)
    lse = torch.cat(lses, dim=2).flatten(2, 3)[:, :, :seq_q].to(torch.float32)
    return out, lse
