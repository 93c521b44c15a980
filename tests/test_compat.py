"""Drop-in entry points: torch_npu's npu_block_sparse_attention (and backward) and FastVideo's
block_sparse_attn_256 against an fp64 oracle, out and gradients; SageAttention's sageattn / sageattn_varlen against
the quantized forward. GPU runs use the reference suites' sizes; the CPU interpreter runs the same cases with fewer
heads and a smaller head dim."""

import math
import random
import re

import pytest
import torch

import blockattn
from blockattn.compat import fastvideo, npu, sage
from conftest import DEVICE, ON_GPU, expand, make_generator, oracle

DIM = 128 if ON_GPU else 32
TND_Q = [355, 17, 41, 83, 129, 211, 7, 53, 97, 151, 233, 301, 19]
TND_KV = [533, 23, 67, 101, 173, 257, 11, 89, 137, 199, 281, 349, 31]
if not ON_GPU:  # the interpreter takes the first sequences of the same list
    TND_Q, TND_KV = TND_Q[:4], TND_KV[:4]


def gen_tensor(*shape, dtype, seed):
    return torch.randn(*shape, generator=make_generator(seed), device=DEVICE).to(dtype)


def tnd_oracle(query, key, value, mask, block, lengths_q, lengths_kv, grad=None, scale=None):
    """Per sequence fp64 attention over the token-expanded block mask (scale None: D ** -0.5); returns out [T, N, D],
    lse [T, N] and, with grad, (dq, dk, dv) in the packed layout."""
    leaves = [t.detach().double().requires_grad_(grad is not None) for t in (query, key, value)]
    outs, lses = [], []
    start_q = start_kv = 0
    for index, (len_q, len_kv) in enumerate(zip(lengths_q, lengths_kv)):
        q = leaves[0][start_q:start_q + len_q].permute(1, 0, 2)[None]
        k = leaves[1][start_kv:start_kv + len_kv].permute(1, 0, 2)[None]
        v = leaves[2][start_kv:start_kv + len_kv].permute(1, 0, 2)[None]
        visible = expand(mask[index:index + 1], block, len_q, len_kv)
        out, lse = oracle(q, k, v, visible, scale=scale)
        outs.append(out[0].permute(1, 0, 2))
        lses.append(lse[0].t())
        start_q, start_kv = start_q + len_q, start_kv + len_kv
    out, lse = torch.cat(outs), torch.cat(lses)
    if grad is None:
        return out, lse
    out.backward(grad.double())
    return out, lse, [t.grad for t in leaves]


def close(got, want, tolerance, label):
    assert got.shape == want.shape and torch.isfinite(got).all(), f"{label} not finite, or shaped {got.shape}"
    if not want.numel():
        return
    gap = (got.double() - want.double()).abs().max().item()
    scale = want.abs().max().item()
    assert gap <= tolerance * max(scale, 1e-6), f"{label}: gap {gap:.3e} vs scale {scale:.3e}"


TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-4}


def tnd_case(full, heads, kv_heads, block, lengths_q, lengths_kv, dtype, seed=0):
    nq = math.ceil(max(lengths_q) / block[0])
    nk = math.ceil(max(lengths_kv) / block[1])
    if full:
        mask = torch.ones(len(lengths_q), heads, nq, nk, dtype=torch.int8, device=DEVICE)
    else:  # torch_npu's sparse pattern: one or two kept blocks per query block, spread by batch and head
        mask = torch.zeros(len(lengths_q), heads, nq, nk, dtype=torch.int8, device=DEVICE)
        for b, len_kv in enumerate(lengths_kv):
            valid = max(1, math.ceil(len_kv / block[1]))
            for n in range(heads):
                for qb in range(nq):
                    mask[b, n, qb, (qb + b + n) % valid] = 1
                    if valid > 1 and (qb + n) % 2 == 0:
                        mask[b, n, qb, (qb + b + n + 1) % valid] = 1
    query = gen_tensor(sum(lengths_q), heads, DIM, dtype=dtype, seed=seed)
    key = gen_tensor(sum(lengths_kv), kv_heads, DIM, dtype=dtype, seed=seed + 1)
    value = gen_tensor(sum(lengths_kv), kv_heads, DIM, dtype=dtype, seed=seed + 2)
    return query, key, value, mask


