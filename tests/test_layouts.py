"""Layouts: "bshd" and packed "thd" against "bhsd" on the same data, forward and backward, on every backend; the
offsets' validation."""

import contextlib
import math

import pytest
import torch

import blockattn
from conftest import DEVICE, ON_GPU, make_generator, pin

BACKENDS = ("torch", "triton")
# query and key lengths per sequence: ragged, unequal, an empty query sequence and an empty key sequence
LENGTHS_Q = [355, 17, 41, 83, 0, 129, 7] if ON_GPU else [75, 1, 40, 0, 20]
LENGTHS_KV = [533, 23, 67, 0, 9, 257, 11] if ON_GPU else [90, 3, 33, 9, 0]
BLOCK = (64, 128) if ON_GPU else (16, 32)


@pytest.fixture
def pinned_thd(monkeypatch):
    """One tile per kernel for the bitwise comparisons (a tile that nests in BLOCK)."""
    pin(monkeypatch, (max(16, BLOCK[0] // 2), max(16, BLOCK[1] // 2)))


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def packed(heads=4, kv_heads=2, dim=32, dtype=torch.float32, seed=0):
    gen = make_generator(seed)
    q = torch.randn(sum(LENGTHS_Q), heads, dim, generator=gen, device=DEVICE).to(dtype)
    k = torch.randn(sum(LENGTHS_KV), kv_heads, dim, generator=gen, device=DEVICE).to(dtype)
    v = torch.randn(sum(LENGTHS_KV), kv_heads, dim, generator=gen, device=DEVICE).to(dtype)
    nq, nk = math.ceil(max(LENGTHS_Q) / BLOCK[0]), math.ceil(max(LENGTHS_KV) / BLOCK[1])
    keep = torch.rand(len(LENGTHS_Q), heads, nq, nk, generator=gen, device=DEVICE) < 0.5
    return q, k, v, keep


def loss_of(out, lse, grad, lse_weight):
    """sum(out * grad) + lse_weight * (sum of the finite LSEs): a loss that reaches the LSE's gradient too."""
    return (out * grad).sum() + lse_weight * torch.where(torch.isfinite(lse), lse, 0).sum()


def run(q, k, v, grad_seed=5, lse_weight=0.0, trainable="qkv", **kwargs):
    """[out, lse, dq, dk, dv] of loss_of(); leaves not named in trainable are frozen (their gradient None)."""
    leaves = [t.detach().clone().requires_grad_(name in trainable) for name, t in zip("qkv", (q, k, v))]
    out, lse = blockattn.attention(*leaves, return_lse=True, **kwargs)
    grad = torch.randn(out.shape, generator=make_generator(grad_seed), device=DEVICE).to(out.dtype)
    loss_of(out, lse, grad, lse_weight).backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_thd_matches_bhsd_sequence_by_sequence(poisoned, backend, is_causal):
    """A packed batch against each sequence alone: out, LSE, and gradients of a loss on both."""
    q, k, v, keep = packed()
    cu_q, cu_kv = offsets(LENGTHS_Q), offsets(LENGTHS_KV)
    got = run(q, k, v, blocks=keep, block_size=BLOCK, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
              is_causal=is_causal, backend=backend, lse_weight=0.5)
    assert got[0].shape == (q.shape[0], q.shape[1], v.shape[2]) and got[1].shape == q.shape[:2]
    for name, t in zip(("out", "dq", "dk", "dv"), [got[0]] + got[2:]):
        assert torch.isfinite(t).all(), f"{name} not finite"
    for index, (start_q, len_q, start_kv, len_kv) in enumerate(zip(cu_q.tolist(), LENGTHS_Q, cu_kv.tolist(),
                                                                   LENGTHS_KV)):
        rows, keys = slice(start_q, start_q + len_q), slice(start_kv, start_kv + len_kv)
        if len_q == 0:
            continue
        if len_kv == 0:  # nothing to see: zeros, LSE -inf, no query gradient
            assert (got[0][rows] == 0).all() and torch.isneginf(got[1][rows]).all() and (got[2][rows] == 0).all()
            continue
        nq, nk = math.ceil(len_q / BLOCK[0]), math.ceil(len_kv / BLOCK[1])
        as_bhsd = [t.permute(1, 0, 2)[None] for t in (q[rows], k[keys], v[keys])]

        leaves = [t.detach().clone().requires_grad_(True) for t in as_bhsd]
        out, lse = blockattn.attention(*leaves, keep[index:index + 1, :, :nq, :nk], BLOCK, is_causal=is_causal,
                                       backend="torch", return_lse=True)
        # the same upstream gradient the packed run used, on this sequence's rows
        grad = torch.randn(got[0].shape, generator=make_generator(5), device=DEVICE)[rows]
        loss_of(out, lse, grad.permute(1, 0, 2)[None], 0.5).backward()
        torch.testing.assert_close(got[0][rows], out[0].permute(1, 0, 2), rtol=1e-4, atol=1e-5)
        finite = torch.isfinite(lse[0].t())
        assert torch.equal(torch.isfinite(got[1][rows]), finite)
        torch.testing.assert_close(got[1][rows][finite], lse[0].t()[finite], rtol=1e-4, atol=1e-5)
        for name, packed_grad, t, span in (("dq", got[2], leaves[0], rows), ("dk", got[3], leaves[1], keys),
                                           ("dv", got[4], leaves[2], keys)):
            torch.testing.assert_close(packed_grad[span], t.grad[0].permute(1, 0, 2), rtol=1e-4, atol=1e-5,
                                       msg=f"sequence {index} {name}")


@pytest.mark.parametrize("trainable", ["q", "kv"])
def test_thd_frozen_inputs_get_the_gradients_of_the_full_run(poisoned, trainable):
    """A packed batch with the query or the keys and values frozen (the backward then skips a kernel): the
    gradients it computes equal those of the run where everything trains."""
    q, k, v, keep = packed()
    kwargs = dict(blocks=keep, block_size=BLOCK, layout="thd", cu_seqlens_q=offsets(LENGTHS_Q),
                  cu_seqlens_kv=offsets(LENGTHS_KV), is_causal=True, backend="triton", lse_weight=0.5)
    full = run(q, k, v, **kwargs)
    some = run(q, k, v, trainable=trainable, **kwargs)
    for name, got, want in zip("qkv", some[2:], full[2:]):
        if name in trainable:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"d{name}")
        else:
            assert got is None, f"frozen {name} got a gradient"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bshd_matches_bhsd_with_gradients(backend):
    q, k, v, _ = packed()
    batch_q = q[:64].reshape(2, 32, *q.shape[1:])
    batch_kv = [t[:96].reshape(2, 48, *t.shape[1:]) for t in (k, v)]
    keep = torch.rand(2, 4, 2, 2, generator=make_generator(3), device=DEVICE) < 0.7
    block = (16, 32)
    got = run(batch_q, *batch_kv, blocks=keep, block_size=block, layout="bshd", backend=backend)
    leaves = [t.detach().transpose(1, 2).clone().requires_grad_(True) for t in (batch_q, *batch_kv)]
    out, lse = blockattn.attention(*leaves, keep, block, backend=backend, return_lse=True)
    out.backward(torch.randn(got[0].shape, generator=make_generator(5), device=DEVICE).transpose(1, 2))
    assert torch.equal(got[0], out.transpose(1, 2)) and torch.equal(got[1], lse)
    for packed_grad, leaf in zip(got[2:], leaves):
        torch.testing.assert_close(packed_grad, leaf.grad.transpose(1, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(cu_seqlens_q=None), "needs cu_seqlens_q"),
    (dict(cu_seqlens_kv=torch.tensor([0, 5], dtype=torch.int32)), "same number of sequences"),
    (dict(cu_seqlens_q=torch.tensor([0, 20, 10, 30], dtype=torch.int32)), "never decrease"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 20, 29], dtype=torch.int32)), "end at the token count 30"),
    (dict(cu_seqlens_q=torch.tensor([1, 10, 20, 30], dtype=torch.int32)), "start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 20, 30], dtype=torch.int64)), "int32"),
])
def test_bad_offsets_are_refused(change, message):
    q = torch.zeros(30, 2, 16, device=DEVICE)
    k = v = torch.zeros(40, 2, 16, device=DEVICE)
    args = dict(cu_seqlens_q=torch.tensor([0, 10, 20, 30], dtype=torch.int32),
                cu_seqlens_kv=torch.tensor([0, 10, 30, 40], dtype=torch.int32))
    args = {name: (value.to(DEVICE) if isinstance(value, torch.Tensor) else value)
            for name, value in dict(args, **change).items()}
    with pytest.raises(ValueError, match=message):
        blockattn.attention(q, k, v, layout="thd", **args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_longest_lengths_change_nothing(pinned_thd, deterministic, backend):
    """max_seqlen_q / max_seqlen_kv equal to the longest lengths: the same out, LSE and gradients, bitwise, as the
    call that reads the offsets; the Triton path then reads nothing back (Tensor.tolist raises here)."""
    q, k, v, keep = packed()
    kwargs = dict(blocks=keep, block_size=BLOCK, layout="thd", cu_seqlens_q=offsets(LENGTHS_Q),
                  cu_seqlens_kv=offsets(LENGTHS_KV), is_causal=True, backend=backend, lse_weight=0.5)
    want = run(q, k, v, **kwargs)
    with contextlib.ExitStack() as stack:
        if backend == "triton":
            patch = stack.enter_context(pytest.MonkeyPatch.context())
            patch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("the offsets were read on the host"))
        got = run(q, k, v, max_seqlen_q=max(LENGTHS_Q), max_seqlen_kv=max(LENGTHS_KV), **kwargs)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name} differs with the longest lengths given"


