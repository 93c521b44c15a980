"""blockattn.distributed: sequence-parallel attention on 1, 2 and 3 ranks equals attention() on the whole sequence,
forward and backward. The ranks run on CPUs over gloo with the PyTorch backend, or, where the machine has a GPU for
each rank, on the GPUs over NCCL with the Triton kernels."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import blockattn
from blockattn.distributed import sequence_parallel_attention

# Whole sequences (divisible by the ranks), heads and blocks; the block edges fall inside rank shards.
# 6 query heads over 3 kv heads: on 3 ranks one kv head each, on 2 ranks the kv heads are repeated.
HEADS, KV_HEADS, DIM, BLOCK = 6, 3, 16, (16, 8)
EVEN, UNEVEN = (96, 120), (95, 118)   # whole (query, key) lengths; the uneven ones leave the last rank fewer


def inputs(lengths):
    """The whole problem, the same on every rank: q, k, v (bhsd, fp32), a block mask per head, a token mask per
    head, kv_valid, and the upstream gradient of out."""
    gen = torch.Generator().manual_seed(0)
    SEQ_Q, SEQ_KV = lengths
    q = torch.randn(2, HEADS, SEQ_Q, DIM, generator=gen)
    k = torch.randn(2, KV_HEADS, SEQ_KV, DIM, generator=gen)
    v = torch.randn(2, KV_HEADS, SEQ_KV, DIM, generator=gen)
    nq, nk = -(-SEQ_Q // BLOCK[0]), -(-SEQ_KV // BLOCK[1])
    keep = torch.rand(2, HEADS, nq, nk, generator=gen) < 0.5
    keep[:, :, 3] = False                                          # a query block that sees nothing
    token_mask = torch.rand(1, HEADS, SEQ_Q, SEQ_KV, generator=gen) < 0.8
    kv_valid = torch.randint(1, BLOCK[1] + 1, (nk,), generator=gen, dtype=torch.int32)
    grad_out = torch.randn(2, HEADS, SEQ_Q, DIM, generator=gen)
    return q, k, v, keep, token_mask, kv_valid, grad_out


def whole(lengths, use_sparsity: bool, quant=None):
    """attention() on one process: out, lse and the three gradients (none with quant), in bhsd."""
    q, k, v, keep, token_mask, kv_valid, grad_out = inputs(lengths)
    leaves = [t.clone().requires_grad_(quant is None) for t in (q, k, v)]
    out, lse = blockattn.attention(*leaves, keep if use_sparsity else keep[0], BLOCK, attn_mask=token_mask,
                                   kv_valid=kv_valid, is_causal=True, return_lse=True, backend="torch", quant=quant)
    if quant is not None:
        return [out, lse]
    (out * grad_out).sum().backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    return x.chunk(world, dim=dim)[rank]


def on_gpus(world: int) -> bool:
    """Whether the ranks run on GPUs (one each, NCCL, the Triton kernels) rather than on CPUs (gloo, PyTorch)."""
    return torch.cuda.device_count() >= world


def worker(rank: int, world: int, store: str, layout: str, use_sparsity: bool, lengths, quant, results):
    gpus = on_gpus(world)
    if gpus:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpus else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        device = torch.device("cuda", rank) if gpus else torch.device("cpu")
        q, k, v, keep, token_mask, kv_valid, grad_out = (t.to(device) for t in inputs(lengths))
        # a BlockSparsity, or the mask tensor as 3-D [H, nq, nk] (batch-shared) to slice on another axis
        blocks = blockattn.BlockSparsity.from_mask(keep, BLOCK, *lengths) if use_sparsity else keep[0]
        whole_lengths = dict(seq_q=lengths[0], seq_kv=lengths[1]) if lengths != EVEN else {}
        local = [shard(t, rank, world).clone().requires_grad_(quant is None) for t in (q, k, v)]
        args = [t.transpose(1, 2) for t in local] if layout == "bshd" else local
        out, lse = sequence_parallel_attention(*args, blocks, None if use_sparsity else BLOCK, layout=layout,
                                               attn_mask=token_mask, kv_valid=kv_valid, is_causal=True,
                                               return_lse=True, backend="triton" if gpus else "torch", quant=quant,
                                               **whole_lengths)
        if layout == "bshd":
            out = out.transpose(1, 2)
        if quant is not None:  # inference only: the keys' mean is taken over the whole sequence on each rank
            results[rank] = [out.cpu(), lse.cpu()]
            return
        (out * shard(grad_out, rank, world)).sum().backward()
        results[rank] = [t.cpu() for t in [out.detach(), lse.detach()] + [t.grad for t in local]]
    except Exception as error:  # reported to the parent, which fails the test with it
        results[rank] = repr(error)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, layout, use_sparsity, lengths, quant", [
    (1, "bshd", True, UNEVEN, None), (2, "bhsd", False, EVEN, None), (3, "bshd", True, EVEN, None),
    (3, "bhsd", True, UNEVEN, None), (3, "bhsd", True, UNEVEN, "int8")])
def test_sequence_parallel_attention_equals_the_whole_sequence(tmp_path, world, layout, use_sparsity, lengths, quant):
    """Each rank's shard of out, lse, dq, dk and dv equals the single-process result's (GQA, a block mask per
    head, a token mask per head, kv_valid, causal, an empty query block; shards of equal and of unequal length, as
    torch.chunk splits), to fp32 rounding (the IEEE fp32 kernels' on GPUs); with quant="int8", out and lse (each
    rank quantizes whole sequences of its heads, so the keys' mean is the single process's)."""
    with mp.Manager() as manager:
        results = manager.dict()
        env = {"OMP_NUM_THREADS": "1"}
        previous = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            # the ranks meet through a file of this test's own (a free TCP port could be taken before rank 0 binds it)
            mp.spawn(worker, args=(world, str(tmp_path / "store"), layout, use_sparsity, lengths, quant, results),
                     nprocs=world)
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        got = dict(results)
    want = whole(lengths, use_sparsity, quant)
    tolerance = 1e-4 if on_gpus(world) else 1e-5
    for rank in range(world):
        assert not isinstance(got[rank], str), f"rank {rank} raised {got[rank]}"
        for name, part, full in zip(("out", "lse", "dq", "dk", "dv"), got[rank], want):
            expected = shard(full, rank, world)
            assert torch.isfinite(part[expected.isfinite()]).all() and torch.equal(part.isinf(), expected.isinf())
            torch.testing.assert_close(part, expected, rtol=tolerance, atol=tolerance, msg=f"rank {rank} {name}")


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
