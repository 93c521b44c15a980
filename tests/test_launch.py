"""Launch plans: a relaunch puts the new call's tensors in every tensor and descriptor slot, anything a kernel is
specialized on makes a new plan, a plan keeps no tensor alive, and repeated real calls stay exact."""

import collections
import gc
import weakref

import pytest
import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from blockattn.kernels import autotune, backward, forward, launch, lists
from conftest import (DEVICE, ON_GPU, assert_output_and_gradients, check_against_oracle, expand, kernel, meta,
                      qkv, random_keep, set_grid)

ARG_NAMES = ("X", "X_DESC", "Out", "n", "BLOCK")
CONFIG = triton.Config({"BLOCK": 32}, num_warps=4, num_stages=2)


class FakeCompiled:
    """Stands in for Triton's CompiledKernel: records what the plan launches."""
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)

    def launch_metadata(self, grid, stream, *args):
        return "metadata"


class FakeKernelFn:
    """Stands in for a JITFunction: its names and a binder that binds the way Triton's does (mismatch: a binder
    that gives another argument list)."""

    def __init__(self, mismatch=False):
        self.arg_names = ARG_NAMES
        self.__name__ = "fake_kernel"

        def binder(**kwargs):
            bound = {name: kwargs[name] for name in ARG_NAMES}
            if mismatch:
                bound["n"] = object()
            return bound, [], {}
        self.device_caches = collections.defaultdict(lambda: (None, None, None, None, binder))


class FakeDriver:
    class active:
        @staticmethod
        def get_current_stream(device):
            return "stream"


@pytest.fixture
def fakes(monkeypatch):
    """(compiled kernel, launches through the full path, builds): autotune.launch and the driver faked."""
    compiled, full, builds = FakeCompiled(), [], []

    def fake_launch(kernel_fn, grid, configs, key, reset_to_zero=(), pre_hook=None, **kwargs):
        full.append(kwargs)
        return compiled, CONFIG
    monkeypatch.setattr(autotune, "launch", fake_launch)
    monkeypatch.setattr(launch, "driver", FakeDriver)
    monkeypatch.setattr(launch, "_PLANS", {})
    return compiled, full, builds


