"""Split walks (forward.SPLIT_WALKS): where the only element tests are the causal diagonal and the sequence's end,
the kernels walk the blocks that need no test without one. Forward and backward against the fp64 oracle, with the
split on and off, tiles narrower than the blocks (so a block's tiles fall on both sides of the diagonal), ragged
lengths, an empty query block, and NaN-poisoned outputs."""

import pytest
import torch

from blockattn import BlockSparsity, api
from blockattn.kernels import backward, forward
from conftest import DEVICE, ON_GPU, check_against_oracle, expand, mostly_whole_kv_valid, qkv, random_keep, real_keys
from test_backward import assert_grads_close, grads, oracle_grads, upstream
import blockattn


@pytest.mark.parametrize("dq_mode", ["kernel", "atomic"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("split", [True, False])
def test_causal_walks_match_the_oracle(geometry, pinned, poisoned, monkeypatch, dq_mode, cross, split):
    monkeypatch.setattr(forward, "SPLIT_WALKS", split)
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", dq_mode)
    g = geometry
    seq_q = g.seqs[0]
    seq_kv = g.seqs[1] if cross else seq_q  # ragged either way; with cross, keys end before the queries do
    q, k, v = qkv(g.batch, g.heads, seq_q, g.dim, seq_kv=seq_kv, dtype=torch.float32, seed=31)
    keep = random_keep(g.batch, g.heads, seq_q, seq_kv, g.block, density=0.7)
    keep[..., 1, :] = False  # an empty query block
    visible = expand(keep, g.block, seq_q, seq_kv)
    out, lse = blockattn.attention(q, k, v, keep, g.block, is_causal=True, return_lse=True, backend="triton")
    check_against_oracle(out, lse, q, k, v, visible, is_causal=True)
    grad_out = upstream(out.shape, torch.float32)
    _, *got = grads(q, k, v, keep, g.block, grad_out=grad_out, is_causal=True, backend="triton")
    want = oracle_grads(q, k, v, visible, grad_out, is_causal=True)
    assert_grads_close(got, want, 1e-2, f"split={split} dq_mode={dq_mode}")
    rows = slice(g.block[0], 2 * g.block[0])
    assert (got[0][:, :, rows] == 0).all(), "the empty query block got a query gradient"



def test_split_flag_is_on_only_where_the_tests_are_the_diagonal_and_the_end(monkeypatch):
    """forward.split_walk decides the kernels' SPLIT_WALK: any token mask, gathered block mask or kv_valid needs
    per-element tests on every block, and a mask with neither a diagonal nor a ragged end has nothing to split."""
    mask = torch.ones(1, dtype=torch.uint8)
    assert forward.split_walk(True, True, None, None, None)
    assert forward.split_walk(False, False, None, None, None)
    assert not forward.split_walk(False, True, None, None, None)
    for extra in ({"token_mask": mask}, {"block_mask": mask}, {"kv_valid": mask}):
        args = {**dict(token_mask=None, block_mask=None, kv_valid=None), **extra}
        assert not forward.split_walk(True, False, **args), extra
    monkeypatch.setattr(forward, "SPLIT_WALKS", False)
    assert not forward.split_walk(True, False, None, None, None)


@pytest.mark.parametrize("dq_mode", ["kernel", "atomic"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gathered_masks_walk_their_full_tiles_untested(poisoned, monkeypatch, dq_mode, is_causal):
    """Blocks no tile nests in, large enough that many tiles lie wholly inside kept blocks: the kernels walk those
    tiles first and untested (forward.full_tiles_first), the rest tested, with queries and keys of different
    ragged lengths, an empty query block, and the causal diagonal crossing tiles."""
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", dq_mode)
    # the last tiles start in the last blocks (no next block to read on either side)
    seq_q, seq_kv, block = (1000, 900, (100, 120)) if ON_GPU else (250, 230, (90, 88))
    q, k, v = qkv(2, 2, seq_q, 32, seq_kv=seq_kv, dtype=torch.float32, seed=33)
    keep = random_keep(2, 2, seq_q, seq_kv, block, density=0.7, seed=5)
    keep[0, 1, 1] = False  # an empty query block
    visible = expand(keep, block, seq_q, seq_kv)
    out, lse = blockattn.attention(q, k, v, keep, block, is_causal=is_causal, return_lse=True, backend="triton")
    check_against_oracle(out, lse, q, k, v, visible, is_causal=is_causal)
    grad_out = upstream(out.shape, torch.float32)
    _, *got = grads(q, k, v, keep, block, grad_out=grad_out, is_causal=is_causal, backend="triton")
    want = oracle_grads(q, k, v, visible, grad_out, is_causal=is_causal)
    assert_grads_close(got, want, 1e-2, f"causal={is_causal} dq_mode={dq_mode}")


# kv_valid's lists: the blocks themselves (every tile tested), key tiles of 64 inside wider blocks (full tiles
# first, those with no real key left out), and the tile view of blocks no tile nests in (every tile tested)
KV_VALID_BLOCKS = {"blocks": (128, 64) if ON_GPU else (64, 32), "key tiles": (64, 256) if ON_GPU else (32, 128),
                   "gathered": (100, 100) if ON_GPU else (72, 88)}


@pytest.mark.parametrize("dq_mode", ["kernel", "atomic"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("lists", list(KV_VALID_BLOCKS))
def test_kv_valid_matches_the_oracle_on_each_kind_of_list(geometry, pinned, poisoned, monkeypatch, dq_mode, is_causal,
                                                          lists):
    """kv_valid (video tiles padded to the block) per batch row (kv_valid [B, nk] over a mask shared by the batch),
    with ragged lengths, an empty query block, a key block with no real key, a block with one real key, and tiles
    narrower than the blocks (pinned). Over key tiles split from the blocks, the kernels walk the kept tiles whose
    keys are all real first and untested and the rest tested; otherwise every tile is tested."""
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", dq_mode)
    g = geometry
    block = KV_VALID_BLOCKS[lists]
    seq_q, seq_kv = g.seqs
    q, k, v = qkv(2, g.heads, seq_q, g.dim, seq_kv=seq_kv, dtype=torch.float32, seed=34)
    keep = random_keep(1, g.heads, seq_q, seq_kv, block, density=0.7, seed=6)
    keep[0, 0, 1] = False  # an empty query block
    kv_valid = mostly_whole_kv_valid(2, keep.shape[-1], block[1], seed=7)
    kv_valid[1, 0] = 0
    kv_valid[0, -1] = 1  # one real key in a tile, the block's other tiles padding only
    visible = expand(keep, block, seq_q, seq_kv) & real_keys(kv_valid, block[1], seq_kv)[:, None, None, :]
    out, lse = blockattn.attention(q, k, v, keep, block, is_causal=is_causal, kv_valid=kv_valid, return_lse=True,
                                   backend="triton")
    check_against_oracle(out, lse, q, k, v, visible, is_causal=is_causal)
    grad_out = upstream(out.shape, torch.float32)
    _, *got = grads(q, k, v, keep, block, grad_out=grad_out, is_causal=is_causal, kv_valid=kv_valid,
                    backend="triton")
    want = oracle_grads(q, k, v, visible, grad_out, is_causal=is_causal)
    assert_grads_close(got, want, 1e-2, f"causal={is_causal} {lists} dq_mode={dq_mode}")


def test_full_tiles_first_where_some_tiles_need_tests_and_the_lists_can_say_which():
    """forward.full_tiles_first decides FULL_TILES_FIRST (and blockattn.api the lists to match): a gathered block
    mask without kv_valid, or kv_valid over key tiles split from its blocks, with no token mask or packed batch
    beside them."""
    mask = torch.ones(1, dtype=torch.uint8)
    assert forward.full_tiles_first(True, False, None, None, None)
    assert forward.full_tiles_first(False, True, None, mask, None)
    assert not forward.full_tiles_first(False, False, None, mask, None)  # kv_valid over the blocks themselves
    assert not forward.full_tiles_first(True, False, None, mask, None)  # kv_valid and a gathered mask
    assert not forward.full_tiles_first(False, False, None, None, None)
    assert not forward.full_tiles_first(False, True, None, None, None)
    for gathered, key_tiles, kv_valid in ((True, False, None), (False, True, mask)):
        assert not forward.full_tiles_first(gathered, key_tiles, mask, kv_valid, None)
        assert not forward.full_tiles_first(gathered, key_tiles, None, kv_valid, object())


@pytest.mark.parametrize("block, min_tile_kv, tile_kv", [((64, 256), 16, 64), ((64, 96), 16, 48), ((32, 128), 32, 64),
                                                         ((64, 80), 16, None), ((64, 64), 16, None),
                                                         ((32, 64), 32, None)])
def test_kv_valid_lists_split_wider_blocks_into_key_tiles(block, min_tile_kv, tile_kv):
    """api._kernel_inputs with kv_valid: key blocks wider than 64 are listed in key tiles of at most 64 that nest
    in them (the block halved while the halves stay multiples of the narrowest key tile), full tiles first; other
    blocks (None) keep the BlockSparsity's own lists, as every call without kv_valid does."""
    seq = 300
    sparsity = BlockSparsity.from_mask(random_keep(1, 2, seq, seq, block), block, seq, seq)
    kv_valid = torch.full((1, sparsity.num_blocks[1]), block[1], dtype=torch.int32, device=DEVICE)
    lists, gathered = api._kernel_inputs(sparsity, False, min_tile_kv, None, kv_valid, None)
    assert gathered is None
    if tile_kv is None:
        assert lists is sparsity
    else:
        assert tuple(lists.block_size) == (block[0], tile_kv)
        nk = -(-seq // tile_kv)
        listed = lists.kv_index.gather(-1, (lists.kv_count - 1).clamp_min(0).long().unsqueeze(-1))
        assert (listed >= nk).any(), "the ragged last key tile is listed as tested, after the full ones"
    assert api._kernel_inputs(sparsity, False, min_tile_kv)[0] is sparsity
