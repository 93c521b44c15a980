"""The Triton helpers on their own: the list search that orders the dK/dV walk, the split walks' count of steps
that need no element test, the tile load that drops its masks where a side is whole, and the int32 -> fp32
conversion of the quantized forward."""

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from blockattn.kernels.autotune import is_interpreted
from blockattn.kernels.primitives import (GATHER_COLUMNS, GATHER_ELEMENTS, GATHER_ROWS, GATHER_SPANS,
                                          first_entry_at_or_after, gather_mode, int32_to_float, load_tile,
                                          round_to_int8, to_float8, untested_steps)


@triton.jit
def _search_kernel(List, Count, Pivot, Out):
    row = tl.program_id(0)
    count = tl.load(Count + row)
    pivot = tl.load(Pivot + row)
    tl.store(Out + row, first_entry_at_or_after(List + row * 16, count, pivot))


def test_first_entry_at_or_after_matches_searchsorted():
    gen = torch.Generator().manual_seed(3)
    rows = 64
    keep = torch.rand(rows, 16, generator=gen) < torch.rand(rows, 1, generator=gen)
    keep[0] = False          # an empty list
    keep[1] = True           # a full one
    count = keep.sum(1).to(torch.int32)
    lists = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)
    pivot = torch.randint(-1, 18, (rows,), generator=gen, dtype=torch.int32)
    pivot[1] = 16            # past every entry
    want = torch.tensor([int(torch.searchsorted(lists[r, :count[r]].contiguous(), pivot[r])) for r in range(rows)])
    out = torch.full((rows,), -7, dtype=torch.int32)
    lists, count, pivot, out = (t.to(DEVICE) for t in (lists, count, pivot, out))
    _search_kernel[(rows,)](lists, count, pivot, out)
    assert torch.equal(out.cpu(), want.to(torch.int32))


@triton.jit
def _untested_kernel(List, Count, StartM, SeqKv, Out, BLOCK_KV: tl.constexpr, TILES: tl.constexpr,
                     EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    row = tl.program_id(0)
    tl.store(Out + row, untested_steps(List + row * 16, tl.load(Count + row), tl.load(StartM + row),
                                       tl.load(SeqKv + row), BLOCK_KV, TILES, EVEN_KV, IS_CAUSAL))


@pytest.mark.parametrize("even_kv", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_untested_steps_counts_the_blocks_that_need_no_element_test(even_kv, is_causal):
    """Against a direct count: a listed block kb needs a test when it crosses the causal diagonal of a query tile
    starting at start_m ((kb + 1) * 64 - 1 > start_m) or, without EVEN_KV, holds keys past seq_kv; the split walk
    runs TILES steps per listed block before the first such one without tests."""
    gen = torch.Generator().manual_seed(5)
    rows, block_kv, tiles = 96, 64, 2
    keep = torch.rand(rows, 16, generator=gen) < torch.rand(rows, 1, generator=gen)
    keep[0] = False          # an empty list
    keep[1] = True           # a full one
    count = keep.sum(1).to(torch.int32)
    lists = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)
    keep[2:4] = True
    start_m = torch.randint(0, 16 * block_kv, (rows,), generator=gen, dtype=torch.int32)
    # Boundary rows: a tile from row 319 (block 4's last key) runs block 4 untested, as does one from row 320.
    start_m[2:4] = torch.tensor([5 * block_kv - 1, 5 * block_kv])
    count = keep.sum(1).to(torch.int32)
    lists = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)
    seq_kv = torch.randint(1, 16 * block_kv + 1, (rows,), generator=gen, dtype=torch.int32)
    if even_kv:  # whole blocks, none listed past the end (only a packed batch's lists list such blocks)
        seq_kv = torch.full_like(seq_kv, 16 * block_kv)
    want = []
    for r in range(rows):
        untested = 0
        for kb in lists[r, :count[r]].tolist():
            crosses = is_causal and (kb + 1) * block_kv - 1 > int(start_m[r])
            past_end = not even_kv and (kb + 1) * block_kv > int(seq_kv[r])
            if crosses or past_end:
                break
            untested += 1
        want.append(untested * tiles)
    out = torch.full((rows,), -7, dtype=torch.int32)
    lists, count, start_m, seq_kv, out = (t.to(DEVICE) for t in (lists, count, start_m, seq_kv, out))
    _untested_kernel[(rows,)](lists, count, start_m, seq_kv, out, BLOCK_KV=block_kv, TILES=tiles, EVEN_KV=even_kv,
                              IS_CAUSAL=is_causal)
    assert torch.equal(out.cpu(), torch.tensor(want, dtype=torch.int32))
    if not is_causal and even_kv:  # nothing to test: the whole list runs untested
        assert torch.equal(out.cpu(), count.cpu() * tiles)


@triton.jit
def _load_kernel(X, Out, rows, cols, stride, R: tl.constexpr, C: tl.constexpr, EVEN_ROWS: tl.constexpr,
                 EVEN_COLS: tl.constexpr):
    offs_r = tl.arange(0, R)
    offs_c = tl.arange(0, C)
    tile = load_tile(X + offs_r[:, None] * stride + offs_c[None, :], offs_r < rows, offs_c < cols, EVEN_ROWS,
                     EVEN_COLS)
    tl.store(Out + offs_r[:, None] * C + offs_c[None, :], tile)