def call(kernel_fn, x, out, builds, site=("site",), fresh=()):
    def build():
        builds.append(x)
        return launch.LaunchSpec(grid=lambda meta: (meta["n"] // meta["BLOCK"], 2), configs=[CONFIG],
                                 tuning_key=(), static={"X_DESC": TensorDescriptor.from_tensor(x, [2, 16]), "n": 64})
    launch.run(kernel_fn, site, {"X": x, "X_DESC": x, "Out": out}, build, fresh=fresh)


def test_a_relaunch_puts_the_new_tensors_in_every_slot(fakes):
    compiled, full, builds = fakes
    fn = FakeKernelFn()
    x1, out1 = torch.randn(4, 16), torch.empty(4, 16)
    call(fn, x1, out1, builds)
    assert len(builds) == 1 and len(full) == 1 and full[0]["X"] is x1 and full[0]["n"] == 64
    x2, out2 = torch.randn(4, 16), torch.empty(4, 16)
    call(fn, x2, out2, builds)
    assert len(builds) == 1 and len(full) == 1, "a second call of the same shapes must relaunch the plan"
    grid0, grid1, grid2, stream, function, packed, metadata, enter, leave, *args = compiled.runs[-1]
    assert (grid0, grid1, grid2, stream, function, packed) == (2, 2, 1, "stream", "function", "packed")
    x_arg, desc, out_arg, n, block = args
    # tensors go in as their data pointers (the launcher then skips its driver query), descriptors as descriptors
    assert x_arg == x2.data_ptr() and out_arg == out2.data_ptr() and (n, block) == (64, 32)
    assert isinstance(desc, TensorDescriptor) and desc.base is x2
    assert (list(desc.shape), list(desc.strides), desc.block_shape) == (list(x2.shape), list(x2.stride()), [2, 16])


def test_a_relaunch_passes_triton_launch_hooks_only_where_one_is_registered(fakes, monkeypatch):
    """An empty hook chain (what Triton 3.6 on keeps) goes in as None, with no launch metadata built; a registered
    hook goes in with the metadata, as Triton's own launch passes them."""
    compiled, full, builds = fakes
    fn = FakeKernelFn()
    for _ in range(2):
        call(fn, torch.randn(4, 16), torch.empty(4, 16), builds)
    chain = type(knobs.runtime.launch_enter_hook)
    metadata, enter, leave = compiled.runs[-1][6:9]
    if hasattr(chain, "add"):  # a Triton with hook chains
        assert (metadata, enter, leave) == (None, None, None)
        hook = chain()
        hook.add(lambda metadata: None)
    else:
        hook = lambda metadata: None  # noqa: E731 (an older Triton: a plain callable or None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    call(fn, torch.randn(4, 16), torch.empty(4, 16), builds)
    metadata, enter, leave = compiled.runs[-1][6:9]
    assert len(builds) == 1 and metadata == "metadata" and enter is hook


# The descriptor metadata the fake compiled kernel carries (one entry: its one descriptor argument, X_DESC).
DESCRIPTOR_META = {"swizzle": 128}


def triton_like_launcher(compiled_calls: list, encoded: list):
    """A launcher built as Triton 3.6 builds one (3.9 differs only in passing the kernel's arguments as one tuple):
    its `launch` wraps the compiled launcher and expands the descriptor argument X_DESC (make_tensordesc_arg with
    DESCRIPTOR_META: a tensor map, here a tuple naming the address, then shape and strides), encoding it on every
    launch. compiled_calls gets what the compiled launcher is given, encoded each address encoded."""
    descriptor_position = ARG_NAMES.index("X_DESC")
    def make_tensordesc_arg(arg, metadata):
        encoded.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), metadata["swizzle"], tuple(arg.block_shape)), *arg.shape, *arg.strides]

    def wrap(launcher):
        def inner(*args):  # 5 launch arguments, then metadata, launch metadata, two hooks, the kernel's arguments
            final = list(args[:9])
            for i, arg in enumerate(args[9:]):
                final.extend(make_tensordesc_arg(arg, DESCRIPTOR_META) if i == descriptor_position else [arg])
            return launcher(*final)
        return inner

    class Launcher:
        def __init__(self):
            self.launch = wrap(lambda *args: compiled_calls.append(args))

        def __call__(self, grid0, grid1, grid2, stream, function, *args):
            self.launch(grid0, grid1, grid2, stream, function, *args)
    return Launcher()


@pytest.fixture
def triton_like(fakes, monkeypatch):
    """(compiled kernel whose launcher is triton_like_launcher's, what its compiled launcher got, addresses
    encoded): the fakes fixture's compiled kernel with a Triton-like launcher and descriptor metadata."""
    compiled, full, builds = fakes
    compiled_calls, encoded = [], []
    compiled.run = triton_like_launcher(compiled_calls, encoded)
    compiled.metadata = type("Metadata", (), {"tensordesc_meta": [DESCRIPTOR_META]})()
    return compiled, compiled_calls, encoded, builds


def test_a_relaunch_expands_descriptors_as_triton_would_and_encodes_an_address_once(triton_like, monkeypatch):
    """Through a plan, the compiled launcher gets what Triton's own wrapper would give it for the same call (each
    descriptor expanded into its tensor map, shape and strides), and a descriptor slot encodes a tensor map only
    for an address it has not seen: the first launch's is kept, a new tensor at a new address is encoded once."""
    compiled, compiled_calls, encoded, builds = triton_like
    fn = FakeKernelFn()
    x1 = torch.randn(4, 16)
    call(fn, x1, torch.empty(4, 16), builds)
    assert launch.plans() and next(iter(launch.plans().values())).expanded is not None
    assert encoded == [x1.data_ptr()], "the plan encodes the first launch's map once, to check its expansion"
    x2, out2 = torch.randn(4, 16), torch.empty(4, 16)
    for _ in range(3):
        call(fn, x2, out2, builds)
    assert len(builds) == 1 and encoded == [x1.data_ptr(), x2.data_ptr()], "one new address, one encoding"
    got = compiled_calls[-1]
    # what Triton's wrapper gives the compiled launcher for the same call, through the full launch path
    compiled.run(2, 2, 1, "stream", "function", "packed", None, None, None, x2.data_ptr(),
                 TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [2, 16]), out2.data_ptr(), 64, 32)
    assert got == compiled_calls[-1]
    call(fn, x1, out2, builds)
    assert encoded[-1] == x2.data_ptr() and compiled_calls[-1][10][1] == x1.data_ptr(), "x1's map was kept"
    monkeypatch.setattr(launch, "EXPAND_DESCRIPTORS", False)  # switched off: Triton's wrapper encodes every launch
    before = len(encoded)
    call(fn, x1, out2, builds)
    assert len(encoded) == before + 1 and compiled_calls[-1][10][1] == x1.data_ptr()


