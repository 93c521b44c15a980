"""Experiment: consumers split a query tile's keys as well as its rows (not part of the package).

At D=64 a tile's products and its exponentials take about as long each (kernels/README.md), and with two consumer
warpgroups each scheduler of a multiprocessor holds two consumer warps: the special function unit idles whenever
both are in a product. PARTS=2 gives four consumer warpgroups: (HALF, PART) owns query rows HALF*64 .. HALF*64+63
and the key tiles j = PART, PART + 2, ... of the list, with its own row sums and accumulator; at the end each PART 1
consumer hands its own to the PART 0 consumer of the same rows through shared memory, which merges and stores. Each
K/V tile is still read by the two halves of one part, so the L2 traffic per FLOP is unchanged; what changes is four
consumer warps a scheduler instead of two, at 120 registers a thread instead of 240. That fits a 64-key tile's
scores (32 registers) with no spill, not a 128-key tile's (64: ptxas spills 19 values a step, Triton 3.6), so
SUB_N=64 takes a BLOCK_N=128 stage in two 64-key parts, one after the other (OVERLAP: the second part's Q K^T
under the first's softmax; it spills too).

FIXED: after its first tile a consumer keeps that tile's row maxima as the exponentials' offsets (no row max, no
rescale in the loop), as the package's fixed offsets do; safe on the random normal inputs used here, not in general.
A program a query tile (no claimed items), no element tests, bf16 [1, H, S, D] contiguous, 128-row query blocks.

    python benchmarks/exp_key_split.py --compile-only                   # no GPU: registers, spills, shared memory
    python benchmarks/exp_key_split.py --package --density 0.5 0.1 --variants 2,64,8,1 1,64,8,1 2,128,5,1,64
"""

import argparse

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from blockattn.kernels.forward_ws import _barrier, tma_load
# (run from benchmarks/, as the commands above do) the two-consumer experiment's constants and helpers
from exp_gluon_fwd import CONSUMER_ROWS, HALF_M, LOG2E, _layouts, _list_start


