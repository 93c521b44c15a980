"""The public entry points: validate arguments, normalize layouts and masks, dispatch to a backend."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import NamedTuple, Optional, Union

import torch

from . import reference
from .kernels.varlen import Varlen
from .sparsity import BlockSparsity, check_block_size, compiling_or_capturing

DEFAULT_BLOCK_SIZE = (128, 64)
# blocks=None (every block kept, dense or causal): the shape sets only speed. 128x128 measured faster than 128x64 on
# the H200 (B1 H24 S16384, fwd+bwd: 11.63 against 12.80 ms causal and 21.85 against 24.61 dense at D=128; 7.86 / 7.92
# and 14.86 / 15.05 at D=64, benchmarks/default_blocks.py), and at D=128 it takes the warp-specialized backward.
DENSE_BLOCK_SIZE = (128, 128)
_LAYOUTS = ("bhsd", "bshd", "thd")
_BACKENDS = ("auto", "triton", "torch")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MIN_HEAD_DIM, _MAX_HEAD_DIM = 16, 256
QUANTS = ("int8", "int8-fp8", "int8-int8")  # the quant schemes attention() takes (the CLI offers them too)


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_OPS = None


def _kernel_ops():
    """The Triton custom ops, imported on first use (Triton decides at import whether it interprets), then kept (an
    import statement costs a call about 1.4 us of host time, and a call asks up to three times). Kept in a global,
    not by functools.lru_cache: torch.compile traces this, and warns at every lru_cache it meets."""
    global _OPS
    if _OPS is None:
        from .kernels import ops
        _OPS = ops
    return _OPS


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA tensors (or on CPU under TRITON_INTERPRET=1), else 'torch'. An explicit choice
    that cannot run raises; it never falls back."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" or (device.type == "cpu" and _interpret_requested()) else "torch"
    if backend == "triton":
        if device.type == "cpu" and not _interpret_requested():
            raise ValueError('backend="triton" needs CUDA tensors, or TRITON_INTERPRET=1 to run the kernels on the '
                             f"CPU; got tensors on {device}")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f'backend="triton" runs on CUDA (or CPU under TRITON_INTERPRET=1), got {device}')
        if device.type == "cpu" and not _kernels_interpreted():
            raise ValueError("TRITON_INTERPRET=1 was set after blockattn's kernels were imported; set it before "
                             "the first call so Triton builds interpreted kernels")
    return backend


def _kernels_interpreted() -> bool:
    from .kernels.autotune import is_interpreted
    from .kernels.forward import attention_fwd_kernel
    return is_interpreted(attention_fwd_kernel)


def _check_qkv(q, k, v, layout: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D] (layout {layout!r}), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    (batch, heads, seq_q, head_dim), k_shape, v_shape = q.shape, k.shape, v.shape
    if k_shape[0] != batch or v_shape[0] != batch:
        raise ValueError(f"q, k and v must share the batch size, got {batch}, {k_shape[0]}, {v_shape[0]}")
    if k_shape[1] != v_shape[1] or k_shape[2] != v_shape[2]:
        raise ValueError(f"k and v must share heads and sequence length, got k {tuple(k_shape)} and v {tuple(v_shape)}")
    if k_shape[1] == 0 or heads % k_shape[1]:
        raise ValueError(f"the query heads ({heads}) must be a multiple of the key/value heads ({k_shape[1]})")
    if k_shape[3] != head_dim:
        raise ValueError(f"q and k must share the head dim, got {head_dim} and {k_shape[3]}")
    for name, dim in (("q", head_dim), ("v", v_shape[3])):
        if not _MIN_HEAD_DIM <= dim <= _MAX_HEAD_DIM:
            raise ValueError(f"{name}'s head dim must be in {_MIN_HEAD_DIM}..{_MAX_HEAD_DIM}, got {dim}")
    for name, seq in (("q", seq_q), ("k", k_shape[2])):
        if seq == 0:
            raise ValueError(f"{name} has an empty sequence (length 0)")


_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves fp64 alone


def _under_autocast(q, k, v):
    """(q, k, v, context). Under torch.autocast on q's device: q, k and v in the autocast dtype, as
    scaled_dot_product_attention takes them there (fp64 stays fp64), and a context that switches autocast off while
    blockattn computes, so the PyTorch backend's products keep the precision they have outside autocast. Otherwise
    the inputs unchanged and a null context."""
    device_type = q.device.type if isinstance(q, torch.Tensor) else None
    # is_autocast_available (false for "meta") is opaque to torch.compile before PyTorch 2.13; a compiled call's
    # tensors are on a real device, and the two autocast reads are folded to constants there
    if (device_type is None or not (torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type))
            or not torch.is_autocast_enabled(device_type)):
        return q, k, v, contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_CASTS else t for t in (q, k, v))
    return q, k, v, torch.autocast(device_type, enabled=False)


@functools.lru_cache(maxsize=32)
def _cached_dense(block_size: tuple, seq_q: int, seq_kv: int, device: torch.device) -> BlockSparsity:
    return BlockSparsity.dense(block_size, seq_q, seq_kv, device=device)


def _dense_sparsity(block_size, seq_q: int, seq_kv: int, device: torch.device) -> BlockSparsity:
    """The dense mask for blocks=None, built once per (block size, lengths, device): a dense or causal call then
    reuses its lists (and the causal and q lists derived from them) instead of rebuilding them every call. Built
    afresh while torch.compile traces or a CUDA graph captures (a cached tensor must not come from either)."""
    block_size = check_block_size(block_size)
    if compiling_or_capturing(device):
        return BlockSparsity.dense(block_size, seq_q, seq_kv, device=device)
    return _cached_dense(block_size, seq_q, seq_kv, device)


def _prepare_blocks(blocks, block_size, seq_q: int, seq_kv: int, batch: int, heads: int, device) -> BlockSparsity:
    if isinstance(blocks, BlockSparsity):
        if block_size is not None and tuple(block_size) != blocks.block_size:
            raise ValueError(f"block_size {tuple(block_size)} disagrees with the BlockSparsity's {blocks.block_size}")
        if (blocks.seq_q, blocks.seq_kv) != (seq_q, seq_kv):
            raise ValueError(f"blocks was built for seq_q={blocks.seq_q}, seq_kv={blocks.seq_kv}; the inputs have "
                             f"seq_q={seq_q}, seq_kv={seq_kv}")
        if blocks.device != device:
            raise ValueError(f"blocks is on {blocks.device} but q is on {device}")
        sparsity = blocks
    elif blocks is None:
        sparsity = _dense_sparsity(block_size or DENSE_BLOCK_SIZE, seq_q, seq_kv, device)
    elif isinstance(blocks, torch.Tensor):
        if blocks.device != device:
            raise ValueError(f"the block mask is on {blocks.device} but q is on {device}")
        sparsity = BlockSparsity.from_mask(blocks, block_size or DEFAULT_BLOCK_SIZE, seq_q, seq_kv)
    else:
        raise TypeError(f"blocks must be a block-mask tensor, a BlockSparsity or None, got {type(blocks).__name__}")
    if sparsity.batch not in (1, batch):
        raise ValueError(f"the block mask's batch dim must be 1 or {batch}, got {sparsity.batch}")
    if sparsity.heads not in (1, heads):
        raise ValueError(f"the block mask's head dim must be 1 or the query heads ({heads}), got {sparsity.heads}")
    return sparsity


def _prepare_token_mask(attn_mask, batch: int, heads: int, seq_q: int, seq_kv: int, device):
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a bool tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be bool (True = attend), got {attn_mask.dtype}")
    if attn_mask.device != device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {device}")
    target = (batch, heads, seq_q, seq_kv)
    shape = (1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape)
    if attn_mask.ndim > 4 or any(got not in (1, want) for got, want in zip(shape, target)):
        raise ValueError(f"attn_mask must broadcast to [B, H, Sq, Sk] = {list(target)}, got {tuple(attn_mask.shape)}")
    return attn_mask.reshape(shape).expand(target)


def _prepare_kv_valid(kv_valid, batch: int, nk: int, device):
    if kv_valid is None:
        return None
    if not isinstance(kv_valid, torch.Tensor) or kv_valid.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"kv_valid must be an int32 tensor [nk] or [B, nk], got "
                        f"{getattr(kv_valid, 'dtype', type(kv_valid).__name__)}")
    if kv_valid.device != device:
        raise ValueError(f"kv_valid is on {kv_valid.device} but q is on {device}")
    if kv_valid.ndim == 1:
        kv_valid = kv_valid.unsqueeze(0)
    if kv_valid.ndim != 2 or kv_valid.shape[1] != nk or kv_valid.shape[0] not in (1, batch):
        raise ValueError(f"kv_valid must have shape [nk={nk}] or [B={batch}, nk={nk}], got {tuple(kv_valid.shape)}")
    return kv_valid.to(torch.int32).contiguous()


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    return float(scale)


class _Prepared(NamedTuple):
    q: torch.Tensor          # "bhsd" views; for "thd" [1, H, T, D] views of the packed tensors
    k: torch.Tensor
    v: torch.Tensor
    sparsity: BlockSparsity  # for "thd": per sequence, at the longest lengths
    scale: float
    token_mask: Optional[torch.Tensor]
    kv_valid: Optional[torch.Tensor]
    backend: str
    varlen: Optional[Varlen]  # "thd" only
    lengths: Optional[list]   # "thd" only: [(start_q, len_q, start_kv, len_kv)] per sequence (host values)


def _check_quant(quant, q, k, v) -> None:
    """quant is None or a built scheme, and then no input needs a gradient (the quantized forward has no backward)."""
    if quant is None:
        return
    if quant not in QUANTS:
        raise ValueError(f"quant must be None or one of {QUANTS}, got {quant!r}")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise ValueError(f"quant={quant!r} is a forward for inference and has no backward: call it under "
                         "torch.no_grad() / torch.inference_mode(), or with inputs that do not require grad")


def _check_max_seqlens(max_seqlen_q, max_seqlen_kv, layout: str) -> Optional[tuple]:
    """(max_seqlen_q, max_seqlen_kv) when given (both, positive ints, layout "thd"), else None."""
    if max_seqlen_q is None and max_seqlen_kv is None:
        return None
    if layout != "thd":
        raise ValueError(f'max_seqlen_q / max_seqlen_kv belong to layout "thd", got layout {layout!r}')
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int (give both max_seqlen_q and max_seqlen_kv, or neither),"
                             f" got {value!r}")
    return max_seqlen_q, max_seqlen_kv


def _prepare_offsets(cu_seqlens_q, cu_seqlens_kv, tokens_q: int, tokens_kv: int, device,
                     max_seqlens: Optional[tuple] = None, need_spans: bool = True):
    """Check the "thd" offsets and return (Varlen, per-sequence spans or None). The offsets' values are read on the
    host (a synchronization) unless max_seqlens gives the longest lengths and need_spans is False (the kernels need
    no spans): then nothing is read, and the values are the caller's promise."""
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, tokens_q), ("cu_seqlens_kv", cu_seqlens_kv, tokens_kv)):
        if cu is None:
            raise ValueError(f'layout "thd" needs {name} (int32 offsets [N + 1] of each sequence\'s first token)')
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be a 1-D int32 tensor [N + 1] with N >= 1, got "
                             f"{(cu.dtype, tuple(cu.shape)) if isinstance(cu, torch.Tensor) else type(cu).__name__}")
        if cu.device != device:
            raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if cu_seqlens_q.shape != cu_seqlens_kv.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must describe the same number of sequences, got "
                         f"{cu_seqlens_q.shape[0] - 1} and {cu_seqlens_kv.shape[0] - 1}")
    if max_seqlens is not None and not need_spans:
        return Varlen(cu_seqlens_q.contiguous(), cu_seqlens_kv.contiguous(), *max_seqlens), None
    host_q, host_kv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    for name, cu, total in (("cu_seqlens_q", host_q, tokens_q), ("cu_seqlens_kv", host_kv, tokens_kv)):
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the token count {total}, got {cu}")
    spans = [(host_q[i], host_q[i + 1] - host_q[i], host_kv[i], host_kv[i + 1] - host_kv[i])
             for i in range(len(host_q) - 1)]
    max_q = max(1, max(span[1] for span in spans))
    max_kv = max(1, max(span[3] for span in spans))
    if max_seqlens is not None:
        for name, given, longest in (("max_seqlen_q", max_seqlens[0], max_q), ("max_seqlen_kv", max_seqlens[1],
                                                                                max_kv)):
            if given < longest:
                raise ValueError(f"{name}={given} is shorter than the longest sequence ({longest})")
        max_q, max_kv = max_seqlens
    return Varlen(cu_seqlens_q.contiguous(), cu_seqlens_kv.contiguous(), max_q, max_kv), spans


