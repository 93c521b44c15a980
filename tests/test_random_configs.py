"""attention() on random configurations against the fp64 oracle. The rest of the suite tests each feature on its
own; this draws them together: layouts (packed batches with empty sequences among them), GQA, odd lengths, block
shapes no tile nests in, head dims, Dv != D, dtypes, causal, token masks, kv_valid, strided and batch-broadcast
inputs, prepared lists, masks that keep nothing, gradients through out and LSE, attention_backward, and the
quantized forwards (held against the PyTorch backend's, which defines them); the first few also under torch.compile,
against eager. Each test draws one configuration from its seed, and its failure message prints that configuration.
More seeds, outside pytest:

    python tests/test_random_configs.py 1000        # seeds 0..999 on both backends, failures listed
"""

import dataclasses
import itertools
import math
import random
import sys
from typing import Optional

import pytest
import torch

import blockattn
from conftest import (DEVICE, ON_GPU, expand, mostly_whole_kv_valid, oracle, output_and_lse_loss, real_keys,
                      rel_error)

SEEDS = range(64)
COMPILED_SEEDS = range(6)
# Relative error allowed against the fp64 oracle, per input dtype (the gradients twice this). fp32 on a GPU may
# multiply in tf32.
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# The 8-bit P @ V formats round P, which the PyTorch backend does not (tests/test_quant.py bounds that rounding).
QUANT_TOLERANCE = {"int8": None, "int8-fp8": 0.1, "int8-int8": 0.1}


@dataclasses.dataclass
class Config:
    """One random call: the drawn choices, and the seed that makes its tensors."""
    seed: int
    layout: str
    dtype: torch.dtype
    kv_heads: int
    group: int
    dim: int
    dim_v: int
    block: tuple
    seq_q: int                      # the longest sequence for "thd"
    seq_kv: int
    batch: int                      # sequences for "thd"
    lengths: Optional[tuple]        # "thd": (query lengths, key lengths)
    density: float
    mask_batch: int
    mask_heads: int
    is_causal: bool
    token_mask: bool
    kv_valid: Optional[tuple]       # the shape of kv_valid, or None
    memory: str                     # "contiguous", "sliced" (views into wider rows), "permuted", "batch-broadcast"
    prepared: bool                  # a BlockSparsity rather than a mask tensor
    scale: Optional[float]
    magnitude: float                # of q and k
    gradients: Optional[str]        # None, "out" or "out and lse"
    backward_api: bool
    quant: Optional[str]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def draw(seed: int) -> Config:
    rng = random.Random(seed)
    layout = rng.choice(["bhsd", "bshd", "thd"])
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    dim = rng.choice([16, 32, 40, 64, 80, 128])
    block = (rng.choice([8, 16, 32, 48, 64, 100, 128]), rng.choice([8, 16, 32, 48, 64, 100, 128]))
    lengths = None
    if layout == "thd":
        count = rng.choice([1, 2, 3])
        lengths_q = [rng.randint(0, 200) for _ in range(count)]
        lengths_kv = lengths_q if rng.random() < 0.5 else [rng.randint(0, 200) for _ in range(count)]
        lengths_q[0], lengths_kv[-1] = max(lengths_q[0], 1), max(lengths_kv[-1], 1)  # no empty packed tensor
        lengths, batch, seq_q, seq_kv = (tuple(lengths_q), tuple(lengths_kv)), count, max(lengths_q), max(lengths_kv)
    else:
        batch, seq_q = rng.choice([1, 2]), rng.randint(1, 260)
        seq_kv = seq_q if rng.random() < 0.4 else rng.randint(1, 260)
    kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 3])
    nk = math.ceil(seq_kv / block[1])
    gradients = rng.choice([None, "out", "out", "out and lse"])
    return Config(
        seed=seed, layout=layout, dtype=dtype, kv_heads=kv_heads, group=group, dim=dim,
        dim_v=dim if rng.random() < 0.6 else rng.choice([16, 32, 48, 64]), block=block, seq_q=seq_q, seq_kv=seq_kv,
        batch=batch, lengths=lengths, density=rng.choice([0.0, 0.2, 0.5, 1.0, round(rng.random(), 3)]),
        mask_batch=rng.choice([1, batch]), mask_heads=rng.choice([1, kv_heads * group]),
        is_causal=rng.random() < 0.35, token_mask=layout != "thd" and rng.random() < 0.25,
        kv_valid=rng.choice([None, None, None, (nk,), (1, nk), (batch, nk)]),
        memory=rng.choice(["contiguous", "contiguous", "sliced", "permuted"]
                          + (["batch-broadcast"] if layout != "thd" else [])),
        prepared=rng.random() < 0.4, scale=None if rng.random() < 0.7 else round(rng.uniform(0.01, 0.5), 4),
        magnitude=rng.choice([1.0, 1.0, 3.0, 0.1]), gradients=gradients,
        backward_api=gradients == "out" and rng.random() < 0.4,
        quant=rng.choice([None, "int8", "int8-fp8", "int8-int8"]) if gradients is None and dtype != torch.float32
        else None)


