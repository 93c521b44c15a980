"""The warp-specialized Gluon forward (kernels/forward_ws.py): which calls it takes, that it compiles for sm_90
with its register split and within shared memory (on any machine), and on a GPU its output, LSE and the backward
through them against the fp64 oracle. On the CPU the same cases must take the Triton forward (the interpreter
cannot run Gluon) and meet the same oracle."""


import itertools
import math
import re

import numpy as np
import pytest
import torch
import blockattn
from blockattn.kernels import bounds, forward, forward_ws
from conftest import (DECLINED_TENSORS, DEVICE, ON_GPU, aligned_scores, assert_output_and_gradients,
                      check_against_oracle, declined_tensors, expand, interpreter_share, meta, output_and_lse_loss, qkv,
                      random_keep, row_bounds, set_grid, sm90_report, stack_bytes)


QUALIFYING = dict(block_q=128, block_kv=128, is_causal=False, token_mask=None, block_mask=None, kv_valid=None,
                  varlen=None, quant=None, min_work=0)


def _qualifies(q=None, k=None, v=None, **changes):
    q = q if q is not None else meta(2, 4, 1000, 128)
    k = k if k is not None else meta(2, 2, 1024, 128)
    v = v if v is not None else k
    args = {**QUALIFYING, **changes}
    return forward_ws.qualifies(q, k, v, args.pop("block_q"), args.pop("block_kv"), **args)


def _plan(sub_n: int, causal: bool = False, dim: int = 128) -> forward_ws.Plan:
    """The plan of a qualifying call at head dim `dim` under the module's tables as they stand (TILE_KEYS,
    OVERLAPPED; fixed offsets at FIXED_OFFSET_DIMS but for the causal walk with the overlap, as
    test_fixed_offsets_in_the_plan pins down)."""
    overlap = forward_ws.OVERLAPPED[dim]
    return forward_ws.Plan(sub_n, causal, forward_ws.TILE_KEYS[dim], overlap,
                           dim in forward_ws.FIXED_OFFSET_DIMS and not (causal and overlap))


