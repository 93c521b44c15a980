"""blockattn.distributed: sequence-parallel attention on 1, 2 and 3 ranks equals attention() on the whole sequence,
forward and backward. The ranks run on CPUs over gloo with the PyTorch backend, or, where the machine has a GPU for
each rank, on the GPUs over NCCL with the Triton kernels."""

import dataclasses
import os
import random
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import blockattn
from blockattn.distributed import sequence_parallel_attention

# Whole sequences (divisible by the ranks), heads and blocks; the block edges fall inside rank shards.
# 6 query heads over 3 kv heads: on 3 ranks one kv head each, on 2 ranks the kv heads are repeated.
EVEN, UNEVEN = (96, 120), (95, 118)   # whole (query, key) lengths; the uneven ones leave the last rank fewer
BLOCK_KINDS = ("sparsity", "mask", "3-D", "2-D", "head-shared", "none")


@dataclasses.dataclass(frozen=True)
class Call:
    """One sequence-parallel call and the whole problem it splits. blocks: a BlockSparsity ("sparsity"), a mask
    [B, H, nq, nk] ("mask"), [H, nq, nk] ("3-D"), [nq, nk] ("2-D"), [B, 1, nq, nk] ("head-shared") or None
    ("none": dense)."""
    world: int
    layout: str
    blocks: str
    lengths: tuple
    quant: Optional[str] = None
    heads: int = 6
    kv_heads: int = 3
    dim: int = 16
    dim_v: int = 16
    batch: int = 2
    block: tuple = (16, 8)
    causal: bool = True
    token_mask: bool = True
    kv_valid: bool = True
    seed: int = 0


def draw(seed: int) -> Call:
    """A random call: ranks, layout, kind of block mask, lengths (even or not), GQA or MQA, Dv != D, block shape,
    causal or not, with or without a token mask and kv_valid."""
    rng = random.Random(seed)
    world = rng.choice([2, 3])
    kv_heads = rng.choice([1, 2, 3, 6])
    lengths = (rng.randint(world, 130), rng.randint(world, 130))
    return Call(world, rng.choice(["bhsd", "bshd"]), rng.choice(BLOCK_KINDS), lengths, heads=6, kv_heads=kv_heads,
                dim=rng.choice([16, 32]), dim_v=rng.choice([16, 24]), batch=rng.choice([1, 2]),
                block=(rng.choice([8, 16, 32, 48]), rng.choice([8, 16, 32, 48])), causal=rng.random() < 0.5,
                token_mask=rng.random() < 0.5, kv_valid=rng.random() < 0.5, seed=seed)


CALLS = [Call(1, "bshd", "sparsity", UNEVEN), Call(2, "bhsd", "3-D", EVEN), Call(3, "bshd", "sparsity", EVEN),
         Call(3, "bhsd", "sparsity", UNEVEN), Call(3, "bhsd", "sparsity", UNEVEN, quant="int8")]
RANDOM_CALLS = [draw(seed) for seed in range(6)]