def _prepare(q, k, v, blocks, block_size, layout, cu_seqlens_q, cu_seqlens_kv, scale, attn_mask, is_causal,
             kv_valid, quant, backend, max_seqlens: Optional[tuple] = None) -> _Prepared:
    """Validate every argument and bring the inputs to "bhsd" views (no copies)."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    if layout != "thd" and (cu_seqlens_q is not None or cu_seqlens_kv is not None):
        raise ValueError(f'cu_seqlens_q / cu_seqlens_kv belong to layout "thd", got layout {layout!r}')
    _check_quant(quant, q, k, v)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if layout in ("bshd", "thd"):
        rank, shape = (4, "[B, S, H, D]") if layout == "bshd" else (3, "[T, H, D]")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.ndim != rank:
                raise ValueError(f"{name} must be a {rank}-D tensor {shape} for layout {layout!r}, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if layout == "bshd":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))
    _check_qkv(q, k, v, layout)
    batch, heads, seq_q, head_dim = q.shape
    seq_kv = k.shape[2]
    device = q.device
    backend = resolve_backend(backend, device)
    if backend == "triton" and q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f'backend="triton" takes fp16, bf16 or fp32 inputs, got {q.dtype}')
    scale = _check_scale(scale, head_dim)
    varlen = spans = None
    if layout == "thd":
        if attn_mask is not None:
            raise NotImplementedError('attn_mask with layout "thd" is not supported yet: use blocks, is_causal '
                                      "and kv_valid")
        varlen, spans = _prepare_offsets(cu_seqlens_q, cu_seqlens_kv, seq_q, seq_kv, device, max_seqlens,
                                         need_spans=backend == "torch")
        batch, seq_q, seq_kv = varlen.batch, varlen.max_q, varlen.max_kv
    sparsity = _prepare_blocks(blocks, block_size, seq_q, seq_kv, batch, heads, device)
    token_mask = _prepare_token_mask(attn_mask, batch, heads, seq_q, seq_kv, device)
    kv_valid = _prepare_kv_valid(kv_valid, batch, sparsity.num_blocks[1], device)
    return _Prepared(q, k, v, sparsity, scale, token_mask, kv_valid, backend, varlen, spans)


def _reference(p: _Prepared, is_causal: bool, q=None, k=None, v=None, need_lse: bool = True):
    """The PyTorch backend on prepared inputs (q, k, v override p's, for autograd on detached copies); the LSE is
    None unless need_lse."""
    q, k, v = (p.q if q is None else q), (p.k if k is None else k), (p.v if v is None else v)
    attend = reference.block_sparse_attention
    if torch.compiler.is_compiling():
        # torch.compile runs the backend eagerly: it reads its lists' lengths on the host (a graph break in any case),
        # and torch 2.13's Inductor on the CPU miscompiled it, giving keys wrong gradients in some chunks (GQA, a chunk
        # of one row) or corrupting the heap (tests/test_compile.py). Wrapped here, not decorated, so that importing
        # blockattn does not import torch._dynamo.
        attend = torch.compiler.disable(attend)
    if p.varlen is None:
        out, lse = attend(q, k, v, p.sparsity, p.scale, p.token_mask, is_causal, p.kv_valid, need_lse)
    else:
        out, lse = _packed_reference(p, is_causal, q, k, v, need_lse, attend)
    if not out.requires_grad and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # no row saw a key (a mask keeping nothing, or packed sequences without keys): zeros, still hung off q, k and
        # v, so that a backward gives zero gradients
        out, lse = (None if t is None else reference.attached(t, q, k, v) for t in (out, lse))
    return out, lse


def _packed_reference(p: _Prepared, is_causal: bool, q, k, v, need_lse: bool, attend):
    """_reference for a packed batch: one sequence at a time, each with its own slice of the block mask."""
    outs, lses = [], []
    mask = p.sparsity.mask
    block_q, block_kv = p.sparsity.block_size
    for index, (start_q, len_q, start_kv, len_kv) in enumerate(p.lengths):
        if len_q == 0:
            continue
        q_i = q[:, :, start_q:start_q + len_q]
        if len_kv == 0:
            outs.append(q_i.new_zeros(*q_i.shape[:3], v.shape[-1]))
            lses.append(torch.full(q_i.shape[:3], float("-inf"), device=q.device))
            continue
        nq, nk = math.ceil(len_q / block_q), math.ceil(len_kv / block_kv)
        keep = mask[index if mask.shape[0] > 1 else 0][None, :, :nq, :nk]
        valid = p.kv_valid[index if p.kv_valid.shape[0] > 1 else 0, :nk][None] if p.kv_valid is not None else None
        out, lse = attend(
            q_i, k[:, :, start_kv:start_kv + len_kv], v[:, :, start_kv:start_kv + len_kv],
            BlockSparsity.from_mask(keep, (block_q, block_kv), len_q, len_kv), p.scale, None, is_causal, valid,
            need_lse)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), (torch.cat(lses, dim=2) if need_lse else None)


def _to_layout(out: torch.Tensor, lse: Optional[torch.Tensor], layout: str):
    """Kernel-side [B, H, S, Dv] / [B, H, S] to the caller's layout (views, no copies); lse may be None."""
    if layout == "bshd":
        return out.transpose(1, 2), lse
    if layout == "thd":
        return out.squeeze(0).permute(1, 0, 2), (None if lse is None else lse.squeeze(0).t())
    return out, lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              blocks: Union[torch.Tensor, BlockSparsity, None] = None, block_size=None, *,
              layout: str = "bhsd", cu_seqlens_q=None, cu_seqlens_kv=None, scale: Optional[float] = None,
              attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
              kv_valid: Optional[torch.Tensor] = None, quant: Optional[str] = None, return_lse: bool = False,
              backend: str = "auto", max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None):
    """Exact attention over the kept (query block, key block) pairs.

    q: [B, Hq, Sq, D], k: [B, Hkv, Sk, D], v: [B, Hkv, Sk, Dv] for layout "bhsd"; [B, S, H, D] for "bshd";
    packed [T, H, D] for "thd" with cu_seqlens_q / cu_seqlens_kv (int32 offsets [N + 1]; a sequence's query and
    key lengths may differ; max_seqlen_q / max_seqlen_kv, the longest lengths as ints, spare the host read of the
    offsets, which synchronizes and breaks a torch.compile graph: with them the Triton path reads nothing back, and
    they must be at least the longest lengths, which it cannot check). Hq a multiple of Hkv (GQA/MQA); D, Dv in
    16..256; fp16, bf16 or fp32 (fp64 on the torch backend).
    blocks: block mask (bool/int8/uint8, nonzero = keep) shaped [nq, nk], [H|1, nq, nk] or [B|1, H|1, nq, nk]
    with nq = ceil(Sq / block_q), nk = ceil(Sk / block_kv) ("thd": [N|1, H|1, nq, nk] at the longest lengths, each
    sequence's blocks starting at its own first token); or a prepared BlockSparsity; or None (dense).
    block_size: (block_q, block_kv), default (128, 64) for a mask tensor and (128, 128) for blocks=None (the fastest
    there); a BlockSparsity carries its own.
    attn_mask: bool token mask broadcastable to [B, Hq, Sq, Sk], AND-ed with the blocks (not with "thd").
    is_causal: key j visible from query i only if j <= i (top-left aligned, per sequence). kv_valid: int32 [nk] or
    [B, nk], valid tokens at the start of each key block (the rest is padding). A row that sees no key gives zeros
    and LSE -inf.
    Returns out in the input layout with Dv last (and lse float32 [B, Hq, Sq], or [T, Hq] for "thd", natural log,
    if return_lse). backend: "auto" (Triton on CUDA, PyTorch on CPU unless TRITON_INTERPRET=1), "triton" or
    "torch". Differentiable on every backend (gradients for q, k, v, and through lse); the Triton backend once
    only: a double backward (create_graph=True, then differentiating the gradients) raises.
    Under torch.autocast, q, k and v are cast to its dtype first, as scaled_dot_product_attention does (fp64
    excepted): fp32 inputs then run the bf16/fp16 kernels and out comes back in that dtype.
    quant="int8": a quantized forward for inference (SageAttention's scheme; no backward, so no input may require
    grad). The keys less their mean over the sequence (per batch and kv head) and the queries are rounded per token
    to int8 with scale max|x| / 127, and the scores are scale * q8 . k8 * (their scales), an int8 product on the
    GPU; softmax ignores the mean's share, which is added back to the LSE. P @ V stays in the inputs' dtype. Every
    backend computes this; the PyTorch backend as exact attention on the dequantized values. quant="int8-fp8"
    also rounds V per channel (scale max|v| / 448 over the sequence) and the kernels' P (times 448) to float8
    e4m3 for P @ V (the PyTorch backend rounds V, not P); quant="int8-int8" rounds them to int8 instead (scale
    max|v| / 127; P times 127 to integers), an int8 product on the GPU.
    """
    max_seqlens = _check_max_seqlens(max_seqlen_q, max_seqlen_kv, layout)
    q, k, v, autocast_off = _under_autocast(q, k, v)
    with autocast_off:
        p = _prepare(q, k, v, blocks, block_size, layout, cu_seqlens_q, cu_seqlens_kv, scale, attn_mask, is_causal,
                     kv_valid, quant, backend, max_seqlens)
        if quant is not None:
            out, lse = _quantized(p, is_causal, quant, need_lse=return_lse)
        elif p.backend == "torch":
            out, lse = _reference(p, is_causal, need_lse=return_lse)
        else:
            out, lse = _triton_attention(p, is_causal)
    out, lse = _to_layout(out, lse, layout)
    return (out, lse) if return_lse else out


