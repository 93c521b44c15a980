"""The warp-specialized Gluon backward (kernels/backward_ws.py): which calls it takes, that it compiles for sm_90
with its register split, TMA reductions and within shared memory (on any machine), and on a GPU its gradients
against the fp64 oracle. On the CPU the same cases must take the Triton backward (the interpreter cannot run Gluon)
and meet the same oracle."""


import math
import types

import pytest
import torch
import blockattn
from blockattn.kernels import backward, backward_ws, forward, replay
from conftest import (DECLINED_TENSORS, DEVICE, ON_GPU, assert_output_and_gradients, captured_replay,
                      declined_tensors, expand, interpreter_share, meta, no_host_reads, output_and_lse_loss, qkv,
                      random_keep, sm90_report, stack_bytes)


QUALIFYING = dict(block_q=128, block_kv=128, is_causal=False, token_mask=None, block_mask=None, kv_valid=None,
                  varlen=None, min_work=0)


def _qualifies(q=None, k=None, v=None, grad_out=None, **changes):
    q = q if q is not None else meta(2, 4, 1000, 128)
    k = k if k is not None else meta(2, 2, 1024, 128)
    v = v if v is not None else k
    grad_out = grad_out if grad_out is not None else q
    args = {**QUALIFYING, **changes}
    return backward_ws.qualifies(q, k, v, grad_out, args.pop("block_q"), args.pop("block_kv"), **args)


def test_qualifying_calls():
    assert _qualifies()
    assert _qualifies(block_q=64)
    assert _qualifies(block_q=256, block_kv=256)
    assert _qualifies(is_causal=True)
    # key blocks of 64 (or an odd multiple): paired programs, two 64-key tiles each, so Sk a multiple of 128
    mha = dict(q=meta(2, 2, 1000, 128), grad_out=meta(2, 2, 1000, 128))
    assert _qualifies(block_kv=64) and _qualifies(block_kv=64, **mha)
    assert _qualifies(block_q=64, block_kv=64, is_causal=True)
    assert _qualifies(k=meta(2, 2, 1152, 128), block_kv=192)
    assert _qualifies(q=meta(2, 4, 1000, 64), k=meta(2, 2, 1024, 64))
    assert _qualifies(q=meta(2, 4, 1000, 128, dtype=torch.float16), k=meta(2, 2, 1024, 128, dtype=torch.float16))
    # paired GQA up to 2 ** HEAD_BITS query heads a kv head (merge_group_lists); 128-key tiles walk head by head
    wide = meta(1, 2 * 256, 128, 128)
    assert _qualifies(q=wide, grad_out=wide, block_kv=64)
    wider = meta(1, 2 * 257, 128, 128)
    assert _qualifies(q=wider, grad_out=wider)
    # bshd storage seen as bhsd: strides (S*H*D, D, H*D, 1), all 16-byte multiples
    bshd = meta(2, 1024, 4, 128).transpose(1, 2)
    assert _qualifies(q=bshd, k=bshd, grad_out=bshd)


@pytest.mark.parametrize("change", [
    dict(token_mask=object()), dict(block_mask=object()), dict(kv_valid=object()),
    dict(varlen=object()), dict(block_q=32), dict(block_q=96), dict(block_kv=32), dict(block_kv=96),
    dict(block_kv=192), dict(block_kv=64, k=meta(2, 2, 1088, 128)), dict(min_work=2 * 4 * 1000 * 1024 * 128 + 1),
    dict(block_kv=64, q=meta(1, 2 * 257, 128, 128), grad_out=meta(1, 2 * 257, 128, 128),
         k=meta(1, 2, 1024, 128))])
def test_calls_it_declines(change):
    """Element tests other than the causal one, blocks not of whole 64-row steps or 64-key tiles, Sk not a multiple
    of the key block (192 at 1024) or of 128 (1088 = 17 tiles of 64: one would lack its pair), too little work, and
    paired GQA with more query heads a kv head than the merged lists' entries can name (257 > 2 ** HEAD_BITS)."""
    assert not _qualifies(**change), change


@pytest.mark.parametrize("tensors", DECLINED_TENSORS + ("grad dtype", "value dim 128 at 64", "broadcast grad"))
def test_tensors_it_declines(tensors):
    """The forward's declined tensors (with grad_out like q), and the backward's own: a gradient of another dtype,
    Dv = 128 with D = 64, and a gradient broadcast along its rows."""
    if tensors in DECLINED_TENSORS:
        q, k, v = declined_tensors(tensors)
        grad_out = q
    else:
        q, k = meta(2, 4, 1000, 128), meta(2, 2, 1024, 128)
        v, grad_out = k, q
        if tensors == "grad dtype":
            grad_out = q.float()
        elif tensors == "value dim 128 at 64":
            q, k, v = meta(2, 4, 1000, 64), meta(2, 2, 1024, 64), meta(2, 2, 1024, 128)
            grad_out = meta(2, 4, 1000, 128)
        else:  # "broadcast grad", e.g. the gradient of (out * w).sum(): stride 0 rows, which TMA cannot take
            grad_out = meta(128).expand(2, 4, 1000, 128)
    assert not _qualifies(q=q, k=k, v=v, grad_out=grad_out), tensors


def test_switched_off_deterministic_or_off_hopper_it_declines(monkeypatch):
    q = torch.empty(1, 2, 256, 128, device=DEVICE, dtype=torch.bfloat16)
    args = {**QUALIFYING}
    block_q, block_kv = args.pop("block_q"), args.pop("block_kv")
    on_hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    assert backward_ws.plan(q, q, q, q, block_q, block_kv, **args) == on_hopper
    dispatch = (q, q, q, q, block_q, block_kv, False, None, None, None, None)
    assert (backward.warp_specialized_module(*dispatch, None) is not None) == on_hopper
    # a dQ mode chosen (by the caller or the default) runs the Triton kernels it names
    assert backward.warp_specialized_module(*dispatch, "auto") is None
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", "kernel")
    assert backward.warp_specialized_module(*dispatch, None) is None
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", "auto")
    real_version = forward._triton_version
    monkeypatch.setattr(forward, "_triton_version", lambda: (3, 5))  # an older Gluon: not even imported
    assert backward.warp_specialized_module(*dispatch, None) is None
    monkeypatch.setattr(forward, "_triton_version", real_version)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # the dQ adds' order varies from run to run
    try:
        assert not backward_ws.plan(q, q, q, q, block_q, block_kv, **args)
    finally:
        torch.use_deterministic_algorithms(previous)
    monkeypatch.setattr(backward_ws, "ENABLED", False)
    assert not backward_ws.plan(q, q, q, q, block_q, block_kv, **args)
    assert backward.warp_specialized_module(*dispatch, None) is None


