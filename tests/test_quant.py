"""The quantized forwards (quant="int8", "int8-fp8", "int8-int8"): the quantization kernels against their rules, the
attention kernel and the PyTorch backend against the fp64 oracle on the values they quantized to, how close both
come to exact attention, key smoothing, the layouts, and every refusal."""

import math

import pytest
import torch

import blockattn
from blockattn import reference
from blockattn.kernels import forward, launch, lists, ops
from blockattn.kernels.quant import quantize_columns, quantize_columns_kernel, quantize_rows, quantize_rows_kernel
from conftest import (DEVICE, ON_GPU, check_against_oracle, expand, make_generator, mostly_whole_kv_valid, oracle,
                      qkv, random_keep, rel_error)

BACKENDS = ("torch", "triton")


def rule(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization rule in fp64, written from its statement: (int8 values as fp64, scale max|x| / 127)."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True)
    y = torch.where(amax > 0, x * 127 / amax, torch.zeros_like(x))
    return torch.sign(y) * torch.floor(y.abs() + 0.5), amax[..., 0] / 127


def dequantized(q, k):
    """What the Triton path multiplies: the quantization kernel's q and smoothed k, dequantized in fp64, and the
    LSE shift it adds (scale * q . mean of the keys)."""
    mean = k.mean(2, dtype=torch.float32)
    q8, q_scale, _ = quantize_rows(q, mean, subtract_mean=False, dot_mean=True)
    k8, k_scale, _ = quantize_rows(k, mean, subtract_mean=True, dot_mean=False)
    group = q.shape[1] // k.shape[1]
    q_hat = q8.double() * q_scale.double()[..., None]
    shift = (q_hat * mean.double().repeat_interleave(group, 1)[:, :, None]).sum(-1) * q.shape[-1] ** -0.5
    return q_hat, k8.double() * k_scale.double()[..., None], shift


def inputs_of(backend, q, k):
    """(q_hat, k_hat, shift) in fp64 as the backend computes them."""
    if backend == "triton":
        return dequantized(q, k)
    q_hat, k_hat, shift = reference.quantized_qk(q, k, q.shape[-1] ** -0.5)
    return q_hat.double(), k_hat.double(), shift.double()


@pytest.mark.parametrize("subtract_mean", [False, True])
def test_quantize_rows_follows_the_rule(poisoned, subtract_mean):
    """int8 values within one step of the rule's (near-halves round either way in fp32), nearly all equal; scales
    to fp32 rounding; a zero row gives zeros and scale 0; strided [B, S, H, D] input."""
    gen = make_generator(3)
    x = (torch.randn(2, 77, 3, 40, generator=gen, device=DEVICE) * 3).to(torch.bfloat16).transpose(1, 2)
    mean = torch.randn(2, 3, 40, generator=gen, device=DEVICE).to(torch.bfloat16).float() * subtract_mean
    x[0, 1, 5] = mean[0, 1]  # a row that quantizes from all zeros
    x8, scale, row_dot = quantize_rows(x, mean, subtract_mean=subtract_mean, dot_mean=True)
    want8, want_scale = rule(x.double() - mean.double()[:, :, None] if subtract_mean else x)
    assert x8.dtype == torch.int8 and x8.shape == x.shape and x8.is_contiguous()
    gap = (x8.double() - want8).abs()
    assert gap.max() <= 1 and (gap > 0).float().mean() < 1e-3, f"{int((gap > 0).sum())} values off the rule"
    torch.testing.assert_close(scale.double(), want_scale, rtol=1e-6, atol=0)
    assert (x8[0, 1, 5] == 0).all() and scale[0, 1, 5] == 0
    dots = (x8.double() * scale.double()[..., None] * mean.double()[:, :, None]).sum(-1)
    torch.testing.assert_close(row_dot.double(), dots, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["ragged", "causal", "gqa_empty_row", "kv_valid"])
def test_quantized_forward_matches_the_oracle_on_its_quantized_values(geometry, poisoned, backend, case):
    """out and LSE against fp64 attention on exactly the values the backend quantized q and k to (and the keys'
    mean added back): the same error budget as an unquantized bf16 kernel."""
    g = geometry
    seq_q, seq_kv = g.seqs
    kv_heads = g.heads // 2 if case == "gqa_empty_row" else g.heads
    q, k, v = qkv(g.batch, g.heads, seq_q, g.dim, kv_heads=kv_heads, seq_kv=seq_kv, seed=4)
    k = k + 2.0 * torch.randn(g.dim, generator=make_generator(9), device=DEVICE).to(k.dtype)  # a shared offset
    keep = random_keep(g.batch, g.heads, seq_q, seq_kv, g.block)
    kwargs = {}
    if case == "gqa_empty_row":
        keep[..., 1, :] = False
    if case == "causal":
        q[:, :, :3] = 0   # all-zero queries (scale 0) in tiles whose masked scores are -inf
    if case == "kv_valid":
        valid = torch.randint(0, g.block[1] + 1, (keep.shape[-1],), generator=make_generator(2), device=DEVICE)
        kwargs["kv_valid"] = valid.to(torch.int32)
    out, lse = blockattn.attention(q, k, v, keep, g.block, quant="int8", backend=backend, return_lse=True,
                                   is_causal=case == "causal", **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    q_hat, k_hat, shift = inputs_of(backend, q, k)
    visible = expand(keep, g.block, seq_q, seq_kv)
    if case == "kv_valid":
        positions = torch.arange(seq_kv, device=DEVICE)
        visible = visible & (positions % g.block[1] < valid.repeat_interleave(g.block[1])[:seq_kv])
    # the oracle sees the smoothed keys, so its LSE lacks the shift the backends add back
    check_against_oracle(out, lse - shift.float(), q_hat.to(q.dtype), k_hat.to(k.dtype), v, visible,
                         is_causal=case == "causal")


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_forward_stays_near_exact_attention_despite_a_key_offset(geometry, backend):
    """Against exact fp64 attention on the unquantized inputs: keys with a large shared offset (as real keys
    carry) lose no more accuracy than keys without, thanks to the smoothing, and the error is the size of
    per-token int8 rounding (the same inputs quantized by the fp64 rule without smoothing: the offset ruins it)."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(1, g.heads, seq, g.dim, seed=6)
    offset = 8.0 * torch.randn(g.dim, generator=make_generator(7), device=DEVICE)
    keep = random_keep(1, g.heads, seq, seq, g.block)
    visible = expand(keep, g.block, seq, seq)
    errors = {}
    for name, keys in (("plain", k), ("offset", (k.float() + offset).to(k.dtype))):
        want, want_lse = oracle(q, keys, v, visible)
        out, lse = blockattn.attention(q, keys, v, keep, g.block, quant="int8", backend=backend, return_lse=True)
        errors[name] = rel_error(out, want)
        assert (lse.double() - want_lse).abs().max() < 0.05 * want_lse.abs().max(), f"{name}: LSE off"
    q8, q_scale = rule(q)
    k8, k_scale = rule(k.float() + offset)
    naive = oracle(q8 * q_scale[..., None], k8 * k_scale[..., None], v, visible)[0]
    naive_error = rel_error(naive, oracle(q, (k.float() + offset).to(k.dtype), v, visible)[0])
    assert errors["offset"] <= 1.5 * errors["plain"] + 1e-3, errors
    assert errors["offset"] < naive_error / 2, (errors, naive_error)
    assert errors["plain"] < 0.05, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_packed_batch_matches_each_sequence_on_its_values(backend):
    """"thd": each sequence's out against the oracle on the values quantized over the whole packed batch (the
    keys' mean is taken over every packed token, which softmax ignores all the same)."""
    lengths_q, lengths_kv, block = (37, 64, 5), (50, 29, 70), (32, 16)
    gen = make_generator(8)
    q = torch.randn(sum(lengths_q), 4, 32, generator=gen, device=DEVICE).to(torch.bfloat16)
    k = torch.randn(sum(lengths_kv), 2, 32, generator=gen, device=DEVICE).to(torch.bfloat16)
    v = torch.randn(sum(lengths_kv), 2, 32, generator=gen, device=DEVICE).to(torch.bfloat16)
    nq, nk = math.ceil(max(lengths_q) / block[0]), math.ceil(max(lengths_kv) / block[1])
    keep = torch.rand(3, 4, nq, nk, generator=gen, device=DEVICE) < 0.6
    cu_q = torch.tensor([0, 37, 101, 106], dtype=torch.int32, device=DEVICE)
    cu_kv = torch.tensor([0, 50, 79, 149], dtype=torch.int32, device=DEVICE)
    out, lse = blockattn.attention(q, k, v, keep, block, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                   quant="int8", backend=backend, return_lse=True)
    q_hat, k_hat, shift = inputs_of(backend, q.transpose(0, 1)[None], k.transpose(0, 1)[None])
    for i in range(3):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_kv[i], cu_kv[i + 1])
        visible = expand(keep[i:i + 1], block, lengths_q[i], lengths_kv[i])
        check_against_oracle(out[sq].transpose(0, 1)[None], (lse[sq] - shift[0, :, sq].t().float()).t()[None],
                             q_hat[:, :, sq].to(q.dtype), k_hat[:, :, sk].to(k.dtype),
                             v[sk].transpose(0, 1)[None], visible)


def test_compiled_quantized_forward_matches_eager(geometry):
    g = geometry
    q, k, v = qkv(1, g.heads, g.seqs[0], g.dim, seed=2)
    keep = random_keep(1, g.heads, g.seqs[0], g.seqs[0], g.block)

    def call(q, k, v, keep):
        return blockattn.attention(q, k, v, keep, g.block, quant="int8", backend="triton", return_lse=True)
    torch._dynamo.reset()
    got = torch.compile(call, fullgraph=True)(q, k, v, keep)
    want = call(q, k, v, keep)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_repeated_quantized_calls_relaunch_and_stay_exact(geometry, poisoned, monkeypatch):
    """The same shapes three times with new data, each scheme: out and LSE against the oracle on the quantized values
    every time; on a GPU the quantize kernels and the forward relaunch from launch plans (none under the
    interpreter)."""
    monkeypatch.setattr(launch, "_PLANS", {})
    g = geometry
    seq = g.seqs[0]
    keep = random_keep(1, g.heads, seq, seq, g.block)
    visible = expand(keep, g.block, seq, seq)
    for seed in range(3):
        q, k, v = qkv(1, g.heads, seq, g.dim, seed=30 + seed)
        for quant in ("int8", "int8-int8"):
            out, lse = blockattn.attention(q, k, v, keep, g.block, quant=quant, backend="triton", return_lse=True)
            if quant == "int8":
                q_hat, k_hat, shift = dequantized(q, k)
                check_against_oracle(out, lse - shift.float(), q_hat.to(q.dtype), k_hat.to(k.dtype), v, visible)
            else:  # a fresh V quantized each time: the relaunch reads it, not the first call's
                v_hat = reference.quantized_v(v, "int8")
                want = oracle(*dequantized(q, k)[:2], v_hat, visible)[0]
                assert rel_error(out, want) < 0.05, f"seed {seed}: {rel_error(out, want):.3e}"
    kernels = {key[0] for key in launch.plans()}
    # (and the list kernel, which builds each call's lists from its mask)
    expected = {forward.attention_fwd_kernel, quantize_rows_kernel, quantize_columns_kernel,
                lists.full_first_lists_kernel}
    assert kernels == (expected if ON_GPU else set())


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_forward_refuses_inputs_that_need_gradients(backend):
    q = torch.zeros(1, 2, 16, 32, device=DEVICE, requires_grad=True)
    k = torch.zeros(1, 2, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="has no backward"):
        blockattn.attention(q, k, k, quant="int8", backend=backend)
    with torch.no_grad():
        assert torch.isfinite(blockattn.attention(q, k, k, quant="int8", backend=backend)).all()


# ------------------------------------------- int8-fp8 / int8-int8: V per channel and P in float8 e4m3 / int8

@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantize_columns_rounds_each_channel_by_its_rule(poisoned, fmt):
    """fp8: values equal torch's rounding of v * 448 / max|v| over the sequence (per batch, head and channel);
    int8: v * 127 / max|v| rounded halves away from zero (the fp64 rule; near-halves may round either way in
    fp32). Stored [B, H, D, S]; an all-zero channel gives zeros and scale 0; strided [B, S, H, D] input."""
    gen = make_generator(12)
    v = (torch.randn(2, 91, 3, 40, generator=gen, device=DEVICE) * 4).to(torch.bfloat16).transpose(1, 2)
    v[1, 2, :, 7] = 0
    v8, scale = quantize_columns(v, fmt)
    amax = v.abs().amax(2).float()
    largest, dtype = {"fp8": (448, torch.float8_e4m3fn), "int8": (127, torch.int8)}[fmt]
    assert v8.dtype == dtype and v8.shape == v.shape and v8.transpose(2, 3).is_contiguous()
    if fmt == "fp8":
        want = (v.float() * torch.where(amax > 0, 448 / amax.clamp_min(1e-30), 0)[:, :, None]).to(dtype).double()
        assert torch.equal(v8.double(), want), f"{int((v8.double() != want).sum())} values differ"
    else:
        want = rule(v.transpose(2, 3))[0].transpose(2, 3)  # the rule per row of [B, H, D, S]: per channel here
        gap = (v8.double() - want).abs()
        assert gap.max() <= 1 and (gap > 0).float().mean() < 1e-3, f"{int((gap > 0).sum())} values off the rule"
    assert torch.equal(scale, amax / largest) and (v8[1, 2, :, 7].double() == 0).all()


def test_quantize_columns_names_an_unknown_format():
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_columns(torch.zeros(1, 1, 4, 16, device=DEVICE), "int4")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant", ["int8-fp8", "int8-int8"])
@pytest.mark.parametrize("case", ["ragged", "causal", "gqa_empty_row"])
def test_pv_quantized_forward_matches_the_oracle_on_its_quantized_values(geometry, poisoned, backend, quant, case):
    """quant="int8-fp8" / "int8-int8" against fp64 attention on the backend's q, k and V values: the PyTorch
    backend within bf16's budget (it rounds V, not P); the kernels round P (times 448 to float8, times 127 to
    integers) as well, so their error is held against that rounding's own, P rounded in fp64 (a row's final
    maximum, where the kernels round against a running one). LSE as exact as int8's; empty rows zero."""
    g = geometry
    seq_q, seq_kv = g.seqs
    kv_heads = g.heads // 2 if case == "gqa_empty_row" else g.heads
    q, k, v = qkv(g.batch, g.heads, seq_q, g.dim, kv_heads=kv_heads, seq_kv=seq_kv, seed=14)
    keep = random_keep(g.batch, g.heads, seq_q, seq_kv, g.block)
    if case == "gqa_empty_row":
        keep[..., 1, :] = False
    is_causal = case == "causal"
    out, lse = blockattn.attention(q, k, v, keep, g.block, quant=quant, backend=backend, return_lse=True,
                                   is_causal=is_causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    q_hat, k_hat, shift = inputs_of(backend, q, k)
    fmt = quant.split("-")[1]
    v_hat = reference.quantized_v(v, fmt).double()
    visible = expand(keep, g.block, seq_q, seq_kv)
    if backend == "torch":
        check_against_oracle(out, lse - shift.float(), q_hat.to(q.dtype), k_hat.to(k.dtype), v_hat.to(v.dtype),
                             visible, is_causal=is_causal)
        return
    if is_causal:
        visible = visible & torch.ones(seq_q, seq_kv, dtype=torch.bool, device=DEVICE).tril()
    want, want_lse = oracle(q_hat, k_hat, v_hat, visible)
    rows = visible.expand(*want.shape[:3], seq_kv).any(-1)
    assert torch.isfinite(out).all() and (out[~rows] == 0).all() and torch.isneginf(lse[~rows]).all()
    group = q.shape[1] // k.shape[1]
    scores = q_hat @ k_hat.repeat_interleave(group, 1).transpose(-1, -2) * g.dim ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True).nan_to_num(0, 0, 0))
    if fmt == "fp8":
        rounded = (weights * 448).float().to(torch.float8_e4m3fn).double() / 448
    else:
        rounded = torch.round(weights * 127) / 127
    emulated = (rounded @ v_hat.repeat_interleave(group, 1)) / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    budget = rel_error(emulated, want, rows)
    err = rel_error(out, want, rows)
    # int8 P's rounding is the coarser in absolute terms, and truncating it (a bias) measured 1.8-1.9x its budget
    factor, floor = (2.0, 1e-3) if fmt == "fp8" else (1.5, 1e-4)
    assert err <= factor * budget + floor, f"error {err:.3e} against {fmt} P's own {budget:.3e}"
    lse_err = ((lse - shift.float())[rows].double() - want_lse[rows]).abs().max().item()
    assert lse_err <= 1e-3 * max(1.0, want_lse[rows].abs().max().item()), f"LSE off by {lse_err:.3e}"


