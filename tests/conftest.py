"""Shared test machinery: the fp64 oracle, the sizes per device, NaN-poisoned buffers and pinned tiles.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
blockattn's kernels are imported) at small sizes; on a GPU the same tests run at full size.
"""

import contextlib
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import blockattn  # noqa: E402
from blockattn.kernels import autotune, buffers, tma  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


@dataclass(frozen=True)
class Geometry:
    """Sizes for this device: the GPU runs the reference suites' sizes, the CPU interpreter scaled copies with the
    same structure (ragged tails, a sub tile wholly past the end, several blocks per axis)."""
    batch: int
    heads: int
    dim: int
    block: tuple          # (block_q, block_kv)
    tile: tuple           # pinned (BLOCK_M, BLOCK_N): nests in block, narrower than it
    seqs: tuple           # ragged lengths
    sub_tile_seq: int     # divisible by the tile width, not by the block width


GEOMETRY = (Geometry(2, 4, 64, (128, 64), (64, 32), (1000, 970), 992) if ON_GPU
            else Geometry(1, 2, 32, (64, 32), (32, 16), (250, 230), 240))


@pytest.fixture
def geometry() -> Geometry:
    return GEOMETRY


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape, dtype=torch.bfloat16, gen=None):
    gen = gen if gen is not None else make_generator(0)
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def qkv(batch, heads, seq_q, dim, *, kv_heads=None, seq_kv=None, dim_v=None, dtype=torch.bfloat16, seed=0):
    gen = make_generator(seed)
    kv_heads, seq_kv, dim_v = kv_heads or heads, seq_kv or seq_q, dim_v or dim
    return (randn(batch, heads, seq_q, dim, dtype=dtype, gen=gen), randn(batch, kv_heads, seq_kv, dim, dtype=dtype, gen=gen),
            randn(batch, kv_heads, seq_kv, dim_v, dtype=dtype, gen=gen))


def random_keep(batch, heads, seq_q, seq_kv, block, density=0.4, seed=1):
    """A random block mask with the block diagonal kept (so no row is empty unless a test empties it)."""
    nq, nk = math.ceil(seq_q / block[0]), math.ceil(seq_kv / block[1])
    keep = torch.rand(batch, heads, nq, nk, generator=make_generator(seed), device=DEVICE) < density
    rows = torch.arange(nq, device=DEVICE)[:, None] * block[0]
    cols = torch.arange(nk, device=DEVICE)[None, :] * block[1]
    diagonal = (cols < rows + block[0]) & (rows < cols + block[1])
    return keep | diagonal


def mostly_whole_kv_valid(batch: int, nk: int, block_kv: int, seed: int) -> torch.Tensor:
    """A kv_valid int32 [batch, nk] as video tiles give it: about 60% of the key blocks wholly real, the others a
    random count of real keys in 0..block_kv - 1."""
    gen = make_generator(seed)
    partial = torch.randint(0, block_kv, (batch, nk), generator=gen, device=DEVICE)
    whole = torch.rand(batch, nk, generator=gen, device=DEVICE) < 0.6
    return torch.where(whole, block_kv, partial).to(torch.int32)


def real_keys(kv_valid, block_kv: int, seq_kv: int) -> torch.Tensor:
    """bool [Bv, Sk]: the keys kv_valid int32 [Bv, nk] marks real (the first kv_valid[b, j] of key block j)."""
    within = torch.arange(seq_kv, device=kv_valid.device) % block_kv
    return within < kv_valid.repeat_interleave(block_kv, -1)[..., :seq_kv]


def expand(keep, block, seq_q, seq_kv):
    """The token mask [.., Sq, Sk] a block mask stands for."""
    while keep.ndim < 4:
        keep = keep.unsqueeze(0)
    return keep.bool().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :seq_q, :seq_kv]