# Bytes of spilled registers a consumer thread may have (stack_bytes). Some variants spill: measured for the variants
# below, 0-232 bytes under Triton 3.9 (the CPU tests'; the most with paired GQA causal split in parts) and 0-104
# under Triton 3.6 (the H200's, whose speed BENCHMARKS.md reports; the most with 128-key GQA causal), none at D=64
# with 128-key tiles (thirty-ninth session); with the causal walk split (fifty-first session) 312 under 3.9 and 80
# under 3.6 at GQA causal, 32 and 112 at MHA causal. The budget catches a change that spills much more than that.
SPILL_BUDGET = 384


@pytest.mark.parametrize("blocks, dtype, grouped, causal, lagged, dim, ordered", [
    ((128, 128), "bfloat16", False, False, None, 128, None), ((64, 256), "float16", True, True, None, 128, True),
    ((128, 128), "bfloat16", False, True, False, 128, False), ((128, 128), "bfloat16", False, True, None, 64, None),
    ((64, 128), "float16", True, False, None, 64, True),
    # paired programs (64-key tiles)
    ((128, 64), "bfloat16", False, False, None, 128, None), ((128, 64), "float16", True, True, None, 128, True),
    ((64, 64), "bfloat16", False, True, None, 64, False), ((128, 192), "bfloat16", True, False, None, 64, None),
    ((128, 64), "bfloat16", False, True, None, 128, "own dQ"),
    # the causal walk's crossing steps apart or in one loop with the rest (a launch's choice: _splits_causal)
    ((128, 128), "bfloat16", False, True, None, 128, "split"),
    ((128, 128), "bfloat16", True, True, None, 128, "one loop"),
    ((128, 128), "float16", False, True, None, 64, "split")])
def test_compiles_for_sm90_with_its_register_split(blocks, dtype, grouped, causal, lagged, dim, ordered):
    """Each variant (lagged, ordered: None as a launch would, LAGGED_DQ and ORDERED; "own dQ": paired programs
    without PAIRED_SUMMED_DQ; "split" / "one loop": the causal walk's crossing steps apart or not) compiles with the
    register split, wgmma, TMA copies and adds, in shared memory, and spills no more than SPILL_BUDGET bytes a
    thread."""
    variant = {"own dQ": "ordered=None, summed=False", "split": "ordered=None, split_causal=True",
               "one loop": "ordered=None, split_causal=False"}.get(ordered, f"ordered={ordered}")
    report = sm90_report(f"backward_ws.compile_sm90({blocks[0]}, {blocks[1]}, torch.{dtype}, grouped={grouped}, "
                         f"causal={causal}, lagged={lagged}, dim={dim}, {variant})")
    assert {backward_ws.CONSUMER_REGS, backward_ws.LOADER_REGS} <= set(report["registers"]), report
    assert report["wgmma"] and report["tma"] and report["reduction"], report
    assert report["shared"] <= 227 * 1024, report
    assert "LOCAL:0" in report["usage"] and stack_bytes(report) <= SPILL_BUDGET, f"registers spill: {report['usage']}"


@pytest.mark.parametrize("grouped, causal, dim, split", [(False, False, 128, 4), (True, True, 128, 2),
                                                          (False, True, 64, 8)])
def test_compiles_for_sm90_with_the_group_split_in_parts(grouped, causal, dim, split):
    """Paired programs of one part of a kv head's group (KV_SPLIT; grouped: of several query heads) compile with
    TMA adds of dK and dV into fp32 sums, in shared memory, within SPILL_BUDGET."""
    report = sm90_report(f"backward_ws.compile_sm90(128, 64, grouped={grouped}, causal={causal}, dim={dim}, "
                         f"kv_split={split})")
    assert report["wgmma"] and report["tma"] and report["reduction"], report
    assert report["shared"] <= 227 * 1024, report
    assert "LOCAL:0" in report["usage"] and stack_bytes(report) <= SPILL_BUDGET, f"registers spill: {report['usage']}"


