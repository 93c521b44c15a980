"""FlexAttention's ways to run a mask of 128x64 blocks, against blockattn, forward and backward, one process.

Compiled with default options, FlexAttention's backward finds no config for 64-key blocks (Inductor's sm90 default has
128-key tiles: `NoValidChoicesError`), so the bench harness has no FlexAttention backward to compare with there. A
FlexAttention user has two ways around it, both timed here:
  - "flex-autotune": the same 128x64 BlockMask, flex_attention compiled with mode="max-autotune-no-cudagraphs", whose
    search space holds 64-key tiles;
  - "flex-128": FlexAttention's default 128x128 blocks with a mask_mod that looks the 128x64 block up (what
    create_block_mask(..., BLOCK_SIZE=128) makes of it, built here from the block table: create_block_mask itself
    materializes the element mask, 24 x 32768^2 here): a 128-key block with both halves kept is full, with one half
    partial (its mask_mod runs per element).
  - "flex-128x128" (a reference, not the same mask): FlexAttention compiled with default options on a random mask of
    128x128 blocks at the same density, the comparison the earlier sessions made with 128x64 blocks; blockattn on
    that mask runs too ("blockattn-128x128"); "flex-128x128-autotune" the same compiled with
    mode="max-autotune-no-cudagraphs".
Effective TFLOP/s count the kept work only (bench.py's rule); the speedup column is blockattn's TFLOP/s over the
variant's (for the same mask, its time over blockattn's).

    python benchmarks/flex_variants.py --densities 0.5 0.25 0.1
"""

import argparse

import torch

from blockattn import BlockSparsity, attention
from blockattn.bench import Case, _flops, _inputs, _time_ms, block_mask, flex_block_mask
from blockattn.sparsity import build_lists


def runners(case: Case, keep: torch.Tensor, which):
    """The variants asked for in which, by name, and the density of the blocks each keeps."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    blocks = BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
    out = {"blockattn": lambda q, k, v: attention(q, k, v, blocks)}
    if "flex-autotune" in which:
        mask = flex_block_mask(blocks)
        tuned = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
        out["flex-autotune"] = lambda q, k, v: tuned(q, k, v, block_mask=mask)
    if "flex-128" in which:
        table = keep[0]
        block_q, block_kv = case.block

        def lookup(b, h, q_idx, kv_idx):
            return table[h, q_idx // block_q, kv_idx // block_kv]
        halves = keep[..., 0::2], keep[..., 1::2]  # the 64-key blocks of each 128-key block (block_kv = 64)
        partial_count, partial_index = build_lists(halves[0] ^ halves[1])
        full_count, full_index = build_lists(halves[0] & halves[1])
        coarse = BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index, BLOCK_SIZE=128,
                                          mask_mod=lookup, seq_lengths=(case.seq, case.seq))
        compiled = torch.compile(flex_attention, dynamic=False)
        out["flex-128"] = lambda q, k, v: compiled(q, k, v, block_mask=coarse)
    kept = {name: blocks.density() for name in out}
    square_names = [name for name in ("flex-128x128", "flex-128x128-autotune") if name in which]
    if square_names:
        square = Case(seq=case.seq, block=(128, 128), density=case.density)
        square_blocks = BlockSparsity.from_mask(block_mask(square, keep.device), (128, 128), case.seq, case.seq)
        square_mask = flex_block_mask(square_blocks)
        for name in square_names:
            mode = "max-autotune-no-cudagraphs" if name.endswith("autotune") else None
            square_fn = torch.compile(flex_attention, dynamic=False, mode=mode)
            out[name] = lambda q, k, v, square_fn=square_fn: square_fn(q, k, v, block_mask=square_mask)
            kept[name] = square_blocks.density()
        out["blockattn-128x128"] = lambda q, k, v: attention(q, k, v, square_blocks)
        kept["blockattn-128x128"] = square_blocks.density()
    return out, kept


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--impls", nargs="+", default=["flex-autotune", "flex-128", "flex-128x128"])
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| case | impl | fwd ms (TFLOP/s) | bwd ms (TFLOP/s) | blockattn fwd / bwd speedup |")
    print("| --- | --- | --- | --- | --- |")
    for density in args.densities:
        case = Case(seq=args.seq, block=(128, 64), density=density)
        q, k, v = _inputs(case, device, requires_grad=True)
        grad = torch.randn_like(q)
        fns, kept = runners(case, block_mask(case, device), set(args.impls))
        times = {}
        for name, fn in fns.items():
            try:
                with torch.no_grad():
                    fwd = _time_ms(lambda: fn(q, k, v))
                both = _time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad))
                times[name] = (fwd, both - fwd)
            except Exception as error:  # a failing variant is a result too
                print(f"| d={kept[name]:.3f} | {name} | failed: {type(error).__name__}: {str(error)[:150]} | | |")
        rates = {name: (_flops(case, kept[name]) / fwd / 1e9, 2.5 * _flops(case, kept[name]) / bwd / 1e9)
                 for name, (fwd, bwd) in times.items()}
        base = rates.get("blockattn")
        for name, (fwd, bwd) in times.items():
            rate = rates[name]
            speed = "" if base is None else f"{base[0] / rate[0]:.2f}x / {base[1] / rate[1]:.2f}x"
            block_label = "128x64" if name in ("blockattn", "flex-autotune", "flex-128") else "128x128"
            print(f"| {block_label} d={kept[name]:.3f} | {name} | {fwd:.3f} ({rate[0]:.0f}) | "
                  f"{bwd:.3f} ({rate[1]:.0f}) | {speed} |", flush=True)


if __name__ == "__main__":
    main()
