"""Host time of one kernel relaunch through a launch plan, split by what it does, for each launch of an eager
B8 H16 S1024 D128 forward+backward (d=0.5, 128x128 blocks): the plan key (launch.layout_key; for the backward's launches
also with the keys its earlier launches left, which they share), Plan.relaunch, and
variants of it measured in the same process: Triton's launch hooks passed as Triton keeps them (an empty chain in
Triton 3.6: launch metadata built, the chain called twice) or as None where none is registered, tensors passed
as tensors or as their data pointers (the launcher then skips its per-pointer driver query), and the compiled
launcher's C entry called directly (Triton 3.6's CudaLauncher, no scratch buffers). Each time: the fastest of 15 rounds of 100 relaunches back to back, per relaunch.

    python benchmarks/launch_cost.py
"""

import torch
from triton import knobs
from triton.runtime.driver import driver

from blockattn.kernels import launch

from exp_short import short_case
from host_cost import per_call_us

CALLS = []


def record():
    """Wrap launch.run so that each call's (kernel_fn, site_key, tensors, fresh, seen) lands in CALLS."""
    inner = launch.run

    def wrapper(kernel_fn, site_key, tensors, build, fresh=(), seen=None):
        # seen as this launch finds it: the keys its launcher's earlier launches left
        CALLS.append((kernel_fn, site_key, dict(tensors), fresh, None if seen is None else dict(seen)))
        return inner(kernel_fn, site_key, tensors, build, fresh, seen)
    launch.run = wrapper
    return inner


def fastest_us(fn, calls: int = 100) -> float:
    """host_cost.per_call_us over 15 rounds."""
    return per_call_us(fn, calls, rounds=15)


def variants(plan, tensors, device):
    kernel, grid = plan.kernel, plan.grid

    def args_of(as_pointers: bool):
        args = plan.args.copy()
        for index, name in plan.tensor_slots:
            args[index] = tensors[name].data_ptr() if as_pointers else tensors[name]
        for index, name, template in plan.descriptor_slots:
            args[index] = launch.rebased(template, tensors[name])
        return args

    def variant(as_pointers: bool, skip_hooks: bool):
        def go():
            args = args_of(as_pointers)
            stream = driver.active.get_current_stream(device)
            enter, leave = launch.launch_hooks() if skip_hooks else (knobs.runtime.launch_enter_hook,
                                                                      knobs.runtime.launch_exit_hook)
            metadata = kernel.launch_metadata(grid, stream, *args) if enter is not None else None
            kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, metadata, enter,
                       leave, *args)
        return go

    found = {"Plan.relaunch": lambda: plan.relaunch(tensors, device),
             "hooks as Triton keeps them, tensors (before)": variant(False, False),
             "no hooks, tensors": variant(False, True), "no hooks, pointers": variant(True, True)}
    launcher = kernel.run
    c_entry = getattr(launcher, "launch", None)
    if (c_entry is not None and getattr(launcher, "global_scratch_size", 1) == 0
            and getattr(launcher, "profile_scratch_size", 1) == 0 and not plan.descriptor_slots
            and hasattr(launcher, "launch_cooperative_grid")):
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl

        def direct():
            args = args_of(True)
            stream = driver.active.get_current_stream(device)
            c_entry(grid[0], grid[1], grid[2], stream, kernel.function, coop, pdl, None, None,
                    kernel.packed_metadata, None, None, None, *args)
        found["C entry, pointers"] = direct
    return found


def main():
    fwd, fwd_bwd = short_case(8, 16, 1024, 0.5)
    for _ in range(5):
        fwd_bwd()
    record()
    fwd_bwd()
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    print(f"triton launch hooks: enter {knobs.runtime.launch_enter_hook!r}", flush=True)
    print(f"torch.cuda.current_device {fastest_us(torch.cuda.current_device, 1000):.2f} us, "
          f"get_current_stream {fastest_us(lambda: driver.active.get_current_stream(device), 1000):.2f} us",
          flush=True)
    for kernel_fn, site_key, tensors, fresh, seen in CALLS:
        name = getattr(kernel_fn, "__name__", repr(kernel_fn))
        key = (kernel_fn, site_key, device, launch.layout_key(tensors, fresh))
        plan = launch.plans().get(key)
        distinct = len({id(t) for n, t in tensors.items() if n not in fresh})
        shared = ""
        if seen is not None:  # (the time includes copying seen, so that every round finds what the launch found)
            shared = (f", with the {len(seen)} keys its launcher's earlier launches left "
                      f"{fastest_us(lambda: launch.layout_key(tensors, fresh, seen.copy())):.1f} us")
        print(f"{name}: {len(tensors)} tensor arguments ({distinct} distinct, keyed), "
              f"layout_key {fastest_us(lambda: launch.layout_key(tensors, fresh)):.1f} us{shared}", flush=True)
        if plan is None:
            print("  no plan", flush=True)
            continue
        print(f"  {len(plan.args)} arguments, {len(plan.tensor_slots)} tensors, {len(plan.descriptor_slots)} "
              f"descriptors, launcher {type(plan.kernel.run).__name__}", flush=True)
        for label, fn in variants(plan, tensors, device).items():
            print(f"  relaunch, {label}: {fastest_us(fn):.1f} us", flush=True)


if __name__ == "__main__":
    main()
