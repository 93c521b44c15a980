"""Scored block selection: the budget, the diagonal, pins and drops, determinism, GQA and head sharing, ragged
tails, the mass mode, and an error against dense attention that falls as the budget rises on structured inputs."""

import math

import pytest
import torch

import blockattn
from blockattn import select_blocks
from blockattn.select import block_means
from conftest import DEVICE, ON_GPU, make_generator, oracle, qkv, rel_error

SEQ_Q, SEQ_KV, BLOCK = (2000, 1800, (128, 64)) if ON_GPU else (300, 270, (64, 32))


def structured(batch=1, heads=2, kv_heads=1, dim=32, clusters=6, seed=0):
    """Queries and keys drawn around a few cluster centres, one centre per block (as neighbouring tokens of a
    video or a document share content): attention has real structure (a query block cares about the key blocks
    of its cluster), unlike white noise."""
    gen = make_generator(seed)
    centres = 1.5 * torch.randn(clusters, dim, generator=gen, device=DEVICE)
    nk = math.ceil(SEQ_KV / BLOCK[1])
    key_cluster = torch.randint(0, clusters, (nk,), generator=gen, device=DEVICE).repeat_interleave(BLOCK[1])[:SEQ_KV]
    nq = math.ceil(SEQ_Q / BLOCK[0])
    query_cluster = torch.randint(0, clusters, (nq,), generator=gen, device=DEVICE).repeat_interleave(BLOCK[0])[:SEQ_Q]
    noise = lambda *s: 0.5 * torch.randn(*s, generator=gen, device=DEVICE)  # noqa: E731
    q = centres[query_cluster] + noise(batch, heads, SEQ_Q, dim)
    k = centres[key_cluster] + noise(batch, kv_heads, SEQ_KV, dim)
    v = torch.randn(batch, kv_heads, SEQ_KV, dim, generator=gen, device=DEVICE)
    return q, k, v


def test_budget_per_row_diagonal_and_no_empty_rows():
    q, k, _ = structured()
    nk = math.ceil(SEQ_KV / BLOCK[1])
    for budget in (0.05, 0.25, 0.6):
        sel = select_blocks(q, k, budget, BLOCK)
        kept = sel.mask.sum(-1)
        nq = sel.num_blocks[0]
        q_first = torch.arange(nq, device=DEVICE) * BLOCK[0]
        q_last = torch.clamp(q_first + BLOCK[0], max=SEQ_Q) - 1
        k_first = torch.arange(nk, device=DEVICE) * BLOCK[1]
        k_last = torch.clamp(k_first + BLOCK[1], max=SEQ_KV) - 1
        diagonal = (k_first[None] <= q_last[:, None]) & (q_first[:, None] <= k_last[None])
        assert (sel.mask | ~diagonal).all(), "a diagonal block was dropped"
        assert (kept <= math.ceil(budget * nk) + diagonal.sum(-1)).all(), "the budget was exceeded"
        assert (kept >= math.ceil(budget * nk)).all() and (kept > 0).all()
        no_diagonal = select_blocks(q, k, budget, BLOCK, keep_diagonal=False)
        assert (no_diagonal.mask.sum(-1) == math.ceil(budget * nk)).all()


def test_the_best_blocks_are_kept_with_ties_to_the_lower_index():
    q = torch.ones(1, 1, 4 * 16, 16, device=DEVICE)
    k = torch.ones(1, 1, 8 * 16, 16, device=DEVICE)  # every score ties
    sel = select_blocks(q, k, 0.25, (16, 16), keep_diagonal=False)
    want = torch.zeros(4, 8, dtype=torch.bool, device=DEVICE)
    want[:, :2] = True
    assert torch.equal(sel.mask[0, 0], want)
    k[:, :, 16 * 5:16 * 6] *= 3  # block 5 now scores highest for every query
    sel = select_blocks(q, k, 0.25, (16, 16), keep_diagonal=False)
    assert sel.mask[0, 0, :, 5].all() and sel.mask[0, 0, :, 0].all() and sel.mask.sum() == 8


def test_pins_and_drops():
    q, k, _ = structured()
    nq, nk = math.ceil(SEQ_Q / BLOCK[0]), math.ceil(SEQ_KV / BLOCK[1])
    pins = torch.zeros(nq, nk, dtype=torch.bool, device=DEVICE)
    pins[:, -1] = True
    drops = torch.zeros(nq, nk, dtype=torch.bool, device=DEVICE)
    drops[:, 0] = True
    drops[1, :] = True
    drops[1, 3] = False  # row 1 keeps only block 3 allowed
    sel = select_blocks(q, k, 0.25, BLOCK, pins=pins, drops=drops)
    assert sel.mask[..., :, -1][..., [r for r in range(nq) if r != 1]].all(), "a pin was not kept"
    assert not sel.mask[..., :, 0].any(), "a dropped block was kept"
    assert torch.equal(sel.mask[0, :, 1].nonzero()[:, -1].unique(), torch.tensor([3], device=DEVICE)), \
        "the emptied row did not get its best allowed block"
    assert (sel.mask.sum(-1) > 0).all()


