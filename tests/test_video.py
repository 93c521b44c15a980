"""blockattn.video: the tile order of a video grid, and video sparse attention against an fp64 oracle."""

import math
import random

import pytest
import torch

import blockattn
from blockattn.compat import fastvideo
from blockattn.video import TileLayout, video_sparse_attention
from conftest import DEVICE, ON_GPU, expand, make_generator, oracle, qkv

# A grid that no tile axis divides: every kind of cut tile (one, two or three axes short) occurs.
GRID, TILE = ((5, 9, 20), (4, 4, 8)) if ON_GPU else ((3, 5, 6), (2, 4, 4))
HEADS, KV_HEADS, DIM = (4, 2, 64) if ON_GPU else (2, 1, 32)


def test_tile_order_keeps_each_tiles_tokens_together_in_raster_order():
    layout = TileLayout(GRID, TILE, device=DEVICE)
    raster = torch.arange(math.prod(GRID), device=DEVICE)
    coords = torch.stack(torch.meshgrid(*(torch.arange(g, device=DEVICE) for g in GRID), indexing="ij"), -1)
    coords = coords.reshape(-1, 3)
    tiled = layout.to_tiles((raster + 1).float()[:, None], dim=0)[:, 0].long() - 1   # -1 marks padding
    tile_coords = coords // torch.tensor(TILE, device=DEVICE)
    for index in range(layout.num_tiles):
        slots = tiled[index * layout.tile_tokens:(index + 1) * layout.tile_tokens]
        count = int(layout.valid[index])
        real, padding = slots[:count], slots[count:]
        assert (real >= 0).all() and (padding == -1).all(), f"tile {index}: real tokens not first"
        assert torch.equal(real, real.sort().values), f"tile {index}: tokens not in raster order"
        assert len(torch.unique(tile_coords[real], dim=0)) == 1, f"tile {index} mixes tiles"
        a, b, c = torch.unravel_index(torch.tensor(index), layout.tiles_per_axis)
        assert tile_coords[real[0]].tolist() == [int(a), int(b), int(c)], "tiles are not in row-major tile order"
    assert int(layout.valid.sum()) == math.prod(GRID) and layout.valid.dtype == torch.int32


def test_tile_order_round_trips_and_is_differentiable():
    layout = TileLayout(GRID, TILE, device=DEVICE)
    x = torch.randn(2, math.prod(GRID), 3, 5, generator=make_generator(1), device=DEVICE).requires_grad_(True)
    tiled = layout.to_tiles(x, dim=1)
    assert tiled.shape == (2, layout.seq, 3, 5)
    assert torch.equal(layout.from_tiles(tiled, dim=1), x)
    weight = torch.randn(tiled.shape, generator=make_generator(2), device=DEVICE)
    (tiled * weight).sum().backward()
    assert torch.equal(x.grad, layout.from_tiles(weight, dim=1)), "to_tiles' gradient is not its inverse gather"


@pytest.mark.parametrize("args, error, message", [
    (dict(grid=(4, 4), tile=(2, 2, 2)), ValueError, "grid must be three positive ints"),
    (dict(grid=(4, 4, 4), tile=(2, 0, 2)), ValueError, "tile must be three positive ints"),
])
def test_tile_layout_rejects_bad_shapes(args, error, message):
    with pytest.raises(error, match=message):
        TileLayout(**args)


def test_tile_layout_names_a_wrong_length():
    layout = TileLayout(GRID, TILE)
    with pytest.raises(ValueError, match="raster-order tokens along dim 1"):
        layout.to_tiles(torch.zeros(1, math.prod(GRID) + 1, 4), dim=1)
    with pytest.raises(ValueError, match="tile-ordered slots"):
        layout.from_tiles(torch.zeros(1, 2, math.prod(GRID), 4))