def _plan_for_block(block_kv: int, causal: bool = False, dim: int = 128) -> forward_ws.Plan:
    """_plan for a call with key blocks of block_kv keys under the module's tables as they stand: its blocks walked as
    64-key ones at SPLIT_KEY_BLOCK_DIMS where not causal and not split between consumer pairs (KEY_SPLIT_DIMS), in
    sub tiles of the largest of the tile, 128 and 64 that divides the block it walks."""
    if dim in (forward_ws.KEY_SPLIT_CAUSAL_DIMS if causal else forward_ws.KEY_SPLIT_DIMS):
        # four consumers: 128-key tiles in 64-key steps, over the mask's own blocks
        sub_n = next(n for n in (forward_ws.KEY_SPLIT_TILE_N, 128, 64) if block_kv % n == 0)
        return forward_ws.Plan(sub_n, causal, forward_ws.KEY_SPLIT_TILE_N, False,
                               dim in forward_ws.FIXED_OFFSET_DIMS, 1, 2)
    parts = block_kv // 64 if dim in forward_ws.SPLIT_KEY_BLOCK_DIMS and not causal else 1
    sub_n = next(n for n in (forward_ws.TILE_KEYS[dim], 128, 64) if block_kv // parts % n == 0)
    return _plan(sub_n, causal, dim)._replace(block_parts=parts)


def test_qualifying_calls_and_their_tiles():
    assert _qualifies() == _plan(128)
    assert _qualifies(block_kv=64) == _plan(64)
    assert _qualifies(block_q=256, block_kv=256) == _plan(128)
    assert _qualifies(is_causal=True) == _plan(128, causal=True)
    assert _qualifies(block_kv=64, is_causal=True) == _plan(64, causal=True)
    wide = meta(2, 2, 1152, 128)
    assert _qualifies(k=wide, block_kv=192) == _plan(64)  # 128-key tiles do not nest in 192
    assert _qualifies(q=meta(2, 4, 1000, 128, dtype=torch.float16), k=meta(2, 2, 1024, 128, dtype=torch.float16))
    # bshd storage seen as bhsd: strides (S*H*D, D, H*D, 1), all 16-byte multiples
    bshd = meta(2, 1024, 4, 128).transpose(1, 2)
    assert _qualifies(q=bshd, k=bshd) == _plan(128)


def test_split_key_blocks_in_the_plan(monkeypatch):
    """SPLIT_KEY_BLOCK_DIMS: at its head dims the kernel walks each key block as block_kv / 64 blocks of 64 keys (the
    sub tiles follow those) where not causal; elsewhere as listed."""
    def dims(d):
        return dict(q=meta(2, 4, 1000, d), k=meta(2, 2, 8192, d), v=meta(2, 2, 8192, d))
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", ())  # (two consumers' tiles: test_key_split_in_the_plan)
    monkeypatch.setattr(forward_ws, "SPLIT_KEY_BLOCK_DIMS", ())
    assert _qualifies(**dims(64)) == _plan(128, dim=64)  # (256-key tiles of two 128-key blocks)
    monkeypatch.setattr(forward_ws, "SPLIT_KEY_BLOCK_DIMS", (64, ))
    assert _qualifies(**dims(64)) == _plan(64, dim=64)._replace(block_parts=2)
    assert _qualifies(**dims(64), block_q=256, block_kv=256) == _plan(64, dim=64)._replace(block_parts=4)
    assert _qualifies(**dims(64), block_kv=64) == _plan(64, dim=64)
    assert _qualifies(**dims(64), is_causal=True) == _plan(128, causal=True, dim=64)
    assert _qualifies(**dims(128)) == _plan(128)


@pytest.mark.parametrize("broadcast", [False, True])
def test_split_key_blocks_lists_equal_the_finer_masks(broadcast):
    """split_key_blocks of a mask's lists at (128, 128) or (128, 192) lists, entry for entry up to each count, the
    keys that mask's lists at (128, 64) list (the mask with each key block repeated), empty rows included; a mask
    shared across batch and heads keeps its size-1 dims."""
    for block_kv in (128, 192):
        parts = block_kv // 64
        keep = random_keep(1 if broadcast else 2, 1 if broadcast else 3, 512, 1536, (128, block_kv), density=0.4)
        keep[..., 2, :] = False
        coarse = blockattn.BlockSparsity.from_mask(keep, (128, block_kv), 512, 1536)
        fine = blockattn.BlockSparsity.from_mask(keep.repeat_interleave(parts, dim=-1), (128, 64), 512, 1536)
        count, index = forward_ws.split_key_blocks(coarse.kv_count, coarse.kv_index, parts)
        assert count.shape == fine.kv_count.shape and index.shape[:-1] == fine.kv_index.shape[:-1]
        assert torch.equal(count, fine.kv_count) and int(count[..., 2].abs().sum()) == 0
        for row in itertools.product(*map(range, count.shape)):
            n = int(count[row])
            assert torch.equal(index[row][:n], fine.kv_index[row][:n])


def test_fixed_offsets_in_the_plan(monkeypatch):
    """FIXED_OFFSET_DIMS picks the head dims whose walks may keep fixed offsets, except the causal walk with the
    overlap inside a warpgroup (D=128's), whose consumers spill under Triton 3.6 with them."""
    def dims(d):
        return dict(q=meta(2, 4, 1000, d), k=meta(2, 2, 8192, d), v=meta(2, 2, 8192, d))
    monkeypatch.setattr(forward_ws, "FIXED_OFFSET_DIMS", (64, 128))
    assert _qualifies(**dims(128)).fixed_offsets
    assert not _qualifies(**dims(128), is_causal=True).fixed_offsets
    assert _qualifies(**dims(64), is_causal=True).fixed_offsets  # (64: no overlap)
    monkeypatch.setattr(forward_ws, "FIXED_OFFSET_DIMS", ())
    assert not _qualifies(**dims(64)).fixed_offsets


@pytest.mark.parametrize("causal", [False, True])
def test_rise_checked_or_bounded_as_the_tables_say(causal, monkeypatch):
    """A launch with fixed offsets checks the rise after the walk, and takes no key norms (no pass over k), for the
    dtypes in RISE_CHECKED_DTYPES at the head dims in RISE_CHECKED_DIMS, or RISE_CHECKED_CAUSAL_DIMS under is_causal;
    else the key norms' bound keeps the offsets. D=64, whose causal walk keeps fixed offsets too."""
    monkeypatch.setattr(forward_ws, "FIXED_OFFSET_DIMS", (64, 128))
    monkeypatch.setattr(forward_ws, "RISE_CHECKED_DTYPES", (torch.bfloat16, ))
    chosen = forward_ws._plan(128, 64, causal)
    assert chosen.fixed_offsets

    def checked(dtype):
        settings = forward_ws._settings(chosen, dtype, 64)
        takes_norms = "KEY_NORMS" not in forward_ws._unused_arguments(chosen, settings)
        assert takes_norms != settings["CHECK_RISE"], settings
        return settings["CHECK_RISE"]
    for plain, causal_dims in [((64, ), ()), ((), (64, )), ((64, 128), (64, 128)), ((), ())]:
        monkeypatch.setattr(forward_ws, "RISE_CHECKED_DIMS", plain)
        monkeypatch.setattr(forward_ws, "RISE_CHECKED_CAUSAL_DIMS", causal_dims)
        assert checked(torch.bfloat16) == (64 in (causal_dims if causal else plain)), (plain, causal_dims)
        assert not checked(torch.float16)  # (fp16 P would overflow past 65504: always the bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_host_descriptors_take_gluons_layout_for_their_box(dtype):
    """host_descriptor's box and shared-memory layout (cached per box and dtype) are what Gluon picks for that box,
    whatever was asked before: boxes of 64 and 128 rows, the backward's 64-column dQ box, each dtype."""
    from triton.experimental.gluon import language as gl
    t = torch.zeros(2, 3, 256, 128, dtype=dtype)
    for rows, columns in ((64, None), (128, None), (64, 64), (64, None)):
        desc = forward_ws.host_descriptor(t, rows, columns)
        box = [1, 1, rows, columns or 128]
        assert desc.block_shape == box and desc.shape == [2, 3, 256, 128] and desc.strides == list(t.stride())
        assert desc.layout == gl.NVMMASharedLayout.get_default_for(box, forward_ws._GL_DTYPES[dtype][1])
        assert f"{forward_ws._GL_DTYPES[dtype][0]}[{','.join(map(str, box))}],{desc.layout!r}>" in \
            forward_ws.descriptor_signature(dtype, rows, columns or 128)


def test_head_dims_it_takes(monkeypatch):
    """D=64 and D=128 (q, k and v alike) take the kernel; a value dim unlike the key's never does, nor a head dim
    left out of HEAD_DIMS or one without a ring depth in STAGES."""
    def dims(d, dv):
        return dict(q=meta(2, 4, 1000, d), k=meta(2, 2, 1024, d), v=meta(2, 2, 1024, dv))
    monkeypatch.setattr(forward_ws, "MIN_KEYS", {})  # (1024 keys: short of D=64's minimum, tested below)
    for setting in ("KEY_SPLIT_DIMS", "KEY_SPLIT_CAUSAL_DIMS"):  # (two consumers' tiles: test_key_split_in_the_plan)
        monkeypatch.setattr(forward_ws, setting, ())
    # at D=64 256-key tiles without the overlap, over 64-key blocks (SPLIT_KEY_BLOCK_DIMS) in 64-key boxes
    assert _qualifies(**dims(64, 64)) == forward_ws.Plan(64, tile_n=256, overlap=False, fixed_offsets=True,
                                                       block_parts=2)
    assert _qualifies(**dims(64, 64), block_kv=64, is_causal=True) == forward_ws.Plan(64, True, 256, False, True)
    assert _qualifies(**dims(64, 64), block_q=256, block_kv=256) == forward_ws.Plan(64, tile_n=256, overlap=False,
                                                                                     fixed_offsets=True,
                                                                                     block_parts=4)
    assert _qualifies(**dims(64, 128)) is None
    assert _qualifies(**dims(128, 64)) is None
    assert _qualifies(**dims(96, 96)) is None
    monkeypatch.setattr(forward_ws, "HEAD_DIMS", (128,))
    assert _qualifies(**dims(64, 64)) is None
    assert _qualifies(**dims(128, 128)) == _plan(128)
    monkeypatch.setattr(forward_ws, "HEAD_DIMS", (96, 128))  # a head dim with no ring depth set never launches
    assert _qualifies(**dims(96, 96)) is None


def test_at_head_dim_64_short_key_sequences_go_to_the_triton_forward():
    """At D=64 a call takes the kernel from MIN_KEYS[64] keys on (8192), any query length; D=128 at any length."""
    def dims(d, seq_kv):
        return dict(q=meta(2, 4, 1000, d), k=meta(2, 2, seq_kv, d))
    assert forward_ws.MIN_KEYS == {64: 8192}
    assert _qualifies(**dims(64, 8192)) == _plan_for_block(128, dim=64)
    assert _qualifies(**dims(64, 8192), block_kv=64) == _plan_for_block(64, dim=64)
    assert _qualifies(**dims(64, 8064)) is None
    assert _qualifies(**dims(64, 4096), block_kv=64, is_causal=True) is None
    assert _qualifies(**dims(128, 128)) == _plan(128)


@pytest.mark.parametrize("change", [
    dict(token_mask=object()), dict(block_mask=object()), dict(kv_valid=object()),
    dict(varlen=object()), dict(quant="int8"), dict(block_q=64), dict(block_kv=32), dict(block_kv=96),
    dict(min_work=2 * 4 * 1000 * 1024 * 128 + 1)])
def test_calls_it_declines(change):
    assert _qualifies(**change) is None, change


@pytest.mark.parametrize("tensors", DECLINED_TENSORS)
def test_tensors_it_declines(tensors):
    q, k, v = declined_tensors(tensors)
    assert _qualifies(q=q, k=k, v=v) is None, tensors


def test_switched_off_or_off_hopper_it_declines(monkeypatch):
    q = torch.empty(1, 2, 256, 128, device=DEVICE, dtype=torch.bfloat16)
    args = {**QUALIFYING}
    block_q, block_kv = args.pop("block_q"), args.pop("block_kv")
    on_hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    assert (forward_ws.plan(q, q, q, block_q, block_kv, **args) is not None) == on_hopper
    dispatch = (q, q, q, block_q, block_kv, False, None, None, None, None, None)
    assert (forward.warp_specialized_plan(*dispatch) is not None) == on_hopper
    real_version = forward._triton_version
    monkeypatch.setattr(forward, "_triton_version", lambda: (3, 5))  # an older Gluon: not even imported
    assert forward.warp_specialized_plan(*dispatch) is None
    monkeypatch.setattr(forward, "_triton_version", real_version)
    monkeypatch.setattr(forward_ws, "ENABLED", False)
    assert forward_ws.plan(q, q, q, block_q, block_kv, **args) is None
    assert forward.warp_specialized_plan(*dispatch) is None


# Bytes of stack a thread may have (stack_bytes). Measured for the variants below (forty-ninth session): none under
# Triton 3.9 (the CPU tests'); under Triton 3.6 (the H200's) 8 at D=128 with 64-key blocks, bf16 and fixed offsets,
# where ptxas stores two of the prologue's values once and reloads them as each partition starts, outside every loop
# (nvdisasm), since the cold walk again (_walk_again, a call of its own) came in. The budget catches any real spill.
SPILL_BUDGET = 16
# Stack under the persistent grid (PERSISTENT_DIMS): ptxas keeps the items' loop values on it, outside the hot loops
# (nvdisasm, fifty-first session: the four hot loops hold no local load or store): up to 40 bytes at D=128 with
# 64-key blocks (fixed offsets, or out through the TMA unit), none at D=64.
SPILL_BUDGET_PERSISTENT = 48
# And with the items claimed from a counter (CLAIMED_DIMS, fifty-second session): up to 88 bytes under Triton 3.9 (D=64
# causal with 128x128 blocks: 24 stores before the items' loop, 23 loads an item), 24 under 3.6; the hot loops hold
# no local load or store but for one load a tile in 3.9's tested causal loop at D=128 (the tiles on the diagonal).
SPILL_BUDGET_CLAIMED = 96
# And with four consumers at 120 registers (KEY_SPLIT_DIMS, sixtieth session): 48-80 bytes under Triton 3.6, whose hot
# loops hold no local load or store; 160-200 under 3.9 (200: the items in turns), whose loops reload one value a tile.
SPILL_BUDGET_KEY_SPLIT = 256


@pytest.mark.parametrize("blocks, dtype, causal, dim, emulate, o_through_tma, fixed", [
    ((128, 128), "bfloat16", False, 128, False, None, None), ((128, 64), "float16", False, 128, False, None, None),
    ((128, 64), "bfloat16", True, 128, False, None, None), ((128, 128), "bfloat16", False, 64, False, None, None),
    ((128, 64), "float16", True, 64, True, None, None), ((128, 128), "bfloat16", False, 128, True, None, None),
    ((128, 64), "bfloat16", True, 128, False, True, None), ((128, 128), "float16", False, 64, False, True, None),
    ((128, 64), "bfloat16", False, 128, False, None, True), ((128, 128), "float16", False, 64, False, None, False)])
def test_compiles_for_sm90_with_its_register_split(blocks, dtype, causal, dim, emulate, o_through_tma, fixed):
    """The launch's settings, and out through the TMA unit and fixed offsets either way (O_THROUGH_TMA,
    FIXED_OFFSET_DIMS): the register split, wgmma and TMA in the PTX, shared memory within Hopper's, and a stack
    within SPILL_BUDGET, or SPILL_BUDGET_CLAIMED where the launch claims its items (_launch_spill_budget)."""
    _assert_compiles(f"forward_ws.compile_sm90({blocks[0]}, {blocks[1]}, torch.{dtype}, causal={causal}, dim={dim}, "
                     f"emulate_exp2={emulate}, o_through_tma={o_through_tma}, fixed_offsets={fixed})",
                     _launch_spill_budget(blocks, causal, dim), forward_ws._plan(blocks[1], dim, causal))


def _launch_spill_budget(blocks: tuple, causal: bool, dim: int) -> int:
    """The stack a launch's kernel may have at these blocks: SPILL_BUDGET_KEY_SPLIT where four consumers run
    (KEY_SPLIT_DIMS), SPILL_BUDGET_CLAIMED where it claims its items (forward_ws._claims: CLAIMED_DIMS,
    CLAIMED_CAUSAL_DIMS), else SPILL_BUDGET."""
    if forward_ws._plan(blocks[1], dim, causal).key_split > 1:
        return SPILL_BUDGET_KEY_SPLIT
    return SPILL_BUDGET_CLAIMED if forward_ws._claims(dim, causal) else SPILL_BUDGET


def _assert_compiles(call: str, spill_budget: int = SPILL_BUDGET, plan=None) -> None:
    """call (a forward_ws.compile_sm90 call, as sm90_report takes it) compiles with the register split (plan's, a
    forward_ws.Plan; None: two consumers'), wgmma and TMA in the PTX, shared memory within Hopper's, and at most
    spill_budget bytes of stack."""
    report = sm90_report(call)
    consumer_regs = forward_ws.CONSUMER_REGS if plan is None else plan.consumer_regs()
    assert {consumer_regs, forward_ws.LOADER_REGS} <= set(report["registers"]), report
    assert report["wgmma"] and report["tma"], report
    assert report["shared"] <= 227 * 1024, report
    assert "LOCAL:0" in report["usage"] and stack_bytes(report) <= spill_budget, f"registers spill: {report['usage']}"


def test_key_split_in_the_plan(monkeypatch):
    """KEY_SPLIT_DIMS: at its head dims, where not causal, four consumers (key_split 2) walk 128-key tiles without the
    overlap, with their own ring depth, registers and launch bound; causal calls (unless at KEY_SPLIT_CAUSAL_DIMS)
    and other head dims keep two."""
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", (64, ))
    split = forward_ws._plan(128, 64, False)
    assert (split.key_split, split.tile_n, split.overlap) == (2, forward_ws.KEY_SPLIT_TILE_N, False)
    assert split.stages(64) == forward_ws.KEY_SPLIT_STAGES and split.consumer_regs() == forward_ws.KEY_SPLIT_REGS
    assert split.launch_options() == dict(num_warps=4, maxnreg=forward_ws.KEY_SPLIT_MAX_REGS)
    # the mask's own key blocks in 128-key boxes, even at SPLIT_KEY_BLOCK_DIMS (as D=64 is by default)
    monkeypatch.setattr(forward_ws, "SPLIT_KEY_BLOCK_DIMS", (64, ))
    for block_kv in (128, 256):
        whole = forward_ws._plan(block_kv, 64, False)
        assert (whole.block_parts, whole.sub_n) == (1, 128)
    # 20 warps (the loader's padded to a warpgroup) within the register file at launch and after setmaxnreg
    assert 20 * 32 * forward_ws.KEY_SPLIT_MAX_REGS <= 65536
    assert 4 * 128 * forward_ws.KEY_SPLIT_REGS + 128 * forward_ws.LOADER_REGS <= 65536
    for plan in (forward_ws._plan(128, 64, True), forward_ws._plan(128, 128, False)):
        assert plan.key_split == 1 and plan.launch_options() is forward_ws.LAUNCH_OPTIONS
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", ())
    assert forward_ws._plan(128, 64, False).key_split == 1
    # under is_causal, KEY_SPLIT_CAUSAL_DIMS alone decides
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_CAUSAL_DIMS", (64, ))
    causal = forward_ws._plan(64, 64, True)
    assert (causal.key_split, causal.causal, causal.tile_n, causal.sub_n, causal.overlap) == (2, True, 128, 64, False)
    assert forward_ws._plan(128, 64, False).key_split == 1 and forward_ws._plan(128, 128, True).key_split == 1


def test_two_q_buffers_where_the_table_says(monkeypatch):
    """Q_BUFFER_DIMS: two Q buffers (the kernel's Q_BUFFERS) only on a persistent grid (claimed or in turns), at its
    head dims, with one consumer pair; a program a tile, the key split and other head dims keep one."""
    monkeypatch.setattr(forward_ws, "Q_BUFFER_DIMS", (64, ))
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", ())
    plan = forward_ws._plan(128, 64, False)
    assert forward_ws._settings(plan, torch.bfloat16, 64, claimed=True)["Q_BUFFERS"] == 2
    assert forward_ws._settings(plan, torch.bfloat16, 64, claimed=False)["Q_BUFFERS"] == 1  # (PERSISTENT_DIMS off)
    monkeypatch.setattr(forward_ws, "PERSISTENT_DIMS", (64, ))
    assert forward_ws._settings(plan, torch.bfloat16, 64, claimed=False)["Q_BUFFERS"] == 2
    assert forward_ws._settings(forward_ws._plan(128, 128, False), torch.bfloat16, 128, claimed=True)["Q_BUFFERS"] == 1
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", (64, ))
    split = forward_ws._plan(128, 64, False)
    assert split.key_split == 2 and forward_ws._settings(split, torch.bfloat16, 64, claimed=True)["Q_BUFFERS"] == 1
    monkeypatch.setattr(forward_ws, "Q_BUFFER_DIMS", ())
    assert forward_ws._settings(plan, torch.bfloat16, 64, claimed=True)["Q_BUFFERS"] == 1


def test_q_given_back_early_where_the_table_says(monkeypatch):
    """EARLY_Q_RELEASE_DIMS: its head dims' persistent launches (claimed, or in turns), with one consumer pair and out
    not through Q's buffer, where not causal; a program a tile, the key split, out through the TMA unit and causal
    launches give Q back after the rows."""
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", ())
    monkeypatch.setattr(forward_ws, "PERSISTENT_DIMS", ())
    monkeypatch.setattr(forward_ws, "EARLY_Q_RELEASE_DIMS", (64, 128))
    for dim, causal in itertools.product((64, 128), (False, True)):
        plan = forward_ws._plan(128, dim, causal)
        assert forward_ws._settings(plan, torch.bfloat16, dim, claimed=True)["RELEASE_Q"] is not causal, (dim, causal)
        assert not forward_ws._settings(plan, torch.bfloat16, dim, claimed=False)["RELEASE_Q"], (dim, causal)
    monkeypatch.setattr(forward_ws, "PERSISTENT_DIMS", (64, ))
    assert forward_ws._settings(forward_ws._plan(128, 64, False), torch.float16, 64, claimed=False)["RELEASE_Q"]
    monkeypatch.setattr(forward_ws, "O_THROUGH_TMA", True)
    assert not forward_ws._settings(forward_ws._plan(128, 64, False), torch.bfloat16, 64, claimed=True)["RELEASE_Q"]
    monkeypatch.setattr(forward_ws, "O_THROUGH_TMA", False)
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", (64, ))
    assert not forward_ws._settings(forward_ws._plan(128, 64, False), torch.bfloat16, 64, claimed=True)["RELEASE_Q"]
    monkeypatch.setattr(forward_ws, "EARLY_Q_RELEASE_DIMS", (64, ))
    assert not forward_ws._settings(forward_ws._plan(128, 128, False), torch.bfloat16, 128, claimed=True)["RELEASE_Q"]


@pytest.mark.parametrize("blocks, dim, dtype", [((128, 128), 64, "bfloat16"), ((128, 64), 128, "bfloat16"),
                                                 ((128, 128), 128, "float16")])
def test_compiles_with_q_given_back_early(blocks, dim, dtype):
    """The claimed grid with Q given back after the walks' last Q K^T (EARLY_Q_RELEASE_DIMS): as _assert_compiles
    asks, within SPILL_BUDGET_CLAIMED."""
    _assert_compiles(f"setattr(forward_ws, 'EARLY_Q_RELEASE_DIMS', (64, 128)) or forward_ws.compile_sm90({blocks[0]}, "
                     f"{blocks[1]}, torch.{dtype}, dim={dim}, claimed=True)", SPILL_BUDGET_CLAIMED,
                     forward_ws._plan(blocks[1], dim, False))


def test_row_sums_on_the_tensor_cores_where_the_tables_say(monkeypatch):
    """MMA_ROW_SUM_DIMS and MMA_ROW_SUM_CAUSAL_DIMS: their head dims' walks in turn with fixed offsets, two consumers
    and one Q buffer, nothing else."""
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", ())
    monkeypatch.setattr(forward_ws, "FIXED_OFFSET_DIMS", (64, 128))
    for plain, causal_dims in (((64, ), ()), ((), (64, )), ((64, 128), (64, 128))):
        monkeypatch.setattr(forward_ws, "MMA_ROW_SUM_DIMS", plain)
        monkeypatch.setattr(forward_ws, "MMA_ROW_SUM_CAUSAL_DIMS", causal_dims)
        for dim, causal in ((64, False), (64, True), (128, False), (128, True)):
            plan = forward_ws._plan(128, dim, causal)
            expected = dim == 64 and dim in (causal_dims if causal else plain)  # (D=128's walk overlaps)
            assert forward_ws._settings(plan, torch.bfloat16, dim)["MMA_SUMS"] is expected, (plain, dim, causal)
    assert not forward_ws._settings(forward_ws._plan(128, 64, False)._replace(fixed_offsets=False), torch.bfloat16,
                                    64)["MMA_SUMS"]
    monkeypatch.setattr(forward_ws, "Q_BUFFER_DIMS", (64, ))
    assert not forward_ws._settings(forward_ws._plan(128, 64, False), torch.bfloat16, 64, claimed=True)["MMA_SUMS"]
    monkeypatch.setattr(forward_ws, "Q_BUFFER_DIMS", ())
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", (64, ))
    assert not forward_ws._settings(forward_ws._plan(128, 64, False), torch.bfloat16, 64)["MMA_SUMS"]


@pytest.mark.parametrize("blocks, dtype, causal, claimed", [((128, 128), "bfloat16", False, None),
                                                            ((128, 64), "float16", True, True)])
def test_compiles_with_row_sums_on_the_tensor_cores(blocks, dtype, causal, claimed):
    """D=64 with MMA_ROW_SUM_DIMS: as _assert_compiles asks (its tiles of ones within Hopper's shared memory), with
    the launch's stack budget."""
    _assert_compiles(f"setattr(forward_ws, 'MMA_ROW_SUM_DIMS', (64, )) or forward_ws.compile_sm90({blocks[0]}, "
                     f"{blocks[1]}, torch.{dtype}, causal={causal}, dim=64, claimed={claimed})",
                     SPILL_BUDGET_CLAIMED, forward_ws._plan(blocks[1], 64, causal))


@pytest.mark.parametrize("blocks, o_through_tma, causal", [((128, 128), False, False), ((128, 64), True, True)])
def test_compiles_with_two_q_buffers(blocks, o_through_tma, causal):
    """D=64 with two Q buffers (Q_BUFFER_DIMS) on the claimed grid: as _assert_compiles asks (the 16 KiB more
    within Hopper's shared memory), within SPILL_BUDGET_CLAIMED."""
    _assert_compiles(f"forward_ws.compile_sm90({blocks[0]}, {blocks[1]}, torch.bfloat16, causal={causal}, dim=64, "
                     f"o_through_tma={o_through_tma}, claimed=True, q_buffers=2)", SPILL_BUDGET_CLAIMED,
                     forward_ws._plan(blocks[1], 64, causal))


@pytest.mark.parametrize("blocks, dtype, claimed, causal", [
    ((128, 128), "bfloat16", None, False), ((128, 64), "float16", None, False), ((256, 256), "bfloat16", False, False),
    ((128, 64), "bfloat16", None, True), ((128, 128), "float16", True, True)])
def test_compiles_with_the_key_split(blocks, dtype, claimed, causal):
    """Four consumers at D=64 (KEY_SPLIT_DIMS, KEY_SPLIT_CAUSAL_DIMS): KEY_SPLIT_REGS registers a consumer thread,
    wgmma and TMA, shared memory within Hopper's and SPILL_BUDGET_KEY_SPLIT's stack."""
    report = sm90_report("setattr(forward_ws, 'KEY_SPLIT_DIMS', (64, )) or "
                         "setattr(forward_ws, 'KEY_SPLIT_CAUSAL_DIMS', (64, )) or forward_ws.compile_sm90("
                         f"{blocks[0]}, {blocks[1]}, torch.{dtype}, dim=64, claimed={claimed}, causal={causal})")
    assert {forward_ws.KEY_SPLIT_REGS, forward_ws.LOADER_REGS} <= set(report["registers"]), report
    assert report["wgmma"] and report["tma"] and report["shared"] <= 227 * 1024, report
    assert "LOCAL:0" in report["usage"] and stack_bytes(report) <= SPILL_BUDGET_KEY_SPLIT, report["usage"]


@pytest.mark.parametrize("blocks, causal, dim", [((128, 128), False, 128), ((128, 64), False, 128),
                                                  ((128, 64), True, 64)])
def test_compiles_with_the_rise_checked(blocks, causal, dim):
    """bf16 fixed offsets with the rise checked after the walk (RISE_CHECKED_DTYPES), whose cold walk again runs
    Ampere products (mma_v2) on pointer loads: as _assert_compiles asks, with the launch's stack budget."""
    _assert_compiles(f"forward_ws.compile_sm90({blocks[0]}, {blocks[1]}, torch.bfloat16, causal={causal}, dim={dim}, "
                     "fixed_offsets=True, check_rise=True)", _launch_spill_budget(blocks, causal, dim),
                     forward_ws._plan(blocks[1], dim, causal))


@pytest.mark.parametrize("blocks, dim, o_through_tma, causal, claimed", [
    ((128, 128), 64, False, False, False), ((128, 64), 64, True, False, False), ((128, 128), 128, False, False, False),
    ((128, 64), 128, True, False, False), ((128, 128), 128, False, False, True), ((128, 64), 64, False, False, True),
    ((128, 64), 128, True, True, True), ((128, 128), 64, False, True, True)])
def test_compiles_with_the_persistent_grid(blocks, dim, o_through_tma, causal, claimed):
    """The persistent grid (PERSISTENT_DIMS; claimed: its programs claim items from a counter, CLAIMED_DIMS, also
    under is_causal), bf16 with the launch's other settings: as _assert_compiles asks, within
    SPILL_BUDGET_PERSISTENT or SPILL_BUDGET_CLAIMED (SPILL_BUDGET_KEY_SPLIT with four consumers)."""
    plan = forward_ws._plan(blocks[1], dim, causal)
    budget = (SPILL_BUDGET_KEY_SPLIT if plan.key_split > 1
              else SPILL_BUDGET_CLAIMED if claimed else SPILL_BUDGET_PERSISTENT)
    _assert_compiles(f"forward_ws.compile_sm90({blocks[0]}, {blocks[1]}, torch.bfloat16, causal={causal}, dim={dim}, "
                     f"o_through_tma={o_through_tma}, persistent=True, claimed={claimed})", budget, plan)


# ---------------------------------------------------------------- against the oracle

CASES = {
    # name: (batch, heads, kv_heads, seq_q, seq_kv, block, dtype, layout); "one mask" cases share one [nq, nk] mask
    # across batch and heads (the lists' batch and head strides are 0)
    "128x128 bf16": (2, 4, 4, 2048, 2048, (128, 128), torch.bfloat16, "bhsd"),
    "128x64 fp16, query tail": (1, 4, 4, 1000, 1024, (128, 64), torch.float16, "bhsd"),
    # 900 = 7 * 128 + 4: the last tile's second half of Q lies wholly past the end (a box of zeros)
    "short query tail": (1, 2, 2, 900, 1024, (128, 128), torch.bfloat16, "bhsd"),
    "256x256 gqa": (1, 8, 2, 1024, 1024, (256, 256), torch.bfloat16, "bhsd"),
    "bshd layout": (2, 2, 2, 1536, 1024, (128, 128), torch.bfloat16, "bshd"),
    # three 64-key sub tiles a block: key tiles pair sub tiles of different blocks, odd counts end half a tile
    "128x192 paired sub tiles": (1, 4, 4, 1024, 1152, (128, 192), torch.bfloat16, "bhsd"),
    "one mask, batch 3": (3, 4, 2, 1024, 1024, (128, 64), torch.bfloat16, "bhsd"),
}


@pytest.fixture
def warp_specialized_calls(monkeypatch) -> list:
    """The plans the Gluon forward ran with from here on."""
    calls = []
    run = forward_ws.attention_forward_ws

    def spy(*args):
        calls.append(args[-1])
        return run(*args)
    monkeypatch.setattr(forward_ws, "attention_forward_ws", spy)
    return calls


CAUSAL_CASES = {
    # Sq < Sk: top-left alignment, the query tail ends inside its tile
    "128x128 causal, query tail": (1, 4, 4, 1000, 1024, (128, 128), torch.bfloat16, "bhsd"),
    # the default block shape: two 64-key blocks a key tile, both crossing the diagonal
    "128x64 causal gqa": (2, 4, 2, 1024, 1024, (128, 64), torch.float16, "bhsd"),
    # a 256-row block: its first 128-row tile walks a key tile wholly above its diagonal
    "256x256 causal": (1, 4, 4, 1024, 1024, (256, 256), torch.bfloat16, "bhsd"),
    # key tiles pairing sub tiles of different blocks, which cross the diagonal at different rows
    "128x192 causal": (1, 2, 2, 1152, 1152, (128, 192), torch.bfloat16, "bhsd"),
    # Sq > Sk: the last query tiles see every key and test none
    "more queries than keys": (1, 2, 2, 1536, 512, (128, 128), torch.bfloat16, "bshd"),
}


def _expected_calls(plan) -> list:
    return [plan] if ON_GPU and torch.cuda.get_device_capability() == (9, 0) else []


def _keep_with_edge_rows(batch, heads, seq_q, seq_kv, block, density, halfway_last: bool):
    """A random block mask whose query block 1 keeps nothing; halfway_last: the last query block keeps only the key
    block holding the key halfway down it, so under is_causal some of its rows see no key at all."""
    keep = random_keep(batch, heads, seq_q, seq_kv, block, density=density)
    nq, nk = keep.shape[-2:]
    keep[:, :, 1] = False
    if halfway_last:
        keep[:, :, nq - 1] = False
        keep[:, :, nq - 1, min(nk - 1, ((nq - 1) * block[0] + block[0] // 2) // block[1])] = True
    return keep


def _case_inputs(cases: dict, case: str):
    """(batch, heads, seq_q, seq_kv, block, q, k, v) of a table's case at D=128 (shrunk under the interpreter),
    q, k and v in the case's layout."""
    batch, heads, kv_heads, seq_q, seq_kv, block, dtype, layout = cases[case]
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block)
    q, k, v = qkv(batch, heads, seq_q, 128, kv_heads=kv_heads, seq_kv=seq_kv, dtype=dtype)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return batch, heads, seq_q, seq_kv, block, q, k, v


@pytest.mark.parametrize("case", list(CAUSAL_CASES))
def test_causal_against_the_oracle(case, poisoned, warp_specialized_calls):
    """Causal calls, with rows that see no key inside a tile whose other rows do (the last query block keeps one
    key block, which starts halfway down it) and a query block that keeps nothing. (The walk runs the tiles before
    its first tested one in a loop of their own, then the tested ones.)"""
    batch, heads, seq_q, seq_kv, block, q, k, v = _case_inputs(CAUSAL_CASES, case)
    keep = _keep_with_edge_rows(batch, heads, seq_q, seq_kv, block, 0.6, halfway_last=True)
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, is_causal=True, backend="triton")
    assert warp_specialized_calls == _expected_calls(_plan_for_block(block[1], True))
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv), is_causal=True)