def test_the_kept_tensor_maps_are_bounded_and_keep_no_tensor_alive(fakes, triton_like, monkeypatch):
    """A slot keeps at most ExpandedArgs.MAX_MAPS maps, and what it keeps holds no tensor: a tensor launched
    through a plan is freed once the caller drops it."""
    compiled, compiled_calls, encoded, builds = triton_like
    full = fakes[1]
    monkeypatch.setattr(launch.ExpandedArgs, "MAX_MAPS", 2)
    fn = FakeKernelFn()
    xs = [torch.randn(4, 16) for _ in range(5)]
    watched = weakref.ref(xs[0])
    for x in xs:
        call(fn, x, torch.empty(4, 16), builds)
    plan, = launch.plans().values()
    (*_, maps), = plan.expanded.descriptor_slots
    assert len(maps) <= 2 and len(encoded) == 5
    full.clear()  # (the fakes' record of the first launch)
    builds.clear()
    del xs, x
    gc.collect()
    assert watched() is None


def test_an_enter_hook_or_an_unexpected_launcher_takes_tritons_path(triton_like, monkeypatch):
    """A registered launch enter hook gets launch metadata from the unexpanded arguments: the relaunch then goes
    through the kernel's launcher with descriptors. A launcher without the wrapper Triton 3.6 and 3.9 build, or
    descriptor metadata that does not match the descriptors, gets no expanded arguments."""
    compiled, compiled_calls, encoded, builds = triton_like
    fn = FakeKernelFn()
    call(fn, torch.randn(4, 16), torch.empty(4, 16), builds)
    chain = type(knobs.runtime.launch_enter_hook)
    hook = chain() if hasattr(chain, "add") else (lambda metadata: None)
    if hasattr(hook, "add"):
        hook.add(lambda metadata: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    before = len(encoded)
    call(fn, torch.randn(4, 16), torch.empty(4, 16), builds)
    assert len(encoded) == before + 1 and compiled_calls[-1][7] is hook, "Triton's wrapper encoded it"
    for broken in ("no wrapper", "metadata"):
        monkeypatch.setattr(launch, "_PLANS", {})
        compiled.run = triton_like_launcher(compiled_calls, encoded)
        if broken == "no wrapper":
            compiled.run.launch = lambda *args: compiled_calls.append(args)
        else:
            compiled.metadata.tensordesc_meta = [None]
        call(fn, torch.randn(4, 16), torch.empty(4, 16), builds)
        plan, = launch.plans().values()
        assert plan.expanded is None, broken


def test_what_a_kernel_is_specialized_on_makes_a_new_plan(fakes):
    compiled, full, builds = fakes
    fn = FakeKernelFn()
    call(fn, torch.randn(4, 16), torch.empty(4, 16), builds)
    variants = [
        ("strides", torch.randn(4, 32)[:, :16], torch.empty(4, 16), ("site",), True),
        ("dtype", torch.randn(4, 16, dtype=torch.float64), torch.empty(4, 16), ("site",), True),
        ("a base 4 bytes off alignment", torch.randn(4 * 16 + 1)[1:].view(4, 16), torch.empty(4, 16), ("site",),
         True),
        ("the launcher's scalars or switches", torch.randn(4, 16), torch.empty(4, 16), ("other site",), True),
        ("an output 64 bytes in (same alignment)", torch.randn(4, 16), torch.empty(5, 16)[1:], ("site",), False),
    ]
    for label, x, out, site, new_plan in variants:
        before = len(builds)
        try:
            call(fn, x, out, builds, site)
        except AssertionError:  # Triton refuses a descriptor over a misaligned base (the launchers check first)
            assert x.data_ptr() % 16, label
        assert (len(builds) > before) == new_plan, label


def test_a_fresh_buffer_is_left_out_of_the_key_and_still_relaunched_in_its_slot(fakes):
    """A buffer the launcher allocates (fresh) does not enter the plan key: another layout of it reuses the plan
    (the launchers guarantee its layout follows from the keyed tensors), and the relaunch passes the new one."""
    compiled, full, builds = fakes
    fn = FakeKernelFn()
    call(fn, torch.randn(4, 16), torch.empty(4, 16), builds, fresh=("Out",))
    out = torch.empty(4, 32)[:, :16]
    call(fn, torch.randn(4, 16), out, builds, fresh=("Out",))
    assert len(builds) == 1 and compiled.runs[-1][9 + 2] == out.data_ptr()
    call(fn, torch.randn(4, 16), torch.empty(4, 32)[:, :16], builds)
    assert len(builds) == 2, "keyed, another output layout makes a new plan"


def test_layout_key_has_one_entry_per_name_and_looks_at_a_shared_tensor_once():
    a, same_as_a, b = torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 32)[:, :16]
    key = launch.layout_key
    assert key({"A": a, "B": a}) == key({"A": a, "B": same_as_a}) == (launch.tensor_key(a),) * 2
    # which name gets which layout stays in the key when tensors are shared
    assert key({"A": a, "B": a, "C": b}) != key({"A": a, "B": b, "C": b})
    assert key({"A": a, "B": b}, fresh=("B",)) == key({"A": a})
    # each of tensor_key's parts is in the key: shape, strides, dtype and the start's 16-byte alignment
    for other in (torch.randn(16, 4), torch.randn(4, 32)[:, ::2], a.half(), torch.randn(65)[1:].view(4, 16)):
        assert key({"A": other}) == (launch.tensor_key(other),) != key({"A": a})