def test_longer_given_lengths_size_the_mask_and_change_nothing(pinned_thd):
    """Longest lengths given above the real ones (a fixed bucket, as a compiled model keeps): the block mask is
    sized at them, and the results equal those of the real lengths with that mask cut to size."""
    q, k, v, keep = packed()
    # the query bucket also exceeds the packed token count (a fixed bucket for a small batch)
    max_q, max_kv = sum(LENGTHS_Q) + 2 * BLOCK[0], max(LENGTHS_KV) + BLOCK[1]
    bigger = torch.zeros(*keep.shape[:2], math.ceil(max_q / BLOCK[0]), math.ceil(max_kv / BLOCK[1]),
                         dtype=torch.bool, device=DEVICE)
    bigger[..., :keep.shape[2], :keep.shape[3]] = keep
    bigger[..., keep.shape[2]:, :] = True   # blocks past every sequence: never reached
    kwargs = dict(block_size=BLOCK, layout="thd", cu_seqlens_q=offsets(LENGTHS_Q), cu_seqlens_kv=offsets(LENGTHS_KV),
                  is_causal=True, backend="triton")
    want = run(q, k, v, blocks=keep, **kwargs)
    got = run(q, k, v, blocks=bigger, max_seqlen_q=max_q, max_seqlen_kv=max_kv, **kwargs)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{name} differs with longer lengths given")


