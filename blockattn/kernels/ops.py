"""The Triton path as torch.library custom ops, so autograd and torch.compile see one opaque, differentiable op.

The ops take only tensors and scalars: BlockSparsity is unpacked by blockattn.api before the call. For a packed
("thd") batch, cu_seqlens_q / cu_seqlens_kv are the int32 offsets [N + 1] and max_seqlen_q / max_seqlen_kv the
longest lengths; otherwise they are None and 0.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backward import attention_backward
# blockattn.api reads PV_FORMATS, PV_MIN_TILE_KV and full_tiles_first from here
from .forward import PV_FORMATS, PV_MIN_TILE_KV, attention_forward, full_tiles_first, output_buffers  # noqa: F401
from .varlen import Varlen


def _varlen(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) -> Optional[Varlen]:
    if cu_seqlens_q is None:
        return None
    return Varlen(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)


def forward_quantized(q: Tensor, k: Tensor, v: Tensor, kv_count: Tensor, kv_index: Tensor,
                      q_count: Optional[Tensor], q_index: Optional[Tensor], token_mask: Optional[Tensor],
                      block_mask: Optional[Tensor], kv_valid: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                      cu_seqlens_kv: Optional[Tensor], scale: float, block_q: int, block_kv: int,
                      mask_block_q: int, mask_block_kv: int, is_causal: bool, max_seqlen_q: int,
                      max_seqlen_kv: int, quant: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """(out [B, H, Sq, Dv], lse fp32 [B, H, Sq]): the forward with quant None, "int8", "int8-fp8" or "int8-int8".
    q_count/q_index are the q lists, carried for the backward (None for the quantized forward, which has none)."""
    return attention_forward(q, k, v, kv_count, kv_index, block_q, block_kv, scale, token_mask=token_mask,
                             is_causal=is_causal, block_mask=block_mask, mask_block_q=mask_block_q,
                             mask_block_kv=mask_block_kv, kv_valid=kv_valid,
                             varlen=_varlen(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv), quant=quant)


def forward_eager(q: Tensor, k: Tensor, v: Tensor, kv_count: Tensor, kv_index: Tensor,
                  q_count: Optional[Tensor], q_index: Optional[Tensor], token_mask: Optional[Tensor],
                  block_mask: Optional[Tensor], kv_valid: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                  cu_seqlens_kv: Optional[Tensor], scale: float, block_q: int, block_kv: int,
                  mask_block_q: int, mask_block_kv: int, is_causal: bool, max_seqlen_q: int,
                  max_seqlen_kv: int) -> tuple[Tensor, Tensor]:
    """forward_quantized with quant None: the differentiable op's forward (its schema has no quant)."""
    return forward_quantized(q, k, v, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid,
                             cu_seqlens_q, cu_seqlens_kv, scale, block_q, block_kv, mask_block_q, mask_block_kv,
                             is_causal, max_seqlen_q, max_seqlen_kv)


# The op torch.compile sees. In eager mode blockattn.api calls forward_eager itself (no gradient needed) or
# EagerAttention below: the custom-op dispatch measured about 1 ms of host time per call (BENCHMARKS.md).
sparse_attention_fwd = torch.library.custom_op("blockattn::sparse_attention_fwd", mutates_args=())(forward_eager)


quantized_attention_fwd = torch.library.custom_op("blockattn::quantized_attention_fwd",
                                                  mutates_args=())(forward_quantized)


@sparse_attention_fwd.register_fake
@quantized_attention_fwd.register_fake
def _(q, k, v, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid, cu_seqlens_q, cu_seqlens_kv,
      scale, block_q, block_kv, mask_block_q, mask_block_kv, is_causal, max_seqlen_q, max_seqlen_kv, quant=None):
    return output_buffers(q, v.shape[-1], cu_seqlens_q is not None)