def vsa_oracle(q, k, v, topk, tile, q_valid, kv_valid, gate=None, scale=None):
    """fp64 video sparse attention on tile-ordered bhsd tensors: (out, kept tiles [B, Hq, nq, nk]); keys past
    kv_valid in a tile never count, queries past q_valid count nowhere but in their own rows."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)

    def means(x, valid):
        b, h, s, d = x.shape
        real = (torch.arange(tile, device=x.device) < valid[:, None]).double()        # [n, tile]
        return (x.view(b, h, s // tile, tile, d) * real[:, :, None]).sum(3) / valid[:, None].double()
    scores = means(qd, q_valid) @ means(kd, kv_valid).transpose(-1, -2) * scale
    coarse = torch.softmax(scores, -1) @ means(vd, kv_valid)
    coarse = coarse.repeat_interleave(tile, 2)
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
    keep.scatter_(-1, scores.topk(topk, -1).indices, True)
    key_real = (torch.arange(k.shape[2], device=q.device) % tile) < kv_valid.repeat_interleave(tile)
    visible = expand(keep, (tile, tile), q.shape[2], k.shape[2]) & key_real
    fine, _ = oracle(q, k, v, visible, scale=scale)
    return fine + coarse * (1 if gate is None else gate.double()), keep


def tiled_inputs(dtype, seed=0, batch=1):
    layout = TileLayout(GRID, TILE, device=DEVICE)
    raster = qkv(batch, HEADS, math.prod(GRID), DIM, kv_heads=KV_HEADS, dtype=dtype, seed=seed)
    return layout, [layout.to_tiles(t) for t in raster]


def assert_matches_the_oracle(layout, q, k, v, topk, gate, backend, tensor_layout="bhsd", label=""):
    """video_sparse_attention on tile-ordered fp32 q, k, v [B, H, S, D] of a TileLayout (given to it in
    tensor_layout), with gate or None, against vsa_oracle: the kept tiles exactly the oracle's top-k, and out on the
    real query rows and every gradient (the gate's too) within 1e-5 relative."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)] + ([gate.clone().requires_grad_(True)]
                                                                    if gate is not None else [])
    given = [t.transpose(1, 2) for t in leaves] if tensor_layout == "bshd" else leaves
    out, blocks = video_sparse_attention(*given[:3], topk, layout.tile, q_valid=layout.valid, kv_valid=layout.valid,
                                         gate=given[3] if gate is not None else None, layout=tensor_layout,
                                         backend=backend, return_blocks=True)
    out = out.transpose(1, 2) if tensor_layout == "bshd" else out
    want_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    want, keep = vsa_oracle(*want_leaves[:3], topk, layout.tile_tokens, layout.valid, layout.valid,
                            gate=want_leaves[3] if gate is not None else None)
    assert torch.equal(blocks.mask.expand_as(keep), keep), f"the kept tiles differ from the oracle's top-k {label}"
    assert torch.isfinite(out).all(), label
    rows = layout.from_tiles(torch.arange(q.shape[2], device=DEVICE)[:, None], dim=0)[:, 0]  # the real query rows
    gap = (out.double() - want)[:, :, rows].abs().max() / want[:, :, rows].abs().max()
    assert gap < 1e-5, f"out off the oracle by {gap:.2e} {label}"
    grad_out = torch.randn(out.shape, generator=make_generator(5), device=DEVICE)
    grad_out[:, :, torch.isin(torch.arange(q.shape[2], device=DEVICE), rows, invert=True)] = 0  # padding rows unused
    (out * grad_out).sum().backward()
    (want * grad_out.double()).sum().backward()
    for name, got, ref in zip(("dq", "dk", "dv", "dgate"), leaves, want_leaves):
        gap = (got.grad.double() - ref.grad).abs().max() / ref.grad.abs().max()
        assert gap < 1e-5, f"{name} off the oracle by {gap:.2e} {label}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("gated", [False, True])