@pytest.mark.parametrize("case", list(CASES))
def test_against_the_oracle_with_empty_rows(case, poisoned, warp_specialized_calls):
    batch, heads, kv_heads, seq_q, seq_kv, block, dtype, layout = CASES[case]
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block)
    q, k, v = qkv(batch, heads, seq_q, 128, kv_heads=kv_heads, seq_kv=seq_kv, dtype=dtype)
    one_mask = case.startswith("one mask")
    keep = random_keep(1 if one_mask else batch, 1 if one_mask else heads, seq_q, seq_kv, block, density=0.3)
    keep[:, :, 1] = False  # a query block that keeps nothing: zeros and LSE -inf
    if not one_mask:
        keep[0, 0] = False  # a head that keeps nothing at all
    args = (q, k, v) if layout == "bhsd" else tuple(t.transpose(1, 2).contiguous().transpose(1, 2)
                                                    for t in (q, k, v))
    q, k, v = args
    out, lse = blockattn.attention(q, k, v, keep[0, 0] if one_mask else keep, block, return_lse=True,
                                   backend="triton")
    assert warp_specialized_calls == _expected_calls(_plan_for_block(block[1]))
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv))


@pytest.mark.parametrize("case", ["128x64 fp16, query tail", "short query tail", "bshd layout"])
def test_out_through_the_tma_unit_against_the_oracle(case, monkeypatch, poisoned, warp_specialized_calls):
    """O_THROUGH_TMA on (off by default, when the kernel takes no descriptor of out): each consumer's rows of out
    stored by one TMA copy, which leaves out the rows past Sq of a query tail, into a bhsd or bshd out."""
    monkeypatch.setattr(forward_ws, "O_THROUGH_TMA", True)
    batch, heads, seq_q, seq_kv, block, q, k, v = _case_inputs(CASES, case)
    keep = _keep_with_edge_rows(batch, heads, seq_q, seq_kv, block, 0.4, halfway_last=False)
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, backend="triton")
    assert warp_specialized_calls == _expected_calls(_plan_for_block(block[1]))
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv))


