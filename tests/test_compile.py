"""The Triton path as custom ops: torch.library.opcheck, and torch.compile without graph breaks; the PyTorch backend
under torch.compile."""

import subprocess
import sys
import warnings

import pytest
import torch

import blockattn
from blockattn.kernels import ops
from conftest import DEVICE, ON_GPU, assert_output_and_gradients, expand, output_and_lse_loss, qkv, random_keep


def op_args(requires_grad):
    q, k, v = qkv(1, 4, 70, 32, kv_heads=2, dtype=torch.float32)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    blocks = blockattn.BlockSparsity.from_mask(random_keep(1, 4, 70, 70, (32, 16)), (32, 16), 70, 70)
    q_count, q_index = blocks.q_lists()
    return (q, k, v, blocks.kv_count, blocks.kv_index, q_count, q_index, None, None, None, None, None, 0.2, 32, 16, 32,
            16, True, 0, 0)


def packed_op_args():
    """A packed ("thd") batch of sequences 30 and 40 long (keys 50 and 20), viewed [1, H, T, D] as the API does."""
    q, k, v = qkv(1, 4, 70, 32, kv_heads=2, seq_kv=70, dtype=torch.float32)
    q, k, v = (t[0].permute(1, 0, 2).contiguous().permute(1, 0, 2).unsqueeze(0).requires_grad_(True)
               for t in (q, k, v))
    blocks = blockattn.BlockSparsity.from_mask(random_keep(2, 4, 40, 50, (32, 16)), (32, 16), 40, 50)
    q_count, q_index = blocks.q_lists()
    cu_q = torch.tensor([0, 30, 70], dtype=torch.int32, device=q.device)
    cu_kv = torch.tensor([0, 50, 70], dtype=torch.int32, device=q.device)
    return (q, k, v, blocks.kv_count, blocks.kv_index, q_count, q_index, None, None, None, cu_q, cu_kv, 0.2, 32, 16,
            32, 16, False, 40, 50)


def test_opcheck_forward_op():
    torch.library.opcheck(ops.sparse_attention_fwd, op_args(requires_grad=True))
    torch.library.opcheck(ops.sparse_attention_fwd, packed_op_args())


def test_opcheck_backward_op():
    args = op_args(requires_grad=False)
    out, lse = ops.sparse_attention_fwd(*args)
    q, k, v, kv_count, kv_index, q_count, q_index = args[:7]
    bwd_args = (torch.randn_like(out), None, q, k, v, out, lse, kv_count, kv_index, q_count, q_index, None, None,
                None, *args[10:])  # cu_seqlens (None, None) and the scalars
    torch.library.opcheck(ops.sparse_attention_bwd, bwd_args)
    torch.library.opcheck(ops.sparse_attention_bwd, bwd_args, {"needs": [False, True, True]})


