"""torch_npu's npu_block_sparse_attention and its backward, on blockattn.

Layouts "BNSD" [B, N, S, D], "BSND" [B, S, N, D] and "TND" [T, N, D] (packed; actual_seq_lengths give each
sequence's length, not offsets). With BNSD / BSND, actual_seq_lengths (_kv), if given, hold one length per batch
entry, at most S: the queries (keys) past it are padding, and a padding row gives zeros and LSE -inf.
block_sparse_mask [B, N, ceil(S / block_shape[0]), ceil(S_kv / block_shape[1])]
(nonzero = keep; for TND at the longest lengths, each sequence's blocks starting at its first token). softmax_lse
is float32, natural log, [B, N, S, 1] (BNSD, BSND) or [T, N, 1] (TND). Differences from the NPU operator: head
dims up to 256 (not 128), and inner_precise has no effect (accumulation is always fp32).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..api import attention, attention_backward

_LAYOUTS = {"BNSD": "bhsd", "BSND": "bshd", "TND": "thd"}
Lengths = Union[Sequence[int], torch.Tensor, None]


def _layout(q_input_layout: str, kv_input_layout: str) -> str:
    if q_input_layout not in _LAYOUTS:
        raise ValueError(f"q_input_layout must be one of {list(_LAYOUTS)}, got {q_input_layout!r}")
    if kv_input_layout != q_input_layout:
        raise ValueError(f"kv_input_layout must equal q_input_layout ({q_input_layout!r}), got {kv_input_layout!r}")
    return _LAYOUTS[q_input_layout]


def _host_lengths(name: str, lengths: Lengths) -> torch.Tensor:
    """int64 lengths on the CPU (a list stays on the host; a device tensor is read back once), checked >= 0."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64).flatten().cpu()
    if (lengths < 0).any():
        raise ValueError(f"{name} must be non-negative lengths, got {lengths.tolist()}")
    return lengths


def _offsets(name: str, lengths: Optional[torch.Tensor], layout: str, device) -> Optional[torch.Tensor]:
    """int32 offsets [N + 1] on device from host lengths (_host_lengths), or None without lengths."""
    if lengths is None:
        if layout == "thd":
            raise RuntimeError(f"{name} must be specified when q_input_layout is TND")
        return None
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device=device, dtype=torch.int32)


def _check(query, key, value, num_key_value_heads, layout):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got query {query.dtype}, key {key.dtype}, "
                        f"value {value.dtype}")
    head_axis = {"bhsd": 1, "bshd": 2, "thd": 1}[layout]
    if key.ndim > head_axis and key.shape[head_axis] != num_key_value_heads:
        raise ValueError(f"num_key_value_heads is {num_key_value_heads} but key has {key.shape[head_axis]} heads")


def _block_shape(block_shape) -> tuple:
    """(block_q, block_kv) from block_shape: two positive whole numbers (a fraction is refused, not cut off)."""
    try:
        sides = tuple(int(side) for side in block_shape)
        whole = all(side == float(given) for side, given in zip(sides, block_shape))
    except (TypeError, ValueError):
        sides, whole = (), False
    if len(sides) != 2 or not whole or min(sides) < 1:
        raise ValueError(f"block_shape must be two positive integers [block_q, block_kv], got {block_shape!r}")
    return sides


def _check_padded_lengths(name: str, lengths: Optional[torch.Tensor], batch: int, seq: int) -> None:
    """BNSD / BSND: one actual length per batch entry, none past the tensor's sequence length."""
    if lengths is None:
        return
    if lengths.numel() != batch:
        raise ValueError(f"{name} must give one length per batch entry ({batch}), got {lengths.numel()}: "
                         f"{lengths.tolist()}")
    if int(lengths.max()) > seq:
        raise ValueError(f"{name} must not exceed the sequence length {seq}, got {lengths.tolist()}")


def _padded_token_mask(offsets_q, offsets_kv, seq_q, seq_kv, device):
    """BNSD/BSND with actual lengths: query i and key j of batch b count only below that batch's lengths."""
    lengths_q = (offsets_q[1:] - offsets_q[:-1]).long()
    lengths_kv = (offsets_kv[1:] - offsets_kv[:-1]).long()
    rows = torch.arange(seq_q, device=device)[None, :] < lengths_q[:, None]
    cols = torch.arange(seq_kv, device=device)[None, :] < lengths_kv[:, None]
    return (rows[:, :, None] & cols[:, None, :])[:, None]  # [B, 1, Sq, Sk]