@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_through_its_output_and_lse(is_causal, warp_specialized_calls):
    batch, heads, seq = (2, 4, 1024) if ON_GPU else (1, 2, 256)
    block = (128, 128)
    q, k, v = (t.requires_grad_() for t in qkv(batch, heads, seq, 128))
    keep = random_keep(batch, heads, seq, seq, block, density=0.3)
    keep[:, :, 1] = False
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, is_causal=is_causal, backend="triton")
    assert len(warp_specialized_calls) == int(ON_GPU and torch.cuda.get_device_capability() == (9, 0))
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    grad_out = torch.randn(out.shape, generator=gen, device=DEVICE).to(out.dtype)
    # the LSE enters the loss too: its gradient flows back through the saved LSE
    grads = torch.autograd.grad(output_and_lse_loss(out.float(), lse, grad_out.float()), (q, k, v))
    assert_output_and_gradients(None, grads, q, k, v, expand(keep, block, seq, seq), grad_out, tolerance=1e-2,
                                is_causal=is_causal, through_lse=True)


HEAD_DIM_64_CASES = {
    "128x128 bf16": (2, 4, 4, 1000, 1024, (128, 128), torch.bfloat16, False),
    "128x64 fp16 causal gqa": (1, 4, 2, 1024, 1024, (128, 64), torch.float16, True),
    "128x64 bf16": (1, 4, 4, 1000, 1024, (128, 64), torch.bfloat16, False),
    "256x256 bf16 causal": (1, 2, 2, 1024, 1024, (256, 256), torch.bfloat16, True),
    # three 64-key sub tiles a block, four a tile: tiles take sub tiles of two blocks crossing the diagonal apart
    "128x192 bf16 causal": (1, 2, 2, 1152, 1152, (128, 192), torch.bfloat16, True),
}
# D=64 tilings: (keys a tile, overlapped, ring stages); the first is the default (TILE_KEYS, OVERLAPPED, STAGES)
HEAD_DIM_64_TILINGS = {"256 keys": (256, False, 3), "128 keys, overlapped": (128, True, 4)}