def _from_layout(t: torch.Tensor, layout: str, is_lse: bool = False) -> torch.Tensor:
    """The inverse of _to_layout for one output (is_lse: the LSE, which "bshd" keeps as [B, H, S])."""
    if layout == "bshd" and not is_lse:
        return t.transpose(1, 2)
    if layout == "thd":
        return t.t().unsqueeze(0) if is_lse else t.permute(1, 0, 2).unsqueeze(0)
    return t


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor,
                       blocks: Union[torch.Tensor, BlockSparsity, None] = None, block_size=None, *,
                       layout: str = "bhsd", cu_seqlens_q=None, cu_seqlens_kv=None, scale: Optional[float] = None,
                       attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                       kv_valid: Optional[torch.Tensor] = None, backend: str = "auto",
                       max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None):
    """Gradients (dq, dk, dv) of attention() from its saved output and LSE, without autograd.

    grad_out and out: shaped like attention()'s output; lse: float32 from return_lse=True ([B, Hq, Sq], or [T, Hq]
    for "thd"). The other arguments must be those of the forward call (under torch.autocast, as there: q, k, v are
    cast alike). Returns tensors shaped like q, k, v, in their dtypes."""
    max_seqlens = _check_max_seqlens(max_seqlen_q, max_seqlen_kv, layout)
    dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in (q, k, v)]
    q, k, v, autocast_off = _under_autocast(q, k, v)
    with autocast_off:
        p = _prepare(q, k, v, blocks, block_size, layout, cu_seqlens_q, cu_seqlens_kv, scale, attn_mask, is_causal,
                     kv_valid, None, backend, max_seqlens)
        out_rank, lse_rank = (3, 2) if layout == "thd" else (4, 3)
        for name, t, rank in (("grad_out", grad_out, out_rank), ("out", out, out_rank), ("lse", lse, lse_rank)):
            if not isinstance(t, torch.Tensor) or t.ndim != rank:
                raise ValueError(f"{name} does not have the rank attention() returns for layout {layout!r}: got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        grad_out, out = _from_layout(grad_out, layout), _from_layout(out, layout)
        lse = _from_layout(lse, layout, True)
        expected = (*p.q.shape[:3], p.v.shape[-1])
        for name, t in (("grad_out", grad_out), ("out", out)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have the output's shape {list(expected)} (bhsd order), got "
                                 f"{tuple(t.shape)}")
        if tuple(lse.shape) != expected[:3] or lse.dtype != torch.float32:
            raise ValueError(f"lse must be float32 {list(expected[:3])} (bhsd order), got {lse.dtype} "
                             f"{tuple(lse.shape)}")
        if p.backend == "torch":
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_(True) for t in (p.q, p.k, p.v)]
                recomputed, _ = _reference(p, is_causal, *inputs, need_lse=False)
                grads = torch.autograd.grad(recomputed, inputs, grad_out.to(recomputed.dtype))
        else:
            ops = _kernel_ops()
            op = ops.sparse_attention_bwd if torch.compiler.is_compiling() else ops.backward_eager
            with _on_device(p.q.device):
                grads = op(grad_out.contiguous(), None, p.q, p.k, p.v, out, lse,
                           *_op_args(p, is_causal, need_q_lists=True))
    # under autocast the gradients come back in the inputs' own dtypes, as autograd would give them
    return tuple(_to_layout(g, None, layout)[0].to(dtype) for g, dtype in zip(grads, dtypes))


