"""The warp-specialized backward for Hopper, written in Gluon: FlashAttention-3's structure over blockattn's q lists.

One program takes one 128-key tile of one (batch, kv head) and walks the q lists of the query heads that share it. A
loader warp reads the tile's K and V once, then each listed query block's 64-row tiles of Q and dO, with the rows' lse2
and delta, into a ring of shared-memory stages through TMA. Two consumer warpgroups own 64 keys each. Per query tile a
consumer computes S^T = K Q^T and dP^T = V dO^T for its keys, P^T and dS^T in registers, adds P^T dO into dV and dS^T Q
into dK, and stores dS^T into shared memory; once both halves are there, each computes half of dQ's columns (dS K; at
D=64 all columns over its own keys) and adds them into an fp32 buffer through the TMA unit (a bulk tensor reduction from
shared memory). dQ lags a step (LAGGED_DQ): a step computes the step before's dQ, so the consumers need not meet within
a step. Each (batch, kv head)'s programs take its tiles longest walk first (ORDERED, tile_order), and MHA programs store
dK and dV through the TMA unit. Key blocks of 64 keys (128x64, 64x64, or an odd multiple) run paired programs (PAIRED):
two 64-key tiles, one per consumer, each with its own walk (for GQA one list over the group's heads,
merge_group_lists): first the query blocks both tiles keep (common steps: one load for both consumers, who meet there
and add dQ over both tiles' 128 keys once, SUMMED_DQ), then each tile's rest, the two rests interleaved in the ring,
dQ over each consumer's own keys. A program's two tiles are matched by the query blocks they share (PAIR_BY_SHARED,
paired_tile_order). Where a GQA group's rows outgrow L2, its paired programs split it in parts, one head each, that
add their dK and dV into fp32 sums (KV_SPLIT, kv_split).
Five tile products per step, against seven for the Triton kernels' deterministic dQ walk (kernels/README.md, "The
warp-specialized backward"). Measured on the H200 at B1 H24 S32768 D128,
density 0.25, 128x128 blocks: 15.64 ms against 20.28 for the Triton backward and 21.64 for FlexAttention's
(BENCHMARKS.md, twenty-third session); 128x64 blocks: 18.38 ms against 19.97 for the Triton backward, causal at
d=0.5 30.69 against 39.06 (twenty-eighth session).

It covers the plain walk and the causal one (the test key <= query on the steps the diagonal crosses): no other
element tests (no token mask, kv_valid, gathered block mask or packed batch), bf16 or fp16, head dim 64 or 128, key
blocks of whole 64-key tiles with Sk a multiple of 128, and query blocks of whole 64-row ones.
The dQ adds land in a nondeterministic order, so deterministic mode runs the Triton backward. `plan()` says whether
a call qualifies; backward.attention_backward runs the Triton kernels otherwise. Triton's interpreter cannot run
Gluon, so on the CPU the tests compile this kernel for sm_90 without running it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from . import autotune, buffers, launch, replay
from .forward import stride_args
# Registers per thread for a consumer warpgroup and for the loader (setmaxnreg) and the launch options (the
# register bound among them): the forward's. Its host descriptors, their compile signatures and the launch
# (launch_warp_specialized) also come from there.
from .forward_ws import (CONSUMER_REGS, LAUNCH_OPTIONS, LOADER_REGS, _GL_DTYPES, _LOG2E, descriptor_signature,
                         host_descriptor, launch_warp_specialized, tma_load, tma_readable, tma_store)

# Whether attention_backward may take this kernel (benchmarks switch it off to time the Triton backward).
ENABLED = True
# Query rows per step, keys per consumer warpgroup (a wgmma's 4 warps x 16 rows) and per program (two consumers).
STEP_ROWS = 64
CONSUMER_KEYS = 64
TILE_N = 2 * CONSUMER_KEYS
# Head dims (D = Dv) the kernel takes. At 128 each consumer computes half of dQ's columns over the tile's 128 keys;
# at 64 a half (32 columns, 64 bytes) would cut the 128-byte swizzled rows of K in shared memory, which a wgmma
# operand cannot start inside, so each consumer computes all 64 columns over its own 64 keys and both add them.
HEAD_DIMS = (64, 128)
# Ring stages of Q and dO tiles and their rows' terms (32.5 KiB a stage): 2 and 3 measured alike (17.47 / 17.54 ms at
# the design case, seventeenth session); with the terms in the ring 3 ran 0-8% slower (twenty-second session).
STAGES = 2
# Whether dQ lags a step (each step computes the step before's dQ, whose dS^T halves are both in by then, so the two
# consumers do not meet within a step) with a staggered start (the second consumer starts once the first has its
# first scores): 1.7-4.5% faster at B1 H24 S32k than meeting each step (d = 1 .. 0.1, causal), both measured apart and
# together in BENCHMARKS.md, twentieth session. GQA calls lag too since each head's walk ends with its own last dQ
# (0.8-1.3% faster at GQA 32/8 S16k d=0.5, even at d=0.1; twenty-first session): carried across the group's heads it
# had run 5-8% slower. Taking turns (FA3's ping-pong: each consumer waits for the other to issue its products before
# issuing its own) ran 5-6% slower than lagging alone, and four dS buffers with each half stored as soon as it is
# computed 0-3% slower.
LAGGED_DQ = True
# Whether each (batch, kv head)'s programs take its tiles longest walk first (tile_order) instead of in key order:
# the grid's last programs are then the short ones, and its tail shorter (benchmarks/tail_sim.py models it); a kv
# head's programs still run together, sharing its rows of Q, dO and dQ in L2. Measured against key order (twenty-third
# session): GQA 32/8 S16k 6.8% faster at density 0.1, 2.3% at 0.5; B1 H24 S32k 0.2-1.2%; B8 H16 S4096 2.5%.
ORDERED = True
# Whether the causal walk over a q list (MHA and GQA programs of 128-key blocks; not the paired ones, whose common
# steps come first) runs the steps that cross its keys' diagonal in a loop of their own, and the rest without the
# causal test. The lists are ascending, so the crossing steps are a prefix (_crossing_steps): one or two of a walk's
# many. The test is a runtime condition that the compiler makes selects every step runs (32 FSEL a thread among
# them). Offline sm_90 SASS (fifty-first session; instructions a step, the two consumers' loops, and local loads and
# stores in them): Triton 3.6, the H200's: D=64 419 / 413 -> 364 / 361 untested, no spill either way; GQA D=128
# 524 / 514 (8 / 12 local) -> 440 / 448 (0 / 1); MHA D=128 543 / 503 (8 / 4) -> 450 / 468 but with 10 / 18 local,
# the stack 64 -> 112 bytes. Triton 3.9: MHA D=128 513 / 515 (17 / 15) -> 445 / 449 (2 / 2); GQA 521 / 529 (21 / 21)
# -> 476 / 477 (19 / 21), its crossing loop 605 / 613 (58 / 62), stack 144 -> 312. The head dims whose MHA walks
# split (SPLIT_CAUSAL_DIMS) and whose GQA walks do (SPLIT_CAUSAL_GROUPED_DIMS). Timed in turns
# (`benchmarks/ws_backward_ab.py --setting split-causal`; one loop's time / split's): GQA 32/8 S16k D=128 1.11x on an
# H100 (fifty-third session) and 1.046x on the H200 (fifty-fifth); MHA D=128 0.93-0.94x at S32k and at B8 S4096,
# D=64 0.99x. So GQA walks at D=128 split, MHA walks do not.
SPLIT_CAUSAL_DIMS: tuple = ()
SPLIT_CAUSAL_GROUPED_DIMS: tuple = (128, )
# Key blocks of 64 keys (or an odd multiple: 128x64 is the library's default block): each program takes two 64-key
# tiles, one per consumer, whose q lists differ, so the consumers walk apart; the loader interleaves their steps in
# one ring (a stage holds one consumer's step) and each consumer computes the dQ over its own keys for all of D. Its
# ring stages: with two dQ tiles and two dS^T buffers (PAIRED_SUMMED_DQ), 3 stages fill 225.9 KiB at D = 128. That
# is PAIRED_STAGES, GQA calls'; MHA calls take PAIRED_MHA_STAGES: 2 ran 1-3.5% faster than 3 at d=0.1 in four rounds
# (B1 H24 S32k, 128x64, D=128), 2-4% faster at d=0.5 in three of them (0.4% slower in the fourth), as fast at d=0.25,
# causal and D=64, while GQA 32/8 ran 0.5-2.5% slower (thirty-sixth session).
PAIRED_STAGES = 3
PAIRED_MHA_STAGES = 2
# Whether a paired program's two walks start with the query blocks both its tiles keep (pair_lists), one ring stage
# each that both consumers read, so that Q and dO are loaded once for both. Alone, within 4% either way of no common
# steps (twenty-eighth session); it is what PAIRED_SUMMED_DQ builds on.
PAIRED_COMMON_FIRST = True
# Whether a paired program's common steps (PAIRED_COMMON_FIRST) add dQ over both tiles' 128 keys once, the two
# consumers meeting at each as the 128-key programs' do, instead of each adding its own 64 keys' dQ: half the bytes
# added into dQ's fp32 buffer on those steps, whose reductions bound the paired step (twenty-seventh session).
# Measured against no common steps (twenty-eighth session, B1 H24 S32k): causal 1.26x at D=128, 1.14x at D=64;
# random masks 1.04x / 1.06x / 1.00x at d=0.5 / 0.25 / 0.1, GQA 32/8 0.99x.
PAIRED_SUMMED_DQ = True
# Whether a paired program's two tiles are matched by the query blocks their lists share (paired_tile_order) rather
# than taken as neighbours in tile_order: each shared block is a common step, loaded once and its dQ added once, and
# at d=0.1 the paired backward is bound by those loads and adds in L2 (thirty-sixth session). On the benchmarks'
# random masks at 128x64, B1 H24 S32k, matching takes a program's shared blocks from 2.6 to 6.5 at d=0.1 (16 to 23
# at 0.25, 64 to 71 at 0.5) and all programs' steps (both walks, common ones once) down by 8.1% / 6.3% / 3.4%, and
# the backward ran 2.9-3.0% / 1.5-3.0% / 0.7-1.2% faster in two calls (thirty-eighth session; GQA 32/8 S16k
# 0.5-0.7%, D=64 0.6-1.3%). PAIR_BALANCE:
# what a step of difference between the two walks' lengths costs against a shared block (the shorter walk's
# consumer idles at the end): 0 ran as fast at d=0.1, 1.7% faster at 0.25 and 5.8% slower with GQA; 1 ran slower
# than 0.5 in every random-mask case. PAIR_ROUNDS: rounds of the matching (16 were no faster than 8), after which
# unmatched tiles pair as tile_order puts them.
PAIR_BY_SHARED = True
PAIR_BALANCE = 0.5
PAIR_ROUNDS = 8
# The matching costs about 2-4 ms of host time (its rounds' small launches) where the lists are new, and its scores
# take (tiles per (batch, kv head))^2 floats: it runs from PAIR_MIN_TILES tiles (Sk = 16k at 64-key tiles), where a
# backward takes milliseconds, to PAIR_MAX_TILES (256k); outside, programs keep tile_order's neighbours.
PAIR_MIN_TILES = 256
PAIR_MAX_TILES = 4096
# The backward call on a mask's lists from which on its tiles are matched (backward_uses counts them per lists
# tensors): before, its programs pair tile_order's neighbours. The matching's GPU time where the lists are new (0.44
# ms at GQA 32/8 S16k, 0.90 at B1 H24 S32k, 10.8 at S128k, replayed from a CUDA graph; kernels/replay.py) is more than
# it saves in one backward (about 3%), so a mask made afresh for every call (a video model's per-step top-k blocks)
# runs faster unmatched: at H24 S16k 128x64 d=0.1, forward+backward with a new mask each call took 2.88-2.91 ms
# unmatched against 3.19-3.28 matched (fortieth session, benchmarks/dynamic_masks.py). A mask used again (by the next
# layer, the next step) is matched once, from its second backward on. Under CUDA graph capture (where nothing is kept)
# calls count 1.
MATCH_FROM_USE = 2
# GQA's paired programs walk one merged list per tile over the group's query heads (merge_group_lists), whose
# entries are query block << HEAD_BITS | the query head's place in its group: groups of up to 2 ** HEAD_BITS heads,
# query blocks below 2 ** (31 - HEAD_BITS). The walk is then MHA's single loop, the head read with each step.
HEAD_BITS = 8
# Paired GQA (64-key tiles): into how many parts a kv head's programs split its group of query heads (kv_split),
# each part's programs loading the tiles' K and V again and adding their shares of dK and dV into fp32 sums through
# the TMA unit. 128-key tiles take one part: there 4 parts ran 0.9% / 7.7% slower at GQA 32/8 S16k d=0.5 / 0.1. None:
# the group's query heads one a part where the group's rows of Q, dO and dQ's fp32 sums exceed the L2 cache, else
# one part (an int: that many parts where it divides the group). The group's programs of a kv head run together and
# walk all its heads' rows: past L2 they miss. GQA 32/8 S16k 128x64 d=0.5 (64 MiB of rows a kv head against 50 MiB
# of L2): 1 part 12.11-12.23 ms, 2 parts 12.08-12.11, 4 parts 11.51-11.55 (MHA 32 11.40-11.52); Nsight Compute: one
# part 91.5% L2 hits and 6.0 GB of DRAM traffic, four 97.6% and 1.9 GB (parts' shares then stored, not added). At
# d=0.1 4 parts ran 0.3-2.6% slower (2.93-2.99 ms against 2.91-2.92), about what zeroing and converting the sums
# take (thirty-ninth session).
KV_SPLIT = None

_ROWS = gl.constexpr(STEP_ROWS)
_KEYS = gl.constexpr(CONSUMER_KEYS)
_HEAD_BITS = gl.constexpr(HEAD_BITS)

if hasattr(tma, "async_atomic_add"):  # Triton 3.8 on
    _tma_add = tma.async_atomic_add
else:  # Triton 3.6 has the operation (a bulk tensor reduction) without a Gluon function for it
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def _tma_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile src into the global tensor at coord through the TMA unit."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


# A view of shared memory in another layout (Triton 3.9 renamed it)
_reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret


@gluon.jit
def _program(shared, W: gl.constexpr, BLOCK_KV: gl.constexpr, ORDERED: gl.constexpr, PAIRED: gl.constexpr):
    """(off_b, off_hkv, start_n, list_row): this program's batch and kv head, the first key of its 128-key tile or
    (PAIRED) of consumer W's 64-key tile, the program's 2 * p + W-th among its (batch, kv head)'s tiles, and the row
    of the q lists it walks: its key block's, or (PAIRED) the tile's own in pair_lists' layout. ORDERED: the tile
    TILE_ORDER puts at that place; else the place's own. (W is ignored unless PAIRED.)"""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    pid_bh = gl.program_id(1) + gl.program_id(2) * gl.num_programs(1)
    off_b, off_hkv = pid_bh // kv_heads, pid_bh % kv_heads
    if PAIRED:
        place = 2 * gl.program_id(0) + W
        TILE_KEYS: gl.constexpr = _KEYS
    else:
        place = gl.program_id(0)
        TILE_KEYS: gl.constexpr = 2 * _KEYS
    if ORDERED:
        tile = gl.load(TILE_ORDER + off_b * stride_ob + off_hkv * stride_oh + place)
    else:
        tile = place
    start_n = tile * TILE_KEYS
    list_row = start_n // BLOCK_KV
    if PAIRED:
        list_row = tile  # pair_lists' rows are per 64-key tile
    return off_b, off_hkv, start_n, list_row


