"""BlockSparsity: the lists it builds, their derived forms, and the lists it refuses."""

import math

import pytest
import torch

from blockattn import BlockSparsity
from blockattn.sparsity import build_lists
from conftest import DEVICE, make_generator, mostly_whole_kv_valid, random_keep, real_keys


def lists_by_hand(keep):
    """Per row, the kept column indices in ascending order, from Python loops."""
    flat = keep.reshape(-1, keep.shape[-1]).tolist()
    return [[c for c, kept in enumerate(row) if kept] for row in flat]


def test_kv_lists_are_ascending_kept_indices_padded_to_nk():
    keep = torch.rand(2, 3, 9, 18, generator=make_generator(0), device=DEVICE) < 0.3
    keep[0, 0, 4] = False
    blocks = BlockSparsity.from_mask(keep, (128, 64), 1100, 1100)
    assert blocks.kv_count.dtype == torch.int32 and blocks.kv_index.dtype == torch.int32
    assert blocks.kv_count.is_contiguous() and blocks.kv_index.is_contiguous()
    assert tuple(blocks.kv_index.shape) == (2, 3, 9, 18)
    counts = blocks.kv_count.reshape(-1).tolist()
    index = blocks.kv_index.reshape(-1, 18).tolist()
    for row, want in enumerate(lists_by_hand(keep)):
        assert counts[row] == len(want) and index[row][:counts[row]] == want
    assert torch.equal(blocks.mask, keep)


def test_mask_is_rebuilt_from_lists_given_by_hand():
    keep = random_keep(1, 2, 500, 700, (64, 32))
    count, index = build_lists(keep)
    blocks = BlockSparsity(count, index, (64, 32), 500, 700)
    assert torch.equal(blocks.mask, keep)


def test_q_lists_are_the_transpose():
    keep = torch.rand(1, 2, 7, 5, generator=make_generator(1), device=DEVICE) < 0.5
    blocks = BlockSparsity.from_mask(keep, (32, 64), 7 * 32 - 3, 5 * 64 - 10)
    count, index = blocks.q_lists()
    assert tuple(index.shape) == (1, 2, 5, 7)
    flat_index = index.reshape(-1, 7).tolist()
    for row, want in enumerate(lists_by_hand(keep.transpose(-1, -2))):
        assert count.reshape(-1)[row].item() == len(want) and flat_index[row][:len(want)] == want
    assert blocks.q_lists()[0] is count, "the q lists are cached"


def test_causal_drops_exactly_the_blocks_above_the_diagonal():
    seq_q, seq_kv, block = 300, 260, (64, 32)
    keep = torch.ones(1, 1, math.ceil(seq_q / 64), math.ceil(seq_kv / 32), dtype=torch.bool, device=DEVICE)
    causal = BlockSparsity.from_mask(keep, block, seq_q, seq_kv).causal().mask[0, 0]
    token = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=DEVICE).tril()
    want = torch.zeros_like(causal)
    for qb in range(causal.shape[0]):
        for kb in range(causal.shape[1]):
            want[qb, kb] = token[qb * 64:(qb + 1) * 64, kb * 32:(kb + 1) * 32].any()
    assert torch.equal(causal, want)


def test_tile_view_keeps_every_tile_that_overlaps_a_kept_block():
    seq_q, seq_kv, block, tile = 150, 130, (8, 40), (64, 32)
    keep = random_keep(2, 1, seq_q, seq_kv, block, density=0.2)
    tiled = BlockSparsity.from_mask(keep, block, seq_q, seq_kv).tiled(*tile).mask
    token = keep.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :seq_q, :seq_kv]
    nq, nk = math.ceil(seq_q / tile[0]), math.ceil(seq_kv / tile[1])
    padded = torch.zeros(*token.shape[:2], nq * tile[0], nk * tile[1], dtype=torch.bool, device=DEVICE)
    padded[..., :seq_q, :seq_kv] = token
    want = padded.view(*token.shape[:2], nq, tile[0], nk, tile[1]).any(-1).any(-2)
    assert torch.equal(tiled, want)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("with_kv_valid", [False, True])