TND_CASES = {
    "gqa full": dict(full=True, heads=12 if ON_GPU else 4, kv_heads=3 if ON_GPU else 1, block=(128, 128),
                     lengths_q=TND_Q, lengths_kv=TND_KV),
    "gqa sparse": dict(full=False, heads=12 if ON_GPU else 4, kv_heads=3 if ON_GPU else 1, block=(128, 128),
                       lengths_q=TND_Q, lengths_kv=TND_KV),
    "single 127x191": dict(full=False, heads=4, kv_heads=4, block=(64, 128), lengths_q=[127], lengths_kv=[191]),
    "uneven lengths": dict(full=False, heads=4, kv_heads=2, block=(64, 128), lengths_q=[1, 64, 129, 17],
                           lengths_kv=[128, 3, 257, 65]),
    "group of 4": dict(full=False, heads=8, kv_heads=2, block=(64, 128), lengths_q=[100, 200], lengths_kv=[150, 90]),
    "mqa": dict(full=False, heads=4, kv_heads=1, block=(64, 128), lengths_q=[100, 33], lengths_kv=[70, 300]),
    "block 8x128": dict(full=False, heads=2, kv_heads=2, block=(8, 128), lengths_q=[100, 40], lengths_kv=[300, 129]),
    "block 32x128": dict(full=False, heads=2, kv_heads=1, block=(32, 128), lengths_q=[100, 40],
                         lengths_kv=[300, 129]),
}


@pytest.mark.parametrize("case", list(TND_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_npu_tnd_forward_and_autograd(poisoned, case, dtype):
    spec = dict(TND_CASES[case])
    query, key, value, mask = tnd_case(dtype=dtype, **spec)
    block = spec["block"]
    leaves = [t.detach().clone().requires_grad_(True) for t in (query, key, value)]
    out, lse = npu.npu_block_sparse_attention(
        *leaves, mask, block, q_input_layout="TND", kv_input_layout="TND", num_key_value_heads=spec["kv_heads"],
        scale_value=DIM ** -0.5, actual_seq_lengths=spec["lengths_q"], actual_seq_lengths_kv=spec["lengths_kv"],
        softmax_lse_flag=1)
    assert out.shape == query.shape and lse.shape == (query.shape[0], query.shape[1], 1) and lse.dtype == torch.float32
    grad = gen_tensor(*out.shape, dtype=dtype, seed=9)
    out.backward(grad)
    want_out, want_lse, want_grads = tnd_oracle(query, key, value, mask, block, spec["lengths_q"],
                                                spec["lengths_kv"], grad)
    close(out, want_out, TOLERANCE[dtype], "out")
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse[..., 0]), finite)
    close(lse[..., 0][finite], want_lse[finite], 1e-3, "lse")
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, want_grads):
        close(leaf.grad, want, 2 * TOLERANCE[dtype], name)


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("full", [True, False])
def test_npu_padded_layouts_forward_then_backward_function(layout, dtype, full):
    """The forward's attention_out and softmax_lse handed to the backward function (torch_npu's forward/backward
    together row), against the oracle."""
    batch, heads, seq, block = 2, 8 if ON_GPU else 2, 256 if ON_GPU else 96, (128, 128) if ON_GPU else (32, 32)
    n = math.ceil(seq / block[0])
    mask = torch.ones(batch, heads, n, n, dtype=torch.int8, device=DEVICE)
    if not full:
        mask = (torch.rand(batch, heads, n, n, generator=make_generator(4), device=DEVICE) < 0.5).to(torch.int8)
        mask[..., 0, 0] = 1
    q, k, v = (gen_tensor(batch, heads, seq, DIM, dtype=dtype, seed=s) for s in (1, 2, 3))
    grad = gen_tensor(batch, heads, seq, DIM, dtype=dtype, seed=4)
    to_layout = (lambda t: t) if layout == "BNSD" else (lambda t: t.transpose(1, 2).contiguous())
    args = [to_layout(t) for t in (q, k, v)]
    out, lse = npu.npu_block_sparse_attention(*args, mask, block, q_input_layout=layout, kv_input_layout=layout,
                                              num_key_value_heads=heads, scale_value=DIM ** -0.5)
    assert lse.shape == (batch, heads, seq, 1)
    dq, dk, dv = npu.npu_block_sparse_attention_backward(to_layout(grad), *args, out, lse, mask, block,
                                                         q_input_layout=layout, kv_input_layout=layout,
                                                         num_key_value_heads=heads, scale_value=DIM ** -0.5)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want, _ = oracle(*leaves, expand(mask, block, seq, seq))
    want.backward(grad.double())
    from_layout = (lambda t: t) if layout == "BNSD" else (lambda t: t.transpose(1, 2))
    close(from_layout(out), want, TOLERANCE[dtype], "out")
    for name, got, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        close(from_layout(got), leaf.grad, 2 * TOLERANCE[dtype], name)