@pytest.mark.parametrize("quant", ["int8-fp8", "int8-int8"])
@pytest.mark.parametrize("block, causal", [((48, 48), False), ((32, 16), True), ((16, 64), False), ((48, 64), True)])
def test_pv_quantized_forward_takes_key_tiles_of_32_at_least(poisoned, tuner_launches, quant, block, causal):
    """The GPU's 8-bit products reduce over 32 keys at a time, so P @ V in 8 bits runs on key tiles of 32 or more:
    key blocks that no such tile nests in (48, 16) run on a tile view with the block mask tested per element, and
    query blocks whose rows are a multiple of 16 but not of 32 (16, 48) on 16x32 tiles. Against the oracle on the
    quantized values (P's rounding allowed for), every forward launch 32 keys wide."""
    seq_q, seq_kv, heads, dim = 150, 131, 2, 32
    q, k, v = qkv(1, heads, seq_q, dim, seq_kv=seq_kv, seed=41)
    keep = random_keep(1, heads, seq_q, seq_kv, block)
    out = blockattn.attention(q, k, v, keep, block, quant=quant, backend="triton", is_causal=causal)
    widths = [config.kwargs["BLOCK_N"] for fn, _, config in tuner_launches if fn.__name__ == "attention_fwd_kernel"]
    assert widths and min(widths) >= 32, widths
    visible = expand(keep, block, seq_q, seq_kv)
    if causal:
        visible = visible & torch.ones(seq_q, seq_kv, dtype=torch.bool, device=DEVICE).tril()
    q_hat, k_hat, _ = dequantized(q, k)
    want = oracle(q_hat, k_hat, reference.quantized_v(v, quant.split("-")[1]).double(), visible)[0]
    rows = visible.expand(1, heads, seq_q, seq_kv).any(-1)
    assert torch.isfinite(out).all() and (out[~rows] == 0).all()
    assert rel_error(out, want, rows) < 0.06, f"{rel_error(out, want, rows):.3e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["token_mask", "odd_blocks", "fp16", "fp32", "dims_16_40"])
