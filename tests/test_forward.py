"""Forward: the kernel contract (block mask against the token-expanded mask), every backend against the fp64
oracle, and the features of the semantics (GQA, broadcasts, ragged tails, causal, token masks, odd blocks)."""

import math

import pytest
import torch

import blockattn
from conftest import (DEVICE, ON_GPU, assert_one_ulp, assert_output_and_gradients, check_against_oracle, expand,
                      kernel, make_generator, mostly_whole_kv_valid, oracle, output_and_lse_loss, qkv, randn,
                      random_keep, real_keys)

BACKENDS = ("torch", "triton")


# ---------------------------------------------------------------- kernel contract (pinned tile)

@pytest.mark.parametrize("which", ["ragged", "ragged2", "sub_tile"])
def test_block_mask_matches_the_expanded_token_mask(geometry, pinned, poisoned, which):
    seq = {"ragged": geometry.seqs[0], "ragged2": geometry.seqs[1], "sub_tile": geometry.sub_tile_seq}[which]
    g = geometry
    q, k, v = qkv(g.batch, g.heads, seq, g.dim)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    got = kernel(q, k, v, keep, g.block)
    want = kernel(q, k, v, None, g.block, attn_mask=expand(keep, g.block, seq, seq))
    assert torch.isfinite(got).all()
    assert_one_ulp(got, want, f"seq {seq}")
    assert not torch.equal(got, kernel(q, k, v, None, g.block)), "a 40% block mask left the output dense"


def test_all_ones_block_mask_matches_no_mask(geometry, pinned, poisoned):
    g = geometry
    for seq in (g.seqs[0], g.sub_tile_seq):
        q, k, v = qkv(g.batch, g.heads, seq, g.dim)
        nq, nk = math.ceil(seq / g.block[0]), math.ceil(seq / g.block[1])
        ones = torch.ones(nq, nk, dtype=torch.int8, device=DEVICE)
        assert_one_ulp(kernel(q, k, v, ones, g.block), kernel(q, k, v, None, g.block), f"seq {seq}")
        # and the sub tile past the end did not inflate the softmax: dense truth holds
        check_against_oracle(*kernel(q, k, v, ones, g.block, return_lse=True), q, k, v,
                             torch.ones(seq, seq, dtype=torch.bool, device=DEVICE))


def test_empty_block_row_gives_zeros_and_finite_values_elsewhere(geometry, pinned, poisoned):
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    keep[..., 1, :] = False
    out, lse = kernel(q, k, v, keep, g.block, return_lse=True)
    rows = slice(g.block[0], 2 * g.block[0])
    assert (out[:, :, rows] == 0).all() and torch.isneginf(lse[:, :, rows]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, :g.block[0]]).all()
    assert out[:, :, :g.block[0]].abs().max() > 0
    assert_one_ulp(out, kernel(q, k, v, None, g.block, attn_mask=expand(keep, g.block, seq, seq)))


def test_token_mask_composes_with_the_block_mask_bitwise(geometry, pinned, poisoned):
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    padding = torch.ones(g.batch, 1, seq, seq, dtype=torch.bool, device=DEVICE)
    padding[..., -37:] = False  # trailing keys are padding
    got = kernel(q, k, v, keep, g.block, attn_mask=padding)
    want = kernel(q, k, v, None, g.block, attn_mask=padding & expand(keep, g.block, seq, seq))
    assert torch.equal(got, want), "both arms carry a token mask, so they must agree bitwise"
    assert not torch.equal(got, kernel(q, k, v, keep, g.block)), "the token mask was ignored"