NPU_SEEDS = range(24)


def draw_npu_call(seed: int) -> dict:
    """One random npu_block_sparse_attention call: layout, GQA, dtype, block shape, lengths (TND: per sequence, some
    empty; BNSD / BSND: actual lengths, some 0, for queries, keys, both or neither), mask density and type, scale, and
    whether the gradients come through autograd or through the backward function."""
    rng = random.Random(seed)
    layout = rng.choice(["BNSD", "BSND", "TND"])
    kv_heads, group, batch = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
    call = dict(layout=layout, dtype=rng.choice([torch.float16, torch.bfloat16, torch.float32]), kv_heads=kv_heads,
                heads=kv_heads * group, dim=rng.choice([16, 32, 64]), batch=batch,
                block=(rng.choice([16, 32, 48, 64, 128]), rng.choice([16, 32, 48, 64, 128])),
                density=rng.choice([1.0, 0.5, 0.2]), mask_dtype=rng.choice([torch.int8, torch.uint8, torch.bool]),
                scale=rng.choice([0.0, 0.1, 0.3]), through=rng.choice(["autograd", "backward function"]))
    if layout == "TND":
        lengths_q = [rng.randint(0, 150) for _ in range(batch)]
        lengths_kv = list(lengths_q) if rng.random() < 0.5 else [rng.randint(0, 150) for _ in range(batch)]
        lengths_q[0], lengths_kv[-1] = max(lengths_q[0], 1), max(lengths_kv[-1], 1)  # no empty packed tensor
        seq_q, seq_kv = max(lengths_q), max(lengths_kv)
    else:
        seq_q = rng.randint(1, 150)
        seq_kv = seq_q if rng.random() < 0.5 else rng.randint(1, 150)
        lengths_q = [rng.randint(0, seq_q) for _ in range(batch)] if rng.random() < 0.6 else None
        lengths_kv = [rng.randint(0, seq_kv) for _ in range(batch)] if rng.random() < 0.6 else None
    return dict(call, seq_q=seq_q, seq_kv=seq_kv, lengths_q=lengths_q, lengths_kv=lengths_kv)


