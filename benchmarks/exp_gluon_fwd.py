"""Experiment: a warp-specialized Hopper forward written in Gluon (not part of the package).

FlashAttention-3's structure over blockattn's kv lists: one loader warp brings each kept K and V tile into a ring of
shared-memory stages through TMA, and two consumer warpgroups each own 64 of a 128-row query block, their scores
and accumulator in registers (wgmma). OVERLAP: each consumer issues the next tile's Q K^T and this tile's P V
together, so the tensor cores run the one while the softmax of the other runs ("intra-warpgroup overlap"); Triton's
own pipeliner does not reorder the loop that way, and doing it by hand in Triton spilled (BENCHMARKS.md, third
session). Contiguous bf16 [1, H, S, D] inputs, S a multiple of 128, no element tests.

    python benchmarks/exp_gluon_fwd.py --dim 128 --density 0.25          # on the GPU: check and time
    python benchmarks/exp_gluon_fwd.py --compile-only                     # no GPU: compile for sm_90, print usage
    python benchmarks/exp_gluon_fwd.py --causal --density 0.5 --variants 128,3,1,0 64,4,1,0   # causal (untimed yet)
    python benchmarks/exp_gluon_fwd.py --dim 64 --variants 128,4,1,0 64,4,0,0,80,104   # two programs a multiprocessor
    python benchmarks/exp_gluon_fwd.py --dim 64 --variants 128,4,1,0,168,240,1        # Q K^T's Q from registers
    python benchmarks/exp_gluon_fwd.py --dim 64 --blocks 128x256 --no-flex --variants 256,3,0,0 256,2,1,0,168,240,0,1
                                               # 256-key tiles; with the overlap, P through shared memory

P_SMEM: each consumer stores P into its own shared-memory tile, which P V reads, instead of keeping it in registers
as the product's first operand: with the overlap, no tile's P is then held in registers across the next tile's
softmax (FlashAttention-3's choice at D=64). Each warp's product reads only the rows it stored, so a fence suffices.
At D=64 with 256-key tiles it ran 0.96x the same tiles without the overlap (forty-second session; outputs exact).

Q_IN_REGS: each consumer loads its Q rows into registers once, as Q K^T's first operand, so the products read only
K from shared memory. At BLOCK_N 64 with 104 registers (and a spill) it gave wrong outputs on the H200 (thirty-seventh
session, not looked into); at BLOCK_N 128 with 240 it equalled the shared-memory operand bit for bit.
"""

import argparse

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from blockattn.kernels.forward_ws import tma_load

LOG2E = gl.constexpr(1.4426950408889634)
CONSUMER_ROWS = 64
HALF_M = gl.constexpr(CONSUMER_ROWS)  # query rows per consumer warpgroup (one wgmma row block of 4 warps x 16)


