"""Experiment: variants of the forward loop at one shape, each tile config timed on its own (not part of the package).

Knobs: TMA (K and V tiles through host tensor descriptors, Hopper's bulk copies, instead of pointer loads);
PIPELINE_QK (the next tile's Q K^T is issued before this tile's softmax, so the tensor cores can work while the
softmax runs: the "intra-warpgroup overlap" of FlashAttention-3, written by hand since Triton does not reorder it);
POLY_QUARTERS (that many quarters of the exponentials as a polynomial on the FMA pipe, FlashAttention-4's trick);
LAZY (rescale the accumulator only when a row max grows by more than 2^8). Square 128 blocks, contiguous
[B, H, S, D] inputs, no masks; the package's forward is timed alongside. All of PIPELINE_QK, POLY_QUARTERS and
LAZY measured slower on the H200 (BENCHMARKS.md). --warp-specialize: the plain loop under Triton's automatic warp
specialization (tl.range(warp_specialize=True)); with Triton 3.6 on the H200 it fails to compile with 4 warps and
changes nothing with 8. --layout: the plain loop on a persistent grid (tile loop flattened or not), with the walk
rotated, Q through a descriptor, or a register cap; none beat one program per tile (BENCHMARKS.md, sixth session).
--row-sums: the row sums of P from a product with a block of ones on the tensor cores instead of adds and shuffles
(the package's forward measured slower with it, twelfth session).

    python benchmarks/exp_fwd.py --dim 128 --density 0.25             # exponential / lazy-rescale grid
    python benchmarks/exp_fwd.py --dim 128 --pipeline                 # loads x hand-pipelined QK^T grid
    python benchmarks/exp_fwd.py --dim 64 --plain --configs 64,128,4,2 128,64,8,3   # tiles of the plain loop
    python benchmarks/exp_fwd.py --dim 128 --warp-specialize --configs 128,64,4,2 128,128,8,2
    python benchmarks/exp_fwd.py --dim 128 --layout --persistent 2 3 --maxnreg 168 --configs 128,64,4,2
    python benchmarks/exp_fwd.py --dim 64 --layout --row-sums --configs 64,128,4,2 128,128,8,2
"""

import argparse

import torch
import triton
import triton.language as tl
import triton.testing

import blockattn
from blockattn.bench import Case, block_mask
from blockattn.kernels.forward import LOG2E


