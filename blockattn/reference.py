"""The PyTorch backend: block-gathered sparse attention, differentiable through autograd.

For each chunk of query blocks (of like list lengths) it gathers only the kept key blocks (from the kv lists), so
memory grows with the kept blocks, never with Sq x Sk. It computes in float32 (float64 for float64 inputs) and
follows the semantics of DESIGN.md exactly: a row with no visible key gives zeros and LSE -inf.
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch

from .sparsity import BlockSparsity

# Bytes of the largest tensor one chunk of query blocks builds (its gathered keys or values, or its per-element
# mask or scores): chunks keep the peak memory bounded, and larger ones take fewer launches on a GPU (and, under
# autograd, which holds every chunk's tensors, fewer backward gathers that zero and sum into whole tables).
_CHUNK_BYTES = 256 * 2**20
# The same on the CPU without autograd, where every chunk gathers into the same memory: a small chunk is the
# memory a call touches afresh, and each page's first touch costs more than the copy into it (with the reused
# memory, the forward ran 1.26-1.47x as fast as with fresh 256 MiB chunks on uneven, even and causal masks;
# benchmarks/torch_backend.py, BENCHMARKS.md).
_CPU_CHUNK_BYTES = 8 * 2**20
# A chunk's query blocks keep lists whose lengths differ by at most this factor (plus one block): each block is
# padded to its chunk's longest list, so a skewed mask (a few query blocks that keep everything) no longer makes
# every block attend as many keys as the longest.
_LENGTH_SPREAD = 1.25


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: BlockSparsity, scale: float,
                           token_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                           kv_valid: Optional[torch.Tensor] = None,
                           need_lse: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] -> (out [B, Hq, Sq, Dv] in q's dtype,
    lse float32 [B, Hq, Sq], or None unless need_lse). token_mask: bool, broadcastable to [B, Hq, Sq, Sk];
    kv_valid: int [B|1, nk].

    A row is one query block of one head, or, when every head shares the lists (a block mask without a head dim)
    and Hq > Hkv, the query blocks of one kv head's group of query heads stacked (they attend to the same keys,
    gathered once, and PyTorch's CPU kernel runs longer query sides faster). The rows are taken in order of their
    kv lists' lengths, in chunks of like lengths (_chunks); each chunk's rows attend, through PyTorch's fused
    attention, to their gathered key blocks, padded to the chunk's longest list; the mask is per key ([.., 1, L])
    unless causality or a token mask make it per element. Rows that keep every key block (global tokens) skip the
    gather: each (batch, row head)'s attend to its kv head's keys as they lie, in one call. The (batch, row head)s
    whose rows all keep every key block (a dense call), or under is_causal alone all that causality leaves them,
    attend as whole heads, all in one call (causal: skipping the upper triangle), unless a token mask applies. Rows
    that see no key are given one harmless key and zeroed afterwards, so neither the output nor the gradients see
    a NaN."""
    if is_causal:  # no gather of the blocks wholly above the diagonal, which the causal test would hide anyway
        blocks = blocks.causal()
    batch, heads, seq_q, _ = q.shape
    kv_heads, seq_kv = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q, block_kv = blocks.block_size
    nq, nk = blocks.num_blocks
    compute = torch.promote_types(q.dtype, torch.float32)
    device = q.device
    dim, dim_v = q.shape[-1], v.shape[-1]
    # query heads a row stacks, and the rows' heads: kv heads when stacked, else query heads
    stack = group if blocks.kv_count.shape[1] == 1 else 1
    row_heads = heads // stack
    # a (batch, row head) number's (batch, kv head) number is it // per_kv (row heads are kv heads' consecutive runs)
    per_kv = group // stack
    rows = batch * row_heads * nq
    stacked_q = stack * block_q

    count = blocks.kv_count.expand(batch, row_heads, nq).reshape(rows)
    width_cap = blocks.kv_index.shape[-1]
    index = blocks.kv_index.expand(batch, row_heads, nq, width_cap).reshape(rows, width_cap)
    # the LSE from the fused kernel when it is PyTorch's CPU one (which takes D = Dv only) and no gradient can reach
    # the LSE; else from the scores, which autograd differentiates
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    fused_lse = need_lse and device.type == "cpu" and _CPU_ATTENTION is not None and dim == dim_v and not differentiable
    # heads taken whole, all in one call (below), where no per-element mask but causality's applies and the LSE, if
    # asked, needs no scores: a (batch, row head) whose every row keeps every key block, or under is_causal (with no
    # kv_valid) the key blocks its causal part reaches (more are masked anyway)
    whole_heads = torch.zeros(batch * row_heads, dtype=torch.bool, device=device)
    if nk and token_mask is None and (fused_lse or not need_lse):
        if not is_causal:
            whole_heads = (count == nk).view(-1, nq).all(1)
        elif kv_valid is None:
            whole_heads = _keeps_causal_reach(count, index, nq, nk, block_q, block_kv, seq_q).view(-1, nq).all(1)
    # the other rows by their lists' lengths (a host read: this is the CPU path)
    order = torch.nonzero(~whole_heads.repeat_interleave(nq)).squeeze(1)
    order = order[torch.argsort(count[order], stable=True)]
    sorted_count = count[order]
    lengths = sorted_count.tolist()
    # every row here and its list as long: the stable sort kept the rows' order
    in_place = len(lengths) == rows and (not lengths or lengths[0] == lengths[-1])

    pad_q, pad_kv = nq * block_q - seq_q, nk * block_kv - seq_kv
    # one row per (batch, row head, block), as tables for _gathered; stacked: the group's heads within each row
    q_blocks = _stacked(_padded(q, pad_q), stack, block_q).reshape(rows, stacked_q * dim)
    k_blocks = _padded(k, pad_kv).reshape(batch * kv_heads * nk, block_kv * dim)
    v_blocks = _padded(v, pad_kv).reshape(batch * kv_heads * nk, block_kv * dim_v)
    row_batch, row_head, row_block = order // (row_heads * nq), order // nq % row_heads, order % nq  # per sorted row
    # each stacked query's head within its row's group, and its offset in its block
    offsets_q = torch.arange(stacked_q, device=device) % block_q
    head_in_row = torch.arange(stacked_q, device=device) // block_q
    offsets_kv = torch.arange(block_kv, device=device)
    if token_mask is not None:
        token_mask = token_mask.expand(batch, heads, seq_q, seq_kv)
    if kv_valid is not None:
        kv_valid = kv_valid.expand(batch, nk).long()
    elements = is_causal or token_mask is not None  # a per-element mask
    element_bytes = torch.finfo(compute).bits // 8
    # per key block of a row: its gathered keys or values, or its slice of a per-element mask or of the scores
    score_rows = stacked_q if elements or (need_lse and not fused_lse) else 1
    slot_bytes = element_bytes * block_kv * max(dim, dim_v, score_rows)

    budget = _CPU_CHUNK_BYTES if device.type == "cpu" and not differentiable else _CHUNK_BYTES

    def attend(queries, keys, values, visible, causal=False):
        """(out [n, sq, Dv], lse [n, sq] or None unless need_lse) of queries [n, sq, D] attending to keys
        [n, L, D] and values [n, L, Dv] where visible [n, sq | 1, L] (None: everywhere). A row that sees nothing
        attends to its first key instead and is zeroed (LSE -inf). causal (with visible None): key j for query i
        only if j <= i, where an LSE, if asked, comes from the fused kernel (the scores' LSE here takes no mask)."""
        seen = None
        if visible is not None:
            seen = visible.any(-1, keepdim=True)                                          # [n, sq | 1, 1]
            first = torch.zeros_like(visible)
            first[..., 0] = True
            visible = visible | (first & ~seen)
        if fused_lse:
            bias = (None if visible is None else torch.zeros(visible.shape, dtype=compute, device=device)
                    .masked_fill_(~visible, float("-inf"))[:, None])
            out, lse = _CPU_ATTENTION(queries[:, None], keys[:, None], values[:, None], attn_mask=bias,
                                      is_causal=causal, scale=scale)
            out, lse = out[:, 0], lse[:, 0, :, None]
        else:
            queries, keys, values = (_aligned(x) for x in (queries, keys, values))
            out = torch.nn.functional.scaled_dot_product_attention(
                queries[:, None], keys[:, None], values[:, None],
                attn_mask=None if visible is None else visible[:, None], is_causal=causal, scale=scale)[:, 0]
            if need_lse:
                scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale            # [n, sq, L]
                if visible is not None:
                    scores = scores.masked_fill(~visible, float("-inf"))
                lse = torch.logsumexp(scores, -1, keepdim=True)
        if seen is not None:
            out = out * seen
        if not need_lse:
            return out, None
        return out, (lse if seen is None else torch.where(seen, lse, float("-inf"))).squeeze(-1)

    # rows that keep every key block (sorted last) attend to their kv head's keys where they lie, each (batch, row
    # head)'s in one call, with no gather (below); the others in chunks of gathered keys
    gathered = bisect.bisect_left(lengths, nk) if nk else len(lengths)
    # (an empty batch: one empty chunk, so that out and lse still hang off q, k and v for autograd)
    chunks = _chunks(lengths[:gathered], slot_bytes, budget) if rows else [(0, 0, 1)]
    whole_head_rows = torch.nonzero(whole_heads).squeeze(1)
    if gathered < len(lengths) or len(whole_head_rows):
        # each kv head's keys and values [Sk, D], and each (batch, row head)'s query blocks [nq, sq * D], for the
        # calls on whole rows and heads: through unbind, whose backward sums them at once (a slice's or a gather's
        # would zero the whole tensor once for each)
        k_heads, v_heads = k.flatten(0, 1).unbind(0), v.flatten(0, 1).unbind(0)
        query_heads = q_blocks.view(batch * row_heads, nq, stacked_q * dim).unbind(0)
        # each key's position in its head [Sk], and each batch's real keys [B, Sk] under kv_valid
        head_key_pos = torch.arange(seq_kv, device=device)
        real_keys = None if kv_valid is None else head_key_pos % block_kv < kv_valid[:, head_key_pos // block_kv]
    # without autograd each chunk gathers into the memory the one before used (_gathered)
    reused = None if differentiable else {}
    outs, lses = [], []
    for start, stop, width in chunks:
        n = stop - start
        if width == 0:  # rows that keep no key block: zeros, LSE -inf
            outs.append(torch.zeros(n, stacked_q, dim_v, dtype=compute, device=device))
            lses.append(torch.full((n, stacked_q), float("-inf"), dtype=compute, device=device))
            continue
        here = order[start:stop]  # the chunk's rows, as (batch, row head, query block) numbers
        b = row_batch[start:stop, None]
        listed = torch.arange(width, device=device) < sorted_count[start:stop, None]      # [n, w]
        # (slots past a list's count hold any block; block 0 stands in, masked off)
        idx = torch.where(listed, index[here, :width], 0).long()                          # [n, w]
        kv_rows = (here[:, None] // nq // per_kv) * nk + idx                              # [n, w]
        keys = _gathered(k_blocks, kv_rows, (block_kv, dim), reused, "k").flatten(1, 2).to(compute)  # [n, L=w*bkv, D]
        values = _gathered(v_blocks, kv_rows, (block_kv, dim_v), reused, "v").flatten(1, 2).to(compute)  # [n, L, Dv]
        queries = (q_blocks[start:stop].view(n, stacked_q, dim) if in_place
                   else _gathered(q_blocks, here, (stacked_q, dim), reused, "q")).to(compute)  # [n, sq = g*bq, D]

        key_pos = idx[..., None] * block_kv + offsets_kv                                  # [n, w, bkv]
        visible = listed[..., None] & (key_pos < seq_kv)
        if kv_valid is not None:
            visible = visible & (offsets_kv < kv_valid[b, idx][..., None])
        visible = visible.flatten(1, 2)[:, None, :]                                       # [n, 1, L]
        key_pos = key_pos.flatten(1, 2)
        query_pos = row_block[start:stop, None] * block_q + offsets_q                     # [n, sq]
        if is_causal:
            visible = visible & (key_pos[:, None, :] <= query_pos[:, :, None])
        if token_mask is not None:
            token_heads = (row_head[start:stop, None] * stack + head_in_row)[:, :, None]  # [n, sq, 1]
            q_rows = query_pos.clamp(max=seq_q - 1)[:, :, None]
            k_cols = key_pos.clamp(max=seq_kv - 1)[:, None, :]
            visible = visible & token_mask[b[..., None], token_heads, q_rows, k_cols]
        out, lse = attend(queries, keys, values, visible)
        outs.append(out)
        lses.append(lse)

    if gathered < len(lengths):
        # each (batch, row head)'s rows that keep everything, consecutive in the sorted order
        head_rows, sizes = torch.unique_consecutive(order[gathered:] // nq, return_counts=True)
        # rows a call: all of a head's, unless a per-element mask or the scores would outgrow the budget
        most = rows if score_rows == 1 else max(1, budget // (stacked_q * seq_kv * element_bytes))
        start = gathered
        for head_row, size in zip(head_rows.tolist(), sizes.tolist()):
            b, row_h = divmod(head_row, row_heads)
            keys = k_heads[head_row // per_kv].to(compute)[None]                          # [1, Sk, D]
            values = v_heads[head_row // per_kv].to(compute)[None]                        # [1, Sk, Dv]
            visible = None if real_keys is None else real_keys[b][None, None]            # [1, 1, Sk]
            step = min(size, most)
            for first, last in ((i, min(i + step, start + size)) for i in range(start, start + size, step)):
                blocks_here = row_block[first:last]                                       # [m] query blocks
                queries = (query_heads[head_row][None] if last - first == nq else
                           _gathered(query_heads[head_row], blocks_here, (stacked_q * dim,), reused, "q")[None])
                queries = queries.view(1, -1, dim).to(compute)                            # [1, m * sq, D]
                query_pos = (blocks_here[:, None] * block_q + offsets_q).flatten()        # [m * sq]
                here = visible
                if is_causal:
                    causal = head_key_pos[None, None, :] <= query_pos[None, :, None]
                    here = causal if here is None else here & causal
                if token_mask is not None:
                    token_heads = (row_h * stack + head_in_row).repeat(last - first)
                    tokens = token_mask[b, token_heads, query_pos.clamp(max=seq_q - 1)][None]  # [1, m * sq, Sk]
                    here = tokens if here is None else here & tokens
                out, lse = attend(queries, keys, values, here)
                outs.append(out.view(last - first, stacked_q, dim_v))
                lses.append(None if lse is None else lse.view(last - first, stacked_q))
            start += size

    if len(whole_head_rows):
        # every such head in one call: PyTorch's CPU kernels split their work by head (its backward by head alone),
        # and a causal call balances the triangle's rows better over more heads. Each head's query blocks as one
        # sequence [h, nq * sq, D] beside its kv head's keys and values [h, Sk, D]; causal, each query head apart
        # (its whole padded sequence in order) beside a copy of its kv head's
        head_rows = whole_head_rows.tolist()
        queries = torch.stack([query_heads[head_row] for head_row in head_rows]).view(len(head_rows), -1, dim)
        keys, values = (torch.stack([per_head[head_row // per_kv] for head_row in head_rows])
                        for per_head in (k_heads, v_heads))
        visible = None if real_keys is None else real_keys[whole_head_rows // row_heads][:, None]  # [h, 1, Sk]
        if is_causal:
            queries = queries.view(-1, nq, stack, block_q, dim).transpose(1, 2).reshape(-1, nq * block_q, dim)
            keys, values = keys.repeat_interleave(stack, 0), values.repeat_interleave(stack, 0)
        out, lse = attend(queries.to(compute), keys.to(compute), values.to(compute), visible, causal=is_causal)
        if is_causal:  # the query heads back into their rows
            out = out.view(-1, stack, nq, block_q, dim_v).transpose(1, 2)
            lse = None if lse is None else lse.view(-1, stack, nq, block_q).transpose(1, 2)
        outs.append(out.reshape(-1, stacked_q, dim_v))                                    # [h * nq, sq, Dv]
        lses.append(None if lse is None else lse.reshape(-1, stacked_q))
    order = torch.cat([order, (whole_head_rows[:, None] * nq + torch.arange(nq, device=device)).flatten()])

    # back to (batch, head, query block) order: the sort's inverse permutation (none where the rows stayed in place,
    # or all came in whole heads, in order), then the stacked heads apart
    inverse = (None if in_place or not lengths else
               torch.empty_like(order).scatter_(0, order, torch.arange(rows, device=device)))

    def unsorted(parts, columns):
        whole = torch.cat(parts)
        whole = whole if inverse is None else whole[inverse]
        return _unstacked(whole.view(batch, row_heads, nq, stacked_q, *columns), stack, block_q)[:, :, :seq_q]
    out = unsorted(outs, (dim_v,)).to(q.dtype)
    if not need_lse:
        return out, None
    return out, unsorted(lses, ()).to(torch.float32)


# PyTorch's fused attention on the CPU, which also returns each row's LSE (not differentiable); a private operator,
# so looked up rather than assumed
_CPU_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _keeps_causal_reach(count: torch.Tensor, index: torch.Tensor, nq: int, nk: int, block_q: int, block_kv: int,
                        seq_q: int) -> torch.Tensor:
    """bool [rows]: whether each row's list (count [rows], index [rows, L]; the row's query block is row % nq)
    holds every key block that holds a key at or before one of its queries: blocks 0 .. reach - 1, which an
    ascending list holds when its count reaches `reach` and its entry reach - 1 is block reach - 1."""
    last_query = torch.clamp((torch.arange(count.shape[0], device=count.device) % nq + 1) * block_q, max=seq_q) - 1
    reach = torch.clamp(last_query // block_kv + 1, max=nk)                                # 1 .. nk
    entry = index.gather(1, (reach - 1)[:, None].long())[:, 0]
    return (count >= reach) & (entry == reach - 1)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x, or on a GPU its copy where x starts off a 16-byte boundary. A whole head of k or v is a view into the
    caller's memory (a slice of wider rows may start anywhere), and PyTorch's memory-efficient CUDA kernel, which
    takes fp32 with a mask, checks the strides' alignment but not the start's: it faults (misaligned address)."""
    return x.clone() if x.device.type != "cpu" and x.data_ptr() % 16 else x


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [.., S, D] with `rows` zero rows after its last (x itself when none: pad would copy it)."""
    return torch.nn.functional.pad(x, (0, 0, 0, rows)) if rows else x


def _stacked(x: torch.Tensor, stack: int, block_q: int) -> torch.Tensor:
    """x [B, H, nq * bq, D] as [B, H / stack, nq, stack * bq, D]: each block row holds the `stack` consecutive heads'
    query blocks (a view when stack is 1, else a copy)."""
    batch, heads, seq, dim = x.shape
    x = x.view(batch, heads // stack, stack, seq // block_q, block_q, dim)
    return x.transpose(2, 3).reshape(batch, heads // stack, seq // block_q, stack * block_q, dim)


def _unstacked(x: torch.Tensor, stack: int, block_q: int) -> torch.Tensor:
    """_stacked's inverse on rows x [B, H / stack, nq, stack * bq, *C] -> [B, H, nq * bq, *C]."""
    batch, row_heads, nq = x.shape[:3]
    columns = x.shape[4:]
    x = x.view(batch, row_heads, nq, stack, block_q, *columns).transpose(2, 3)
    return x.reshape(batch, row_heads * stack, nq * block_q, *columns)


def _gathered(table: torch.Tensor, index: torch.Tensor, row_shape: tuple, reused: Optional[dict] = None,
              name: str = "") -> torch.Tensor:
    """table[index] with each row viewed as row_shape: table [N, R], index int64 [...] -> [..., *row_shape].
    reused (no autograd): buffers by name; the rows go into reused[name], grown as needed, which the next call of
    that name overwrites (fresh memory costs page faults on the CPU, more than the copy). Else through embedding
    rather than advanced indexing, whose gradient (index_put) made forward+backward 1.15x slower on the CPU than
    embedding's (a sum into rows; benchmarks/torch_backend.py)."""
    if reused is None:
        return torch.nn.functional.embedding(index, table).view(*index.shape, *row_shape)
    size = index.numel() * table.shape[1]
    memory = reused.get(name)
    if memory is None or memory.numel() < size:  # a chunk's worth at least (untouched pages cost nothing)
        memory = reused[name] = table.new_empty(max(size, _CPU_CHUNK_BYTES // table.element_size()))
    rows = memory[:size].view(index.numel(), table.shape[1])
    torch.index_select(table, 0, index.reshape(-1), out=rows)
    return rows.view(*index.shape, *row_shape)


def attached(result: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """result unchanged in value but hung off inputs in autograd's graph (it adds an exact zero, the sum of none of
    their elements), so that a result that depends on none of them still differentiates, to zero gradients."""
    nothing = sum(t.reshape(-1)[:0].sum() for t in inputs)
    return result + nothing.to(result.dtype)


def _chunks(lengths: list, slot_bytes: int, budget: int) -> list:
    """[(start, stop, width)] over rows sorted by their lists' lengths (ascending): consecutive rows whose lengths
    lie within _LENGTH_SPREAD of the first's (plus one), as many as keep width x slot_bytes of scores a row within
    budget bytes (one at least); width is the chunk's longest length. Rows of length 0 make chunks of their own."""
    chunks, start = [], 0
    while start < len(lengths):
        first = lengths[start]
        cap = 0 if first == 0 else max(first + 1, int(first * _LENGTH_SPREAD))
        stop = bisect.bisect_right(lengths, cap, lo=start)
        if first:  # (empty rows hold no scores)
            stop = min(stop, start + max(1, budget // (lengths[stop - 1] * slot_bytes)))
        chunks.append((start, stop, lengths[stop - 1]))
        start = stop
    return chunks


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