@gluon.jit
def _softmax(qk, acc, m_i, l_i, scale_log2, RUNNING: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr):
    """P (bf16, as P V's first operand) of one tile's scores, with running maxima or fixed offsets m_i."""
    if RUNNING:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * scale_log2)
        p = gl.exp2(qk * scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        m_i = m_new
    else:
        p = gl.exp2(qk * scale_log2 - m_i[:, None])
        l_i = l_i + gl.sum(p, 1)
    return gl.convert_layout(p.to(gl.bfloat16), p_layout), acc, m_i, l_i


@gluon.jit
def _tile(q, k_smem, v_smem, k_ready, v_ready, kv_empty, j, acc, m_i, l_i, s_layout: gl.constexpr, scale_log2,
          SUB_N: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RUNNING: gl.constexpr,
          OVERLAP: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr):
    """Tile j of the walk (BLOCK_N keys, in parts of SUB_N): scores, softmax, P V into acc. OVERLAP (two parts,
    fixed offsets): the second part's Q K^T runs under the first part's softmax, its P V under the second's."""
    stage = j % STAGES
    phase = (j // STAGES) & 1
    k_tile = k_smem.index(stage)
    v_tile = v_smem.index(stage)
    mbarrier.wait(k_ready.index(stage), phase)
    # zeros made here, not held across the loop: 64 registers at 128 keys, which four consumers lack
    s_zero = gl.zeros([HALF_M, SUB_N], gl.float32, s_layout)
    if OVERLAP and not RUNNING:
        qk_a = warpgroup_mma(q, k_tile.slice(0, SUB_N).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk_b = warpgroup_mma(q, k_tile.slice(SUB_N, SUB_N).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk_a = warpgroup_mma_wait(1, deps=(qk_a, ))
        p_a, acc, m_i, l_i = _softmax(qk_a, acc, m_i, l_i, scale_log2, False, p_layout, row_o)
        mbarrier.wait(v_ready.index(stage), phase)
        acc = warpgroup_mma(p_a, v_tile.slice(0, SUB_N), acc, is_async=True)
        qk_b = warpgroup_mma_wait(1, deps=(qk_b, ))  # the first part's P V may still run
        p_b, acc, m_i, l_i = _softmax(qk_b, acc, m_i, l_i, scale_log2, False, p_layout, row_o)
        acc = warpgroup_mma(p_b, v_tile.slice(SUB_N, SUB_N), acc, is_async=True)
        acc, p_a, p_b = warpgroup_mma_wait(0, deps=(acc, p_a, p_b))
    else:
        for part in gl.static_range(BLOCK_N // SUB_N):
            qk = warpgroup_mma(q, k_tile.slice(part * SUB_N, SUB_N).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            qk = warpgroup_mma_wait(0, deps=(qk, ))
            p_op, acc, m_i, l_i = _softmax(qk, acc, m_i, l_i, scale_log2, RUNNING, p_layout, row_o)
            if part == 0:
                mbarrier.wait(v_ready.index(stage), phase)
            acc = warpgroup_mma(p_op, v_tile.slice(part * SUB_N, SUB_N), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_empty.index(stage), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer(shared, HALF: gl.constexpr, PART: gl.constexpr, PARTS: gl.constexpr, BLOCK_KV: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, FIXED: gl.constexpr,
              SUB_N: gl.constexpr, OVERLAP: gl.constexpr):
    """Rows HALF*64 .. +63 over the key tiles PART, PART + PARTS, ... of the list; PART 0 merges and stores."""
    (Q_DESC, K_DESC, V_DESC, q_smem, k_smem, v_smem, merge_acc, merge_ml, q_ready, k_ready, v_ready, kv_empty,
     merged, Out, Lse, KV_COUNT, KV_INDEX, scale_log2, seq, heads, stride_ch, stride_ih, stride_iq) = shared
    pid_m, bh, h, total = _list_start(KV_COUNT, heads, stride_ch, BLOCK_KV, BLOCK_N, False)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, SUB_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HALF_M], gl.float32, row_s)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
    q = q_smem.index(HALF)
    mbarrier.wait(q_ready, 0)
    if FIXED:
        if PART < total:  # the first tile finds the offsets; the rest keep them
            acc, m_i, l_i = _tile(q, k_smem, v_smem, k_ready, v_ready, kv_empty, PART, acc, m_i, l_i, s_layout,
                                  scale_log2, SUB_N, BLOCK_N, STAGES, True, OVERLAP, p_layout, row_o)
        for j in range(PART + PARTS, total, PARTS):
            acc, m_i, l_i = _tile(q, k_smem, v_smem, k_ready, v_ready, kv_empty, j, acc, m_i, l_i, s_layout,
                                  scale_log2, SUB_N, BLOCK_N, STAGES, False, OVERLAP, p_layout, row_o)
    else:
        for j in range(PART, total, PARTS):
            acc, m_i, l_i = _tile(q, k_smem, v_smem, k_ready, v_ready, kv_empty, j, acc, m_i, l_i, s_layout,
                                  scale_log2, SUB_N, BLOCK_N, STAGES, True, OVERLAP, p_layout, row_o)

    if PART == 1:  # hand the row sums, offsets and accumulator to the PART 0 consumer of the same rows
        merge_acc.index(HALF).store(acc)
        merge_ml.index(2 * HALF).store(m_i)
        merge_ml.index(2 * HALF + 1).store(l_i)
        _barrier()
        mbarrier.arrive(merged.index(HALF), count=1)
    else:
        if PARTS == 2:
            mbarrier.wait(merged.index(HALF), 0)
            acc_b = merge_acc.index(HALF).load(o_layout)
            m_b = merge_ml.index(2 * HALF).load(row_s)
            l_b = merge_ml.index(2 * HALF + 1).load(row_s)
            m_new = gl.maximum(m_i, m_b)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha_a = gl.exp2(m_i - m_safe)
            alpha_b = gl.exp2(m_b - m_safe)
            l_i = l_i * alpha_a + l_b * alpha_b
            acc = (acc * gl.convert_layout(alpha_a, row_o)[:, None]
                   + acc_b * gl.convert_layout(alpha_b, row_o)[:, None])
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
def _loader(shared, HALF: gl.constexpr, PART: gl.constexpr, PARTS: gl.constexpr, BLOCK_KV: gl.constexpr,
            BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, FIXED: gl.constexpr,
            SUB_N: gl.constexpr, OVERLAP: gl.constexpr):
    """One warp: both halves of Q, then every key tile of the list in order into the ring."""
    (Q_DESC, K_DESC, V_DESC, q_smem, k_smem, v_smem, merge_acc, merge_ml, q_ready, k_ready, v_ready, kv_empty,
     merged, Out, Lse, KV_COUNT, KV_INDEX, scale_log2, seq, heads, stride_ch, stride_ih, stride_iq) = shared
    pid_m, bh, h, total = _list_start(KV_COUNT, heads, stride_ch, BLOCK_KV, BLOCK_N, False)
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
def key_split_kernel(Q_DESC, K_DESC, V_DESC, Out, Lse, KV_COUNT, KV_INDEX, scale_log2, seq, heads,
                     stride_ch, stride_ih, stride_iq,
                     PARTS: gl.constexpr, BLOCK_KV: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                     STAGES: gl.constexpr, FIXED: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr, SUB_N: gl.constexpr,
                     OVERLAP: gl.constexpr):
    """Grid (S / 128, H): one 128-row query block of one head. Out bf16 [H*S, D], Lse fp32 [H*S]."""
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, HEAD_DIM], Q_DESC.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], K_DESC.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], V_DESC.layout)
    MERGE_ROWS: gl.constexpr = HALF_M if PARTS == 2 else 8  # a token allocation when nothing is merged
    merge_acc = gl.allocate_shared_memory(gl.float32, [2, MERGE_ROWS, HEAD_DIM],
                                          gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    merge_ml = gl.allocate_shared_memory(gl.float32, [4, MERGE_ROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    merged = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(merged.index(0), count=1)
    mbarrier.init(merged.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # the two halves of the tile's part release a stage
    fence_async_shared()
    shared = (Q_DESC, K_DESC, V_DESC, q_smem, k_smem, v_smem, merge_acc, merge_ml, q_ready, k_ready, v_ready,
              kv_empty, merged, Out, Lse, KV_COUNT, KV_INDEX, scale_log2, seq, heads, stride_ch, stride_ih,
              stride_iq)
    ZERO: gl.constexpr = 0
    ONE: gl.constexpr = 1
    if PARTS == 2:
        gl.warp_specialize([
            (_consumer, (shared, ZERO, ZERO, PARTS, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, FIXED, SUB_N, OVERLAP)),
            (_consumer, (shared, ONE, ZERO, PARTS, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, FIXED, SUB_N, OVERLAP)),
            (_consumer, (shared, ZERO, ONE, PARTS, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, FIXED, SUB_N, OVERLAP)),
            (_consumer, (shared, ONE, ONE, PARTS, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, FIXED, SUB_N, OVERLAP)),
            (_loader, (shared, ZERO, ZERO, PARTS, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, FIXED, SUB_N, OVERLAP)),
        ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (shared, ZERO, ZERO, PARTS, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, FIXED, SUB_N, OVERLAP)),
            (_consumer, (shared, ONE, ZERO, PARTS, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, FIXED, SUB_N, OVERLAP)),
            (_loader, (shared, ZERO, ZERO, PARTS, BLOCK_KV, BLOCK_N, HEAD_DIM, STAGES, FIXED, SUB_N, OVERLAP)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _regs(parts):
    """(maxnreg at launch, consumer registers): with four consumers 20 warps (the loader's padded to a warpgroup)
    share the 64K registers, with two 12."""
    return (96, 120) if parts == 2 else (168, 240)


def key_split_forward(q, k, v, blocks, parts=2, block_n=64, stages=8, fixed=True, sub_n=0, overlap=False):
    """q, k, v bf16 [1, H, S, D] contiguous; blocks: a BlockSparsity with 128-row query blocks."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _, heads, seq, dim = q.shape
    block_q, block_kv = blocks.block_size
    assert block_q == 2 * CONSUMER_ROWS and seq % block_q == 0 and block_kv % block_n == 0
    q_layout, kv_layout = _layouts(block_n, dim)
    q2, k2, v2 = (t.reshape(-1, dim) for t in (q, k, v))
    qd = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [CONSUMER_ROWS, dim], q_layout)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, dim], kv_layout)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, dim], kv_layout)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    count, index = blocks.kv_count, blocks.kv_index
    maxnreg, consumer_regs = _regs(parts)
    key_split_kernel[(seq // block_q, heads)](
        qd, kd, vd, out, lse, count, index, dim ** -0.5 * LOG2E.value, seq, heads,
        count.stride(1), index.stride(1), index.stride(2),
        PARTS=parts, BLOCK_KV=block_kv, BLOCK_N=block_n, HEAD_DIM=dim, STAGES=stages, FIXED=fixed,
        CONSUMER_REGS=consumer_regs, LOADER_REGS=24, SUB_N=sub_n or block_n, OVERLAP=overlap, num_warps=4,
        maxnreg=maxnreg)
    return out, lse


def compile_only(dim, parts, block_n, stages, fixed, sub_n=0, overlap=False, block_kv=128):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    q_layout, kv_layout = _layouts(block_n, dim)
    signature = dict(Q_DESC=f"tensordesc<bf16[{CONSUMER_ROWS},{dim}],{q_layout!r}>",
                     K_DESC=f"tensordesc<bf16[{block_n},{dim}],{kv_layout!r}>",
                     V_DESC=f"tensordesc<bf16[{block_n},{dim}],{kv_layout!r}>",
                     Out="*bf16", Lse="*fp32", KV_COUNT="*i32", KV_INDEX="*i32", scale_log2="fp32", seq="i32",
                     heads="i32", stride_ch="i32", stride_ih="i32", stride_iq="i32")
    maxnreg, consumer_regs = _regs(parts)
    constants = dict(PARTS=parts, BLOCK_KV=block_kv, BLOCK_N=block_n, HEAD_DIM=dim, STAGES=stages, FIXED=fixed,
                     CONSUMER_REGS=consumer_regs, LOADER_REGS=24, SUB_N=sub_n or block_n, OVERLAP=overlap)
    signature.update(dict.fromkeys(constants, "constexpr"))
    src = GluonASTSource(key_split_kernel, signature, constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))


def _variants(text):
    """'parts,block_n,stages,fixed[,sub_n[,overlap]]' strings (sub_n 0: the whole tile at once)."""
    return [(tuple(int(x) for x in v.split(",")) + (0, 0))[:6] for v in text]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--density", type=float, nargs="+", default=[0.5, 0.1])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--blocks", nargs="+", default=["128x128"])
    parser.add_argument("--variants", nargs="+", default=["2,64,8,1", "1,64,8,1", "1,128,4,1", "2,64,8,0"],
                        help="parts,block_n,stages,fixed[,sub_n[,overlap]] (a block_n wider than the key block is "
                        "skipped)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, all variants in turn each round")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--package", action="store_true", help="also time blockattn.attention on the same inputs")
    args = parser.parse_args()
    variants = _variants(args.variants)
    if args.compile_only:
        from exp_gluon_fwd import resource_usage
        for parts, block_n, stages, fixed, sub_n, overlap in variants:
            for block_kv in (128, 256):
                if block_kv % block_n:
                    continue
                label = (f"D={args.dim} parts={parts} BN={block_n} stages={stages} fixed={fixed} sub={sub_n} "
                         f"overlap={overlap} BKV={block_kv}")
                try:
                    kernel = compile_only(args.dim, parts, block_n, stages, bool(fixed), sub_n, bool(overlap), block_kv)
                    print(f"{label}: {resource_usage(kernel)}", flush=True)
                except Exception as error:
                    print(f"{label}: failed {type(error).__name__}: {str(error)[:2000]}", flush=True)
        return

    import statistics

    import torch

    import blockattn
    from blockattn.bench import Case, _runners, _time_ms, block_mask
    device = torch.device("cuda")
    dim = args.dim
    for blocks_arg in args.blocks:
        block = tuple(int(x) for x in blocks_arg.split("x"))
        for density in args.density:
            case = Case(heads=args.heads, seq=args.seq, dim=dim, block=block, density=density, pattern="random")
            keep = block_mask(case, device)
            runners = _runners(case, keep, device)
            blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
            gen = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(1, case.heads, case.seq, dim, device=device, dtype=torch.bfloat16,
                                   generator=gen) for _ in range(3))
            flops = 4.0 * case.heads * case.seq * case.seq * dim * blocks.density()
            expected, expected_lse = blockattn.attention(q, k, v, blocks, return_lse=True)
            fns = {"flex": lambda: runners["flex"][0](q, k, v)}
            if args.package:
                fns["package"] = lambda: blockattn.attention(q, k, v, blocks)
            for parts, block_n, stages, fixed, sub_n, overlap in variants:
                if block[1] % block_n:
                    continue
                label = f"parts={parts} BN={block_n} stages={stages} fixed={fixed} sub={sub_n} overlap={overlap}"

                def run(parts=parts, block_n=block_n, stages=stages, fixed=fixed, sub_n=sub_n, overlap=overlap):
                    return key_split_forward(q, k, v, blocks, parts, block_n, stages, bool(fixed), sub_n,
                                             bool(overlap))
                try:
                    out, lse = run()
                    err = (out.float() - expected.float()).abs().max().item()
                    lse_err = (lse - expected_lse).abs().max().item()
                    print(f"{case.label} {label}: max err {err:.1e} lse err {lse_err:.1e}", flush=True)
                    fns[label] = run
                except Exception as error:
                    print(f"{case.label} {label}: failed {type(error).__name__}: {str(error)[:300]}", flush=True)
            times = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    times[name].append(_time_ms(fn))
            flex = statistics.median(times["flex"])
            for name, ts in times.items():
                ms = statistics.median(ts)
                print(f"{case.label} {name}: {' / '.join(f'{t:.3f}' for t in ts)} ms, median {ms:.3f} "
                      f"({flops / ms / 1e9:.0f} TFLOP/s, {flex / ms:.2f}x flex)", flush=True)


if __name__ == "__main__":
    main()