def oracle(q, k, v, token_mask=None, scale=None, is_causal=False):
    """fp64 dense attention over a token mask; rows that see nothing give zeros and LSE -inf (the contract).
    Returns (out, lse); differentiable in q, k, v (autograd gives the oracle's gradients)."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = qd @ kd.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    visible = torch.ones(scores.shape, dtype=torch.bool, device=q.device)
    if token_mask is not None:
        visible = visible & token_mask
    if is_causal:
        visible = visible & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    seen = visible.any(-1, keepdim=True)
    # Rows that see nothing get all-zero scores (a harmless softmax) and are then zeroed: finite gradients.
    scores = torch.where(seen, scores.masked_fill(~visible, -math.inf), torch.zeros_like(scores))
    out = (torch.softmax(scores, -1) * seen) @ vd
    lse = torch.where(seen[..., 0], torch.logsumexp(scores, -1), torch.full_like(scores[..., 0], -math.inf))
    return out, lse


def rel_error(got, want, rows=None):
    """||got - want|| / ||want|| over the given rows (a bool [.., S] selection) or all."""
    diff, ref = got.double() - want.double(), want.double()
    if rows is not None:
        diff, ref = diff[rows], ref[rows]
    return (diff.norm() / ref.norm().clamp_min(1e-30)).item()


def assert_one_ulp(got, want, label=""):
    """Elementwise within one unit in the last place of the value, plus one ulp of the tensor's scale (the floor
    for values near zero, where a different rounding order moves the last bit of a much smaller number)."""
    if torch.equal(got, want):
        return
    eps = torch.finfo(got.dtype).eps
    gap = (got.float() - want.float()).abs()
    bound = eps * want.float().abs() + eps * want.float().abs().max()
    worst = (gap - bound).max().item()
    assert worst <= 0, (f"{label}: max gap {gap.max().item():.3e} over {int((got != want).sum())} elements exceeds "
                        f"one ulp")


def sdpa_error(q, k, v, visible, want, rows):
    """Error of dense SDPA in the inputs' dtype on the same token mask: the yardstick for every backend."""
    group = q.shape[1] // k.shape[1]
    # copies: PyTorch's memory-efficient CUDA kernel (fp32 with a mask) faults on a view that starts off a 16-byte
    # boundary, which some tests' inputs are
    got = F.scaled_dot_product_attention(q.clone(), k.repeat_interleave(group, 1).clone(),
                                         v.repeat_interleave(group, 1).clone(), attn_mask=visible)
    return rel_error(got, want, rows)


def output_and_lse_loss(out, lse, grad_out):
    """A loss through both of attention's outputs: <out, grad_out> plus half the sum of the LSE over rows that see a
    key (the others hold -inf). Its LSE share reaches q and k through the backward's row terms."""
    return (out * grad_out).sum() + 0.5 * torch.where(torch.isinf(lse), 0, lse).sum()


