"""Sequence-parallel block-sparse attention over torch.distributed (all-to-all over heads, "Ulysses").

Each of P ranks holds a contiguous shard of the sequence, split as torch.chunk splits it (shard_sizes), with every
head. One all-to-all turns that into the whole sequence for H/P heads, blockattn.attention runs there with those
heads' slice of the block mask (and token mask), and a second all-to-all returns the output to sequence shards.
The result is exactly attention() on the whole sequence; the collectives are differentiable
(torch.distributed.nn.functional.all_to_all), so the backward runs the reverse all-to-alls.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from .api import attention
from .sparsity import BlockSparsity


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("sequence_parallel_attention needs torch.distributed initialized (init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def shard_sizes(seq: int, world: int) -> list[int]:
    """Tokens per rank when a sequence of `seq` tokens is split over `world` ranks as torch.chunk splits it: ranks
    in order hold ceil(seq / world) tokens each, the last ones what is left (possibly none)."""
    size = -(-seq // world)
    return [max(0, min(size, seq - rank * size)) for rank in range(world)]


def _all_to_all(chunks: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send chunks[j] (all one shape) to rank j; returns what each rank sent here, in rank order
    (differentiable)."""
    from torch.distributed.nn.functional import all_to_all
    chunks = [c.contiguous() for c in chunks]
    return list(all_to_all([torch.empty_like(c) for c in chunks], chunks, group=group))


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, H, n, D] with zero rows appended along the sequence up to `length`: Gloo exchanges only equal shapes,
    so unequal shards travel padded to the longest and are cut back on arrival (equal ones go as they are)."""
    return x if x.shape[2] == length else torch.nn.functional.pad(x, (0, 0, 0, length - x.shape[2]))


def _sequence_to_heads(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """[B, H, S_r, D] (this rank's tokens, all heads) -> [B, H/P, S, D] (all tokens, this rank's heads); sizes: the
    tokens each rank holds."""
    pieces = _all_to_all(list(_padded(x, max(sizes)).chunk(len(sizes), dim=1)), group)
    return torch.cat([piece[:, :, :n] for piece, n in zip(pieces, sizes)], dim=2)


def _heads_to_sequence(x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """[B, H/P, S, D] -> [B, H, S_rank, D]: the inverse of _sequence_to_heads."""
    pieces = _all_to_all([_padded(piece, max(sizes)) for piece in x.split(sizes, dim=2)], group)
    return torch.cat([piece[:, :, :sizes[rank]] for piece in pieces], dim=1)


def _sizes(name: str, whole: Optional[int], local: int, world: int, rank: int) -> list[int]:
    """Every rank's token count for a sequence of `whole` tokens (default: world * local), checked against this
    rank's `local`."""
    if whole is None:
        return [local] * world
    if isinstance(whole, bool) or not isinstance(whole, int) or whole < 1:
        raise ValueError(f"{name} must be a positive int (the whole sequence's length), got {whole!r}")
    sizes = shard_sizes(whole, world)
    if sizes[rank] != local:
        raise ValueError(f"{name}={whole} split over {world} ranks gives rank {rank} {sizes[rank]} tokens (as "
                         f"torch.chunk splits it), but its shard has {local}")
    return sizes


def _rank_heads(name: str, mask: Optional[torch.Tensor], heads: int, world: int, rank: int):
    """This rank's heads of a [.., H|1, X, Y] mask (heads third from last; a head-shared or 2-D mask stays whole)."""
    if mask is None or mask.ndim < 3:
        return mask
    axis = mask.ndim - 3
    if mask.shape[axis] == 1:
        return mask
    if mask.ndim > 4 or mask.shape[axis] != heads:
        raise ValueError(f"{name} must have 1 or {heads} (the query heads) heads, third from last in [B, H, X, Y], "
                         f"got shape {tuple(mask.shape)}")
    per_rank = heads // world
    return mask.narrow(axis, rank * per_rank, per_rank)


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                blocks: Union[torch.Tensor, BlockSparsity, None] = None, block_size=None, *,
                                group=None, layout: str = "bhsd", attn_mask: Optional[torch.Tensor] = None,
                                seq_q: Optional[int] = None, seq_kv: Optional[int] = None, return_lse: bool = False,
                                **kwargs):
    """blockattn.attention over a sequence split across the ranks of `group` (default: the world).

    q: [B, Hq, Sq_r, D], k: [B, Hkv, Sk_r, D], v: [B, Hkv, Sk_r, Dv] ("bhsd"; [B, S_r, H, D] for "bshd"): this
    rank's contiguous shard. seq_q / seq_kv: the whole lengths, split as torch.chunk splits them (shard_sizes);
    default: every rank holds as many tokens as this one (S = P * S_r). Hq a multiple of P (when Hkv is not, the
    key/value heads are repeated to Hq before the exchange, at Hq / Hkv times their traffic). blocks (a block mask or a
    BlockSparsity), attn_mask and kv_valid describe the whole sequences (Sq, Sk), as attention() takes them; each
    rank uses its heads' slice. Other keyword arguments (is_causal, scale, kv_valid, backend, quant) go to attention().
    Returns this rank's shard of out (and of lse [B, Hq, Sq_r] if return_lse), exactly attention() on the whole
    sequence. Differentiable. The collectives are eager: compile attention() itself, not this function."""
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f'layout must be "bhsd" or "bshd" (a packed "thd" batch cannot be split by rank), got '
                         f"{layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor ({layout!r}), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    world, rank = _world(group)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v)) if layout == "bshd" else (q, k, v)
    heads, kv_heads = qh.shape[1], kh.shape[1]
    sizes_q, sizes_kv = (_sizes(name, whole, local.shape[2], world, rank)
                         for name, whole, local in (("seq_q", seq_q, qh), ("seq_kv", seq_kv, kh)))
    if heads % world:
        raise ValueError(f"the query heads ({heads}) must be a multiple of the ranks ({world}): each rank attends "
                         "with a share of them")
    if kv_heads and heads % kv_heads == 0 and kv_heads % world:
        # fewer key/value heads than a whole share per rank: each query head gets its own copy (MHA) to send
        kh, vh = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kh, vh))
    if isinstance(blocks, BlockSparsity):
        if block_size is not None and tuple(block_size) != blocks.block_size:
            raise ValueError(f"block_size {tuple(block_size)} disagrees with the BlockSparsity's {blocks.block_size}")
        blocks, block_size = blocks.mask, blocks.block_size
    local_blocks = _rank_heads("blocks", blocks, heads, world, rank) if isinstance(blocks, torch.Tensor) else blocks
    local_mask = _rank_heads("attn_mask", attn_mask, heads, world, rank)

    q_all, k_all, v_all = (_sequence_to_heads(t, sizes, group) for t, sizes in ((qh, sizes_q), (kh, sizes_kv),
                                                                                (vh, sizes_kv)))
    result = attention(q_all, k_all, v_all, local_blocks, block_size, attn_mask=local_mask, return_lse=return_lse,
                       **kwargs)
    out, lse = result if return_lse else (result, None)
    out = _heads_to_sequence(out, sizes_q, rank, group)
    if layout == "bshd":
        out = out.transpose(1, 2)
    if not return_lse:
        return out
    return out, _heads_to_sequence(lse[..., None], sizes_q, rank, group)[..., 0]
