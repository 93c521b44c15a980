"""The list kernel (kernels/lists.py) against sparsity's PyTorch list builders: the same count and index, entry for
entry, on random masks with empty and whole rows, rows longer than one step of the kernel's walk, transposed and
broadcast inputs, and row counts that leave a program's rows partly past the end. On the CPU the kernel runs under
Triton's interpreter; on a GPU the builders themselves take it."""

import pytest
import torch

from blockattn import sparsity
from blockattn.kernels import lists
from conftest import DEVICE, ON_GPU


def _masks(shape, seed):
    """(keep, full): random bool masks of shape [..., R, C], full within keep, with an empty row and a whole row."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    keep = torch.rand(shape, generator=gen, device=DEVICE) < 0.4
    full = keep & (torch.rand(shape, generator=gen, device=DEVICE) < 0.5)
    keep[..., 0, :] = False
    full[..., 0, :] = False
    if shape[-2] > 1:
        keep[..., 1, :] = True
    return keep, full


@pytest.mark.parametrize("shape", [(1, 3, 5, 37), (2, 1, 19, 16), (1, 2, 3, 1100), (4, 1)])
@pytest.mark.parametrize("view", ["contiguous", "transposed", "broadcast head"])
def test_full_first_lists_match_the_operations(shape, view):
    keep, full = _masks(shape, seed=sum(shape))
    if view == "transposed":  # the q lists' case: rows are the mask's columns
        keep, full = keep.transpose(-1, -2), full.transpose(-1, -2)
    elif view == "broadcast head" and len(shape) == 4:
        keep, full = keep[:, :1].expand(shape), full[:, :1].expand(shape)
    count, index = lists.full_first_lists(keep, full)
    want_count, want_index = sparsity._full_first_lists_by_operations(keep.contiguous(), full.contiguous())
    assert count.dtype == index.dtype == torch.int32
    assert count.is_contiguous() and index.is_contiguous()
    assert torch.equal(count, want_count)
    assert torch.equal(index, want_index)


def test_with_every_kept_column_full_they_are_the_sorted_lists():
    keep, _ = _masks((2, 3, 9, 70), seed=5)
    count, index = lists.full_first_lists(keep, keep)
    want_count = keep.sum(-1, dtype=torch.int32)
    want_index = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    assert torch.equal(count, want_count)
    assert torch.equal(index, want_index)


def test_empty_masks():
    count, index = lists.full_first_lists(torch.zeros(2, 0, 5, dtype=torch.bool, device=DEVICE),
                                          torch.zeros(2, 0, 5, dtype=torch.bool, device=DEVICE))
    assert count.shape == (2, 0) and index.shape == (2, 0, 5)
    count, index = lists.full_first_lists(torch.zeros(3, 0, dtype=torch.bool, device=DEVICE),
                                          torch.zeros(3, 0, dtype=torch.bool, device=DEVICE))
    assert count.shape == (3,) and index.shape == (3, 0) and (count == 0).all()


def test_the_builders_take_the_kernel_on_a_gpu_only(monkeypatch):
    calls = []
    run = lists.full_first_lists

    def spy(keep, full):
        calls.append(keep.shape)
        return run(keep, full)
    monkeypatch.setattr(lists, "full_first_lists", spy)
    keep, full = _masks((1, 2, 6, 12), seed=2)
    count, index = sparsity.build_lists(keep)
    assert torch.equal(index, torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32))
    got = sparsity._full_first_lists(keep, full)
    want = sparsity._full_first_lists_by_operations(keep, full)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(calls) == (2 if ON_GPU else 0)
