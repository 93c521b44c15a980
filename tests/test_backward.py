"""Backward: gradients through the kernels against the token-mask arm, fp32 autograd and the fp64 oracle; exact
zeros where nothing was kept; determinism; the explicit backward function; the PyTorch backend's autograd."""

import math

import pytest
import torch
import torch.nn.functional as F

import blockattn
from blockattn.kernels import backward, tma
from conftest import DEVICE, ON_GPU, assert_one_ulp, expand, oracle, qkv, random_keep


def upstream(shape, dtype, seed=17):
    return torch.randn(shape, generator=torch.Generator(device=DEVICE).manual_seed(seed), device=DEVICE).to(dtype)


def grads(q, k, v, blocks=None, block_size=None, grad_out=None, lse_weight=0.0, attention=blockattn.attention,
          **kwargs):
    """(out, dq, dk, dv) of sum(out * grad_out) (+ lse_weight * sum(lse)), through attention (e.g. compiled)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention(*leaves, blocks, block_size, return_lse=True, **kwargs)
    grad_out = upstream(out.shape, out.dtype) if grad_out is None else grad_out
    loss = (out.float() * grad_out.float()).sum()
    if lse_weight:
        loss = loss + lse_weight * torch.where(torch.isinf(lse), 0, lse).sum()
    loss.backward()
    return (out.detach(),) + tuple(t.grad for t in leaves)


def oracle_grads(q, k, v, visible, grad_out, **kwargs):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out, _ = oracle(*leaves, visible, **kwargs)
    out.backward(grad_out.double())
    return [t.grad for t in leaves]


def assert_grads_close(got, want, tolerance, label):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{label} {name} not finite"
        scale = w.abs().max().item()
        gap = (g.double() - w.double()).abs().max().item()
        assert gap <= tolerance * scale, f"{label} {name}: gap {gap:.3e} is {gap / scale:.2%} of scale {scale:.3e}"


@pytest.mark.parametrize("which", ["ragged", "sub_tile"])
def test_backward_matches_the_expanded_token_mask(geometry, pinned, poisoned, which):
    g = geometry
    seq = g.seqs[0] if which == "ragged" else g.sub_tile_seq
    q, k, v = qkv(g.batch, g.heads, seq, g.dim)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    block = grads(q, k, v, keep, g.block, backend="triton")
    token = grads(q, k, v, None, g.block, attn_mask=expand(keep, g.block, seq, seq), backend="triton")
    dense = grads(q, k, v, None, g.block, backend="triton")
    for name, got, want, other in zip(("out", "dq", "dk", "dv"), block, token, dense):
        assert torch.isfinite(got).all(), f"{name} not finite"
        assert_one_ulp(got, want, f"seq {seq} {name}")
        assert not torch.equal(got, other), f"{name} equals the dense result: the mask never reached it"


BLOCKS = [(128, 128), (128, 64), (64, 64), (64, 128)]
# D=256 at one block shape: an fp32 (IEEE) kernel's products run on the FMA units, and at D=256 each tile takes
# ptxas up to a minute to compile; every block shape at D=256 would be most of a cold GPU suite's time.
FP32_CASES = [(dim, block) for dim in (64, 128) for block in BLOCKS] + [(256, (128, 64))]


@pytest.mark.parametrize("head_dim, block", FP32_CASES)
@pytest.mark.parametrize("group", [1, 4])
def test_fp32_backward_matches_autograd_through_sdpa(poisoned, head_dim, block, group):
    """Within 0.5% of the gradient scale of PyTorch autograd through fp32 SDPA on the same selection."""
    batch, kv_heads, seq = (2, 2, 1000) if ON_GPU else (1, 1, 200)
    heads = kv_heads * group
    q, k, v = qkv(batch, heads, seq, head_dim, kv_heads=kv_heads, dtype=torch.float32, seed=head_dim + group)
    keep = random_keep(batch, heads, seq, seq, block)
    grad_out = upstream((batch, heads, seq, head_dim), torch.float32)
    _, *got = grads(q, k, v, keep, block, grad_out=grad_out, backend="triton")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(group, 1),
                                             leaves[2].repeat_interleave(group, 1),
                                             attn_mask=expand(keep, block, seq, seq))
    ref_out.backward(grad_out)
    assert_grads_close(got, [t.grad for t in leaves], 5e-3, f"D{head_dim} {block} group {group}")


@pytest.mark.parametrize("switch, off, on", [("allow_tf32", False, True), ("fp32_precision", "ieee", "tf32")])
def test_fp32_products_follow_pytorchs_tf32_switch(geometry, poisoned, monkeypatch, switch, off, on):
    """fp32 inputs multiply in IEEE fp32 unless PyTorch allows tf32 for CUDA matmuls, through either of its
    switches (reading allow_tf32 raises once fp32_precision was set), and the switch takes effect between calls
    (the launch plans key on it). The interpreter ignores the precision, so only the GPU shows tf32's rounding."""
    if switch == "fp32_precision" and not hasattr(torch.backends.cuda.matmul, switch):
        pytest.skip("this PyTorch predates torch.backends.cuda.matmul.fp32_precision")
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, dtype=torch.float32, seed=5)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    grad_out = upstream((g.batch, g.heads, seq, g.dim), torch.float32)
    visible = expand(keep, g.block, seq, seq)
    want = [oracle(q, k, v, visible)[0]] + oracle_grads(q, k, v, visible, grad_out)

    def gaps(got):
        return [((a.double() - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want)]
    runs = {}
    for label, value in (("ieee", off), ("tf32", on), ("ieee again", off)):
        monkeypatch.setattr(torch.backends.cuda.matmul, switch, value)
        runs[label] = grads(q, k, v, keep, g.block, grad_out=grad_out, backend="triton")
    assert max(gaps(runs["ieee"])) <= 1e-4, f"IEEE fp32 off the oracle: {gaps(runs['ieee'])}"
    assert max(gaps(runs["tf32"])) <= 1e-2, f"tf32 off the oracle: {gaps(runs['tf32'])}"
    for name, first, again in zip(("out", "dq", "dk", "dv"), runs["ieee"], runs["ieee again"]):
        assert torch.equal(first, again), f"{name}: switching tf32 off did not restore the IEEE result"
    if ON_GPU:
        assert min(gaps(runs["tf32"])) > 10 * max(gaps(runs["ieee"])), (
            f"allow_tf32 left the products in IEEE fp32: gaps {gaps(runs['tf32'])} against {gaps(runs['ieee'])}")


@pytest.mark.parametrize("backend, compiled", [("torch", False), ("triton", False), ("triton", True)])
def test_training_after_calls_under_inference_mode(geometry, pinned, deterministic, backend, compiled):
    """A validation pass under torch.inference_mode, which builds lists (and fills blockattn's own cache of dense
    lists and the causal lists derived from them) there, does not break the training steps after it, eager or
    compiled: their gradients equal those the same call computes on lists built outside it. Bitwise, so the tiles
    are pinned and the algorithms deterministic (the GPU's fused SDPA); and compiled is compared with compiled,
    because a compiled graph hands the backward a zero LSE gradient, which compiles a different (equally exact)
    dQ kernel than eager's None."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, seed=9)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    dense = torch.ones_like(keep)
    with torch.inference_mode():
        built_there = blockattn.BlockSparsity.from_mask(keep, g.block, seq, seq)
        for blocks, block_size in ((built_there, None), (None, g.block)):
            blockattn.attention(q, k, v, blocks, block_size, is_causal=True, backend=backend)
    attention = torch.compile(blockattn.attention, fullgraph=True) if compiled else blockattn.attention
    for blocks, block_size, mask in ((built_there, None, keep), (None, g.block, dense)):
        built_here = blockattn.BlockSparsity.from_mask(mask, g.block, seq, seq)
        got = grads(q, k, v, blocks, block_size, is_causal=True, backend=backend, attention=attention)
        want = grads(q, k, v, built_here, None, is_causal=True, backend=backend, attention=attention)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"{name} differs after the inference-mode pass (blocks={blocks is not None})"


@pytest.mark.parametrize("backend, compiled", [("torch", False), ("triton", False), ("triton", True)])
def test_autocast_runs_fp32_inputs_in_its_dtype(geometry, pinned, deterministic, backend, compiled):
    """Under torch.autocast, fp32 q, k, v run in the autocast dtype, as scaled_dot_product_attention does there: the
    output is bf16 and equals, bitwise, the same call on inputs cast beforehand outside autocast (so the PyTorch
    backend's own products are not downcast as well); the fp32 leaves get that call's gradients, cast up."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, dtype=torch.float32, seed=11)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    attention = torch.compile(blockattn.attention, fullgraph=True) if compiled else blockattn.attention
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = grads(q, k, v, keep, g.block, is_causal=True, backend=backend, attention=attention)
    want = grads(*(t.to(torch.bfloat16) for t in (q, k, v)), keep, g.block, is_causal=True, backend=backend,
                 attention=attention)
    assert got[0].dtype == torch.bfloat16, f"autocast left the output in {got[0].dtype}"
    assert torch.equal(got[0], want[0]), "out under autocast differs from the call on inputs cast beforehand"
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert a.dtype == torch.float32, f"{name} came back in {a.dtype}, not the leaf's fp32"
        assert torch.equal(a, b.float()), f"{name} under autocast differs from the cast call's, cast up"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_explicit_backward_under_autocast_matches_the_forwards_cast(geometry, pinned, deterministic, backend):
    """attention_backward under autocast casts q, k, v as the forward did and returns gradients in their dtypes:
    fp32 here, equal to the bf16 call's cast up."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, dtype=torch.float32, seed=12)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    grad_out = upstream((g.batch, g.heads, seq, g.dim), torch.bfloat16)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out, lse = blockattn.attention(q, k, v, keep, g.block, return_lse=True, backend=backend)
        got = blockattn.attention_backward(grad_out, q, k, v, out, lse, keep, g.block, backend=backend)
    want = blockattn.attention_backward(grad_out, *(t.to(torch.bfloat16) for t in (q, k, v)), out, lse, keep,
                                        g.block, backend=backend)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32, f"{name} came back in {a.dtype}"
        assert torch.equal(a, b.float()), f"{name} under autocast differs from the cast call's"


@pytest.mark.parametrize("compiled", [False, True])
def test_a_second_order_gradient_raises_instead_of_dropping_attention(geometry, compiled):
    """The Triton backward is not itself differentiable. A gradient penalty that differentiates through dq (with
    create_graph=True) must raise, not return a result that silently leaves out attention's second-order share
    (here the penalty also has a path around attention, so without the guard backward() would succeed)."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = (t.requires_grad_(True) for t in qkv(g.batch, g.heads, seq, g.dim, dtype=torch.float32, seed=14))
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    attention = torch.compile(blockattn.attention, fullgraph=True) if compiled else blockattn.attention
    out = attention(q, k, v, keep, g.block, backend="triton")
    dq, = torch.autograd.grad((out * out).sum(), q, create_graph=True)
    penalty = (dq * dq).sum() + (q * q).sum()
    with pytest.raises(RuntimeError, match="differentiate twice|double backward"):
        penalty.backward()


def test_autocast_leaves_fp64_inputs_alone(geometry):
    """fp64 is not an autocast dtype (PyTorch's autocast does not cast it); the PyTorch backend computes in it."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, dtype=torch.float64, seed=13)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = blockattn.attention(q, k, v, keep, g.block, backend="torch")
    assert out.dtype == torch.float64
    want, _ = oracle(q, k, v, expand(keep, g.block, seq, seq))
    assert (out - want).abs().max() <= 1e-10 * want.abs().max()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dropped_blocks_get_exactly_zero_gradients(geometry, poisoned, backend):
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, 2 * g.heads, seq, g.dim, kv_heads=g.heads)
    keep = random_keep(g.batch, 1, seq, seq, g.block)
    keep[..., 1, :] = False  # query block 1 sees nothing
    keep[..., :, 2] = False  # key block 2 is seen by nobody
    _, dq, dk, dv = grads(q, k, v, keep, g.block, backend=backend)
    rows, keys = slice(g.block[0], 2 * g.block[0]), slice(2 * g.block[1], 3 * g.block[1])
    assert (dq[:, :, rows] == 0).all(), "an empty query block got a gradient"
    assert (dk[:, :, keys] == 0).all() and (dv[:, :, keys] == 0).all(), "a dropped key block got a gradient"
    assert dq[:, :, :g.block[0]].abs().max() > 0 and dk[:, :, :g.block[1]].abs().max() > 0


# The dQ modes this machine runs for real ("tma" needs a Hopper GPU and compiled Triton).
ACCUMULATING_MODES = ["atomic"] + (["tma"] if ON_GPU and tma.reductions_available(
    backward.attention_bwd_dkdv_kernel, torch.device(DEVICE)) else [])


@pytest.mark.parametrize("dq_mode", backward.DQ_MODES + ("auto",))
def test_gqa_gradients_are_bitwise_repeatable_in_deterministic_mode(geometry, monkeypatch, deterministic, dq_mode):
    """With deterministic algorithms asked for, dQ never uses atomics, so two runs agree bitwise."""
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", dq_mode)
    g = geometry
    seq = g.seqs[1]
    q, k, v = qkv(g.batch, 2 * g.heads, seq, g.dim, kv_heads=g.heads // 2)
    keep = random_keep(g.batch, 2 * g.heads, seq, seq, g.block)
    first = grads(q, k, v, keep, g.block, backend="triton")
    second = grads(q, k, v, keep, g.block, backend="triton")
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two identical backward runs differ"


@pytest.mark.parametrize("dq_mode", ACCUMULATING_MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_accumulated_dq_matches_the_dq_kernel(geometry, pinned, poisoned, monkeypatch, dq_mode, packed):
    """dQ accumulated in the dK/dV kernel against the dQ kernel: the same sums in another order, with GQA,
    causal, a token mask (padded batch) or a packed batch of uneven sequences, and an empty query block."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, 2 * g.heads, seq, g.dim, kv_heads=g.heads // 2, dtype=torch.float32, seed=9)
    keep = random_keep(g.batch, 2 * g.heads, seq, seq, g.block)
    keep[..., 1, :] = False
    if packed:  # sequences of seq and seq - 37 tokens, packed token-major
        lengths = torch.tensor([seq, seq - 37], device=DEVICE)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        q, k, v = (torch.cat([t[0, :, :seq], t[-1, :, :seq - 37]], 1).transpose(0, 1).contiguous() for t in (q, k, v))
        kwargs = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, is_causal=True)
        keep = keep[[0, -1]]
    else:
        token = torch.rand(seq, seq, generator=torch.Generator(device=DEVICE).manual_seed(4), device=DEVICE) < 0.9
        kwargs = dict(attn_mask=token, is_causal=True)
    runs = {}
    for mode in ("kernel", dq_mode):
        monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", mode)
        runs[mode] = grads(q, k, v, keep, g.block, backend="triton", **kwargs)
    rows = (slice(None), slice(g.block[0], 2 * g.block[0])) if packed else (slice(None), slice(None),
                                                                           slice(g.block[0], 2 * g.block[0]))
    assert (runs[dq_mode][1][rows] == 0).all(), "an empty query block got a gradient"
    assert_grads_close(runs[dq_mode][1:], runs["kernel"][1:], 1e-5, f"{dq_mode} dq")


@pytest.mark.parametrize("dq_mode", ACCUMULATING_MODES)
def test_accumulated_dq_with_head_dims_off_the_tile(geometry, poisoned, monkeypatch, dq_mode):
    """Q/K head dims narrower than their tile (40 in 64, then 72 in 128) with a 24-wide V: the accumulator the
    preprocess zeroes is as wide as the tile, dq takes only its first D columns, and two calls whose O has one shape
    but whose accumulators differ do not share a launch plan. Against the dQ kernel, NaN-poisoned buffers."""
    g = geometry
    seq = g.seqs[1]
    keep = random_keep(1, g.heads, seq, seq, g.block)
    for dim in (40, 72):
        q, k, v = qkv(1, g.heads, seq, dim, dim_v=24, dtype=torch.float32, seed=dim)
        runs = {}
        for mode in ("kernel", dq_mode):
            monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", mode)
            runs[mode] = grads(q, k, v, keep, g.block, backend="triton")
        assert runs[dq_mode][1].shape == q.shape
        assert_grads_close(runs[dq_mode][1:], runs["kernel"][1:], 1e-5, f"{dq_mode} D={dim}")


def test_dq_mode_is_checked():
    device = torch.device(DEVICE)
    with pytest.raises(ValueError, match="dq_mode"):
        backward.resolve_dq_mode("fast", backward.attention_bwd_dkdv_kernel, device)
    if "tma" not in ACCUMULATING_MODES:
        with pytest.raises(ValueError, match="tma"):
            backward.resolve_dq_mode("tma", backward.attention_bwd_dkdv_kernel, device)
    assert backward.resolve_dq_mode(None, backward.attention_bwd_dkdv_kernel, device) in backward.DQ_MODES
    assert backward.resolve_dq_mode("auto", backward.attention_bwd_dkdv_kernel, device) == "kernel"
    assert backward.resolve_dq_mode("atomic", backward.attention_bwd_dkdv_kernel, device) == "atomic"


FEATURES = {
    "causal_token_mask": dict(is_causal=True, token=True),
    "cross_dv": dict(cross=True),
    "kv_valid": dict(kv_valid=True),
    "odd_block": dict(block=(8, 40) if not ON_GPU else (40, 24)),  # the block mask tested per element
    "odd_block_spans": dict(block=(72, 88) if not ON_GPU else (100, 100)),  # four flags per tile
    "odd_block_rows": dict(block=(24, 64) if not ON_GPU else (8, 128)),  # one flag per query row
    "odd_block_columns": dict(block=(64, 24) if not ON_GPU else (128, 8)),  # one flag per key
    "gqa_broadcast": dict(gqa=True),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_match_the_fp64_oracle(geometry, poisoned, feature, backend):
    """Every forward feature reaches the backward: gradients within 1% of the fp64 oracle's scale in bf16-free
    fp32 arithmetic (the kernels use full fp32 dots unless PyTorch allows tf32)."""
    g = geometry
    spec = FEATURES[feature]
    block = spec.get("block", g.block)
    seq_q = g.seqs[0]
    seq_kv = g.seqs[1] if spec.get("cross") else seq_q
    heads, kv_heads = (2 * g.heads, g.heads // 2) if spec.get("gqa") else (g.heads, g.heads)
    dim_v = 2 * g.dim if spec.get("cross") else g.dim
    q, k, v = qkv(g.batch, heads, seq_q, g.dim, kv_heads=kv_heads, seq_kv=seq_kv, dim_v=dim_v,
                  dtype=torch.float32, seed=21)
    keep = random_keep(1 if spec.get("gqa") else g.batch, 1 if spec.get("gqa") else heads, seq_q, seq_kv, block)
    visible = expand(keep, block, seq_q, seq_kv)
    kwargs = {}
    if spec.get("token"):
        token = torch.rand(seq_q, seq_kv, generator=torch.Generator(device=DEVICE).manual_seed(2), device=DEVICE) < 0.8
        kwargs["attn_mask"] = token
        visible = visible & token
    if spec.get("kv_valid"):
        nk = math.ceil(seq_kv / block[1])
        valid = torch.randint(0, block[1] + 1, (nk,), generator=torch.Generator(device=DEVICE).manual_seed(3),
                              device=DEVICE, dtype=torch.int32)
        kwargs["kv_valid"] = valid
        visible = visible & ((torch.arange(seq_kv, device=DEVICE) % block[1]) <
                             valid.repeat_interleave(block[1])[:seq_kv])
    is_causal = spec.get("is_causal", False)
    grad_out = upstream((g.batch, heads, seq_q, dim_v), torch.float32)
    _, *got = grads(q, k, v, keep, block, grad_out=grad_out, is_causal=is_causal, backend=backend, **kwargs)
    want = oracle_grads(q, k, v, visible, grad_out, is_causal=is_causal)
    assert_grads_close(got, want, 1e-2, feature)


def test_gradient_through_lse_matches_the_torch_backend(geometry):
    g = geometry
    seq = g.seqs[1]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, dtype=torch.float32, seed=5)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    keep[..., 0, :] = False
    _, *got = grads(q, k, v, keep, g.block, lse_weight=0.7, backend="triton")
    _, *want = grads(q, k, v, keep, g.block, lse_weight=0.7, backend="torch")
    assert_grads_close(got, want, 1e-3, "lse")


def test_gradient_through_lse_alone(geometry):
    """A loss of the LSE only: the output's gradient never arrives (autograd passes None), and the kernels' result
    still matches the PyTorch backend's."""
    g = geometry
    seq = g.seqs[1]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, dtype=torch.float32, seed=8)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    keep[..., 0, :] = False
    results = {}
    for backend in ("triton", "torch"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        _, lse = blockattn.attention(*leaves, keep, g.block, return_lse=True, backend=backend)
        torch.where(torch.isinf(lse), 0, lse).sum().backward()
        results[backend] = [t.grad for t in leaves]
    assert_grads_close(results["triton"][:2], results["torch"][:2], 1e-3, "lse only")
    # V does not reach the LSE: PyTorch leaves its gradient None, the kernels write exact zeros.
    assert results["torch"][2] is None and torch.equal(results["triton"][2], torch.zeros_like(v))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_explicit_backward_from_saved_output_and_lse(geometry, poisoned, backend):
    """The forward's out and LSE handed to attention_backward give autograd's gradients."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, kv_heads=g.heads // 2, seed=6)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    grad_out = upstream((g.batch, g.heads, seq, g.dim), q.dtype)
    out, *auto = grads(q, k, v, keep, g.block, grad_out=grad_out, is_causal=True, backend=backend)
    out, lse = blockattn.attention(q, k, v, keep, g.block, is_causal=True, return_lse=True, backend=backend)
    explicit = blockattn.attention_backward(grad_out, q, k, v, out, lse, keep, g.block, is_causal=True,
                                            backend=backend)
    for name, a, b in zip(("dq", "dk", "dv"), explicit, auto):
        assert a.shape == b.shape
        assert_one_ulp(a, b, name)


def test_gradcheck_torch_backend_fp64():
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 13, 16, kv_heads=1, seq_kv=11, dtype=torch.float64))
    keep = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool, device=DEVICE)
    token = torch.rand(13, 11, generator=torch.Generator(device=DEVICE).manual_seed(0), device=DEVICE) < 0.8

    def fn(q, k, v):
        return blockattn.attention(q, k, v, keep, (8, 4), attn_mask=token, backend="torch")

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("trainable", ["q", "k", "v", "kv", "qv"])
def test_frozen_inputs_skip_their_kernels_and_the_rest_match_the_oracle(geometry, poisoned, launched_kernels,
                                                                         trainable):
    """Only the gradients autograd asks for are computed: a frozen query skips the dQ kernel (the preprocess then
    computes the row terms), frozen keys and values skip the dK/dV kernel. The asked-for gradients, of a loss on
    the output and the LSE, match the fp64 oracle; frozen leaves get none."""
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, kv_heads=g.heads // 2, dtype=torch.float32, seed=21)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    keep[..., 1, :] = False  # a query block that sees nothing
    leaves = [t.detach().clone().requires_grad_(name in trainable) for name, t in zip("qkv", (q, k, v))]
    out, lse = blockattn.attention(*leaves, keep, g.block, return_lse=True, backend="triton")
    grad_out = upstream(out.shape, out.dtype)
    ((out * grad_out).sum() + 0.3 * torch.where(torch.isinf(lse), 0, lse).sum()).backward()

    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = oracle(*ref, expand(keep, g.block, seq, seq))
    ((ref_out * grad_out.double()).sum() + 0.3 * torch.where(torch.isinf(ref_lse), 0, ref_lse).sum()).backward()
    for name, leaf, want in zip("qkv", leaves, ref):
        if name not in trainable:
            assert leaf.grad is None, f"frozen {name} got a gradient"
            continue
        assert torch.isfinite(leaf.grad).all(), f"d{name} not finite"
        gap, scale = (leaf.grad.double() - want.grad).abs().max().item(), want.grad.abs().max().item()
        assert gap <= 1e-3 * scale, f"trainable {trainable}: d{name} off the oracle by {gap / scale:.2%} of its scale"
    assert (backward.attention_bwd_dq_kernel in launched_kernels) == ("q" in trainable)
    assert (backward.attention_bwd_dkdv_kernel in launched_kernels) == any(name in trainable for name in "kv")
    assert (backward.attention_bwd_preprocess_kernel in launched_kernels) == ("q" not in trainable)