def _common(query, key, value, block_sparse_mask, block_shape, q_input_layout, kv_input_layout, num_key_value_heads,
            scale_value, actual_seq_lengths, actual_seq_lengths_kv):
    layout = _layout(q_input_layout, kv_input_layout)
    _check(query, key, value, num_key_value_heads, layout)
    # each read to the host once (a device tensor of lengths costs a synchronization)
    host_q, host_kv = (None if lengths is None else _host_lengths(name, lengths)
                       for name, lengths in (("actual_seq_lengths", actual_seq_lengths),
                                             ("actual_seq_lengths_kv", actual_seq_lengths_kv)))
    cu_q = _offsets("actual_seq_lengths", host_q, layout, query.device)
    cu_kv = _offsets("actual_seq_lengths_kv", host_kv, layout, query.device)
    kwargs = dict(layout=layout, scale=None if not scale_value else float(scale_value))
    if layout == "thd":
        if host_q.numel() != host_kv.numel():
            raise ValueError(f"actual_seq_lengths and actual_seq_lengths_kv must describe the same number of "
                             f"sequences, got {host_q.numel()} and {host_kv.numel()}")
        kwargs.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
        # the lengths are on the host already: check their totals here and hand the longest ones over, so that
        # attention() need not read the offsets back from the device
        longest = []
        for name, host, tensor in (("actual_seq_lengths", host_q, query), ("actual_seq_lengths_kv", host_kv, key)):
            if int(host.sum()) != tensor.shape[0]:
                raise ValueError(f"{name} must sum to the packed token count {tensor.shape[0]}, got "
                                 f"{int(host.sum())}")
            longest.append(max(1, int(host.max())) if host.numel() else 1)
        kwargs.update(max_seqlen_q=longest[0], max_seqlen_kv=longest[1])
    elif cu_q is not None or cu_kv is not None:
        seq_axis = 2 if layout == "bhsd" else 1
        seq_q, seq_kv = query.shape[seq_axis], key.shape[seq_axis]
        batch = query.shape[0]
        _check_padded_lengths("actual_seq_lengths", host_q, batch, seq_q)
        _check_padded_lengths("actual_seq_lengths_kv", host_kv, batch, seq_kv)
        full_q = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * seq_q
        full_kv = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * seq_kv
        kwargs["attn_mask"] = _padded_token_mask(cu_q if cu_q is not None else full_q,
                                                 cu_kv if cu_kv is not None else full_kv, seq_q, seq_kv, query.device)
    return kwargs, _block_shape(block_shape)


def npu_block_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               block_sparse_mask: torch.Tensor, block_shape, *, q_input_layout: str = "TND",
                               kv_input_layout: str = "TND", num_key_value_heads: int = 1, scale_value: float = 0.0,
                               inner_precise: int = 1, actual_seq_lengths: Lengths = None,
                               actual_seq_lengths_kv: Lengths = None, softmax_lse_flag: int = 0):
    """(attention_out, softmax_lse): attention_out in the query's layout; softmax_lse float32 natural-log LSE
    [B, N, S, 1] or [T, N, 1] (computed whatever softmax_lse_flag says). scale_value 0 means D ** -0.5.
    Differentiable through autograd."""
    kwargs, block = _common(query, key, value, block_sparse_mask, block_shape, q_input_layout, kv_input_layout,
                            num_key_value_heads, scale_value, actual_seq_lengths, actual_seq_lengths_kv)
    out, lse = attention(query, key, value, block_sparse_mask, block, return_lse=True, **kwargs)
    return out, lse.unsqueeze(-1)


def npu_block_sparse_attention_backward(d_out, query, key, value, attention_out, softmax_lse, block_sparse_mask,
                                        block_shape, actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                        q_input_layout: str = "TND", kv_input_layout: str = "TND",
                                        num_key_value_heads: int = 1, scale_value: float = 0.0):
    """(dq, dk, dv) from the forward's attention_out and softmax_lse (shapes as the forward returns them)."""
    kwargs, block = _common(query, key, value, block_sparse_mask, block_shape, q_input_layout, kv_input_layout,
                            num_key_value_heads, scale_value, actual_seq_lengths, actual_seq_lengths_kv)
    return attention_backward(d_out, query, key, value, attention_out, softmax_lse.squeeze(-1), block_sparse_mask,
                              block, **kwargs)