@pytest.mark.parametrize("mask_heads", ["query_heads", "one"])
def test_gqa_block_mask_indexes_query_heads(geometry, pinned, poisoned, mask_heads):
    g = geometry
    seq, heads, kv_heads = g.seqs[0], 2 * g.heads, g.heads // 2
    q, k, v = qkv(g.batch, heads, seq, g.dim, kv_heads=kv_heads)
    keep = random_keep(g.batch, heads if mask_heads == "query_heads" else 1, seq, seq, g.block)
    got = kernel(q, k, v, keep, g.block)
    assert_one_ulp(got, kernel(q, k, v, None, g.block, attn_mask=expand(keep, g.block, seq, seq)))
    check_against_oracle(*kernel(q, k, v, keep, g.block, return_lse=True), q, k, v, expand(keep, g.block, seq, seq))


@pytest.mark.parametrize("mask_shape", [(1, 1), (1, "H"), ("B", 1), ("B", "H")])
def test_block_mask_broadcasts_over_batch_and_heads(geometry, pinned, poisoned, mask_shape):
    g = geometry
    seq, batch = g.seqs[1], max(g.batch, 2)
    q, k, v = qkv(batch, g.heads, seq, g.dim)
    mb = batch if mask_shape[0] == "B" else 1
    mh = g.heads if mask_shape[1] == "H" else 1
    keep = random_keep(mb, mh, seq, seq, g.block)
    assert_one_ulp(kernel(q, k, v, keep, g.block),
                   kernel(q, k, v, None, g.block, attn_mask=expand(keep, g.block, seq, seq)), f"mask {mask_shape}")


def test_bool_int8_uint8_and_3d_masks_agree(geometry, pinned):
    g = geometry
    seq = g.seqs[1]
    q, k, v = qkv(1, g.heads, seq, g.dim)
    keep = random_keep(1, g.heads, seq, seq, g.block)
    want = kernel(q, k, v, keep, g.block)
    for variant in (keep.to(torch.int8), keep.to(torch.uint8) * 7, keep[0]):
        assert torch.equal(kernel(q, k, v, variant, g.block), want)


# ---------------------------------------------------------------- every backend against the fp64 oracle

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_backend_matches_the_oracle(geometry, poisoned, backend, dtype):
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, dtype=dtype, seed=3)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    keep[..., 0, :] = False
    out, lse = blockattn.attention(q, k, v, keep, g.block, backend=backend, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (g.batch, g.heads, seq)
    check_against_oracle(out, lse, q, k, v, expand(keep, g.block, seq, seq))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_batch_gives_empty_results_and_gradients(backend):
    """B=0 (a batch emptied by filtering): out, lse and the gradients come back empty and shaped, dense or with a
    block mask, causal or not."""
    q, k, v = (t.requires_grad_(True) for t in qkv(0, 4, 100, 32, kv_heads=2))
    for blocks in (None, torch.ones(0, 4, 2, 4, dtype=torch.bool, device=DEVICE)):
        for is_causal in (False, True):
            out, lse = blockattn.attention(q, k, v, blocks, (64, 32), is_causal=is_causal, return_lse=True,
                                           backend=backend)
            assert out.shape == (0, 4, 100, 32) and lse.shape == (0, 4, 100)
            grads = torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
            assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["nothing kept", "kept above the diagonal", "packed, no keys"])