@pytest.mark.parametrize("change, message", [
    (dict(max_seqlen_q=20), "max_seqlen_kv must be a positive int .give both"),
    (dict(max_seqlen_q=0, max_seqlen_kv=20), "max_seqlen_q must be a positive int"),
    (dict(max_seqlen_q=10, max_seqlen_kv=20.0), "max_seqlen_kv must be a positive int"),
    (dict(max_seqlen_q=9, max_seqlen_kv=20, backend="torch"), "max_seqlen_q=9 is shorter than the longest"),
    (dict(max_seqlen_q=10, max_seqlen_kv=20, layout="bhsd"), 'belong to layout "thd"'),
])
def test_bad_longest_lengths_are_refused(change, message):
    q = torch.zeros(30, 2, 16, device=DEVICE)
    k = v = torch.zeros(40, 2, 16, device=DEVICE)
    args = dict(cu_seqlens_q=torch.tensor([0, 10, 20, 30], dtype=torch.int32, device=DEVICE),
                cu_seqlens_kv=torch.tensor([0, 10, 30, 40], dtype=torch.int32, device=DEVICE), layout="thd")
    args.update(change)
    if args["layout"] != "thd":
        q, k, v = (t[None] for t in (q, k, v))
        args.pop("cu_seqlens_q"), args.pop("cu_seqlens_kv")
    with pytest.raises(ValueError, match=message):
        blockattn.attention(q, k, v, **args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_backward_takes_the_longest_lengths(pinned_thd, backend):
    """attention_backward with max_seqlen_q / max_seqlen_kv gives the gradients autograd gives."""
    q, k, v, keep = packed()
    kwargs = dict(layout="thd", cu_seqlens_q=offsets(LENGTHS_Q), cu_seqlens_kv=offsets(LENGTHS_KV), is_causal=True,
                  backend=backend, max_seqlen_q=max(LENGTHS_Q), max_seqlen_kv=max(LENGTHS_KV))
    want = run(q, k, v, blocks=keep, block_size=BLOCK, **kwargs)
    grad = torch.randn(want[0].shape, generator=make_generator(5), device=DEVICE)
    got = blockattn.attention_backward(grad, q, k, v, want[0], want[1], keep, BLOCK, **kwargs)
    for name, a, b in zip(("dq", "dk", "dv"), got, want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"explicit {name}")
