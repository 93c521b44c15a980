"""The tile candidates: the nesting filter, the environment overrides, and the error when nothing nests."""

import pytest
import torch

import blockattn
from blockattn.kernels import autotune
from conftest import DEVICE, qkv


def no_smem(bm, bn):
    return 0


def set_lists(monkeypatch, kernel="FWD", m="32,64,128,256", n="16,32,64,128", warps="4", stages="2"):
    for field, value in (("BLOCK_M", m), ("BLOCK_N", n), ("NUM_WARPS", warps), ("NUM_STAGES", stages)):
        monkeypatch.setenv(f"BLOCKATTN_{kernel}_{field}", value)


def default_lists(monkeypatch):
    for name in autotune.env_names("FWD"):
        monkeypatch.delenv(name, raising=False)


def test_the_filter_keeps_exactly_the_tiles_that_nest(monkeypatch):
    set_lists(monkeypatch)
    kept = autotune.nesting("FWD", 128, 64, no_smem, no_smem)
    tiles = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept]
    want = [(m, n) for m in (32, 64, 128, 256) for n in (16, 32, 64, 128) if 128 % m == 0 and 64 % n == 0]
    assert tiles == want


def test_defaults_always_offer_a_tile_for_multiples_of_16(monkeypatch):
    default_lists(monkeypatch)
    for block in ((16, 16), (48, 80), (128, 128), (256, 256), (112, 16)):
        assert autotune.nesting("FWD", *block, no_smem, no_smem)


def test_nothing_nesting_raises_naming_the_variables(monkeypatch):
    set_lists(monkeypatch, m="256", n="128")
    with pytest.raises(ValueError, match="BLOCKATTN_FWD_BLOCK_M"):
        autotune.nesting("FWD", 128, 64, no_smem, no_smem)


def test_attention_reports_a_pin_that_cannot_nest(monkeypatch):
    set_lists(monkeypatch, m="32", n="32")
    q, k, v = qkv(1, 1, 96, 16)
    with pytest.raises(ValueError, match="BLOCKATTN_FWD_BLOCK_N"):
        blockattn.attention(q, k, v, torch.ones(2, 6, dtype=torch.bool, device=DEVICE), (48, 16), backend="triton")


def test_a_malformed_list_is_named(monkeypatch):
    monkeypatch.setenv("BLOCKATTN_BWD_DQ_NUM_WARPS", "four")
    with pytest.raises(ValueError, match="BLOCKATTN_BWD_DQ_NUM_WARPS"):
        autotune.candidates("BWD_DQ")


def test_a_pin_leaves_one_candidate(monkeypatch):
    set_lists(monkeypatch, kernel="BWD_DKDV", m="64", n="32", warps="8", stages="3")
    assert autotune.candidates("BWD_DKDV") == [(64, 32, 8, 3)]
    assert len(autotune.nesting("BWD_DKDV", 128, 64, no_smem, no_smem)) == 1


def test_shared_memory_budget_drops_oversized_tiles(monkeypatch):
    """D=256 bf16: a 64-key stage takes 64 KiB, Q 64 KiB. Three stages keep two buffers in flight (Triton's
    pipeliner), 192 KiB, which fits; 128-key stages (2 x 128 + 64 KiB) do not."""
    set_lists(monkeypatch, m="128", n="64,128", stages="3")
    kept = autotune.nesting("FWD", 128, 128, lambda bm, bn: bn * 512 * 2, lambda bm, bn: bm * 256 * 2)
    assert [c.kwargs["BLOCK_N"] for c in kept] == [64]


def test_unpipelined_products_count_two_buffers_whatever_the_stages(monkeypatch):
    """fp32 D=256 (IEEE products on the FMA units): a 64x64 tile with 2 stages plans 2 x 128 KiB of key-side tiles
    + 64 KiB of Q, which does not fit (Triton 3.6 compiles it to 262 KB), though one pipelined buffer would."""
    set_lists(monkeypatch, m="64", n="32,64", stages="2")
    estimates = dict(smem_per_stage=lambda bm, bn: bn * 512 * 4, fixed_smem=lambda bm, bn: bm * 256 * 4)
    pipelined = autotune.nesting("FWD", 128, 64, **estimates)
    unpipelined = autotune.nesting("FWD", 128, 64, **estimates, fp32_precision="ieee")
    assert [c.kwargs["BLOCK_N"] for c in pipelined] == [32, 64]
    assert [c.kwargs["BLOCK_N"] for c in unpipelined] == [32]


