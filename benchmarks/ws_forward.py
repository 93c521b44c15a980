"""The forward with and without the warp-specialized Gluon kernel (kernels/forward_ws.py), and FlexAttention on the
same block mask, in one process: ms and effective TFLOP/s per case, and each ratio to FlexAttention.

    python benchmarks/ws_forward.py                       # the design cases, D=128, densities 1 .. 0.1
    python benchmarks/ws_forward.py --cases short gqa     # B8 H16 S2048/4096 d=0.5; GQA 32/8 S16384
    python benchmarks/ws_forward.py --cases causal        # is_causal over the block-causal mask, and SDPA causal
    python benchmarks/ws_forward.py --cases skewed        # target 6 on the warp-specialized forward
    python benchmarks/ws_forward.py --cases d64           # D=64 (target 1.3x FlexAttention)
    python benchmarks/ws_forward.py --cases d64more       # D=64: B8 S1024-4096, GQA 32/8, causal 128x64
    python benchmarks/ws_forward.py --cases d64sizes --no-flex   # D=64 from B8 S2048 up: where the kernel pays
    python benchmarks/ws_forward.py --cases sizes --no-flex      # the same sizes at D=128
    python benchmarks/ws_forward.py --cases d64 --stages 3 4 5   # and its ring depth (forward_ws.STAGES[64])
    python benchmarks/ws_forward.py --cases d64 design --emulate-exp2   # also with one exponential in four emulated
    python benchmarks/ws_forward.py --cases design --o-through-tma  # also with out's rows stored the other way
    python benchmarks/ws_forward.py --cases d64 --tiles 128,1,4   # also with 128-key tiles, overlapped, 4 stages
    python benchmarks/ws_forward.py --cases d64 --fixed-offsets [--query-scale 8]   # and with running maxima only
    python benchmarks/ws_forward.py --cases d64 design --triton-fixed-offsets   # the Triton forward's, the other way
    python benchmarks/ws_forward.py --cases d64causal --fixed-offsets   # causal's row counts, at random positions
    python benchmarks/ws_forward.py --cases d64 design causal --grid claimed   # every column on the persistent grid
    python benchmarks/ws_forward.py --cases d64 --q-buffers    # and D=64 with the Q buffers the other way
"""

import argparse

import torch

import blockattn
from blockattn.bench import Case, _flops, _inputs, _runners, _time_ms, block_mask
from blockattn.kernels import forward, forward_ws

