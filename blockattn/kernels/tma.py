"""Host tensor descriptors (Hopper's TMA): the kernels read the tiles their loops walk through them where the GPU
and the tensor allow it, and pointer loads otherwise. Measured on the H200 (BENCHMARKS.md): the forward's K/V
reads through descriptors ran 6.15 ms against 6.52 ms for pointer loads (D=128, density 0.25).

A descriptor covers a whole [B, H, S, D] tensor; the kernels load [1, 1, rows, BLOCK_D] boxes at (b, h, row, 0).
Rows past S and columns past D read as zeros, as masked pointer loads do. A packed ("thd") batch keeps pointer
loads: a box that crosses a sequence's end would read the next sequence's tokens.
"""

from __future__ import annotations

import torch
import triton.language as tl

from . import autotune, launch

# Whether the kernels may read tiles through descriptors at all (tests switch it off to cover the pointer loads).
TMA_LOADS = True
# The dK/dV kernel's Q and dO tiles, when its loop has no dQ atomics (dQ mode "kernel"): 79.3 / 19.4 ms against
# 81.4 / 20.8 ms for pointer loads at densities 1 / 0.25 (128x128 blocks, H200, BENCHMARKS.md). Beside the atomics
# they spill registers and ran slower (92.7 against 87.7 ms), so the accumulating modes keep pointer loads.
DKDV_TMA_LOADS = True

# Below this much work (B * Hq * Sq * Sk * D, the dense problem's) the kernels read tiles by pointers: a call that
# small is host-bound, and descriptors cost host time (a plan keeps their encoded tensor maps, launch.ExpandedArgs,
# but the warp-specialized backward takes a launch more; at B8 H16 S1024 it stayed host-bound, 0.53-0.79 ms of host
# time a forward+backward on the calling thread against 0.375 of GPU time, BENCHMARKS.md, thirty-third session).
MIN_DESCRIPTOR_WORK = 2 ** 35

# Descriptor argument -> (tile rows, tile columns) meta-parameters of its box.
_BOX = {"K_DESC": ("BLOCK_N", "BLOCK_D"), "V_DESC": ("BLOCK_N", "BLOCK_DV"),
        "Q_DESC": ("BLOCK_M", "BLOCK_D"), "DO_DESC": ("BLOCK_M", "BLOCK_DV")}


def _descriptor_class():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host descriptors
        return None
    return TensorDescriptor


def _gpu_has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and launch.device_capability(device)[0] >= 9


def available(kernel_fn, device: torch.device) -> bool:
    """Whether kernel_fn can read through host descriptors on device: a GPU of compute capability 9 or more, or
    Triton's interpreter (which emulates them)."""
    if not TMA_LOADS or _descriptor_class() is None:
        return False
    return autotune.is_interpreted(kernel_fn) or _gpu_has_tma(device)


def reductions_available(kernel_fn, device: torch.device) -> bool:
    """Whether kernel_fn can add into a descriptor (atomic_add: Hopper's bulk reductions, dQ mode "tma") on
    device: compiled Triton on a GPU of compute capability 9 or more; the interpreter has no reductions."""
    return (_descriptor_class() is not None and not autotune.is_interpreted(kernel_fn) and _gpu_has_tma(device)
            and hasattr(tl.tensor_descriptor, "atomic_add"))


def tile_descriptor(t: torch.Tensor):
    """A descriptor over t [B, H, S, D] whose box is set per config by set_boxes; None where the TMA cannot read
    t (base not 16-byte aligned, a stride that is not a multiple of 16 bytes, last dim not dense)."""
    cls = _descriptor_class()
    elt = t.element_size()
    if t.stride(-1) != 1 and t.shape[-1] > 1 or t.data_ptr() % 16:
        return None
    # A size-1 dim's stride is never used; any aligned positive value will do.
    strides = [st if n > 1 else 16 // elt for st, n in zip(t.stride(), t.shape)]
    strides[-1] = 1
    if any(st <= 0 or (st * elt) % 16 for st in strides[:-1]) or min(t.shape) == 0:
        return None
    return cls(t, list(t.shape), strides, [1, 1, 16, 16])


def tile_args(kernel_fn, packed: bool, work: int, use: bool = True, **tensors: torch.Tensor) -> dict:
    """Kernel arguments for reading the tiles of tensors ([B, H, S, D], keyed by their descriptor argument's
    name) through descriptors: {name: descriptor, ..., "TMA_LOADS": True}; or {name: the tensor itself, ...,
    "TMA_LOADS": False} (unused by the kernel) when not use, for packed batches, below MIN_DESCRIPTOR_WORK (work:
    B * Hq * Sq * Sk * D), where kernel_fn cannot use descriptors on this device, or when any of the tensors
    cannot be described (tile_descriptor)."""
    if (use and not packed and work >= MIN_DESCRIPTOR_WORK
            and available(kernel_fn, next(iter(tensors.values())).device)):
        descs = {name: tile_descriptor(t) for name, t in tensors.items()}
        if all(d is not None for d in descs.values()):
            return dict(descs, TMA_LOADS=True)
    return dict(tensors, TMA_LOADS=False)


def accumulator_descriptor(acc: torch.Tensor):
    """A descriptor over the fp32 dQ accumulator [B * H, Sq, BD] for bulk adds; its box height is the tile's,
    set per config by set_boxes."""
    return _descriptor_class()(acc, list(acc.shape), list(acc.stride()), [1, 16, acc.shape[-1]])


def set_boxes(nargs: dict) -> None:
    """Autotune pre-hook: every descriptor argument gets the box of one tile of the config being launched."""
    for name, (rows, cols) in _BOX.items():
        desc = nargs.get(name)
        if desc is not None and not isinstance(desc, torch.Tensor):
            desc.block_shape = [1, 1, nargs[rows], nargs[cols]]
    dq = nargs.get("DQ_DESC")
    if dq is not None and not isinstance(dq, torch.Tensor):
        dq.block_shape = [1, nargs["BLOCK_M"], nargs["BLOCK_D"]]