@pytest.mark.parametrize("heads, kv_heads, tiles_per_block", [(6, 2, 1), (4, 4, 2), (1, 3, 1)])
def test_tile_order_puts_each_kv_heads_longest_walks_first(heads, kv_heads, tiles_per_block):
    """tile_order: per (batch, kv head) a permutation of the key tiles whose walks (the q lists' counts summed over
    the kv head's query heads; heads = 1 stands for one mask shared by all) never grow along it, ties in key
    order."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q_count = torch.randint(0, 5, (3, heads, 7), generator=gen, dtype=torch.int32)
    order = backward_ws.tile_order(q_count, kv_heads, tiles_per_block)
    assert order.dtype == torch.int32 and order.shape == (3, min(heads, kv_heads), 7 * tiles_per_block)
    summed = q_count.long().reshape(3, -1, max(heads // kv_heads, 1), 7).sum(2)
    walks = summed.repeat_interleave(tiles_per_block, -1).gather(-1, order.long())
    assert (order.sort(-1).values == torch.arange(7 * tiles_per_block, dtype=torch.int32)).all()
    assert (walks[..., 1:] <= walks[..., :-1]).all()
    ties = walks[..., 1:] == walks[..., :-1]
    assert (order[..., 1:] > order[..., :-1])[ties].all(), "equal walks out of key order"


@pytest.mark.parametrize("heads, kv_heads, tiles_per_block, ordered", [(4, 2, 1, True), (3, 3, 2, True),
                                                                          (1, 2, 1, False), (2, 1, 3, True)])
def test_pair_lists_put_the_blocks_a_programs_tiles_share_first(heads, kv_heads, tiles_per_block, ordered):
    """pair_lists: a row per 64-key tile holding its key block's list, reordered so that the query blocks the other
    tile of its program (order[2p], order[2p + 1]) also lists come first, ascending, then the rest, ascending; the
    count of those common ones is the same in both rows of a program. common_first=False keeps each list as it is,
    with no common steps. (heads 1: one mask for all heads.)"""
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + tiles_per_block)
    batch, nq, nk = 2, 9, 8 // tiles_per_block * 2
    keep = torch.rand(batch, heads, nq, nk, generator=gen) < 0.5
    keep[0, 0, :, 0] = True   # a dense key block and an empty one
    keep[0, 0, :, 1] = False
    q_count, q_index = blockattn.sparsity.build_lists(keep.transpose(-1, -2))
    order = backward_ws.tile_order(q_count, kv_heads, tiles_per_block) if ordered else None
    counts, index = backward_ws.pair_lists(q_count, q_index, order, tiles_per_block)
    tiles = nk * tiles_per_block
    assert counts.shape == (batch, heads, tiles, 2) and index.shape == (batch, heads, tiles, nq)
    if order is None:
        order = torch.arange(tiles).expand(batch, 1, tiles)
    order = order.long().repeat_interleave(heads // order.shape[1], dim=1)
    seen_common = 0
    for b in range(batch):
        for h in range(heads):
            for p in range(tiles // 2):
                pair = order[b, h, 2 * p].item(), order[b, h, 2 * p + 1].item()
                kept = [set(torch.nonzero(keep[b, h, :, t // tiles_per_block]).flatten().tolist()) for t in pair]
                shared = sorted(kept[0] & kept[1])
                assert counts[b, h, pair[0], 1] == counts[b, h, pair[1], 1] == len(shared)
                for t, own in zip(pair, kept):
                    listed = index[b, h, t, :counts[b, h, t, 0]].tolist()
                    assert counts[b, h, t, 0] == len(own)
                    assert listed == shared + sorted(own - set(shared)), (b, h, t)
                seen_common += len(shared)
    assert seen_common > 0
    plain, plain_index = backward_ws.pair_lists(q_count, q_index, None, tiles_per_block, common_first=False)
    assert not plain[..., 1].any()
    assert torch.equal(plain[..., 0], q_count.repeat_interleave(tiles_per_block, -1))
    assert torch.equal(plain_index, q_index.repeat_interleave(tiles_per_block, 2))


@pytest.mark.parametrize("heads, kv_heads, ordered", [(6, 2, True), (4, 1, True), (1, 2, True), (2, 2, True),
                                                     (4, 2, False)])
def test_merge_group_lists_walks_every_heads_common_blocks_then_every_heads_rest(heads, kv_heads, ordered):
    """merge_group_lists: paired GQA's one list per kv head's tile over its group's query heads. Its entries name
    (query block, the head's place in the group); it holds each head's common blocks (those the program's other
    tile lists too), head by head in order, then each head's rest, head by head, each part as pair_lists orders it;
    its counts are the totals. heads 1: one mask for all heads, every head of the group listing the same blocks.
    Group 1 (MHA) leaves the lists as they are (the launcher does not merge them)."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    batch, nq, nk = 2, 7, 6
    tiles_per_block = 2 if ordered else 1  # (key order pairs a block's own two tiles)
    group = (heads if heads > 1 else 4) // kv_heads
    keep = torch.rand(batch, heads, nq, nk, generator=gen) < 0.45
    keep[..., 0] = True  # a dense key block and an empty one
    keep[..., 1] = False
    q_count, q_index = blockattn.sparsity.build_lists(keep.transpose(-1, -2))
    order = None  # key order, or (ordered) a random pairing: a key block's own two tiles would share every block
    if ordered:
        order = torch.argsort(torch.rand(batch, kv_heads if heads > 1 else 1, nk * tiles_per_block, generator=gen))
    counts, index = backward_ws.pair_lists(q_count, q_index, order, tiles_per_block)
    if group == 1:
        assert backward_ws.cached_pair_lists(q_count, q_index, order, kv_heads, tiles_per_block, 1)[0].shape == \
            counts.shape
        return
    merged_counts, merged = backward_ws.merge_group_lists(counts, index, group)
    rows = kv_heads if heads > 1 else 1
    tiles = nk * tiles_per_block
    assert merged_counts.shape == (batch, rows, tiles, 2) and merged.shape == (batch, rows, tiles, group * nq)
    assert merged_counts.dtype == merged.dtype == torch.int32
    low = 2 ** backward_ws.HEAD_BITS - 1
    for b in range(batch):
        for row in range(rows):
            for t in range(tiles):
                common, rest = [], []
                for g in range(group):
                    h = row * group + g if heads > 1 else 0
                    length, shared = counts[b, h, t].tolist()
                    listed = index[b, h, t, :length].tolist()
                    common += [(block, g) for block in listed[:shared]]
                    rest += [(block, g) for block in listed[shared:]]
                length, shared = merged_counts[b, row, t].tolist()
                assert (length, shared) == (len(common) + len(rest), len(common))
                entries = merged[b, row, t, :length].tolist()
                assert [(e >> backward_ws.HEAD_BITS, e & low) for e in entries] == common + rest, (b, row, t)
    assert merged_counts[..., 1].any() and (merged_counts[..., 0] > merged_counts[..., 1]).any()
    with pytest.raises(ValueError, match="group"):
        backward_ws.merge_group_lists(counts, index, 2 ** backward_ws.HEAD_BITS + 1)


def test_pair_lists_are_kept_per_lists_tensor(monkeypatch):
    """cached_pair_lists computes a lists tensor's pair lists once, again after the lists are written in place or
    PAIRED_COMMON_FIRST changes, and lets the entry go with the tensor."""
    q_count = torch.tensor([[[2, 2]]], dtype=torch.int32)
    q_index = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)
    first = backward_ws.cached_pair_lists(q_count, q_index, None, 1, 2)
    assert first[0].tolist() == [[[[2, 2], [2, 2], [2, 2], [2, 2]]]]
    assert backward_ws.cached_pair_lists(q_count, q_index, None, 1, 2) is first
    q_count[0, 0, 0] = 1
    again = backward_ws.cached_pair_lists(q_count, q_index, None, 1, 2)
    assert again is not first and again[0][0, 0, :, 0].tolist() == [1, 1, 2, 2]
    assert again[0][0, 0, :, 1].tolist() == [1, 1, 2, 2]
    monkeypatch.setattr(backward_ws, "PAIRED_COMMON_FIRST", False)
    assert backward_ws.cached_pair_lists(q_count, q_index, None, 1, 2)[0][0, 0, :, 1].tolist() == [0, 0, 0, 0]
    entries = len(backward_ws._PAIR_LISTS)
    del q_count
    assert len(backward_ws._PAIR_LISTS) < entries