def padded_oracle(layout, query, key, value, mask, block, lengths_q, lengths_kv, scale, grad):
    """fp64 out, LSE and (dq, dk, dv) for BNSD / BSND, where query row i of batch entry b counts only below
    lengths_q[b] and key j below lengths_kv[b] (None: all); each in the inputs' layout (LSE [B, N, S])."""
    to_bnsd = (lambda t: t) if layout == "BNSD" else (lambda t: t.transpose(1, 2))
    leaves = [to_bnsd(t).detach().double().requires_grad_(True) for t in (query, key, value)]
    seq_q, seq_kv = leaves[0].shape[2], leaves[1].shape[2]
    visible = expand(mask, block, seq_q, seq_kv).clone()
    for b in range(visible.shape[0]):
        visible[b, :, lengths_q[b] if lengths_q else seq_q:] = False
        visible[b, :, :, lengths_kv[b] if lengths_kv else seq_kv:] = False
    out, lse = oracle(*leaves, visible, scale=scale)
    out.backward(to_bnsd(grad).double())
    return to_bnsd(out), lse, [to_bnsd(leaf.grad) for leaf in leaves]


@pytest.mark.parametrize("seed", NPU_SEEDS)
def test_npu_on_random_configurations(poisoned, seed):
    """npu_block_sparse_attention (and its backward, or autograd through it) on a random call against the fp64
    oracle: padded rows and sequences without keys give zeros and LSE -inf, never NaN."""
    call = draw_npu_call(seed)
    layout, dtype, block, batch = call["layout"], call["dtype"], call["block"], call["batch"]
    gen = make_generator(seed)
    nq, nk = math.ceil(call["seq_q"] / block[0]), math.ceil(call["seq_kv"] / block[1])
    mask = (torch.rand(batch, call["heads"], nq, nk, generator=gen, device=DEVICE) < call["density"])
    mask = mask.to(call["mask_dtype"])
    if layout == "TND":
        shapes = [(sum(call["lengths_q"]), call["heads"]), (sum(call["lengths_kv"]), call["kv_heads"])]
    else:
        shapes = [(batch, call["heads"], call["seq_q"]), (batch, call["kv_heads"], call["seq_kv"])]
        if layout == "BSND":
            shapes = [(shape[0], shape[2], shape[1]) for shape in shapes]
    query, key, value = (torch.randn(*shape, call["dim"], generator=gen, device=DEVICE).to(dtype)
                         for shape in (shapes[0], shapes[1], shapes[1]))
    grad = torch.randn(query.shape, generator=gen, device=DEVICE).to(dtype)
    options = dict(q_input_layout=layout, kv_input_layout=layout, num_key_value_heads=call["kv_heads"],
                   scale_value=call["scale"], actual_seq_lengths=call["lengths_q"],
                   actual_seq_lengths_kv=call["lengths_kv"])
    autograd = call["through"] == "autograd"
    leaves = [t.detach().clone().requires_grad_(autograd) for t in (query, key, value)]
    out, lse = npu.npu_block_sparse_attention(*leaves, mask, block, **options)
    if autograd:
        out.backward(grad)
        grads = [leaf.grad for leaf in leaves]
    else:
        grads = npu.npu_block_sparse_attention_backward(grad, query, key, value, out, lse, mask, block, **options)
    scale = call["scale"] or call["dim"] ** -0.5
    if layout == "TND":
        want_out, want_lse, want_grads = tnd_oracle(query, key, value, mask, block, call["lengths_q"],
                                                    call["lengths_kv"], grad, scale=scale)
    else:
        want_out, want_lse, want_grads = padded_oracle(layout, query, key, value, mask, block, call["lengths_q"],
                                                       call["lengths_kv"], scale, grad)
    label = ", ".join(f"{name}={value}" for name, value in call.items())
    tolerance = TOLERANCE[dtype] if dtype != torch.float32 else 5e-3  # fp32 on a GPU may multiply in tf32
    close(out, want_out, tolerance, f"out ({label})")
    lse = lse[..., 0]
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite) and not lse.isnan().any(), f"LSE's empty rows ({label})"
    close(lse[finite], want_lse[finite], 1e-3 if dtype != torch.float32 else 1e-4, f"lse ({label})")
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        close(got, want, 2 * tolerance, f"{name} ({label})")