@pytest.mark.parametrize("even_rows", [False, True])
@pytest.mark.parametrize("even_cols", [False, True])
def test_load_tile_zeroes_what_is_out_of_range(even_rows, even_cols):
    rows, cols = (16 if even_rows else 11), (32 if even_cols else 20)
    x = torch.randn(16, 32, device=DEVICE)
    out = torch.full((16, 32), float("nan"), device=DEVICE)
    _load_kernel[(1,)](x, out, rows, cols, 32, R=16, C=32, EVEN_ROWS=even_rows, EVEN_COLS=even_cols)
    want = torch.zeros_like(x)
    want[:rows, :cols] = x[:rows, :cols]
    assert torch.equal(out, want)


@triton.jit
def _to_float_kernel(X, Out):
    offs = tl.arange(0, 1024)
    tl.store(Out + offs, int32_to_float(tl.load(X + offs)))


def test_int32_to_float_is_exact_over_the_int8_products_range():
    """Every int8 product of up to 256 columns (|x| <= 127 * 127 * 256 < 2**22) converts exactly: the ends, zero,
    +-1 and random values."""
    gen = torch.Generator().manual_seed(5)
    edge = 2 ** 22 - 1
    x = torch.randint(-edge, edge + 1, (1024,), generator=gen, dtype=torch.int32)
    x[:6] = torch.tensor([edge, -edge, 0, 1, -1, 127 * 127 * 256])
    out = torch.full((1024,), float("nan"), device=DEVICE)
    _to_float_kernel[(1,)](x.to(DEVICE), out)
    assert torch.equal(out.cpu(), x.float())


@triton.jit
def _round_int8_kernel(X, Out):
    offs = tl.arange(0, 1024)
    tl.store(Out + offs, round_to_int8(tl.load(X + offs)))


def test_round_to_int8_rounds_to_nearest_even_over_0_to_127():
    """P times 127 for int8-int8: every value of [0, 127] to the nearest integer, exact halves to even (as
    torch.round), the ends and values a hair off a half."""
    gen = torch.Generator().manual_seed(8)
    x = torch.rand(1024, generator=gen) * 127
    x[:8] = torch.tensor([0.0, 127.0, 0.5, 1.5, 126.5, 2.4999998, 2.5000002, 0.49999997])
    out = torch.full((1024,), -1, dtype=torch.int8, device=DEVICE)
    _round_int8_kernel[(1,)](x.to(DEVICE), out)
    assert torch.equal(out.cpu(), torch.round(x).to(torch.int8))


@triton.jit
def _float8_kernel(X, Out, ROUND_FIRST: tl.constexpr):
    offs = tl.arange(0, 4096)
    tl.store(Out + offs, to_float8(tl.load(X + offs), ROUND_FIRST))


def test_to_float8_rounds_as_torch_does():
    """fp32 -> float8 e4m3 over e4m3's normal range, to nearest with ties to even: values that round up to the
    next power of two (which Triton's interpreter converts wrongly on its own), exact ties, and random ones."""
    gen = torch.Generator().manual_seed(6)
    x = torch.exp2(torch.rand(4096, generator=gen) * 14.8 - 6) * torch.where(torch.rand(4096, generator=gen) < 0.5,
                                                                           -1.0, 1.0)
    x[:8] = torch.tensor([7.9, 124.44, 1.99, 31.5, 100.0, 200.0, 0.0, 448.0])  # carries, ties (96|104, 192|208)
    out = torch.empty(4096, dtype=torch.float8_e4m3fn, device=DEVICE)
    _float8_kernel[(1,)](x.to(DEVICE), out, ROUND_FIRST=is_interpreted(_float8_kernel))
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(out.cpu().float(), want.float()), f"{int((out.cpu().float() != want.float()).sum())} differ"


@pytest.mark.parametrize("lists, mask_block, mode", [
    ((64, 64), (100, 100), GATHER_SPANS), ((64, 32), (100, 96), GATHER_SPANS), ((64, 64), (1560, 64), GATHER_SPANS),
    ((64, 64), (8, 128), GATHER_ROWS), ((64, 32), (24, 96), GATHER_ROWS), ((64, 64), (128, 8), GATHER_COLUMNS),
    ((32, 64), (96, 40), GATHER_COLUMNS), ((64, 64), (100, 40), GATHER_ELEMENTS), ((64, 64), (8, 40), GATHER_ELEMENTS)])
def test_gather_mode_reads_the_fewest_flags_the_block_shape_allows(lists, mask_block, mode):
    """Four flags per tile where the mask's blocks are at least the lists' blocks on both sides (a tile then spans
    at most two blocks each way); else one flag per query row where the lists' key tiles lie inside one mask key
    block (their width divides the block's), one per key where the query tiles do, else per element; no gathered
    mask, no gathering."""
    mask = torch.ones(1, dtype=torch.bool)
    assert gather_mode(mask, *lists, *mask_block) == mode.value
    assert gather_mode(None, *lists, *mask_block) == 0