def test_tile_order_is_kept_per_lists_tensor():
    """cached_tile_order computes a lists tensor's order once, again after the tensor is written in place, and lets
    the entry go with the tensor; an inference tensor's (no version counter) it computes each time."""
    q_count = torch.tensor([[[1, 3, 2, 3]]], dtype=torch.int32)
    first = backward_ws.cached_tile_order(q_count, 1, 1)
    assert first.tolist() == [[[1, 3, 2, 0]]]
    assert backward_ws.cached_tile_order(q_count, 1, 1) is first
    assert backward_ws.cached_tile_order(q_count.clone(), 1, 1) is not first
    q_count[0, 0, 0] = 9
    assert backward_ws.cached_tile_order(q_count, 1, 1).tolist() == [[[0, 1, 3, 2]]]
    entries = len(backward_ws._TILE_ORDERS)
    del q_count
    assert len(backward_ws._TILE_ORDERS) < entries
    with torch.inference_mode():
        made_there = torch.tensor([[[2, 5]]], dtype=torch.int32)
    assert backward_ws.cached_tile_order(made_there, 1, 2).tolist() == [[[2, 3, 0, 1]]]
    assert len(backward_ws._TILE_ORDERS) < entries


def _union_steps(q_count, q_index, order, tiles_per_block) -> int:
    """The paired programs' steps over all tiles: both walks, the steps common to a program's two tiles once."""
    counts, _ = backward_ws.pair_lists(q_count, q_index, order, tiles_per_block)
    return int(counts[..., 0].sum()) - int(counts[..., 1].sum()) // 2


@pytest.mark.parametrize("batch, heads, kv_heads", [(2, 2, 2), (1, 6, 2), (2, 1, 3)])
def test_paired_tile_order_matches_tiles_whose_lists_agree(batch, heads, kv_heads, monkeypatch):
    """paired_tile_order: with the key blocks made into twins (two blocks whose q lists are equal in every query head
    of a kv head's group, random otherwise), each program takes a pair of twins; the programs come longest walk first
    (the longer of a program's two walks, summed over the group), within a program the longer walk first; each
    (batch, kv head)'s row is a permutation of its tiles. (heads 1: one mask for all heads.)"""
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    gen = torch.Generator().manual_seed(batch * 100 + heads * 10 + kv_heads)
    nq, nk = 24, 16
    keep = torch.rand(batch, heads, nq, nk, generator=gen) < 0.5
    twin = torch.empty(batch, nk, dtype=torch.long)
    for b in range(batch):  # a random pairing of the key blocks, the same for every head
        perm = torch.randperm(nk, generator=gen)
        twin[b, perm[0::2]], twin[b, perm[1::2]] = perm[1::2], perm[0::2]
        keep[b, :, :, perm[1::2]] = keep[b, :, :, perm[0::2]]
    q_count, q_index = blockattn.sparsity.build_lists(keep.transpose(-1, -2))
    order = backward_ws.paired_tile_order(q_count, q_index, kv_heads, 1)
    rows = 1 if heads == 1 else kv_heads
    assert order.dtype == torch.int32 and order.shape == (batch, rows, nk)
    assert (order.sort(-1).values == torch.arange(nk, dtype=torch.int32)).all()
    first, second = order[..., 0::2].long(), order[..., 1::2].long()
    assert (twin.unsqueeze(1).expand(batch, rows, nk).gather(-1, first) == second).all(), "tiles not twins"
    walks = q_count.long().reshape(batch, rows, -1, nk).sum(2)
    longer = walks.gather(-1, first)
    assert (longer >= walks.gather(-1, second)).all()
    assert (longer[..., 1:] <= longer[..., :-1]).all()


def test_paired_tile_order_pairs_a_blocks_own_tiles_and_keeps_neighbours_outside_its_range(monkeypatch):
    """Two 64-key tiles of one key block (128x128 lists read as 64-key tiles) list the same query blocks, so each
    program takes one block's two tiles; with fewer tiles than PAIR_MIN_TILES, or more than PAIR_MAX_TILES, the
    order is tile_order's."""
    gen = torch.Generator().manual_seed(4)
    keep = torch.rand(2, 4, 12, 8, generator=gen) < 0.5
    q_count, q_index = blockattn.sparsity.build_lists(keep.transpose(-1, -2))
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    order = backward_ws.paired_tile_order(q_count, q_index, 4, 2)
    assert (order[..., 0::2] // 2 == order[..., 1::2] // 2).all()
    for low, high in ((17, 4096), (2, 15)):
        monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", low)
        monkeypatch.setattr(backward_ws, "PAIR_MAX_TILES", high)
        assert torch.equal(backward_ws.paired_tile_order(q_count, q_index, 2, 2),
                           backward_ws.tile_order(q_count, 2, 2))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_paired_tile_order_shares_more_steps_than_neighbours(heads, kv_heads):
    """On random masks of density 0.1 at the default settings (256 tiles a kv head), matching tiles by shared query
    blocks leaves the paired programs fewer steps than tile_order's neighbours (which share by chance only), and
    every tile walks in exactly one program."""
    gen = torch.Generator().manual_seed(heads + kv_heads)
    keep = torch.rand(1, heads, 64, 256, generator=gen) < 0.1
    q_count, q_index = blockattn.sparsity.build_lists(keep.transpose(-1, -2))
    matched = backward_ws.paired_tile_order(q_count, q_index, kv_heads, 1)
    neighbours = backward_ws.tile_order(q_count, kv_heads, 1)
    assert (matched.sort(-1).values == torch.arange(256, dtype=torch.int32)).all()
    total = int(q_count.sum())
    with_matching = _union_steps(q_count, q_index, matched, 1)
    assert with_matching < 0.97 * _union_steps(q_count, q_index, neighbours, 1) <= 0.97 * total


def test_paired_tile_order_reads_nothing_back_and_is_captured(monkeypatch):
    """paired_tile_order on the lists' device reads no value back to the host (so a backward with new lists does not
    wait for the GPU); on a GPU it is captured in a CUDA graph whose replay, on lists rewritten in place, gives the
    order computed eagerly from those lists."""
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)

    def lists(seed):
        keep = torch.rand(2, 4, 16, 32, generator=torch.Generator().manual_seed(seed)) < 0.3
        return [t.to(DEVICE) for t in blockattn.sparsity.build_lists(keep.transpose(-1, -2))]
    q_count, q_index = lists(1)
    backward_ws.paired_tile_order(q_count, q_index, 2, 1)  # (first use: lazy initialization may read back)
    with no_host_reads(monkeypatch):
        order = backward_ws.paired_tile_order(q_count, q_index, 2, 1)
    assert (order.sort(-1).values.cpu() == torch.arange(32, dtype=torch.int32)).all()
    if not ON_GPU:
        return
    new_count, new_index = lists(2)
    captured = captured_replay(lambda: backward_ws.paired_tile_order(q_count, q_index, 2, 1), (q_count, q_index),
                               (new_count, new_index))
    eager = backward_ws.paired_tile_order(new_count, new_index, 2, 1)
    assert torch.equal(captured, eager) and not torch.equal(eager, order)