@gluon.jit
def _list_start(KV_COUNT, heads, stride_ch, BLOCK_KV: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(pid_m, bh, h, total) of this program: its query block, (batch 1) head, and key tiles in its list."""
    pid_m = gl.program_id(0)
    if CAUSAL:  # the longest lists first, so the short ones fill the tail
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    h = bh % heads
    return pid_m, bh, h, gl.load(KV_COUNT + h * stride_ch + pid_m) * (BLOCK_KV // BLOCK_N)


@gluon.jit
def _consumer(shared, HALF: gl.constexpr, BLOCK_KV: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr,
              Q_IN_REGS: gl.constexpr, P_SMEM: gl.constexpr):
    """Rows HALF*64 .. HALF*64+63 of the program's 128-row query block: the online softmax over its kv list."""
    (Q_DESC, K_DESC, V_DESC, q_smem, k_smem, v_smem, p_smem, q_ready, k_ready, v_ready, kv_empty, turn, Out, Lse,
     KV_COUNT, KV_INDEX, scale_log2, seq, heads, stride_ch, stride_ih, stride_iq) = shared
    pid_m, bh, h, total = _list_start(KV_COUNT, heads, stride_ch, BLOCK_KV, BLOCK_N, CAUSAL)
    TILES: gl.constexpr = BLOCK_KV // BLOCK_N

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HALF_M], gl.float32, row_s)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    q = q_smem.index(HALF)
    if Q_IN_REGS:  # Q K^T's first operand from registers: the products then read only K from shared memory
        mbarrier.wait(q_ready, 0)
        q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    # CAUSAL (overlap path only): the list is ascending and its last block is the diagonal one, whose tiles (the
    # last TILES of the walk) take the test key <= query; every other tile lies wholly below the diagonal
    rows = pid_m * (2 * HALF_M) + HALF * HALF_M + gl.arange(0, HALF_M, row_s)
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    last_block = gl.load(KV_INDEX + h * stride_ih + pid_m * stride_iq + gl.maximum(total // TILES - 1, 0))
    mbarrier.wait(q_ready, 0)
    if OVERLAP:
        if total > 0:
            mbarrier.wait(k_ready.index(0), 0)
            qk = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            qk = warpgroup_mma_wait(0, deps=(qk, ))
            if CAUSAL and total <= TILES:
                keys = last_block * BLOCK_KV + cols
                qk = gl.where(keys[None, :] <= rows[:, None], qk, float("-inf"))
            m_i = gl.max(qk, 1) * scale_log2
            p = gl.exp2(qk * scale_log2 - m_i[:, None])
            l_i = gl.sum(p, 1)
            if P_SMEM:  # P goes to the product through shared memory: no tile's P held in registers across it
                p_smem.index(HALF).store(p.to(gl.bfloat16))
                fence_async_shared()  # each warp's product reads only the rows it stored (FA3's note)
                p_prev = p_smem.index(HALF)
            else:
                p_prev = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            for j in range(1, total):
                stage = j % STAGES
                prev = (j - 1) % STAGES
                mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
                mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
                if PINGPONG:  # take turns issuing products: one warpgroup's softmax runs under the other's
                    mbarrier.wait(turn.index(HALF), (j & 1) ^ (1 - HALF))
                qk = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - HALF), count=1)
                qk = warpgroup_mma_wait(1, deps=(qk, ))  # this tile's scores; the previous P V may still run
                if CAUSAL and j >= total - TILES:
                    keys = last_block * BLOCK_KV + (j % TILES) * BLOCK_N + cols
                    qk = gl.where(keys[None, :] <= rows[:, None], qk, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(qk, 1) * scale_log2)
                p = gl.exp2(qk * scale_log2 - m_new[:, None])
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + gl.sum(p, 1)
                if P_SMEM:
                    acc = warpgroup_mma_wait(0, deps=(acc, ))  # the previous P V has read the shared P
                    mbarrier.arrive(kv_empty.index(prev), count=1)
                    p_smem.index(HALF).store(p.to(gl.bfloat16))
                    fence_async_shared()
                else:
                    p_next = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                    acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
                    mbarrier.arrive(kv_empty.index(prev), count=1)
                    p_prev = p_next
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                m_i = m_new
            last = (total - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((total - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
            if P_SMEM:
                acc = warpgroup_mma_wait(0, deps=(acc, ))
            else:
                acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
            mbarrier.arrive(kv_empty.index(last), count=1)
    else:
        for j in range(total):
            stage = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(stage), phase)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), (j & 1) ^ (1 - HALF))
            qk = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            qk = warpgroup_mma_wait(0, deps=(qk, ))
            m_new = gl.maximum(m_i, gl.max(qk, 1) * scale_log2)
            p = gl.exp2(qk * scale_log2 - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            mbarrier.wait(v_ready.index(stage), phase)
            acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(kv_empty.index(stage), count=1)
            m_i = m_new

    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) / LOG2E, float("-inf"))
    rows_o = bh * seq + pid_m * (2 * HALF_M) + HALF * HALF_M + gl.arange(0, HALF_M, row_o)
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
    gl.store(Out + rows_o.to(gl.int64)[:, None] * HEAD_DIM + cols[None, :], out.to(gl.bfloat16))
    rows_s = bh * seq + pid_m * (2 * HALF_M) + HALF * HALF_M + gl.arange(0, HALF_M, row_s)
    gl.store(Lse + rows_s, lse)