def test_quantized_forward_on_the_other_kernel_variants(geometry, poisoned, backend, case):
    """quant="int8" with what the first oracle test leaves out: a token mask, a block shape no tile nests in (the
    gathered block mask), fp16 and fp32 inputs (P @ V in their precision), a head dim of 16 (the int8 product's
    columns padded to 32) with Dv = 40. Against the fp64 oracle on the quantized values."""
    g = geometry
    seq_q, seq_kv = g.seqs
    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(case, torch.bfloat16)
    dim, dim_v = (16, 40) if case == "dims_16_40" else (g.dim, g.dim)
    block = (100, 100) if case == "odd_blocks" else g.block
    q, k, v = qkv(g.batch, g.heads, seq_q, dim, seq_kv=seq_kv, dim_v=dim_v, dtype=dtype, seed=21)
    keep = random_keep(g.batch, g.heads, seq_q, seq_kv, block)
    visible = expand(keep, block, seq_q, seq_kv)
    kwargs = {}
    if case == "token_mask":
        kwargs["attn_mask"] = torch.rand(seq_q, seq_kv, generator=make_generator(22), device=DEVICE) < 0.7
        visible = visible & kwargs["attn_mask"]
    out, lse = blockattn.attention(q, k, v, keep, block, quant="int8", backend=backend, return_lse=True, **kwargs)
    assert out.dtype == dtype and out.shape == (*q.shape[:3], dim_v)
    q_hat, k_hat, shift = inputs_of(backend, q, k)
    check_against_oracle(out, lse - shift.float(), q_hat.to(dtype), k_hat.to(dtype), v, visible)