def test_paired_tile_order_is_kept_per_lists_and_settings(monkeypatch):
    """cached_paired_tile_order computes a lists pair's order once, again when the matching's settings change."""
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    keep = torch.rand(1, 2, 6, 8, generator=torch.Generator().manual_seed(2)) < 0.5
    q_count, q_index = blockattn.sparsity.build_lists(keep.transpose(-1, -2))
    first = backward_ws.cached_paired_tile_order(q_count, q_index, 2, 1)
    assert backward_ws.cached_paired_tile_order(q_count, q_index, 2, 1) is first
    monkeypatch.setattr(backward_ws, "PAIR_BALANCE", 3.0)
    assert backward_ws.cached_paired_tile_order(q_count, q_index, 2, 1) is not first


# ---------------------------------------------------------------- against the oracle

CASES = {
    # name: (batch, heads, kv_heads, seq_q, seq_kv, block, dtype, layout, head dim); "one mask" cases share one
    # [nq, nk] mask
    # across batch and heads (the lists' batch and head strides are 0)
    "128x128 bf16": (2, 4, 4, 2048, 2048, (128, 128), torch.bfloat16, "bhsd", 128),
    # 1001 = 15 * 64 + 41: the last step's rows end inside it (and the row terms' rows are padded to 1004)
    "64x128 fp16, query tail": (1, 4, 4, 1001, 1024, (64, 128), torch.float16, "bhsd", 128),
    # 900 = 7 * 128 + 4: the last block's second 64-row step lies wholly past the end
    "short query tail": (1, 2, 2, 900, 1024, (128, 128), torch.bfloat16, "bhsd", 128),
    "256x256 gqa": (1, 8, 2, 1024, 1024, (256, 256), torch.bfloat16, "bhsd", 128),
    "bshd layout": (2, 2, 2, 1536, 1024, (128, 128), torch.bfloat16, "bshd", 128),
    "one mask, batch 3, gqa": (3, 4, 2, 1024, 1280, (128, 128), torch.bfloat16, "bhsd", 128),
    # D = 64: each consumer's dQ over its own keys (GQA meeting each step, MHA lagging dQ)
    "d64 gqa, query tail": (1, 4, 2, 999, 1024, (128, 128), torch.bfloat16, "bhsd", 64),
    "d64 64x128 fp16": (2, 2, 2, 1024, 1024, (64, 128), torch.float16, "bshd", 64),
    # 64-key blocks (and 192 = 3 x 64): paired programs, each consumer its own 64-key tile and q list
    "128x64 bf16": (2, 4, 4, 2048, 2048, (128, 64), torch.bfloat16, "bhsd", 128),
    "128x64 gqa fp16, query tail": (1, 8, 2, 1001, 1024, (128, 64), torch.float16, "bshd", 128),
    "one mask, batch 2, 64x64 gqa": (2, 4, 2, 1024, 768, (64, 64), torch.bfloat16, "bhsd", 128),
    "d64 64x64 gqa": (2, 4, 2, 1024, 1024, (64, 64), torch.bfloat16, "bhsd", 64),
    "128x192, query tail": (1, 2, 2, 1000, 1152, (128, 192), torch.bfloat16, "bhsd", 128),
}
CAUSAL_CASES = {
    # Sq < Sk: top-left alignment, the query tail ends inside its step
    "128x128 causal, query tail": (1, 4, 4, 1000, 1024, (128, 128), torch.bfloat16, "bhsd", 128),
    # 64-row blocks: the diagonal crosses two steps of each 128-key tile
    "64x128 causal gqa fp16": (2, 4, 2, 1024, 1024, (64, 128), torch.float16, "bhsd", 128),
    # the last query block keeps only the key block starting halfway down it: its first 128 rows see no key
    "256x128 causal": (1, 2, 2, 1024, 1024, (256, 128), torch.bfloat16, "bhsd", 128),
    # Sq > Sk: the last query blocks see every key
    "more queries than keys": (1, 2, 2, 1536, 512, (128, 128), torch.bfloat16, "bshd", 128),
    "d64 causal": (1, 2, 2, 1024, 1024, (128, 128), torch.bfloat16, "bhsd", 64),
    "128x64 causal gqa": (1, 4, 2, 1024, 1024, (128, 64), torch.bfloat16, "bhsd", 128),
    "d64 64x64 causal fp16, query tail": (1, 2, 2, 1000, 1024, (64, 64), torch.float16, "bhsd", 64),
}


@pytest.fixture
def warp_specialized_calls(monkeypatch) -> list:
    """One entry per run of the Gluon backward from here on."""
    calls = []
    run = backward_ws.attention_backward_ws

    def spy(*args):
        calls.append(tuple(args[7:9]))  # (block_q, block_kv)
        return run(*args)
    monkeypatch.setattr(backward_ws, "attention_backward_ws", spy)
    return calls


