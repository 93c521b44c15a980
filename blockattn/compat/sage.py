"""SageAttention's entry points, sageattn and sageattn_varlen, on blockattn's quantized forward (quant="int8").

Conventions kept: tensor_layout "HND" ([B, H, S, D]) or "NHD" ([B, S, H, D]); sm_scale (default D ** -0.5);
return_lse gives the natural-log LSE [B, H, Sq] of the scaled scores, the keys' mean share included; inference
only. Differences: q and k are quantized per token (SageAttention: per block or per warp of tokens), P @ V stays
in the inputs' dtype (SageAttention on Hopper rounds it to fp8), fp32 inputs and the CPU are served too, and
`blocks` / `block_size` make it block-sparse (blockattn.attention's). The keys are always smoothed (SageAttention's
smooth_k=True, its default); smooth_k=False is refused rather than ignored.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..api import attention

_LAYOUTS = {"HND": "bhsd", "NHD": "bshd"}


def _check_options(smooth_k, options: dict) -> None:
    if smooth_k is not True:
        raise ValueError(f"smooth_k={smooth_k!r}: blockattn always subtracts the keys' mean (smooth_k=True)")
    if options:
        raise TypeError(f"unsupported SageAttention options {sorted(options)}: blockattn's quantized forward "
                        "quantizes q and k per token to int8 and keeps P @ V in the inputs' dtype")


def sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_layout: str = "HND", is_causal: bool = False,
             sm_scale: Optional[float] = None, return_lse: bool = False, *, smooth_k: bool = True, blocks=None,
             block_size=None, **options):
    """q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] ("HND"; [B, S, H, D] for "NHD") -> out in that layout (and the LSE
    fp32 [B, Hq, Sq] with return_lse). blocks / block_size: blockattn.attention's block mask (None: dense)."""
    if tensor_layout not in _LAYOUTS:
        raise ValueError(f'tensor_layout must be "HND" or "NHD", got {tensor_layout!r}')
    _check_options(smooth_k, options)
    return attention(q, k, v, blocks, block_size, layout=_LAYOUTS[tensor_layout], scale=sm_scale,
                     is_causal=is_causal, quant="int8", return_lse=return_lse)


def sageattn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False,
                    sm_scale: Optional[float] = None, smooth_k: bool = True, *, blocks=None, block_size=None,
                    **options):
    """Packed q [Tq, Hq, D], k, v [Tk, Hkv, D] with int32 offsets cu_seqlens_q / cu_seqlens_k [N + 1] and the longest
    lengths -> out [Tq, Hq, D]. blocks: per sequence, [N|1, H|1, nq, nk] at the longest lengths (None: dense)."""
    _check_options(smooth_k, options)
    return attention(q, k, v, blocks, block_size, layout="thd", cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_kv=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_k,
                     scale=sm_scale, is_causal=is_causal, quant="int8")
