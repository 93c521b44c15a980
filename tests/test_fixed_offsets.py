"""Fixed exponent offsets in the Triton forward (forward.FIXED_OFFSET_DIMS; kernels/README.md, "Fixed offsets") and
the key norms that bound the scores (kernels/bounds.py). The warp-specialized forward's own fixed offsets are tested
in test_forward_ws.py; these tests run the Triton forward on any machine (the interpreter on the CPU)."""

import math

import pytest
import torch

import blockattn
from blockattn.kernels import bounds, forward, forward_ws
from conftest import (DEVICE, aligned_scores, check_against_oracle, expand, interpreter_share, mostly_whole_kv_valid,
                      pin, qkv, random_keep, real_keys)


@pytest.mark.parametrize("seq_kv, layout, dim, dtype", [(1000, "bhsd", 64, torch.bfloat16),
                                                        (1000, "bshd", 64, torch.bfloat16),
                                                        (20, "bhsd", 64, torch.bfloat16),
                                                        (333, "strided", 80, torch.float32)])
def test_key_norm_parts_bound_each_part(seq_kv, layout, dim, dtype):
    """key_norm_parts: the largest key norm of each of KEY_NORM_PARTS consecutive parts of ceil(Sk / parts) keys of
    each kv head (the last parts shorter, and those past the keys 0), from bhsd or bshd strides, or with every other
    element of a wider last dim (a head dim that is no power of two)."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    k = torch.randn(2, 3, seq_kv, dim, generator=gen, device=DEVICE)
    k = (k * torch.rand(2, 3, seq_kv, 1, generator=gen, device=DEVICE) * 4).to(dtype)
    if layout == "bshd":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "strided":
        wide = torch.full((2, 3, seq_kv, 2 * dim), float("nan"), device=DEVICE, dtype=dtype)
        wide[..., ::2] = k
        k = wide[..., ::2]
    parts = bounds.key_norm_parts(k)
    norms = k.float().norm(dim=-1)
    per_part = -(-seq_kv // bounds.KEY_NORM_PARTS)
    expected = torch.zeros(2, 3, bounds.KEY_NORM_PARTS, device=DEVICE)
    for part in range(bounds.KEY_NORM_PARTS):
        chunk = norms[..., part * per_part:(part + 1) * per_part]
        if chunk.shape[-1]:
            expected[..., part] = chunk.amax(-1)
    assert (expected[..., -1] == 0).all() == (seq_kv in (20, 333))  # parts past the keys (20 < 32; 31 * 11 > 333)
    torch.testing.assert_close(parts, expected, rtol=1e-5, atol=0)


# (batch, heads, kv_heads, seq_q, seq_kv, block, dtype, dim, is_causal, element tests)
TRITON_CASES = {
    "128x64 bf16": (2, 4, 4, 1000, 1024, (128, 64), torch.bfloat16, 64, False, None),
    # the split walk: its untested part first, and the first query block's walk wholly tested (the decision there)
    "causal fp16 gqa": (1, 4, 2, 1024, 1000, (128, 64), torch.float16, 64, True, None),
    # every step tested; the last query block's rows see no key at all (their programs keep the running maxima)
    "token mask bf16 D=128": (1, 2, 2, 600, 700, (64, 64), torch.bfloat16, 128, False, "token mask"),
    "kv_valid fp32 D=80": (2, 2, 1, 520, 640, (128, 128), torch.float32, 80, False, "kv_valid"),
}


def _triton_forward(q, k, v, keep, block, is_causal, extra, fixed: bool, monkeypatch):
    """attention() through the Triton forward (the warp-specialized one switched off) with fixed offsets at q's
    head dim or without them, on 64x64 tiles: (out, lse). Both arms on the same tile whatever the candidate list (the
    walks done again match the running maxima bit for bit), and the tile the GPU compiles fastest: fp32 products on
    the FMA units with fixed offsets took 20 s to compile on it against 85 s on the first candidate, 128x64 (Triton
    3.6, sm_90, offline, fifty-eighth session), and these cases never finished within a device call before."""
    pin(monkeypatch, (64, 64), kernels=("FWD", ))
    monkeypatch.setattr(forward_ws, "ENABLED", False)
    monkeypatch.setattr(forward, "FIXED_OFFSET_DIMS", (q.shape[-1], ) if fixed else ())
    return blockattn.attention(q, k, v, keep, block, return_lse=True, is_causal=is_causal, backend="triton", **extra)


# "bound 160" overflows the fixed walk on purpose (to inf, then NaN, in rows it walks again), and the interpreter's
# numpy says so
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("inputs", ["bound 13.5", "bound 28.8", "bound 160", "large norms"])
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_fixed_offsets_against_the_oracle(case, inputs, monkeypatch, poisoned, launched_kernels):
    """The Triton forward with fixed offsets on scores that rise past each list's first key tile by nearly the rows'
    bounds (aligned_scores: 13.5, 28.8 or 160 log2 units), and on queries too long for the bound (large norms):
    against the oracle, and against the forward without fixed offsets. fp16 keeps the offsets where the bound holds
    within its headroom (15); bf16 and fp32 keep them wherever every row has a key in the first tile, and walk again
    with running maxima where a row's sum passed 2^RISE_LIMIT or overflowed (rises past 110 of 160). Kept offsets
    give a result that differs from the running maxima' in its roundings; the running maxima, one bit for bit."""
    batch, heads, kv_heads, seq_q, seq_kv, block, dtype, dim, is_causal, tests = TRITON_CASES[case]
    heads, kv_heads, seq_q, seq_kv = interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block)
    # keys past the first tile's, and rows that see them; the ragged tails kept
    seq_q, seq_kv = max(seq_q, 512 + seq_q % block[0]), max(seq_kv, 512 + seq_kv % block[1])
    q, k, v = qkv(batch, heads, seq_q, dim, kv_heads=kv_heads, seq_kv=seq_kv, dtype=dtype)
    keep = random_keep(batch, heads, seq_q, seq_kv, block, density=0.5)
    keep[..., :max(1, 256 // block[1])] = True  # every list starts with keys 0-255
    visible = expand(keep, block, seq_q, seq_kv)
    extra = {}
    if tests == "token mask":
        gen = torch.Generator(device=DEVICE).manual_seed(11)
        token_mask = torch.rand(batch, heads, seq_q, seq_kv, generator=gen, device=DEVICE) < 0.7
        token_mask[:, :, -block[0]:] = False  # the last query block's rows see nothing
        extra["attn_mask"], visible = token_mask, visible & token_mask
    elif tests == "kv_valid":
        kv_valid = mostly_whole_kv_valid(batch, math.ceil(seq_kv / block[1]), block[1], seed=3)
        kv_valid[:, 0] = block[1]  # the first key block whole: every row's first tile holds keys
        extra["kv_valid"], visible = kv_valid, visible & real_keys(kv_valid, block[1], seq_kv)[:, None, None]
    if inputs == "large norms":
        q = q * 8
    else:
        largest_bound = float(inputs.split()[1])
        q, k = (t.to(dtype) for t in aligned_scores(q, k, largest_bound))
    out, lse = _triton_forward(q, k, v, keep, block, is_causal, extra, True, monkeypatch)
    names = [fn.__name__ for fn in launched_kernels]
    bounded = dtype == torch.float16  # (the others check the rise after the walk, and take no key norms)
    assert ("key_norm_parts_kernel" in names) == bounded, names
    check_against_oracle(out, lse, q, k, v, visible, is_causal=is_causal)
    running_out, running_lse = _triton_forward(q, k, v, keep, block, is_causal, extra, False, monkeypatch)
    if bounded and (inputs == "large norms" or largest_bound > bounds.FIXED_HEADROOM[dtype]):
        assert torch.equal(out, running_out) and torch.equal(lse, running_lse)
        return
    if inputs != "bound 160":
        assert not torch.equal(out, running_out), "the offsets did not stay fixed anywhere"
        return
    # a row whose scores rise past its first tile's (within keys 0-255, every list's first) by well over
    # RISE_LIMIT leaves a sum past 2^RISE_LIMIT: its program walked again, with the running maxima, bit for bit
    group = heads // kv_heads
    scores = (q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)) * dim ** -0.5 * math.log2(
        math.e)
    if is_causal:
        visible = visible & torch.ones(seq_q, seq_kv, dtype=torch.bool, device=DEVICE).tril()
    scores = scores.masked_fill(~visible.expand_as(scores), float("-inf"))
    walked_again = scores.amax(-1) - scores[..., :256].amax(-1) >= bounds.RISE_LIMIT + 15
    assert walked_again.any()
    assert (out == running_out).all(-1)[walked_again].all() and (lse == running_lse)[walked_again].all()


@pytest.mark.parametrize("query_scale", [1.0, 8.0])
def test_triton_fixed_offsets_on_a_packed_batch(query_scale, monkeypatch, poisoned):
    """A packed ("thd") bf16 batch of sequences of their own lengths, under is_causal: with random inputs, and with
    queries 8 times longer (past any bound, within the checked rise), the offsets stay fixed and the result meets
    the fp64 PyTorch backend about as closely as the running maxima' does."""
    lengths_q, lengths_kv = [300, 513, 77], [400, 256, 600]
    cu_q = torch.tensor([0, 300, 813, 890], dtype=torch.int32, device=DEVICE)
    cu_kv = torch.tensor([0, 400, 656, 1256], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    q = torch.randn(sum(lengths_q), 4, 64, generator=gen, device=DEVICE).bfloat16() * query_scale
    k, v = (torch.randn(sum(lengths_kv), 2, 64, generator=gen, device=DEVICE).bfloat16() for _ in range(2))
    block = (64, 64)
    keep = torch.rand(3, 4, 9, 10, generator=gen, device=DEVICE) < 0.6
    keep[..., 0] = True
    extra = dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    want, want_lse = blockattn.attention(q.double(), k.double(), v.double(), keep, block, return_lse=True,
                                         is_causal=True, backend="torch", **extra)
    out, lse = _triton_forward(q, k, v, keep, block, True, extra, True, monkeypatch)
    running_out, running_lse = _triton_forward(q, k, v, keep, block, True, extra, False, monkeypatch)
    running_err = (running_out.double() - want).norm() / want.norm()
    err = (out.double() - want).norm() / want.norm()
    assert err <= 1.5 * running_err + 1e-3, (err, running_err)
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=0, atol=1e-3)
    assert not torch.equal(out, running_out), "the offsets did not stay fixed anywhere"


def test_quantized_forwards_keep_the_running_maxima(monkeypatch):
    """quant takes no fixed offsets: with the head dim in FIXED_OFFSET_DIMS the int8 forward (fp16 inputs, which
    would take key norms) is the same bit for bit, and no key norms are taken."""
    q, k, v = qkv(1, 2, 300, 64, seq_kv=320, dtype=torch.float16)
    keep = random_keep(1, 2, 300, 320, (64, 64), density=0.6)
    outs = []
    for dims in ((), (64, )):
        monkeypatch.setattr(forward, "FIXED_OFFSET_DIMS", dims)
        monkeypatch.setattr(forward, "key_norm_parts", None)  # would raise if called
        outs.append(blockattn.attention(q, k, v, keep, (64, 64), quant="int8", backend="triton"))
    assert torch.equal(*outs)