def test_a_call_where_no_row_sees_a_key_still_differentiates(backend, case):
    """Every row empty (a batch whose mask keeps nothing visible): out is zeros and LSE -inf, and both still hang
    off q, k and v, so that loss.backward() gives zero gradients instead of failing."""
    gen = torch.Generator().manual_seed(4)
    if case == "packed, no keys":  # the first sequence has queries and no keys, the second keys and no queries
        q, k, v = (torch.randn(tokens, 4, 32, generator=gen).to(DEVICE) for tokens in (70, 90, 90))
        lengths = dict(cu_seqlens_q=torch.tensor([0, 70, 70], dtype=torch.int32, device=DEVICE),
                       cu_seqlens_kv=torch.tensor([0, 0, 90], dtype=torch.int32, device=DEVICE))
        call = dict(blocks=None, layout="thd", **lengths)
    else:
        q, k, v = (torch.randn(2, 4, 100, 32, generator=gen).to(DEVICE) for _ in range(3))
        keep = torch.zeros(2, 4, 4, 4, dtype=torch.bool, device=DEVICE)
        if case == "kept above the diagonal":  # causal: the kept blocks hold no key at or before their queries
            keep[..., 0, 1:] = keep[..., 1, 2:] = keep[..., 2, 3] = True
        call = dict(blocks=keep, block_size=(32, 32), is_causal=case == "kept above the diagonal")
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = blockattn.attention(q, k, v, return_lse=True, backend=backend, **call)
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert out.requires_grad and lse.requires_grad
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k, v))
    assert all(torch.equal(g, torch.zeros_like(t)) for g, t in zip(grads, (q, k, v)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_composes_with_block_and_token_masks(geometry, poisoned, backend):
    g = geometry
    seq_q, seq_kv = g.seqs[0], g.seqs[1]
    q, k, v = qkv(g.batch, g.heads, seq_q, g.dim, seq_kv=seq_kv, seed=4)
    keep = random_keep(g.batch, g.heads, seq_q, seq_kv, g.block, density=0.6)
    token = torch.rand(seq_q, seq_kv, generator=torch.Generator(device=DEVICE).manual_seed(5), device=DEVICE) < 0.9
    out, lse = blockattn.attention(q, k, v, keep, g.block, attn_mask=token, is_causal=True, backend=backend,
                                   return_lse=True)
    check_against_oracle(out, lse, q, k, v, expand(keep, g.block, seq_q, seq_kv) & token, is_causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_with_value_dim_unlike_key_dim(geometry, poisoned, backend):
    g = geometry
    seq_q, seq_kv = g.seqs[1], g.seqs[0] + 17
    q, k, v = qkv(g.batch, g.heads, seq_q, g.dim, seq_kv=seq_kv, dim_v=2 * g.dim, seed=6)
    keep = random_keep(g.batch, g.heads, seq_q, seq_kv, g.block)
    out, lse = blockattn.attention(q, k, v, keep, g.block, backend=backend, return_lse=True, scale=0.3)
    assert out.shape == (g.batch, g.heads, seq_q, 2 * g.dim)
    check_against_oracle(out, lse, q, k, v, expand(keep, g.block, seq_q, seq_kv), scale=0.3)


@pytest.mark.parametrize("head_dim", [16, 72, 96, 160, 256] + ([64, 80, 128, 192] if ON_GPU else []))
def test_head_dims(poisoned, head_dim):
    seq, block = (1000, (128, 64)) if ON_GPU else (97, (32, 32))
    q, k, v = qkv(1, 2, seq, head_dim, seed=head_dim)
    keep = random_keep(1, 2, seq, seq, block)
    out, lse = kernel(q, k, v, keep, block, return_lse=True)
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq, seq))


# Tested per element (40x24, 8x40, 50x30), with four flags per tile (100x100, 72x88: blocks larger than the tiles),
# one flag per query row (8x128, 24x64: key tiles inside a key block), one flag per key (128x8, 64x24: query tiles
# inside a query block), or nested (32x128, 48x80)
ODD_BLOCKS = ([(8, 128), (128, 8), (100, 100), (40, 24), (32, 128), (48, 80)] if ON_GPU
              else [(8, 40), (50, 30), (72, 88), (24, 64), (64, 24)])


@pytest.mark.parametrize("block", ODD_BLOCKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_shapes_no_tile_nests_in(poisoned, block, backend):
    seq_q, seq_kv = (1000, 777) if ON_GPU else (150, 130)
    q, k, v = qkv(2, 2, seq_q, 64 if ON_GPU else 32, seq_kv=seq_kv, seed=7)
    keep = random_keep(2, 2, seq_q, seq_kv, block, density=0.3)
    keep[1, :, 2, :] = False
    out, lse = blockattn.attention(q, k, v, keep, block, backend=backend, return_lse=True)
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_valid_masks_the_padding_of_each_key_block(geometry, poisoned, backend):
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, seed=8)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    nk = math.ceil(seq / g.block[1])
    valid = torch.randint(0, g.block[1] + 1, (g.batch, nk), generator=torch.Generator(device=DEVICE).manual_seed(9),
                          device=DEVICE, dtype=torch.int32)
    out, lse = blockattn.attention(q, k, v, keep, g.block, kv_valid=valid, backend=backend, return_lse=True)
    within = torch.arange(seq, device=DEVICE) % g.block[1]
    token = within[None, :] < valid.repeat_interleave(g.block[1], 1)[:, :seq]  # [B, Sk]
    check_against_oracle(out, lse, q, k, v, expand(keep, g.block, seq, seq) & token[:, None, None, :])


def test_bshd_layout_matches_bhsd(geometry):
    g = geometry
    seq = g.seqs[1]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, seed=10)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    for backend in BACKENDS:
        want = blockattn.attention(q, k, v, keep, g.block, backend=backend)
        got = blockattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep, g.block,
                                  layout="bshd", backend=backend)
        assert torch.equal(got.transpose(1, 2), want), backend


