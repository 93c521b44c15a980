"""The Triton path as torch.library custom ops, so autograd and torch.compile see one opaque, differentiable op.

The ops take only tensors and scalars: BlockSparsity is unpacked by blockattn.api before the call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backward import attention_backward
from .forward import attention_forward


@torch.library.custom_op("blockattn::sparse_attention_fwd", mutates_args=())
def sparse_attention_fwd(q: Tensor, k: Tensor, v: Tensor, kv_count: Tensor, kv_index: Tensor,
                         q_count: Optional[Tensor], q_index: Optional[Tensor], token_mask: Optional[Tensor],
                         block_mask: Optional[Tensor], kv_valid: Optional[Tensor], scale: float, block_q: int,
                         block_kv: int, mask_block_q: int, mask_block_kv: int,
                         is_causal: bool) -> tuple[Tensor, Tensor]:
    """(out [B, H, Sq, Dv], lse fp32 [B, H, Sq]). q_count/q_index are the q lists, carried for the backward."""
    return attention_forward(q, k, v, kv_count, kv_index, block_q, block_kv, scale, token_mask=token_mask,
                             is_causal=is_causal, block_mask=block_mask, mask_block_q=mask_block_q,
                             mask_block_kv=mask_block_kv, kv_valid=kv_valid)


@sparse_attention_fwd.register_fake
def _(q, k, v, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid, scale, block_q, block_kv,
      mask_block_q, mask_block_kv, is_causal):
    batch, heads, seq_q, _ = q.shape
    return q.new_empty(batch, heads, seq_q, v.shape[-1]), q.new_empty(batch, heads, seq_q, dtype=torch.float32)


@torch.library.custom_op("blockattn::sparse_attention_bwd", mutates_args=())
def sparse_attention_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         lse: Tensor, kv_count: Tensor, kv_index: Tensor, q_count: Tensor, q_index: Tensor,
                         token_mask: Optional[Tensor], block_mask: Optional[Tensor], kv_valid: Optional[Tensor],
                         scale: float, block_q: int, block_kv: int, mask_block_q: int, mask_block_kv: int,
                         is_causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) shaped like (q, k, v)."""
    return attention_backward(grad_out, q, k, v, out, lse, kv_count, kv_index, q_count, q_index, block_q, block_kv,
                              scale, grad_lse=grad_lse, token_mask=token_mask, is_causal=is_causal,
                              block_mask=block_mask, mask_block_q=mask_block_q, mask_block_kv=mask_block_kv,
                              kv_valid=kv_valid)


@sparse_attention_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid,
      scale, block_q, block_kv, mask_block_q, mask_block_kv, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid = inputs[:10]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid)
    ctx.scalars = inputs[10:]


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid = ctx.saved_tensors
    if q_count is None or q_index is None:
        raise RuntimeError("blockattn: the forward ran without q lists, so it cannot be differentiated; "
                           "call attention() with inputs that require grad")
    dq, dk, dv = sparse_attention_bwd(grad_out.contiguous(), grad_lse, q, k, v, out, lse, kv_count, kv_index,
                                      q_count, q_index, token_mask, block_mask, kv_valid, *ctx.scalars)
    return (dq, dk, dv) + (None,) * 13


sparse_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