@pytest.mark.parametrize("case", list(CASES) + list(CAUSAL_CASES))
def test_gradients_against_the_oracle(case, poisoned, warp_specialized_calls):
    """dq, dk, dv through a loss of out and LSE, with a query block that keeps nothing, a key block no query
    keeps (exact zeros for its dk and dv) and, where the mask is per head, a head that keeps nothing. Causal cases
    keep, in their last query block, only the key block holding its middle row."""
    is_causal = case in CAUSAL_CASES
    batch, heads, kv_heads, seq_q, seq_kv, block, dtype, layout, dim = (CAUSAL_CASES if is_causal else CASES)[case]
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block)
    q, k, v = qkv(batch, heads, seq_q, dim, kv_heads=kv_heads, seq_kv=seq_kv, dtype=dtype)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    one_mask = case.startswith("one mask")
    keep = random_keep(1 if one_mask else batch, 1 if one_mask else heads, seq_q, seq_kv, block, density=0.4)
    keep[:, :, 1] = False  # a query block that keeps nothing
    keep[:, :, :, -1] = False  # a key block no query keeps
    if not one_mask:
        keep[0, 0] = False  # a head that keeps nothing at all
    if is_causal:
        nq, nk = keep.shape[-2:]
        last = nq - 1
        keep[:, :, last] = False
        keep[:, :, last, min(nk - 2, (last * block[0] + block[0] // 2) // block[1])] = True
    out, lse = blockattn.attention(q, k, v, keep[0, 0] if one_mask else keep, block, return_lse=True,
                                   is_causal=is_causal, backend="triton")
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    grad_out = torch.randn(out.shape, generator=gen, device=DEVICE).to(out.dtype)
    # the LSE enters the loss too: its gradient folds into the row terms
    grads = torch.autograd.grad(output_and_lse_loss(out.float(), lse, grad_out.float()), (q, k, v))
    on_hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    assert warp_specialized_calls == ([block] if on_hopper else [])
    assert_output_and_gradients(None, grads, q, k, v, expand(keep, block, seq_q, seq_kv), grad_out, tolerance=1e-2,
                                is_causal=is_causal, through_lse=True)
    unkept = slice(seq_kv - block[1], seq_kv)
    assert not grads[1][:, :, unkept].any() and not grads[2][:, :, unkept].any(), "dk / dv of an unkept key block"


@pytest.mark.parametrize("case", list(CAUSAL_CASES))
def test_causal_split_the_other_way_against_the_oracle(case, monkeypatch, poisoned, warp_specialized_calls):
    """The causal cases above with each walk of 128-key blocks, MHA and GQA, taking the other loop structure than a
    launch's by default at its head dim: its crossing steps in a loop of their own and the rest without the causal
    test where it would run every step in one loop with the test, and the other way round (SPLIT_CAUSAL_DIMS and
    SPLIT_CAUSAL_GROUPED_DIMS swapped for their complements; the paired walks of 64-key blocks keep one loop)."""
    for setting in ("SPLIT_CAUSAL_DIMS", "SPLIT_CAUSAL_GROUPED_DIMS"):
        split_dims = getattr(backward_ws, setting)
        monkeypatch.setattr(backward_ws, setting, tuple(d for d in backward_ws.HEAD_DIMS if d not in split_dims))
    test_gradients_against_the_oracle(case, poisoned, warp_specialized_calls)


def test_row_terms_reach_it_in_their_padded_buffer(poisoned, monkeypatch):
    """On any machine: attention_backward with the Gluon kernel stood in for by its arithmetic in fp64 (the row terms
    it is handed, dQ unscaled into the zeroed buffer) gives the oracle's gradients at Sq = 141, so the preprocess
    wrote lse2 and delta into row_terms_buffer's rows (padded to 144 entries, as TMA's 16-byte strides need), and
    the zeroing and the dQ finish pass did their part. A head keeps nothing (lse2 = +inf: its P is exactly 0)."""
    block, seq_q, seq_kv = (64, 64), 141, 128
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, seq_q, 64, kv_heads=2, seq_kv=seq_kv, seed=7))
    keep = random_keep(1, 4, seq_q, seq_kv, block, density=0.5)
    keep[0, 1] = False
    visible = expand(keep, block, seq_q, seq_kv)
    handed = []

    def kernel_arithmetic(q, k, v, grad_out, row_terms, q_count, q_index, block_q, block_kv, scale_log2, causal,
                          dq_acc, dk, dv):
        handed.append(row_terms)
        group = q.shape[1] // k.shape[1]
        kx, vx = (t.double().repeat_interleave(group, 1) for t in (k, v))
        lse2, delta = row_terms[:, :, 0, :, None].double(), row_terms[:, :, 1, :, None].double()
        p = torch.where(visible, torch.exp2(q.double() @ kx.transpose(-1, -2) * scale_log2 - lse2), 0.0)
        ds = p * (grad_out.double() @ vx.transpose(-1, -2) - delta)
        dq_acc += (ds @ kx).float()
        unflat = (k.shape[0], k.shape[1], group, *k.shape[2:])
        dk.copy_((ds.transpose(-1, -2) @ q.double()).view(unflat).sum(2) * (scale_log2 / math.log2(math.e)))
        dv.copy_((p.transpose(-1, -2) @ grad_out.double()).view(unflat).sum(2))
    stand_in = types.SimpleNamespace(row_terms_buffer=backward_ws.row_terms_buffer,
                                     attention_backward_ws=kernel_arithmetic)
    monkeypatch.setattr(backward, "warp_specialized_module", lambda *args: stand_in)
    out = blockattn.attention(q, k, v, keep, block, backend="triton")
    grad_out = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(8), device=DEVICE)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    (terms,) = handed
    assert terms.shape == (1, 4, 2, seq_q) and terms.stride() == (4 * 2 * 144, 2 * 144, 144, 1)
    assert_output_and_gradients(None, grads, q, k, v, visible, grad_out, tolerance=1e-2)
    assert not grads[0][:, 1].any(), "dq of the head that keeps nothing"


@pytest.mark.parametrize("case", ["short query tail", "128x128 causal, query tail", "d64 64x128 fp16", "256x256 gqa"])
def test_gradients_with_consumers_meeting_each_step(case, poisoned, warp_specialized_calls, monkeypatch):
    """As above with dQ not lagged (LAGGED_DQ off: both consumers meet at each step's dS): the kernel's other dQ
    schedule."""
    monkeypatch.setattr(backward_ws, "LAGGED_DQ", False)
    test_gradients_against_the_oracle(case, poisoned, warp_specialized_calls)


@pytest.mark.parametrize("case", ["256x256 gqa", "one mask, batch 3, gqa", "64x128 causal gqa fp16", "d64 causal"])
def test_gradients_with_tiles_longest_first(case, poisoned, warp_specialized_calls, monkeypatch):
    """As above with each (batch, kv head)'s tiles taken longest walk first (ORDERED): the programs' tiles come from
    tile_order, for one mask shared by all heads and masks per head, two tiles a key block and one."""
    monkeypatch.setattr(backward_ws, "ORDERED", True)
    test_gradients_against_the_oracle(case, poisoned, warp_specialized_calls)


def _recorded(monkeypatch, name: str) -> list:
    """The results of backward_ws's function `name`, one per call from here on (the function still runs). The
    backward's preparation then runs eagerly: a replay (kernels/replay.py) would call no function, a capture two."""
    results = []
    function = getattr(backward_ws, name)
    monkeypatch.setattr(replay, "ENABLED", False)

    def spy(*args):
        results.append(function(*args))
        return results[-1]
    monkeypatch.setattr(backward_ws, name, spy)
    return results


@pytest.mark.parametrize("case", ["128x64 bf16", "128x64 gqa fp16, query tail", "one mask, batch 2, 64x64 gqa",
                                  "d64 64x64 gqa", "128x192, query tail", "128x64 causal gqa"])