def assert_output_and_gradients(out, grads, q, k, v, visible, grad_out, *, tolerance, is_causal=False, label="",
                                through_lse=False):
    """out and grads (dq, dk, dv for the output gradient grad_out) each within `tolerance` relative error of the
    fp64 oracle's for inputs q, k, v over the token mask visible, and finite (out None: the gradients only).
    through_lse: grads are those of output_and_lse_loss(out, lse, grad_out) instead."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = oracle(*leaves, visible, is_causal=is_causal)
    if through_lse:
        want = torch.autograd.grad(output_and_lse_loss(want_out, want_lse, grad_out.double()), leaves)
    else:
        want = torch.autograd.grad(want_out, leaves, grad_out.double())
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (want_out, *want)):
        if got is None:
            continue
        err = rel_error(got, ref)
        assert torch.isfinite(got).all() and err < tolerance, f"{label}{name} relative error {err:.2e}"


def check_against_oracle(out, lse, q, k, v, visible, *, scale=None, is_causal=False, factor=4.0, lse_tolerance=1e-3):
    """out within `factor` times dense SDPA's error (same dtype) of the fp64 oracle on rows that see a key, and
    the LSE within lse_tolerance times the largest |LSE| (at least 1); rows that see nothing are exactly zero with
    LSE -inf."""
    want, want_lse = oracle(q, k, v, visible, scale=scale, is_causal=is_causal)
    if is_causal:
        visible = visible & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    rows = visible.expand(*want.shape[:3], k.shape[2]).any(-1)
    assert torch.isfinite(out).all(), "non-finite output"
    assert (out[~rows] == 0).all(), "a row that sees no key is not zero"
    assert torch.isneginf(lse[~rows]).all(), "a row that sees no key has LSE other than -inf"
    if scale is None:
        baseline = sdpa_error(q, k, v, visible, want, rows)
    else:
        baseline = sdpa_error(q * (scale * q.shape[-1] ** 0.5), k, v, visible, want, rows)
    floor = 8 * torch.finfo(q.dtype).eps
    err = rel_error(out, want, rows)
    assert err <= factor * baseline + floor, f"error {err:.3e} vs dense SDPA's {baseline:.3e} (factor {factor})"
    lse_err = (lse[rows].double() - want_lse[rows]).abs().max().item()
    assert lse_err <= lse_tolerance * max(1.0, want_lse[rows].abs().max().item()), f"LSE off by {lse_err:.3e}"


@pytest.fixture(autouse=True)
def one_tile_per_kernel(request, monkeypatch):
    """Each kernel launches its first candidate tile that nests and fits, without benchmarking (the interpreter
    does this anyway): on a GPU the autotuner would compile four or five tiles per kernel variant, most of a cold
    suite's time. tests/test_tiles.py runs every candidate against the oracle; tests marked `autotuned` keep the
    autotuner."""
    if request.node.get_closest_marker("autotuned") is None:
        monkeypatch.setattr(autotune, "_MAX_TUNED", dict.fromkeys(autotune._MAX_TUNED, 1))


@pytest.fixture(autouse=True)
def descriptors_at_every_size(monkeypatch):
    """The suite's shapes are small: without this the launchers would keep descriptors off (below
    tma.MIN_DESCRIPTOR_WORK) and the descriptor path would go untested (test_tma.py tests the threshold)."""
    monkeypatch.setattr(tma, "MIN_DESCRIPTOR_WORK", 0)


@pytest.fixture
def launched_kernels(monkeypatch) -> list:
    """The kernels the launchers launch from here on, in order (launch.run observed)."""
    from blockattn.kernels import launch
    launched = []
    run = launch.run

    def spy(kernel_fn, *args, **kwargs):
        launched.append(kernel_fn)
        return run(kernel_fn, *args, **kwargs)
    monkeypatch.setattr(launch, "run", spy)
    return launched


@pytest.fixture
def tuner_launches(monkeypatch) -> list:
    """(kernel, keyword arguments, config run) of every launch through autotune.launch from here on: with the plan
    table emptied first, each kernel's first launch (on a GPU later ones relaunch a plan instead)."""
    from blockattn.kernels import launch
    monkeypatch.setattr(launch, "_PLANS", {})
    launches = []
    launch_fn = autotune.launch

    def record(kernel_fn, *args, **kwargs):
        compiled, config = launch_fn(kernel_fn, *args, **kwargs)
        launches.append((kernel_fn, kwargs, config))
        return compiled, config
    monkeypatch.setattr(autotune, "launch", record)
    return launches


@pytest.fixture
def poisoned(monkeypatch):
    """The launchers' outputs (and the backward's row terms) start as NaN (integer buffers as their type's least
    value, which the int8 quantizer never writes), so an element a kernel never wrote shows up."""
    def empty(*shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min, dtype=dtype,
                          device=device)

    def empty_like(tensor):
        return torch.full_like(tensor, float("nan"))

    def empty_strided(shape, stride, dtype, device):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(float("nan"))
    monkeypatch.setattr(buffers, "empty", empty)
    monkeypatch.setattr(buffers, "empty_like", empty_like)
    monkeypatch.setattr(buffers, "empty_strided", empty_strided)


def pin(monkeypatch, tile, kernels=("FWD", "BWD_DQ", "BWD_DKDV")):
    """Pin every kernel's autotuner to one tile, so two arms of a bitwise comparison compile the same code."""
    for kernel in kernels:
        monkeypatch.setenv(f"BLOCKATTN_{kernel}_BLOCK_M", str(tile[0]))
        monkeypatch.setenv(f"BLOCKATTN_{kernel}_BLOCK_N", str(tile[1]))
        monkeypatch.setenv(f"BLOCKATTN_{kernel}_NUM_WARPS", "4")
        monkeypatch.setenv(f"BLOCKATTN_{kernel}_NUM_STAGES", "2")