def test_memoized_lists_follow_the_environment(monkeypatch):
    set_lists(monkeypatch, m="64")
    first = autotune.nesting("FWD", 128, 64, no_smem, no_smem, cache_key=("test",))
    assert autotune.nesting("FWD", 128, 64, no_smem, no_smem, cache_key=("test",)) is first
    set_lists(monkeypatch, m="128")
    second = autotune.nesting("FWD", 128, 64, no_smem, no_smem, cache_key=("test",))
    assert {c.kwargs["BLOCK_M"] for c in first} == {64} and {c.kwargs["BLOCK_M"] for c in second} == {128}


def test_measured_sorts_each_tuners_timings(monkeypatch):
    class Tuner:
        def __init__(self, timings):
            self.configs_timings = timings

    fast, slow, mid = (autotune.triton.Config({"BLOCK_M": m}) for m in (16, 32, 64))
    monkeypatch.setattr(autotune, "_TUNERS", {("fwd_kernel", None): Tuner({slow: 3.0, fast: 1.0}),
                                              ("dq_kernel", None): Tuner({mid: [2.0, 1.5, 2.5], fast: [4.0]}),
                                              ("untuned", None): Tuner(None)})
    assert autotune.measured() == [("fwd_kernel", [(fast, 1.0), (slow, 3.0)]),
                                   ("dq_kernel", [(mid, 2.0), (fast, 4.0)]), ("untuned", [])]


@pytest.mark.parametrize("kernel_name", ["attention_fwd_kernel", "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel"])
def test_every_kernel_builds_a_tuner_from_the_shared_key(kernel_name):
    """The kernels share one tuning key, which names flags some of them lack: the tuner keys on the ones the
    kernel has (Triton 3.9 raises for unknown names), and still on every one it has."""
    from blockattn.kernels import backward, forward
    kernel_fn = getattr(forward if "fwd" in kernel_name else backward, kernel_name)
    key = forward.TUNING_KEY + ("DQ_MODE",)
    tuner = autotune._build_tuner(kernel_fn, (autotune.triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}),), key, ())
    assert set(tuner.keys) == set(key) & set(kernel_fn.arg_names)
    assert "seq_bucket" in tuner.keys and "TMA_LOADS" in tuner.keys


class FakeKernelFn:
    """Stands in for a compiled JITFunction: records each direct launch's arguments."""
    __name__ = "fake_kernel"
    cache_key = "source-hash"

    def __init__(self):
        self.launched = []

    def __getitem__(self, grid):
        return lambda **meta: self.launched.append((grid, meta)) or "compiled"


def test_a_tuned_choice_is_remembered_in_memory_and_on_disk(monkeypatch, tmp_path):
    """The tuner benchmarks a tuning key once; later launches of that key (in this process, or after a restart,
    from Triton's cache directory) run the chosen config directly, through the pre-hook; another key, or the disk
    cache switched off in a fresh process, tunes again."""
    benchmarked = []

    class FakeTuner:
        def __init__(self, configs):
            self.configs = configs

        def __getitem__(self, grid):
            def run(**kwargs):
                benchmarked.append(kwargs)
                self.best_config = self.configs[1]
                return "compiled"
            return run

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "is_interpreted", lambda fn: False)
    monkeypatch.setattr(autotune, "_tuner", lambda kernel_fn, configs, key, reset_to_zero: FakeTuner(configs))
    monkeypatch.setattr(autotune, "_CHOICES", {})
    set_lists(monkeypatch, m="64,128", n="64", warps="4", stages="2")
    configs = autotune.nesting("FWD", 128, 128, no_smem, no_smem)
    fn, hooked = FakeKernelFn(), []

    def grid(meta):
        return (meta["BLOCK_M"],)

    def launch(key_value):
        return autotune.launch(fn, grid, configs, ("A",), pre_hook=lambda meta: hooked.append(meta["BLOCK_M"]),
                               A=key_value, x=torch.zeros(1))
    kernel, config = launch(1)
    assert len(benchmarked) == 1 and config is configs[1] and kernel == "compiled"
    assert benchmarked[0]["enable_fp_fusion"] is True, "the pinned compile options reach the tuner"
    for restart in (False, True):
        if restart:
            monkeypatch.setattr(autotune, "_CHOICES", {})  # a new process: only the disk remembers
        kernel, config = launch(1)
        assert len(benchmarked) == 1 and config is configs[1] and kernel == "compiled"
        grid_used, meta = fn.launched[-1]
        assert grid_used == (128,) and meta["BLOCK_M"] == 128 and meta["num_warps"] == 4 and hooked[-1] == 128
    launch(2)
    assert len(benchmarked) == 2, "another tuning key is benchmarked"
    monkeypatch.setattr(autotune, "_CHOICES", {})
    monkeypatch.setattr(autotune, "DISK_CACHE", False)
    launch(1)
    assert len(benchmarked) == 3, "without the disk cache a new process tunes again"