def test_gradients_with_tiles_matched_by_shared_blocks(case, poisoned, warp_specialized_calls, monkeypatch):
    """As above with the paired programs' tiles matched by the query blocks they share (paired_tile_order, which the
    test shapes are too short for at the default PAIR_MIN_TILES): a program's two tiles are then not neighbours,
    and on Hopper the kernel ran with that order (matched from a mask's first backward on: MATCH_FROM_USE 1)."""
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    monkeypatch.setattr(backward_ws, "MATCH_FROM_USE", 1)
    orders = _recorded(monkeypatch, "paired_tile_order")
    test_gradients_against_the_oracle(case, poisoned, warp_specialized_calls)
    on_hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    assert len(orders) == on_hopper
    if orders and not case.endswith("causal gqa"):  # (causal lists: a block's own two tiles agree best)
        assert (orders[0][..., 1::2] - orders[0][..., 0::2]).abs().ne(1).any(), "every pair neighbours"


def test_gradients_with_a_new_mask_each_call(poisoned, warp_specialized_calls, monkeypatch):
    """Paired programs with their tiles matched (PAIR_MIN_TILES 2, MATCH_FROM_USE 1), MHA and GQA: two random masks
    of one shape in turn, each call's lists new, so that on a GPU the first call captures the preparation (tile
    order, matching, pair lists) and the second replays it (kernels/replay.py). Every call's gradients meet the fp64
    oracle."""
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    monkeypatch.setattr(backward_ws, "MATCH_FROM_USE", 1)
    monkeypatch.setattr(replay, "_GRAPHS", type(replay._GRAPHS)())
    block, seq = (128, 64), 256
    on_hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    for kv_heads in (4, 2):
        q, k, v = (t.requires_grad_() for t in qkv(1, 4, seq, 128, kv_heads=kv_heads, seed=kv_heads))
        for seed in range(2):
            keep = random_keep(1, 4, seq, seq, block, density=0.4, seed=seed)
            _gradients_meet_the_oracle(q, k, v, keep, block, seq, seed, warp_specialized_calls)
            warp_specialized_calls.clear()
    # a graph per computation (order, pair lists) and group; the tile order's MHA and GQA keys differ
    assert len(replay._GRAPHS) == (4 if on_hopper else 0)


def test_tiles_are_matched_from_a_masks_second_backward_on(poisoned, warp_specialized_calls, monkeypatch):
    """One prepared BlockSparsity (128x64, PAIR_MIN_TILES 2) through three backward calls: on Hopper the first pairs
    tile_order's neighbours, the second matches its tiles (paired_tile_order runs once), the third keeps that
    order; a mask given as a tensor, new lists each call, is never matched. Every call's gradients meet the fp64
    oracle. backward_uses counts per lists tensors, afresh after a write in place."""
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    orders = _recorded(monkeypatch, "paired_tile_order")
    block, seq = (128, 64), 256
    on_hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, seq, 128, kv_heads=1, seed=3))
    keep = random_keep(1, 2, seq, seq, block, density=0.4, seed=3)
    blocks = blockattn.BlockSparsity.from_mask(keep, block, seq, seq)
    for matched in (0, 1, 1):
        _gradients_meet_the_oracle(q, k, v, keep, block, seq, 3, warp_specialized_calls, blocks=blocks)
        warp_specialized_calls.clear()
        assert len(orders) == (matched if on_hopper else 0)
    for _ in range(2):
        _gradients_meet_the_oracle(q, k, v, keep, block, seq, 5, warp_specialized_calls)
        warp_specialized_calls.clear()
    assert len(orders) == on_hopper
    q_count, q_index = (t.clone() for t in blocks.q_lists())
    assert [backward_ws.backward_uses(q_count, q_index) for _ in range(3)] == [1, 2, 3]
    q_count[0, 0, 0] = q_count[0, 0, 0]  # a write in place: the lists may differ now
    assert backward_ws.backward_uses(q_count, q_index) == 1


def test_kv_split_takes_a_head_a_part_where_the_groups_rows_exceed_l2(monkeypatch):
    """kv_split: by default one part per query head of the group once the group's rows of Q, dO (2 bytes a value)
    and dQ's fp32 sums outgrow the L2 cache, else one part; MHA one part; KV_SPLIT forces a count that divides the
    group, and 1 where it does not."""
    l2 = 50 * 2 ** 20
    assert backward_ws.KV_SPLIT is None
    assert backward_ws.kv_split(32, 8, 16384, 128, l2) == 4          # 64 MiB of rows a kv head
    assert backward_ws.kv_split(32, 8, 12800, 128, l2) == 1          # exactly 50 MiB
    assert backward_ws.kv_split(32, 8, 16384, 64, l2) == 1
    assert backward_ws.kv_split(32, 32, 65536, 128, l2) == 1
    assert backward_ws.kv_split(12, 2, 32768, 64, l2) == 6
    monkeypatch.setattr(backward_ws, "KV_SPLIT", 2)
    assert backward_ws.kv_split(32, 8, 1024, 128, l2) == 2
    assert backward_ws.kv_split(6, 2, 16384, 128, l2) == 1


@pytest.mark.parametrize("case, split", [("128x64 gqa fp16, query tail", 2), ("128x64 gqa fp16, query tail", 4),
                                         ("one mask, batch 2, 64x64 gqa", 2), ("d64 64x64 gqa", 2),
                                         ("128x64 causal gqa", 2), ("128x64 bf16", 2), ("256x256 gqa", 4)])
def test_gradients_with_the_group_split_in_parts(case, split, poisoned, warp_specialized_calls, monkeypatch):
    """As above with each kv head's group of query heads split in KV_SPLIT parts (paired GQA), whose programs add
    their shares of dK and dV into fp32 sums: a group of 4 in 2 parts of 2 and in 4 parts of one head (the MHA
    walk), one mask for all heads, D = 64, causal. MHA and 128-key tiles take no parts."""
    monkeypatch.setattr(backward_ws, "KV_SPLIT", split)
    splits = _recorded(monkeypatch, "kv_split")
    test_gradients_against_the_oracle(case, poisoned, warp_specialized_calls)
    on_hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    spec = CASES.get(case) or CAUSAL_CASES[case]
    heads, kv_heads, block = spec[1], spec[2], spec[5]
    assert splits == ([split] if on_hopper and heads > kv_heads and block[1] % 128 else [])