def test_layout_keys_shared_between_launches_equal_their_own():
    """A launcher's launches share one seen dict: each key is the one the launch alone would get, each tensor is
    looked at once, and an entry under a tensor's id that holds another tensor (an id reused) is not trusted."""
    a, b, c = torch.randn(4, 16), torch.randn(8, 16)[:, :8], torch.randn(2, 3).half()
    seen = {}
    first, second = {"A": a, "B": b}, {"B": b, "C": c, "D": a}
    assert launch.layout_key(first, seen=seen) == launch.layout_key(first)
    assert launch.layout_key(second, seen=seen) == launch.layout_key(second)
    assert sorted(seen) == sorted(map(id, (a, b, c))) and all(seen[id(t)][0] is t for t in (a, b, c))
    stale = {id(b): (a, launch.tensor_key(a))}
    assert launch.layout_key({"B": b}, seen=stale) == (launch.tensor_key(b),) != (launch.tensor_key(a),)


def test_a_plan_keeps_no_tensor_alive(fakes):
    compiled, full, builds = fakes
    x, out = torch.randn(4, 16), torch.empty(4, 16)
    watched = weakref.ref(x)
    call(FakeKernelFn(), x, out, builds)
    full.clear()
    builds.clear()
    del x
    gc.collect()
    assert watched() is None and len(launch.plans()) == 1


def test_no_plan_where_the_binder_disagrees(fakes):
    compiled, full, builds = fakes
    fn = FakeKernelFn(mismatch=True)
    for _ in range(2):
        call(fn, torch.randn(4, 16), torch.empty(4, 16), builds)
    assert len(full) == 2 and not launch.plans()


def test_the_plan_table_is_bounded(fakes, monkeypatch):
    compiled, full, builds = fakes
    monkeypatch.setattr(launch, "_MAX_PLANS", 2)
    for width in (16, 32, 48):
        call(FakeKernelFn(), torch.randn(4, width), torch.empty(4, width), builds)
    assert len(launch.plans()) <= 2


def _call_against_the_oracle(q, k, v, keep, block, seen, seed, **kwargs):
    """One forward and backward of kernel(q, k, v, keep, block, **kwargs) against the fp64 oracle over the token
    mask seen: out and LSE, then dq, dk, dv for a random upstream gradient (finite, within 2e-2)."""
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    is_causal = kwargs.get("is_causal", False)
    out, lse = kernel(q, k, v, keep, block, return_lse=True, **kwargs)
    check_against_oracle(out.detach(), lse.detach(), q.detach(), k.detach(), v.detach(), seen, is_causal=is_causal)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert_output_and_gradients(None, got, q, k, v, seen, grad, tolerance=2e-2, is_causal=is_causal,
                                label=f"seed {seed}: ")


