"""Narrow query blocks (torch_npu's 8x128, 32x128, 64x128) and blocks no tile nests in (100x100): which tiles
and which tile view run them fastest, and what the element tests cost.

Variants, each timed forward and forward+backward against FlexAttention where it compiles:
  default          the package as it is;
  tiles:...        the autotuner's candidates replaced through the BLOCKATTN_* variables (kernels/autotune.py);
  view:QxK         the kernels walk a QxK tile view of the mask and test the block mask (as blocks no tile nests
                   in do), forced for any block shape by replacing api._kernel_inputs;
  gather:elements  blocks no tile nests in tested per element instead of by the mode gather_mode picks.

    python benchmarks/odd_blocks.py [--seq 16384] [--heads 16] [--density 0.25] [--only 32x128,100x100]
                                    [--default-only]

The 13th session's first run (BENCHMARKS.md) also timed 64x64 and 64x128 views for 8x128 and 100x100 blocks and a
32x64 view for 8x128; none beat the package's 64x64 view.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

from blockattn import api, bench
from blockattn.kernels import forward


@contextlib.contextmanager
def environment(values: dict):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def tile_view(tile_q: int, tile_kv: int):
    original = api._kernel_inputs

    def forced(sparsity, is_causal, min_tile_kv=16, token_mask=None, kv_valid=None, varlen=None):
        if is_causal:
            sparsity = sparsity.causal()
        full_first = forward.full_tiles_first(True, False, token_mask, kv_valid, varlen)
        tiles = (sparsity.full_first(tile_q, tile_kv, is_causal) if full_first
                 else sparsity.tiled(tile_q, tile_kv))
        return tiles, sparsity.mask.to(torch.uint8)

    api._kernel_inputs = forced
    try:
        yield
    finally:
        api._kernel_inputs = original


@contextlib.contextmanager
def per_element_tests():
    """The kernels test every element against the block mask (GATHER_ELEMENTS), whatever gather_mode would pick;
    launch plans are dropped on the way in and out, since their keys do not hold the mode."""
    from blockattn.kernels import backward, forward, launch, primitives
    saved = forward.gather_mode, backward.gather_mode

    def elements(block_mask, *sizes):
        return 0 if block_mask is None else primitives.GATHER_ELEMENTS.value

    launch._PLANS.clear()
    forward.gather_mode = backward.gather_mode = elements
    try:
        yield
    finally:
        forward.gather_mode, backward.gather_mode = saved
        launch._PLANS.clear()


def tiles(fwd: str, dq: str, dkdv: str) -> dict:
    """BLOCKATTN_* variables from 'M,..;N,..;W,..;S,..' strings per kernel."""
    values = {}
    for kernel, spec in (("FWD", fwd), ("BWD_DQ", dq), ("BWD_DKDV", dkdv)):
        for field, lst in zip(("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES"), spec.split(";")):
            values[f"BLOCKATTN_{kernel}_{field}"] = lst
    return values


def variants(block: tuple) -> list:
    """(name, context manager factory) per variant worth timing for this block shape."""
    out = [("default", contextlib.nullcontext)]
    bq, bk = block
    if bq == 32:
        out.append(("tiles:32-wide", lambda: environment(tiles("32;64,128;4;2,3", "32;64,128;4;2,3",
                                                                "32;64,128;4,8;2,3"))))
        out.append(("view:64x128", lambda: tile_view(64, 128)))
    if bq >= 64 and bk >= 64 and (bq % 16 or bk % 16):
        out.append(("gather:elements", per_element_tests))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--density", type=float, nargs="+", default=[0.25])
    parser.add_argument("--only", default="8x128,32x128,64x128,100x100")
    parser.add_argument("--default-only", action="store_true", help="only the package as it is, no FlexAttention")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(bench.environment())
    rows = []
    for spec in args.only.split(","):
        block = tuple(int(x) for x in spec.split("x"))
        seq = args.seq - args.seq % block[0] if block[0] % 16 else args.seq  # whole blocks: 100x100 S=16300
        for density in args.density:
            case = bench.Case(heads=args.heads, kv_heads=args.heads, seq=seq, block=block, density=density)
            if block[0] % 32 == 0 and block[1] % 32 == 0 and not args.default_only:  # FlexAttention's 8x128 and 100x100: BENCHMARKS.md
                rows += bench.bench_case(case, device, sdpa=False, impls=("flex",))
            for name, context in variants(block)[:1] if args.default_only else variants(block):
                with context():
                    try:
                        got = bench.bench_case(case, device, sdpa=False, impls=("blockattn",))
                    except Exception as error:  # a variant that fails is a result too
                        print(f"{case.label} {name}: failed: {type(error).__name__}: {str(error)[:200]}")
                        continue
                for row in got:
                    row.impl = f"blockattn {name}"
                rows += got
                print("\n".join(f"{r.case} | {r.impl} | {r.mode} | {r.ms:.3f} ms | {r.tflops:.0f}" for r in got),
                      flush=True)
    print(bench.markdown(rows))


if __name__ == "__main__":
    main()
