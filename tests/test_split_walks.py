"""Split walks (forward.SPLIT_WALKS): where the only element tests are the causal diagonal and the sequence's end,
the kernels walk the blocks that need no test without one. Forward and backward against the fp64 oracle, with the
split on and off, tiles narrower than the blocks (so a block's tiles fall on both sides of the diagonal), ragged
lengths, an empty query block, and NaN-poisoned outputs."""

import pytest
import torch

from blockattn.kernels import backward, forward
from conftest import ON_GPU, expand, check_against_oracle, qkv, random_keep
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


def test_full_tiles_first_only_where_the_block_mask_is_the_only_test():
    """forward.full_tiles_first decides FULL_TILES_FIRST (and blockattn.api the lists to match): a gathered block
    mask with no token mask, kv_valid or packed batch beside it."""
    mask = torch.ones(1, dtype=torch.uint8)
    assert forward.full_tiles_first(mask, None, None, None)
    assert not forward.full_tiles_first(None, None, None, None)
    for extra in ({"token_mask": mask}, {"kv_valid": mask}, {"varlen": object()}):
        args = {**dict(token_mask=None, kv_valid=None, varlen=None), **extra}
        assert not forward.full_tiles_first(mask, **args), extra