class Block(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks

    def forward(self, q, k, v):
        out = blockattn.attention(q, k, v, self.blocks, is_causal=True, backend="triton")
        return out * 2


def test_compiled_model_has_no_graph_break_and_matches_eager():
    q, k, v = qkv(1, 4, 70, 32, kv_heads=2, dtype=torch.float32, seed=3)
    blocks = blockattn.BlockSparsity.from_mask(random_keep(1, 4, 70, 70, (32, 16)), (32, 16), 70, 70)
    model = Block(blocks)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    eager = model(*leaves)
    eager.sum().backward()
    eager_grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    out = compiled(*leaves)
    out.sum().backward()
    assert torch.equal(out, eager)
    for got, want in zip((t.grad for t in leaves), eager_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["one row alone in its chunk", "packed GQA"])
def test_the_pytorch_backend_compiled_by_inductor_matches_eager(case):
    """torch.compile with Inductor over the PyTorch backend: out, LSE and the gradients through both as eager gives
    them. torch 2.13's Inductor on the CPU miscompiled the backend's key gradients in both cases (a query block that
    keeps key blocks alone in its chunk; GQA over a packed batch), so the backend runs eagerly under compile
    (api._reference wraps it in torch.compiler.disable)."""
    if case == "packed GQA":
        gen = torch.Generator(device=DEVICE).manual_seed(37)
        q, k, v = (torch.randn(tokens, heads, dim, generator=gen, device=DEVICE)
                   for tokens, heads, dim in ((302, 3, 16), (341, 1, 16), (341, 1, 48)))
        offsets = {f"cu_seqlens_{side}": torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
                   for side, lengths in (("q", [0, 162, 293, 302]), ("kv", [0, 94, 206, 341]))}
        call = dict(blocks=None, block_size=(64, 100), layout="thd", max_seqlen_q=162, max_seqlen_kv=135, **offsets)
    else:
        q, k, v = qkv(2, 2, 80, 16, kv_heads=1, dtype=torch.float32, seed=8)
        keep = torch.zeros(2, 2, 1, 2, dtype=torch.bool, device=DEVICE)
        keep[0, 1, 0, 1] = True
        call = dict(blocks=keep, block_size=(100, 48))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def outputs_and_gradients(fn):
        out, lse = fn(q, k, v, return_lse=True, backend="torch", **call)
        grads = torch.autograd.grad(output_and_lse_loss(out, lse, torch.ones_like(out)), (q, k, v))
        return out, lse, *grads
    torch._dynamo.reset()
    compiled = outputs_and_gradients(torch.compile(blockattn.attention))
    for got, want in zip(compiled, outputs_and_gradients(blockattn.attention)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_importing_blockattn_imports_neither_triton_nor_dynamo():
    """import blockattn stays light: Triton loads with the first kernel call (so TRITON_INTERPRET set after the import
    still counts), and torch._dynamo (with Inductor, over a second of import) only where a caller compiles."""
    probe = "import sys, blockattn; print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


def test_compiling_meets_no_cache_wrapper():
    """torch.compile traces blockattn's API layer up to the custom op: nothing it calls there is wrapped in
    functools.lru_cache, at which Dynamo warns once per call site (each warning saying that silent incorrectness is
    possible). The inputs require grad, so the trace takes the q lists too; the result matches the eager call's."""
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 4, 70, 32, kv_heads=2, dtype=torch.float32, seed=5))
    model = Block(blockattn.BlockSparsity.from_mask(random_keep(1, 4, 70, 70, (32, 16)), (32, 16), 70, 70))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")(q, k, v)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    torch.testing.assert_close(out, model(q, k, v), rtol=0, atol=0)


def test_compiled_frozen_keys_and_values_skip_the_dkdv_kernel(launched_kernels):
    """Under torch.compile too, only the gradients autograd asks for are computed: with keys and values frozen the
    dK/dV kernel never runs, and the query's gradient equals the eager one."""
    from blockattn.kernels import backward
    q, k, v = qkv(1, 4, 70, 32, kv_heads=2, dtype=torch.float32, seed=4)
    model = Block(blockattn.BlockSparsity.from_mask(random_keep(1, 4, 70, 70, (32, 16)), (32, 16), 70, 70))
    q_eager = q.clone().requires_grad_(True)
    model(q_eager, k, v).sum().backward()
    launched_kernels.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    q_compiled = q.clone().requires_grad_(True)
    compiled(q_compiled, k, v).sum().backward()
    torch.testing.assert_close(q_compiled.grad, q_eager.grad, rtol=0, atol=0)
    assert (backward.attention_bwd_dq_kernel in launched_kernels
            and backward.attention_bwd_dkdv_kernel not in launched_kernels)


def test_eager_autograd_bypasses_the_custom_op():
    """Eager calls that need gradients run the launchers through a plain autograd Function (the custom-op
    dispatch cost about 1 ms of host time per call, BENCHMARKS.md); the custom op is for torch.compile."""
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 64, 32, dtype=torch.float32))
    out = blockattn.attention(q, k, v, random_keep(1, 2, 64, 64, (32, 32)), (32, 32), backend="triton")
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"


