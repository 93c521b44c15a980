"""Tile candidates, the nesting filter, and the launch through Triton's autotuner with the choice remembered in
memory and on disk (DISK_CACHE).

Environment variables (this is the one place they are documented; they are read at call time, never at import):

========================================  =========================================================
``BLOCKATTN_{KERNEL}_BLOCK_M``            comma list of tile heights to try, e.g. ``64,128``
``BLOCKATTN_{KERNEL}_BLOCK_N``            comma list of tile widths to try
``BLOCKATTN_{KERNEL}_NUM_WARPS``          comma list of warp counts
``BLOCKATTN_{KERNEL}_NUM_STAGES``         comma list of software-pipelining depths
========================================  =========================================================

``{KERNEL}`` is ``FWD`` (forward), ``BWD_DQ`` (dQ) or ``BWD_DKDV`` (dK/dV). Setting any of the four replaces the
built-in candidate list by the product of the four lists (unset ones keep their defaults: 64,128 / 32,64,128 / 4,8
/ 2,3), and every candidate of that product that nests is benchmarked; without them, the first four built-in
candidates that nest and fit shared memory are (five for ``FWD``; the rest stand by, tried in order, in case none
of those compiles within the GPU's shared memory). Every candidate must nest in the block: its
tile height divides ``block_q`` and its tile width divides ``block_kv``; candidates that do not are dropped, and
if none is left a ValueError names these variables. Setting one value for each pins the autotuner to one tile
(tests do this for bitwise comparisons). Under ``TRITON_INTERPRET=1`` the first candidate that nests runs, without
benchmarking. They tune the Triton kernels only: the warp-specialized forward (``forward_ws.py``), which takes the
forward's plain walks on Hopper, has one fixed tile.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Optional

import triton
from triton.runtime.errors import OutOfResources


# (BLOCK_M, BLOCK_N, num_warps, num_stages), best first. Of those that nest and fit, the first _MAX_TUNED[kernel]
# are benchmarked (the interpreter takes the first); the small tiles at the end serve small or odd blocks.
_DEFAULTS = {
    "FWD": [(128, 64, 4, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3),
            (128, 128, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (32, 128, 4, 3), (32, 128, 4, 2), (32, 64, 4, 3),
            (32, 64, 4, 2), (32, 32, 4, 2), (32, 16, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)],
    "BWD_DQ": [(128, 128, 8, 2), (128, 32, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2), (32, 128, 4, 2),
               (32, 64, 4, 2), (32, 128, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2), (32, 16, 4, 2), (16, 16, 4, 2)],
    "BWD_DKDV": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (32, 128, 4, 3),
                 (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)],
}
# 32-row blocks (torch_npu's 32x128) take 32-row tiles as wide as their keys allow: 32x64 and 32x128 tiles ran the
# forward 1.53x and the backward 1.25x faster than 32x32 (BENCHMARKS.md, thirteenth session).
# The forward benchmarks one more: 64x128 with 4 warps is the best tile at D=64 (3.74 ms against 3.92 for the
# next, H200), and far the worst at D=128 (10.0 against 6.2), so it has to be measured, not assumed. (The GPU tests
# set each to 1, so every kernel variant compiles one tile; tests/test_tiles.py runs every candidate.)
_MAX_TUNED = {"FWD": 5, "BWD_DQ": 4, "BWD_DKDV": 4}
_LIST_DEFAULTS = {"BLOCK_M": "64,128", "BLOCK_N": "32,64,128", "NUM_WARPS": "4,8", "NUM_STAGES": "2,3"}
# Shared memory a config may plan for (bytes); Hopper allows 227 KiB per program.
_SMEM_BUDGET = 227 * 1024


@functools.lru_cache(maxsize=None)
def env_names(kernel: str) -> tuple[str, ...]:
    return tuple(f"BLOCKATTN_{kernel}_{field}" for field in _LIST_DEFAULTS)


@functools.lru_cache(maxsize=None)
def _encoded_env_names(kernel: str) -> tuple:
    return tuple(map(os.environ.encodekey, env_names(kernel)))


def env_key(kernel: str) -> tuple:
    """The current values of kernel's environment variables (None where unset; encoded as os.environ stores them):
    part of every key that caches a decision built on the candidate list, so it is read on every launch."""
    # os.environ.get raises and catches a KeyError for each unset name: 7 us for a kernel's four names against
    # 0.7 through the encoded mapping behind it (CPython's os._Environ keeps it in _data).
    stored = getattr(os.environ, "_data", None)
    if stored is None:
        return tuple(map(os.environ.get, env_names(kernel)))
    return tuple(map(stored.get, _encoded_env_names(kernel)))


def _env_list(name: str, default: str) -> list[int]:
    raw = os.environ.get(name, default)
    try:
        values = [int(part) for part in raw.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of ints, got {raw!r}") from None
    if not values or any(value <= 0 for value in values):
        raise ValueError(f"{name} must list positive ints, got {raw!r}")
    return values


def candidates(kernel: str) -> list[tuple[int, int, int, int]]:
    """The candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) list for a kernel, env overrides applied."""
    names = env_names(kernel)
    if not any(name in os.environ for name in names):
        return list(_DEFAULTS[kernel])
    lists = [_env_list(name, _LIST_DEFAULTS[field]) for name, field in zip(names, _LIST_DEFAULTS)]
    return [(m, n, w, s) for m in lists[0] for n in lists[1] for w in lists[2] for s in lists[3]]


_NESTING_CACHE: dict = {}


def nesting(kernel: str, block_m_of: int, block_n_of: int, smem_per_stage, fixed_smem,
            cache_key: Optional[tuple] = None, fp32_precision: Optional[str] = None,
            min_block_n: int = 16) -> list[triton.Config]:
    """Candidates whose tile nests in the block (BLOCK_M | block_m_of, BLOCK_N | block_n_of) and fits shared memory,
    the first _MAX_TUNED[kernel] of them to be benchmarked (all of them when the environment overrides the list).

    smem_per_stage(BLOCK_M, BLOCK_N) and fixed_smem(BLOCK_M, BLOCK_N) estimate the bytes a config plans for.
    fp32_precision: the kernel's FP32_PRECISION; "ieee" products run on the FMA units, unpipelined, where Triton
    keeps two buffers per loop load whatever num_stages says. min_block_n: the narrowest tile width the kernel
    compiles with (16; 32 where the tile's keys are the reduction of an 8-bit product). cache_key: whatever else
    the two estimates depend on; given it, the list is memoized (with the environment variables' current values
    in the key, so changing them still takes effect), sparing short calls the work."""
    if cache_key is not None:
        key = (kernel, block_m_of, block_n_of, cache_key, fp32_precision, min_block_n, env_key(kernel),
               _MAX_TUNED[kernel])
        if key not in _NESTING_CACHE:
            _NESTING_CACHE[key] = nesting(kernel, block_m_of, block_n_of, smem_per_stage, fixed_smem,
                                          fp32_precision=fp32_precision, min_block_n=min_block_n)
        return _NESTING_CACHE[key]
    kept = Candidates(kernel)
    overridden = any(name in os.environ for name in env_names(kernel))
    for block_m, block_n, warps, stages in candidates(kernel):
        if block_m_of % block_m or block_n_of % block_n or block_m < 16 or block_n < min_block_n:
            continue
        # Triton's pipeliner allocates stages - 1 buffers per loop load (the stripped forward with 128x64 tiles,
        # 3 stages and D=256 runs, which 3 buffers would not fit). Unpipelined FMA products hold two (Triton 3.6's
        # sm_90 metadata.shared: the fp32 D=256 dQ and dK/dV kernels exactly, the forward 1.5). Configs that still
        # overflow give way to the next (launch).
        buffers = 2 if fp32_precision == "ieee" else max(stages - 1, 1)
        if buffers * smem_per_stage(block_m, block_n) + fixed_smem(block_m, block_n) > _SMEM_BUDGET:
            continue
        kept.append(triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages))
    if not kept:
        raise ValueError(
            f"no {kernel} tile candidate nests in the block {block_m_of}x{block_n_of} (tile sides must divide the "
            f"block sides, the height be at least 16 and the width at least {min_block_n}) within shared memory; "
            f"candidates {candidates(kernel)}; adjust "
            f"{', '.join(env_names(kernel))}")
    kept.tuned = len(kept) if overridden else min(len(kept), _MAX_TUNED[kernel])
    return kept


class Candidates(list):
    """A kernel's tile configs, best first: the first `tuned` are benchmarked; the rest stand by for when none of
    those compiles within the GPU's shared memory (nesting() admits them on an estimate, not a compile)."""

    def __init__(self, kernel: str, configs=()):
        super().__init__(configs)
        self.kernel, self.tuned = kernel, len(self)


# Compile options every launch passes. Fused multiply-adds are pinned on: the kernels' score step `s * c - m` is
# one FMA per element, and Triton 3.10 turns the default off (3.9 warns about it; 3.6 has it on).
COMPILE_OPTIONS = {"enable_fp_fusion": True}

_TUNERS: dict = {}


def tuners() -> dict:
    """The autotuners built so far, keyed by (kernel name, configs): their .configs_timings show what was measured."""
    return _TUNERS


def measured() -> list[tuple[str, list]]:
    """(kernel name, [(config, ms), ...] fastest first) for every autotuner that has benchmarked its configs (the
    last key it tuned)."""
    result = []
    for (name, *_), tuner in _TUNERS.items():
        timings = getattr(tuner, "configs_timings", None) or {}
        # Triton reports a float, or a list whose first entry is the median.
        rows = [(config, ms[0] if isinstance(ms, (list, tuple)) else ms) for config, ms in timings.items()]
        result.append((name, sorted(rows, key=lambda row: row[1])))
    return result


def _tuner(kernel_fn, configs: tuple, key: tuple, reset_to_zero: tuple):
    name = (getattr(kernel_fn, "__name__", str(kernel_fn)), configs, key, reset_to_zero,
            tuple(c.pre_hook for c in configs))
    if name not in _TUNERS:
        _TUNERS[name] = _build_tuner(kernel_fn, configs, key, reset_to_zero)
    return _TUNERS[name]


def _build_tuner(kernel_fn, configs: tuple, key: tuple, reset_to_zero: tuple):
    options = {"reset_to_zero": list(reset_to_zero)} if reset_to_zero else {}
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True  # tuning results persist on disk: a user pays tuning once per shape
    # Triton 3.9 rejects key names that are not the kernel's arguments (3.6 ignored them); kernels share one key.
    names = set(getattr(kernel_fn, "arg_names", key))
    return triton.autotune(configs=list(configs), key=[name for name in key if name in names], **options)(kernel_fn)


def _config_key(config: triton.Config):
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


class _HashableConfigs(tuple):
    def __hash__(self):
        return hash(tuple(_config_key(c) for c in self))

    def __eq__(self, other):
        return [_config_key(c) for c in self] == [_config_key(c) for c in other]


# Whether tile choices persist on disk, so a process pays the benchmarking of a shape once per machine. Triton's
# own autotune cache skips every kernel whose configs carry a pre-hook, and the descriptor kernels' do (their boxes
# are set per config), so blockattn keeps its choices itself, in Triton's cache directory (TRITON_CACHE_DIR):
# clearing that cache retunes. Benchmarks that sweep the candidates switch it off.
DISK_CACHE = True
_CHOICE_FORMAT = "blockattn-tile-choice-2"
# (kernel, every candidate, how many are tuned, tuning-key values, argument dtypes) -> the config chosen for them in
# this process.
_CHOICES: dict = {}


def launch(kernel_fn, grid, configs: list[triton.Config], key: tuple, reset_to_zero: tuple = (), pre_hook=None,
           **kwargs):
    """Run kernel_fn over grid(meta) with the best of configs; returns (the compiled kernel, or None under the
    interpreter; the config it ran). The best is benchmarked through triton.autotune the first time a tuning key
    (the values of the arguments named in key, and the arguments' dtypes) is seen, then remembered in memory and on
    disk (DISK_CACHE); a single config, a remembered choice and the interpreter (which takes the first) launch
    directly. configs from nesting() (a Candidates list) benchmark only their first `tuned`; the rest are tried in
    order, directly, if none of those fits the GPU's shared memory. reset_to_zero names the arguments a kernel
    accumulates into, zeroed before each benchmarked run; pre_hook(arguments with the config's values) runs before
    every launch of a config (host tensor descriptors take their block shape there)."""
    kwargs.update(COMPILE_OPTIONS)  # the interpreter drops them
    interpreted = is_interpreted(kernel_fn)
    if interpreted:
        return _launch_config(kernel_fn, grid, configs[0], pre_hook, kwargs, interpreted)
    tuned, kernel_name = getattr(configs, "tuned", len(configs)), getattr(configs, "kernel", None)
    if tuned == 1:
        return _first_that_fits(kernel_fn, grid, configs, pre_hook, kwargs, kernel_name)
    # the choice is one of every candidate (a spare, when none of the tuned fits), stored as its index there
    choice_key = (kernel_fn, _HashableConfigs(configs), tuned, tuple(kwargs.get(name) for name in key),
                  tuple(str(value.dtype) for value in kwargs.values() if hasattr(value, "dtype")))
    spare = configs[tuned:]
    configs = configs[:tuned]
    candidates = _HashableConfigs(configs)
    config = _CHOICES.get(choice_key)
    if config is None and DISK_CACHE:
        config = _read_choice(choice_key)
    if config is not None:
        _CHOICES[choice_key] = config
        return _launch_config(kernel_fn, grid, config, pre_hook, kwargs, False)
    if pre_hook is not None:
        candidates = _HashableConfigs(triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages,
                                                    pre_hook=pre_hook) for c in configs)
    tuner = _tuner(kernel_fn, candidates, key, tuple(reset_to_zero))
    try:
        kernel = tuner[grid](**kwargs)  # the tuner times a config that does not fit as infinitely slow
        best = _config_key(tuner.best_config)
        config = next(c for c in configs if _config_key(c) == best)
    except OutOfResources:  # none of them fit
        if not spare:
            raise
        kernel, config = _first_that_fits(kernel_fn, grid, spare, pre_hook, kwargs, kernel_name)
    _CHOICES[choice_key] = config
    if DISK_CACHE:
        _write_choice(choice_key, config)
    return kernel, config


