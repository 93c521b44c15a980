"""Launch plans: the first launch of a kernel for one set of static arguments goes through Triton's autotuner and
JIT (tile choice, compilation); later launches with the same static arguments relaunch the compiled kernel with
the new tensors, skipping the launcher's argument building, the autotuner's wrapper and the JIT's argument binding.

Why: at short sequences an eager call is host-bound. On the H200 machine's CPU a forward launch took ~200 us of host
time (~80 us building arguments, ~55 us in the autotuner's wrapper, ~50 us in the JIT's binding) against ~15 us
for the compiled kernel's own launcher (benchmarks/host_cost.py).

A plan is keyed by the launch site's key (the launcher's scalar arguments and every switch it reads), the current
device, and each tensor argument's shape, strides, dtype and 16-byte alignment: everything Triton specializes a
kernel on and everything the launcher derives its other arguments from. Only the tensors change between
relaunches; descriptor arguments are rebuilt around the new tensors from the first launch's descriptors. A plan
is made only after checking that its argument list equals the one Triton's own binder produced; a Triton whose
internals differ gets no plans, and every launch takes the full path (same results, more host time).

Descriptors: Triton's launcher encodes each host tensor descriptor into a TMA tensor map again on every launch
(`wrap_handle_tensordesc` around the compiled launcher: Triton 3.6 walks the arguments in Python, 3.9 in C++, and
both call the Python make_tensordesc_arg and the driver's encoder per descriptor). A plan whose kernel takes
descriptors keeps each slot's encoded maps by base address (the plan key fixes everything else a map holds: shape,
strides, dtype, box, swizzle) and hands the compiled launcher the expanded arguments itself (ExpandedArgs); where
Triton's launcher is not built that way, descriptors take Triton's path.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable, NamedTuple, Optional

import torch
from triton import knobs
from triton.runtime.driver import driver

from . import autotune

# Whether launches use plans (benchmarks/host_cost.py switches them off to time the full path).
ENABLED = True
# Whether plans hand the compiled launcher descriptors expanded, their tensor maps kept (ExpandedArgs; switched off,
# relaunches take Triton's wrapper, which encodes every map again: benchmarks/descriptor_host.py compares the two).
EXPAND_DESCRIPTORS = True
# Plans kept; a full table is cleared (a workload that keeps changing shapes pays the full path per new shape).
_MAX_PLANS = 512
_PLANS: dict = {}


class LaunchSpec(NamedTuple):
    """What a launcher builds on a plan miss. grid(meta) -> grid tuple; configs, tuning_key, reset_to_zero and
    pre_hook as autotune.launch takes them; static: every non-tensor keyword argument, and for arguments read
    through descriptors the descriptor (built on the call's tensors)."""
    grid: Callable
    configs: list
    tuning_key: tuple
    static: dict
    pre_hook: Optional[Callable] = None
    reset_to_zero: tuple = ()


# The most programs CUDA allows along a grid's axes 1 and 2 (axis 0 takes 2^31 - 1).
MAX_GRID_AXIS = 65535


def batch_head_axes(batch: int, heads: int) -> tuple[int, int]:
    """Grid axes 1 and 2 for one program per (batch, head) pair, which the kernels number as
    program_id(1) + program_id(2) * num_programs(1) (primitives.batch_head_program): (batch * heads, 1) when that
    fits one axis, else (heads * chunk, batch // chunk) for the largest chunk of the batch that divides it and fits,
    so no program falls past the end. A ValueError for a batch no chunk of which fits both axes."""
    if batch * heads <= MAX_GRID_AXIS:
        return batch * heads, 1
    chunk = min(batch, MAX_GRID_AXIS // heads)
    while chunk > 1 and batch % chunk:
        chunk -= 1
    if chunk == 0 or batch // chunk > MAX_GRID_AXIS:
        raise ValueError(f"batch {batch} x heads {heads} cannot be laid out on a CUDA grid (at most "
                         f"{MAX_GRID_AXIS} programs along axes 1 and 2): split the batch into calls")
    return heads * chunk, batch // chunk


def device_properties(device: torch.device):
    """torch.cuda.get_device_properties(device) (capability as .major and .minor, .L2_cache_size), kept per device:
    the launchers ask on every call, and under cProfile the query took 20-40 us of a call's host time (H200
    machine)."""
    return _device_properties(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _device_properties(index: int):
    return torch.cuda.get_device_properties(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability(device), from device_properties."""
    properties = device_properties(device)
    return properties.major, properties.minor


def tensor_key(tensor: torch.Tensor) -> tuple:
    """What a plan depends on in one tensor argument: shape, strides, dtype, and 16-byte alignment of its base."""
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.data_ptr() % 16


class Plan:
    """A compiled kernel, its grid and its argument list in signature order; relaunch() puts the call's tensors in
    their slots (tensor_slots: (index, name); descriptor_slots: (index, name, first launch's descriptor)).
    expanded: an ExpandedArgs for a kernel that takes descriptors, where this Triton allows it, else None."""

    __slots__ = ("kernel", "grid", "args", "tensor_slots", "descriptor_slots", "expanded")

    def __init__(self, kernel, grid: tuple, args: list, tensor_slots: tuple, descriptor_slots: tuple,
                 expanded: Optional[ExpandedArgs] = None):
        self.kernel, self.grid, self.args = kernel, grid, args
        self.tensor_slots, self.descriptor_slots = tensor_slots, descriptor_slots
        self.expanded = expanded

    def relaunch(self, tensors: dict, device: int) -> None:
        kernel, grid = self.kernel, self.grid
        stream = driver.active.get_current_stream(device)
        enter, leave = launch_hooks()
        # (an enter hook takes launch metadata built from the unexpanded arguments: Triton's path then)
        if self.expanded is not None and enter is None and EXPAND_DESCRIPTORS:
            self.expanded.launch(kernel, grid, stream, tensors, leave)
            return
        args = self.args.copy()
        # A tensor goes in as its data pointer: Triton's launcher then skips the driver query that checks a
        # tensor's memory is on the GPU (the plan exists only for CUDA tensors of this device).
        for index, name in self.tensor_slots:
            args[index] = tensors[name].data_ptr()
        for index, name, template in self.descriptor_slots:
            args[index] = rebased(template, tensors[name])
        metadata = kernel.launch_metadata(grid, stream, *args) if enter is not None else None
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, metadata, enter, leave,
                   *args)


def launch_hooks() -> tuple:
    """Triton's launch enter and exit hooks, each None where nothing is registered: Triton 3.6 on keeps an empty
    HookChain, and passing it makes every launch build launch metadata and call the empty chain twice."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if enter is not None and not getattr(enter, "calls", True):
        enter = None
    if leave is not None and not getattr(leave, "calls", True):
        leave = None
    return enter, leave


def rebased(descriptor, base: torch.Tensor):
    """A copy of a host tensor descriptor over base (same shape, strides, dtype and alignment as the original's
    base: the plan key guarantees it, so Triton's checks need not run again)."""
    twin = object.__new__(type(descriptor))
    twin.__dict__.update(descriptor.__dict__)
    twin.base = base
    return twin


class ExpandedArgs:
    """A plan's arguments as the compiled launcher takes them, each descriptor expanded into its TMA tensor map,
    shape and strides, with the maps kept per slot by base address: a relaunch encodes a map only for an address
    its slot has not seen (a training loop's allocations come back at the same addresses).

    launcher: a copy of the kernel's launcher calling the compiled launcher directly; flat: the expanded argument
    list with None in the call's slots; tensor_slots: (flat index, name); descriptor_slots: (start, stop, name,
    first launch's descriptor, its metadata, {address: expansion})."""

    __slots__ = ("launcher", "expand", "flat", "tensor_slots", "descriptor_slots")
    # Maps kept per slot; a full slot starts over.
    MAX_MAPS = 64

    def __init__(self, launcher, expand: Callable, flat: list, tensor_slots: tuple, descriptor_slots: tuple):
        self.launcher, self.expand, self.flat = launcher, expand, flat
        self.tensor_slots, self.descriptor_slots = tensor_slots, descriptor_slots

    def launch(self, kernel, grid: tuple, stream, tensors: dict, leave) -> None:
        flat = self.flat.copy()
        for index, name in self.tensor_slots:
            flat[index] = tensors[name].data_ptr()
        for start, stop, name, template, meta, maps in self.descriptor_slots:
            tensor = tensors[name]
            address = tensor.data_ptr()
            expansion = maps.get(address)
            if expansion is None:
                if len(maps) >= self.MAX_MAPS:
                    maps.clear()
                expansion = maps[address] = self.expand(rebased(template, tensor), meta)
            flat[start:stop] = expansion
        self.launcher(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, leave,
                      *flat)


def expanded_args(kernel, args: list, tensor_slots: list, descriptor_slots: list,
                  first_descriptors: list) -> Optional[ExpandedArgs]:
    """The ExpandedArgs of a plan whose kernel takes descriptors (args: the first launch's, in signature order, the
    call's slots None; first_descriptors: that launch's descriptors, in slot order), or None: no descriptors, or a
    launcher not built as Triton 3.6 and 3.9 build it (the compiled launcher wrapped by a function that expands
    descriptors with make_tensordesc_arg and the compiled kernel's descriptor metadata), or descriptors Triton
    passes without tensor maps."""
    if not descriptor_slots:
        return None
    try:
        launcher = kernel.run
        wrapper = launcher.launch
        cells = dict(zip(wrapper.__code__.co_freevars, (cell.cell_contents for cell in wrapper.__closure__ or ())))
        compiled = cells["launcher"]
        expand = cells.get("make_tensordesc_arg") or wrapper.__globals__["make_tensordesc_arg"]
        metas = list(getattr(kernel.metadata, "tensordesc_meta", None) or ())
        arity = expand.__code__.co_argcount
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if not callable(compiled) or len(metas) != len(descriptor_slots) or any(meta is None for meta in metas):
        return None
    if arity == 3:  # Triton 3.9: (arg, metadata, base arguments), the last unused by its CUDA driver
        three = expand
        expand = lambda descriptor, meta: three(descriptor, meta, None)  # noqa: E731
    tensor_names = dict(tensor_slots)
    descriptor_at = {slot[0]: (slot, first, meta) for slot, first, meta in zip(descriptor_slots, first_descriptors,
                                                                                metas)}
    flat, flat_tensors, flat_descriptors = [], [], []
    for index, arg in enumerate(args):
        if index in tensor_names:
            flat_tensors.append((len(flat), tensor_names[index]))
            flat.append(None)
        elif index in descriptor_at:
            (_, name, template), first, meta = descriptor_at[index]
            try:  # (Triton's wrapper has just expanded this very descriptor for the first launch)
                expansion = expand(first, meta)
            except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
                return None
            # the tensor map, shape and strides; no tensor (a map kept by address must not keep memory alive)
            if len(expansion) != 1 + 2 * len(first.shape) or any(isinstance(x, torch.Tensor) for x in expansion):
                return None
            flat_descriptors.append((len(flat), len(flat) + len(expansion), name, template, meta,
                                     {first.base.data_ptr(): expansion}))
            flat.extend([None] * len(expansion))
        else:
            flat.append(arg)
    own = copy.copy(launcher)
    own.launch = compiled
    return ExpandedArgs(own, expand, flat, tuple(flat_tensors), tuple(flat_descriptors))


def layout_key(tensors: dict, fresh: tuple = (), seen: Optional[dict] = None) -> tuple:
    """tensor_key of every tensor argument not named in fresh, in order; a tensor passed under several names
    (absent optional arguments share one stand-in) is looked at once. seen: {id(tensor): (tensor, its key)}, to
    share those looks between the launches of one call (it holds the tensors, so no id is reused meanwhile)."""
    seen = {} if seen is None else seen
    parts = []
    for name, t in tensors.items():
        if name in fresh:
            continue
        entry = seen.get(id(t))
        if entry is None or entry[0] is not t:
            entry = seen[id(t)] = (t, tensor_key(t))
        parts.append(entry[1])
    return tuple(parts)


def run(kernel_fn, site_key: tuple, tensors: dict, build: Callable[[], LaunchSpec], fresh: tuple = (),
        seen: Optional[dict] = None) -> None:
    """Launch kernel_fn. tensors: every tensor argument by name for this call (an argument read through a
    descriptor maps to the tensor it describes); site_key: hashable, everything else build() depends on.
    fresh: names of buffers the launcher has just allocated, whose shapes and strides follow from the other
    tensors and site_key (and whose bases the allocator aligns): they are left out of the plan key, which saves
    host time per launch. seen: as layout_key takes it, shared by a launcher's launches. build() runs on a plan
    miss only."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    key = (kernel_fn, site_key, device, layout_key(tensors, fresh, seen))
    plan = _PLANS.get(key) if ENABLED else None
    if plan is not None:
        plan.relaunch(tensors, device)
        return
    spec = build()
    kwargs = {**tensors, **spec.static}
    kernel, config = autotune.launch(kernel_fn, spec.grid, spec.configs, spec.tuning_key, spec.reset_to_zero,
                                     spec.pre_hook, **kwargs)
    if kernel is None:  # the interpreter: nothing compiled to relaunch
        return
    plan = make_plan(kernel_fn, kernel, config, spec.grid, kwargs, tensors, device) if ENABLED else None
    if plan is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan


def make_plan(kernel_fn, kernel, config, grid, kwargs: dict, tensors: dict, device) -> Optional[Plan]:
    """The plan for relaunching kernel (compiled by kernel_fn for config on device) with kwargs; None where this
    Triton's internals do not match what Plan.relaunch uses (its binder must give the same argument list)."""
    meta = {**kwargs, **config.all_kwargs()}
    try:
        names = kernel_fn.arg_names
        args = [meta[name] for name in names]
        binder = kernel_fn.device_caches[device][4]
        bound = list(binder(**meta)[0].values())
        if len(bound) != len(args) or any(a is not b for a, b in zip(bound, args)):
            return None
        kernel.run, kernel.function, kernel.packed_metadata, kernel.launch_metadata  # noqa: B018 (present?)
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    tensor_slots, descriptor_slots, first_descriptors = [], [], []
    for index, name in enumerate(names):
        if name in tensors:  # the plan must not keep this call's tensors alive
            if isinstance(args[index], torch.Tensor):
                tensor_slots.append((index, name))
            else:
                descriptor_slots.append((index, name, rebased(args[index], None)))
                first_descriptors.append(args[index])
            args[index] = None
    g = tuple(grid(meta))
    g = g + (1,) * (3 - len(g))
    return Plan(kernel, g, args, tuple(tensor_slots), tuple(descriptor_slots),
                expanded_args(kernel, args, tensor_slots, descriptor_slots, first_descriptors))


def plans() -> dict:
    """The plans made so far (tests read it)."""
    return _PLANS