def test_a_compiled_packed_batch_with_its_longest_lengths_has_no_graph_break():
    """layout "thd" under torch.compile(fullgraph=True): with max_seqlen_q / max_seqlen_kv given, nothing reads the
    offsets on the host (that read is a graph break), and the result equals the eager call's."""
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    q, k, v = (torch.randn(70, 2, 32, generator=gen, device=DEVICE) for _ in range(3))
    cu = torch.tensor([0, 30, 70], dtype=torch.int32, device=DEVICE)
    keep = random_keep(2, 2, 40, 40, (32, 16))
    kwargs = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=40, max_seqlen_kv=40,
                  is_causal=True, backend="triton")
    torch._dynamo.reset()
    compiled = torch.compile(blockattn.attention, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    torch.testing.assert_close(compiled(q, k, v, keep, (32, 16), **kwargs),
                               blockattn.attention(q, k, v, keep, (32, 16), **kwargs), rtol=0, atol=0)


def test_compiled_kv_valid_builds_its_lists_in_the_graph():
    """kv_valid's full-first lists are built on each call from the tensor (BlockSparsity.full_first): under
    torch.compile that happens inside the graph, with no graph break, and a new kv_valid value gives eager's
    results without a recompilation (the first call fills the BlockSparsity's cache of the mask's own part, after
    which the graph may compile once more)."""
    seq, block = 200, (32, 128)
    q, k, v = qkv(2, 2, seq, 32, dtype=torch.float32, seed=4)
    blocks = blockattn.BlockSparsity.from_mask(random_keep(1, 2, seq, seq, block, density=0.6), block, seq, seq)

    def step(q, k, v, kv_valid):
        out = blockattn.attention(q, k, v, blocks, kv_valid=kv_valid, backend="triton")
        return out * 2

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="inductor" if ON_GPU else "aot_eager")
    graphs = []
    for valid in ([[128, 72], [1, 128]], [[0, 128], [128, 5]], [[128, 128], [64, 0]]):
        kv_valid = torch.tensor(valid, dtype=torch.int32, device=DEVICE)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = compiled(*leaves, kv_valid)
        out.sum().backward()
        want_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = step(*want_leaves, kv_valid)
        want.sum().backward()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        for got, expected in zip(leaves, want_leaves):
            torch.testing.assert_close(got.grad, expected.grad, rtol=0, atol=0)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[2] == graphs[1], graphs


def test_a_step_making_its_mask_compiles_once_and_runs_from_cuda_graphs():
    """A step that makes its BlockSparsity from the mask tensor it is given (a video model's blocks chosen anew each
    step), compiled with torch.compile's mode="reduce-overhead" on a GPU (Inductor's CUDA graphs, forward and
    backward; "aot_eager" on the CPU): three calls on three masks compile once, on a GPU none skips the CUDA
    graphs, and each call's output and gradients meet the fp64 oracle on its own mask."""
    seq, block = (512, (128, 64)) if ON_GPU else (128, (32, 16))
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 4, seq, 128 if ON_GPU else 32, kv_heads=2, seed=6))
    grad_out = torch.randn(q.shape, generator=torch.Generator(device=DEVICE).manual_seed(7), device=DEVICE,
                           dtype=q.dtype)

    def step(q, k, v, mask):
        return blockattn.attention(q, k, v, blockattn.BlockSparsity.from_mask(mask, block, seq, seq),
                                   backend="triton")

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=False,
                             **({"mode": "reduce-overhead"} if ON_GPU else {"backend": "aot_eager"}))
    graphs = []
    for seed in (8, 9, 10):
        mask = random_keep(1, 4, seq, seq, block, density=0.4, seed=seed)
        if ON_GPU:
            torch.compiler.cudagraph_mark_step_begin()
        out = compiled(q, k, v, mask)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_output_and_gradients(out, grads, q, k, v, expand(mask, block, seq, seq), grad_out, tolerance=1e-2,
                                    label=f"mask {seed}: ")
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[2] >= 1, graphs
    assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