@pytest.mark.parametrize("block, tile", [((100, 72), (64, 32)), ((8, 40), (64, 32)), ((72, 88), (64, 64)),
                                         ((64, 48), (64, 48)), ((64, 96), (64, 32))])
def test_full_first_lists_put_the_tiles_needing_no_test_first(block, tile, with_kv_valid, is_causal):
    """The kernels' full-first lists (kernels/README.md), over a tile view, the blocks themselves (64x48) or key
    tiles inside them (64x96 on 64x32): per row, the tiles whose every element is visible (inside the sequence and
    kept blocks, at or below the diagonal with is_causal, real keys only with kv_valid) come first, ascending, then
    the other kept tiles plus the tile count, ascending; the q lists the same with rows and columns swapped. With
    kv_valid, tiles holding no real key are left out, and a kv_valid per batch row gives lists per batch row over a
    mask shared by the batch."""
    seq_q, seq_kv = 250, 230
    keep = random_keep(1 if with_kv_valid else 2, 2, seq_q, seq_kv, block, density=0.85, seed=4)
    sparsity = BlockSparsity.from_mask(keep, block, seq_q, seq_kv)
    if is_causal:
        sparsity = sparsity.causal()
    nk_blocks = math.ceil(seq_kv / block[1])
    kv_valid = mostly_whole_kv_valid(2, nk_blocks, block[1], seed=5) if with_kv_valid else None
    if with_kv_valid:
        kv_valid[0, 1] = 1  # one real key: the block's first tile holds it, the others padding only
    lists = sparsity.full_first(*tile, is_causal, kv_valid)
    tile_keep = sparsity.tiled(*tile).mask.expand(2, -1, -1, -1)
    nq, nk = tile_keep.shape[-2:]
    if with_kv_valid:
        real = torch.zeros(2, nk * tile[1], dtype=torch.bool, device=DEVICE)
        real[:, :seq_kv] = real_keys(kv_valid, block[1], seq_kv)
        tile_keep = tile_keep & real.view(2, nk, tile[1]).any(-1)[:, None, None, :]
    token = keep.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :seq_q, :seq_kv]
    if is_causal:
        token = token & torch.ones(seq_q, seq_kv, dtype=torch.bool, device=DEVICE).tril()
    if with_kv_valid:
        token = token & real_keys(kv_valid, block[1], seq_kv)[:, None, None, :]
    padded = torch.zeros(2, 2, nq * tile[0], nk * tile[1], dtype=torch.bool, device=DEVICE)
    padded[..., :seq_q, :seq_kv] = token
    full = padded.view(2, 2, nq, tile[0], nk, tile[1]).all(-1).all(-2)
    assert full.any() and (tile_keep & ~full).any(), "the case should hold both kinds of tile"

    def want_rows(kept, whole, columns):
        return [[c for c in range(columns) if kept[r][c] and whole[r][c]]
                + [c + columns for c in range(columns) if kept[r][c] and not whole[r][c]]
                for r in range(len(kept))]

    for (count, index), kept, whole in (((lists.kv_count, lists.kv_index), tile_keep, full),
                                        (lists.q_lists(), tile_keep.transpose(-1, -2), full.transpose(-1, -2))):
        assert count.shape[0] == 2
        columns = kept.shape[-1]
        got = [row[:n] for row, n in zip(index.reshape(-1, index.shape[-1]).tolist(), count.reshape(-1).tolist())]
        want = want_rows(kept.reshape(-1, columns).tolist(), whole.reshape(-1, columns).tolist(), columns)
        assert got == want
    assert torch.equal(lists.mask, tile_keep)


def test_density():
    keep = torch.zeros(1, 1, 4, 5, dtype=torch.bool, device=DEVICE)
    keep[0, 0, :, :2] = True
    assert BlockSparsity.from_mask(keep, (16, 16), 64, 80).density() == pytest.approx(0.4)


