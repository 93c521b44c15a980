"""Every bad input to the public functions raises the right error, naming the argument."""

import contextlib

import pytest
import torch

import blockattn
from blockattn.api import resolve_backend
from conftest import (DEVICE, ON_GPU, assert_output_and_gradients, captured_replay, expand, no_host_reads, overwrite,
                      qkv, random_keep)


def base():
    q, k, v = qkv(2, 4, 100, 32, kv_heads=2)
    return dict(q=q, k=k, v=v)


def call(**overrides):
    args = base()
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return blockattn.attention(q, k, v, **args)


def t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


CASES = [
    ("q not a tensor", dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    ("integer q", dict(q=t(2, 4, 100, 32, dtype=torch.int32)), TypeError, "q must be a floating-point"),
    ("3-D q", dict(q=t(4, 100, 32)), ValueError, "q must be 4-D"),
    ("dtype mismatch", dict(k=t(2, 2, 100, 32, dtype=torch.float16)), TypeError, "share a dtype"),
    ("batch mismatch", dict(k=t(3, 2, 100, 32), v=t(3, 2, 100, 32)), ValueError, "batch"),
    ("heads not a multiple", dict(k=t(2, 3, 100, 32), v=t(2, 3, 100, 32)), ValueError, "query heads"),
    ("k and v lengths differ", dict(v=t(2, 2, 90, 32)), ValueError, "k and v"),
    ("head dims differ", dict(k=t(2, 2, 100, 64)), ValueError, "head dim"),
    ("head dim too small", dict(q=t(2, 4, 100, 8), k=t(2, 2, 100, 8), v=t(2, 2, 100, 8)), ValueError, "16..256"),
    ("head dim too large", dict(v=t(2, 2, 100, 512)), ValueError, "v's head dim"),
    ("empty query sequence", dict(q=t(2, 4, 0, 32)), ValueError, "q has an empty sequence"),
    ("empty key sequence", dict(k=t(2, 2, 0, 32), v=t(2, 2, 0, 32)), ValueError, "k has an empty sequence"),
    ("bad layout", dict(layout="bsdh"), ValueError, "layout"),
    ("thd needs 3-D inputs", dict(layout="thd"), ValueError, "q must be a 3-D tensor"),
    ("offsets without thd", dict(cu_seqlens_q=torch.tensor([0, 100], dtype=torch.int32)), ValueError, "thd"),
    ("bad backend", dict(backend="cuda"), ValueError, "backend"),
    ("float token mask", dict(attn_mask=t(100, 100, dtype=torch.float32)), TypeError, "attn_mask"),
    ("token mask shape", dict(attn_mask=t(100, 99, dtype=torch.bool)), ValueError, "attn_mask"),
    ("blocks of a wrong type", dict(blocks=[[1]]), TypeError, "blocks"),
    ("mask batch", dict(blocks=t(3, 1, 1, 2, dtype=torch.bool)), ValueError, "batch"),
    ("mask heads", dict(blocks=t(1, 2, 1, 2, dtype=torch.bool)), ValueError, "head"),
    ("mask shape", dict(blocks=t(1, 3, dtype=torch.bool)), ValueError, "nq=1, nk=2"),
    ("kv_valid dtype", dict(blocks=t(1, 2, dtype=torch.bool), kv_valid=t(2, dtype=torch.float32)), TypeError,
     "kv_valid"),
    ("kv_valid shape", dict(blocks=t(1, 2, dtype=torch.bool), kv_valid=t(3, dtype=torch.int32)), ValueError,
     "kv_valid"),
    ("nan scale", dict(scale=float("nan")), TypeError, "scale"),
    ("non-bool is_causal", dict(is_causal=1), TypeError, "is_causal"),
    ("quant unknown", dict(quant="int4"), ValueError, "quant must be None or one of"),
    ("quant not a string", dict(quant=8), ValueError, "quant must be None or one of"),
    ("fp64 on the kernels", dict(q=t(2, 4, 100, 32, dtype=torch.float64), k=t(2, 2, 100, 32, dtype=torch.float64),
                                 v=t(2, 2, 100, 32, dtype=torch.float64), backend="triton"), TypeError, "triton"),
]


@pytest.mark.parametrize("label, overrides, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(label, overrides, error, message):
    with pytest.raises(error, match=message):
        call(**overrides)


def test_sparsity_for_other_lengths_is_refused():
    blocks = blockattn.BlockSparsity.dense((64, 64), 128, 128, device=DEVICE)
    with pytest.raises(ValueError, match="seq_q=128"):
        call(blocks=blocks)


def test_block_size_disagreeing_with_the_sparsity_is_refused():
    blocks = blockattn.BlockSparsity.dense((64, 64), 100, 100, device=DEVICE)
    with pytest.raises(ValueError, match="block_size"):
        call(blocks=blocks, block_size=(128, 64))


def test_explicit_triton_backend_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match='backend="triton"'):
        resolve_backend("triton", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


def test_interpreter_asked_for_after_the_kernels_were_built_is_refused(monkeypatch):
    """TRITON_INTERPRET=1 set after blockattn's kernels were decorated for the GPU (no kernel is Triton's
    interpreted kind): backend="triton" on the CPU raises, saying to set it first; on a GPU it still runs."""
    from blockattn.kernels import autotune

    class NotTheirType:
        pass
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(autotune, "_interpreted_function_type", lambda: NotTheirType)
    with pytest.raises(ValueError, match="set it before"):
        resolve_backend("triton", torch.device("cpu"))
    if ON_GPU:
        assert resolve_backend("triton", torch.device("cuda")) == "triton"


def test_backward_checks_the_saved_tensors():
    args = base()
    out = blockattn.attention(**args, backend="torch")
    lse = torch.zeros(2, 4, 99, device=DEVICE)
    with pytest.raises(ValueError, match="lse"):
        blockattn.attention_backward(out, args["q"], args["k"], args["v"], out, lse, backend="torch")
    with pytest.raises(ValueError, match="grad_out"):
        blockattn.attention_backward(out[..., :16], args["q"], args["k"], args["v"], out, lse, backend="torch")


def test_dense_masks_are_built_once_per_shape(monkeypatch):
    """blocks=None reuses one dense BlockSparsity per (block size, lengths, device), so a causal call's lists are
    not rebuilt every call; other lengths or block sizes get their own, and results do not change."""
    from blockattn import api
    from blockattn.sparsity import BlockSparsity

    api._cached_dense.cache_clear()
    built = []
    original = BlockSparsity.dense.__func__
    monkeypatch.setattr(BlockSparsity, "dense",
                        classmethod(lambda cls, *a, **kw: built.append(a) or original(cls, *a, **kw)))
    q, k, v = qkv(1, 2, 96, 32, seed=9)
    first = blockattn.attention(q, k, v, None, (32, 32), is_causal=True)
    second = blockattn.attention(q, k, v, None, (32, 32), is_causal=True)
    assert torch.equal(first, second) and len(built) == 1
    blockattn.attention(q, k, v, None, (32, 16), is_causal=True)
    q2, k2, v2 = qkv(1, 2, 64, 32, seed=9)
    blockattn.attention(q2, k2, v2, None, (32, 32))
    assert len(built) == 3
    with pytest.raises(TypeError, match="block_size"):
        blockattn.attention(q, k, v, None, (32, 32.0))


def test_the_kernels_launch_with_the_inputs_gpu_current(monkeypatch):
    """Triton launches on the current CUDA device, so a call whose tensors live on another GPU (a model spread over
    several) makes theirs current for its launches: the helper, with the current device reported as GPU 1, and its
    use around the forward's and the explicit backward's launches."""
    from blockattn import api
    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "current_device", lambda: 1)
        patched.setattr(torch.cuda, "device", Guard)
        for device in (torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda", 0)):
            with api._on_device(device):
                pass
    assert entered == [torch.device("cuda", 0)], "only a GPU other than the current one is switched to"

    wrapped, devices = api._on_device, []
    monkeypatch.setattr(api, "_on_device", lambda device: devices.append(device) or wrapped(device))
    q, k, v = qkv(1, 2, 64, 16)
    out, lse = blockattn.attention(q, k, v, None, (32, 32), return_lse=True, backend="triton")
    blockattn.attention_backward(torch.ones_like(out), q, k, v, out, lse, None, (32, 32), backend="triton")
    assert devices == [q.device, q.device], "the forward and the backward launch under the guard"


@pytest.fixture
def gluon_runs(monkeypatch) -> list:
    """The names of the warp-specialized Gluon launchers (attention_forward_ws, attention_backward_ws) in the order
    they ran from here on."""
    from blockattn.kernels import backward_ws, forward_ws
    ran = []
    for module, name in ((forward_ws, "attention_forward_ws"), (backward_ws, "attention_backward_ws")):
        def spy(*args, run=getattr(module, name), name=name):
            ran.append(name)
            return run(*args)
        monkeypatch.setattr(module, name, spy)
    return ran


@pytest.mark.parametrize("heads, kv_heads, block", [(4, 4, (128, 128)), (4, 4, (128, 64)), (4, 2, (128, 64))])
def test_a_step_making_its_mask_is_captured_whole_and_replays_a_new_mask(monkeypatch, gluon_runs, heads, kv_heads,
                                                                         block):
    """A training step that makes its BlockSparsity from a mask tensor (a video model's blocks chosen anew each step)
    and runs attention() forward and backward, captured whole in one CUDA graph: replayed after new q, k, v and a new
    mask are copied into its inputs, its output and gradients meet the fp64 oracle on the new mask. On Hopper the
    Gluon forward and backward ran inside the capture (128x64: the paired programs, the backward's preparation
    computed inside the graph, GQA's lists merged there). On the CPU the step runs eagerly on the first mask, then
    on the second, copied in the same way."""
    from blockattn.kernels import backward_ws
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)  # (matched tiles, were anything kept under a capture)
    seq = 512 if ON_GPU else 256
    q, k, v = (t.requires_grad_(True) for t in qkv(1, heads, seq, 128, kv_heads=kv_heads, seed=3))
    new_q, new_k, new_v = qkv(1, heads, seq, 128, kv_heads=kv_heads, seed=4)
    grad_out = torch.randn(q.shape, generator=torch.Generator(device=DEVICE).manual_seed(5), device=DEVICE,
                           dtype=q.dtype)
    first_mask, new_mask = (random_keep(1, heads, seq, seq, block, density=0.4, seed=seed) for seed in (6, 7))
    mask = first_mask.clone()

    def step():
        blocks = blockattn.BlockSparsity.from_mask(mask, block, seq, seq)
        out = blockattn.attention(q, k, v, blocks, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    inputs, new_inputs = (mask, q, k, v), (new_mask, new_q, new_k, new_v)
    if ON_GPU:
        out, *grads = captured_replay(step, inputs, new_inputs)
    else:
        step()
        overwrite(inputs, new_inputs)
        out, *grads = step()
    assert_output_and_gradients(out, grads, new_q, new_k, new_v, expand(new_mask, block, seq, seq), grad_out,
                                tolerance=1e-2)
    hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    # (on a GPU: the warm-up's call and the captured one)
    assert gluon_runs == (["attention_forward_ws", "attention_backward_ws"] * 2 if hopper else [])


@pytest.mark.parametrize("is_causal, block", [(False, (128, 128)), (True, (128, 128)), (False, (128, 64))])
def test_warp_specialized_calls_read_nothing_back(monkeypatch, gluon_runs, is_causal, block):
    """As below, for the calls the warp-specialized Gluon forward and backward take on Hopper (D=128, bf16, 128x128
    blocks, the descriptor-work floor lowered so that a small call qualifies): nothing read back after a first call,
    and both kernels ran (on the CPU the Triton kernels run these shapes under the same check). 128x64 blocks, with
    the paired programs' tiles matched at these sizes (PAIR_MIN_TILES 2): the second call matches them, captures the
    preparation in CUDA graphs (kernels/replay.py) and still reads nothing back."""
    from blockattn.kernels import backward_ws, tma
    monkeypatch.setattr(tma, "MIN_DESCRIPTOR_WORK", 0)
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    seq = 512 if ON_GPU else 256
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, seq, 128))
    keep = torch.rand(1, 2, seq // block[0], seq // block[1], generator=torch.Generator(device=DEVICE).manual_seed(2),
                      device=DEVICE) < 0.5
    keep |= torch.eye(seq // block[0], dtype=torch.bool, device=DEVICE).repeat_interleave(block[0] // block[1], 1)
    blocks = blockattn.BlockSparsity.from_mask(keep, block, seq, seq)
    checks = (False, True) if block[1] == 128 else (False, True, True)
    for check in checks:
        with no_host_reads(monkeypatch) if check else contextlib.nullcontext():
            out = blockattn.attention(q, k, v, blocks, is_causal=is_causal, backend="triton")
            out.float().sum().backward()
    hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    assert gluon_runs == (["attention_forward_ws", "attention_backward_ws"] * len(checks) if hopper else [])


@pytest.mark.parametrize("layout", ["bhsd", "thd"])
def test_prepared_calls_read_nothing_back(monkeypatch, layout):
    """Forward and backward with a prepared BlockSparsity (and, packed, the longest lengths given) never read a
    tensor's values on the host, after a first call (which may compile and tune)."""
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 4, 96, 32, kv_heads=2, dtype=torch.float32))
    kwargs = dict(is_causal=True, backend="triton")
    if layout == "thd":
        q, k, v = (t.detach()[0].transpose(0, 1).requires_grad_(True) for t in (q, k, v))   # [T, H, D]
        cu = torch.tensor([0, 40, 96], dtype=torch.int32, device=DEVICE)
        kwargs.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=56, max_seqlen_kv=56)
        seq = 56
    else:
        seq = 96
    n = -(-seq // 16)
    keep = torch.rand(2 if layout == "thd" else 1, 4, n, n, generator=torch.Generator(device=DEVICE).manual_seed(1),
                      device=DEVICE) < 0.5
    blocks = blockattn.BlockSparsity.from_mask(keep, (16, 16), seq, seq)
    for check in (False, True):
        with no_host_reads(monkeypatch) if check else contextlib.nullcontext():
            out = blockattn.attention(q, k, v, blocks, **kwargs)
            out.sum().backward()
