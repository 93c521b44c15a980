"""Experiment: a warp-specialized Gluon backward for Hopper, FlashAttention-3's structure over blockattn's q lists:
dK, dV and dQ in one kernel, five tile products per step where the package's two Triton kernels run seven.

One program takes one 128-key block of one head. A loader warp reads its K and V once, then each listed query
block's 64-row tiles of Q and dO into a ring of shared-memory stages (TMA). Two consumer warpgroups own 64 keys
each. Per query tile, a consumer computes S^T = K Q^T and dP^T = V dO^T for its keys, P^T and dS^T in registers,
adds P^T dO into dV and dS^T Q into dK (registers as the A operand), and stores dS^T (bf16) into shared memory.
Once both halves are there, each consumer computes half of dQ's columns, dS K[:, half], and adds it into an fp32
dQ buffer with element atomics (modes 0 and 3) or through the TMA unit (4 and 5). Contiguous bf16 [1, H, S, 128]
inputs, S a multiple of 128, 128x128 blocks, MHA, no element tests.

    python benchmarks/exp_gluon_bwd.py --compile-only            # no GPU: compile for sm_90, print resources
    python benchmarks/exp_gluon_bwd.py --density 0.25 0.1        # on the GPU: check against the package, time
    python benchmarks/exp_gluon_bwd.py --stages 2 --dq-modes 0 3 1 2   # dQ in the step, a step later, diagnoses
    python benchmarks/exp_gluon_bwd.py --stages 2 3 --dq-modes 4 5     # 0 and 3 with the adds through the TMA unit
    python benchmarks/exp_gluon_bwd.py --stages 2 --dq-modes 4 6 7     # two dQ tiles per consumer; a rotated walk

Measured on the H200 at density 0.25 (BENCHMARKS.md, sixteenth and seventeenth sessions), against 19.3-19.6 ms for
the package's Triton backward and 21.0 for FlexAttention's: mode 0 21.89 ms (correct, relative error 2e-4), mode 3
21.49, mode 1 16.87 and mode 2 11.99 (so the element atomics cost ~5 ms), mode 4 17.47 and mode 5 17.55. Mode 4 is
what kernels/backward_ws.py runs in the package. Eighteenth session, d=1 / 0.25 / 0.1: mode 4 63.97 / 17.48 /
8.27, mode 6 (two dQ tiles per consumer) 63.41 / 17.86 / 8.20 (no better), mode 7 (a rotated walk) 64.81 / 18.13 /
8.79, modes 8 and 9 (dQ over each consumer's own keys) 78.03 / 21.74 / 9.92 and 69.68 / 19.21 / 9.30. With
--pattern rows (one q list for every key block) modes 2 and 4 ran as fast as on random lists: the cost of a step does
not depend on the mask.

    python benchmarks/exp_gluon_bwd.py --stages 2 --dq-modes 4 8 9 --pattern rows   # own-key dQ; a shared q list
    python benchmarks/exp_gluon_bwd.py --density 1 0.25 0.1 --stages 2 --dq-modes 4 10   # dQ by one consumer a step

Mode 10 (one consumer per step computes the whole dQ, alternating, so only it waits for the other's half of dS and
the other goes on to its next step: the two drift half a step apart and one's exponentials can overlap the other's
products) compiles for sm_90 (229,760 B of shared memory; 17 and 27 spill instructions in the two consumers' step
loops against mode 4's 15 and 13, Triton 3.6) and has not run yet.
"""

import argparse

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from blockattn.kernels.backward_ws import _tma_add as tma_add
from blockattn.kernels.forward_ws import tma_load