def _gradients_meet_the_oracle(q, k, v, keep, block, seq, seed, warp_specialized_calls, blocks=None) -> tuple:
    """(dq, dk, dv) of attention(q, k, v, keep, block) with Sq = Sk = seq against the fp64 oracle's for a random
    output gradient (seed); the Gluon backward ran once on Hopper, never elsewhere. blocks: what attention() is given
    for the mask instead of keep (a BlockSparsity made from it)."""
    out = blockattn.attention(q, k, v, keep if blocks is None else blocks, block, backend="triton")
    grad_out = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(seed), device=DEVICE)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    on_hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    assert warp_specialized_calls == ([block] if on_hopper else [])
    assert_output_and_gradients(None, grads, q, k, v, expand(keep, block, seq, seq), grad_out, tolerance=1e-2)
    return grads


@pytest.mark.parametrize("block, flag, value", [((64, 128), "LAGGED_DQ", True), ((64, 128), "LAGGED_DQ", False),
                                               ((64, 64), "ORDERED", True), ((64, 64), "ORDERED", False)])
def test_programs_of_zero_one_and_two_steps(poisoned, warp_specialized_calls, monkeypatch, block, flag, value):
    """A step per kept query block, MHA: key blocks kept by no query block, by exactly one (with 128-key blocks the
    program's only step has no dQ before it to compute, so its dQ is the one after the walk), by two, and by all,
    with dQ lagged and not; with 64-key blocks (paired programs: walks of unequal length, one of them empty) with
    the tiles in key order and longest walk first. Gradients against the fp64 oracle; rows past the kept blocks and
    unkept key blocks get exact zeros."""
    monkeypatch.setattr(backward_ws, flag, value)
    seq = 512
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, seq, 128, seed=5))
    keep = torch.zeros(1, 2, seq // block[0], seq // block[1], dtype=torch.bool, device=DEVICE)
    keep[..., 3, 0] = True          # key block 0: one step
    keep[..., [1, 6], 1] = True     # key block 1: two steps
    keep[..., :, 2] = True          # key block 2: every query block; key blocks 3 on: none
    grads = _gradients_meet_the_oracle(q, k, v, keep, block, seq, 6, warp_specialized_calls)
    assert not grads[1][:, :, 3 * block[1]:].any() and not grads[2][:, :, 3 * block[1]:].any()


@pytest.mark.parametrize("ordered", [False, True])
def test_gqa_paired_walks_far_apart(poisoned, warp_specialized_calls, monkeypatch, ordered):
    """GQA with 128x64 blocks (paired programs): masks per head whose two 64-key tiles' walks differ by far more than
    the ring's stages within a head, the other way round in a later head, with a head of empty lists between them, so
    each consumer's walk over the group's heads runs long stretches with the other's stopped or idle. (Interleaved
    head by head, a consumer could come to a stage a whole ring round ahead of its load: its phase wait passed too
    early and the kernel did not finish on the H200.) Gradients against the fp64 oracle."""
    monkeypatch.setattr(backward_ws, "ORDERED", ordered)
    block, seq = (128, 64), 512  # a kept key block: 8 steps of 64 rows, the ring 3 stages
    q, k, v = (t.requires_grad_() for t in qkv(1, 8, seq, 128, kv_heads=2, seed=9))
    nq, nk = seq // block[0], seq // block[1]
    keep = torch.zeros(1, 8, nq, nk, dtype=torch.bool, device=DEVICE)
    keep[0, 0, :, 0::2] = True           # head 0: even key blocks kept by every query block, odd ones by none
    keep[0, 2, :, 1::2] = True           # head 1 keeps nothing; head 2 the reverse of head 0
    keep[0, 3, 2, 0::2] = True           # head 3: one query block on even key blocks, two on odd ones
    keep[0, 3, [0, 3], 1::2] = True
    keep[0, 4:] = random_keep(1, 4, seq, seq, block, density=0.3)[0]  # kv head 1's heads
    grads = _gradients_meet_the_oracle(q, k, v, keep, block, seq, 4, warp_specialized_calls)
    assert not grads[0][:, 1].any(), "dq of the head that keeps nothing"


@pytest.mark.parametrize("kv_heads, ordered, dim", [(4, False, 128), (4, True, 128), (2, False, 128), (2, True, 128),
                                                    (4, True, 64), (2, True, 64)])
def test_paired_overlapping_lists(poisoned, warp_specialized_calls, monkeypatch, kv_heads, ordered, dim):
    """Paired programs (128x64 blocks) whose two tiles keep query blocks in common and others of their own: a head
    whose adjacent tiles keep the same query blocks (as under a causal or a 128-key-grained mask), one with some in
    common and rests of different lengths, one with nothing in common, one at random and one dense; MHA and GQA,
    tiles in key order (adjacent tiles pair) and longest walk first; head dim 128 and 64 (where only one consumer
    adds a common step's dQ, each in turn). Gradients against the fp64 oracle."""
    monkeypatch.setattr(backward_ws, "ORDERED", ordered)
    block, seq = (128, 64), 512
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, seq, dim, kv_heads=kv_heads, seed=13))
    nq, nk = seq // block[0], seq // block[1]
    keep = torch.zeros(1, 4, nq, nk, dtype=torch.bool, device=DEVICE)
    keep[0, 0] = torch.ones(nq, nk // 2, dtype=torch.bool, device=DEVICE).tril().repeat_interleave(2, dim=1)
    keep[0, 1, :3, 0] = keep[0, 1, 1:, 1] = True    # two in common, then one each
    keep[0, 1, 2, 2] = keep[0, 1, [0, 2, 3], 3] = True  # one in common, then none and two
    keep[0, 1, 0, 4] = keep[0, 1, 3, 5] = True      # none in common
    keep[0, 1, :, 7] = True                         # one tile of all, its pair of none
    keep[0, 2] = random_keep(1, 1, seq, seq, block, density=0.6)[0, 0]
    keep[0, 3] = True
    _gradients_meet_the_oracle(q, k, v, keep, block, seq, 4, warp_specialized_calls)


@pytest.mark.parametrize("common_first, summed", [(True, False), (False, False)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_paired_dq_variants(poisoned, warp_specialized_calls, monkeypatch, common_first, summed, kv_heads):
    """As test_paired_overlapping_lists (tiles longest walk first) with the paired programs' other dQ schedules,
    which the benchmarks compare: common steps first with each consumer adding its own keys' dQ
    (PAIRED_SUMMED_DQ off), and no common steps at all (PAIRED_COMMON_FIRST off)."""
    monkeypatch.setattr(backward_ws, "PAIRED_COMMON_FIRST", common_first)
    monkeypatch.setattr(backward_ws, "PAIRED_SUMMED_DQ", summed)
    test_paired_overlapping_lists(poisoned, warp_specialized_calls, monkeypatch, kv_heads, True, 128)