@pytest.mark.autotuned  # on a GPU also the tuner's path: pre-hooks and zeroed accumulators while benchmarking
@pytest.mark.parametrize("dq_mode", ["kernel", "atomic"])
def test_repeated_calls_with_fresh_tensors_stay_exact(geometry, poisoned, monkeypatch, dq_mode):
    """The same shapes three times with new data (relaunches on a GPU), then a token mask (a new plan): outputs and
    gradients against the fp64 oracle every time."""
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", dq_mode)
    seq = geometry.seqs[0]
    keep = random_keep(1, geometry.heads, seq, seq, geometry.block)
    visible = expand(keep, geometry.block, seq, seq)
    token_mask = torch.rand(seq, seq, device=DEVICE) < 0.9
    for seed, mask in ((0, None), (1, None), (2, None), (3, token_mask)):
        q, k, v = qkv(geometry.batch, geometry.heads, seq, geometry.dim, seed=seed)
        _call_against_the_oracle(q, k, v, keep, geometry.block, visible if mask is None else visible & mask, seed,
                                 attn_mask=mask)
    kernels = {key[0] for key in launch.plans()}
    # In dQ mode "kernel" the dQ kernel computes the row terms; the accumulating modes run the preprocess for them
    # and a pass that scales the accumulated dq into its dtype (and on a GPU the list kernel, which builds each
    # call's lists from its mask)
    expected = {forward.attention_fwd_kernel, backward.attention_bwd_dkdv_kernel, lists.full_first_lists_kernel} | (
        {backward.attention_bwd_dq_kernel} if dq_mode == "kernel"
        else {backward.attention_bwd_preprocess_kernel, backward.attention_bwd_dq_finish_kernel})
    assert kernels == (expected if ON_GPU else set()), "plans on a GPU for every kernel; none under the interpreter"


@pytest.mark.parametrize("plans", [False, True])
@pytest.mark.parametrize("which", ["forward", "forward, Q given back early", "backward"])
def test_warp_specialized_launchers_pass_every_parameter_by_name(monkeypatch, plans, which):
    """forward_ws.launch_warp_specialized, directly or through a launch plan (LAUNCH_PLANS), gives the Gluon kernel
    each of its parameters by name and nothing else but launch options: 4 warps, the register bound, Triton's
    defaults for the rest; q's pointer and strides only where the forward's consumers give Q back early
    (EARLY_Q_RELEASE_DIMS, on the claimed grid), for the walk again. Checked on meta tensors, the kernel's run
    replaced (no GPU needed)."""
    from blockattn.kernels import backward_ws, forward_ws
    monkeypatch.setattr(forward_ws, "LAUNCH_PLANS", plans)
    monkeypatch.setattr(forward_ws, "PERSISTENT_PROGRAMS", 5)
    monkeypatch.setattr(forward_ws, "EARLY_Q_RELEASE_DIMS", (128, ) if which.endswith("early") else ())
    monkeypatch.setattr(launch, "_PLANS", {})
    calls = []
    kernel_fn = forward_ws.attention_fwd_ws_kernel if which != "backward" else backward_ws.attention_bwd_ws_kernel
    monkeypatch.setattr(kernel_fn, "run", lambda *args, grid, warmup, **kwargs: calls.append((args, grid, kwargs)))

    q, lists = meta(2, 4, 256, 128), (meta(1, 4, 2, dtype=torch.int32), meta(1, 4, 2, 2, dtype=torch.int32))
    kv = meta(2, 2, 256, 128)
    if which.startswith("forward"):
        early = which.endswith("early")  # (claimed, so persistent: where not causal)
        forward_ws.attention_forward_ws(q, kv, kv, *lists, 128, 128, 0.1, q, meta(2, 4, 256, dtype=torch.float32),
                                        forward_ws.Plan(128, causal=not early))
        want_grid = (5, 1, 1) if early else (2, 8, 1)
    else:
        row_terms = backward_ws.row_terms_buffer(2, 4, 256, "meta")
        backward_ws.attention_backward_ws(q, kv, kv, q, row_terms, *lists, 128, 128, 0.1, True,
                                          meta(2, 4, 256, 128, dtype=torch.float32), kv, kv)
        want_grid = (2, 4, 1)
    (args, grid, kwargs), = calls
    assert args == () and tuple(grid) == want_grid
    options = {name: kwargs.pop(name) for name in list(kwargs) if name not in kernel_fn.arg_names}
    assert set(kwargs) == set(kernel_fn.arg_names)
    assert kwargs["CAUSAL"] is (which != "forward, Q given back early") and kwargs["BLOCK_Q"] == 128
    if which.startswith("forward"):  # out by pointer stores (O_THROUGH_TMA off): no descriptor of it built or passed
        assert not forward_ws.O_THROUGH_TMA and kwargs["O_DESC"] is None and kwargs["Out"] is q
        q_args = [kwargs[name] for name in ("Q", "stride_qb", "stride_qh", "stride_qs")]
        assert kwargs["RELEASE_Q"] is early and q_args == ([q, 4 * 256 * 128, 256 * 128, 128] if early else [None] * 4)
    assert options.pop("num_warps") == 4 and options.pop("maxnreg") == forward_ws.MAX_REGS
    assert options == ({"num_ctas": 1, "num_stages": 3, "enable_fp_fusion": True} if plans else {}), options