def test_dense_when_blocks_is_none(geometry):
    g = geometry
    seq = g.seqs[1]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, seed=11)
    for backend in BACKENDS:
        out, lse = blockattn.attention(q, k, v, backend=backend, return_lse=True)
        check_against_oracle(out, lse, q, k, v, torch.ones(seq, seq, dtype=torch.bool, device=DEVICE))


def test_prepared_sparsity_gives_the_same_answer_as_the_mask(geometry, pinned):
    g = geometry
    seq = g.seqs[0]
    q, k, v = qkv(g.batch, g.heads, seq, g.dim, seed=12)
    keep = random_keep(g.batch, g.heads, seq, seq, g.block)
    prepared = blockattn.BlockSparsity.from_mask(keep, g.block, seq, seq)
    for backend in BACKENDS:
        assert torch.equal(blockattn.attention(q, k, v, prepared, backend=backend),
                           blockattn.attention(q, k, v, keep, g.block, backend=backend))


# (is_causal, mask): under is_causal a head is whole with the key blocks its causal part reaches, or more; without
# it, with every key block, kv_valid or not
WHOLE_HEAD_MASKS = ([(True, mask) for mask in ("whole", "whole and more", "one head short", "shared")]
                    + [(False, mask) for mask in ("whole", "one head short", "shared", "kv_valid")])