def make_inputs(c: Config):
    """([q, k, v] as the call gets them, views of leaves that require grad where gradients are asked; the block
    mask; the call's keyword arguments: layout, scale, token mask, is_causal, kv_valid and the packed offsets)."""
    gen = torch.Generator(device=DEVICE).manual_seed(c.seed)
    heads = c.kv_heads * c.group
    if c.layout == "thd":
        shapes = [(sum(c.lengths[0]), heads, c.dim), (sum(c.lengths[1]), c.kv_heads, c.dim),
                  (sum(c.lengths[1]), c.kv_heads, c.dim_v)]
    else:
        shapes = [(c.batch, heads, c.seq_q, c.dim), (c.batch, c.kv_heads, c.seq_kv, c.dim),
                  (c.batch, c.kv_heads, c.seq_kv, c.dim_v)]
        if c.layout == "bshd":
            shapes = [(s[0], s[2], s[1], s[3]) for s in shapes]
    scales = (c.magnitude, c.magnitude, 1.0)
    leaves = [(torch.randn(s, generator=gen, device=DEVICE) * m).to(c.dtype).requires_grad_(c.gradients is not None)
              for s, m in zip(shapes, scales)]
    if c.memory == "sliced":
        inputs = [torch.nn.functional.pad(t, (3, 5))[..., 3:3 + t.shape[-1]] for t in leaves]
    elif c.memory == "permuted":
        inputs = [t.transpose(-2, -3).contiguous().transpose(-2, -3) for t in leaves]
    elif c.memory == "batch-broadcast":  # keys and values shared by the batch: stride 0 on it
        inputs = [leaves[0]] + [t[:1].expand(t.shape) for t in leaves[1:]]
    else:
        inputs = leaves
    nq, nk = math.ceil(c.seq_q / c.block[0]), math.ceil(c.seq_kv / c.block[1])
    keep = torch.rand(c.mask_batch, c.mask_heads, nq, nk, generator=gen, device=DEVICE) < c.density
    token_mask = (torch.rand(c.batch, heads, c.seq_q, c.seq_kv, generator=gen, device=DEVICE) < 0.7
                  if c.token_mask else None)
    kv_valid = None
    if c.kv_valid is not None:
        rows, nk = math.prod(c.kv_valid[:-1]), c.kv_valid[-1]
        kv_valid = mostly_whole_kv_valid(rows, nk, c.block[1], c.seed).view(c.kv_valid)
    kwargs = dict(layout=c.layout, scale=c.scale, attn_mask=token_mask, is_causal=c.is_causal, kv_valid=kv_valid)
    if c.layout == "thd":
        kwargs.update({f"cu_seqlens_{side}": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                                                           device=DEVICE)
                       for side, lengths in zip(("q", "kv"), c.lengths)})
    return inputs, keep, kwargs