def test_deterministic_gqa_and_head_shared_shapes():
    q, k, _ = structured(batch=2, heads=4, kv_heads=2)
    first, second = select_blocks(q, k, 0.3, BLOCK), select_blocks(q, k, 0.3, BLOCK)
    assert torch.equal(first.mask, second.mask) and first.mask.shape[:2] == (2, 4)
    shared = select_blocks(q, k, 0.3, BLOCK, head_shared=True)
    assert shared.mask.shape[:2] == (2, 1)


def test_ragged_last_block_is_pooled_over_its_real_tokens():
    """A last key block with one real token must score that token's direction, not one diluted by padding."""
    dim = 16
    q = torch.zeros(1, 1, 16, dim, device=DEVICE)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 16 * 3 + 1, dim, device=DEVICE)
    k[..., :16, 1] = 1.0
    k[..., 16:32, 0] = 0.5
    k[..., 32:48, 1] = 1.0
    k[..., 48, 0] = 1.0  # the ragged block: one token, perfectly aligned with q
    sel = select_blocks(q, k, 0.25, (16, 16), keep_diagonal=False)  # keeps one block
    assert sel.mask[0, 0, 0].nonzero().flatten().tolist() == [3]


def test_mass_mode_reaches_its_mass_with_the_fewest_blocks():
    q, k, _ = structured()
    for mass in (0.5, 0.9, 0.99):
        sel = select_blocks(q, k, None, BLOCK, mass=mass, keep_diagonal=False)
        # recompute the pooled softmax the selector used
        scores = (block_means(q, BLOCK[0]) @ block_means(k, BLOCK[1]).repeat_interleave(2, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
        probs = torch.softmax(scores, -1)
        reached = (probs * sel.mask).sum(-1)
        assert (reached >= mass - 1e-6).all(), "the kept blocks do not reach the mass"
        fewest = (torch.sort(probs, -1, descending=True).values.cumsum(-1) < mass - 1e-6).sum(-1) + 1
        assert torch.equal(sel.mask.sum(-1), fewest), "more blocks than needed"


def test_error_against_dense_falls_as_the_budget_rises():
    q, k, v = structured(heads=2, kv_heads=1, dim=32, seed=3)
    want, _ = oracle(q, k, v)
    errors = []
    for budget in (0.1, 0.25, 0.5, 1.0):
        sel = select_blocks(q, k, budget, BLOCK)
        errors.append(rel_error(blockattn.attention(q, k, v, sel, backend="torch"), want))
    assert all(a > b for a, b in zip(errors, errors[1:])), f"errors {errors} do not fall with the budget"
    assert errors[-1] < 1e-5, errors
    # and the scores carry information: the same number of blocks picked at random does far worse
    sel = select_blocks(q, k, 0.25, BLOCK)
    shuffled = sel.mask[..., torch.randperm(sel.mask.shape[-1], generator=make_generator(1), device=DEVICE)]
    random_error = rel_error(blockattn.attention(q, k, v, shuffled, BLOCK, backend="torch"), want)
    assert errors[1] < 0.5 * random_error, (errors[1], random_error)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(budget=0.0), ValueError, "budget"),
    (dict(budget=None, mass=1.5), ValueError, "mass"),
    (dict(pins=torch.ones(3, 3)), TypeError, "pins"),
    (dict(drops=torch.ones(3, 5, 7, dtype=torch.bool)), ValueError, "drops"),
])
def test_bad_arguments(kwargs, error, message):
    q, k, _ = qkv(1, 2, 100, 32, kv_heads=1, dtype=torch.float32)
    with pytest.raises(error, match=message):
        select_blocks(q, k, **dict(dict(budget=0.25, block_size=(32, 32)), **kwargs))


def test_block_means_average_the_real_tokens_of_each_block():
    """Ragged last block without counts; per-block counts (the rest padding, here NaN) with them; an empty block
    gives zeros. Against fp64 means."""
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    x = torch.randn(2, 3, 77, 8, generator=gen, device=DEVICE).to(torch.bfloat16)
    want = torch.stack([x[:, :, i:i + 16].double().mean(2) for i in range(0, 77, 16)], 2)
    torch.testing.assert_close(block_means(x, 16).double(), want, rtol=1e-6, atol=1e-6)
    counts = torch.tensor([[16, 5, 0, 9, 1], [3, 16, 16, 2, 7]], dtype=torch.int32, device=DEVICE)
    padded = torch.full((2, 3, 80, 8), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    padded[:, :, :77] = x
    real = torch.arange(16, device=DEVICE) < counts[..., None]                      # [B, n, 16]
    padded.view(2, 3, 5, 16, 8)[~real[:, None].expand(2, 3, 5, 16)] = float("nan")
    got = block_means(padded, 16, counts)
    want = torch.stack([torch.stack([padded[b, :, i * 16:i * 16 + int(counts[b, i])].double().mean(1)
                                     if counts[b, i] else torch.zeros(3, 8, dtype=torch.float64, device=DEVICE)
                                     for i in range(5)], 1) for b in range(2)])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
