"""Mask patterns: each equals its token-level definition reduced to blocks, and attention over it is exact."""

import math

import pytest
import torch

import blockattn
from blockattn import masks
from conftest import DEVICE, check_against_oracle, qkv


def reduce_to_blocks(token_mask, block_size):
    """Any-reduction of a token mask [Sq, Sk] to blocks [1, 1, nq, nk] (zero padding past the ends)."""
    seq_q, seq_kv = token_mask.shape
    nq, nk = math.ceil(seq_q / block_size[0]), math.ceil(seq_kv / block_size[1])
    padded = torch.zeros(nq * block_size[0], nk * block_size[1], dtype=torch.bool, device=token_mask.device)
    padded[:seq_q, :seq_kv] = token_mask
    return padded.view(nq, block_size[0], nk, block_size[1]).any(3).any(1)[None, None]


def positions(seq_q, seq_kv):
    i = torch.arange(seq_q, device=DEVICE)[:, None]
    j = torch.arange(seq_kv, device=DEVICE)[None, :]
    return i, j


GEOMETRIES = [(1000, 1000, (128, 64)), (300, 777, (64, 32)), (97, 50, (8, 40)), (256, 256, (256, 256))]


@pytest.mark.parametrize("seq_q, seq_kv, block", GEOMETRIES)
def test_causal_is_the_reduced_token_rule(seq_q, seq_kv, block):
    i, j = positions(seq_q, seq_kv)
    assert torch.equal(masks.causal(seq_q, seq_kv, block, device=DEVICE).mask, reduce_to_blocks(j <= i, block))


@pytest.mark.parametrize("seq_q, seq_kv, block", GEOMETRIES)
@pytest.mark.parametrize("window", [1, 100, 333])
@pytest.mark.parametrize("one_sided", [False, True])
def test_sliding_window_is_the_reduced_token_rule(seq_q, seq_kv, block, window, one_sided):
    i, j = positions(seq_q, seq_kv)
    rule = ((i - j) >= 0) & ((i - j) < window) if one_sided else (i - j).abs() < window
    got = masks.sliding_window(seq_q, seq_kv, block, window, causal=one_sided, device=DEVICE).mask
    assert torch.equal(got, reduce_to_blocks(rule, block))


@pytest.mark.parametrize("seq_q, seq_kv, block", GEOMETRIES)
@pytest.mark.parametrize("tokens", [0, 1, 65, 200])
def test_global_tokens_is_the_reduced_token_rule(seq_q, seq_kv, block, tokens):
    i, j = positions(seq_q, seq_kv)
    got = masks.global_tokens(seq_q, seq_kv, block, tokens, device=DEVICE).mask
    assert torch.equal(got, reduce_to_blocks((i < tokens) | (j < tokens), block))


@pytest.mark.parametrize("grid, tile, window", [((4, 8, 8), (2, 4, 4), (3, 3, 3)), ((6, 4, 6), (2, 2, 3), (1, 3, 5)),
                                                 ((2, 2, 2), (1, 1, 1), (1, 1, 1))])