@triton.jit
def _load_kv(desc, base, start_n, offs_n0, offs_d, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        tile = desc.load([base + start_n, 0])
    else:
        tile = tl.load(desc + (base + start_n + offs_n0[:, None]).to(tl.int64) * HEAD_DIM + offs_d[None, :])
    return tile


@triton.jit
def _exp2_poly(x):
    """2^x on the FMA pipe (FlashAttention-4's trick): 2^round(x) from the exponent bits, 2^f for f in
    [-0.5, 0.5] from a degree-3 polynomial (relative error 7.5e-5, far below bf16's 3.9e-3)."""
    x = tl.maximum(x, -126.0)
    shifted = x + 12582912.0  # 1.5 * 2^23: rounds x to an integer j in the low mantissa bits
    f = x - (shifted - 12582912.0)
    p = 0.0551716685295105 * f + 0.24261115491390228
    p = p * f + 0.6932609677314758
    p = p * f + 0.9999280571937561
    bits = p.to(tl.int32, bitcast=True) + (shifted.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _halves(x):
    """[R, C] -> its left and right [R, C/2] halves (in the MMA layout a thread holds columns c and c + C/2)."""
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [rows, 2, cols // 2]), (0, 2, 1)))


@triton.jit
def _joined(left, right):
    rows: tl.constexpr = left.shape[0]
    cols: tl.constexpr = left.shape[1]
    return tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), [rows, 2 * cols])


@triton.jit
def _exp2_mixed(x, POLY_QUARTERS: tl.constexpr):
    """2^x with POLY_QUARTERS of the 4 column quarters on the FMA pipe (_exp2_poly), the rest on the MUFU."""
    if POLY_QUARTERS == 0:
        return tl.math.exp2(x)
    elif POLY_QUARTERS == 4:
        return _exp2_poly(x)
    else:
        left, right = _halves(x)
        if POLY_QUARTERS == 2:
            return _joined(tl.math.exp2(left), _exp2_poly(right))
        else:
            tl.static_assert(POLY_QUARTERS == 1, "POLY_QUARTERS: 0, 1, 2 or 4")
            right_a, right_b = _halves(right)
            return _joined(tl.math.exp2(left), _joined(tl.math.exp2(right_a), _exp2_poly(right_b)))


@triton.jit
def _online_softmax_step(qk, m_i, l_i, acc, v, scale_log2, POLY_QUARTERS: tl.constexpr = 0, LAZY: tl.constexpr = False,
                         ROW_SUMS_MMA: tl.constexpr = False):
    """One tile of the online softmax. ROW_SUMS_MMA: l_i is [BM, 16] and the row sums come from P (rounded as for
    P V) times a [BN, 16] block of ones on the tensor cores, with no adds or shuffles."""
    m_cand = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    if ROW_SUMS_MMA:
        m_new = m_cand
        p16 = tl.math.exp2(qk * scale_log2 - m_new[:, None]).to(v.dtype)
        alpha = tl.math.exp2(m_i - m_new)
        ones = tl.full([v.shape[0], 16], 1.0, tl.float32).to(v.dtype)
        l_i = tl.dot(p16, ones, l_i * alpha[:, None])
        acc = tl.dot(p16, v, acc * alpha[:, None])
    elif LAZY:
        # Rescale only when some row's max grew by more than 2^8 (FlashAttention-4): otherwise keep the stale max,
        # p stays below 256, and the [BM, D] accumulator skips its multiply. Exact: the final division uses the
        # same max as the sums.
        if tl.max(m_cand - m_i, 0) > 8.0:
            alpha = tl.math.exp2(m_i - m_cand)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_cand
        p = _exp2_mixed(qk * scale_log2 - m_i[:, None], POLY_QUARTERS)
        l_i = l_i + tl.sum(p, 1)
        m_new = m_i
    else:
        m_new = m_cand
        p = _exp2_mixed(qk * scale_log2 - m_new[:, None], POLY_QUARTERS)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
    if not ROW_SUMS_MMA:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _query_tile(Q, KV_COUNT, KV_INDEX, seq, n_list, pid_m, bh, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_M: tl.constexpr, Q_TMA: tl.constexpr):
    """A program's query tile: (start_m, offs_m, offs_d, base, q [BM, D], kv count, kv list row, q_block); Q_TMA:
    Q is a descriptor of the [B * H * S, D] view."""
    start_m = pid_m * BLOCK_M
    q_block = start_m // BLOCK_Q
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = bh * seq  # row of this head's first token in the [B * H * S, D] views
    if Q_TMA:
        q = Q.load([base + start_m, 0])
    else:
        q = tl.load(Q + (base + offs_m[:, None]).to(tl.int64) * HEAD_DIM + offs_d[None, :])
    count = tl.load(KV_COUNT + bh * (seq // BLOCK_Q) + q_block)
    index_row = KV_INDEX + (bh * (seq // BLOCK_Q) + q_block).to(tl.int64) * n_list
    return start_m, offs_m, offs_d, base, q, count, index_row, q_block


@triton.jit
def fwd_variant(Q, K, V, Out, KV_COUNT, KV_INDEX, scale_log2, seq, n_list,
                HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, PIPELINE_QK: tl.constexpr,
                POLY_QUARTERS: tl.constexpr, LAZY: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False):
    TILES: tl.constexpr = BLOCK_KV // BLOCK_N
    start_m, offs_m, offs_d, base, q, count, index_row, q_block = _query_tile(
        Q, KV_COUNT, KV_INDEX, seq, n_list, tl.program_id(0), tl.program_id(1), HEAD_DIM, BLOCK_Q, BLOCK_M, False)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    total = count * TILES
    if PIPELINE_QK:
        start_n = tl.load(index_row) * BLOCK_KV
        k = _load_kv(K, base, start_n, offs_n0, offs_d, HEAD_DIM, TMA)
        qk = tl.dot(q, tl.trans(k))
        for it in range(0, total - 1):
            nxt = it + 1
            start_next = tl.load(index_row + nxt // TILES) * BLOCK_KV + (nxt % TILES) * BLOCK_N
            k = _load_kv(K, base, start_next, offs_n0, offs_d, HEAD_DIM, TMA)
            qk_next = tl.dot(q, tl.trans(k))
            v = _load_kv(V, base, start_n, offs_n0, offs_d, HEAD_DIM, TMA)
            m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, v, scale_log2, POLY_QUARTERS, LAZY)
            qk = qk_next
            start_n = start_next
        v = _load_kv(V, base, start_n, offs_n0, offs_d, HEAD_DIM, TMA)
        m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, v, scale_log2, POLY_QUARTERS, LAZY)
    else:
        for it in tl.range(0, total, warp_specialize=WARP_SPECIALIZE):
            start_n = tl.load(index_row + it // TILES) * BLOCK_KV + (it % TILES) * BLOCK_N
            k = _load_kv(K, base, start_n, offs_n0, offs_d, HEAD_DIM, TMA)
            v = _load_kv(V, base, start_n, offs_n0, offs_d, HEAD_DIM, TMA)
            qk = tl.dot(q, tl.trans(k))
            m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, v, scale_log2, POLY_QUARTERS, LAZY)
    acc = acc / l_i[:, None]
    tl.store(Out + (base + offs_m[:, None]).to(tl.int64) * HEAD_DIM + offs_d[None, :], acc.to(Out.dtype.element_ty))


@triton.jit
def _plain_tile(Q, K, V, Out, KV_COUNT, KV_INDEX, scale_log2, seq, n_list, pid_m, bh,
                HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROTATE: tl.constexpr, Q_TMA: tl.constexpr,
                ROW_SUMS_MMA: tl.constexpr, UNROLL: tl.constexpr = 1, ONE_ACC_BUFFER: tl.constexpr = False):
    """The plain loop (descriptor loads) for one query tile; ROTATE starts the walk at entry q_block % count;
    Q_TMA: Q comes through a descriptor too (Q is one then), so it can stay in shared memory; ROW_SUMS_MMA: see
    _online_softmax_step; UNROLL: Triton's loop unroll factor for the walk (an unrolled body lets the scheduler
    overlap one tile's softmax with the next tile's products); ONE_ACC_BUFFER: tl.range's disallow_acc_multi_buffer."""
    TILES: tl.constexpr = BLOCK_KV // BLOCK_N
    start_m, offs_m, offs_d, base, q, count, index_row, q_block = _query_tile(
        Q, KV_COUNT, KV_INDEX, seq, n_list, pid_m, bh, HEAD_DIM, BLOCK_Q, BLOCK_M, Q_TMA)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if ROW_SUMS_MMA:
        l_i = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    total = count * TILES
    shift = (q_block % tl.maximum(count, 1)) * TILES if ROTATE else 0
    for it in tl.range(0, total, loop_unroll_factor=UNROLL, disallow_acc_multi_buffer=ONE_ACC_BUFFER):
        rot = it
        if ROTATE:
            rot = it + shift
            rot = tl.where(rot >= total, rot - total, rot)
        start_n = tl.load(index_row + rot // TILES) * BLOCK_KV + (rot % TILES) * BLOCK_N
        k = K.load([base + start_n, 0])
        v = V.load([base + start_n, 0])
        qk = tl.dot(q, tl.trans(k))
        m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, v, scale_log2, ROW_SUMS_MMA=ROW_SUMS_MMA)
    if ROW_SUMS_MMA:
        l_i = tl.max(l_i, 1)
    acc = acc / l_i[:, None]
    tl.store(Out + (base + offs_m[:, None]).to(tl.int64) * HEAD_DIM + offs_d[None, :], acc.to(Out.dtype.element_ty))


@triton.jit
def fwd_persistent(Q, K, V, Out, KV_COUNT, KV_INDEX, scale_log2, seq, n_list, num_tiles,
                   HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
                   ROTATE: tl.constexpr, Q_TMA: tl.constexpr, ROW_SUMS_MMA: tl.constexpr = False,
                   UNROLL: tl.constexpr = 1, ONE_ACC_BUFFER: tl.constexpr = False):
    """PERSISTENT: a grid of a few programs per SM, each walking query tiles pid, pid + grid, ... (FLATTEN asks
    Triton to fuse the tile loop with the key loop, so the pipeline runs across tiles); else one tile each."""
    if PERSISTENT:
        tiles_per_head = seq // BLOCK_M
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
            _plain_tile(Q, K, V, Out, KV_COUNT, KV_INDEX, scale_log2, seq, n_list, tile % tiles_per_head,
                        tile // tiles_per_head, HEAD_DIM, BLOCK_Q, BLOCK_KV, BLOCK_M, BLOCK_N, ROTATE, Q_TMA,
                        ROW_SUMS_MMA, UNROLL, ONE_ACC_BUFFER)
    else:
        _plain_tile(Q, K, V, Out, KV_COUNT, KV_INDEX, scale_log2, seq, n_list, tl.program_id(0), tl.program_id(1),
                    HEAD_DIM, BLOCK_Q, BLOCK_KV, BLOCK_M, BLOCK_N, ROTATE, Q_TMA, ROW_SUMS_MMA, UNROLL, ONE_ACC_BUFFER)


def run_plain(q, k, v, blocks, config, persistent=0, flatten=False, rotate=False, maxnreg=None, q_tma=False,
              row_sums_mma=False, unroll=1, one_acc_buffer=False):
    """The plain loop with descriptor loads; persistent = programs per SM (0: one program per tile)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    block_m, block_n, warps, stages = config
    batch, heads, seq, dim = q.shape
    out = torch.empty_like(q)
    kd = TensorDescriptor.from_tensor(k.view(-1, dim), [block_n, dim])
    vd = TensorDescriptor.from_tensor(v.view(-1, dim), [block_n, dim])
    qd = TensorDescriptor.from_tensor(q.view(-1, dim), [block_m, dim]) if q_tma else q
    block_q, block_kv = blocks.block_size
    num_tiles = seq // block_m * batch * heads
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    grid = (min(num_tiles, persistent * sms),) if persistent else (seq // block_m, batch * heads)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    compiled = []

    def call():
        kernel = fwd_persistent[grid](qd, kd, vd, out, blocks.kv_count, blocks.kv_index, q.shape[-1] ** -0.5 * LOG2E,
                                      seq, blocks.kv_index.shape[-1], num_tiles, HEAD_DIM=dim, BLOCK_Q=block_q,
                                      BLOCK_KV=block_kv, BLOCK_M=block_m, BLOCK_N=block_n,
                                      PERSISTENT=bool(persistent), FLATTEN=flatten, ROTATE=rotate, Q_TMA=q_tma,
                                      ROW_SUMS_MMA=row_sums_mma, UNROLL=unroll, ONE_ACC_BUFFER=one_acc_buffer,
                                      num_warps=warps, num_stages=stages, **extra)
        if not compiled:
            compiled.append(kernel)
        return out
    return call, compiled


CONFIGS = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]


def run_variant(q, k, v, blocks, tma, pipeline, config, poly_quarters=0, lazy=False, warp_specialize=False):
    from triton.tools.tensor_descriptor import TensorDescriptor
    block_m, block_n, warps, stages = config
    batch, heads, seq, dim = q.shape
    out = torch.empty_like(q)
    k2, v2 = k.view(-1, dim), v.view(-1, dim)
    kd, vd = ((TensorDescriptor.from_tensor(k2, [block_n, dim]), TensorDescriptor.from_tensor(v2, [block_n, dim]))
              if tma else (k2, v2))
    block_q, block_kv = blocks.block_size
    grid = (seq // block_m, batch * heads)

    def call():
        fwd_variant[grid](q, kd, vd, out, blocks.kv_count, blocks.kv_index, q.shape[-1] ** -0.5 * LOG2E, seq,
                          blocks.kv_index.shape[-1], HEAD_DIM=dim, BLOCK_Q=block_q, BLOCK_KV=block_kv,
                          BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma, PIPELINE_QK=pipeline,
                          POLY_QUARTERS=poly_quarters, LAZY=lazy, WARP_SPECIALIZE=warp_specialize, num_warps=warps,
                          num_stages=stages)
        return out
    return call


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--configs", nargs="+", help="tile configs as BLOCK_M,BLOCK_N,warps,stages (default: CONFIGS)")
    parser.add_argument("--plain", action="store_true", help="only the plain loop (descriptor loads), no variants")
    parser.add_argument("--warp-specialize", action="store_true", help="the plain loop with and without Triton's "
                        "automatic warp specialization (tl.range(warp_specialize=True))")
    parser.add_argument("--layout", action="store_true", help="the plain loop: one program per tile, Q by pointers "
                        "or through a descriptor, the walk rotated, register caps (--maxnreg), persistent grids "
                        "(--persistent, tile loop flattened or not)")
    parser.add_argument("--maxnreg", type=int, nargs="*", default=[], help="register caps for --layout")
    parser.add_argument("--persistent", type=int, nargs="*", default=[], help="programs per SM for --layout")
    parser.add_argument("--row-sums", action="store_true", help="--layout also runs the loop with its row sums on "
                        "the tensor cores (P times a block of ones)")
    parser.add_argument("--unroll", type=int, nargs="*", default=[], help="--layout also runs the loop unrolled by "
                        "these factors (tl.range's loop_unroll_factor), and with one accumulator buffer")
    parser.add_argument("--pipeline", action="store_true", help="the loads x hand-pipelined QK^T grid instead of the "
                        "exponential / lazy-rescale grid")
    args = parser.parse_args()
    case = Case(heads=args.heads, seq=args.seq, dim=args.dim, block=(128, 128), density=args.density)
    device = torch.device("cuda")
    keep = block_mask(case, device)
    blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
    # The experiment indexes lists as [H, nq, L] of batch 1: expand the mask's batch.
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, case.heads, case.seq, case.dim, device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    flops = 4.0 * case.heads * case.seq * case.seq * case.dim * blocks.density()
    expected = blockattn.attention(q, k, v, blocks)
    ms = triton.testing.do_bench(lambda: blockattn.attention(q, k, v, blocks), warmup=50, rep=200,
                                 return_mode="median")
    print(f"== {case.label}: package forward {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
    variants = ([(tma, pipeline, 0, False, False) for tma in (False, True) for pipeline in (False, True)]
                if args.pipeline else [(True, False, split, lazy, False) for lazy in (False, True) for split in (0, 1, 2, 4)])
    if args.plain:
        variants = [(True, False, 0, False, False)]
    if args.warp_specialize:
        variants = [(tma, False, 0, False, ws) for ws in (False, True) for tma in (True, False)]
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else CONFIGS
    if args.layout:
        layouts = ([(0, False, False, None, False, False), (0, False, False, None, True, False),
                    (0, False, True, None, True, False)]
                   + [(0, False, False, cap, True, False) for cap in args.maxnreg]
                   + [(n, flat, False, None, True, False) for n in args.persistent for flat in (False, True)]
                   + [(0, False, False, None, q_tma, True) for q_tma in (False, True) if args.row_sums])
        layouts = [layout + (1, False) for layout in layouts] + [
            (0, False, False, None, True, False, factor, False) for factor in args.unroll] + [
            (0, False, False, None, True, False, 1, True)] * bool(args.unroll)
        for config in configs:
            for persistent, flatten, rotate, cap, q_tma, row_sums, unroll, one_acc in layouts:
                label = (f"persistent={persistent} flatten={int(flatten)} rotate={int(rotate)} maxnreg={cap} "
                         f"q_tma={int(q_tma)} row_sums_mma={int(row_sums)} unroll={unroll} one_acc={int(one_acc)} "
                         f"{config[0]}x{config[1]} w{config[2]} s{config[3]}")
                try:
                    call, compiled = run_plain(q, k, v, blocks, config, persistent, flatten, rotate, cap, q_tma,
                                               row_sums, unroll, one_acc)
                    err = (call().float() - expected.float()).abs().max().item()
                    ms = triton.testing.do_bench(call, warmup=50, rep=200, return_mode="median")
                    print(f"{label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s) max err {err:.1e} "
                          f"regs {compiled[0].n_regs} spills {compiled[0].n_spills}", flush=True)
                except Exception as error:
                    print(f"{label}: failed {type(error).__name__}: {str(error)[:200]}", flush=True)
        return
    for tma, pipeline, split, lazy, ws in variants:
        for config in configs:
            label = (f"tma={int(tma)} pipeline_qk={int(pipeline)} poly_quarters={split} lazy={int(lazy)} "
                     f"ws={int(ws)} {config[0]}x{config[1]} w{config[2]} s{config[3]}")
            try:
                call = run_variant(q, k, v, blocks, tma, pipeline, config, split, lazy, ws)
                err = (call().float() - expected.float()).abs().max().item()
                ms = triton.testing.do_bench(call, warmup=50, rep=200, return_mode="median")
                print(f"{label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s) max err {err:.1e}", flush=True)
            except Exception as error:  # a variant that does not compile is a result too
                print(f"{label}: failed {type(error).__name__}: {str(error)[:200]}", flush=True)

if __name__ == "__main__":
    main()