@gluon.jit
def _loader(shared, HALF: gl.constexpr, BLOCK_KV: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            STAGES: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr,
            Q_IN_REGS: gl.constexpr, P_SMEM: gl.constexpr):
    """One warp: the query block's two halves, then each kept K and V tile into the ring (waits for a free stage)."""
    (Q_DESC, K_DESC, V_DESC, q_smem, k_smem, v_smem, p_smem, q_ready, k_ready, v_ready, kv_empty, turn, Out, Lse,
     KV_COUNT, KV_INDEX, scale_log2, seq, heads, stride_ch, stride_ih, stride_iq) = shared
    pid_m, bh, h, total = _list_start(KV_COUNT, heads, stride_ch, BLOCK_KV, BLOCK_N, CAUSAL)
    TILES: gl.constexpr = BLOCK_KV // BLOCK_N
    index_row = KV_INDEX + h * stride_ih + pid_m * stride_iq
    q_row = bh * seq + pid_m * (2 * HALF_M)
    mbarrier.expect(q_ready, 2 * Q_DESC.block_type.nbytes)
    tma_load(Q_DESC, [q_row, 0], q_ready, q_smem.index(0))
    tma_load(Q_DESC, [q_row + HALF_M, 0], q_ready, q_smem.index(1))
    kv_row = bh * seq
    for j in range(total):
        stage = j % STAGES
        row = kv_row + gl.load(index_row + j // TILES) * BLOCK_KV + (j % TILES) * BLOCK_N
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), K_DESC.block_type.nbytes)
        tma_load(K_DESC, [row, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), V_DESC.block_type.nbytes)
        tma_load(V_DESC, [row, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def gluon_fwd_kernel(Q_DESC, K_DESC, V_DESC, Out, Lse, KV_COUNT, KV_INDEX, scale_log2, seq, heads,
                     stride_ch, stride_ih, stride_iq,
                     BLOCK_KV: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr, Q_IN_REGS: gl.constexpr = False, P_SMEM: gl.constexpr = False):
    """Grid (S / 128, H): one 128-row query block of one head. Out bf16 [H*S, D], Lse fp32 [H*S]."""
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, HEAD_DIM], Q_DESC.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], K_DESC.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], V_DESC.layout)
    # each consumer's P [64, BLOCK_N] when it goes to P V through shared memory (else a token allocation)
    P_COLS: gl.constexpr = BLOCK_N if P_SMEM else 16
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, P_COLS],
                                       gl.NVMMASharedLayout.get_default_for([HALF_M, P_COLS], gl.bfloat16))
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a stage
    fence_async_shared()
    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    # the partitions' shared arguments as one tuple (Gluon's worker partitions share one signature)
    shared = (Q_DESC, K_DESC, V_DESC, q_smem, k_smem, v_smem, p_smem, q_ready, k_ready, v_ready, kv_empty, turn, Out,
              Lse, KV_COUNT, KV_INDEX, scale_log2, seq, heads, stride_ch, stride_ih, stride_iq)
    gl.warp_specialize([
        (_consumer, (shared, FIRST, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, OVERLAP, PINGPONG, CAUSAL, Q_IN_REGS,
                     P_SMEM)),
        (_consumer, (shared, SECOND, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, OVERLAP, PINGPONG, CAUSAL, Q_IN_REGS,
                     P_SMEM)),
        (_loader, (shared, FIRST, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, OVERLAP, PINGPONG, CAUSAL, Q_IN_REGS,
                     P_SMEM)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _layouts(block_n, dim):
    return (gl.NVMMASharedLayout.get_default_for([CONSUMER_ROWS, dim], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([block_n, dim], gl.bfloat16))


def gluon_forward(q, k, v, blocks, block_n=128, stages=2, overlap=True, pingpong=False, maxnreg=168, consumer_regs=240,
                  loader_regs=24, causal=False, q_in_regs=False, p_smem=False):
    """q, k, v bf16 [1, H, S, D] contiguous; blocks: a BlockSparsity with 128-row query blocks (causal: square
    blocks, each list ending at its diagonal block)."""
    assert not causal or overlap, "causal: overlap path only"
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _, heads, seq, dim = q.shape
    block_q, block_kv = blocks.block_size
    assert block_q == 2 * CONSUMER_ROWS and seq % block_q == 0 and seq % block_kv == 0 and block_kv % block_n == 0
    q_layout, kv_layout = _layouts(block_n, dim)
    q2, k2, v2 = (t.reshape(-1, dim) for t in (q, k, v))
    qd = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [CONSUMER_ROWS, dim], q_layout)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, dim], kv_layout)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, dim], kv_layout)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    count, index = blocks.kv_count, blocks.kv_index
    gluon_fwd_kernel[(seq // block_q, heads)](
        qd, kd, vd, out, lse, count, index, dim ** -0.5 * LOG2E.value, seq, heads,
        count.stride(1), index.stride(1), index.stride(2),
        BLOCK_KV=block_kv, BLOCK_N=block_n, HEAD_DIM=dim, STAGES=stages, OVERLAP=overlap, PINGPONG=pingpong,
        CAUSAL=causal, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, Q_IN_REGS=q_in_regs, P_SMEM=p_smem,
        num_warps=4,
        maxnreg=maxnreg)
    return out, lse


def compile_only(dim, block_n, stages, overlap, pingpong=False, maxnreg=168, consumer_regs=240, loader_regs=24,
                 block_kv=128, causal=False, q_in_regs=False, p_smem=False):
    """Compile for sm_90 without a GPU; returns the compiled kernel (n_regs, n_spills, asm)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    q_layout, kv_layout = _layouts(block_n, dim)
    signature = dict(Q_DESC=f"tensordesc<bf16[{CONSUMER_ROWS},{dim}],{q_layout!r}>",
                     K_DESC=f"tensordesc<bf16[{block_n},{dim}],{kv_layout!r}>",
                     V_DESC=f"tensordesc<bf16[{block_n},{dim}],{kv_layout!r}>",
                     Out="*bf16", Lse="*fp32", KV_COUNT="*i32", KV_INDEX="*i32", scale_log2="fp32", seq="i32",
                     heads="i32", stride_ch="i32", stride_ih="i32", stride_iq="i32")
    constants = dict(BLOCK_KV=block_kv, BLOCK_N=block_n, HEAD_DIM=dim, STAGES=stages, OVERLAP=overlap,
                     PINGPONG=pingpong, CAUSAL=causal,
                     CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, Q_IN_REGS=q_in_regs, P_SMEM=p_smem)
    signature.update(dict.fromkeys(constants, "constexpr"))
    src = GluonASTSource(gluon_fwd_kernel, signature, constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))


def resource_usage(kernel) -> str:
    """cuobjdump's register, spill and shared-memory line for a compiled kernel, and setmaxnreg's counts."""
    import os
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True).stdout
    line = next((x.strip() for x in usage.splitlines() if "REG:" in x), usage.strip())
    counts = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])))
    return f"{line}; setmaxnreg {counts}; shared {kernel.metadata.shared}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, nargs="+", default=[128])
    parser.add_argument("--density", type=float, nargs="+", default=[0.25])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--blocks", nargs="+", default=["128x128"])
    parser.add_argument("--variants", nargs="+", default=["128,3,1,0", "128,3,1,1", "128,3,0,1", "64,4,1,0"],
                        help="BLOCK_N,stages,overlap,pingpong[,maxnreg,consumer_regs[,q_in_regs[,p_smem]]] (a BLOCK_N "
                        "wider "
                        "than the key block is skipped; maxnreg 80 with consumer_regs 104 fits two programs a "
                        "multiprocessor, at BLOCK_N 64 and D=64)")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--causal", action="store_true", help="causal attention over the block-causal mask: the "
                        "package's forward with is_causal (the Triton kernel), FlexAttention with its full/partial "
                        "split, and this file's kernel testing the diagonal block's tiles (overlap variants only)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile at block shapes "
                        "such as 128x384 costs minutes); ratios are then to the package only")
    parser.add_argument("--package", action="store_true", help="also time the package's kernel (forward_ws) launched "
                        "directly and through blockattn.attention, beside this file's kernel")
    args = parser.parse_args()
    # BLOCK_N, stages, overlap, pingpong, maxnreg, consumer_regs (default: one program a multiprocessor), q_in_regs
    variants = []
    for v in args.variants:
        given = tuple(int(x) for x in v.split(","))
        variants.append(given + (168, 240, 0, 0)[len(given) - 4:])
    if args.compile_only:
        for dim in args.dim:
            for block_n, stages, overlap, pingpong, maxnreg, consumer_regs, q_in_regs, p_smem in variants:
                label = (f"D={dim} BN={block_n} stages={stages} overlap={overlap} pingpong={pingpong} "
                         f"regs={maxnreg}/{consumer_regs} q_in_regs={q_in_regs} p_smem={p_smem}")
                try:
                    kernel = compile_only(dim, block_n, stages, bool(overlap), bool(pingpong), maxnreg=maxnreg,
                                          consumer_regs=consumer_regs, causal=args.causal,
                                          block_kv=128 if 128 % block_n == 0 else block_n,
                                          q_in_regs=bool(q_in_regs), p_smem=bool(p_smem))
                    print(f"{label}: {resource_usage(kernel)}", flush=True)
                except Exception as error:
                    print(f"{label}: failed {type(error).__name__}: {str(error)[:2000]}", flush=True)
        return

    import torch

    import blockattn
    from blockattn.bench import Case, _runners, _time_ms, block_mask
    device = torch.device("cuda")
    for dim in args.dim:
        for blocks_arg in args.blocks:
            block = tuple(int(x) for x in blocks_arg.split("x"))
            for density in args.density:
                case = Case(heads=args.heads, seq=args.seq, dim=dim, block=block, density=density,
                            pattern="causal" if args.causal else "random")
                keep = block_mask(case, device)
                runners = _runners(case, keep, device)
                blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
                gen = torch.Generator(device=device).manual_seed(0)
                q, k, v = (torch.randn(1, case.heads, case.seq, dim, device=device, dtype=torch.bfloat16,
                                       generator=gen) for _ in range(3))
                flops = 4.0 * case.heads * case.seq * case.seq * dim * blocks.density()
                expected, expected_lse = blockattn.attention(q, k, v, blocks, return_lse=True, is_causal=args.causal)
                times = {}
                for name in ("blockattn",) if args.no_flex else ("blockattn", "flex"):
                    fn = runners[name][0]
                    times[name] = _time_ms(lambda: fn(q, k, v))
                times.setdefault("flex", float("nan"))
                print(f"== {case.label}: package {times['blockattn']:.3f} ms "
                      f"({flops / times['blockattn'] / 1e9:.0f} TFLOP/s), flex {times['flex']:.3f} ms "
                      f"({flops / times['flex'] / 1e9:.0f})", flush=True)
                if args.package and not args.causal:
                    from blockattn.kernels import forward_ws
                    chosen = forward_ws.plan(q, k, v, *case.block, is_causal=False, token_mask=None, block_mask=None,
                                             kv_valid=None, varlen=None, quant=None, min_work=0)
                    out_ws = torch.empty_like(q)
                    lse_ws = torch.empty(q.shape[:3], device=device, dtype=torch.float32)
                    direct = (lambda: forward_ws.attention_forward_ws(
                        q, k, v, blocks.kv_count, blocks.kv_index, *case.block, dim ** -0.5 * LOG2E.value, out_ws,
                        lse_ws, chosen))
                    direct()
                    err = (out_ws.float() - expected.float()).abs().max().item()
                    for label, fn in (("package kernel, direct", direct),
                                      ("blockattn.attention", lambda: blockattn.attention(q, k, v, blocks))):
                        ms = _time_ms(fn)
                        print(f"{label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s, "
                              f"{times['flex'] / ms:.2f}x flex) max err {err:.1e}", flush=True)
                for block_n, stages, overlap, pingpong, maxnreg, consumer_regs, q_in_regs, p_smem in variants:
                    if block[1] % block_n:
                        continue
                    label = (f"gluon BN={block_n} stages={stages} overlap={overlap} pingpong={pingpong} "
                             f"regs={maxnreg}/{consumer_regs} q_in_regs={q_in_regs} p_smem={p_smem}")
                    if args.causal and not overlap:
                        continue
                    run = (lambda: gluon_forward(q, k, v, blocks, block_n, stages, bool(overlap), bool(pingpong),
                                                 maxnreg=maxnreg, consumer_regs=consumer_regs, causal=args.causal,
                                                 q_in_regs=bool(q_in_regs), p_smem=bool(p_smem)))
                    try:
                        out, lse = run()
                        err = (out.float() - expected.float()).abs().max().item()
                        lse_err = (lse - expected_lse).abs().max().item()
                        ms = _time_ms(run)
                        print(f"{label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s, "
                              f"{times['flex'] / ms:.2f}x flex, {times['blockattn'] / ms:.2f}x package) "
                              f"max err {err:.1e} lse err {lse_err:.1e}", flush=True)
                    except Exception as error:  # a variant that does not compile or fit is a result too
                        print(f"{label}: failed {type(error).__name__}: {str(error)[:300]}", flush=True)


if __name__ == "__main__":
    main()