class TooTallKernelFn(FakeKernelFn):
    """Raises OutOfResources for tiles taller than max_block_m, as Triton does on a too-large kernel before it
    launches anything."""

    def __init__(self, max_block_m):
        super().__init__()
        self.max_block_m, self.refused = max_block_m, []

    def __getitem__(self, grid):
        def run(**meta):
            if meta["BLOCK_M"] > self.max_block_m:
                self.refused.append(meta["BLOCK_M"])
                raise autotune.OutOfResources(300_000, 232_448, "shared memory")
            self.launched.append((grid, meta))
            return "compiled"
        return run


def test_a_candidate_that_does_not_fit_gives_way_to_the_next(monkeypatch):
    """Untuned (one tile per kernel, as the tests and a pinned list run): the first candidate that fits runs."""
    default_lists(monkeypatch)
    monkeypatch.setattr(autotune, "is_interpreted", lambda fn: False)
    configs = autotune.nesting("FWD", 128, 128, no_smem, no_smem)
    assert configs.tuned == 1 and len(configs) > 1, "the rest of the candidates stand by"
    fn = TooTallKernelFn(max_block_m=64)
    kernel, config = autotune.launch(fn, lambda meta: (1,), configs, ("A",), A=1)
    first_fit = next(c for c in configs if c.kwargs["BLOCK_M"] <= 64)
    assert kernel == "compiled" and config is first_fit
    assert fn.refused == [128] * configs.index(first_fit) and len(fn.launched) == 1


def test_tuned_candidates_that_all_overflow_fall_back_to_the_spares(monkeypatch, tmp_path):
    """When no benchmarked candidate fits, the first spare that does runs, and that choice is remembered in memory
    and on disk (a new process does not benchmark again)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "is_interpreted", lambda fn: False)
    monkeypatch.setattr(autotune, "_CHOICES", {})
    tall, short = (autotune.triton.Config({"BLOCK_M": m}, num_warps=w) for m, w in ((128, 8), (64, 4)))
    configs = autotune.Candidates("FWD", [tall, autotune.triton.Config({"BLOCK_M": 128}, num_warps=4), short])
    configs.tuned = 2
    tuned = []

    class OverflowingTuner:
        def __getitem__(self, grid):
            def run(**kwargs):
                tuned.append(kwargs)
                raise autotune.OutOfResources(300_000, 232_448, "shared memory")
            return run
    monkeypatch.setattr(autotune, "_tuner", lambda kernel_fn, candidates, key, reset: OverflowingTuner()
                        if len(candidates) == 2 else pytest.fail(f"benchmarked {len(candidates)} configs, not 2"))
    fn = TooTallKernelFn(max_block_m=64)
    for restart in (False, False, True):
        if restart:
            monkeypatch.setattr(autotune, "_CHOICES", {})  # a new process: only the disk remembers
        kernel, config = autotune.launch(fn, lambda meta: (1,), configs, ("A",), A=1)
        assert kernel == "compiled" and config is short
    assert len(tuned) == 1, "the fallback is remembered, in memory and on disk"


def test_no_candidate_fitting_names_the_variables(monkeypatch):
    default_lists(monkeypatch)
    monkeypatch.setattr(autotune, "is_interpreted", lambda fn: False)
    configs = autotune.nesting("FWD", 128, 128, no_smem, no_smem)
    with pytest.raises(autotune.OutOfResources) as caught:
        autotune.launch(TooTallKernelFn(max_block_m=0), lambda meta: (1,), configs, ("A",), A=1)
    assert any("BLOCKATTN_FWD_BLOCK_M" in note for note in getattr(caught.value, "__notes__", []))