def inputs(call: Call):
    """The whole problem, the same on every rank: q, k, v (bhsd, fp32), a block mask per head (one query block
    keeping nothing), a token mask per head or None, kv_valid or None, and the upstream gradient of out."""
    gen = torch.Generator().manual_seed(call.seed)
    seq_q, seq_kv = call.lengths
    q = torch.randn(call.batch, call.heads, seq_q, call.dim, generator=gen)
    k = torch.randn(call.batch, call.kv_heads, seq_kv, call.dim, generator=gen)
    v = torch.randn(call.batch, call.kv_heads, seq_kv, call.dim_v, generator=gen)
    nq, nk = -(-seq_q // call.block[0]), -(-seq_kv // call.block[1])
    keep = torch.rand(call.batch, call.heads, nq, nk, generator=gen) < 0.5
    keep[:, :, min(3, nq - 1)] = False                                  # a query block that sees nothing
    token_mask = torch.rand(1, call.heads, seq_q, seq_kv, generator=gen) < 0.8 if call.token_mask else None
    kv_valid = (torch.randint(1, call.block[1] + 1, (nk,), generator=gen, dtype=torch.int32) if call.kv_valid
                else None)
    grad_out = torch.randn(call.batch, call.heads, seq_q, call.dim_v, generator=gen)
    return q, k, v, keep, token_mask, kv_valid, grad_out


def blocks_argument(call: Call, keep: torch.Tensor):
    """What the call passes as blocks, made from the whole mask keep [B, H, nq, nk]."""
    if call.blocks == "sparsity":
        return blockattn.BlockSparsity.from_mask(keep, call.block, *call.lengths)
    return {"mask": keep, "3-D": keep[0], "2-D": keep[0, 0], "head-shared": keep[:, :1], "none": None}[call.blocks]


def options(call: Call, token_mask, kv_valid) -> dict:
    return dict(attn_mask=token_mask, kv_valid=kv_valid, is_causal=call.causal, return_lse=True, quant=call.quant)


def whole(call: Call):
    """attention() on one process: out, lse and the three gradients (none with quant), in bhsd."""
    q, k, v, keep, token_mask, kv_valid, grad_out = inputs(call)
    leaves = [t.clone().requires_grad_(call.quant is None) for t in (q, k, v)]
    blocks = blocks_argument(call, keep)
    out, lse = blockattn.attention(*leaves, blocks, None if call.blocks == "sparsity" else call.block,
                                   backend="torch", **options(call, token_mask, kv_valid))
    if call.quant is not None:
        return [out, lse]
    (out * grad_out).sum().backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    return x.chunk(world, dim=dim)[rank]


def on_gpus(world: int) -> bool:
    """Whether the ranks run on GPUs (one each, NCCL, the Triton kernels) rather than on CPUs (gloo, PyTorch)."""
    return torch.cuda.device_count() >= world


def worker(rank: int, call: Call, store: str, results):
    world = call.world
    gpus = on_gpus(world)
    if gpus:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpus else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        device = torch.device("cuda", rank) if gpus else torch.device("cpu")
        q, k, v, keep, token_mask, kv_valid, grad_out = (None if t is None else t.to(device) for t in inputs(call))
        blocks = blocks_argument(call, keep)
        # the whole lengths, where the shards alone do not give them
        whole_lengths = (dict(seq_q=call.lengths[0], seq_kv=call.lengths[1])
                         if any(n % world for n in call.lengths) else {})
        local = [shard(t, rank, world).clone().requires_grad_(call.quant is None) for t in (q, k, v)]
        args = [t.transpose(1, 2) for t in local] if call.layout == "bshd" else local
        out, lse = sequence_parallel_attention(*args, blocks, None if call.blocks == "sparsity" else call.block,
                                               layout=call.layout, backend="triton" if gpus else "torch",
                                               **options(call, token_mask, kv_valid), **whole_lengths)
        if call.layout == "bshd":
            out = out.transpose(1, 2)
        if call.quant is not None:  # inference only: the keys' mean is taken over the whole sequence on each rank
            results[rank] = [out.cpu(), lse.cpu()]
            return
        (out * shard(grad_out, rank, world)).sum().backward()
        results[rank] = [t.cpu() for t in [out.detach(), lse.detach()] + [t.grad for t in local]]
    except Exception as error:  # reported to the parent, which fails the test with it
        results[rank] = repr(error)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("call", CALLS + RANDOM_CALLS, ids=lambda call: (
    f"{call.world}ranks-{call.layout}-{call.blocks}-{call.lengths[0]}x{call.lengths[1]}"
    f"{'-' + call.quant if call.quant else ''}-seed{call.seed}"))
def test_sequence_parallel_attention_equals_the_whole_sequence(tmp_path, call):
    """Each rank's shard of out, lse, dq, dk and dv equals the single-process result's: GQA and MQA, each kind of
    block mask, token masks per head, kv_valid, causal or not, an empty query block, shards of equal and of unequal
    length (as torch.chunk splits them; on 3 ranks a short sequence leaves the last rank none), Dv != D; to fp32
    rounding (the IEEE fp32 kernels' on GPUs). With quant="int8", out and lse (each rank quantizes whole sequences
    of its heads, so the keys' mean is the single process's). The last six calls are random draws."""
    with mp.Manager() as manager:
        results = manager.dict()
        env = {"OMP_NUM_THREADS": "1"}
        previous = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            # the ranks meet through a file of this test's own (a free TCP port could be taken before rank 0 binds it)
            mp.spawn(worker, args=(call, str(tmp_path / "store"), results), nprocs=call.world)
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        got = dict(results)
    want = whole(call)
    tolerance = 1e-4 if on_gpus(call.world) else 1e-5
    for rank in range(call.world):
        assert not isinstance(got[rank], str), f"rank {rank} raised {got[rank]} ({call})"
        for name, part, full in zip(("out", "lse", "dq", "dk", "dv"), got[rank], want):
            expected = shard(full, rank, call.world)
            assert torch.isfinite(part[expected.isfinite()]).all() and torch.equal(part.isinf(), expected.isinf())
            torch.testing.assert_close(part, expected, rtol=tolerance, atol=tolerance, msg=f"rank {rank} {name} {call}")


def test_without_an_initialized_group_the_error_says_so():
    q = torch.zeros(1, 2, 16, 16)
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        sequence_parallel_attention(q, q, q)


def test_bad_layout_is_named():
    q = torch.zeros(1, 2, 16, 16)
    with pytest.raises(ValueError, match='layout must be "bhsd" or "bshd"'):
        sequence_parallel_attention(q, q, q, layout="thd")


def test_shard_sizes_split_as_torch_chunk_does():
    from blockattn.distributed import shard_sizes
    for seq in range(1, 40):
        for world in range(1, 6):
            sizes = shard_sizes(seq, world)
            chunks = [len(c) for c in torch.arange(seq).chunk(world)]
            assert sizes[:len(chunks)] == chunks and sum(sizes) == seq and len(sizes) == world, (seq, world)


@pytest.mark.parametrize("overrides, message", [
    (dict(seq_q=50), r"seq_q=50 split over 2 ranks gives rank 1 25 tokens .* but its shard has 16"),
    (dict(seq_kv=0), "seq_kv must be a positive int"),
    (dict(heads=3), r"the query heads \(3\) must be a multiple of the ranks \(2\)"),
])
def test_shards_and_heads_that_do_not_fit_the_ranks_are_named(monkeypatch, overrides, message):
    """Checked before any exchange (here on rank 1 of 2, without a process group)."""
    from blockattn import distributed
    monkeypatch.setattr(distributed, "_world", lambda group: (2, 1))
    heads = overrides.pop("heads", 2)
    q = torch.zeros(1, heads, 16, 16)
    with pytest.raises(ValueError, match=message):
        sequence_parallel_attention(q, q, q, **overrides)
