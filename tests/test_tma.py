"""Tiles read through tensor descriptors (kernels/tma.py) against pointer loads: the same values, so the same
results bit for bit, on ragged lengths, head dims below the padded tile width, GQA and causal masks; tensors the
TMA cannot describe fall back to pointer loads."""

import pytest
import torch

import blockattn
from blockattn.kernels import backward, forward, forward_ws, launch, tma
from conftest import DEVICE, ON_GPU, assert_one_ulp, check_against_oracle, expand, qkv, random_keep

# (seq_q, seq_kv, head dim, query heads, kv heads, causal): ragged tails, a head dim under its padded width (40 ->
# 64: the box reads zero columns past the end), GQA, cross lengths, and lengths that fill whole blocks (the
# pointer path's unmasked loads).
CASES = {
    "ragged_gqa_causal": (250 if not ON_GPU else 1000, None, 32 if not ON_GPU else 64, 4, 2, True),
    "padded_head_dim_cross": (200 if not ON_GPU else 900, 150 if not ON_GPU else 700, 40, 2, 2, False),
    "whole_blocks": (256 if not ON_GPU else 1024, None, 32 if not ON_GPU else 128, 2, 2, False),  # plain loads
}


def run(q, k, v, keep, block, is_causal, tma_loads, monkeypatch):
    monkeypatch.setattr(tma, "TMA_LOADS", tma_loads)
    # the Triton kernels' two ways of reading tiles: the Gluon forward (descriptors only; test_forward_ws.py) stays out
    monkeypatch.setattr(forward_ws, "ENABLED", False)
    monkeypatch.setattr(tma, "DKDV_TMA_LOADS", True)  # the default; pinned so the dK/dV descriptor path stays covered
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = blockattn.attention(*leaves, keep, block, is_causal=is_causal, return_lse=True, backend="triton")
    grad = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(4), device=DEVICE)
    (out.float() * grad).sum().backward()
    return [out.detach(), lse] + [t.grad for t in leaves]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dq_mode", ["kernel", "atomic"])
def test_descriptor_and_pointer_loads_agree_bitwise(monkeypatch, poisoned, pinned, geometry, case, dq_mode):
    seq_q, seq_kv, dim, heads, kv_heads, is_causal = CASES[case]
    seq_kv = seq_kv or seq_q
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", dq_mode)
    q, k, v = qkv(geometry.batch, heads, seq_q, dim, kv_heads=kv_heads, seq_kv=seq_kv, seed=3)
    keep = random_keep(geometry.batch, heads, seq_q, seq_kv, geometry.block)
    keep[..., 1, :] = False  # a query block that sees nothing
    with_tma = run(q, k, v, keep, geometry.block, is_causal, True, monkeypatch)
    without = run(q, k, v, keep, geometry.block, is_causal, False, monkeypatch)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), with_tma, without):
        assert not torch.isnan(a).any(), f"{name} has NaN"
        if name == "dq" and dq_mode == "atomic" and ON_GPU:  # atomics add in a different order each run
            assert_one_ulp(a, b, name)
        else:
            assert torch.equal(a, b), f"{name}: descriptor loads differ from pointer loads"
    visible = expand(keep, geometry.block, seq_q, seq_kv)
    group = heads // kv_heads
    check_against_oracle(with_tma[0], with_tma[1], q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                         visible, is_causal=is_causal)


def test_the_descriptor_path_is_taken_where_available(monkeypatch):
    """Not a silent no-op: where descriptors are available, the launchers hand descriptors to the kernels."""
    q, k, v = qkv(1, 2, 128, 32)
    available = tma.available(forward.attention_fwd_kernel, q.device)
    args = tma.tile_args(forward.attention_fwd_kernel, False, 1, K_DESC=k, V_DESC=v)
    assert args["TMA_LOADS"] == available
    assert all(isinstance(args[name], torch.Tensor) != available for name in ("K_DESC", "V_DESC"))
    pointers = {"K_DESC": k, "V_DESC": v, "TMA_LOADS": False}
    assert tma.tile_args(forward.attention_fwd_kernel, True, 1, K_DESC=k, V_DESC=v) == pointers, (
        "a packed batch must keep pointer loads")
    monkeypatch.setattr(tma, "TMA_LOADS", False)
    assert tma.tile_args(forward.attention_fwd_kernel, False, 1, K_DESC=k, V_DESC=v) == pointers