@pytest.mark.parametrize("setting, constexpr, value", [
    ("EMULATED_EXP2_DIMS", "EMULATE_EXP2", (128, )), ("O_THROUGH_TMA", "O_THROUGH_TMA", True),
    ("PERSISTENT_DIMS", "PERSISTENT", (128, )), ("CLAIMED_DIMS", "CLAIMED", (128, ))])
def test_a_changed_forward_setting_reaches_the_planned_launch(monkeypatch, setting, constexpr, value):
    """forward_ws's module settings are the kernel's constexprs, so they are part of its launch plan's key: a call
    after one of them changed does not relaunch the plan the call before made (benchmarks and tests switch them
    within a process). Checked on meta tensors, launch.run replaced by a plan cache keyed as its own is by the
    site key (the tensors' layouts are the same in both calls), so no GPU is needed."""
    from blockattn.kernels import forward_ws
    monkeypatch.setattr(forward_ws, "LAUNCH_PLANS", True)
    monkeypatch.setattr(forward_ws, "PERSISTENT_PROGRAMS", 5)  # (the persistent grid's size, no device to ask)
    set_grid(monkeypatch, None)  # from a program a tile
    specs, calls = {}, []

    def planned_run(kernel_fn, site_key, tensors, build, fresh=(), seen=None):
        if site_key not in specs:  # a plan miss builds the launch; a hit relaunches what was built
            specs[site_key] = build()
        calls.append((specs[site_key].static, specs[site_key].grid({}), tensors))
    monkeypatch.setattr(launch, "run", planned_run)

    q, kv = meta(2, 4, 256, 128), meta(2, 2, 256, 128)
    lists = (meta(1, 4, 2, dtype=torch.int32), meta(1, 4, 2, 2, dtype=torch.int32))
    for _ in range(2):
        forward_ws.attention_forward_ws(q, kv, kv, *lists, 128, 128, 0.1, q, meta(2, 4, 256, dtype=torch.float32),
                                        forward_ws.Plan(128))
        monkeypatch.setattr(forward_ws, setting, value)
    assert [static[constexpr] for static, _, _ in calls] == [False, True]
    # a program a query tile (2 tiles, batch 2 x 4 heads), or the persistent grid's 5 programs (which claim their
    # items from a counter under CLAIMED_DIMS: a tensor argument, never in the plan)
    persistent = setting in ("PERSISTENT_DIMS", "CLAIMED_DIMS")
    assert [tuple(grid) for _, grid, _ in calls] == [(2, 8, 1), (5, 1, 1) if persistent else (2, 8, 1)]
    assert [static["PERSISTENT"] for static, _, _ in calls] == [False, persistent]
    static, _, tensors = calls[1]
    if setting == "CLAIMED_DIMS":  # a fresh int32 [1] counter each call, which the plan leaves out
        counter = tensors["ITEM_COUNTER"]
        assert "ITEM_COUNTER" not in static and counter.shape == (1, ) and counter.dtype == torch.int32
    else:
        assert static["ITEM_COUNTER"] is None and "ITEM_COUNTER" not in tensors