@pytest.mark.parametrize("tiling", list(HEAD_DIM_64_TILINGS))
@pytest.mark.parametrize("emulate", [False, True])
@pytest.mark.parametrize("case", list(HEAD_DIM_64_CASES))
def test_head_dim_64_against_the_oracle(case, emulate, tiling, monkeypatch, poisoned, warp_specialized_calls):
    """D=64, its exponentials from the special function unit or one in four from the polynomial
    (EMULATED_EXP2_DIMS), with 256-key tiles (last tiles of 1 to 3 sub tiles in 4 at 128x64) and with the 128-key
    tiles it took before: a query tail, a query block that keeps nothing, and under is_causal a last query block
    whose one kept key block starts halfway down it."""
    monkeypatch.setattr(forward_ws, "EMULATED_EXP2_DIMS", (64, ) if emulate else ())
    tile_n, overlap, stages = HEAD_DIM_64_TILINGS[tiling]
    for table, value in ((forward_ws.TILE_KEYS, tile_n), (forward_ws.OVERLAPPED, overlap), (forward_ws.STAGES, stages)):
        monkeypatch.setitem(table, 64, value)
    _check_head_dim_64_case(case, monkeypatch, warp_specialized_calls)


# D=64 cases (as HEAD_DIM_64_CASES') whose key blocks split into four or three 64-key blocks where not causal
SPLIT_CASES = {
    "256x256 bf16": (1, 2, 2, 1000, 1024, (256, 256), torch.bfloat16, False),
    "128x192 fp16": (1, 4, 2, 1100, 1152, (128, 192), torch.float16, False),
}


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("case", ["128x128 bf16", *SPLIT_CASES])
def test_key_blocks_split_or_as_listed_against_the_oracle(case, split, monkeypatch, poisoned,
                                                           warp_specialized_calls):
    """D=64 with each key block walked as two, four or three 64-key blocks (SPLIT_KEY_BLOCK_DIMS, as D=64 runs) or as
    listed (in sub tiles of 128, 256 or 64 keys): a query tail and a query block that keeps nothing."""
    monkeypatch.setattr(forward_ws, "SPLIT_KEY_BLOCK_DIMS", (64, ) if split else ())
    _check_head_dim_64_case(case, monkeypatch, warp_specialized_calls, {**HEAD_DIM_64_CASES, **SPLIT_CASES})