def test_video_sparse_attention_matches_the_fp64_oracle(backend, gated):
    """Cut tiles (q and kv), GQA, a gate: output and every gradient (gate included) against fp64, the kept tiles
    exactly the oracle's top-k."""
    layout, (q, k, v) = tiled_inputs(torch.float32, seed=3)
    gate = torch.rand(q.shape, generator=make_generator(4), device=DEVICE) if gated else None
    assert_matches_the_oracle(layout, q, k, v, 3, gate, backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", range(8))
def test_video_sparse_attention_on_random_grids(backend, seed):
    """Random grids and tiles (cut on any axis, or one token wide), top-k from 1 to every tile, GQA, Dv != D, a gate
    or none, bhsd or bshd, against the fp64 oracle."""
    rng = random.Random(seed)
    tile = tuple(rng.choice([1, 2, 3, 4]) for _ in range(3))
    grid = tuple(rng.randint(1, 3 * side) for side in tile)
    kv_heads, group, dim = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([16, 32])
    dim_v = rng.choice([dim, 16])
    layout = TileLayout(grid, tile, device=DEVICE)
    q, k, v = (layout.to_tiles(t) for t in qkv(1, kv_heads * group, math.prod(grid), dim, kv_heads=kv_heads,
                                                 dim_v=dim_v, dtype=torch.float32, seed=seed))
    gate = torch.rand(*q.shape[:3], dim_v, generator=make_generator(seed), device=DEVICE) if rng.random() < 0.5 \
        else None
    topk, tensor_layout = rng.randint(1, layout.num_tiles), rng.choice(["bhsd", "bshd"])
    label = f"(grid {grid}, tile {tile}, heads {kv_heads * group}/{kv_heads}, D {dim}/{dim_v}, topk {topk}, " \
            f"{tensor_layout}, gate {gate is not None})"
    assert_matches_the_oracle(layout, q, k, v, topk, gate, backend, tensor_layout, label)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bshd_layout_and_no_grad_give_the_same_output(pinned, backend):
    """The [B, S, H, D] entry equals the [B, H, S, D] one, and a call without autograd equals one with it (bitwise:
    the tiles are pinned, as the layouts' strides may tune apart)."""
    layout, (q, k, v) = tiled_inputs(torch.bfloat16, seed=6, batch=2)
    gate = torch.rand(q.shape, generator=make_generator(7), device=DEVICE).to(torch.bfloat16)
    kwargs = dict(q_valid=layout.valid, kv_valid=layout.valid, backend=backend)
    with torch.no_grad():
        inference = video_sparse_attention(q, k, v, 2, layout.tile_tokens, gate=gate, **kwargs)
    training = video_sparse_attention(*(t.clone().requires_grad_(True) for t in (q, k, v)), 2, layout.tile_tokens,
                                      gate=gate, **kwargs)
    bshd = video_sparse_attention(*(t.transpose(1, 2) for t in (q, k, v)), 2, layout.tile_tokens,
                                  gate=gate.transpose(1, 2), layout="bshd", **kwargs)
    assert inference.dtype == torch.bfloat16
    assert torch.equal(inference, training.detach()), "the no-grad call differs from the training one"
    assert torch.equal(bshd.transpose(1, 2), inference), "bshd differs from bhsd"


def test_an_empty_key_tile_is_never_attended():
    """A key tile with no real token (kv_valid 0), whatever its slots hold, is neither selected nor weighed by the
    coarse branch: the output equals that of the same call with the tile cut out of k and v."""
    layout, (q, k, v) = tiled_inputs(torch.float32, seed=8)
    tile, empty = layout.tile_tokens, 1
    valid = layout.valid.clone()
    valid[empty] = 0
    k, v = k.clone(), v.clone()
    k[:, :, empty * tile:(empty + 1) * tile], v[:, :, empty * tile:(empty + 1) * tile] = 1e4, -1e4
    kept_slots = torch.cat([torch.arange(0, empty * tile), torch.arange((empty + 1) * tile, k.shape[2])]).to(DEVICE)
    topk = layout.num_tiles - 2   # more tiles than the best few, so a wrongly scored empty tile would be among them
    got = video_sparse_attention(q, k, v, topk, tile, q_valid=layout.valid, kv_valid=valid, backend="torch")
    want = video_sparse_attention(q, k[:, :, kept_slots], v[:, :, kept_slots], topk, tile, q_valid=layout.valid,
                                  kv_valid=torch.cat([valid[:empty], valid[empty + 1:]]), backend="torch")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_fastvideo_entry_matches():
    """compat.fastvideo.video_sparse_attn (FastVideo's signature: variable_block_sizes for k, then for q, topk,
    block_size, compress_attn_weight) is video_sparse_attention."""
    layout, (q, k, v) = tiled_inputs(torch.float32, seed=9)
    q, k, v = (t[:, :KV_HEADS] for t in (q, k, v))   # FastVideo's entry takes equal head counts
    gate = torch.rand(q.shape, generator=make_generator(10), device=DEVICE)
    got = fastvideo.video_sparse_attn(q, k, v, layout.valid, layout.valid, 2, block_size=TILE,
                                      compress_attn_weight=gate)
    want = video_sparse_attention(q, k, v, 2, TILE, q_valid=layout.valid, kv_valid=layout.valid, gate=gate)
    assert torch.equal(got, want)
    got_bshd = fastvideo.video_sparse_attn_bshd(*(t.transpose(1, 2) for t in (q, k, v)), layout.valid, layout.valid,
                                                2, block_size=TILE, compress_attn_weight=gate.transpose(1, 2))
    assert torch.equal(got_bshd.transpose(1, 2), want)


def _call(**overrides):
    layout, (q, k, v) = tiled_inputs(torch.float32)
    args = dict(q=q, k=k, v=v, topk=2, tile_size=layout.tile_tokens, q_valid=layout.valid, kv_valid=layout.valid)
    args.update(overrides)
    return video_sparse_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("topk"),
                                  args.pop("tile_size"), **args)