def _op_args(p: _Prepared, is_causal: bool, need_q_lists: bool, min_tile_kv: int = 16) -> tuple:
    """The kernel ops' arguments after q, k, v (forward) or after out, lse (backward): kv lists, q lists (None,
    None unless need_q_lists), token mask, gathered block mask, kv_valid, cu_seqlens_q / _kv, scale, list block
    sizes, mask block sizes, is_causal, max_seqlen_q / _kv (None, None and 0, 0 unless "thd"). min_tile_kv: see
    _kernel_inputs."""
    lists, gather_mask = _kernel_inputs(p.sparsity, is_causal, min_tile_kv, p.token_mask, p.kv_valid, p.varlen)
    q_count, q_index = lists.q_lists() if need_q_lists else (None, None)
    token_mask = p.token_mask
    # the kernels read the token mask's bytes (their test, != 0, reads bool or uint8 alike); Inductor cannot lower the
    # bool -> uint8 view (torch 2.11 on CUDA: "torch.bool is not supported by torch.iinfo"), so a compiled call
    # hands the bool tensor over as it is
    if token_mask is not None and not torch.compiler.is_compiling():
        token_mask = token_mask.view(torch.uint8)
    cu_seqlens, max_seqlens = ((p.varlen.cu_q, p.varlen.cu_kv), (p.varlen.max_q, p.varlen.max_kv)) if p.varlen else (
        (None, None), (0, 0))
    return (lists.kv_count, lists.kv_index, q_count, q_index, token_mask, gather_mask, p.kv_valid, *cu_seqlens,
            p.scale, *lists.block_size, *p.sparsity.block_size, is_causal, *max_seqlens)