# D=64 cases for the key split (as HEAD_DIM_64_CASES'): lists of odd and even lengths (128x64: a part's last tile
# half full), a query tail, GQA
KEY_SPLIT_CASES = {
    "128x64 bf16 gqa": (1, 4, 2, 1000, 1024, (128, 64), torch.bfloat16, False),
    "128x128 fp16": (2, 2, 2, 1024, 1152, (128, 128), torch.float16, False),
}


@pytest.mark.parametrize("grid", [None, "turns", "claimed"])
@pytest.mark.parametrize("case", ["128x128 bf16", "128x64 bf16", *KEY_SPLIT_CASES, *SPLIT_CASES,
                                  "128x64 fp16 causal gqa", "128x192 bf16 causal"])
def test_keys_split_between_consumer_pairs_against_the_oracle(case, grid, monkeypatch, poisoned,
                                                              warp_specialized_calls):
    """KEY_SPLIT_DIMS and KEY_SPLIT_CAUSAL_DIMS: D=64 with four consumers, each pair on every other key tile, the PART
    1 consumers' rows merged into the PART 0 ones' (bf16 with the rise checked, fp16 with the bound; a query block
    that keeps nothing, parts with no tile; under is_causal, each part's tiles crossing the diagonal tested, rows
    that one part saw no key of), a program an item or on the persistent grid (where the merge buffers pass from
    item to item)."""
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", (64, ))
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_CAUSAL_DIMS", (64, ))
    set_grid(monkeypatch, grid)
    monkeypatch.setattr(forward_ws, "PERSISTENT_PROGRAMS", 5)
    _check_head_dim_64_case(case, monkeypatch, warp_specialized_calls,
                            {**HEAD_DIM_64_CASES, **SPLIT_CASES, **KEY_SPLIT_CASES})


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("grid", [None, "claimed"])
@pytest.mark.parametrize("largest_bound", [28.8, 160.0])
def test_key_split_walked_again_against_the_oracle(largest_bound, grid, monkeypatch, poisoned,
                                                   warp_specialized_calls):
    """The key split with bf16's rise checked on scores that rise past each part's first tile by up to 28.8 or 160
    log2 units (aligned_scores): past 2^RISE_LIMIT a part's rows are walked again whole by the PART 0 consumer
    (_walk_again), whichever part rose; else merged."""
    monkeypatch.setattr(forward_ws, "KEY_SPLIT_DIMS", (64, ))
    set_grid(monkeypatch, grid)
    _check_rising_scores(largest_bound, monkeypatch, warp_specialized_calls)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("grid", [None, "claimed"])
@pytest.mark.parametrize("inputs", ["128x128 bf16", "128x64 fp16 causal gqa", "128x64 bf16", "256x256 bf16 causal",
                                    "bf16 rising 28.8", "bf16 rising 160"])
def test_row_sums_on_the_tensor_cores_against_the_oracle(inputs, grid, monkeypatch, poisoned, warp_specialized_calls):
    """D=64 with the fixed walk's row sums from the tensor cores (MMA_ROW_SUM_DIMS): HEAD_DIM_64_CASES' cases (bf16
    with the rise checked, fp16 and causal with the bound), and bf16 scores rising past the first tile by up to 28.8
    or 160 log2 units (aligned_scores), where past 2^RISE_LIMIT the sums' rows are walked again."""
    monkeypatch.setattr(forward_ws, "MMA_ROW_SUM_DIMS", (64, ))
    set_grid(monkeypatch, grid)
    if inputs.startswith("bf16 rising"):
        _check_rising_scores(float(inputs.split()[-1]), monkeypatch, warp_specialized_calls)
    else:
        monkeypatch.setattr(forward_ws, "PERSISTENT_PROGRAMS", 5)
        _check_head_dim_64_case(inputs, monkeypatch, warp_specialized_calls)


def _check_rising_scores(largest_bound: float, monkeypatch, warp_specialized_calls) -> None:
    """D=64 bf16 at 128x64, density 0.5 with every row's first 256 keys kept, on scores that rise past that first
    tile by up to largest_bound log2 units (aligned_scores), through attention() on the Triton backend (persistent
    grids of 5 programs): out and LSE against the oracle."""
    monkeypatch.setattr(forward_ws, "MIN_KEYS", {})
    monkeypatch.setattr(forward_ws, "PERSISTENT_PROGRAMS", 5)
    batch, heads, seq, block = 1, 4, 1024, (128, 64)
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, heads, seq, seq, block)
    seq_q, seq_kv = max(seq_q, 512), max(seq_kv, 512)
    q, k, v = qkv(batch, heads, seq_q, 64, kv_heads=kv_heads, seq_kv=seq_kv, dtype=torch.bfloat16)
    keep = random_keep(batch, heads, seq_q, seq_kv, block, density=0.5)
    keep[..., :4] = True  # keys 0-255: every row's first tile (each part's, under the key split)
    q, k = (t.to(torch.bfloat16) for t in aligned_scores(q, k, largest_bound))
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, backend="triton")
    assert warp_specialized_calls == _expected_calls(_plan_for_block(block[1], False, 64))
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv))


def _check_head_dim_64_case(case: str, monkeypatch, warp_specialized_calls, cases: dict = HEAD_DIM_64_CASES) -> None:
    """cases[case] through attention() on the Triton backend: the warp-specialized forward's plan under the module's
    tables as they stand (_plan_for_block) where a Hopper GPU runs it, out and LSE against the oracle."""
    monkeypatch.setattr(forward_ws, "MIN_KEYS", {})  # these sequences are short: the kernel at any length
    batch, heads, kv_heads, seq_q, seq_kv, block, dtype, causal = cases[case]
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block)
    q, k, v = qkv(batch, heads, seq_q, 64, kv_heads=kv_heads, seq_kv=seq_kv, dtype=dtype)
    keep = _keep_with_edge_rows(batch, heads, seq_q, seq_kv, block, 0.4, halfway_last=causal)
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, is_causal=causal, backend="triton")
    assert warp_specialized_calls == _expected_calls(_plan_for_block(block[1], causal, dim=64))
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv), is_causal=causal)