@pytest.fixture
def pinned(monkeypatch, geometry):
    pin(monkeypatch, geometry.tile)
    return geometry.tile


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for one test, restored after: on a GPU the PyTorch backend's
    fused attention (memory-efficient SDPA) otherwise accumulates its dQ in no fixed order."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def kernel(q, k, v, blocks=None, block_size=None, **kwargs):
    return blockattn.attention(q, k, v, blocks, block_size, backend="triton", **kwargs)


_SM90_REPORT = """
import json, os, re, subprocess, sys, tempfile
import torch, triton
from blockattn.kernels import backward_ws, forward_ws
compiled = eval(sys.argv[1])
ptx = compiled.asm["ptx"]
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
    cubin.write(compiled.asm["cubin"])
    cubin.flush()
    usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
print(json.dumps(dict(
    registers=sorted(set(int(n) for n in re.findall(r"setmaxnreg\\.(?:inc|dec)\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx))),
    wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
    reduction=re.search(r"cp\\.reduce\\.async\\.bulk\\.tensor\\S*\\.add", ptx) is not None,
    shared=compiled.metadata.shared, usage=next(line for line in usage.splitlines() if "REG:" in line))))
"""


def stack_bytes(report: dict) -> int:
    """Bytes of stack frame per thread in an sm90_report's resource line: where ptxas puts spilled registers (the
    kernels have no calls and no local arrays, whose LOCAL count stays 0 either way)."""
    return int(re.search(r"STACK:(\d+)", report["usage"]).group(1))


