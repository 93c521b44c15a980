"""The `blockattn` command line: `demo` (the main job), `bench` and `show`."""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from .api import QUANTS

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _block(text: str) -> tuple[int, int]:
    try:
        block_q, block_kv = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a block is written QxKV, e.g. 128x64; got {text!r}") from None
    if block_q <= 0 or block_kv <= 0:
        raise argparse.ArgumentTypeError(f"block sides must be positive, got {text!r}")
    return block_q, block_kv


def _density(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"density must be in (0, 1], got {text}")
    return value


def _wall_ms(fns, device, repeats: int) -> list:
    """Median wall time in ms of each of fns (synchronizing the GPU around each run), after a warm-up run each. The
    functions take turns, so a slow spell of a shared machine falls on all of them rather than on one."""
    times = [[] for _ in fns]
    for round_ in range(repeats + 1):
        for fn, fn_times in zip(fns, times):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_ > 0:
                fn_times.append((time.perf_counter() - start) * 1e3)
    return [sorted(t)[len(t) // 2] for t in times]


def _device() -> torch.device:
    """The GPU when there is one (demo and bench run there), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _problem_size(args, device: torch.device) -> tuple:
    """(seq, heads, dim, dtype name) from args, those left unset sized for the device: B1 H24 S32768 D128 bf16 on a
    GPU, H4 S4096 D64 fp32 on the CPU (where a GPU-sized call would take minutes)."""
    on_gpu = device.type == "cuda"
    return (args.seq or (32768 if on_gpu else 4096), args.heads or (24 if on_gpu else 4),
            args.dim or (128 if on_gpu else 64), args.dtype or ("bf16" if on_gpu else "fp32"))


def demo(args) -> int:
    """Build a problem and a random block mask, run sparse attention on the best backend present, report the error
    against dense attention on the same mask, the density, the time and the speedup over dense, and draw the mask."""
    from tqdm import tqdm

    import blockattn
    from blockattn.bench import Case, block_mask

    device = _device()
    on_gpu = device.type == "cuda"
    seq, heads, dim, dtype = _problem_size(args, device)
    dtype = _DTYPES[dtype]
    case = Case(batch=1, heads=heads, kv_heads=heads, seq=seq, dim=dim, block=args.block, density=args.density)
    backend = blockattn.api.resolve_backend("auto", device)
    print(f"blockattn demo on {torch.cuda.get_device_name() if on_gpu else 'CPU'}: B=1 H={heads} S={seq} D={dim} "
          f"{str(dtype).replace('torch.', '')}, block {args.block[0]}x{args.block[1]}, backend {backend}")

    steps = tqdm(total=6, desc="demo", unit="step", file=sys.stdout)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen, device=device, dtype=dtype) for _ in range(3))
    keep = block_mask(case, device, seed=args.seed)
    steps.set_postfix_str("block mask")
    steps.update()
    blocks = blockattn.BlockSparsity.from_mask(keep, args.block, seq, seq)
    density = blocks.density()
    steps.set_postfix_str("prepared lists")
    steps.update()

    out = blockattn.attention(q, k, v, blocks)  # also compiles/tunes the kernels on the GPU
    sparse_ms, dense_ms = _wall_ms([lambda: blockattn.attention(q, k, v, blocks),
                                    lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)],
                                   device, args.repeats)
    steps.set_postfix_str("sparse and dense attention")
    steps.update(2)

    # Exactness: dense attention restricted to the same blocks, in fp32, a few heads and at most 8192 query rows
    # at a time (the token-level mask of a whole 32k problem would not fit).
    rows = min(seq, 8192)
    num = den = 0.0
    for h in range(0, heads, 4):
        keep_heads = blocks.mask[:, h:h + 4] if blocks.mask.shape[1] > 1 else blocks.mask
        token = keep_heads.repeat_interleave(args.block[0], -2)[..., :rows, :]
        token = token.repeat_interleave(args.block[1], -1)[..., :seq]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, h:h + 4, :rows].float(), k[:, h:h + 4].float(), v[:, h:h + 4].float(), attn_mask=token)
        num += (out[:, h:h + 4, :rows].float() - ref).norm().item() ** 2
        den += ref.norm().item() ** 2
    error = math.sqrt(num / den)
    steps.set_postfix_str("error")
    steps.update()

    path = blocks.plot(args.out, max_heads=min(heads, 8), title="blockattn demo mask")
    steps.set_postfix_str("picture")
    steps.update()
    steps.close()

    print(f"kept density        {density:.4f}")
    print(f"relative error      {error:.2e}  (against dense attention on the same blocks, fp32)")
    print(f"sparse attention    {sparse_ms:.2f} ms")
    print(f"dense SDPA          {dense_ms:.2f} ms")
    print(f"speedup over dense  {dense_ms / sparse_ms:.2f}x")
    print(f"block mask picture  {path}")
    tolerance = 2e-2 if dtype != torch.float32 else 1e-4
    if not error < tolerance:
        print(f"error {error:.2e} is above {tolerance:g}: something is wrong", file=sys.stderr)
        return 1
    return 0


def bench(args) -> int:
    from blockattn.bench import Case, run

    device = _device()
    seq, heads, dim, dtype = _problem_size(args, device)
    densities = [0.5] if args.pattern == "causal" else args.densities  # a causal mask has its own density
    cases = [Case(batch=args.batch, heads=heads, kv_heads=args.kv_heads or heads, seq=seq, dim=dim, block=block,
                  density=density, dtype=dtype, pattern=args.pattern)
             for block in args.blocks for density in densities]
    if device.type == "cpu":
        print("no CUDA GPU here: timing blockattn's PyTorch backend, FlexAttention compiled for the CPU and SDPA on "
              f"the CPU ({torch.get_num_threads()} threads)")
    run(cases, backward=not args.forward_only, out_prefix=args.out, quant=args.quant)
    return 0


def _ints(text: str) -> tuple:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def show(args) -> int:
    """Draw a block-mask pattern to a PNG."""
    from blockattn import masks
    from blockattn.bench import Case, block_mask
    from blockattn.sparsity import BlockSparsity

    seq_q, seq_kv = args.seq, args.seq_kv or args.seq
    if args.pattern == "causal":
        blocks = masks.causal(seq_q, seq_kv, args.block)
    elif args.pattern == "window":
        blocks = masks.sliding_window(seq_q, seq_kv, args.block, args.window, causal=args.causal)
    elif args.pattern == "global":
        blocks = masks.union(masks.global_tokens(seq_q, seq_kv, args.block, args.tokens),
                             masks.sliding_window(seq_q, seq_kv, args.block, args.window))
    elif args.pattern == "tile":
        blocks = masks.sliding_tile(args.grid, args.tile, args.tile_window)
    else:
        keep = block_mask(Case(heads=args.heads, kv_heads=args.heads, seq=seq_q, block=args.block,
                               density=args.density), torch.device("cpu"))
        blocks = BlockSparsity.from_mask(keep, args.block, seq_q, seq_q)
    path = blocks.plot(args.out, title=args.pattern)
    print(f"{blocks} density {blocks.density():.3f} -> {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="blockattn", description="Exact block-sparse attention for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run sparse attention on a random block mask and compare with dense")
    p.add_argument("--seq", type=int, help="sequence length (default 32768 on a GPU, 4096 on the CPU)")
    p.add_argument("--heads", type=int, help="heads (default 24 on a GPU, 4 on the CPU)")
    p.add_argument("--dim", type=int, help="head dim (default 128 on a GPU, 64 on the CPU)")
    p.add_argument("--block", type=_block, default=(128, 128), help="block QxKV (default 128x128)")
    p.add_argument("--density", type=_density, default=0.25, help="kept fraction of blocks (default 0.25)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each, taking turns (median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mask and the inputs (default 0)")
    p.add_argument("--out", default="blockattn-demo-mask.png", help="where to write the mask picture")
    p.set_defaults(func=demo)

    p = sub.add_parser("bench", help="blockattn vs FlexAttention vs SDPA, table and plot (on a GPU, else the CPU)")
    p.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    p.add_argument("--heads", type=int, help="query heads (default 24 on a GPU, 4 on the CPU)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads, for GQA (default: --heads)")
    p.add_argument("--seq", type=int, help="sequence length, queries and keys (default 32768 on a GPU, 4096 on the "
                   "CPU)")
    p.add_argument("--dim", type=int, help="head dim (default 128 on a GPU, 64 on the CPU)")
    p.add_argument("--blocks", type=lambda s: [_block(b) for b in s.split(",")], default=[(128, 128)],
                   help="block shapes QxKV, comma-separated (default 128x128; e.g. 128x128,128x64)")
    p.add_argument("--densities", type=lambda s: [_density(d) for d in s.split(",")], default=[1, 0.5, 0.25, 0.1],
                   help="kept fractions of blocks, comma-separated (default 1,0.5,0.25,0.1)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--pattern", choices=("random", "skewed", "causal"), default="random",
                   help="random (default): each query block keeps the same number of blocks, its diagonal one among "
                   "them; skewed: a tenth of the query blocks keep every block and the rest share what the density "
                   "leaves; causal: the block-causal mask run with is_causal (the densities are then ignored)")
    p.add_argument("--forward-only", action="store_true", help="time the forward only")
    p.add_argument("--quant", choices=QUANTS, default=None,
                   help="also time blockattn's quantized forward (inference only: forward rows)")
    p.add_argument("--out", default="blockattn-bench", help="prefix of the .md, .json and .png written")
    p.set_defaults(func=bench)

    p = sub.add_parser("show", help="draw a block-mask pattern to a PNG")
    p.add_argument("pattern", choices=("causal", "window", "global", "tile", "random"))
    p.add_argument("--seq", type=int, default=4096, help="query length (default 4096)")
    p.add_argument("--seq-kv", type=int, default=None, help="key length (default: --seq)")
    p.add_argument("--block", type=_block, default=(128, 128), help="block QxKV (default 128x128)")
    p.add_argument("--window", type=int, default=1024, help="tokens, for window and global")
    p.add_argument("--causal", action="store_true", help="one-sided window")
    p.add_argument("--tokens", type=int, default=128, help="global tokens, for global")
    p.add_argument("--grid", type=_ints, default=(16, 32, 32), help="T,H,W tokens, for tile")
    p.add_argument("--tile", type=_ints, default=(4, 8, 8), help="t,h,w tokens per tile, for tile")
    p.add_argument("--tile-window", type=_ints, default=(3, 3, 3), help="window in tiles per axis, for tile")
    p.add_argument("--density", type=_density, default=0.25, help="for random")
    p.add_argument("--heads", type=int, default=4, help="for random")
    p.add_argument("--out", default="blockattn-mask.png", help="where to write the picture")
    p.set_defaults(func=show)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