def _kernel_inputs(sparsity: BlockSparsity, is_causal: bool, min_tile_kv: int = 16, token_mask=None,
                   kv_valid=None, varlen=None):
    """(lists, gathered mask): the lists the kernels walk and, for block shapes no tile nests in, the block mask to
    test per element (uint8, else None). min_tile_kv: the narrowest key tile the kernel takes (16, or 32 for the
    8-bit P @ V products). Where the launchers set FULL_TILES_FIRST (kernels.forward.full_tiles_first, asked here
    with the same arguments), the lists put the tiles needing no test first (BlockSparsity.full_first)."""
    if is_causal:
        sparsity = sparsity.causal()
    block_q, block_kv = sparsity.block_size
    gathered = not (block_q % 16 == 0 and block_kv % min_tile_kv == 0)
    if not gathered:
        # kv_valid's lists go over key tiles of at most KV_VALID_TILE_KV keys that still nest in the blocks, so that
        # those holding only padding drop out of the lists.
        tile_kv = block_kv
        while kv_valid is not None and tile_kv > KV_VALID_TILE_KV and tile_kv % (2 * min_tile_kv) == 0:
            tile_kv //= 2
        if _kernel_ops().full_tiles_first(False, tile_kv < block_kv, token_mask, kv_valid, varlen):
            return sparsity.full_first(block_q, tile_kv, is_causal, kv_valid), None
        return sparsity, None
    tile_q, tile_kv = (min(64, _tile_side(sparsity.seq_q)), max(min_tile_kv, min(64, _tile_side(sparsity.seq_kv))))
    mask = sparsity.mask.to(torch.uint8)
    if _kernel_ops().full_tiles_first(True, False, token_mask, kv_valid, varlen):
        return sparsity.full_first(tile_q, tile_kv, is_causal), mask
    return sparsity.tiled(tile_q, tile_kv), mask