# ---------------------------------------------------------------- refusals

def good_lists():
    keep = random_keep(2, 4, 1000, 1000, (128, 64))
    return build_lists(keep)


@pytest.mark.parametrize("label, change, message", [
    ("strided count", lambda c, i: (c.transpose(-1, -2).contiguous().transpose(-1, -2), i), "kv_count"),
    ("strided index", lambda c, i: (c, i.transpose(-1, -2).contiguous().transpose(-1, -2)), "kv_index"),
    ("unpadded index", lambda c, i: (c, i[..., :-1].contiguous()), "kv_index"),
    ("int64 count", lambda c, i: (c.long(), i), "kv_count"),
    ("int8 index", lambda c, i: (c, i.to(torch.int8)), "kv_index"),
    ("3-D index", lambda c, i: (c, i[0]), "kv_index"),
    ("short count", lambda c, i: (c[..., :-1].contiguous(), i), "kv_count"),
    ("count without index", lambda c, i: (c, None), "kv_index"),
    ("index without count", lambda c, i: (None, i), "kv_count"),
])
def test_lists_a_kernel_cannot_read_are_refused(label, change, message):
    count, index = change(*good_lists())
    with pytest.raises(ValueError, match=message):
        BlockSparsity(count, index, (128, 64), 1000, 1000)


def test_missing_block_size_is_refused():
    count, index = good_lists()
    with pytest.raises(ValueError, match="block_size"):
        BlockSparsity(count, index, None, 1000, 1000)


@pytest.mark.parametrize("block_size, error", [((0, 64), ValueError), ((128,), TypeError), ((128.0, 64), TypeError)])
def test_bad_block_sizes_are_refused(block_size, error):
    with pytest.raises(error, match="block_size"):
        BlockSparsity.from_mask(torch.ones(8, 16, dtype=torch.bool), block_size, 1000, 1000)


def test_mask_of_the_wrong_shape_names_the_expected_shape():
    with pytest.raises(ValueError, match=r"nq=8, nk=16"):
        BlockSparsity.from_mask(torch.ones(8, 15, dtype=torch.bool), (128, 64), 1000, 1000)


def test_float_mask_is_refused():
    with pytest.raises(TypeError, match="bool, int8 or uint8"):
        BlockSparsity.from_mask(torch.ones(8, 16), (128, 64), 1000, 1000)


def test_inductor_graphs_warming_up_is_read_from_their_manager(monkeypatch):
    """compiling_or_capturing says yes while Inductor's CUDA graph trees warm up on this thread (their manager in
    warm-up, the current stream its own), and no once the manager records or executes, on another stream, for
    another device, before torch.compile imported them, or where their private state is laid out otherwise (on any
    machine: the trees' module, manager and streams are stood in for)."""
    import sys
    import types
    from blockattn import sparsity
    own, other = object(), object()
    manager = types.SimpleNamespace(in_warmup=True, stream=own)
    containers = {0: types.SimpleNamespace(tree_manager=manager)}
    trees = types.SimpleNamespace(local=types.SimpleNamespace(tree_manager_containers=containers),
                                  get_obj=lambda local, name: getattr(local, name))
    current = [own]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert sparsity.compiling_or_capturing(cuda0)
    assert not sparsity.compiling_or_capturing(cuda1)  # no manager there
    assert not sparsity.compiling_or_capturing(torch.device("cpu"))
    current[0] = other
    assert not sparsity.compiling_or_capturing(cuda0)  # the warm-up runs on the manager's stream only
    current[0] = own
    manager.in_warmup = False
    assert not sparsity.compiling_or_capturing(cuda0)  # recording (a capture, asked apart) or executing
    manager.in_warmup = True
    del manager.stream
    assert not sparsity.compiling_or_capturing(cuda0)  # laid out otherwise: as if absent
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    assert not sparsity.compiling_or_capturing(cuda0)