def test_npu_errors():
    q = torch.zeros(10, 2, 16, device=DEVICE, dtype=torch.float16)
    mask = torch.ones(1, 2, 1, 1, dtype=torch.int8, device=DEVICE)
    with pytest.raises(RuntimeError, match="actual_seq_lengths must be specified when q_input_layout is TND"):
        npu.npu_block_sparse_attention(q, q, q, mask, [16, 16], num_key_value_heads=2, actual_seq_lengths_kv=[10])
    with pytest.raises(RuntimeError, match="actual_seq_lengths_kv must be specified when q_input_layout is TND"):
        npu.npu_block_sparse_attention(q, q, q, mask, [16, 16], num_key_value_heads=2, actual_seq_lengths=[10])
    with pytest.raises(TypeError, match="key torch.bfloat16"):
        npu.npu_block_sparse_attention(q, q.bfloat16(), q, mask, [16, 16], num_key_value_heads=2,
                                       actual_seq_lengths=[10], actual_seq_lengths_kv=[10])
    with pytest.raises(ValueError, match="num_key_value_heads"):
        npu.npu_block_sparse_attention(q, q, q, mask, [16, 16], num_key_value_heads=1, actual_seq_lengths=[10],
                                       actual_seq_lengths_kv=[10])
    with pytest.raises(ValueError, match="actual_seq_lengths_kv must sum to the packed token count 10, got 12"):
        npu.npu_block_sparse_attention(q, q, q, mask, [16, 16], num_key_value_heads=2, actual_seq_lengths=[4, 6],
                                       actual_seq_lengths_kv=[6, 6])
    with pytest.raises(ValueError, match="describe the same number of sequences, got 2 and 1"):
        npu.npu_block_sparse_attention(q, q, q, mask, [16, 16], num_key_value_heads=2, actual_seq_lengths=[4, 6],
                                       actual_seq_lengths_kv=[10])
    for block_shape in ([16], [16, 0], [16.5, 16], "ab", None):
        with pytest.raises(ValueError, match=r"block_shape must be two positive integers .* got " +
                           re.escape(repr(block_shape))):
            npu.npu_block_sparse_attention(q, q, q, mask, block_shape, num_key_value_heads=2,
                                           actual_seq_lengths=[10], actual_seq_lengths_kv=[10])
    padded = torch.zeros(2, 2, 10, 16, device=DEVICE, dtype=torch.float16)  # BNSD, batch 2
    for lengths, message in (([10], r"must give one length per batch entry \(2\), got 1"),
                             ([4, 5, 6], r"must give one length per batch entry \(2\), got 3"),
                             ([4, 11], r"must not exceed the sequence length 10, got \[4, 11\]")):
        for name in ("actual_seq_lengths", "actual_seq_lengths_kv"):
            with pytest.raises(ValueError, match=f"{name} {message}"):
                npu.npu_block_sparse_attention(padded, padded, padded, mask, [16, 16], q_input_layout="BNSD",
                                               kv_input_layout="BNSD", num_key_value_heads=2, **{name: lengths})


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fastvideo_variable_block_sizes_against_the_oracle(poisoned, layout):
    tile = fastvideo.BLOCK
    q_tiles, kv_tiles, heads = (3, 4, 2) if ON_GPU else (2, 3, 1)
    sizes = torch.tensor([tile, 100, 1, tile][:kv_tiles], dtype=torch.int32, device=DEVICE)
    q, k, v = (gen_tensor(1, heads, n * tile, DIM, dtype=torch.bfloat16, seed=s)
               for n, s in ((q_tiles, 1), (kv_tiles, 2), (kv_tiles, 3)))
    block_map = torch.rand(heads, q_tiles, kv_tiles, generator=make_generator(6), device=DEVICE) < 0.6
    block_map[:, :, 0] = True
    grad = gen_tensor(1, heads, q_tiles * tile, DIM, dtype=torch.bfloat16, seed=7)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    if layout == "bhsd":
        out, lse = fastvideo.block_sparse_attn_256(*leaves, block_map, sizes)
        out.backward(grad)
    else:
        out, lse = fastvideo.block_sparse_attn_256_bshd(*(t.transpose(1, 2) for t in leaves), block_map, sizes)
        out.backward(grad.transpose(1, 2))
        out = out.transpose(1, 2)
    assert lse.shape == (1, heads, q_tiles * tile)
    valid_keys = (torch.arange(kv_tiles * tile, device=DEVICE) % tile) < sizes.repeat_interleave(tile)
    visible = expand(block_map[None], (tile, tile), q_tiles * tile, kv_tiles * tile) & valid_keys
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want, want_lse = oracle(*ref_leaves, visible)
    want.backward(grad.double())
    close(out, want, 3e-2, "out")
    close(lse, want_lse / math.log(2), 1e-3, "lse (log2)")
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        close(leaf.grad, ref.grad, 6e-2, name)
    padded = ~valid_keys
    assert (leaves[1].grad[:, :, padded] == 0).all() and (leaves[2].grad[:, :, padded] == 0).all(), \
        "padding of a key tile got a gradient"