def backward_eager(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                   lse: Tensor, kv_count: Tensor, kv_index: Tensor, q_count: Tensor, q_index: Tensor,
                   token_mask: Optional[Tensor], block_mask: Optional[Tensor], kv_valid: Optional[Tensor],
                   cu_seqlens_q: Optional[Tensor], cu_seqlens_kv: Optional[Tensor], scale: float, block_q: int,
                   block_kv: int, mask_block_q: int, mask_block_kv: int, is_causal: bool, max_seqlen_q: int,
                   max_seqlen_kv: int, needs: Optional[list[bool]] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) shaped and strided like (q, k, v). needs: which of them to compute (default all); one not
    needed comes back as zeros of its shape (the op's outputs are tensors; autograd drops them)."""
    needs = (True, True, True) if needs is None else tuple(bool(n) for n in needs)
    grads = backward_some(needs, grad_out, grad_lse, q, k, v, out, lse, kv_count, kv_index, q_count, q_index,
                          token_mask, block_mask, kv_valid, cu_seqlens_q, cu_seqlens_kv, scale, block_q, block_kv,
                          mask_block_q, mask_block_kv, is_causal, max_seqlen_q, max_seqlen_kv)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))


def backward_some(needs: tuple, grad_out, grad_lse, q, k, v, out, lse, kv_count, kv_index, q_count, q_index,
                  token_mask, block_mask, kv_valid, cu_seqlens_q, cu_seqlens_kv, scale, block_q, block_kv,
                  mask_block_q, mask_block_kv, is_causal, max_seqlen_q, max_seqlen_kv):
    """The backward computing only the gradients needs (dq, dk, dv flags) asks for; the others are None."""
    return attention_backward(grad_out, q, k, v, out, lse, kv_count, kv_index, q_count, q_index, block_q, block_kv,
                              scale, grad_lse=grad_lse, token_mask=token_mask, is_causal=is_causal,
                              block_mask=block_mask, mask_block_q=mask_block_q, mask_block_kv=mask_block_kv,
                              kv_valid=kv_valid,
                              varlen=_varlen(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv), needs=needs)


sparse_attention_bwd = torch.library.custom_op("blockattn::sparse_attention_bwd", mutates_args=())(backward_eager)


@sparse_attention_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid,
      cu_seqlens_q, cu_seqlens_kv, scale, block_q, block_kv, mask_block_q, mask_block_kv, is_causal, max_seqlen_q,
      max_seqlen_kv, needs=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_TENSOR_INPUTS = 12  # q .. cu_seqlens_kv; the rest are scalars


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_TENSOR_INPUTS], *output)
    ctx.scalars = inputs[_TENSOR_INPUTS:]


def _gradients(ctx, grad_out, grad_lse, backward_fn) -> tuple:
    """(dq, dk, dv), each None where autograd does not ask for it, from a context _setup_context filled."""
    (q, k, v, kv_count, kv_index, q_count, q_index, token_mask, block_mask, kv_valid, cu_q, cu_kv, out,
     lse) = ctx.saved_tensors
    if q_count is None or q_index is None:
        raise RuntimeError("blockattn: the forward ran without q lists, so it cannot be differentiated; "
                           "call attention() with inputs that require grad")
    if grad_out is None:  # only the LSE was used
        grad_out = torch.zeros_like(out)
    # Only the gradients autograd asks for: frozen keys and values skip the dK/dV kernel, a frozen query the dQ
    # kernel.
    needs = tuple(ctx.needs_input_grad[:3])
    grads = backward_fn(needs, grad_out.contiguous(), grad_lse, q, k, v, out, lse, kv_count, kv_index, q_count,
                        q_index, token_mask, block_mask, kv_valid, cu_q, cu_kv, *ctx.scalars)
    return tuple(g if need else None for g, need in zip(grads, needs))


def _op_backward(needs: tuple, *args):
    return sparse_attention_bwd(*args, needs=list(needs))


def _backward(ctx, grad_out, grad_lse):
    return _gradients(ctx, grad_out, grad_lse, _op_backward) + (None,) * (_TENSOR_INPUTS - 3 + len(ctx.scalars))


sparse_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """The custom ops' forward and backward as a plain autograd Function, for eager calls that need gradients:
    the custom-op dispatch measured about 1 ms of host time per call on the H200 machine (BENCHMARKS.md), several
    times a short sequence's kernel time. blockattn.api uses the custom op whenever torch.compile traces.
    apply(q, k, v, rest): rest is the tuple of sparse_attention_fwd's arguments after v. One argument for those
    seventeen (none of which takes a gradient) costs autograd less host time in the forward and the backward
    (benchmarks/function_cost.py)."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        out, lse = forward_eager(q, k, v, *rest)
        _setup_context(ctx, (q, k, v, *rest), (out, lse))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero buffers, no work
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # a double backward raises instead of dropping this op's share
    def backward(ctx, grad_out, grad_lse):
        return _gradients(ctx, grad_out, grad_lse, backward_some) + (None,)