def record_tile_args(monkeypatch) -> list:
    """(kernel, work, use) of every tma.tile_args call from here on (a launcher calls it on a plan miss; the plan
    table is emptied first)."""
    monkeypatch.setattr(launch, "_PLANS", {})
    calls = []
    tile_args = tma.tile_args

    def spy(kernel_fn, packed, work, use=True, **tensors):
        calls.append((kernel_fn, work, use))
        return tile_args(kernel_fn, packed, work, use=use, **tensors)
    monkeypatch.setattr(tma, "tile_args", spy)
    return calls


@pytest.mark.parametrize("seq, expected", [(64, False), (128, True)])
def test_small_calls_keep_pointer_loads(monkeypatch, tuner_launches, seq, expected):
    """Below tma.MIN_DESCRIPTOR_WORK (B * Hq * Sq * Sk * D) a call is host-bound and Triton re-encodes descriptors
    on every launch: the launchers ask for pointer loads there, at or above it for descriptors."""
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, seq, 32))
    monkeypatch.setattr(tma, "MIN_DESCRIPTOR_WORK", 1 * 2 * 128 * 128 * 32)
    calls = record_tile_args(monkeypatch)
    blockattn.attention(q, k, v, None, (64, 64), backend="triton").sum().backward()
    assert [work for _, work, _ in calls] == [1 * 2 * seq * seq * 32] * 3, "forward, dQ and dK/dV kernels"
    available = tma.available(forward.attention_fwd_kernel, q.device)
    attention_kernels = (forward.attention_fwd_kernel, backward.attention_bwd_dq_kernel,
                         backward.attention_bwd_dkdv_kernel)  # (not the list kernel, which reads no tiles)
    asked = [kwargs["TMA_LOADS"] for kernel_fn, kwargs, _ in tuner_launches if kernel_fn in attention_kernels]
    assert asked == [expected and available] * 3


@pytest.mark.parametrize("dq_mode, expected", [("kernel", True), ("atomic", False)])
def test_dkdv_descriptors_only_without_dq_atomics(monkeypatch, dq_mode, expected):
    """The dK/dV kernel asks for Q/dO descriptors in dQ mode "kernel" only: beside the atomics they spilled
    registers and measured slower on the H200 (tma.DKDV_TMA_LOADS)."""
    calls = record_tile_args(monkeypatch)
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", dq_mode)
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 128, 32))
    keep = random_keep(1, 2, 128, 128, (64, 64))
    blockattn.attention(q, k, v, keep, (64, 64), backend="triton").sum().backward()
    asked = {kernel_fn: use for kernel_fn, _, use in calls}
    assert asked[backward.attention_bwd_dkdv_kernel] is expected


def test_tensors_the_tma_cannot_describe(monkeypatch, poisoned):
    """A base off 16-byte alignment, a row stride that is not a multiple of 16 bytes, a strided last dim: no
    descriptor, pointer loads instead, and still the oracle's answer."""
    base = torch.randn(1, 2, 130, 33, device=DEVICE, dtype=torch.bfloat16)
    shifted = base[..., 1:]  # [1, 2, 130, 32] starting 2 bytes in, rows 66 bytes apart
    assert tma.tile_descriptor(shifted) is None
    assert tma.tile_descriptor(torch.randn(1, 2, 64, 20, device=DEVICE, dtype=torch.bfloat16)) is None  # 40-byte rows
    assert tma.tile_descriptor(torch.randn(1, 2, 64, 64, device=DEVICE)[..., ::2]) is None
    assert tma.tile_descriptor(torch.randn(1, 2, 64, 32, device=DEVICE, dtype=torch.bfloat16)) is not None
    q, k, v = qkv(1, 2, 130, 32, seed=5)
    k, v = shifted.clone(), shifted  # v through pointer loads, k contiguous
    keep = random_keep(1, 2, 130, 130, (64, 64))
    out, lse = blockattn.attention(q, k, v, keep, (64, 64), return_lse=True, backend="triton")
    check_against_oracle(out, lse, q, k, v, expand(keep, (64, 64), 130, 130))