SUITES = {
    "design": [Case(block=block, density=d) for block in ((128, 128), (128, 64)) for d in (1.0, 0.5, 0.25, 0.1)],
    "short": [Case(batch=8, heads=16, kv_heads=16, seq=s, density=0.5) for s in (2048, 4096)],
    "gqa": [Case(heads=32, kv_heads=kv, seq=16384, density=d) for kv in (8, 32) for d in (0.5, 0.1)],
    "blocks": [Case(block=block, density=0.25) for block in ((256, 256), (128, 192), (256, 64))],
    # target 6: a few query blocks keep everything, most little, against the uniform mask of the same density
    "skewed": [Case(density=0.25, pattern="skewed"), Case(density=0.25)],
    # 128x64: the default block shape for a mask tensor; 128x128 is what blocks=None runs (api.DENSE_BLOCK_SIZE)
    "causal": [Case(pattern="causal", block=block, density=0.5) for block in ((128, 128), (128, 64))]
    + [Case(batch=8, heads=16, kv_heads=16, seq=4096, pattern="causal", density=0.5)],
    # target 1 at D=64: >= 1.3x FlexAttention
    "d64": [Case(dim=64, block=block, density=d) for block in ((128, 128), (128, 64)) for d in (0.5, 0.25, 0.1)]
    + [Case(dim=64, pattern="causal", density=0.5)],
    # causal at D=64 against a mask with its counts (query block i keeps i + 1 key blocks, the diagonal one among
    # them) at random positions, run without the causal test: whether causal's walks, which read key blocks 0, 1, ...
    # in step across the programs, cost the fixed offsets their gain (forty-third session: none causal, 4-9% random)
    "d64causal": [Case(dim=64, pattern="causal", density=0.5), Case(dim=64, pattern="staircase", density=0.5)],
    # D=64 beside target 1's shape: short calls, GQA 32/8, the causal default block
    "d64more": [Case(batch=8, heads=16, kv_heads=16, seq=s, dim=64, density=0.5) for s in (1024, 2048, 4096)]
    + [Case(heads=32, kv_heads=8, seq=16384, dim=64, density=d) for d in (0.5, 0.1)]
    + [Case(dim=64, pattern="causal", block=(128, 64), density=0.5)],
    # D=64 from short calls up, for the kernel's minimum work (forward_ws.MIN_WORK); the first case warms the GPU
    "d64sizes": [Case(dim=64, density=0.5)]
    + [Case(batch=8, heads=16, kv_heads=16, seq=s, dim=64, density=d) for s in (2048, 4096, 8192) for d in (0.5, 0.1)]
    + [Case(heads=h, kv_heads=kv, seq=s, dim=64, density=d) for h, kv, s in ((24, 24, 8192), (24, 24, 16384),
                                                                              (32, 8, 16384)) for d in (0.5, 0.1)],
    # the same sizes at D=128
    "sizes": [Case(density=0.5)]
    + [Case(batch=8, heads=16, kv_heads=16, seq=s, density=d) for s in (2048, 4096, 8192) for d in (0.5, 0.1)]
    + [Case(heads=24, kv_heads=24, seq=s, density=d) for s in (8192, 16384) for d in (0.5, 0.1)],
}