def _first_that_fits(kernel_fn, grid, configs: list, pre_hook, kwargs: dict, kernel: Optional[str]):
    """Launch the first of configs whose compiled kernel fits the GPU's resources (Triton checks before it
    launches anything); if none does, the last one's OutOfResources, with kernel's overriding variables named."""
    for index, config in enumerate(configs):
        try:
            return _launch_config(kernel_fn, grid, config, pre_hook, kwargs, False)
        except OutOfResources as error:
            if index + 1 < len(configs):
                continue
            if kernel is not None:
                error.add_note(f"blockattn: no {kernel} tile candidate fits; {', '.join(env_names(kernel))} choose "
                               f"others (tried {[str(c) for c in configs]})")
            raise


def _launch_config(kernel_fn, grid, config: triton.Config, pre_hook, kwargs: dict, interpreted: bool):
    meta = dict(kwargs, **(config.kwargs if interpreted else config.all_kwargs()))
    if pre_hook is not None:
        pre_hook(meta)
    kernel = kernel_fn[grid(meta)](**meta)
    return (None if interpreted else kernel), config


def _choice_file(choice_key: tuple) -> tuple:
    """(Triton cache manager, file name) holding the choice for choice_key on this GPU and Triton, for this
    kernel source."""
    import hashlib

    import torch
    from triton.runtime.cache import get_cache_manager
    kernel_fn, candidates, tuned, values, dtypes = choice_key
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    parts = [_CHOICE_FORMAT, triton.__version__, gpu, kernel_fn.cache_key, repr(values), repr(dtypes),
             repr(COMPILE_OPTIONS), str(tuned)] + [str(c) for c in candidates]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return get_cache_manager(digest), f"{kernel_fn.__name__}.tile.json"