@pytest.mark.parametrize("lse", ["none", "no gradient", "with gradient"])
@pytest.mark.parametrize("causal, mask", WHOLE_HEAD_MASKS)
@pytest.mark.parametrize("seq_kv, block", [(300, (32, 16)), (200, (64, 64)), (420, (48, 32))])
def test_torch_backend_takes_whole_heads_in_one_call(monkeypatch, seq_kv, block, causal, mask, lse):
    """A head whose rows keep every key block (under is_causal, every one their causal part reaches, or more)
    attends over the whole head, all such heads in one call (Sq != Sk top-left aligned, GQA, a mask shared by every
    head, kv_valid); a head whose rows miss one takes the gathered path beside it. Output, LSE and gradients
    against the fp64 oracle, and the calls counted: one whole call of exactly the whole heads, none where the LSE
    must come from the scores (it needs a gradient, which the fused call's LSE does not carry, or no fused kernel
    gives it off the CPU)."""
    from blockattn import reference
    seq_q, batch, heads, kv_heads = 300, 2, 4, 2
    calls = []  # (is_causal, queries' shape) of every attention call

    def spy(original):
        def call(*args, **kwargs):
            calls.append((kwargs.get("is_causal", False), tuple(args[0].shape)))
            return original(*args, **kwargs)
        return call
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        spy(torch.nn.functional.scaled_dot_product_attention))
    if reference._CPU_ATTENTION is not None:
        monkeypatch.setattr(reference, "_CPU_ATTENTION", spy(reference._CPU_ATTENTION))
    nq, nk = math.ceil(seq_q / block[0]), math.ceil(seq_kv / block[1])
    last_query = torch.clamp((torch.arange(nq, device=DEVICE) + 1) * block[0], max=seq_q) - 1
    keep = torch.ones(nq, nk, dtype=torch.bool, device=DEVICE)
    if causal:
        keep = torch.arange(nk, device=DEVICE)[None, :] * block[1] <= last_query[:, None]   # [nq, nk]
    if mask != "shared":
        keep = keep.expand(batch, heads, nq, nk).clone()
    if mask == "whole and more":
        keep |= random_keep(batch, heads, seq_q, seq_kv, block, density=0.3, seed=5)
    if mask == "one head short":
        keep[1, 2, nq - 1, 0] = False                           # its last query block misses key block 0
    kv_valid = None
    if mask == "kv_valid":
        kv_valid = mostly_whole_kv_valid(batch, nk, block[1], seed=6)
        kv_valid[1] = 0                                         # a batch whose rows see no key
    gradient = lse != "no gradient"
    q, k, v = (t.float().requires_grad_(gradient)
               for t in qkv(batch, heads, seq_q, 32, kv_heads=kv_heads, seq_kv=seq_kv, seed=3))
    visible = expand(keep, block, seq_q, seq_kv)
    if kv_valid is not None:
        visible = visible & real_keys(kv_valid, block[1], seq_kv)[:, None, None, :]
    kwargs = dict(is_causal=causal, kv_valid=kv_valid, backend="torch")
    if lse == "none":
        out = blockattn.attention(q, k, v, keep, block, **kwargs)
    else:
        out, got_lse = blockattn.attention(q, k, v, keep, block, return_lse=True, **kwargs)
        check_against_oracle(out, got_lse, q, k, v, visible, is_causal=causal, lse_tolerance=1e-5)
    # a whole call: more than one head (a head of rows that keep everything, alone, is another path's), each
    # with its query heads' whole padded sequences (causal) or its row head's query blocks
    stack = heads // kv_heads if mask == "shared" else 1
    whole_length = nq * block[0] * (1 if causal else stack)
    whole_calls = [shape[0] for is_causal, shape in calls
                   if shape[0] > 1 and shape[2] == whole_length and is_causal == causal]
    # the LSE without a gradient comes from the fused call only where PyTorch has such a kernel (its CPU one)
    fused_lse = lse == "no gradient" and DEVICE.type == "cpu" and reference._CPU_ATTENTION is not None
    if lse != "none" and not fused_lse:
        assert whole_calls == [], calls
    else:
        row_heads = batch * heads // stack - (mask == "one head short")
        assert whole_calls == [row_heads * (stack if causal else 1)], calls
    if gradient:
        grad_out = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(4), device=DEVICE)
        if lse == "with gradient":
            grads = torch.autograd.grad(output_and_lse_loss(out, got_lse, grad_out), (q, k, v))
        else:
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_output_and_gradients(out, grads, q, k, v, visible, grad_out, tolerance=1e-5, is_causal=causal,
                                    through_lse=lse == "with gradient")