NK = math.prod(math.ceil(g / t) for g, t in zip(GRID, TILE))


@pytest.mark.parametrize("overrides, error, message", [
    (dict(topk=0), ValueError, f"topk must be an int in 1..{NK}"),
    (dict(topk=NK + 1), ValueError, "topk must be an int"),
    (dict(tile_size=0), ValueError, "tile_size must be a positive int"),
    (dict(tile_size=(2, 2)), ValueError, "tile_size must be three positive ints"),
    (dict(tile_size=7), ValueError, "whole tiles of 7 tokens"),
    (dict(kv_valid=torch.ones(3, dtype=torch.int32)), ValueError, "kv_valid must be shaped"),
    (dict(q_valid=torch.ones(NK)), TypeError, "q_valid must be an integer tensor"),
    (dict(gate=torch.ones(1)), ValueError, "gate must be shaped like the output"),
    (dict(layout="thd"), ValueError, "layout must be"),
    (dict(k=torch.zeros(1, 3, 4)), ValueError, "k must be a 4-D tensor"),
])
def test_bad_arguments_are_named(overrides, error, message):
    for name in ("kv_valid", "q_valid", "gate", "k"):
        if isinstance(overrides.get(name), torch.Tensor):
            overrides[name] = overrides[name].to(DEVICE)
    with pytest.raises(error, match=message):
        _call(**overrides)


def test_public_names():
    assert blockattn.video.video_sparse_attention is video_sparse_attention
    assert blockattn.video.TileLayout is TileLayout


def test_video_sparse_attention_compiles_without_a_graph_break(pinned):
    """torch.compile(fullgraph=True) traces the whole scheme (pooling, top-k, lists, the kernels' op) and gives the
    eager result."""
    layout, (q, k, v) = tiled_inputs(torch.float32, seed=15)
    kwargs = dict(q_valid=layout.valid, kv_valid=layout.valid, backend="triton")
    torch._dynamo.reset()
    # aot_eager: the same PyTorch ops as eager (inductor may reorder the pooling's sums and so flip a near tie)
    compiled = torch.compile(video_sparse_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, 2, layout.tile_tokens, **kwargs),
                               video_sparse_attention(q, k, v, 2, layout.tile_tokens, **kwargs), rtol=1e-6, atol=1e-6)


def test_tile_means_in_head_chunks_equal_the_whole(monkeypatch):
    """The pooling zeroes padding slots a few heads at a time to bound its copy; one head per chunk gives the same
    means."""
    from blockattn import select
    layout, (q, k, v) = tiled_inputs(torch.bfloat16, seed=16)
    whole = select.block_means(q, layout.tile_tokens, layout.valid[None])
    monkeypatch.setattr(select, "_POOL_CHUNK_BYTES", 1)
    assert torch.equal(select.block_means(q, layout.tile_tokens, layout.valid[None]), whole)


def test_counts_of_full_tiles_change_nothing():
    """Without q_valid / kv_valid the pooling sums whole tiles without a mask: the same output as the counts of
    full tiles given, within fp32 summation order."""
    layout = TileLayout((4, 8, 8), (2, 4, 4), device=DEVICE)   # the tiles cut the grid evenly
    q, k, v = (layout.to_tiles(t) for t in qkv(1, HEADS, 256, DIM, kv_heads=KV_HEADS, seed=17))
    full = layout.valid
    assert (full == layout.tile_tokens).all()
    got = video_sparse_attention(q, k, v, 2, layout.tile_tokens, backend="torch")
    want = video_sparse_attention(q, k, v, 2, layout.tile_tokens, q_valid=full, kv_valid=full, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