@pytest.mark.parametrize("quant", ["int8", "int8-int8"])
def test_quantized_forward_over_kv_valid_key_tiles_matches_every_tile_tested(geometry, poisoned, monkeypatch, quant):
    """kv_valid over key blocks wider than 64 keys, mostly whole, one block with a single real key: the quantized
    forward walks 64-key tiles, the full ones first and untested, the padding-only ones left out. Forcing every
    tile tested over the blocks themselves quantizes the same values, so the two agree but for the order of
    accumulation (and, for int8 P, its rounding at each step's running maximum)."""
    g = geometry
    seq_q, seq_kv = g.seqs
    block = (g.block[0], 256 if ON_GPU else 128)
    q, k, v = qkv(2, g.heads, seq_q, g.dim, seq_kv=seq_kv, seed=12)
    keep = random_keep(1, g.heads, seq_q, seq_kv, block, density=0.7)
    kv_valid = mostly_whole_kv_valid(2, keep.shape[-1], block[1], seed=13)
    kv_valid[0, 0] = 1

    def run():
        return blockattn.attention(q, k, v, keep, block, kv_valid=kv_valid, quant=quant, return_lse=True,
                                   backend="triton")
    got, got_lse = run()
    monkeypatch.setattr(forward, "full_tiles_first", lambda *args: False)
    monkeypatch.setattr(ops, "full_tiles_first", lambda *args: False)
    want, want_lse = run()
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), seen) and (got[~seen] == 0).all()
    assert (got_lse[seen] - want_lse[seen]).abs().max() <= 1e-3 * want_lse[seen].abs().max()
    assert rel_error(got, want, seen) <= (2e-2 if quant == "int8-int8" else 5e-3), rel_error(got, want, seen)