def sm90_report(call: str) -> dict:
    """Compile a Gluon kernel for sm_90 ahead of time in a process of its own (under the interpreter, this suite on
    a CPU, Gluon's helpers are not compilable): call, e.g. "forward_ws.compile_sm90(128, 64)", evaluated there.
    Its setmaxnreg counts, whether the PTX has wgmma, TMA copies and TMA add reductions, its shared memory and
    cuobjdump's resource line."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _SM90_REPORT, call], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def meta(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    """An empty tensor on the meta device: the dispatch tests read shapes, dtypes and strides only."""
    return torch.empty(*shape, device="meta", dtype=dtype)


# Changes to q [2, 4, 1000, 128] and k = v [2, 2, 1024, 128] (a call both warp-specialized kernels take) that
# neither can: declined_tensors names them.
DECLINED_TENSORS = ("fp32", "mixed dtypes", "head dim 96", "value dim 64", "ragged keys", "unaligned stride",
                    "strided last dim", "unaligned start", "batch-broadcast keys")


def declined_tensors(change: str) -> tuple:
    """(q, k, v) with one of DECLINED_TENSORS' changes (meta tensors, but for "unaligned start": a CPU view one
    element into its storage)."""
    q, k = meta(2, 4, 1000, 128), meta(2, 2, 1024, 128)
    v = k
    if change == "fp32":
        q, k, v = (t.float() for t in (q, k, v))
    elif change == "mixed dtypes":
        v = meta(2, 2, 1024, 128, dtype=torch.float16)
    elif change == "head dim 96":  # not in the kernels' HEAD_DIMS (64, 128)
        q, k, v = meta(2, 4, 1000, 96), meta(2, 2, 1024, 96), meta(2, 2, 1024, 96)
    elif change == "value dim 64":
        v = meta(2, 2, 1024, 64)
    elif change == "ragged keys":  # the sequence's end inside a key block needs element tests
        k = v = meta(2, 2, 1000, 128)
    elif change == "unaligned stride":  # rows 129 elements apart: 258 bytes, not a multiple of 16
        k = v = meta(2, 2, 1024, 129)[..., :128]
    elif change == "strided last dim":
        k = v = meta(2, 2, 1024, 256)[..., ::2]
    elif change == "unaligned start":
        k = v = torch.empty(2 * 2 * 1024 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 2, 1024, 128)
    elif change == "batch-broadcast keys":  # one k and v for every batch entry: stride 0, which TMA cannot take
        k = v = meta(1, 2, 1024, 128).expand(2, 2, 1024, 128)
    else:
        raise ValueError(f"change: {change!r} is not one of {DECLINED_TENSORS}")
    return q, k, v


def set_grid(monkeypatch, grid) -> None:
    """The warp-specialized forward's grid at D=64 and 128, causal or not, for the test (forward_ws.grid_settings:
    None a program a tile, "turns" the items in turn, "claimed" claimed from a counter)."""
    from blockattn.kernels import forward_ws  # (Gluon's module: imported where a test needs it)
    for setting, dims in forward_ws.grid_settings(grid).items():
        monkeypatch.setattr(forward_ws, setting, dims)


def interpreter_share(batch, heads, kv_heads, seq_q, seq_kv, block):
    """(heads, kv_heads, seq_q, seq_kv) for an oracle case: on a GPU as given; on the CPU (Triton's interpreter) two
    blocks a side plus the same query tail, two kv heads at most."""
    if ON_GPU:
        return heads, kv_heads, seq_q, seq_kv
    return min(heads, 2 * kv_heads, 4), min(kv_heads, 2), 2 * block[0] + seq_q % block[0], 2 * block[1]


def overwrite(inputs: tuple, new_inputs: tuple) -> None:
    """Each of inputs overwritten in place with its new_inputs counterpart (leaves that require grad too)."""
    with torch.no_grad():
        for tensor, new in zip(inputs, new_inputs):
            tensor.copy_(new)


def captured_replay(fn, inputs: tuple, new_inputs: tuple, warm_up=None):
    """GPU only: fn() captured in a CUDA graph (after one eager call of warm_up, fn by default, on a side stream, for
    libraries' lazy initialization, which a capture refuses), inputs then overwritten in place with new_inputs, the
    graph replayed: fn's captured output, which now holds its result for new_inputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (fn if warm_up is None else warm_up)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    overwrite(inputs, new_inputs)
    graph.replay()
    return captured


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Fails any read of a tensor's values back to the host: CUDA's sync debug mode on a GPU; on the CPU, where
    nothing synchronizes, the reads themselves (Tensor.item, Tensor.tolist) are made to fail."""
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    with monkeypatch.context() as patch:
        for name in ("item", "tolist"):
            patch.setattr(torch.Tensor, name, lambda self, name=name: pytest.fail(f"Tensor.{name} read a value"))
        yield


def row_bounds(q, k) -> torch.Tensor:
    """fp32 [B, H, Sq]: each query row's bound on its scaled scores (log2 units), as the forwards with fixed offsets
    take it (forward.FIXED_OFFSET_DIMS, forward_ws.FIXED_OFFSET_DIMS): scale * log2(e) * |q_row| * the largest |k|
    of its kv head."""
    group = q.shape[1] // k.shape[1]
    key_norms = k.float().norm(dim=-1).amax(-1).repeat_interleave(group, 1)
    return q.shape[-1] ** -0.5 * math.log2(math.e) * q.float().norm(dim=-1) * key_norms[..., None]


def aligned_scores(q, k, largest_bound: float):
    """q and k (fp32, shaped like the given ones) whose scores rise past each list's first key tile by nearly their
    bound: within each kv head's group the queries and keys lie near one random direction, keys 0-255 (the first
    tile of every list that keeps them) shortened a hundredfold, the queries scaled so that the largest of the rows'
    bounds (row_bounds) is largest_bound."""
    batch, kv_heads, seq_kv, dim = k.shape
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    direction = torch.randn(batch, kv_heads, 1, dim, generator=gen, device=DEVICE)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    group = q.shape[1] // kv_heads
    k = 8 * direction + 0.3 * torch.randn(k.shape, generator=gen, device=DEVICE)
    k[:, :, :256] *= 0.01
    q = 8 * direction.repeat_interleave(group, 1) + 0.3 * torch.randn(q.shape, generator=gen, device=DEVICE)
    return q * (largest_bound / row_bounds(q, k).max()), k