@pytest.mark.parametrize("is_causal", [False, True])
def test_warp_specialized_kernels_relaunch_exactly(poisoned, monkeypatch, is_causal):
    """The Gluon forward and backward (D=128 bf16, 128x128 blocks, GQA 4/2, the descriptor-work floor lowered so a
    small call takes them on Hopper) through launch plans (forward_ws.LAUNCH_PLANS switched on): three calls with
    fresh tensors each match the fp64 oracle, and each kernel has one plan, made by the first call and relaunched
    by the others. On the CPU the Triton kernels run the same calls, with no plans."""
    from blockattn.kernels import backward_ws, forward_ws, tma
    monkeypatch.setattr(tma, "MIN_DESCRIPTOR_WORK", 0)
    monkeypatch.setattr(forward_ws, "LAUNCH_PLANS", True)
    monkeypatch.setattr(launch, "_PLANS", {})
    seq = 640 if ON_GPU else 256
    keep = random_keep(1, 4, seq, seq, (128, 128), density=0.6)
    visible = expand(keep, (128, 128), seq, seq)
    for seed in range(3):
        q, k, v = qkv(1, 4, seq, 128, kv_heads=2, seed=seed)
        _call_against_the_oracle(q, k, v, keep, (128, 128), visible, seed, is_causal=is_causal)
    plans = collections.Counter(key[0] for key in launch.plans())
    hopper = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
    for gluon_kernel in (forward_ws.attention_fwd_ws_kernel, backward_ws.attention_bwd_ws_kernel):
        assert plans[gluon_kernel] == (1 if hopper else 0), plans


@pytest.mark.parametrize("batch, heads, axes", [(1, 4, (4, 1)), (3, 2, (2, 3)), (12, 1, (4, 3)), (8, 2, (4, 4)),
                                                (6, 4, None), (7, 3, None)])
def test_batch_head_axes_number_every_pair_once_within_the_grid_limit(monkeypatch, batch, heads, axes):
    """Axes 1 and 2 hold batch x heads programs exactly (no program past the end, whole heads per row of axis 1),
    each axis within the limit; a batch that cannot be laid out is refused by name."""
    monkeypatch.setattr(launch, "MAX_GRID_AXIS", 4)
    if axes is None:
        with pytest.raises(ValueError, match=f"batch {batch} x heads {heads}"):
            launch.batch_head_axes(batch, heads)
        return
    rows, slices = launch.batch_head_axes(batch, heads)
    assert (rows, slices) == axes
    assert rows * slices == batch * heads and rows <= 4 and slices <= 4 and rows % heads == 0


@pytest.mark.parametrize("dq_mode, layout", [("kernel", "bhsd"), ("atomic", "bhsd"), ("kernel", "thd")])
def test_more_batch_heads_than_a_grid_axis_holds(poisoned, monkeypatch, dq_mode, layout):
    """With the grid's axis limit lowered to 4, a batch of 3 (padded, or packed sequences) with 4 query heads and
    2 key/value heads (12 and 6 programs per tile) spreads over axes 1 and 2, and every kernel gives bitwise the
    results of one axis."""
    monkeypatch.setattr(backward, "DQ_MODE_DEFAULT", dq_mode)
    seq = 96
    q, k, v = qkv(3, 4, seq, 32, kv_heads=2, seed=4)
    keep = random_keep(3, 4, seq, seq, (32, 32))
    grad = torch.randn(3, 4, seq, 32, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(6))
    packing = {}
    if layout == "thd":  # three sequences of 96, 70 and 33 tokens, packed
        lengths = (96, 70, 33)
        packing = dict(layout="thd", cu_seqlens_q=torch.tensor([0, 96, 166, 199], dtype=torch.int32, device=DEVICE))
        packing["cu_seqlens_kv"] = packing["cu_seqlens_q"]
        q, k, v, grad = (torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])
                         for t in (q, k, v, grad))

    def step():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = kernel(*leaves, keep, (32, 32), is_causal=True, return_lse=True, **packing)
        (out.float() * grad).sum().add(lse.sum() * 0.25).backward()
        return [out, lse] + [t.grad for t in leaves]
    one_axis = step()
    monkeypatch.setattr(launch, "MAX_GRID_AXIS", 4)
    assert launch.batch_head_axes(3, 4) == (4, 3) and launch.batch_head_axes(3, 2) == (2, 3)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), step(), one_axis):
        assert torch.equal(got, want), f"{name} differs when batch x heads spans two grid axes"
