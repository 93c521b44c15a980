"""Experiment: a 5-product backward that stores dS instead of recomputing it (not part of the package).

Today's backward runs 7 tile products: the dK/dV kernel's 4 and the dQ kernel's 3, two of which (QK^T, dO V^T)
recompute what the dK/dV kernel already had. Here the dK/dV loop also writes each dS tile (bf16) into a
workspace with one 128x128 slot per kept block, in kv-list order, and a second pass computes dQ = scale * dS K
over the kv lists: one product, reading the workspace once (memory-bound: 2 bytes per kept score).

Timed on stripped loops (no masks inside blocks, contiguous inputs, 128x128 blocks): the dK/dV loop with and
without the stores, and the dQ pass; the package's backward kernels (profiler) alongside, so

    new backward ~= package backward - package dQ kernel + (stores' cost in dK/dV) + dQ pass.

Outputs are checked against the package's gradients.

    python benchmarks/exp_stored_ds.py --density 0.25 0.1
"""

import argparse

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

import blockattn
from blockattn.bench import Case, block_mask
from blockattn.kernels.forward import LOG2E

from kernel_resources import kernel_ms


@triton.jit
def dkdv_store(Q, K, V, DO, DK, DV, Lse2, Delta, Q_COUNT, Q_INDEX, Q_SLOT, WS, WS_DESC, scale_log2, scale, seq, n_list,
               head0,
               HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               STORE: tl.constexpr):
    """STORE 0: no dS stores; 1: slot laid out [key, query]; 2: slot laid out [query, key]; 3 / 4: as 1 / 2
    through a tensor descriptor (WS_DESC over the workspace as [slots * 128, 128]; asynchronous bulk stores)."""
    TILES: tl.constexpr = BLOCK // BLOCK_M
    pid_n = tl.program_id(0)
    bh = tl.program_id(1) + head0  # head0: the first (batch x head) of this launch's chunk
    n_blocks = seq // BLOCK
    start_n = pid_n * BLOCK_N
    kv_block = start_n // BLOCK
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m0 = tl.arange(0, BLOCK_M)
    base = bh.to(tl.int64) * seq * HEAD_DIM
    k = tl.load(K + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
    v = tl.load(V + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    list_off = (bh * n_blocks + kv_block).to(tl.int64) * n_list
    count = tl.load(Q_COUNT + bh * n_blocks + kv_block)
    total = count * TILES
    first = (pid_n % tl.maximum(count, 1)) * TILES
    k_in = start_n % BLOCK + tl.arange(0, BLOCK_N)
    for step in range(0, total):
        it = step + first
        it = tl.where(it >= total, it - total, it)
        entry = it // TILES
        q_block = tl.load(Q_INDEX + list_off + entry)
        q_in = (it % TILES) * BLOCK_M + offs_m0
        offs_m = q_block * BLOCK + q_in
        q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
        kq = tl.dot(k, tl.trans(q))
        lse2 = tl.load(Lse2 + bh.to(tl.int64) * seq + offs_m)
        p_t = tl.math.exp2(kq * scale_log2 - lse2[None, :])
        do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(Delta + bh.to(tl.int64) * seq + offs_m)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(do.dtype)
        dk = tl.dot(ds_t, q, dk)
        if STORE != 0:
            slot = tl.load(Q_SLOT + list_off + entry).to(tl.int64) * (BLOCK * BLOCK)
            if STORE == 1:
                tl.store(WS + slot + k_in[:, None] * BLOCK + q_in[None, :], ds_t)
            elif STORE == 2:
                tl.store(WS + slot + q_in[None, :] * BLOCK + k_in[:, None], ds_t)
            elif STORE == 3:
                WS_DESC.store([(slot // BLOCK + start_n % BLOCK).to(tl.int32), (it % TILES) * BLOCK_M], ds_t)
            else:
                WS_DESC.store([(slot // BLOCK + (it % TILES) * BLOCK_M).to(tl.int32), start_n % BLOCK],
                              tl.trans(ds_t))
    tl.store(DK + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def dq_from_ds(K, DQ, KV_COUNT, KV_INDEX, ROW_SLOT, WS, scale, seq, n_list, head0,
               HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               STORE: tl.constexpr):
    """dQ [BM, D] of one query tile: sum over its kv list of dS tile [BM, BN] @ K tile [BN, D], times scale."""
    TILES: tl.constexpr = BLOCK // BLOCK_N
    pid_m = tl.program_id(0)
    bh = tl.program_id(1) + head0  # head0: the first (batch x head) of this launch's chunk
    n_blocks = seq // BLOCK
    start_m = pid_m * BLOCK_M
    q_block = start_m // BLOCK
    q_in = start_m % BLOCK + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n0 = tl.arange(0, BLOCK_N)
    base = bh.to(tl.int64) * seq * HEAD_DIM
    row = bh * n_blocks + q_block
    count = tl.load(KV_COUNT + row)
    slot0 = tl.load(ROW_SLOT + row).to(tl.int64)
    list_off = row.to(tl.int64) * n_list
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for it in range(0, count * TILES):
        entry = it // TILES
        kv_block = tl.load(KV_INDEX + list_off + entry)
        k_in = (it % TILES) * BLOCK_N + offs_n0
        slot = (slot0 + entry) * (BLOCK * BLOCK)
        if STORE % 2 == 1:
            ds = tl.trans(tl.load(WS + slot + k_in[:, None] * BLOCK + q_in[None, :]))
        else:
            ds = tl.load(WS + slot + q_in[:, None] * BLOCK + k_in[None, :])
        keys = kv_block * BLOCK + k_in
        kt = tl.load(K + base + keys[:, None] * HEAD_DIM + offs_d[None, :])
        dq = tl.dot(ds, kt, dq)
    rows = start_m + tl.arange(0, BLOCK_M)
    tl.store(DQ + base + rows[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty))


def slots(blocks):
    """Slot of each kept block in kv-list order: (row_slot int32 [H, nq]: slot of each kv list's first entry,
    q_slot int32 [H, nk, nq]: slot of each q-list entry, nnz)."""
    mask = blocks.mask[0]  # [H, nq, nk]
    heads, nq, nk = mask.shape
    flat = mask.reshape(-1)
    slot_of = torch.full((heads * nq * nk,), -1, dtype=torch.int32, device=mask.device)
    nnz = int(flat.sum().item())
    slot_of[flat] = torch.arange(nnz, dtype=torch.int32, device=mask.device)
    slot_of = slot_of.view(heads, nq, nk)
    counts = blocks.kv_count[0].reshape(-1).to(torch.int64)
    row_slot = (torch.cumsum(counts, 0) - counts).to(torch.int32).view(heads, nq)
    q_count, q_index = blocks.q_lists()
    q_index = q_index[0].long()  # [H, nk, nq]
    head = torch.arange(heads, device=mask.device)[:, None, None]
    key = torch.arange(nk, device=mask.device)[None, :, None]
    q_slot = slot_of[head, q_index.clamp(max=nq - 1), key]
    return row_slot.contiguous(), q_slot.to(torch.int32).contiguous(), nnz


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, nargs="+", default=[0.25, 0.1])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--dkdv", nargs="+", default=["64,64,4,2", "64,64,4,3"], help="BLOCK_M,BLOCK_N,warps,stages")
    parser.add_argument("--stores", type=int, nargs="+", default=[0, 2, 3, 4])
    parser.add_argument("--overlap", type=int, nargs="*", default=[], help="head chunk counts for the chunked "
                        "stored-dS backward (dQ pass in line, or on a second stream overlapping the next chunk)")
    parser.add_argument("--alias", type=int, default=0, help="also time the dK/dV loop's stores into only this many "
                        "slots (an L2-sized region: what the stores cost without their DRAM traffic)")
    parser.add_argument("--dq", nargs="+", default=["128,128,8,2", "128,128,8,3", "128,64,8,3", "128,64,4,3",
                                                    "64,128,4,3", "128,128,4,3"])
    args = parser.parse_args()
    device = torch.device("cuda")
    heads, seq, dim = args.heads, args.seq, 128
    for density in args.density:
        case = Case(heads=heads, kv_heads=heads, seq=seq, density=density)
        blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), case.block, seq, seq)
        row_slot, q_slot, nnz = slots(blocks)
        q_count, q_index = (t.contiguous() for t in blocks.q_lists())
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (torch.randn(1, heads, seq, dim, device=device, dtype=torch.bfloat16, generator=gen)
                       for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out, lse = blockattn.attention(q, k, v, blocks, return_lse=True)
        out.backward(do)
        want = (q.grad.detach().clone(), k.grad.detach().clone(), v.grad.detach().clone())
        q, k, v = (t.detach() for t in (q, k, v))
        lse2 = (lse.float() * LOG2E).contiguous()
        delta = (out.float() * do.float()).sum(-1).contiguous()
        scale = dim ** -0.5
        flops = 2.0 * heads * seq * seq * dim * blocks.density()  # one tile product over the kept blocks
        print(f"density {blocks.density():.3f}: workspace {nnz} slots, {nnz * 128 * 128 * 2 / 2**30:.2f} GiB",
              flush=True)

        def package_bwd():
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            blockattn.attention(qq, kk, vv, blocks).backward(do)
        times = kernel_ms(package_bwd)
        for name, ms in sorted(times.items(), key=lambda x: -x[1])[:6]:
            print(f"  package kernel {name[:60]}: {ms:.3f} ms")
        ws = torch.empty(nnz, 128, 128, device=device, dtype=torch.bfloat16)
        dq = torch.empty_like(q)
        for store in args.stores:
            # Aliased runs first: the last run must leave the true dS in the workspace for the dQ pass.
            for config, slot_map in ([(c, q_slot % args.alias) for c in args.dkdv] if args.alias and store else []) + [
                    (c, q_slot) for c in args.dkdv]:
                bm, bn, warps, stages = (int(x) for x in config.split(","))
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                box = [bn, bm] if store == 3 else [bm, bn]
                aliased = f" into {args.alias} slots" if slot_map is not q_slot else ""
                ws_desc = TensorDescriptor.from_tensor(ws.view(-1, 128), box)
                run = lambda: dkdv_store[(seq // bn, heads)](
                    q, k, v, do, dk, dv, lse2, delta, q_count, q_index, slot_map, ws, ws_desc, scale * LOG2E, scale, seq,
                    q_index.shape[-1], 0, HEAD_DIM=dim, BLOCK=128, BLOCK_M=bm, BLOCK_N=bn, STORE=store,
                    num_warps=warps, num_stages=stages)
                try:
                    ms = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median")
                except Exception as error:  # noqa: BLE001 - an experiment reports and goes on
                    print(f"  dkdv store={store} {config}{aliased}: failed {str(error)[:200]}", flush=True)
                    continue
                gap = max((got.float() - w.float()).abs().max().item() for got, w in zip((dk, dv), want[1:]))
                print(f"  dkdv store={store} {config}{aliased}: {ms:.3f} ms ({4 * flops / ms / 1e9:.0f} TFLOP/s of 4 "
                      f"products), dk/dv gap {gap:.2e}", flush=True)
            if store == 0:
                continue
            for config in args.dq:
                bm, bn, warps, stages = (int(x) for x in config.split(","))
                run = lambda: dq_from_ds[(seq // bm, heads)](
                    k, dq, blocks.kv_count, blocks.kv_index, row_slot, ws, scale, seq, blocks.kv_index.shape[-1], 0,
                    HEAD_DIM=dim, BLOCK=128, BLOCK_M=bm, BLOCK_N=bn, STORE=store, num_warps=warps,
                    num_stages=stages)
                try:
                    ms = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median")
                except Exception as error:  # noqa: BLE001
                    print(f"  dq pass store={store} {config}: failed {str(error)[:200]}", flush=True)
                    continue
                gap = (dq.float() - want[0].float()).abs().max().item()
                print(f"  dq pass store={store} {config}: {ms:.3f} ms ({nnz * 32768 / ms / 1e9:.2f} TB/s of dS, "
                      f"{flops / ms / 1e9:.0f} TFLOP/s), dq gap {gap:.2e} (|dq| max {want[0].abs().max().item():.2e})",
                      flush=True)
        if args.overlap:
            overlap_runs(args, q, k, v, do, lse2, delta, blocks, q_count, q_index, q_slot, row_slot, ws, want)
        ws = None
        torch.cuda.empty_cache()


def overlap_runs(args, q, k, v, do, lse2, delta, blocks, q_count, q_index, q_slot, row_slot, ws, want):
    """The stored-dS backward in head chunks (descriptor stores, [query, key] slots, the first --dkdv and --dq
    configs): each chunk's dQ pass (memory-bound) after its dK/dV loop (compute-bound), either on the same stream or
    on a second stream, where it can overlap the next chunk's dK/dV loop."""
    heads, seq, dim = q.shape[1], q.shape[2], q.shape[3]
    bm_kv, bn_kv, warps_kv, stages_kv = (int(x) for x in args.dkdv[0].split(","))
    bm_q, bn_q, warps_q, stages_q = (int(x) for x in args.dq[0].split(","))
    scale = dim ** -0.5
    ws_desc = TensorDescriptor.from_tensor(ws.view(-1, 128), [bm_kv, bn_kv])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    side = torch.cuda.Stream()

    def dkdv(head0, count):
        dkdv_store[(seq // bn_kv, count)](
            q, k, v, do, dk, dv, lse2, delta, q_count, q_index, q_slot, ws, ws_desc, scale * LOG2E, scale, seq,
            q_index.shape[-1], head0, HEAD_DIM=dim, BLOCK=128, BLOCK_M=bm_kv, BLOCK_N=bn_kv, STORE=4,
            num_warps=warps_kv, num_stages=stages_kv)

    def dq_pass(head0, count):
        dq_from_ds[(seq // bm_q, count)](
            k, dq, blocks.kv_count, blocks.kv_index, row_slot, ws, scale, seq, blocks.kv_index.shape[-1], head0,
            HEAD_DIM=dim, BLOCK=128, BLOCK_M=bm_q, BLOCK_N=bn_q, STORE=4, num_warps=warps_q, num_stages=stages_q)

    for chunks in args.overlap:
        for overlap in (False, True):
            per = heads // chunks

            def run():
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                for c in range(chunks):
                    dkdv(c * per, per)
                    if overlap:
                        done = torch.cuda.Event()
                        done.record(main)
                        side.wait_event(done)
                        with torch.cuda.stream(side):
                            dq_pass(c * per, per)
                    else:
                        dq_pass(c * per, per)
                main.wait_stream(side)
            ms = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median")
            gaps = [(got.float() - w.float()).abs().max().item() for got, w in zip((dq, dk, dv), want)]
            print(f"  stored-dS backward, {chunks} head chunks, dQ pass {'on a second stream' if overlap else 'in line'}"
                  f": {ms:.3f} ms, gaps dq/dk/dv {gaps[0]:.1e} / {gaps[1]:.1e} / {gaps[2]:.1e}", flush=True)


if __name__ == "__main__":
    main()