def test_sliding_tile_is_the_reduced_token_rule(grid, tile, window):
    counts = [g // t for g, t in zip(grid, tile)]
    tokens_per_tile = math.prod(tile)
    # token -> tile coordinates, tokens laid out tile by tile
    tile_index = torch.arange(math.prod(grid), device=DEVICE) // tokens_per_tile
    coords = torch.stack([tile_index // (counts[1] * counts[2]), (tile_index // counts[2]) % counts[1],
                          tile_index % counts[2]], -1)
    reach = torch.tensor([w // 2 for w in window], device=DEVICE)
    rule = ((coords[:, None] - coords[None, :]).abs() <= reach).all(-1)
    got = masks.sliding_tile(grid, tile, window, device=DEVICE)
    assert got.block_size == (tokens_per_tile, tokens_per_tile)
    assert torch.equal(got.mask, reduce_to_blocks(rule, got.block_size))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("grid, tile, window", [((5, 7, 6), (2, 4, 4), (3, 3, 3)), ((3, 5, 9), (2, 2, 4), (1, 3, 1))])
def test_sliding_tile_over_a_grid_with_cut_tiles_is_exact(backend, grid, tile, window):
    """A grid no tile axis divides: the tile-ordered tokens (TileLayout.to_tiles) attended over sliding_tile with
    kv_valid=TileLayout.valid give, back in raster order, exact attention under the token rule (raster tokens x and
    y see each other when their tiles' coordinates, x // tile per axis, differ by at most window // 2)."""
    from blockattn.video import TileLayout
    layout = TileLayout(grid, tile, device=DEVICE)
    blocks = masks.sliding_tile(grid, tile, window, device=DEVICE)
    assert blocks.seq_q == blocks.seq_kv == layout.seq
    q, k, v = qkv(1, 2, math.prod(grid), 16, dtype=torch.float32, seed=3)
    out, lse = blockattn.attention(*(layout.to_tiles(t) for t in (q, k, v)), blocks, kv_valid=layout.valid,
                                   return_lse=True, backend=backend)
    axes = [torch.arange(g, device=DEVICE) for g in grid]
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)       # raster order
    tile_coords = coords // torch.tensor(tile, device=DEVICE)
    reach = torch.tensor([w // 2 for w in window], device=DEVICE)
    rule = ((tile_coords[:, None] - tile_coords[None, :]).abs() <= reach).all(-1)
    check_against_oracle(layout.from_tiles(out), layout.from_tiles(lse[..., None])[..., 0], q, k, v, rule)


@pytest.mark.parametrize("grid, tile, window, name", [
    ((4, 8, 8.5), (2, 4, 4), (3, 3, 3), "grid"),      # was truncated to 8 before
    ((4, 8, 8), (2, 4), (3, 3, 3), "tile"),
    ((4, 8, 8), (2, 4, 4), (3, 0, 3), "window"),
])
def test_sliding_tile_names_an_argument_that_is_not_three_positive_ints(grid, tile, window, name):
    with pytest.raises(ValueError, match=f"{name} must be three positive ints"):
        masks.sliding_tile(grid, tile, window)


@pytest.mark.parametrize("seq_q, seq_kv, block", GEOMETRIES)
def test_from_token_mask_reduces_and_reports_the_residual(seq_q, seq_kv, block):
    i, j = positions(seq_q, seq_kv)
    rule = (i - j).abs() < min(seq_q, seq_kv) // 4
    blocks, residual = masks.from_token_mask(rule, block)
    assert torch.equal(blocks.mask, reduce_to_blocks(rule, block))
    assert residual, "a band cuts blocks, so the token mask is still needed"
    whole, residual = masks.from_token_mask(reduce_to_blocks(rule, block).repeat_interleave(block[0], -2)
                                            .repeat_interleave(block[1], -1)[0, 0, :seq_q, :seq_kv], block)
    assert not residual and torch.equal(whole.mask, blocks.mask)


def test_union_and_intersection():
    a = masks.causal(1000, 1000, (128, 64), device=DEVICE)
    b = masks.sliding_window(1000, 1000, (128, 64), 200, device=DEVICE)
    assert torch.equal(masks.union(a, b).mask, a.mask | b.mask)
    assert torch.equal(masks.intersection(a, b).mask, a.mask & b.mask)
    with pytest.raises(ValueError, match="geometry"):
        masks.union(a, masks.causal(1000, 1000, (128, 128), device=DEVICE))


def test_patterns_with_their_token_rule_are_exact_attention(geometry):
    """A pattern plus the matching token-level argument gives exactly attention under the token rule."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, dtype=torch.float32, seed=5)
    i, j = positions(seq, seq)
    window = 3 * g.block[1] // 2
    band = ((i - j) >= 0) & ((i - j) < window)
    blocks = masks.sliding_window(seq, seq, g.block, window, causal=True, device=DEVICE)
    for backend in ("torch", "triton"):
        out, lse = blockattn.attention(q, k, v, blocks, attn_mask=band, backend=backend, return_lse=True)
        check_against_oracle(out, lse, q, k, v, band)