def staircase_mask(case: Case, device) -> torch.Tensor:
    """bool [1, H, nq, nk]: query block i keeps i + 1 key blocks (as the block-causal mask of square blocks does),
    its diagonal block and i others at random."""
    nq, nk = case.seq // case.block[0], case.seq // case.block[1]
    gen = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(1, case.heads, nq, nk, generator=gen, device=device)
    rows = torch.arange(nq, device=device)
    scores[:, :, rows, rows * case.block[0] // case.block[1]] = 2.0
    rank = scores.argsort(-1, descending=True).argsort(-1)
    return rank <= (rows * case.block[0] // case.block[1])[None, None, :, None]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["design"], choices=list(SUITES))
    parser.add_argument("--stages", type=int, nargs="+", default=None,
                        help="time the warp-specialized forward with each of these ring depths for the cases' head "
                        "dim (forward_ws.STAGES), one column each")
    parser.add_argument("--emulate-exp2", action="store_true",
                        help="also time the warp-specialized forward with one exponential in four from the polynomial "
                        "(forward_ws.EMULATED_EXP2_DIMS) and the other way round")
    parser.add_argument("--o-through-tma", action="store_true",
                        help="also time the warp-specialized forward with out's rows stored the other way "
                        "(forward_ws.O_THROUGH_TMA: through the TMA unit, or by pointer stores)")
    parser.add_argument("--tiles", nargs="+", default=None, metavar="KEYS,OVERLAP,STAGES",
                        help="also time the warp-specialized forward with these tilings for the cases' head dim "
                        "(forward_ws.TILE_KEYS, OVERLAPPED and STAGES): keys a tile, 1 to overlap a tile's products "
                        "with the softmax, ring stages")
    parser.add_argument("--fixed-offsets", action="store_true",
                        help="also time the warp-specialized forward with fixed offsets the other way "
                        "(forward_ws.FIXED_OFFSET_DIMS)")
    parser.add_argument("--rise-checked", action="store_true",
                        help="also time the warp-specialized forward with the rise of bf16's fixed offsets checked "
                        "the other way (forward_ws.RISE_CHECKED_DTYPES, _DIMS and _CAUSAL_DIMS: after the walk, or "
                        "bounded by the key norms)")
    parser.add_argument("--triton-fixed-offsets", action="store_true",
                        help="also time the Triton forward with fixed offsets the other way "
                        "(forward.FIXED_OFFSET_DIMS)")
    parser.add_argument("--query-scale", type=float, default=1.0,
                        help="multiply the queries by this (8: past the bound that lets D=64 keep its offsets fixed)")
    parser.add_argument("--grid", choices=("default", "tiles", "turns", "claimed"), default="default",
                        help="the warp-specialized forward's grid for the whole run: forward_ws's settings, a "
                        "program a query tile, or the persistent grid with the tiles in turns (forward_ws."
                        "PERSISTENT_DIMS, not under is_causal) or claimed as programs free up (CLAIMED_DIMS and "
                        "CLAIMED_CAUSAL_DIMS)")
    parser.add_argument("--q-buffers", action="store_true",
                        help="also time D=64 with the Q buffers the other way (forward_ws.Q_BUFFER_DIMS: two taken in "
                        "turn by a persistent program's items, or one)")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (its ratio columns read nan)")
    args = parser.parse_args()
    if args.grid != "default":
        for setting, dims in forward_ws.grid_settings(None if args.grid == "tiles" else args.grid).items():
            setattr(forward_ws, setting, dims)
        print(f"the warp-specialized forward's grid: {args.grid}")
    default_dims, default_stages = forward_ws.HEAD_DIMS, dict(forward_ws.STAGES)
    default_tiles, default_overlapped = dict(forward_ws.TILE_KEYS), dict(forward_ws.OVERLAPPED)
    default_emulated = forward_ws.EMULATED_EXP2_DIMS
    default_o_through_tma = forward_ws.O_THROUGH_TMA
    default_fixed = forward_ws.FIXED_OFFSET_DIMS
    default_triton_fixed = forward.FIXED_OFFSET_DIMS
    default_checked, default_checked_dims = forward_ws.RISE_CHECKED_DTYPES, forward_ws.RISE_CHECKED_DIMS
    default_checked_causal_dims = forward_ws.RISE_CHECKED_CAUSAL_DIMS
    default_q_buffer_dims = forward_ws.Q_BUFFER_DIMS
    device = torch.device("cuda")
    print("| case | Triton forward ms | warp-specialized ms | flex ms | Triton vs flex | warp-specialized vs flex |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in [c for name in args.cases for c in SUITES[name]]:
        keep = staircase_mask(case, device) if case.pattern == "staircase" else block_mask(case, device)
        blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=False)
        q = q * args.query_scale
        flops = _flops(case, blocks.density())
        causal = case.pattern == "causal"
        times = {}
        outs = {}
        forward_ws.HEAD_DIMS = tuple(sorted(set(default_dims) | {case.dim}))
        for enabled in (False, True):
            forward_ws.ENABLED = enabled
            outs[enabled] = blockattn.attention(q, k, v, blocks, is_causal=causal)
            times[enabled] = _time_ms(lambda: blockattn.attention(q, k, v, blocks, is_causal=causal))
        def variant(what, triton_forward=False):
            """Time the warp-specialized forward (triton_forward: the Triton forward) as its module is set now:
            against its default, its largest gap to the Triton forward's default output, and whether it equals its
            default's bit for bit."""
            forward_ws.ENABLED = not triton_forward
            out = blockattn.attention(q, k, v, blocks, is_causal=causal)
            gap = (out.float() - outs[False].float()).abs().max()
            ms = _time_ms(lambda: blockattn.attention(q, k, v, blocks, is_causal=causal))
            forward_ws.ENABLED = True
            default = not triton_forward  # (times and outs are keyed by forward_ws.ENABLED)
            print(f"{case.label}: {'Triton forward' if triton_forward else 'warp-specialized'} with {what} "
                  f"{ms:.3f} ms ({flops / ms / 1e9:.0f}, {times[default] / ms:.3f}x the default), max gap "
                  f"{gap.item():.1e}, {'equal to' if torch.equal(out, outs[default]) else 'differs from'} the "
                  "default", flush=True)

        if args.triton_fixed_offsets:  # the Triton forward with the other setting than its default
            fixed = case.dim not in default_triton_fixed
            forward.FIXED_OFFSET_DIMS = (case.dim, ) if fixed else ()
            variant("fixed offsets" if fixed else "running maxima only", triton_forward=True)
            forward.FIXED_OFFSET_DIMS = default_triton_fixed
        for stages in args.stages or ():
            forward_ws.STAGES[case.dim] = stages
            variant(f"{stages} stages")
        forward_ws.STAGES.update(default_stages)
        for tiling in args.tiles or ():
            keys, overlap, stages = (int(x) for x in tiling.split(","))
            forward_ws.TILE_KEYS[case.dim], forward_ws.OVERLAPPED[case.dim] = keys, bool(overlap)
            forward_ws.STAGES[case.dim] = stages
            variant(f"{keys}-key tiles, overlap {overlap}, {stages} stages")
        forward_ws.STAGES.update(default_stages)
        forward_ws.TILE_KEYS.update(default_tiles)
        forward_ws.OVERLAPPED.update(default_overlapped)
        if args.emulate_exp2:  # the case's head dim with the other setting than the default
            emulated = case.dim not in default_emulated
            forward_ws.EMULATED_EXP2_DIMS = (case.dim, ) if emulated else ()
            variant("emulated exponentials" if emulated else "no emulated exponentials")
            forward_ws.EMULATED_EXP2_DIMS = default_emulated
        if args.fixed_offsets:  # the case's head dim with the other setting than the default
            fixed = case.dim not in default_fixed
            forward_ws.FIXED_OFFSET_DIMS = (case.dim, ) if fixed else ()
            variant("fixed offsets" if fixed else "running maxima only")
            forward_ws.FIXED_OFFSET_DIMS = default_fixed
        if args.rise_checked:
            checked_dims = default_checked_causal_dims if causal else default_checked_dims
            checked = not (torch.bfloat16 in default_checked and case.dim in checked_dims)
            forward_ws.RISE_CHECKED_DTYPES = (torch.bfloat16, ) if checked else ()
            forward_ws.RISE_CHECKED_DIMS = forward_ws.RISE_CHECKED_CAUSAL_DIMS = (case.dim, )
            variant("the rise checked after the walk" if checked else "the rise bounded")
            forward_ws.RISE_CHECKED_DTYPES, forward_ws.RISE_CHECKED_DIMS = default_checked, default_checked_dims
            forward_ws.RISE_CHECKED_CAUSAL_DIMS = default_checked_causal_dims
        if args.q_buffers and case.dim == 64:  # (D=128 has no shared memory for a second buffer)
            two = case.dim not in default_q_buffer_dims
            forward_ws.Q_BUFFER_DIMS = (case.dim, ) if two else ()
            variant("two Q buffers" if two else "one Q buffer")
            forward_ws.Q_BUFFER_DIMS = default_q_buffer_dims
        if args.o_through_tma:
            forward_ws.O_THROUGH_TMA = not default_o_through_tma
            variant("out through the TMA unit" if forward_ws.O_THROUGH_TMA else "out by pointer stores")
            forward_ws.O_THROUGH_TMA = default_o_through_tma
        forward_ws.ENABLED, forward_ws.HEAD_DIMS = True, default_dims
        runners = _runners(case, keep, device)
        times["flex"] = float("nan") if args.no_flex else _time_ms(lambda: runners["flex"][0](q, k, v))
        gap = (outs[True].float() - outs[False].float()).abs().max().item()
        if causal:  # cuDNN's causal forward: the dense baseline a language model would otherwise run
            sdpa = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
            with sdpa:
                ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                       enable_gqa=True))
            print(f"cuDNN SDPA causal {case.label}: {ms:.3f} ms", flush=True)

        def cell(ms):
            return f"{ms:.3f} ({flops / ms / 1e9:.0f})"
        print(f"| {case.label} | {cell(times[False])} | {cell(times[True])} | {cell(times['flex'])} | "
              f"{times['flex'] / times[False]:.2f}x | {times['flex'] / times[True]:.2f}x | max gap {gap:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