@gluon.jit
def _q_list(shared, off_b, off_h, key_block, BLOCK_Q: gl.constexpr):
    """(steps, index_row): query head off_h's count of 64-row tiles for the key block, and its q list's pointer."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    count = gl.load(Q_COUNT + off_b * stride_cb + off_h * stride_ch + key_block)
    index_row = Q_INDEX + off_b.to(gl.int64) * stride_ib + off_h.to(gl.int64) * stride_ih + key_block * stride_ik
    return count * (BLOCK_Q // _ROWS), index_row


@gluon.jit
def _first_row(index_row, step, BLOCK_Q: gl.constexpr):
    """The first query row of step `step` of a q list: entry step // (BLOCK_Q // 64), its tile step % (...)."""
    _, row0 = _step_rows(index_row, step, BLOCK_Q, False)
    return row0


@gluon.jit
def _step_rows(index_row, step, BLOCK_Q: gl.constexpr, HEAD_IN_ENTRY: gl.constexpr):
    """(g, row0) of step `step` of a q list: the query head's place in its group and the step's first query row
    (entry step // (BLOCK_Q // 64), its tile step % (...)). HEAD_IN_ENTRY: a merged list's (merge_group_lists), whose
    entries hold both; else g = 0."""
    TILES: gl.constexpr = BLOCK_Q // _ROWS
    entry = gl.load(index_row + step // TILES)
    g = entry * 0
    if HEAD_IN_ENTRY:
        g = entry & ((1 << _HEAD_BITS) - 1)
        entry = entry >> _HEAD_BITS
    return g, entry * BLOCK_Q + (step % TILES) * _ROWS


@gluon.jit
def _box(tile):
    """A shared-memory tile [R, C] as the [1, 1, R, C] box a 4-d descriptor's TMA transfers take."""
    return tile.reshape([1, 1, tile.shape[0], tile.shape[1]])


@gluon.jit
def _add_dq(DQ_DESC, dq_smem, dq_tile, dq, off_b, off_h, row0, column, W: gl.constexpr):
    """Add a dQ share of consumer W (fp32 [64 rows, 64 columns]) at rows row0.., columns column.. of query head off_h,
    through the TMA unit, from the consumer's shared tile once the previous reduction has read it."""
    tma.store_wait(0)
    dq_smem.index(W).store(dq)
    fence_async_shared()
    _tma_add(DQ_DESC, [off_b, off_h, row0, column], dq_tile)


@gluon.jit
def _store_ds_half(ds_smem, ds_ready, dst, i, W: gl.constexpr):
    """Consumer W's half of program step i's dS^T ([64 keys, 64 rows]) into that step's buffer, and its arrival on
    the buffer's barrier."""
    buf = i % 2
    ds_smem.index(buf).slice(W * _KEYS, _KEYS, dim=0).store(dst)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(buf), count=1)