@pytest.mark.parametrize("lse", ["none", "with gradient"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_backend_takes_inputs_that_start_off_alignment(causal, lse):
    """fp32 q, k and v that are views into wider rows, starting 3 elements (12 bytes) in, with a mask that keeps
    everything: whole heads and whole rows attend to their kv head's keys where they lie, with no gather, and the
    GPU's memory-efficient kernel (which fp32 with a mask takes) faults on a start off a 16-byte boundary unless
    the backend copies it. Output, LSE and gradients against the fp64 oracle."""
    batch, heads, kv_heads, seq_q, seq_kv, dim, block = 1, 2, 1, 139, 150, 32, (128, 100)
    wide = [randn(batch, h, seq, dim + 8, dtype=torch.float32, gen=make_generator(20 + i))
            for i, (h, seq) in enumerate(((heads, seq_q), (kv_heads, seq_kv), (kv_heads, seq_kv)))]
    q, k, v = (x[..., 3:3 + dim].requires_grad_(lse != "none") for x in wide)
    assert k.storage_offset() * k.element_size() % 16 != 0
    keep = torch.ones(math.ceil(seq_q / block[0]), math.ceil(seq_kv / block[1]), dtype=torch.bool, device=DEVICE)
    visible = expand(keep, block, seq_q, seq_kv)
    if lse == "none":
        out = blockattn.attention(q, k, v, keep, block, is_causal=causal, backend="torch")
        torch.testing.assert_close(out, oracle(q, k, v, visible, is_causal=causal)[0].to(out.dtype),
                                   atol=1e-5, rtol=1e-5)
        return
    out, got_lse = blockattn.attention(q, k, v, keep, block, is_causal=causal, return_lse=True, backend="torch")
    check_against_oracle(out, got_lse, q, k, v, visible, is_causal=causal, lse_tolerance=1e-5)
    grad_out = torch.randn(out.shape, generator=make_generator(23), device=DEVICE)
    grads = torch.autograd.grad(output_and_lse_loss(out, got_lse, grad_out), (q, k, v))
    assert_output_and_gradients(out, grads, q, k, v, visible, grad_out, tolerance=1e-5, is_causal=causal,
                                through_lse=True)


@pytest.mark.parametrize("block, stack", [((32, 32), "per head"), ((64, 32), "per head"), ((32, 64), "shared")])
def test_torch_backend_gathers_no_block_above_the_diagonal(monkeypatch, block, stack):
    """Under is_causal the PyTorch backend walks BlockSparsity.causal()'s lists: a key block that lies wholly past a
    row's last query is never gathered (the causal test would hide all of it), and the result still matches the
    fp64 oracle. Every gather of a chunk's keys is paired with the gather of its query rows (uneven lists: the rows
    are sorted, so their queries are gathered too)."""
    from blockattn import reference
    seq_q, seq_kv, batch, heads = 200, 230, 2, 4
    gathers = []  # (name, index) of every gather

    def spy(table, index, *args, **kwargs):
        gathers.append((kwargs.get("name", args[2] if len(args) > 2 else ""), index.clone()))
        return original(table, index, *args, **kwargs)
    original = reference._gathered
    monkeypatch.setattr(reference, "_gathered", spy)
    kv_heads = heads // 2 if stack == "shared" else heads
    q, k, v = qkv(batch, heads, seq_q, 32, kv_heads=kv_heads, seq_kv=seq_kv, seed=8)
    keep = random_keep(1 if stack == "shared" else batch, 1 if stack == "shared" else heads, seq_q, seq_kv, block,
                       density=0.6, seed=9)
    out, lse = blockattn.attention(q, k, v, keep, block, is_causal=True, return_lse=True, backend="torch")
    check_against_oracle(out, lse, q, k, v, expand(keep, block, seq_q, seq_kv), is_causal=True)
    nq, nk = math.ceil(seq_q / block[0]), math.ceil(seq_kv / block[1])
    keys = [index for name, index in gathers if name == "k"]
    rows = [index for name, index in gathers if name == "q"]
    assert keys and len(keys) == len(rows)
    for kv_rows, here in zip(keys, rows):
        last_query = torch.clamp((here % nq + 1) * block[0], max=seq_q) - 1                  # [n]
        assert ((kv_rows % nk) * block[1] <= last_query[:, None]).all()


def test_torch_backend_chunks_rows_by_list_length():
    """reference._chunks: rows sorted by list length go in chunks of like lengths (within _LENGTH_SPREAD of the
    first, plus one), empty rows apart, as many rows as the scores' budget allows (one at least)."""
    from blockattn import reference
    lengths = [0, 0, 1, 2, 2, 3, 8, 9, 10, 11, 40]
    assert reference._chunks(lengths, 1, 10 ** 6) == [(0, 2, 0), (2, 5, 2), (5, 6, 3), (6, 9, 10), (9, 10, 11),
                                                      (10, 11, 40)]
    assert reference._chunks(lengths, 1, 20) == [(0, 2, 0), (2, 5, 2), (5, 6, 3), (6, 8, 9), (8, 9, 10),
                                                 (9, 10, 11), (10, 11, 40)]
    assert reference._chunks(lengths, 100, 1) == [(0, 2, 0)] + [(i, i + 1, n) for i, n in enumerate(lengths)][2:]
    assert reference._chunks([], 1, 1) == []


@pytest.mark.parametrize("autograd", ["on", "off", "off, no fused LSE"])
@pytest.mark.parametrize("mask_heads", ["per head", "shared"])
@pytest.mark.parametrize("budget", ["default", "one row"])
@pytest.mark.parametrize("tests", ["none", "causal, token mask, kv_valid"])
@pytest.mark.parametrize("lists", ["skewed", "even"])
def test_torch_backend_on_a_skewed_mask(monkeypatch, budget, tests, lists, mask_heads, autograd):
    """The PyTorch backend on lists of every length at once (query blocks that keep everything, most little, some
    nothing; GQA, a ragged last block), its rows taken in chunks of like lengths, also one row a chunk; and on
    lists all as long (every block kept: the rows stay in place): output, LSE and gradients against the fp64
    oracle. A mask shared by every head stacks each kv head's group of query heads into one row (with a token mask
    unlike between the heads); without autograd the chunks gather into reused memory and the LSE comes from the
    fused kernel (or from the scores, where PyTorch has no such kernel)."""
    from blockattn import reference
    if autograd == "off, no fused LSE":
        monkeypatch.setattr(reference, "_CPU_ATTENTION", None)
    if budget == "one row":
        monkeypatch.setattr(reference, "_CHUNK_BYTES", 1)
        monkeypatch.setattr(reference, "_CPU_CHUNK_BYTES", 1)
    seq, block = 300, (32, 16)
    q, k, v = (t.float().requires_grad_(autograd == "on") for t in qkv(2, 4, seq, 32, kv_heads=2, seed=11))
    keep = random_keep(2, 4, seq, seq, block, density=0.1, seed=12)
    if mask_heads == "shared":
        keep = keep[0, 0]
    keep[..., :2, :] = True                                 # two query blocks keep every key block
    keep[..., 3:5, :] = False                               # two keep none
    if lists == "even":
        keep[:] = True
    visible = expand(keep, block, seq, seq)
    options = {}
    if tests != "none":
        gen = torch.Generator(device=DEVICE).manual_seed(13)
        token = torch.rand(4, seq, seq, generator=gen, device=DEVICE) < 0.9
        valid = torch.randint(0, block[1] + 1, (2, math.ceil(seq / block[1])), generator=gen, device=DEVICE,
                              dtype=torch.int32)
        within = torch.arange(seq, device=DEVICE) % block[1]
        real = within[None, :] < valid.repeat_interleave(block[1], 1)[:, :seq]
        options = dict(attn_mask=token, is_causal=True, kv_valid=valid)
        visible = visible & token & real[:, None, None, :]
    out, lse = blockattn.attention(q, k, v, keep, block, backend="torch", return_lse=True, **options)
    check_against_oracle(out, lse, q, k, v, visible, is_causal=tests != "none", lse_tolerance=1e-5)
    if autograd != "on":
        assert not out.requires_grad and not lse.requires_grad
        return
    grad_out = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(14), device=DEVICE)
    grads = torch.autograd.grad(output_and_lse_loss(out, lse, grad_out), (q, k, v))
    assert_output_and_gradients(out, grads, q, k, v, visible, grad_out, tolerance=1e-5, is_causal=tests != "none",
                                through_lse=True)
