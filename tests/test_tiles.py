"""Every candidate tile of every kernel, pinned one at a time, against the fp64 oracle, forward and backward. The
rest of the suite runs each kernel's first candidate (conftest.one_tile_per_kernel), and the autotuner may choose
any of them, so each has to be right on its own: ragged length, GQA, a query block that sees nothing."""

import pytest
import torch

import blockattn
from blockattn.kernels import autotune
from conftest import ON_GPU, assert_output_and_gradients, check_against_oracle, expand, qkv, random_keep

BLOCK = (128, 128) if ON_GPU else (64, 64)
SEQ, HEADS, DIM = (1000, 4, 64) if ON_GPU else (250, 2, 32)


def candidates():
    """(kernel, tile) for every default candidate that nests in BLOCK; under the interpreter, which ignores warps
    and stages, one per tile shape."""
    cases, seen = [], set()
    for kernel in ("FWD", "BWD_DQ", "BWD_DKDV"):
        for tile in autotune._DEFAULTS[kernel]:
            block_m, block_n = tile[:2]
            if BLOCK[0] % block_m or BLOCK[1] % block_n or (not ON_GPU and (kernel, block_m, block_n) in seen):
                continue
            seen.add((kernel, block_m, block_n))
            cases.append(pytest.param(kernel, tile, id=f"{kernel}-{block_m}x{block_n}-w{tile[2]}-s{tile[3]}"))
    return cases


KERNEL_NAMES = {"FWD": "attention_fwd_kernel", "BWD_DQ": "attention_bwd_dq_kernel",
                "BWD_DKDV": "attention_bwd_dkdv_kernel"}


@pytest.mark.parametrize("kernel, tile", candidates())
def test_every_candidate_tile_matches_the_oracle(poisoned, monkeypatch, tuner_launches, kernel, tile):
    for field, value in zip(("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES"), tile):
        monkeypatch.setenv(f"BLOCKATTN_{kernel}_{field}", str(value))
    q, k, v = qkv(1, HEADS, SEQ, DIM, kv_heads=HEADS // 2, seed=31)
    keep = random_keep(1, HEADS, SEQ, SEQ, BLOCK)
    keep[..., 2, :] = False
    visible = expand(keep, BLOCK, SEQ, SEQ)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = blockattn.attention(*leaves, keep, BLOCK, return_lse=True, backend="triton")
    group = HEADS // (HEADS // 2)
    check_against_oracle(out.detach(), lse.detach(), q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                         visible)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    assert_output_and_gradients(None, got, *leaves, visible, grad, tolerance=2e-2)
    ran = [(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
           for kernel_fn, _, config in tuner_launches if kernel_fn.__name__ == KERNEL_NAMES[kernel]]
    assert ran == [tuple(tile)], f"{kernel} ran {ran}, not the pinned tile"