def expected(c: Config, inputs, keep, kwargs):
    """The fp64 oracle's (out, lse) in the call's layout, differentiable in fp64 leaves (returned too)."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    if c.layout == "thd":
        per_sequence, starts = [], [[0, *itertools.accumulate(n)] for n in c.lengths]
        for n in range(c.batch):
            (q0, q1), (k0, k1) = (starts[0][n], starts[0][n + 1]), (starts[1][n], starts[1][n + 1])
            q, k, v = (t[a:b].permute(1, 0, 2)[None] for t, (a, b) in zip(leaves, ((q0, q1), (k0, k1), (k0, k1))))
            if k1 == k0:  # a sequence without keys: zeros and -inf (hung off q, for autograd)
                out = (q[..., :1] * 0).expand(*q.shape[:3], c.dim_v)
                lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float64, device=DEVICE)
            else:
                visible = visible_keys(c, keep[n if c.mask_batch > 1 else 0][None], None, kwargs["kv_valid"], n,
                                       q1 - q0, k1 - k0)
                out, lse = oracle(q, k, v, visible, scale=c.scale, is_causal=c.is_causal)
            per_sequence.append((out[0].permute(1, 0, 2), lse[0].permute(1, 0)))
        return torch.cat([o for o, _ in per_sequence]), torch.cat([lse for _, lse in per_sequence]), leaves
    q, k, v = (t.transpose(1, 2) for t in leaves) if c.layout == "bshd" else leaves
    visible = visible_keys(c, keep, kwargs["attn_mask"], kwargs["kv_valid"], None, c.seq_q, c.seq_kv)
    out, lse = oracle(q, k, v, visible, scale=c.scale, is_causal=c.is_causal)
    return (out.transpose(1, 2) if c.layout == "bshd" else out), lse, leaves


def visible_keys(c: Config, keep, token_mask, kv_valid, sequence: Optional[int], seq_q: int, seq_kv: int):
    """The token mask [B|1, H|1, seq_q, seq_kv] of one batch (or of one packed sequence) the blocks, the token mask
    and kv_valid define (the oracle adds causality)."""
    visible = expand(keep, c.block, seq_q, seq_kv)
    if token_mask is not None:
        visible = visible & token_mask
    if kv_valid is not None:
        valid = kv_valid if kv_valid.ndim == 2 else kv_valid[None]
        if sequence is not None:
            valid = valid[sequence if valid.shape[0] > 1 else 0][None]
        visible = visible & real_keys(valid, c.block[1], seq_kv)[:, None, None, :]
    return visible


def problems_of(c: Config, backend: str) -> list:
    """What the call with configuration c gets wrong on backend, as messages (empty: nothing)."""
    inputs, keep, kwargs = make_inputs(c)
    blocks = blockattn.BlockSparsity.from_mask(keep, c.block, c.seq_q, c.seq_kv) if c.prepared else keep
    block_size = None if c.prepared else c.block
    out, lse = blockattn.attention(*inputs, blocks, block_size, return_lse=True, backend=backend, **kwargs)
    want_out, want_lse, leaves = expected(c, inputs, keep, kwargs)
    tolerance, found = TOLERANCE[c.dtype], []
    empty = torch.isneginf(want_lse)
    rows_empty = empty[..., None] if c.layout == "thd" else (
        empty.transpose(1, 2)[..., None] if c.layout == "bshd" else empty[..., None])
    if not torch.isfinite(out).all():
        found.append("out is not finite")
    if not torch.equal(torch.isneginf(lse), empty):
        found.append(f"LSE is -inf on {int(torch.isneginf(lse).sum())} rows, not on the {int(empty.sum())} that see "
                     "no key")
    if (out.detach() * rows_empty).abs().sum() != 0:
        found.append("a row that sees no key is not zero")
    if (~empty).any():
        lse_gap = (lse.detach()[~empty].double() - want_lse[~empty]).abs().max().item()
        if lse_gap > 1e-2 * max(1.0, want_lse[~empty].abs().max().item()):
            found.append(f"LSE off by {lse_gap:.2e}")
    if rel_error(out.detach(), want_out.detach()) > tolerance:
        found.append(f"out relative error {rel_error(out.detach(), want_out.detach()):.2e}")
    if c.gradients is not None:
        grad_out = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(c.seed + 1),
                               device=DEVICE).to(out.dtype)
        if c.gradients == "out":
            got = torch.autograd.grad(out, inputs, grad_out)
            want = torch.autograd.grad(want_out, leaves, grad_out.double(), allow_unused=True, materialize_grads=True)
        else:
            got = torch.autograd.grad(output_and_lse_loss(out, lse, grad_out), inputs)
            want = torch.autograd.grad(output_and_lse_loss(want_out, want_lse, grad_out.double()), leaves,
                                       allow_unused=True, materialize_grads=True)
        # A gradient the math makes zero (q's and k's with a single key per row) comes out of rounding instead: its
        # error is taken relative to the largest of the three, down to which it may be off. With no key seen at
        # all, every gradient must be exactly zero.
        largest = max(w.norm().item() for w in want)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            error = (g.double() - w).norm().item() / max(w.norm().item(), 0.05 * largest, 1e-30)
            if not torch.isfinite(g).all():
                found.append(f"{name} is not finite")
            elif largest == 0 and (g != 0).any():
                found.append(f"{name} is not zero, though no row sees a key")
            elif error > 2 * tolerance:
                found.append(f"{name} relative error {error:.2e}")
        if c.backward_api:
            saved = blockattn.attention_backward(grad_out, *(t.detach() for t in inputs), out.detach(),
                                                 lse.detach(), blocks, block_size, backend=backend, **kwargs)
            for name, g, w in zip(("dq", "dk", "dv"), saved, got):
                if g.shape != w.shape or g.dtype != w.dtype or rel_error(g, w) > 1e-2 * bool((w != 0).any()):
                    found.append(f"attention_backward's {name} differs from autograd's")
    if c.quant is not None:
        got_q, want_q = (blockattn.attention(*inputs, blocks, block_size, quant=c.quant, return_lse=True,
                                             backend=b, **kwargs) for b in (backend, "torch"))
        allowed = QUANT_TOLERANCE[c.quant] or tolerance
        if not torch.isfinite(got_q[0]).all() or rel_error(got_q[0], want_q[0]) > allowed:
            found.append(f"quant={c.quant!r}: out differs from the PyTorch backend's by "
                         f"{rel_error(got_q[0], want_q[0]):.2e}")
        if not torch.equal(torch.isneginf(got_q[1]), torch.isneginf(want_q[1])):
            found.append(f"quant={c.quant!r}: LSE -inf on other rows than the PyTorch backend's")
    return found


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_configuration_matches_the_oracle(poisoned, seed, backend):
    config = draw(seed)
    found = problems_of(config, backend)
    assert not found, f"{found} for {config.describe()}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", COMPILED_SEEDS)
def test_a_random_configuration_compiled_gives_the_eager_result(seed, backend):
    """The same call under torch.compile: the Triton backend in one graph (fullgraph; packed batches given their
    longest lengths), through Inductor on a GPU and aot_eager under the interpreter; the PyTorch backend through
    Inductor (it runs eagerly inside the compiled graph). Out, LSE and the gradients as eager gives them."""
    c = dataclasses.replace(draw(seed), quant=None)
    inputs, keep, kwargs = make_inputs(c)
    if c.layout == "thd":
        kwargs.update(max_seqlen_q=c.seq_q, max_seqlen_kv=c.seq_kv)

    def call(q, k, v):
        return blockattn.attention(q, k, v, keep, c.block, return_lse=True, backend=backend, **kwargs)
    compiler = "inductor" if backend == "torch" or ON_GPU else "aot_eager"
    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(call, fullgraph=backend == "triton", dynamic=False, backend=compiler), call):
        out, lse = fn(*inputs)
        grads = (torch.autograd.grad(output_and_lse_loss(out, lse, torch.ones_like(out)), inputs)
                 if c.gradients is not None else ())
        results.append((out, lse, *grads))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)) and rel_error(got[finite], want[finite]) <= 1e-3, \
            f"{name} differs from eager's for {c.describe()}"


def test_the_draws_cover_every_choice():
    """The seeds above reach every layout, dtype, memory order and quant format, and masks that keep nothing."""
    configs = [draw(seed) for seed in SEEDS]
    for attribute, values in (("layout", {"bhsd", "bshd", "thd"}),
                              ("dtype", {torch.float16, torch.bfloat16, torch.float32}),
                              ("memory", {"contiguous", "sliced", "permuted", "batch-broadcast"}),
                              ("gradients", {None, "out", "out and lse"}),
                              ("quant", {None, "int8", "int8-fp8", "int8-int8"})):
        assert {getattr(c, attribute) for c in configs} >= values, attribute
    for flag in ("is_causal", "token_mask", "prepared", "backward_api"):
        assert any(getattr(c, flag) for c in configs), flag
    assert any(c.density == 0 for c in configs) and any(c.kv_valid for c in configs)
    assert any(c.block[0] % 16 or c.block[1] % 16 for c in configs)          # blocks no tile nests in


if __name__ == "__main__":  # (conftest, imported above, has set TRITON_INTERPRET=1 on a machine without CUDA)
    failures = 0
    for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 100):
        for backend in ("torch", "triton"):
            found = problems_of(draw(seed), backend)
            if found:
                failures += 1
                print(f"seed {seed} {backend}: {found}\n    {draw(seed).describe()}", flush=True)
    print(f"{failures} failures")