def _read_choice(choice_key: tuple) -> Optional[triton.Config]:
    """The config stored for choice_key, or None (none stored, or unreadable: then it is tuned again)."""
    import json
    try:
        cache, name = _choice_file(choice_key)
        path = cache.get_file(name)
        if path is None:
            return None
        with open(path) as f:
            stored = json.load(f)
        config = choice_key[1][stored["index"]]
        return config if str(config) == stored["config"] else None
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def _write_choice(choice_key: tuple, config: triton.Config) -> None:
    import json
    try:
        cache, name = _choice_file(choice_key)
        index = [_config_key(c) for c in choice_key[1]].index(_config_key(config))
        cache.put(json.dumps({"index": index, "config": str(config)}), name, binary=False)
    except (OSError, ValueError, AttributeError):
        pass  # a read-only or missing cache directory: the choice lives in memory only


def is_interpreted(kernel_fn) -> bool:
    """Whether kernel_fn was decorated under TRITON_INTERPRET=1 (Triton decides at decoration time)."""
    return isinstance(kernel_fn, _interpreted_function_type())


_INTERPRETED_FUNCTION = None


def _interpreted_function_type() -> type:
    # imported on first use (Triton does not import its interpreter unless asked), then kept: every launch asks. In a
    # global, not by functools.lru_cache: torch.compile traces this, and warns at every lru_cache it meets
    global _INTERPRETED_FUNCTION
    if _INTERPRETED_FUNCTION is None:
        from triton.runtime.interpreter import InterpretedFunction
        _INTERPRETED_FUNCTION = InterpretedFunction
    return _INTERPRETED_FUNCTION


def seq_bucket(length: int) -> int:
    """Autotune key for a sequence length: its power-of-two bucket, so nearby lengths share a tuning."""
    return triton.next_power_of_2(max(int(length), 16))
