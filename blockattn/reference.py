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
                           kv_valid: Optional[torch.Tensor] = None,
                           need_lse: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] -> (out [B, Hq, Sq, Dv] in q's dtype,
    lse float32 [B, Hq, Sq], or None unless need_lse). token_mask: bool, broadcastable to [B, Hq, Sq, Sk];
    kv_valid: int [B|1, nk].

    Each chunk of query blocks attends, through scaled_dot_product_attention (PyTorch's fused kernels), to its
    gathered key blocks; the mask is per key ([.., 1, L]) unless causality or a token mask make it per element.
    Rows that see no key are given one harmless key and zeroed afterwards, so neither the output nor the gradients
    see a NaN."""
    batch, heads, seq_q, _ = q.shape
    kv_heads, seq_kv = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q, block_kv = blocks.block_size
    nq, nk = blocks.num_blocks
    compute = torch.promote_types(q.dtype, torch.float32)
    device = q.device

    count = blocks.kv_count.expand(batch, heads, nq)
    index = blocks.kv_index.expand(batch, heads, nq, blocks.kv_index.shape[-1])
    # the widest row: gathered width (a host read; this is the CPU path); an empty batch has none
    slots = max(int(count.max().item()), 1) if count.numel() else 1
    index = index[..., :slots].long()

    pad_q, pad_kv = nq * block_q - seq_q, nk * block_kv - seq_kv
    q_blocks = torch.nn.functional.pad(q, (0, 0, 0, pad_q)).view(batch, heads, nq, block_q, q.shape[-1])
    k_blocks = torch.nn.functional.pad(k, (0, 0, 0, pad_kv)).view(batch, kv_heads, nk, block_kv, k.shape[-1])
    v_blocks = torch.nn.functional.pad(v, (0, 0, 0, pad_kv)).view(batch, kv_heads, nk, block_kv, v.shape[-1])

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
        rows = stop - start
        idx = index[:, :, start:stop]                                     # [B, H, c, slots]
        keys = k_blocks[b_idx, kv_h_idx, idx].flatten(3, 4).to(compute)    # [B, H, c, L = slots*bkv, D]
        values = v_blocks[b_idx, kv_h_idx, idx].flatten(3, 4).to(compute)  # [B, H, c, L, Dv]
        queries = q_blocks[:, :, start:stop].to(compute)                  # [B, H, c, bq, D]

        listed = torch.arange(slots, device=device) < count[:, :, start:stop, None]   # [B, H, c, slots]
        key_pos = idx[..., None] * block_kv + offsets_kv                   # [B, H, c, slots, bkv]
        visible = listed[..., None] & (key_pos < seq_kv)
        if kv_valid is not None:
            valid_len = kv_valid[b_idx, idx]                               # [B, H, c, slots]
            visible = visible & (offsets_kv < valid_len[..., None])
        visible = visible.flatten(3, 4)[..., None, :]                      # [B, H, c, 1, L]
        key_pos = key_pos.flatten(3, 4)
        query_pos = torch.arange(start * block_q, stop * block_q, device=device).view(rows, block_q)
        if is_causal:
            visible = visible & (key_pos[..., None, :] <= query_pos[:, :, None])
        if token_mask is not None:
            q_rows = query_pos.clamp(max=seq_q - 1)[None, None, :, :, None]
            k_cols = key_pos.clamp(max=seq_kv - 1)[:, :, :, None, :]
            visible = visible & token_mask[b_idx[..., None], h_idx[..., None], q_rows, k_cols]
        seen = visible.any(-1, keepdim=True)                               # [B, H, c, bq | 1, 1]
        # a row that sees nothing attends to its first gathered key instead, and is zeroed below
        first = torch.zeros_like(visible)
        first[..., 0] = True
        attend = visible | (first & ~seen)

        def flat(t):  # [B, H, c, X, Y] -> [B, H*c, X, Y], the 4-D shape the fused kernels take
            return t.reshape(batch, heads * rows, *t.shape[3:])

        out = torch.nn.functional.scaled_dot_product_attention(
            flat(queries), flat(keys), flat(values), attn_mask=flat(attend), scale=scale)
        outs.append(out.view(batch, heads, rows, block_q, v.shape[-1]) * seen)
        if need_lse:
            scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # [B, H, c, bq, L]
            lse = torch.logsumexp(scores.masked_fill(~attend, float("-inf")), -1, keepdim=True)
            lses.append(torch.where(seen, lse, torch.full_like(lse, float("-inf"))).squeeze(-1))

    out = torch.cat(outs, dim=2).flatten(2, 3)[:, :, :seq_q].to(q.dtype)
    if not need_lse:
        return out, None
    lse = torch.cat(lses, dim=2).flatten(2, 3)[:, :, :seq_q].to(torch.float32)
    return out, lse


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    """y rounded to the nearest integer, halves away from zero (the quantize kernels' int8 rounding)."""
    return torch.where(y >= 0, y + 0.5, y - 0.5).trunc()


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row int8 quantization of x [.., D] (the last dim), returned dequantized in x's dtype (fp32 or fp64):
    round(x * 127 / max|x|) (halves away from zero) times max|x| / 127; an all-zero row stays zero. The rule of
    kernels/quant.py."""
    amax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    y = x * inverse
    return _round_half_away(y) * (amax / 127)


def quantized_qk(q: torch.Tensor, k: torch.Tensor, scale: float):
    """quant="int8" on q [B, Hq, Sq, D] and k [B, Hkv, Sk, D]: (q's dequantized int8 values, the keys' less their
    mean over the sequence, in fp32 (fp64 for fp64 inputs), and the LSE's shift [B, Hq, Sq] fp32: scale * q . mean,
    the share of the mean the kernels leave out of the scores)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    mean = k.to(compute).mean(2, keepdim=True)                                  # [B, Hkv, 1, D]
    q_hat = quantize_rows(q.to(compute))
    k_hat = quantize_rows(k.to(compute) - mean)
    group = q.shape[1] // k.shape[1]
    shift = (q_hat * mean.repeat_interleave(group, 1)).sum(-1) * scale
    return q_hat, k_hat, shift.to(torch.float32)


def quantized_v(v: torch.Tensor, fmt: str = "fp8") -> torch.Tensor:
    """V as quant="int8-fp8" (fmt "fp8") or "int8-int8" (fmt "int8") rounds it, v [B, Hkv, Sk, Dv]: each channel
    at scale max|v| / 448 over the sequence to float8 e4m3 (to nearest even), or at max|v| / 127 to int8 (halves
    away from zero); an all-zero channel stays zero. Returned dequantized in fp32 (fp64 for fp64 inputs). The rule
    of kernels/quant.py's quantize_columns."""
    compute = torch.promote_types(v.dtype, torch.float32)
    largest = {"fp8": 448.0, "int8": 127.0}[fmt]
    amax = v.abs().amax(2, keepdim=True).to(torch.float32)
    y = v.to(torch.float32) * torch.where(amax > 0, largest / torch.where(amax > 0, amax, 1.0), 0.0)
    rounded = y.to(torch.float8_e4m3fn).to(torch.float32) if fmt == "fp8" else _round_half_away(y)
    return rounded.to(compute) * (amax / largest).to(compute)