def _fixed_offset_walks(q, k, keep, block, causal: bool, tile_n: int, checked: bool):
    """What the kernel's fixed offsets meet on these inputs (FIXED_OFFSET_DIMS): (the share of consumer tiles, 64
    query rows with a kv list, whose walk keeps them fixed, the most by which a later score of such a tile rises
    above its row's offset, in log2 units). With the bound, a tile keeps them when for each of its rows the bound
    scale * log2(e) * |q_row| * (the kv head's largest |k|) exceeds the row's largest scaled score in the walk's
    first key tile (its first tile_n listed keys, the offset) by at most FIXED_HEADROOM[dtype]; with the rise
    checked after the walk instead (RISE_CHECKED_DTYPES: checked), when each of its rows has a key there."""
    batch, heads, seq_q, dim = q.shape
    group = heads // k.shape[1]
    c = dim ** -0.5 * math.log2(math.e)
    qf, kf = q.float(), k.float()
    bound = row_bounds(q, k)
    keep = keep.expand(batch, heads, *keep.shape[-2:])
    fixed, tiles, rise = 0, 0, float("-inf")
    for b, h, q_block in itertools.product(range(batch), range(heads), range(keep.shape[2])):
        blocks = keep[b, h, q_block].nonzero().flatten().tolist()
        if not blocks:
            continue
        keys = torch.cat([torch.arange(n * block[1], (n + 1) * block[1], device=q.device) for n in blocks])
        for start in range(q_block * block[0], min((q_block + 1) * block[0], seq_q), 64):
            rows = torch.arange(start, min(start + 64, seq_q), device=q.device)
            scores = qf[b, h, rows] @ kf[b, h // group, keys].T * c
            if causal:
                scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
            offsets = scores[:, :tile_n].amax(-1)
            tiles += 1
            if checked:
                keeps = bool(offsets.isfinite().all())
            else:
                keeps = (bound[b, h, rows] - offsets).max().item() <= bounds.FIXED_HEADROOM[q.dtype]
            if keeps:
                fixed += 1
                rise = max(rise, (scores.amax(-1) - offsets).max().item())
    return fixed / tiles, rise


@pytest.mark.parametrize("batch, heads, kv_heads, seq_q, block_q, shared, causal", [
    (2, 4, 2, 1100, 256, False, False), (1, 6, 3, 640, 128, False, False), (3, 4, 4, 1024, 128, True, False),
    (2, 4, 2, 1100, 256, False, True)])
def test_query_tile_order_puts_the_longest_lists_first(batch, heads, kv_heads, seq_q, block_q, shared, causal):
    """query_tile_order (the persistent grid's order of work items): a permutation of the items, numbered as _program
    decodes them (tile, then slot within the batch's heads, slot s holding head (s % kv_heads) * group + s //
    kv_heads; causal: the tile counted from the last), along which the kv counts' powers of two (empty lists below
    any) never rise, in item order within each; with 256-row blocks two tiles share a block's list, and a tail tile
    its last; shared: one mask for every batch and head (size-1 dims)."""
    group = heads // kv_heads
    nq = -(-seq_q // block_q)
    q_tiles = -(-seq_q // 128)
    gen = torch.Generator().manual_seed(5)
    kv_count = torch.randint(0, 9, (1, 1, nq) if shared else (batch, heads, nq), generator=gen, dtype=torch.int32)
    order = forward_ws.query_tile_order(kv_count, batch, heads, group, block_q, q_tiles, causal)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(q_tiles * batch * heads))
    full = kv_count.expand(batch, heads, nq)

    def count(item):
        tile, bh = item % q_tiles, item // q_tiles
        tile = q_tiles - 1 - tile if causal else tile
        slot = bh % heads
        return int(full[bh // heads, (slot % kv_heads) * group + slot // kv_heads, tile * 128 // block_q])
    scales = [count(item).bit_length() for item in order.tolist()]  # 0 for an empty list, k + 1 for 2^k..2^(k+1)-1
    assert all(a > b or (a == b and i < j) for (a, i), (b, j) in zip(zip(scales, order.tolist()),
                                                                   zip(scales[1:], order.tolist()[1:])))
    assert len(set(scales)) >= 3
    cached = forward_ws.cached_query_tile_order(kv_count, batch, heads, group, block_q, q_tiles, causal)
    assert torch.equal(cached, order)
    assert forward_ws.cached_query_tile_order(kv_count, batch, heads, group, block_q, q_tiles, causal) is cached
    # the other numbering is another order (kept apart), and the counts written in place are computed again
    other = forward_ws.cached_query_tile_order(kv_count, batch, heads, group, block_q, q_tiles, not causal)
    assert torch.equal(other, forward_ws.query_tile_order(kv_count, batch, heads, group, block_q, q_tiles, not causal))
    kv_count.add_(1)
    assert forward_ws.cached_query_tile_order(kv_count, batch, heads, group, block_q, q_tiles, causal) is not cached


# the persistent grid's cases: (a table, its case, head dim, out through the TMA unit, its programs' items: "turns"
# (PERSISTENT_DIMS, never under is_causal) or "claimed" from a counter (set_grid: under is_causal too), Q buffers
# (Q_BUFFER_DIMS: two at D=64))
PERSISTENT_CASES = ([("CASES", case, 128, False, grid, 1) for case in CASES for grid in ("turns", "claimed")]
                    + [("HEAD_DIM_64_CASES", case, 64, False, grid, buffers) for case, spec in HEAD_DIM_64_CASES.items()
                       for grid in ("turns", "claimed") if grid == "claimed" or not spec[7] for buffers in (1, 2)]
                    + [("CAUSAL_CASES", case, 128, False, "claimed", 1) for case in CAUSAL_CASES]
                    + [("CASES", case, 128, True, grid, 1) for case in ("128x64 fp16, query tail", "bshd layout")
                       for grid in ("turns", "claimed")]
                    + [("CASES", "128x64 fp16, query tail", 64, True, "claimed", 2)])


@pytest.mark.parametrize("table, case, dim, o_through_tma, grid, q_buffers", PERSISTENT_CASES)
def test_persistent_grid_against_the_oracle(table, case, dim, o_through_tma, grid, q_buffers, monkeypatch, poisoned,
                                            warp_specialized_calls):
    """The persistent grid (set_grid: in turns or claimed) with 7 programs, so that each walks many items of unequal
    lists and the ring's stages and the barriers' phases carry over from item to item, its last turn shorter in some
    programs than in others (claimed: however many items each program claims, and the consumers stopped by the
    loader's post of none left): the tables' cases (a query block that keeps nothing, a
    head that keeps nothing, query tails; claimed also is_causal's, with rows that see no key in a tile), D=128 and
    64, out through the TMA unit, and at D=64 two Q buffers taken in turn (Q_BUFFER_DIMS)."""
    _check_persistent_case(table, case, dim, o_through_tma, grid, q_buffers, monkeypatch, warp_specialized_calls)


def _check_persistent_case(table, case, dim, o_through_tma, grid, q_buffers, monkeypatch,
                           warp_specialized_calls) -> None:
    """A PERSISTENT_CASES case on the persistent grid of 7 programs, against the oracle and bit for bit against a
    program a tile (as test_persistent_grid_against_the_oracle says)."""
    set_grid(monkeypatch, grid)
    monkeypatch.setattr(forward_ws, "PERSISTENT_PROGRAMS", 7)
    monkeypatch.setattr(forward_ws, "O_THROUGH_TMA", o_through_tma)
    monkeypatch.setattr(forward_ws, "Q_BUFFER_DIMS", (64, ) if q_buffers == 2 else ())
    if q_buffers == 2:  # (two Q buffers leave no room for the tiles of ones: the program a tile below must add too)
        monkeypatch.setattr(forward_ws, "MMA_ROW_SUM_DIMS", ())
        monkeypatch.setattr(forward_ws, "MMA_ROW_SUM_CAUSAL_DIMS", ())
    monkeypatch.setattr(forward_ws, "MIN_KEYS", {})
    causal = False
    if table == "HEAD_DIM_64_CASES":
        batch, heads, kv_heads, seq_q, seq_kv, block, dtype, causal = HEAD_DIM_64_CASES[case]
        layout = "bhsd"
    else:
        causal = table == "CAUSAL_CASES"
        batch, heads, kv_heads, seq_q, seq_kv, block, dtype, layout = (CAUSAL_CASES if causal else CASES)[case]
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block)
    q, k, v = qkv(batch, heads, seq_q, dim, kv_heads=kv_heads, seq_kv=seq_kv, dtype=dtype)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    keep = _keep_with_edge_rows(batch, heads, seq_q, seq_kv, block, 0.4, halfway_last=causal)
    keep[0, 0] = False  # a head that keeps nothing: items with empty lists among the others
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, is_causal=causal, backend="triton")
    assert warp_specialized_calls == _expected_calls(_plan_for_block(block[1], causal, dim))
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv), is_causal=causal)
    # an item's rows come out of the same instructions whichever program takes it: a program a tile's, bit for bit
    set_grid(monkeypatch, None)
    out_tiled, lse_tiled = blockattn.attention(q, k, v, keep, block, return_lse=True, is_causal=causal,
                                               backend="triton")
    assert torch.equal(out, out_tiled) and torch.equal(lse, lse_tiled)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("grid", ["turns", "claimed"])
@pytest.mark.parametrize("inputs", ["D=128 128x64 fp16, query tail", "D=128 bshd layout", "D=64 128x64 bf16",
                                    "D=64 128x128 bf16", "bf16 rising 160"])