# ---------------------------------------------------------------- SageAttention

@pytest.mark.parametrize("tensor_layout", ["HND", "NHD"])
@pytest.mark.parametrize("sparse", [False, True])
def test_sageattn_is_the_quantized_forward(tensor_layout, sparse):
    """sageattn (GQA, causal, a given scale, the LSE; a block mask when sparse) equals attention(quant="int8") on
    the same layout, bitwise, and its out comes back in the layout it was given."""
    seq, block = (1000, (128, 64)) if ON_GPU else (150, (32, 16))
    q = gen_tensor(2, 4, seq, DIM, dtype=torch.bfloat16, seed=1)
    k, v = (gen_tensor(2, 2, seq, DIM, dtype=torch.bfloat16, seed=s) for s in (2, 3))
    keep = (torch.rand(2, 4, math.ceil(seq / block[0]), math.ceil(seq / block[1]), generator=make_generator(4),
                       device=DEVICE) < 0.5) if sparse else None
    if tensor_layout == "NHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    extra = dict(blocks=keep, block_size=block) if sparse else {}
    out, lse = sage.sageattn(q, k, v, tensor_layout=tensor_layout, is_causal=True, sm_scale=0.1, return_lse=True,
                             **extra)
    want, want_lse = blockattn.attention(q, k, v, keep, block if sparse else None, scale=0.1, is_causal=True,
                                         layout="bhsd" if tensor_layout == "HND" else "bshd", quant="int8",
                                         return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, seq)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_sageattn_varlen_is_the_packed_quantized_forward():
    lengths = [70, 33, 101]
    cu = torch.tensor([0, 70, 103, 204], dtype=torch.int32, device=DEVICE)
    q, k, v = (gen_tensor(204, 2, DIM, dtype=torch.float16, seed=s) for s in (5, 6, 7))
    out = sage.sageattn_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
    want = blockattn.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, is_causal=True,
                               quant="int8")
    assert torch.equal(out, want)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(tensor_layout="BHSD"), ValueError, "tensor_layout must be"),
    (dict(smooth_k=False), ValueError, "smooth_k=False"),
    (dict(pv_accum_dtype="fp32"), TypeError, "unsupported SageAttention options .'pv_accum_dtype'."),
])
def test_sageattn_refuses_what_it_does_not_do(kwargs, error, message):
    q = gen_tensor(1, 2, 64, DIM, dtype=torch.bfloat16, seed=8)
    with pytest.raises(error, match=message):
        sage.sageattn(q, q, q, **kwargs)


def test_sageattn_refuses_inputs_that_need_gradients():
    q = gen_tensor(1, 2, 64, DIM, dtype=torch.bfloat16, seed=9).requires_grad_(True)
    with pytest.raises(ValueError, match="has no backward"):
        sage.sageattn(q, q.detach(), q.detach())