# The key side of the lists' tiles where kv_valid marks padding (see _kernel_inputs): the forward's and the dK/dV
# kernel's usual key tiles are 64 wide.
KV_VALID_TILE_KV = 64


def _tile_side(seq: int) -> int:
    side = 16
    while side < 64 and side < seq:
        side *= 2
    return side


def _triton_attention(p: _Prepared, is_causal: bool):
    ops = _kernel_ops()
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (p.q, p.k, p.v))
    # The custom op when torch.compile traces; in eager mode the launchers directly (its dispatch costs host time).
    with _on_device(p.q.device):  # (_op_args may launch the lists' kernels: on the inputs' GPU too)
        rest = _op_args(p, is_causal, need_q_lists=needs_grad)
        if torch.compiler.is_compiling():
            return ops.sparse_attention_fwd(p.q, p.k, p.v, *rest)
        if needs_grad:
            return ops.EagerAttention.apply(p.q, p.k, p.v, rest)
        return ops.forward_eager(p.q, p.k, p.v, *rest)


def _quantized(p: _Prepared, is_causal: bool, quant: str, need_lse: bool):
    """The quantized forward (quant="int8", "int8-fp8" or "int8-int8") on either backend: the PyTorch one runs the
    exact attention of the dequantized q and smoothed k that the kernels multiply in int8 (reference.quantized_qk),
    and for "int8-fp8" / "int8-int8" of V rounded per channel to float8 / int8 (P stays exact there: the kernels
    round it tile by tile against a running maximum, which no whole-row computation reproduces)."""
    if p.backend == "torch":
        q_hat, k_hat, shift = reference.quantized_qk(p.q, p.k, p.scale)
        v_hat = p.v if quant == "int8" else reference.quantized_v(p.v, quant.split("-")[1])
        out, lse = _reference(p, is_causal, q_hat, k_hat, v_hat, need_lse=need_lse)
        return out.to(p.q.dtype), (lse + shift if need_lse else None)
    ops = _kernel_ops()
    op = ops.quantized_attention_fwd if torch.compiler.is_compiling() else ops.forward_quantized
    # P @ V in 8 bits reduces over at least 32 keys a tile: key blocks that no such tile nests in run as the block
    # shapes no tile nests in do, on a tile view with the block mask tested per element
    min_tile_kv = ops.PV_MIN_TILE_KV if quant in ops.PV_FORMATS else 16
    with _on_device(p.q.device):
        return op(p.q, p.k, p.v, *_op_args(p, is_causal, need_q_lists=False, min_tile_kv=min_tile_kv), quant)


def _on_device(device: torch.device):
    """Makes the inputs' GPU the current one while the kernels launch: Triton launches on the current device, and a
    model spread over several GPUs calls with tensors on another. (The autograd engine runs a backward on its
    tensors' device already, and compiled graphs set their own.)"""
    if device.type != "cuda" or torch.compiler.is_compiling() or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