def test_q_given_back_early_against_the_oracle(inputs, grid, monkeypatch, poisoned, warp_specialized_calls):
    """Each consumer giving its half of Q back after its walk's last Q K^T (EARLY_Q_RELEASE_DIMS, at D=128 and 64)
    on the persistent grid in turns or claimed, so that a program's next item loads its Q while the rows' last tile
    runs and they are stored: query blocks and a head that keep nothing (their walks give Q back at the end), query
    tails, and bf16 scores rising past 2^RISE_LIMIT, whose rows are walked again (_walk_again, reading Q by pointer
    while its buffer may hold the next item's). Against the oracle, and bit for bit against a program a tile, which
    gives Q back after its rows."""
    monkeypatch.setattr(forward_ws, "EARLY_Q_RELEASE_DIMS", (64, 128))
    if inputs.startswith("bf16 rising"):
        set_grid(monkeypatch, grid)
        _check_rising_scores(float(inputs.split()[-1]), monkeypatch, warp_specialized_calls)
        return
    dim, case = int(inputs.split()[0][2:]), inputs.split(maxsplit=1)[1]
    table = "CASES" if dim == 128 else "HEAD_DIM_64_CASES"
    _check_persistent_case(table, case, dim, False, grid, 1, monkeypatch, warp_specialized_calls)


FIXED_OFFSET_CASES = {
    **{f"D=64 {name}": (*HEAD_DIM_64_CASES[name], 64) for name in ("128x64 bf16", "256x256 bf16 causal",
                                                                   "128x64 fp16 causal gqa")},
    # 256-key blocks walked as listed (256-key TMA boxes) where not causal: with two Q buffers, the build ptxas 12.8
    # once miscompiled (kernels/README.md, "Two Q buffers")
    "D=64 256x256 bf16": (1, 2, 2, 1000, 1024, (256, 256), torch.bfloat16, False, 64),
    # D=128's loop, with the overlap inside a warpgroup (fixed offsets by default since the forty-sixth session)
    "D=128 128x128 bf16": (1, 4, 4, 1000, 1024, (128, 128), torch.bfloat16, False, 128),
    "D=128 128x64 fp16 gqa": (1, 4, 2, 1024, 1024, (128, 64), torch.float16, False, 128),
    "D=128 128x64 bf16 gqa": (1, 4, 2, 1000, 1024, (128, 64), torch.bfloat16, False, 128),
}


# "bound 160" overflows bf16's fixed walk on purpose (then walked again), and the interpreter's numpy says so where
# the Triton forward runs it
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("inputs", ["bound 13.5", "bound 28.8", "bound 160", "large norms"])
@pytest.mark.parametrize("case, checked, grid, q_buffers",
                         [(case, False, None, 1) for case in FIXED_OFFSET_CASES]
                         + [(case, True, grid, buffers) for case, spec in FIXED_OFFSET_CASES.items()
                            if spec[6] == torch.bfloat16 for grid in (None, "turns", "claimed")
                            for buffers in ((1, 2) if spec[8] == 64 and grid is not None else (1, ))])
def test_fixed_offsets_against_the_oracle(case, checked, grid, q_buffers, inputs, monkeypatch, poisoned,
                                          warp_specialized_calls):
    """The walk with fixed offsets (FIXED_OFFSET_DIMS, here at D=64 and 128) on scores that rise past each list's
    first key tile by nearly the rows' bounds (aligned_scores: 13.5, 28.8 or 160 log2 units, so P reaches 2^12,
    2^25 or would pass bf16's 2^128). With a bound, the offsets stay where it is within P's headroom (bf16 32, fp16
    15: fp16 P past 2^16 would overflow), and the running maxima run where it is not (and for longer queries); with
    the rise checked (bf16 in RISE_CHECKED_DTYPES: checked), wherever every row has a key in its first tile, and
    past 2^RISE_LIMIT ("bound 160") the rows are walked again with running maxima (the cold _walk_again), else
    their overflowed sums would show here. Against the oracle, with the share of tiles taking each walk and the
    scores' rise computed on the host. grid: with the rise checked, on the persistent grid of 5 programs taking their
    items in turns or claiming them (set_grid; claimed under is_causal too), where a walk again comes between one
    item and the next; None: a program an item. q_buffers: at D=64 on the persistent grid, one Q buffer or two taken
    in turn by a program's items (Q_BUFFER_DIMS)."""
    monkeypatch.setattr(forward_ws, "MIN_KEYS", {})
    monkeypatch.setattr(forward_ws, "Q_BUFFER_DIMS", (64, ) if q_buffers == 2 else ())
    set_grid(monkeypatch, grid)
    monkeypatch.setattr(forward_ws, "PERSISTENT_PROGRAMS", 5)
    monkeypatch.setattr(forward_ws, "FIXED_OFFSET_DIMS", (64, 128))
    monkeypatch.setattr(forward_ws, "RISE_CHECKED_DTYPES", (torch.bfloat16, ) if checked else ())
    monkeypatch.setattr(forward_ws, "RISE_CHECKED_DIMS", (64, 128))
    monkeypatch.setattr(forward_ws, "RISE_CHECKED_CAUSAL_DIMS", (64, 128))
    batch, heads, kv_heads, seq_q, seq_kv, block, dtype, causal, dim = FIXED_OFFSET_CASES[case]
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block)
    # (under the interpreter too: keys past the first tile, and under is_causal rows that see them)
    seq_q, seq_kv = max(seq_q, 512), max(seq_kv, 512)
    q, k, v = qkv(batch, heads, seq_q, dim, kv_heads=kv_heads, seq_kv=seq_kv, dtype=dtype)
    keep = random_keep(batch, heads, seq_q, seq_kv, block, density=0.4)
    keep[..., :max(1, 256 // block[1])] = True  # every list starts with keys 0-255
    if inputs == "large norms":
        q = q * 8
    else:
        largest_bound = float(inputs.split()[1])
        q, k = (t.to(dtype) for t in aligned_scores(q, k, largest_bound))
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, is_causal=causal, backend="triton")
    tile_n = forward_ws.TILE_KEYS[dim]
    assert warp_specialized_calls == _expected_calls(_plan_for_block(block[1], causal, dim))
    share, rise = _fixed_offset_walks(q, k, keep, block, causal, tile_n, checked)
    if checked:
        assert share == 1, share
        if inputs == "bound 160":  # some rows rose past the limit: those were walked again
            assert rise > bounds.RISE_LIMIT + 15, rise
    elif inputs == "large norms" or largest_bound > bounds.FIXED_HEADROOM[dtype]:
        assert share == 0, share
    else:
        assert share == 1 and rise > 0.8 * largest_bound, (share, rise)
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv), is_causal=causal)


@pytest.mark.parametrize("is_causal", [False, True])
def test_emulated_exponentials_against_the_oracle(is_causal, monkeypatch, poisoned, warp_specialized_calls):
    """D=128 with one exponential in four from the polynomial: rows with no key still give zeros and LSE -inf."""
    monkeypatch.setattr(forward_ws, "EMULATED_EXP2_DIMS", (128, ))
    batch, heads, kv_heads, seq_q, seq_kv, block = 2, 4, 2, 1000, 1024, (128, 128)
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block)
    q, k, v = qkv(batch, heads, seq_q, 128, kv_heads=kv_heads, seq_kv=seq_kv)
    keep = _keep_with_edge_rows(batch, heads, seq_q, seq_kv, block, 0.5, halfway_last=False)
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, is_causal=is_causal, backend="triton")
    assert warp_specialized_calls == _expected_calls(_plan(128, is_causal))
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv), is_causal=is_causal)


def test_the_polynomial_exponential_is_accurate():
    """_EXP2_ASM's fourth lane, evaluated step by step in fp32 with its own constants (its add rounded toward -inf
    leaves 1.5 * 2^23 + floor(x), whose bits shifted left by 23 are floor(x) << 23): within 1e-4 of 2^x from
    x = -126 to 0, exactly 0 below -126 and at -inf (a key masked out must weigh nothing)."""
    asm = str(forward_ws._EXP2_ASM.value)
    fmas = [line for line in asm.splitlines() if line.startswith("fma.rn")]
    c3, c2, c1, one = (np.array([int(h, 16)], dtype=np.uint32).view(np.float32)[0]
                       for h in re.findall(r"0f([0-9A-F]{8})", " ".join(fmas)))
    x = np.concatenate([np.linspace(-130, 0, 400001, dtype=np.float32), [-np.inf]]).astype(np.float32)
    clamped = np.maximum(x, np.float32(-127))
    floor = np.floor(clamped)
    f = clamped - floor
    p = ((f * c3 + c2) * f + c1) * f + one
    magic = np.float32(1.5 * 2 ** 23)
    shifted = ((magic + floor).view(np.uint32) << np.uint32(23)).view(np.int32)  # the sum is exact: floor is integral
    assert (shifted == floor.astype(np.int32) << 23).all()
    bits = p.view(np.int32) + shifted
    got = np.where(x < -126, np.float32(0), bits.view(np.float32))
    want = np.exp2(x.astype(np.float64))
    live = x >= -126
    assert np.abs(got[live] / want[live] - 1).max() < 1e-4
    assert (got[~live] == 0).all()
