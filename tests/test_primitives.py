"""The Triton helpers on their own: the list search that orders the dK/dV walk, and the tile load that drops its
masks where a side is whole."""

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from blockattn.kernels.primitives import first_entry_at_or_after, load_tile


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