@gluon.jit
def _dq_product(ds_smem, ds_ready, k_dq, st_zero, i, W: gl.constexpr, OWN_KEYS: gl.constexpr):
    """Consumer W's share of program step i's dQ, once both consumers have stored their halves of dS^T for it: an
    async wgmma to wait for. dS K over the tile's 128 keys for k_dq's 64 columns, or (OWN_KEYS) over its own 64 keys
    for all of D = 64 (k_dq: its keys' rows of K)."""
    buf = i % 2
    mbarrier.wait(ds_ready.index(buf), (i // 2) & 1)
    ds_t = ds_smem.index(buf)
    if OWN_KEYS:
        ds_t = ds_t.slice(W * _KEYS, _KEYS, dim=0)
    return warpgroup_mma(ds_t.permute((1, 0)), k_dq, st_zero, use_acc=False, is_async=True)


@triton.constexpr_function
def _gradient_layout(dim):
    """The registers' layout of a consumer's fp32 [64 keys, dim] gradients: a wgmma's, over its 4 warps."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, dim, 16])


@triton.constexpr_function
def _operand_layout(dim):
    """The registers' layout of a [64 keys, 64 rows] tile (P^T, dS^T) as the A operand of a product into the fp32
    [64 keys, dim] gradients."""
    return gl.DotOperandLayout(operand_index=0, parent=_gradient_layout(dim), k_width=2)


@gluon.jit
def _terms_rows(terms_smem, STAGES: gl.constexpr):
    """The ring's row terms as [2 * STAGES] rows of 64 (TMA writes them through a layout whose rows cannot be
    indexed): row 2 * stage holds a stage's lse2, the next its delta."""
    return _reinterpret(terms_smem, gl.float32, [2 * STAGES, _ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _step_scores(shared, k_half, v_half, terms_rows, st_zero, i, row0, first_key, W: gl.constexpr,
                 STAGES: gl.constexpr, CAUSAL: gl.constexpr, OPENS_GATE: gl.constexpr):
    """Program step i's scores for consumer W's 64 keys (first_key..) and the 64 rows (row0..) in the ring's stage
    i % STAGES, once loaded: S^T = K Q^T and dP^T = V dO^T, then P^T and dS^T in registers. (q_tile, do_tile, dst,
    pt_op): the stage's tiles, dS^T, and P^T as the A operand of the dV product. CAUSAL:
    P = 0 where a key lies past the row. OPENS_GATE: the first consumer's program step i = 0 opens the second's
    staggered start once it has its scores (LAGGED_DQ)."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    dtype: gl.constexpr = Q_DESC.dtype
    D: gl.constexpr = Q_DESC.block_type.shape[3]
    along_rows: gl.constexpr = gl.SliceLayout(0, st_zero.type.layout)
    stage = i % STAGES
    mbarrier.wait(q_ready.index(stage), (i // STAGES) & 1)
    q_tile = q_smem.index(stage)
    do_tile = do_smem.index(stage)
    st = warpgroup_mma(k_half, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_half, do_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    # The rows' terms came with the tiles. Rows past the end read as zeros throughout: Q and dO, so S = dP = 0,
    # and lse2 = delta = 0, so P = 1 and dS = 0; dO = 0 keeps them out of dV too.
    lse2 = terms_rows.index(2 * stage).load(along_rows)
    st = warpgroup_mma_wait(1, deps=(st, ))
    if OPENS_GATE:
        if W == 0:
            if i == 0:
                mbarrier.arrive(start_gate, count=1)
    pt = gl.exp2(st * scale_log2 - lse2[None, :])
    if CAUSAL:
        if row0 < first_key + _KEYS - 1:  # the diagonal crosses the step: some key lies past some row
            # key - row0 <= row - row0: the tile's own offsets, so no row vector stays live for the test
            keys = (first_key - row0) + gl.arange(0, _KEYS, gl.SliceLayout(1, st_zero.type.layout))
            pt = gl.where(keys[:, None] <= gl.arange(0, _ROWS, along_rows)[None, :], pt, 0.0)
    dpt = warpgroup_mma_wait(0, deps=(dpt, ))
    delta = terms_rows.index(2 * stage + 1).load(along_rows)
    dst = (pt * (dpt - delta[None, :])).to(dtype)
    pt_op = gl.convert_layout(pt.to(dtype), _operand_layout(D))
    return q_tile, do_tile, dst, pt_op


@gluon.jit
def _head_walk(shared, dk, dv, it, off_b, off_h, start_n, key_block, k_half, v_half, k_dq, dq_tile, st_zero,
               W: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
               LAGGED_DQ: gl.constexpr, OWN_KEYS: gl.constexpr, SPLIT_CAUSAL: gl.constexpr):
    """Consumer W's steps over query head off_h's q list for the key block, from the program's step `it` on:
    (dk, dv, it) after them. CAUSAL: P = 0 where a key lies past the query row (key > row, absolute indices);
    SPLIT_CAUSAL: the test only in the steps that cross the diagonal, a prefix of the list (_crossing_steps), the
    rest in a loop of their own without it. LAGGED_DQ: each step computes the dQ of the step before and the walk's
    last one follows it, so the two consumers need not meet within a step; the second starts its first step once
    the first has its first scores, so that their exponentials need not fall at the same time. OWN_KEYS (D = 64):
    each step's dQ share is over the consumer's own keys (k_dq its rows of K), not over all 128 for its columns."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    first_key = start_n + W * _KEYS
    if OWN_KEYS:
        dq_column: gl.constexpr = 0
    else:
        dq_column: gl.constexpr = W * _KEYS
    steps, index_row = _q_list(shared, off_b, off_h, key_block, BLOCK_Q)
    pending_row0 = first_key * 0  # LAGGED_DQ: the first row of the step whose dQ is still to come
    walk = (index_row, it, off_b, off_h, first_key, k_half, v_half, k_dq, dq_tile, st_zero)
    if CAUSAL and SPLIT_CAUSAL:
        crossing = _crossing_steps(index_row, steps, first_key, BLOCK_Q)
        dk, dv, pending_row0 = _head_steps(shared, walk, 0, crossing, dk, dv, pending_row0, W, BLOCK_Q, STAGES,
                                           True, LAGGED_DQ, OWN_KEYS)
        dk, dv, pending_row0 = _head_steps(shared, walk, crossing, steps, dk, dv, pending_row0, W, BLOCK_Q, STAGES,
                                           False, LAGGED_DQ, OWN_KEYS)
    else:
        dk, dv, pending_row0 = _head_steps(shared, walk, 0, steps, dk, dv, pending_row0, W, BLOCK_Q, STAGES, CAUSAL,
                                           LAGGED_DQ, OWN_KEYS)
    if LAGGED_DQ:
        if steps > 0:  # the walk's last dQ
            dq = _dq_product(ds_smem, ds_ready, k_dq, st_zero, it + steps - 1, W, OWN_KEYS)
            dq = warpgroup_mma_wait(0, deps=(dq, ))
            _add_dq(DQ_DESC, dq_smem, dq_tile, dq, off_b, off_h, pending_row0, dq_column, W)
    return dk, dv, it + steps


@gluon.jit
def _crossing_steps(index_row, steps, first_key, BLOCK_Q: gl.constexpr):
    """How many of a q list's first steps (of `steps`) the diagonal of the consumer's keys first_key .. first_key+63
    crosses: those whose first row lies before its last key, so that some key lies past some row. The list is
    ascending, so they lead it, and the scan stops at the first step past them (one or two steps in)."""
    count = steps * 0
    scanning = steps > 0
    while scanning:
        crosses = _first_row(index_row, count, BLOCK_Q) < first_key + _KEYS - 1
        count = count + crosses.to(gl.int32)
        scanning = crosses & (count < steps)
    return count


@gluon.jit
def _head_steps(shared, walk, start, end, dk, dv, pending_row0, W: gl.constexpr, BLOCK_Q: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, LAGGED_DQ: gl.constexpr, OWN_KEYS: gl.constexpr):
    """Steps start .. end-1 of _head_walk's walk (walk: its list, first program step, place and operands, as
    _head_walk packs them): (dk, dv, pending_row0) after them. CAUSAL: the steps take the causal test."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    index_row, it, off_b, off_h, first_key, k_half, v_half, k_dq, dq_tile, st_zero = walk
    D: gl.constexpr = Q_DESC.block_type.shape[3]
    if OWN_KEYS:
        dq_column: gl.constexpr = 0
    else:
        dq_column: gl.constexpr = W * _KEYS
    terms_rows = _terms_rows(terms_smem, STAGES)
    for step in range(start, end):
        i = it + step  # the program's step: the ring's and the dS buffers' phases
        stage = i % STAGES
        row0 = _first_row(index_row, step, BLOCK_Q)
        if LAGGED_DQ:
            if W == 1:
                if i == 0:  # the staggered start
                    mbarrier.wait(start_gate, 0)
        q_tile, do_tile, dst, pt_op = _step_scores(shared, k_half, v_half, terms_rows, st_zero, i, row0, first_key,
                                                   W, STAGES, CAUSAL, LAGGED_DQ)
        dst_op = gl.convert_layout(dst, _operand_layout(D))  # dK's A operand from registers
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
        if LAGGED_DQ:
            if step > 0:
                # the step before's dQ: the other consumer stored its half of that dS^T at the end of its step
                dq = _dq_product(ds_smem, ds_ready, k_dq, st_zero, i - 1, W, OWN_KEYS)
                dq = warpgroup_mma_wait(0, deps=(dq, ))  # and so this step's products before it
                mbarrier.arrive(q_empty.index(stage), count=1)
                _add_dq(DQ_DESC, dq_smem, dq_tile, dq, off_b, off_h, pending_row0, dq_column, W)
            # (a wgmma's result is a different type until waited for, so the branch cannot rebind dv and dk)
            dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
            if step == 0:
                mbarrier.arrive(q_empty.index(stage), count=1)
            # The buffer's last contents (step i-2's dS^T) have been read: by this consumer (just above, or at the
            # end of the walk before), and by the other before it stored its half of step i-1's, which this one
            # waited for (at i = 0, 1 the buffer is unused).
            _store_ds_half(ds_smem, ds_ready, dst, i, W)
            pending_row0 = row0
        else:
            # dS^T's half into shared memory: dQ's product runs over all 128 keys, so it waits for both halves.
            # Two buffers: a consumer writes one again two steps on, after the other has met it at the one between.
            _store_ds_half(ds_smem, ds_ready, dst, i, W)
            dq = _dq_product(ds_smem, ds_ready, k_dq, st_zero, i, W, OWN_KEYS)
            dv, dk, dq, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, pt_op, dst_op))
            mbarrier.arrive(q_empty.index(stage), count=1)
            _add_dq(DQ_DESC, dq_smem, dq_tile, dq, off_b, off_h, row0, dq_column, W)
    return dk, dv, pending_row0


@gluon.jit
def _pair_list(shared, off_b, off_hkv, tile, BLOCK_Q: gl.constexpr):
    """PAIRED: (steps, common, index_row) of kv head off_hkv's list for 64-key tile `tile`, in pair_lists' layout
    (GQA: merge_group_lists', over the group's query heads): its 64-row steps, how many of them lead it because the
    program's other tile lists them too, and its pointer."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    TILES: gl.constexpr = BLOCK_Q // _ROWS
    counts = Q_COUNT + off_b * stride_cb + off_hkv * stride_ch + 2 * tile
    index_row = Q_INDEX + off_b.to(gl.int64) * stride_ib + off_hkv.to(gl.int64) * stride_ih + tile * stride_ik
    return gl.load(counts) * TILES, gl.load(counts + 1) * TILES, index_row


@gluon.jit
def _first_head(off_hkv, group_size, GROUPED: gl.constexpr):
    """PAIRED: the first query head of kv head off_hkv's group, the one a merged list's heads count from. Not GROUPED:
    off_hkv itself, without the product by group_size (1), which MHA's walk would keep live (ptxas then spilled
    16 more bytes a thread, Triton 3.6)."""
    if GROUPED:
        return off_hkv * group_size
    return off_hkv


@gluon.jit
def _paired_place(step, common, both, W: gl.constexpr):
    """PAIRED: where step `step` of consumer W's walk (GQA: over all the group's heads) falls among the program's
    steps, as the loader takes them. A walk starts with the `common` steps both tiles' lists hold (the same in both
    walks), one stage each, which both consumers read; then its own rest, the two rests one step of
    each in turn while both last (`both` steps each), then the longer rest. A consumer's next step is thus at most 2
    places on, at most one round of a ring of 2 or more stages on: two rounds on, its wait on a stage's parity could
    not tell that round's load from the one before (kernels/README.md, "Paired programs")."""
    # Common steps (step < common) fall at `step`; a rest's step r = step - common at common + 2r + W while r < both,
    # at common + both + r after: in one expression, without branches (fewer registers live in the walk's loop).
    return step + gl.minimum(gl.maximum(step - common + W, 0), both)


@gluon.jit
def _paired_walk(shared, dk, dv, common, both, off_b, first_head, start_n, index_row, steps, k_half, v_half, dq_tile,
                 st_zero, W: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, GROUPED: gl.constexpr,
                 CAUSAL: gl.constexpr, SUMMED_DQ: gl.constexpr):
    """PAIRED: consumer W's walk over its own 64-key tile's list (keys start_n..; `steps` steps at index_row,
    pair_lists' layout, GQA merge_group_lists' over the query heads first_head..): (dk, dv) after it. `common` and
    `both` place the steps in the ring's order (_paired_place); the walk's first `common` steps are common ones (both
    tiles list them). A step's stage is released once dV and dK have read it: by each consumer for a common step, for
    both by the one consumer otherwise. A step's dQ is over the consumer's own keys, all of D's columns, 64 at a time
    through the consumer's dQ tile (_own_dq); SUMMED_DQ: a common step's is over both tiles' 128 keys (_common_dq),
    added once, not once per tile. CAUSAL as in _head_walk."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    terms_rows = _terms_rows(terms_smem, STAGES)
    # The buffer of this consumer's dS^T [64 keys, 64 rows] on rest steps. SUMMED_DQ: the one the last common step
    # did not use, which the other consumer read last at the common step before (and was done with before it stored
    # its half of the last one, which this consumer waited for); a common step's is that step's (_common_dq).
    own_buffer = common * 0
    if SUMMED_DQ:
        own_buffer = common % 2
    for walked in range(steps):  # the step's place in this consumer's walk
        i = _paired_place(walked, common, both, W)  # and in the ring's order
        stage = i % STAGES
        g, row0 = _step_rows(index_row, walked, BLOCK_Q, GROUPED)
        off_h = first_head + g
        q_tile, do_tile, dst, pt_op = _step_scores(shared, k_half, v_half, terms_rows, st_zero, i, row0, start_n, W,
                                                   STAGES, CAUSAL, False)
        rest = walked >= common
        buffer = own_buffer
        if SUMMED_DQ:
            buffer = gl.where(rest, own_buffer, walked % 2)
        # (the step before's dQ products, which read the buffer, were waited for)
        ds_t = ds_smem.index(buffer).slice(W * _KEYS, _KEYS, dim=0)
        # dS^T into shared memory first, where the dK product reads it: its registers (and an operand copy of them)
        # are then free during the products. From registers ptxas spilled in the loop at D = 128 (28 stack stores
        # against 9, sm_90 SASS, Triton 3.6); at D = 64 the two measured the same (twenty-eighth session).
        ds_t.store(dst)
        fence_async_shared()
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        dk = warpgroup_mma(ds_t, q_tile, dk, is_async=True)
        if SUMMED_DQ:
            mbarrier.arrive(ds_ready.index(buffer), count=1, pred=not rest)  # this half of a common step is in
        dv, dk, pt_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op))
        mbarrier.arrive(q_empty.index(stage), count=1)
        mbarrier.arrive(q_empty.index(stage), count=1, pred=rest)  # the other's share: not its step
        if SUMMED_DQ:
            if rest:
                _own_dq(shared, ds_t, k_half, dq_tile, st_zero, off_b, off_h, row0, W)
            else:
                _common_dq(shared, dq_tile, st_zero, walked, off_b, off_h, row0, W)
        else:
            _own_dq(shared, ds_t, k_half, dq_tile, st_zero, off_b, off_h, row0, W)
    return dk, dv


@gluon.jit
def _own_dq(shared, ds_t, k_half, dq_tile, st_zero, off_b, off_h, row0, W: gl.constexpr):
    """PAIRED: a step's dQ over consumer W's own 64 keys (k_half: their rows of K), all of D's columns, added 64
    columns at a time through its dQ tile, from its dS^T in ds_t."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    D: gl.constexpr = Q_DESC.block_type.shape[3]
    for block in gl.static_range(D // _KEYS):  # 64 columns at a time: one fp32 accumulator live, not two
        dq = warpgroup_mma(ds_t.permute((1, 0)), k_half.slice(block * _KEYS, _KEYS, dim=1), st_zero, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        _add_dq(DQ_DESC, dq_smem, dq_tile, dq, off_b, off_h, row0, block * _KEYS, W)


@gluon.jit
def _common_dq(shared, dq_tile, st_zero, walked, off_b, off_h, row0, W: gl.constexpr):
    """PAIRED, SUMMED_DQ: common step `walked` (both tiles keep its rows) of consumer W, its dS^T half in the step's
    buffer: once the other's half is there too, dQ over both tiles' 128 keys, added once. D = 128: this
    consumer's 64 columns of it; D = 64: all of it, by one consumer a step, in turn. Two buffers: a consumer writes
    one again two common steps on, after the other has met it at the one between (so is done reading it)."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    D: gl.constexpr = Q_DESC.block_type.shape[3]
    # D = 128: this consumer's 64 columns of each tile's K; D = 64: all of them (a [64, 64] tile's one column block)
    COLUMN: gl.constexpr = W * _KEYS if D == 2 * _KEYS else 0
    buf = walked % 2
    mbarrier.wait(ds_ready.index(buf), (walked // 2) & 1)
    if D == 2 * _KEYS or buf == W:
        first_t = ds_smem.index(buf).slice(0, _KEYS, dim=0).permute((1, 0))  # dS [64 rows, the first tile's keys]
        second_t = ds_smem.index(buf).slice(_KEYS, _KEYS, dim=0).permute((1, 0))
        dq = warpgroup_mma(first_t, k_smem.index(0).slice(COLUMN, _KEYS, dim=1), st_zero, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(second_t, k_smem.index(1).slice(COLUMN, _KEYS, dim=1), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        _add_dq(DQ_DESC, dq_smem, dq_tile, dq, off_b, off_h, row0, COLUMN, W)


@gluon.jit
def _consumer(shared, W: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr, STAGES: gl.constexpr,
              GROUPED: gl.constexpr, CAUSAL: gl.constexpr, LAGGED_DQ: gl.constexpr, ORDERED: gl.constexpr,
              PAIRED: gl.constexpr, SUMMED_DQ: gl.constexpr, KV_SPLIT: gl.constexpr, SPLIT_CAUSAL: gl.constexpr):
    """Keys W*64 .. W*64+63 of the program's tile: dK and dV over the group's q lists, stored at the end, and dQ's
    columns W*64 .. W*64+63 of each step (at D = 64 all columns over its own keys), added into the fp32 buffer behind
    DQ_DESC (without the softmax scale). PAIRED: the program's second 64-key tile, its own walks (_paired_walk).
    shared: the kernel's arguments and buffers, as attention_bwd_ws_kernel packs them."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    off_b, off_hkv, start_n, key_block = _program(shared, W, BLOCK_KV, ORDERED, PAIRED)
    D: gl.constexpr = Q_DESC.block_type.shape[3]
    dtype: gl.constexpr = Q_DESC.dtype
    # [64 keys, 64 rows] scores (and dQ's [64 rows, 64 columns]); [64 keys, D] gradients
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, 64, 16])
    acc_layout: gl.constexpr = _gradient_layout(D)
    dk = gl.zeros([_KEYS, D], gl.float32, acc_layout)
    dv = gl.zeros([_KEYS, D], gl.float32, acc_layout)
    st_zero = gl.zeros([_KEYS, _ROWS], gl.float32, st_layout)
    OWN_KEYS: gl.constexpr = D != 2 * _KEYS  # D = 64: dQ over the consumer's own keys (HEAD_DIMS' comment)
    if PAIRED:
        k_half = k_smem.index(W)                         # [64 keys, D]; _paired_walk takes dQ's columns from it
        v_half = v_smem.index(W)
    else:
        k_half = k_smem.slice(W * _KEYS, _KEYS, dim=0)   # [64 keys, D]
        v_half = v_smem.slice(W * _KEYS, _KEYS, dim=0)
        if OWN_KEYS:
            k_dq = k_half                                # all of D's columns, over its own keys
        else:
            k_dq = k_smem.slice(W * _KEYS, _KEYS, dim=1)  # [128 keys, 64 of D]: this consumer's dQ columns
    dq_tile = _box(dq_smem.index(W))
    mbarrier.wait(kv_ready, 0)
    # The MHA walk is one loop: a loop over the group around it keeps more state live across the inner one, and
    # ptxas spilled three times as much (sm_90 SASS, Triton 3.6).
    if PAIRED:
        # one walk per consumer (GQA: over the group's heads, one merged list): the steps both tiles list first,
        # then its own rest
        _, _, _, other_tile = _program(shared, 1 - W, BLOCK_KV, ORDERED, PAIRED)
        steps, common, index_row = _pair_list(shared, off_b, off_hkv, key_block, BLOCK_Q)
        other_steps, _, _ = _pair_list(shared, off_b, off_hkv, other_tile, BLOCK_Q)
        dk, dv = _paired_walk(shared, dk, dv, common, gl.minimum(steps, other_steps) - common, off_b,
                              _first_head(off_hkv, group_size, GROUPED), start_n, index_row, steps, k_half, v_half,
                              dq_tile, st_zero, W, BLOCK_Q, STAGES, GROUPED, CAUSAL, SUMMED_DQ)
    elif GROUPED:
        it = 0  # steps so far, over the group's heads: the ring's and the dS buffers' phases
        for g in range(group_size):
            dk, dv, it = _head_walk(shared, dk, dv, it, off_b, off_hkv * group_size + g, start_n, key_block, k_half,
                                    v_half, k_dq, dq_tile, st_zero, W, BLOCK_Q, STAGES, CAUSAL, LAGGED_DQ,
                                    OWN_KEYS, SPLIT_CAUSAL)
    else:
        dk, dv, _ = _head_walk(shared, dk, dv, 0, off_b, off_hkv, start_n, key_block, k_half, v_half, k_dq,
                               dq_tile, st_zero, W, BLOCK_Q, STAGES, CAUSAL, LAGGED_DQ, OWN_KEYS, SPLIT_CAUSAL)
    if PAIRED:
        first_key = start_n  # its own 64-key tile's
    else:
        first_key = start_n + W * _KEYS
    tma.store_wait(0)  # the last dQ reduction has read its tile
    if KV_SPLIT > 1:
        # one part of the kv head's group: its share added into fp32 sums (DK_DESC / DV_DESC of [B, Hkv, Sk, D]
        # zeroed, [1, 1, 64, 64] boxes), 64 columns at a time through its dQ tile
        kv_head = off_hkv // KV_SPLIT
        _add_columns(DK_DESC, dq_smem, dq_tile, dk * (scale_log2 / _LOG2E), off_b, kv_head, first_key, W)
        _add_columns(DV_DESC, dq_smem, dq_tile, dv, off_b, kv_head, first_key, W)
        tma.store_wait(0)  # before the program's shared memory goes
    elif GROUPED:
        # stores from the accumulator's layout: the TMA path below made GQA 32/8 S16k 2-3% slower (its loop's
        # registers come out worse), MHA 1-5% faster (twenty-third session)
        keys = first_key + gl.arange(0, _KEYS, gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, D, gl.SliceLayout(0, acc_layout))
        gl.store(DK + off_b.to(gl.int64) * stride_dkb + off_hkv.to(gl.int64) * stride_dkh
                 + keys.to(gl.int64)[:, None] * stride_dks + cols[None, :], (dk * (scale_log2 / _LOG2E)).to(dtype))
        gl.store(DV + off_b.to(gl.int64) * stride_dvb + off_hkv.to(gl.int64) * stride_dvh
                 + keys.to(gl.int64)[:, None] * stride_dvs + cols[None, :], dv.to(dtype))
    else:
        _store_through_tma(DK_DESC, DV_DESC, dq_smem.index(W), dk * (scale_log2 / _LOG2E), dv,
                           [off_b, off_hkv, first_key, 0])


@gluon.jit
def _add_columns(DESC, dq_smem, dq_tile, acc, off_b, off_h, row0, W: gl.constexpr):
    """Add consumer W's fp32 [64, D] acc at rows row0.. of head off_h of DESC's tensor, 64 columns at a time."""
    if acc.shape[1] == _KEYS:
        _add_dq(DESC, dq_smem, dq_tile, acc, off_b, off_h, row0, 0, W)
    else:
        first, second = acc.reshape([_KEYS, 2, _KEYS]).permute((0, 2, 1)).split()
        _add_dq(DESC, dq_smem, dq_tile, first, off_b, off_h, row0, 0, W)
        _add_dq(DESC, dq_smem, dq_tile, second, off_b, off_h, row0, _KEYS, W)


@gluon.jit
def _store_through_tma(DK_DESC, DV_DESC, tile, dk, dv, coord):
    """dk and dv (fp32 [64 keys, D]) into the [1, 1, 64, D] boxes at coord through the TMA unit, staged in turn in
    the free fp32 tile `tile` (a dQ tile: 16 KiB, as a [64, D] tile of the gradients' dtype at D = 128)."""
    dtype: gl.constexpr = DK_DESC.dtype
    D: gl.constexpr = DK_DESC.block_type.shape[3]
    out_tile = _reinterpret(tile, dtype, [_KEYS, D], gl.NVMMASharedLayout.get_default_for([_KEYS, D], dtype))
    out_tile.store(dk.to(dtype))
    fence_async_shared()
    tma_store(DK_DESC, coord, _box(out_tile))
    tma.store_wait(0)
    out_tile.store(dv.to(dtype))
    fence_async_shared()
    tma_store(DV_DESC, coord, _box(out_tile))
    tma.store_wait(0)  # before the program's shared memory goes


@gluon.jit
def _load_step(shared, it, off_b, off_h, index_row, step, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
               HEAD_IN_ENTRY: gl.constexpr):
    """The loader's program step `it`: step `step` of query head off_h's q list at index_row (its 64-row tiles of Q
    and dO and their rows' lse2 and delta) into the ring's stage it % STAGES, once its consumers have released it.
    HEAD_IN_ENTRY: a merged list's step (merge_group_lists), of query head off_h + the head's place it holds."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    stage = it % STAGES
    # a fresh barrier counts as released in the phase before its first: the first round goes at once
    mbarrier.wait(q_empty.index(stage), ((it // STAGES) & 1) ^ 1)
    g, row0 = _step_rows(index_row, step, BLOCK_Q, HEAD_IN_ENTRY)
    off_h = off_h + g
    mbarrier.expect(q_ready.index(stage), Q_DESC.block_type.nbytes + DO_DESC.block_type.nbytes
                    + TERMS_DESC.block_type.nbytes)
    tma_load(Q_DESC, [off_b, off_h, row0, 0], q_ready.index(stage), _box(q_smem.index(stage)))
    tma_load(DO_DESC, [off_b, off_h, row0, 0], q_ready.index(stage), _box(do_smem.index(stage)))
    tma_load(TERMS_DESC, [off_b, off_h, 0, row0], q_ready.index(stage), _box(terms_smem.index(stage)))


@gluon.jit
def _loader(shared, W: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr, STAGES: gl.constexpr,
            GROUPED: gl.constexpr, CAUSAL: gl.constexpr, LAGGED_DQ: gl.constexpr, ORDERED: gl.constexpr,
            PAIRED: gl.constexpr, SUMMED_DQ: gl.constexpr, KV_SPLIT: gl.constexpr):
    """One warp: the tile's K and V, then each step's Q and dO tiles and its rows' lse2 and delta into the ring, a stage
    once its consumers have released it. PAIRED: both 64-key tiles' K and V, then both consumers' walks (GQA: over
    the group's heads), one step of each in turn while both last (_paired_place). (Same parameters as _consumer:
    Gluon's worker partitions share one signature.)"""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem, k_smem,
     v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT, Q_INDEX, TILE_ORDER,
     scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih, stride_ik, stride_ob, stride_oh,
     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs) = shared
    off_b, off_hkv, start_n, key_block = _program(shared, 0, BLOCK_KV, ORDERED, PAIRED)
    kv_head = off_hkv // KV_SPLIT  # (KV_SPLIT: off_hkv is one of the kv head's parts)
    if PAIRED:
        _, _, second_n, second_block = _program(shared, 1, BLOCK_KV, ORDERED, PAIRED)
        mbarrier.expect(kv_ready, 2 * (K_DESC.block_type.nbytes + V_DESC.block_type.nbytes))
        tma_load(K_DESC, [off_b, kv_head, start_n, 0], kv_ready, _box(k_smem.index(0)))
        tma_load(V_DESC, [off_b, kv_head, start_n, 0], kv_ready, _box(v_smem.index(0)))
        tma_load(K_DESC, [off_b, kv_head, second_n, 0], kv_ready, _box(k_smem.index(1)))
        tma_load(V_DESC, [off_b, kv_head, second_n, 0], kv_ready, _box(v_smem.index(1)))
        # The steps both tiles' lists hold (the same in both lists; GQA: merged lists over the group's heads), one
        # stage each, which both consumers read; then both rests, one step of each in turn while both last, then the
        # longer one's (_paired_place).
        first_steps, common, first_row = _pair_list(shared, off_b, off_hkv, key_block, BLOCK_Q)
        second_steps, _, second_row = _pair_list(shared, off_b, off_hkv, second_block, BLOCK_Q)
        first_head = _first_head(off_hkv, group_size, GROUPED)
        for step in range(common):
            _load_step(shared, step, off_b, first_head, first_row, step, BLOCK_Q, STAGES, GROUPED)
        first_step = common
        second_step = common
        first_rest = first_steps - common
        second_rest = second_steps - common
        both = gl.minimum(first_rest, second_rest)
        rest_second = second_rest > first_rest
        for t in range(first_rest + second_rest):
            second = rest_second
            if t < 2 * both:
                second = (t % 2) == 1
            if second:
                _load_step(shared, common + t, off_b, first_head, second_row, second_step, BLOCK_Q, STAGES, GROUPED)
                second_step += 1
            else:
                _load_step(shared, common + t, off_b, first_head, first_row, first_step, BLOCK_Q, STAGES, GROUPED)
                first_step += 1
    else:
        mbarrier.expect(kv_ready, K_DESC.block_type.nbytes + V_DESC.block_type.nbytes)
        tma_load(K_DESC, [off_b, kv_head, start_n, 0], kv_ready, _box(k_smem))
        tma_load(V_DESC, [off_b, kv_head, start_n, 0], kv_ready, _box(v_smem))
        it = 0
        for g in range(group_size):
            off_h = off_hkv * group_size + g
            steps, index_row = _q_list(shared, off_b, off_h, key_block, BLOCK_Q)
            for step in range(steps):
                _load_step(shared, it, off_b, off_h, index_row, step, BLOCK_Q, STAGES, False)
                it += 1


@gluon.jit
def attention_bwd_ws_kernel(Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, DK, DV,
                            Q_COUNT, Q_INDEX, TILE_ORDER, scale_log2, kv_heads, group_size, stride_cb, stride_ch,
                            stride_ib, stride_ih, stride_ik, stride_ob, stride_oh, stride_dkb, stride_dkh, stride_dks,
                            stride_dvb, stride_dvh, stride_dvs, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr,
                            STAGES: gl.constexpr, GROUPED: gl.constexpr, CAUSAL: gl.constexpr,
                            LAGGED_DQ: gl.constexpr, ORDERED: gl.constexpr, PAIRED: gl.constexpr,
                            SUMMED_DQ: gl.constexpr, KV_SPLIT: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                            SPLIT_CAUSAL: gl.constexpr = False):
    """Grid (Sk / 128, launch.batch_head_axes(B, Hkv)). Q_DESC / DO_DESC: Gluon host descriptors of q and dO [B, H, Sq,
    D] with [1, 1, 64, D] boxes (D = 64 or 128); K_DESC / V_DESC of k, v [B, Hkv, Sk, D] with [1, 1, 128, D]; DQ_DESC of
    a zeroed fp32 [B, H, Sq, D] buffer with [1, 1, 64, 64] boxes (it gets dS K without the softmax scale). TERMS_DESC of
    the row terms (backward._row_terms) fp32 [B, H, 2, Sq] (lse2, delta) with [1, 1, 2, 64] boxes. Q_COUNT int32 [Bm,
    Hm, nk], Q_INDEX int32 [Bm, Hm, nk, L] (size-1 mask dims with stride 0). ORDERED: TILE_ORDER int32 [Bm, Hkv or 1, Sk
    / 128] (tile_order; PAIRED: Sk / 64) gives each (batch, kv head)'s tiles in the order its programs take them.
    DK_DESC / DV_DESC of dk, dv [B, Hkv, Sk, D] with [1, 1, 64, D] boxes, for MHA calls; DK / DV the same tensors,
    last dim contiguous, for GQA calls. Sk is a multiple of BLOCK_KV and of 128; BLOCK_KV is a multiple of 128 or
    (PAIRED) of 64 only; BLOCK_Q is a multiple of 64. PAIRED: a program takes two 64-key tiles (K_DESC / V_DESC with
    [1, 1, 64, D] boxes), each consumer one, with their own walks, and Q_COUNT int32 [Bm, Hm, Sk / 64, 2] / Q_INDEX
    int32 [Bm, Hm, Sk / 64, C] are pair_lists': a row per tile, the steps both of a program's tiles list first (GQA:
    merge_group_lists', [Bm, Hkv or 1, Sk / 64, ...], one row per kv head's tile over its group's query heads).
    GROUPED: a program's walk covers several query heads. KV_SPLIT > 1: each kv head's group of query heads is split
    in KV_SPLIT parts, and the programs' kv heads (the grid's, lists', order's: kv_heads = Hkv * KV_SPLIT, group_size
    a part's heads) are these parts, which load kv head off_hkv // KV_SPLIT's K and V; DK_DESC / DV_DESC then
    describe zeroed fp32 sums [B, Hkv, Sk, D] with [1, 1, 64, 64] boxes, into which each program adds its dK
    (scaled) and dV. CAUSAL: only keys at or before each query row count (the lists those of BlockSparsity.causal()
    or fewer). LAGGED_DQ (not PAIRED): each step computes the step before's dQ, the second consumer starting after
    the first. SUMMED_DQ (PAIRED): a common step's dQ is over both tiles' keys, added once."""
    D: gl.constexpr = Q_DESC.block_type.shape[3]
    dtype: gl.constexpr = Q_DESC.dtype
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, D], dtype)
    key_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * _KEYS, D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * _KEYS, _ROWS], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, _KEYS], gl.float32)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, _ROWS, D], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, _ROWS, D], row_layout)
    # each step's rows' lse2 and delta: 64 fp32 each, unswizzled (256-byte rows)
    terms_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2, _ROWS], gl.float32)
    terms_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 2, _ROWS], terms_layout)
    if PAIRED:  # a [64 keys, D] tile of K and V per consumer, loaded apart; its dS^T in its half of one buffer
        k_smem = gl.allocate_shared_memory(dtype, [2, _KEYS, D], row_layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, _KEYS, D], row_layout)
        # SUMMED_DQ: two buffers, as the 128-key programs have, for the common steps at which the consumers meet
        ds_smem = gl.allocate_shared_memory(dtype, [2 if SUMMED_DQ else 1, 2 * _KEYS, _ROWS], ds_layout)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [2 * _KEYS, D], key_layout)
        v_smem = gl.allocate_shared_memory(dtype, [2 * _KEYS, D], key_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * _KEYS, _ROWS], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, _ROWS, _KEYS], dq_layout)  # one dQ tile per consumer
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    start_gate = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # LAGGED_DQ's staggered start
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(start_gate, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        # both consumers release a stage (PAIRED: a stage of one consumer's step, that one for both)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both consumers' halves of dS^T
    fence_async_shared()
    shared = (Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, TERMS_DESC, DK_DESC, DV_DESC, q_smem, do_smem, terms_smem,
              k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready, start_gate, DK, DV, Q_COUNT,
              Q_INDEX, TILE_ORDER, scale_log2, kv_heads, group_size, stride_cb, stride_ch, stride_ib, stride_ih,
              stride_ik, stride_ob, stride_oh, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs)
    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    gl.warp_specialize([
        (_consumer, (shared, FIRST, BLOCK_Q, BLOCK_KV, STAGES, GROUPED, CAUSAL, LAGGED_DQ, ORDERED, PAIRED,
                       SUMMED_DQ, KV_SPLIT, SPLIT_CAUSAL)),
        (_consumer, (shared, SECOND, BLOCK_Q, BLOCK_KV, STAGES, GROUPED, CAUSAL, LAGGED_DQ, ORDERED, PAIRED,
                       SUMMED_DQ, KV_SPLIT, SPLIT_CAUSAL)),
        (_loader, (shared, FIRST, BLOCK_Q, BLOCK_KV, STAGES, GROUPED, CAUSAL, LAGGED_DQ, ORDERED, PAIRED,
                       SUMMED_DQ, KV_SPLIT)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, block_q: int, block_kv: int, *,
         is_causal: bool, token_mask, block_mask, kv_valid, varlen, min_work: int) -> bool:
    """Whether this kernel can run the backward of q [B, H, Sq, D], k / v [B, Hkv, Sk, D] with grad_out like q
    over q lists at (block_q, block_kv): ENABLED, a Hopper GPU (compute capability 9.0, for wgmma), not
    deterministic mode (the dQ adds' order varies), and qualifies()."""
    if not ENABLED or q.device.type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return False
    return (qualifies(q, k, v, grad_out, block_q, block_kv, is_causal=is_causal, token_mask=token_mask,
                      block_mask=block_mask, kv_valid=kv_valid, varlen=varlen, min_work=min_work)
            and launch.device_capability(q.device) == (9, 0))


def qualifies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, block_q: int, block_kv: int,
              *, is_causal: bool, token_mask, block_mask, kv_valid, varlen, min_work: int) -> bool:
    """plan()'s conditions on the call, whatever the device: no element tests but the causal one (no token_mask,
    block_mask, kv_valid or varlen, Sk a multiple of block_kv); bf16 or fp16 for q, k, v and grad_out alike; D = Dv in
    HEAD_DIMS; block_kv a multiple of 64 (not of 128: paired programs, then at most 2 ** HEAD_BITS query heads a kv
    head) and block_q of 64; Sk a multiple of 128; at least min_work of dense work (B * H * Sq * Sk * D); every
    tensor's last dim contiguous, its other strides positive (a broadcast gradient has zeros) and, with its start,
    16-byte aligned (TMA's rule)."""
    if any(x is not None for x in (token_mask, block_mask, kv_valid, varlen)):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k.dtype == v.dtype == grad_out.dtype):
        return False
    batch, heads, seq_q, dim = q.shape
    seq_kv = k.shape[2]
    if (dim not in HEAD_DIMS or v.shape[-1] != dim or block_kv % CONSUMER_KEYS or block_q % STEP_ROWS
            or seq_kv % block_kv or seq_kv % TILE_N):
        return False
    if batch * heads * seq_q * seq_kv * dim < min_work:
        return False
    if block_kv % TILE_N and heads // k.shape[1] > 2 ** HEAD_BITS:  # merge_group_lists' bound
        return False
    return all(map(tma_readable, (q, k, v, grad_out)))


def _tiling(block_kv: int, grouped: bool) -> tuple:
    """(paired, tile_keys, stages) for key blocks of block_kv keys, GQA (grouped) or not: whether the programs are
    paired (block_kv not a multiple of 128), the keys of the tiles K_DESC / V_DESC and TILE_ORDER hold, and the
    ring's stages."""
    paired = block_kv % TILE_N != 0
    if not paired:
        return paired, TILE_N, STAGES
    return paired, CONSUMER_KEYS, PAIRED_STAGES if grouped else PAIRED_MHA_STAGES


def attention_backward_ws(q, k, v, grad_out, row_terms, q_count, q_index, block_q: int, block_kv: int,
                          scale_log2: float, causal: bool, dq_acc, dk, dv) -> None:
    """Run the kernel: dS K (unscaled) added into dq_acc (fp32 [B, H, Sq, D], zeroed, contiguous), dk and dv
    [B, Hkv, Sk, D] stored. row_terms fp32 [B, H, 2, Sq]: lse2 and delta (backward._row_terms), from
    row_terms_buffer. causal: the key <= query test on the steps the diagonal crosses. Paired GQA calls may split
    each kv head's group in parts (kv_split), whose dK and dV shares go through fp32 sums converted here."""
    batch, heads = q.shape[:2]
    kv_heads, seq_kv = k.shape[1], k.shape[2]
    split = 1
    if heads != kv_heads and block_kv % TILE_N:  # paired GQA (KV_SPLIT's comment)
        split = kv_split(heads, kv_heads, q.shape[2], q.shape[3], _l2_bytes(q.device))
    parts = kv_heads * split  # the programs' kv heads: each kv head's parts of its group
    ordered = ORDERED
    paired, tile_keys, stages = _tiling(block_kv, heads != parts)
    summed = paired and PAIRED_COMMON_FIRST and PAIRED_SUMMED_DQ
    split_causal = _splits_causal(heads != parts, q.shape[3], causal, paired)
    order = q_count  # (unordered, the kernel reads no order: q_count stands in for the pointer)
    matched = ordered and paired and PAIR_BY_SHARED and backward_uses(q_count, q_index) >= MATCH_FROM_USE
    if matched:
        order = cached_paired_tile_order(q_count, q_index, parts, block_kv // tile_keys)
    elif ordered:
        order = cached_tile_order(q_count, parts, block_kv // tile_keys)
    if paired:  # per-tile lists, the steps both tiles of a program list first (GQA: merged over the group)
        q_count, q_index = cached_pair_lists(q_count, q_index, order if ordered else None, parts,
                                             block_kv // tile_keys, heads // parts, matched)
    dk_out, dv_out = dk, dv
    if split > 1:  # fp32 sums the parts' programs add into
        dk_out, dv_out = torch.zeros(2, *dk.shape, dtype=torch.float32, device=dk.device).unbind(0)

    def arguments():
        columns = CONSUMER_KEYS if split > 1 else None  # (the fp32 sums': [1, 1, 64, 64] boxes)
        descriptors = dict(Q_DESC=host_descriptor(q, STEP_ROWS), K_DESC=host_descriptor(k, tile_keys),
                           V_DESC=host_descriptor(v, tile_keys), DO_DESC=host_descriptor(grad_out, STEP_ROWS),
                           DQ_DESC=host_descriptor(dq_acc, STEP_ROWS, CONSUMER_KEYS),
                           TERMS_DESC=host_descriptor(row_terms, 2, STEP_ROWS),
                           DK_DESC=host_descriptor(dk_out, CONSUMER_KEYS, columns),
                           DV_DESC=host_descriptor(dv_out, CONSUMER_KEYS, columns))
        static = dict(
            scale_log2=scale_log2, kv_heads=parts, group_size=heads // parts,
            # the lists' size-1 batch and head dims broadcast: stride 0
            **stride_args("c", q_count, "bh"), **stride_args("i", q_index, "bhk"), **stride_args("o", order, "bh"),
            **stride_args("dk", dk_out, "bhs"), **stride_args("dv", dv_out, "bhs"), BLOCK_Q=block_q,
            BLOCK_KV=block_kv, STAGES=stages, GROUPED=heads != parts, CAUSAL=causal, LAGGED_DQ=LAGGED_DQ,
            ORDERED=ordered, PAIRED=paired, SUMMED_DQ=summed, KV_SPLIT=split, CONSUMER_REGS=CONSUMER_REGS,
            LOADER_REGS=LOADER_REGS, SPLIT_CAUSAL=split_causal)
        return (seq_kv // TILE_N, *launch.batch_head_axes(batch, parts)), descriptors, static
    launch_warp_specialized(attention_bwd_ws_kernel,
                            (block_q, block_kv, scale_log2, causal, stages, LAGGED_DQ, ordered, summed, split,
                             split_causal),
                            dict(Q_DESC=q, K_DESC=k, V_DESC=v, DO_DESC=grad_out, DQ_DESC=dq_acc, DK_DESC=dk_out,
                                 DV_DESC=dv_out, DK=dk_out, DV=dv_out,
                                 TERMS_DESC=row_terms, Q_COUNT=q_count, Q_INDEX=q_index, TILE_ORDER=order),
                            arguments)
    if split > 1:
        dk.copy_(dk_out)
        dv.copy_(dv_out)


def _splits_causal(grouped: bool, dim: int, causal: bool, paired: bool) -> bool:
    """Whether a launch's walks at head dim `dim` run their crossing steps in a loop of their own (SPLIT_CAUSAL): only
    causal walks of 128-key blocks (paired walks keep one loop), per SPLIT_CAUSAL_GROUPED_DIMS for GQA walks
    (grouped) and SPLIT_CAUSAL_DIMS for MHA ones."""
    return causal and not paired and dim in (SPLIT_CAUSAL_GROUPED_DIMS if grouped else SPLIT_CAUSAL_DIMS)


def _l2_bytes(device: torch.device) -> int:
    """The device's L2 cache in bytes (0 off CUDA: meta tensors in tests)."""
    return launch.device_properties(device).L2_cache_size if device.type == "cuda" else 0


def kv_split(heads: int, kv_heads: int, seq_q: int, dim: int, l2_bytes: int) -> int:
    """Into how many parts the programs split each kv head's group of heads // kv_heads query heads (KV_SPLIT): with
    KV_SPLIT None the group's size where its rows (seq_q of Q and dO at 2 bytes a value and of dQ's fp32 sums, dim
    values each) exceed l2_bytes, else 1; an int where it divides the group, else 1."""
    group = heads // kv_heads
    if KV_SPLIT is None:
        return group if group * seq_q * dim * 8 > l2_bytes else 1
    return KV_SPLIT if group % KV_SPLIT == 0 else 1


def tile_order(q_count: torch.Tensor, kv_heads: int, tiles_per_block: int) -> torch.Tensor:
    """int32 [Bm, Hkv or 1, nk * tiles_per_block]: each (batch, kv head)'s tiles (128 keys, or 64 when paired),
    longest walk first (the q lists' counts summed over the query heads sharing the kv head; ties in key order).
    q_count int32 [Bm, Hm, nk] with Hm = H (a multiple of kv_heads) or 1 (one mask for all heads). Paired
    programs take consecutive entries, so that a program's two walks come out about as long."""
    return torch.argsort(_walks(q_count, kv_heads, tiles_per_block), dim=-1, descending=True,
                         stable=True).to(torch.int32)


def _walks(q_count: torch.Tensor, kv_heads: int, tiles_per_block: int) -> torch.Tensor:
    """int64 [Bm, Hkv or 1, nk * tiles_per_block]: each tile's walk, its key block's q lists' counts summed over the
    query heads sharing the kv head (q_count int32 [Bm, Hm, nk], Hm = H or 1)."""
    batch, heads, blocks = q_count.shape
    counts = q_count.long()
    if heads > 1:
        counts = counts.reshape(batch, kv_heads, heads // kv_heads, blocks).sum(2)
    return counts.repeat_interleave(tiles_per_block, dim=-1)


def _membership(q_count: torch.Tensor, q_index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(listed bool [..., C], member dtype [..., C]) of q lists (q_count int32 [...], q_index int32 [..., C],
    build_lists'): whether each slot of a list is within its count, and whether each query block is listed (1)."""
    columns = q_index.shape[-1]
    listed = torch.arange(columns, device=q_count.device, dtype=torch.int32) < q_count.unsqueeze(-1)
    member = torch.zeros(*q_index.shape[:-1], columns + 1, dtype=dtype, device=q_count.device)
    member.scatter_(-1, torch.where(listed, q_index, columns).long(), 1)  # unlisted slots into a spare column
    return listed, member[..., :columns]


def paired_tile_order(q_count: torch.Tensor, q_index: torch.Tensor, kv_heads: int,
                      tiles_per_block: int) -> torch.Tensor:
    """int32 [Bm, Hkv or 1, T]: tile_order's layout for paired programs (T = nk * tiles_per_block 64-key tiles),
    whose entries 2p and 2p + 1 are program p's two tiles, matched by the query blocks their lists share (summed over
    the query heads sharing the kv head), less PAIR_BALANCE a step of difference in their walks' lengths; programs
    longest walk first. q_count int32 [Bm, Hm, nk], q_index int32 [Bm, Hm, nk, C] (build_lists'). Each of
    PAIR_ROUNDS rounds pairs the unmatched tiles that are each other's best unmatched partner (a greedy matching's
    parallel form, with no host synchronization); tiles still unmatched then pair as tile_order puts them, as do all
    below PAIR_MIN_TILES tiles or past PAIR_MAX_TILES."""
    batch, heads, blocks = q_count.shape
    tiles = blocks * tiles_per_block
    if not PAIR_MIN_TILES <= tiles <= PAIR_MAX_TILES:
        return tile_order(q_count, kv_heads, tiles_per_block)
    device = q_count.device
    group = heads // kv_heads if heads > 1 else 1
    columns = q_index.shape[-1]
    # membership [Bm * kv heads, nk, group * C]: whether each query head of the group lists each query block (fp16
    # on a GPU: its sums are exact to 2048)
    _, member = _membership(q_count, q_index, torch.float16 if device.type == "cuda" else torch.float32)
    member = member.reshape(batch, heads // group, group, blocks, columns).transpose(2, 3)
    member = member.reshape(-1, blocks, group * columns)
    walks = _walks(q_count, kv_heads, tiles_per_block).reshape(-1, tiles)
    places = torch.arange(tiles, device=device)
    # a symmetric tie-break below the scores' step (0.5 or 1 while PAIR_BALANCE is a multiple of 0.5), so that tied
    # tiles still find a mutual best (any order it gives is valid: the pairing only moves the speed)
    spread = places[:, None] + places[None, :], (places[:, None] - places[None, :]).abs()
    tie_break = torch.frac(spread[0] * 0.6180339887 + spread[1] * 0.7548776662) * 0.25
    chunk = max(1, 2 ** 24 // tiles ** 2)  # (batch, kv head)s a step: their scores take at most 64 MiB
    orders = []
    for start in range(0, member.shape[0], chunk):
        part = member[start:start + chunk]
        walk = walks[start:start + chunk].float()
        shared = (part @ part.transpose(1, 2)).float()
        shared = shared.repeat_interleave(tiles_per_block, 1).repeat_interleave(tiles_per_block, 2)
        score = shared - PAIR_BALANCE * (walk[:, :, None] - walk[:, None, :]).abs() + tie_break
        score.diagonal(dim1=1, dim2=2).fill_(-torch.inf)
        orders.append(_pairs_longest_first(_mutual_best(score, PAIR_ROUNDS), walk))
    return torch.cat(orders).reshape(batch, heads // group, tiles).to(torch.int32)


def _mutual_best(score: torch.Tensor, rounds: int) -> torch.Tensor:
    """int64 [N, T]: each tile's partner, -1 if none, after `rounds` rounds in which tiles that are each other's best
    by score (float [N, T, T], symmetric, -inf on the diagonal; overwritten) among the unmatched pair up."""
    places = torch.arange(score.shape[-1], device=score.device)
    partner = torch.full(score.shape[:2], -1, dtype=torch.long, device=score.device)
    for _ in range(rounds):
        best_score, best = score.max(-1)
        mutual = (best.gather(-1, best) == places) & (best_score > -torch.inf)
        partner = torch.where(mutual, best, partner)
        score.masked_fill_(mutual[:, :, None] | mutual[:, None, :], -torch.inf)  # out of later rounds
    return partner


def _pairs_longest_first(partner: torch.Tensor, walk: torch.Tensor) -> torch.Tensor:
    """int64 [N, T]: the pairs of partner ([N, T], -1 for unmatched tiles, which pair here with their neighbours in
    order of walk) as consecutive entries, the pair whose longer walk (walk float [N, T]) is longest first; in a
    pair the longer walk first (ties: the lower tile)."""
    tiles = partner.shape[-1]
    places = torch.arange(tiles, device=partner.device)
    unmatched = partner < 0
    ranked = torch.argsort(torch.where(unmatched, -walk, torch.inf), dim=-1, stable=True)  # unmatched first
    neighbour = torch.empty_like(partner).scatter_(-1, ranked, ranked.gather(-1, places.expand_as(ranked) ^ 1))
    partner = torch.where(unmatched, neighbour, partner)
    other = walk.gather(-1, partner)
    leads = (walk > other) | ((walk == other) & (places < partner))
    pair_rank = torch.where(leads, -torch.maximum(walk, other), torch.inf)
    leaders = torch.argsort(pair_rank, dim=-1, stable=True)[:, :tiles // 2]
    return torch.stack((leaders, partner.gather(-1, leaders)), dim=-1).reshape(partner.shape)


# tile_order's and pair_lists' results by ((id, version) of each lists tensor, the call's terms): (weak reference to
# q_count, result) (replay.kept_per_lists). Lists are made once and used by many calls (every layer of a model, every
# step of a mask that stays); an entry goes with its q_count.
_TILE_ORDERS: dict = {}
_PAIRED_ORDERS: dict = {}
_PAIR_LISTS: dict = {}
_USES: dict = {}  # backward_uses' counts


def cached_tile_order(q_count: torch.Tensor, kv_heads: int, tiles_per_block: int) -> torch.Tensor:
    """tile_order(q_count, ...), computed once per lists tensor (replay.kept_per_lists)."""
    return replay.kept_per_lists(_TILE_ORDERS, (q_count, ), (kv_heads, tiles_per_block),
                                 lambda counts: tile_order(counts, kv_heads, tiles_per_block))


def cached_paired_tile_order(q_count: torch.Tensor, q_index: torch.Tensor, kv_heads: int,
                             tiles_per_block: int) -> torch.Tensor:
    """paired_tile_order(q_count, q_index, ...), computed once per lists tensors (replay.kept_per_lists)."""
    return replay.kept_per_lists(_PAIRED_ORDERS, (q_count, q_index),
                                 (kv_heads, tiles_per_block, PAIR_BALANCE, PAIR_ROUNDS, PAIR_MIN_TILES, PAIR_MAX_TILES),
                                 lambda counts, index: paired_tile_order(counts, index, kv_heads, tiles_per_block))


def backward_uses(q_count: torch.Tensor, q_index: torch.Tensor) -> int:
    """How many paired backward calls have run on these lists tensors, this one included (MATCH_FROM_USE). Under CUDA
    graph capture, and for inference tensors, nothing is kept: 1."""
    uses = replay.kept_per_lists(_USES, (q_count, q_index), (), lambda *lists: [0], replayed=False)
    uses[0] += 1
    return uses[0]


def pair_lists(q_count: torch.Tensor, q_index: torch.Tensor, order: Optional[torch.Tensor], tiles_per_block: int,
               common_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The q lists as paired programs read them: (counts int32 [Bm, Hm, T, 2], index int32 [Bm, Hm, T, C]), one row
    per 64-key tile (T = nk * tiles_per_block). A program takes tiles order[2p] and order[2p + 1] of its kv head
    (order: tile_order's [Bm, Hkv or 1, T], or None for key order); each tile's row lists first, ascending, the query
    blocks its program's other tile lists too, then the rest of its own, ascending. counts[..., 0] is the list's
    length, counts[..., 1] how many lead it (the same in both tiles' rows). q_count int32 [Bm, Hm, nk], q_index int32
    [Bm, Hm, nk, C] (build_lists': ascending, every index below C). common_first False: no steps in common (each
    tile's own list, as it is; the benchmarks' comparison)."""
    if tiles_per_block > 1:
        q_count = q_count.repeat_interleave(tiles_per_block, dim=-1)
        q_index = q_index.repeat_interleave(tiles_per_block, dim=2)
    batch, heads, tiles = q_count.shape
    if order is None:
        order = torch.arange(tiles, device=q_count.device).expand(batch, 1, tiles)
    order = order.long()
    if order.shape[1] != heads:  # kv heads' orders for the query heads sharing each
        order = order.repeat_interleave(heads // order.shape[1], dim=1)
    # each tile's place in the order (the permutation's inverse: a scatter, where an argsort took a sort) and so
    # the other tile of its program
    position = torch.empty_like(order).scatter_(-1, order, torch.arange(tiles, device=order.device).expand_as(order))
    partner = order.gather(-1, position ^ 1)
    listed, member = _membership(q_count, q_index, torch.bool)
    partner_member = member.gather(2, partner.unsqueeze(-1).expand(member.shape))
    common = listed & partner_member.gather(-1, q_index.long()) & common_first
    rest = listed & ~common
    common_count = common.sum(-1, dtype=torch.int32)

    def running(flags):  # per slot, how many of the row's slots up to it have the flag, less one
        return flags.cumsum(-1, dtype=torch.int32) - 1
    place = torch.where(common, running(common),
                        torch.where(rest, common_count.unsqueeze(-1) + running(rest),
                                    q_count.unsqueeze(-1) + running(~listed)))
    index = torch.empty_like(q_index).scatter_(-1, place.long(), q_index)
    return torch.stack((q_count, common_count), dim=-1).contiguous(), index


def cached_pair_lists(q_count: torch.Tensor, q_index: torch.Tensor, order: Optional[torch.Tensor], kv_heads: int,
                      tiles_per_block: int, group: int = 1, matched: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """pair_lists(..., PAIRED_COMMON_FIRST), for GQA (group query heads a kv head) merged by merge_group_lists,
    computed once per lists tensors (replay.kept_per_lists). The order comes from the lists, kv_heads, whether it is the
    matching's (matched: cached_paired_tile_order's, else cached_tile_order's) and the pairing's settings, which the
    cache key therefore holds."""
    def compute(counts, index, *given_order):
        lists = pair_lists(counts, index, given_order[0] if given_order else None, tiles_per_block,
                           PAIRED_COMMON_FIRST)
        return merge_group_lists(*lists, group) if group > 1 else lists
    return replay.kept_per_lists(_PAIR_LISTS, (q_count, q_index),
                                 (order is None, kv_heads, tiles_per_block, group, PAIRED_COMMON_FIRST, matched,
                                  PAIR_BALANCE, PAIR_ROUNDS, PAIR_MIN_TILES, PAIR_MAX_TILES), compute,
                                 () if order is None else (order, ))


def merge_group_lists(counts: torch.Tensor, index: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Paired GQA's lists: each (batch, kv head)'s tile's lists of its group's query heads (pair_lists' counts int32
    [Bm, Hm, T, 2] and index int32 [Bm, Hm, T, C], Hm = Hkv * group or 1) as one list, (counts int32 [Bm, Hkv or 1,
    T, 2], index int32 [Bm, Hkv or 1, T, group * C]). Its entries are query block << HEAD_BITS | g for the group's
    g-th query head: first every head's common blocks (those the program's other tile lists too), head by head, then
    every head's rest, head by head; counts[..., 0] is the list's length, counts[..., 1] how many common ones lead it.
    The walk is then MHA's one loop, the head read with each step."""
    if group > 2 ** HEAD_BITS:
        raise ValueError(f"group: at most {2 ** HEAD_BITS} query heads a kv head, got {group}")
    batch, heads, tiles, columns = index.shape
    if heads == 1:  # one mask for all heads: every head of the group lists the same blocks
        counts, index = counts.expand(batch, group, tiles, 2), index.expand(batch, group, tiles, columns)
        heads = group
    counts = counts.reshape(batch, heads // group, group, tiles, 2)
    index = index.reshape(batch, heads // group, group, tiles, columns)
    length, common = counts[..., 0].unsqueeze(-1), counts[..., 1].unsqueeze(-1)  # [Bm, Hkv, group, T, 1]

    def before(x):  # per head, the sum of x over the group's heads before it
        return x.cumsum(2) - x
    slot = torch.arange(columns, device=index.device, dtype=torch.int32)
    total_common, total = common.sum(2, keepdim=True), length.sum(2, keepdim=True)
    place = torch.where(slot < common, before(common) + slot,
                        torch.where(slot < length, total_common + before(length - common) + slot - common,
                                    total + before(columns - length) + slot - length))  # unused slots last
    heads_place = torch.arange(group, device=index.device, dtype=torch.int32).reshape(group, 1, 1)
    entries = (index << HEAD_BITS) | heads_place
    flat = (batch, heads // group, tiles, group * columns)
    merged = torch.empty(flat, dtype=torch.int32, device=index.device).scatter_(
        -1, place.transpose(2, 3).reshape(flat).long(), entries.transpose(2, 3).reshape(flat))
    return torch.stack((total, total_common), dim=-1).reshape(*flat[:3], 2).to(torch.int32), merged


def row_terms_buffer(batch: int, heads: int, seq_q: int, device) -> torch.Tensor:
    """fp32 [B, H, 2, Sq] for the row terms (lse2 at [:, :, 0], delta at [:, :, 1]): rows padded to a multiple of 4
    entries, so that the strides are multiples of 16 bytes as TMA requires."""
    padded = -(-seq_q // 4) * 4
    return buffers.empty(batch, heads, 2, padded, device=device, dtype=torch.float32)[..., :seq_q]


def compile_sm90(block_q: int = 128, block_kv: int = 128, dtype: torch.dtype = torch.bfloat16,
                 grouped: bool = False, causal: bool = False, lagged: Optional[bool] = None, dim: int = 128,
                 ordered: Optional[bool] = None, summed: Optional[bool] = None, kv_split: int = 1,
                 split_causal: Optional[bool] = None):
    """Compile the kernel for sm_90 ahead of time, with no GPU (tests and benchmarks/sass tools): the compiled
    kernel for q lists at (block_q, block_kv), GQA (grouped) or not, causal or not, dQ lagged a step or not (None:
    as a launch would, LAGGED_DQ), head dim `dim` (HEAD_DIMS), tiles in tile_order's order or not (None: ORDERED),
    with the launch's register settings; block_kv not a multiple of 128 compiles the paired programs, their common
    steps' dQ summed over both tiles or not (None: as a launch would, PAIRED_COMMON_FIRST and PAIRED_SUMMED_DQ);
    kv_split > 1: each kv head's group split in that many parts, dK and dV added into fp32 sums (KV_SPLIT; grouped
    then says whether a part holds several query heads); split_causal: the causal walk's crossing steps apart (None:
    as a launch would, _splits_causal)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    name = _GL_DTYPES[dtype][0]
    paired, tile_keys, stages = _tiling(block_kv, grouped)
    rows_desc, keys_desc = descriptor_signature(dtype, STEP_ROWS, dim), descriptor_signature(dtype, tile_keys, dim)
    # dK and dV: stored in the inputs' dtype, or (kv_split > 1) added into fp32 sums 64 columns at a time
    gradient_desc, gradients = descriptor_signature(dtype, CONSUMER_KEYS, dim), f"*{name}"
    if kv_split > 1:
        gradient_desc, gradients = descriptor_signature(torch.float32, CONSUMER_KEYS, CONSUMER_KEYS), "*fp32"
    descriptors = dict(Q_DESC=rows_desc, DO_DESC=rows_desc, K_DESC=keys_desc, V_DESC=keys_desc,
                       DQ_DESC=descriptor_signature(torch.float32, STEP_ROWS, CONSUMER_KEYS),
                       TERMS_DESC=descriptor_signature(torch.float32, 2, STEP_ROWS),
                       DK_DESC=gradient_desc, DV_DESC=gradient_desc)
    constants = dict(BLOCK_Q=block_q, BLOCK_KV=block_kv, STAGES=stages, GROUPED=grouped,
                     CAUSAL=causal, LAGGED_DQ=LAGGED_DQ if lagged is None else lagged,
                     ORDERED=ORDERED if ordered is None else ordered, PAIRED=paired,
                     SUMMED_DQ=paired and (PAIRED_COMMON_FIRST and PAIRED_SUMMED_DQ if summed is None else summed),
                     KV_SPLIT=kv_split,
                     SPLIT_CAUSAL=(_splits_causal(grouped, dim, causal, paired) if split_causal is None
                                   else split_causal),
                     CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS)
    signature = {}
    for param in attention_bwd_ws_kernel.params:
        if param.name in constants:
            signature[param.name] = "constexpr"
        else:
            signature[param.name] = descriptors.get(param.name) or {
                "DK": gradients, "DV": gradients, "Q_COUNT": "*i32", "Q_INDEX": "*i32", "TILE_ORDER": "*i32",
                "scale_log2": "fp32"}.get(param.name, "i32")
    source = GluonASTSource(attention_bwd_ws_kernel, signature, constants)
    # with the options every launch passes (autotune.COMPILE_OPTIONS), so that what compiles here is what runs
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(LAUNCH_OPTIONS, **autotune.COMPILE_OPTIONS))