ROWS = 64     # query rows per step
KEYS = 128    # keys per program (the key block); each consumer owns KEYS // 2
_ROWS = gl.constexpr(ROWS)
_HALF = gl.constexpr(KEYS // 2)
_LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _place(shared, BLOCK_Q: gl.constexpr):
    """(off_h, key_block, steps, index_row): the program's head and key block, its count of 64-row query tiles,
    and the pointer to its q list."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, q_smem, do_smem, k_smem, v_smem, ds_smem, kv_ready, q_ready, q_empty,
     ds_ready, ds_empty, DQ, DQ_DESC, dq_smem, DK, DV, LSE, DELTA, Q_COUNT, Q_INDEX, scale_log2, seq, stride_ch,
     stride_ih, stride_ik) = shared
    key_block = gl.program_id(0)
    off_h = gl.program_id(1)
    count = gl.load(Q_COUNT + off_h * stride_ch + key_block)
    index_row = Q_INDEX + off_h.to(gl.int64) * stride_ih + key_block * stride_ik
    return off_h, key_block, count * (BLOCK_Q // _ROWS), index_row


@gluon.jit
def _first_row(index_row, step, BLOCK_Q: gl.constexpr):
    """The first query row of step `step`: list entry step // (BLOCK_Q // 64), its 64-row tile step % (...)."""
    TILES: gl.constexpr = BLOCK_Q // _ROWS
    return gl.load(index_row + step // TILES) * BLOCK_Q + (step % TILES) * _ROWS


@gluon.jit
def _add_dq(DQ, DQ_DESC, dq_tile, dq, row, dq_offsets, W: gl.constexpr, D: gl.constexpr,
            THROUGH_TMA: gl.constexpr, PENDING: gl.constexpr = 0):
    """Add a consumer's [64 rows, 64 columns] share of dQ into DQ fp32 [H * S, D] at row `row`: with element
    atomics from registers, or through shared memory (dq_tile) and one bulk tensor reduction. PENDING: how many of
    the consumer's reductions may still run (1 with two tiles in turn: the one before last has read this one)."""
    if THROUGH_TMA:
        tma.store_wait(PENDING)  # the reduction that last read this tile is done
        dq_tile.store(dq)
        fence_async_shared()
        tma_add(DQ_DESC, [row, W * _HALF], dq_tile)
    else:
        gl.atomic_add(DQ + row.to(gl.int64) * D + dq_offsets, dq, sem="relaxed")


@gluon.jit
def _add_dq_columns(DQ_DESC, dq_tile, dq, row, column):
    """Mode 8: add dq [64 rows, 64 columns] into DQ at (row, column) through dq_tile; the consumer's two tiles
    alternate, so the reduction before last (which read this tile) must be done, the last may still run."""
    tma.store_wait(1)
    dq_tile.store(dq)
    fence_async_shared()
    tma_add(DQ_DESC, [row, column], dq_tile)


@gluon.jit
def _walk_row(index_row, step, steps, key_block, BLOCK_Q: gl.constexpr, DQ_MODE: gl.constexpr):
    """The first query row of step `step` of the program's walk. DQ_MODE 7 rotates the walk: the program of key
    block j starts at step (j * BLOCK_Q / 64) mod steps and wraps around, so that on dense rows the programs of a
    head do not all read the same Q/dO tile at once (the Triton dK/dV kernel's diagonal start measured 14%)."""
    if DQ_MODE == 7:
        step = step + (key_block * (BLOCK_Q // _ROWS)) % gl.maximum(steps, 1)
        step = step - steps * (step >= steps).to(gl.int32)
    return _first_row(index_row, step, BLOCK_Q)


@gluon.jit
def _consumer(shared, W: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, DQ_MODE: gl.constexpr):
    """Keys W*64 .. W*64+63 of the program's block: dK and dV over the q list, and dQ's columns W*64 .. of each
    step. DQ fp32 [H * S, D] (zeroed; gets dS K without the softmax scale), DK / DV [H * S, D]. DQ_MODE: 0 the
    product and its atomics in the step; 3 the same one step later (dQ of step i-1 during step i, so that the two
    consumers need not wait for each other's half of this step's dS: they may drift up to a step apart, one's
    exponentials beside the other's products); as a diagnosis of where the time goes, without a correct dQ, 1 the
    product without the atomics and 2 neither (dK and dV alone, four products). 4 and 5 are 0 and 3 with the adds
    through the TMA unit (a [64, 64] fp32 tile in shared memory, one bulk reduction) instead of element atomics;
    6 is 4 with two tiles per consumer in turn, so a step waits for the reduction before last, not the last; 7 is
    4 with a rotated walk (_walk_row)."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, q_smem, do_smem, k_smem, v_smem, ds_smem, kv_ready, q_ready, q_empty,
     ds_ready, ds_empty, DQ, DQ_DESC, dq_smem, DK, DV, LSE, DELTA, Q_COUNT, Q_INDEX, scale_log2, seq, stride_ch,
     stride_ih, stride_ik) = shared
    off_h, key_block, steps, index_row = _place(shared, BLOCK_Q)
    dtype: gl.constexpr = Q_DESC.dtype
    D: gl.constexpr = Q_DESC.block_type.shape[1]
    # [64 keys, 64 rows] scores and dQ's [64 rows, 64 columns]; [64 keys, D] gradients
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, 64, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    along_rows: gl.constexpr = gl.SliceLayout(0, st_layout)
    dk = gl.zeros([_HALF, D], gl.float32, acc_layout)
    dv = gl.zeros([_HALF, D], gl.float32, acc_layout)
    st_zero = gl.zeros([_HALF, _ROWS], gl.float32, st_layout)
    k_half = k_smem.slice(W * _HALF, _HALF, dim=0)       # [64 keys, D]
    v_half = v_smem.slice(W * _HALF, _HALF, dim=0)
    k_columns = k_smem.slice(W * _HALF, _HALF, dim=1)    # [128 keys, 64 of D]: dQ's columns of this consumer
    head_rows = off_h * seq
    dq_offsets = (gl.arange(0, _ROWS, gl.SliceLayout(1, st_layout))[:, None] * D
                  + W * _HALF + gl.arange(0, _HALF, gl.SliceLayout(0, st_layout))[None, :])
    THROUGH_TMA: gl.constexpr = DQ_MODE >= 4
    LATER: gl.constexpr = DQ_MODE == 3 or DQ_MODE == 5
    dq_tile = dq_smem.index(W)
    mbarrier.wait(kv_ready, 0)
    prev_row0 = 0
    for step in range(steps):
        stage = step % STAGES
        row0 = _walk_row(index_row, step, steps, key_block, BLOCK_Q, DQ_MODE)
        rows = head_rows + row0 + gl.arange(0, _ROWS, along_rows)
        lse = gl.load(LSE + rows) * _LOG2E
        lse = gl.where(lse == float("-inf"), float("inf"), lse)  # a row with no key: P = 0
        delta = gl.load(DELTA + rows)
        mbarrier.wait(q_ready.index(stage), (step // STAGES) & 1)
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)
        st = warpgroup_mma(k_half, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_half, do_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st, ))
        pt = gl.exp2(st * scale_log2 - lse[None, :])
        dpt = warpgroup_mma_wait(0, deps=(dpt, ))
        dst = (pt * (dpt - delta[None, :])).to(dtype)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dst_op = gl.convert_layout(dst, op_layout)
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
        if DQ_MODE == 2:
            dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
            mbarrier.arrive(q_empty.index(stage), count=1)
        elif DQ_MODE == 8 or DQ_MODE == 9:
            # this consumer's keys only: dQ's part dS[:, keys] K[keys, :], all D columns in two 64-column
            # products, each added through the TMA unit; no wait on the other consumer's half of dS. Mode 9
            # issues the second product after the first has retired (fewer registers live at once)
            own = ds_smem.index(W)
            own.store(dst)
            fence_async_shared()
            dq_lo = warpgroup_mma(own.permute((1, 0)), k_half.slice(0, _HALF, dim=1), st_zero, use_acc=False,
                                  is_async=True)
            if DQ_MODE == 8:
                dq_hi = warpgroup_mma(own.permute((1, 0)), k_half.slice(_HALF, _HALF, dim=1), st_zero,
                                      use_acc=False, is_async=True)
                dv, dk, dq_lo, pt_op, dst_op = warpgroup_mma_wait(1, deps=(dv, dk, dq_lo, pt_op, dst_op))
            else:
                dv, dk, dq_lo, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, dq_lo, pt_op, dst_op))
                dq_hi = warpgroup_mma(own.permute((1, 0)), k_half.slice(_HALF, _HALF, dim=1), st_zero,
                                      use_acc=False, is_async=True)
            mbarrier.arrive(q_empty.index(stage), count=1)
            _add_dq_columns(DQ_DESC, dq_smem.index(2 * W), dq_lo, head_rows + row0, 0)
            dq_hi = warpgroup_mma_wait(0, deps=(dq_hi, ))
            _add_dq_columns(DQ_DESC, dq_smem.index(2 * W + 1), dq_hi, head_rows + row0, _HALF)
        elif DQ_MODE == 10:
            # one consumer computes the step's whole dQ (consumer step % 2, in two 64-column products over all 128
            # keys); only it waits for the other's half of dS, so the other goes on to its next step's products
            # and exponentials while this one's dQ runs on the tensor cores. Consumer W always reads buffer W.
            buf = step % 2
            # the buffer's last reader (dQ of step - 2) is done; a fresh barrier passes
            mbarrier.wait(ds_empty.index(buf), ((step // 2) & 1) ^ 1)
            ds_smem.index(buf).slice(W * _HALF, _HALF, dim=0).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            # (the accumulators are settled before the branch: a dynamic if cannot change their type)
            dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
            mbarrier.arrive(q_empty.index(stage), count=1)
            if buf == W:
                mbarrier.wait(ds_ready.index(buf), (step // 2) & 1)
                ds_rows = ds_smem.index(buf).permute((1, 0))   # [64 rows, 128 keys]
                dq_lo = warpgroup_mma(ds_rows, k_smem.slice(0, _HALF, dim=1), st_zero, use_acc=False,
                                      is_async=True)
                dq_lo = warpgroup_mma_wait(0, deps=(dq_lo, ))
                dq_hi = warpgroup_mma(ds_rows, k_smem.slice(_HALF, _HALF, dim=1), st_zero, use_acc=False,
                                      is_async=True)
                _add_dq_columns(DQ_DESC, dq_smem.index(2 * W), dq_lo, head_rows + row0, 0)
                dq_hi = warpgroup_mma_wait(0, deps=(dq_hi, ))
                mbarrier.arrive(ds_empty.index(buf), count=1)
                _add_dq_columns(DQ_DESC, dq_smem.index(2 * W + 1), dq_hi, head_rows + row0, _HALF)
        elif LATER:
            buf = step % 2
            prev = 1 - buf
            has_prev = step > 0
            # the buffer's last readers (dQ of step - 2, in both consumers) are done; a fresh barrier passes
            mbarrier.wait(ds_empty.index(buf), ((step // 2) & 1) ^ 1)
            ds_smem.index(buf).slice(W * _HALF, _HALF, dim=0).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            # dQ of the step before (at step 0 a product that is dropped: one code path for the waits)
            mbarrier.wait(ds_ready.index(prev), ((step - 1) // 2) & 1, pred=has_prev)
            dq = warpgroup_mma(ds_smem.index(prev).permute((1, 0)), k_columns, st_zero, use_acc=False,
                               is_async=True)
            dv, dk, dq, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, pt_op, dst_op))
            mbarrier.arrive(ds_empty.index(prev), count=1, pred=has_prev)
            mbarrier.arrive(q_empty.index(stage), count=1)
            if has_prev:  # (step 0's product read a buffer nothing was written to for it: dropped)
                _add_dq(DQ, DQ_DESC, dq_tile, dq, head_rows + prev_row0, dq_offsets, W, D, THROUGH_TMA)
            prev_row0 = row0
        else:
            # dS^T's half into shared memory; dQ needs both halves (its product runs over all 128 keys)
            buf = step % 2
            ds_smem.index(buf).slice(W * _HALF, _HALF, dim=0).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            mbarrier.wait(ds_ready.index(buf), (step // 2) & 1)
            dq = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_columns, st_zero, use_acc=False,
                               is_async=True)
            dv, dk, dq, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, pt_op, dst_op))
            mbarrier.arrive(q_empty.index(stage), count=1)
            # a scalar base and constant offsets, so that the adds need no 64-bit address per element
            dq_base = DQ + (head_rows + row0).to(gl.int64) * D
            if DQ_MODE == 0 or DQ_MODE == 4 or DQ_MODE == 7:
                _add_dq(DQ, DQ_DESC, dq_tile, dq, head_rows + row0, dq_offsets, W, D, THROUGH_TMA)
            elif DQ_MODE == 6:  # two tiles per consumer in turn: no wait on the last step's reduction
                _add_dq(DQ, DQ_DESC, dq_smem.index(2 * W + step % 2), dq, head_rows + row0, dq_offsets, W, D,
                        THROUGH_TMA, 1)
            else:  # keep the product: one add per program at most, for row 0 only when dQ is NaN
                gl.atomic_add(dq_base + dq_offsets, dq, mask=dq != dq, sem="relaxed")
    if LATER:
        if steps > 0:  # the last step's dQ
            last = (steps - 1) % 2
            mbarrier.wait(ds_ready.index(last), ((steps - 1) // 2) & 1)
            dq = warpgroup_mma(ds_smem.index(last).permute((1, 0)), k_columns, st_zero, use_acc=False,
                               is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq, ))
            _add_dq(DQ, DQ_DESC, dq_tile, dq, head_rows + prev_row0, dq_offsets, W, D, THROUGH_TMA)
    if THROUGH_TMA:
        tma.store_wait(0)  # the tile is read before the program's shared memory goes
    key_rows = head_rows + key_block * (2 * _HALF) + W * _HALF + gl.arange(0, _HALF, gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, gl.SliceLayout(0, acc_layout))
    offsets = key_rows.to(gl.int64)[:, None] * D + cols[None, :]
    gl.store(DK + offsets, (dk * (scale_log2 / _LOG2E)).to(DK.dtype.element_ty))
    gl.store(DV + offsets, dv.to(DV.dtype.element_ty))


@gluon.jit
def _loader(shared, W: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, DQ_MODE: gl.constexpr):
    """One warp: the block's K and V, then each step's Q and dO tiles into the ring, a stage once both consumers
    have released it."""
    (Q_DESC, K_DESC, V_DESC, DO_DESC, q_smem, do_smem, k_smem, v_smem, ds_smem, kv_ready, q_ready, q_empty,
     ds_ready, ds_empty, DQ, DQ_DESC, dq_smem, DK, DV, LSE, DELTA, Q_COUNT, Q_INDEX, scale_log2, seq, stride_ch,
     stride_ih, stride_ik) = shared
    off_h, key_block, steps, index_row = _place(shared, BLOCK_Q)
    head_rows = off_h * seq
    mbarrier.expect(kv_ready, K_DESC.block_type.nbytes + V_DESC.block_type.nbytes)
    tma_load(K_DESC, [head_rows + key_block * (2 * _HALF), 0], kv_ready, k_smem)
    tma_load(V_DESC, [head_rows + key_block * (2 * _HALF), 0], kv_ready, v_smem)
    for step in range(steps):
        stage = step % STAGES
        mbarrier.wait(q_empty.index(stage), ((step // STAGES) & 1) ^ 1)
        row = head_rows + _walk_row(index_row, step, steps, key_block, BLOCK_Q, DQ_MODE)
        mbarrier.expect(q_ready.index(stage), Q_DESC.block_type.nbytes + DO_DESC.block_type.nbytes)
        tma_load(Q_DESC, [row, 0], q_ready.index(stage), q_smem.index(stage))
        tma_load(DO_DESC, [row, 0], q_ready.index(stage), do_smem.index(stage))


@gluon.jit
def gluon_bwd_kernel(Q_DESC, K_DESC, V_DESC, DO_DESC, DQ, DQ_DESC, DK, DV, LSE, DELTA, Q_COUNT, Q_INDEX, scale_log2,
                     seq, stride_ch, stride_ih, stride_ik, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
                     DQ_MODE: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """Grid (S / 128, H). Descriptors over [H * S, D]: Q / dO with [64, D] boxes, K / V with [128, D], DQ_DESC
    over DQ (fp32) with [64, 64] boxes; LSE
    (natural log) and DELTA (rowsum(dO * O)) fp32 [H * S]; Q_COUNT int32 [1, H, nk], Q_INDEX int32 [1, H, nk, nq]."""
    D: gl.constexpr = Q_DESC.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(Q_DESC.dtype, [STAGES, _ROWS, D], Q_DESC.layout)
    do_smem = gl.allocate_shared_memory(DO_DESC.dtype, [STAGES, _ROWS, D], DO_DESC.layout)
    k_smem = gl.allocate_shared_memory(K_DESC.dtype, [2 * _HALF, D], K_DESC.layout)
    v_smem = gl.allocate_shared_memory(V_DESC.dtype, [2 * _HALF, D], V_DESC.layout)
    if DQ_MODE == 8 or DQ_MODE == 9:  # each consumer's own half of dS^T, [64 keys, 64 rows]
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HALF, _ROWS], Q_DESC.dtype)
        ds_smem = gl.allocate_shared_memory(Q_DESC.dtype, [2, _HALF, _ROWS], ds_layout)
    else:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * _HALF, _ROWS], Q_DESC.dtype)
        ds_smem = gl.allocate_shared_memory(Q_DESC.dtype, [2, 2 * _HALF, _ROWS], ds_layout)
    if DQ_MODE == 6 or DQ_MODE >= 8:  # two [64 rows, 64 columns] fp32 tiles per consumer, used in turn
        dq_smem = gl.allocate_shared_memory(gl.float32, [4, _ROWS, _HALF], DQ_DESC.layout)
    elif DQ_MODE >= 4:  # a [64 rows, 64 columns] fp32 tile per consumer for the TMA adds
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, _ROWS, _HALF], DQ_DESC.layout)
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 8, _HALF], DQ_DESC.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_empty.index(i), count=1 if DQ_MODE == 10 else 2)  # mode 10: its one reader
    fence_async_shared()
    shared = (Q_DESC, K_DESC, V_DESC, DO_DESC, q_smem, do_smem, k_smem, v_smem, ds_smem, kv_ready, q_ready, q_empty,
              ds_ready, ds_empty, DQ, DQ_DESC, dq_smem, DK, DV, LSE, DELTA, Q_COUNT, Q_INDEX, scale_log2, seq,
              stride_ch, stride_ih, stride_ik)
    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    gl.warp_specialize([
        (_consumer, (shared, FIRST, BLOCK_Q, STAGES, DQ_MODE)),
        (_consumer, (shared, SECOND, BLOCK_Q, STAGES, DQ_MODE)),
        (_loader, (shared, FIRST, BLOCK_Q, STAGES, DQ_MODE)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _layouts(dim):
    return (gl.NVMMASharedLayout.get_default_for([ROWS, dim], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([KEYS, dim], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([ROWS, KEYS // 2], gl.float32))


def gluon_backward(q, k, v, out, lse, grad_out, blocks, stages=2, dq_mode=0, maxnreg=168, consumer_regs=240,
                   loader_regs=24):
    """Gradients (dq, dk, dv) of attention over blocks (128x128) for q, k, v, out, grad_out bf16 [1, H, S, D]
    contiguous and lse fp32 [1, H, S] (natural log, the forward's)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _, heads, seq, dim = q.shape
    assert blocks.block_size == (KEYS, KEYS) and seq % KEYS == 0
    q_layout, kv_layout, dq_layout = _layouts(dim)

    def desc(t, rows, layout, columns=dim):
        flat = t.reshape(-1, dim)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, columns], layout)
    delta = (grad_out.float() * out.float()).sum(-1)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    count, index = blocks.q_lists()
    scale = dim ** -0.5
    gluon_bwd_kernel[(seq // KEYS, heads)](
        desc(q, ROWS, q_layout), desc(k, KEYS, kv_layout), desc(v, KEYS, kv_layout), desc(grad_out, ROWS, q_layout),
        dq, desc(dq, ROWS, dq_layout, KEYS // 2), dk, dv, lse, delta, count, index, scale * _LOG2E.value, seq,
        count.stride(1), index.stride(1), index.stride(2), BLOCK_Q=blocks.block_size[0], STAGES=stages,
        DQ_MODE=dq_mode, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, num_warps=4, maxnreg=maxnreg)
    return (dq * scale).to(q.dtype), dk, dv


def compile_only(dim=128, stages=2, dq_mode=0, maxnreg=168, consumer_regs=240, loader_regs=24):
    """Compile for sm_90 without a GPU; returns the compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    q_layout, kv_layout, dq_layout = _layouts(dim)
    signature = dict(Q_DESC=f"tensordesc<bf16[{ROWS},{dim}],{q_layout!r}>",
                     K_DESC=f"tensordesc<bf16[{KEYS},{dim}],{kv_layout!r}>",
                     V_DESC=f"tensordesc<bf16[{KEYS},{dim}],{kv_layout!r}>",
                     DO_DESC=f"tensordesc<bf16[{ROWS},{dim}],{q_layout!r}>",
                     DQ="*fp32", DQ_DESC=f"tensordesc<fp32[{ROWS},{KEYS // 2}],{dq_layout!r}>", DK="*bf16",
                     DV="*bf16", LSE="*fp32", DELTA="*fp32", Q_COUNT="*i32", Q_INDEX="*i32",
                     scale_log2="fp32", seq="i32", stride_ch="i32", stride_ih="i32", stride_ik="i32")
    constants = dict(BLOCK_Q=KEYS, STAGES=stages, DQ_MODE=dq_mode, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs)
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = GluonASTSource(gluon_bwd_kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, nargs="+", default=[0.25])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--dq-modes", type=int, nargs="+", default=[0],
                        help="0: dQ's product and atomics; 3: the same a step later; 1: the product only; "
                        "2: neither (1 and 2: timing diagnosis, no correct dQ); 4 and 5: 0 and 3 with the adds "
                        "through the TMA unit; 6: 4 with two dQ tiles per consumer; 7: 4 with a rotated walk; 8: each "
                        "consumer's dQ over its own 64 keys, no wait for the other; 9: 8 with its two products in "
                        "turn; 10: one consumer per step (alternating) computes the whole dQ, only it waits")
    parser.add_argument("--pattern", choices=["random", "rows"], default="random",
                        help="random: the benchmarks' block masks; rows: every n-th query block keeps every key "
                        "block (all programs walk the same q list, as at density 1)")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    variants = [(stages, mode) for stages in args.stages for mode in args.dq_modes]
    if args.compile_only:
        from exp_gluon_fwd import resource_usage
        for stages, mode in variants:
            try:
                print(f"stages={stages} dq_mode={mode}: {resource_usage(compile_only(stages=stages, dq_mode=mode))}",
                      flush=True)
            except Exception as error:
                print(f"stages={stages} dq_mode={mode}: failed {type(error).__name__}: {str(error)[:3000]}",
                      flush=True)
        return

    import torch

    import blockattn
    from blockattn.bench import Case, _flops, _inputs, _runners, _time_ms, block_mask
    device = torch.device("cuda")
    for density in args.density:
        case = Case(heads=args.heads, kv_heads=args.heads, seq=args.seq, density=density)
        keep = block_mask(case, device)
        if args.pattern == "rows":  # the same q list for every key block: query blocks 0, n, 2n, ... keep all
            rows = torch.arange(keep.shape[-2], device=device) % max(1, round(1 / density)) == 0
            keep = rows[None, None, :, None].expand_as(keep).contiguous()
        blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=True)
        grad = torch.randn_like(q)
        flops = 2.5 * _flops(case, blocks.density())  # 5 products credited
        out, lse = blockattn.attention(q, k, v, blocks, return_lse=True)
        want = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        times = {"package": _time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))}
        flex = _runners(case, keep, device)["flex"][0]
        flex_out = flex(q, k, v)
        times["flex"] = _time_ms(lambda: torch.autograd.grad(flex_out, (q, k, v), grad, retain_graph=True))
        line = ", ".join(f"{name} {ms:.3f} ms ({flops / ms / 1e9:.0f})" for name, ms in times.items())
        print(f"== {case.label} backward: {line}", flush=True)
        saved = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), grad)
        for stages, mode in variants:
            try:
                got = gluon_backward(*saved, blocks, stages=stages, dq_mode=mode)
                errors = [((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want)]
                ms = _time_ms(lambda: gluon_backward(*saved, blocks, stages=stages, dq_mode=mode))
                print(f"gluon stages={stages} dq_mode={mode}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s, "
                      f"{times['flex'] / ms:.2f}x flex, {times['package'] / ms:.2f}x package); relative error "
                      f"dq {errors[0]:.1e} dk {errors[1]:.1e} dv {errors[2]:.1e}", flush=True)
            except Exception as error:
                print(f"gluon stages={stages} dq_mode={mode}: failed {type(error).__name__}: {str(error)[:2000]}",
                      flush=True)


if __name__ == "__main__":
    main()
