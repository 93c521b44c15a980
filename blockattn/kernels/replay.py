"""The backward's per-mask preparation replayed from CUDA graphs, so that a mask that changes every step costs little
host time.

Where a mask's q lists are new, the warp-specialized backward derives from them a tile order and, for 64-key tiles,
the paired programs' lists (backward_ws: tile_order, paired_tile_order, pair_lists, merge_group_lists): about 200
small PyTorch operations, 3-9 ms of host time a call at B1 H24 S16k-32k (by the host), more than the whole
forward+backward's GPU time at S=16k (2.5 ms at d=0.1). Masks made afresh every step (a video model's top-k blocks)
pay it on every call. On CUDA, run() captures such a computation once per shapes, settings and stream in a CUDA graph
and replays it after: two copies in, one graph launch, a clone per output. Results are the eager computation's, bit
for bit (the same kernels on the same values).

Each graph keeps its static inputs, outputs and intermediate memory (tens of MB at S=32k, a few hundred at S=128k),
so only the KEPT most recently used stay; clear() drops them all. Where CUDA refuses a capture (an allocator setting
or another library's hooks may), run() warns once and computes eagerly from then on, as it does with ENABLED False.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

import torch

from .. import sparsity

# Whether run() replays CUDA computations from graphs (benchmarks switch it off to time the eager path; run() does
# after a capture failed).
ENABLED = True
# Graphs kept, the least recently used dropped first.
KEPT = 4

_GRAPHS: OrderedDict = OrderedDict()


class CaptureRefused(RuntimeError):
    """CUDA refused to capture a computation (which runs eagerly all the same): run() computes eagerly from then on."""


class _Replay:
    """compute(*inputs) captured in a CUDA graph on the current stream's device, with the static inputs it reads."""

    def __init__(self, compute: Callable, inputs: Sequence[torch.Tensor]):
        device = inputs[0].device
        current = torch.cuda.current_stream(device)
        self.inputs = [t.clone(memory_format=torch.contiguous_format) for t in inputs]
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.device(device), torch.cuda.stream(side):
                compute(*self.inputs)  # once outside the capture: lazy initializations (cuBLAS's) must not be captured
                self.graph = torch.cuda.CUDAGraph()
                try:
                    # thread_local: other threads' calls that a capture forbids (a synchronization) do not break it
                    self.graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        outputs = compute(*self.inputs)
                    finally:
                        self.graph.capture_end()
                except RuntimeError as error:
                    raise CaptureRefused(str(error)) from error
        finally:
            current.wait_stream(side)
        self.single = isinstance(outputs, torch.Tensor)
        self.outputs = (outputs, ) if self.single else tuple(outputs)

    def __call__(self, inputs: Sequence[torch.Tensor]):
        for static, given in zip(self.inputs, inputs):
            static.copy_(given)
        self.graph.replay()
        outputs = tuple(t.clone() for t in self.outputs)  # the next replay writes over the graph's own
        return outputs[0] if self.single else outputs


def run(compute: Callable, inputs: Sequence[torch.Tensor], terms: Hashable):
    """compute(*inputs): a tensor or a tuple of tensors computed from the tensors `inputs` alone, without host
    synchronization. On CUDA from a graph captured the first time for the inputs' shapes and dtypes, their device,
    the current stream and `terms` (everything else the computation depends on: its name, its settings); eagerly
    elsewhere, while ENABLED is False, while torch.compile traces and while a graph is being captured (the
    computation then joins that graph). Where CUDA refuses the capture, it warns and sets ENABLED False."""
    global ENABLED
    first = inputs[0]
    if not ENABLED or not _graphable(first):
        return compute(*inputs)
    key = (terms, first.device, _stream(first.device), tuple((t.shape, t.dtype) for t in inputs))
    replay = _GRAPHS.get(key)
    if replay is None:
        try:
            replay = _Replay(compute, inputs)
        except CaptureRefused as error:
            ENABLED = False
            warnings.warn(f"blockattn could not capture the backward's per-mask preparation in a CUDA graph ({error});"
                          " it runs eagerly from now on", RuntimeWarning, stacklevel=2)
            return compute(*inputs)
        _GRAPHS[key] = replay
        while len(_GRAPHS) > KEPT:
            _GRAPHS.popitem(last=False)
    _GRAPHS.move_to_end(key)
    return replay(inputs)


def _graphable(tensor: torch.Tensor) -> bool:
    """Whether a computation on tensor's device may be captured now: a CUDA tensor, outside torch.compile's tracing
    and any capture."""
    return tensor.is_cuda and not sparsity.compiling_or_capturing(tensor.device)


def _stream(device: torch.device) -> int:
    """The device's current CUDA stream (its handle): each stream replays graphs of its own, whose static inputs no
    other stream's replay may overwrite meanwhile."""
    return torch.cuda.current_stream(device).cuda_stream


def clear() -> None:
    """Drop every graph kept, and with them their memory."""
    _GRAPHS.clear()


def kept_per_lists(table: dict, lists: tuple, terms: tuple, compute, derived: tuple = (), replayed: bool = True):
    """compute(*lists, *derived) (derived: tensors that follow from the lists and the terms, such as their tile
    order), kept in table under the lists tensors' ids and versions and the hashable terms, so computed again only
    after a list is written in place; the entry goes with lists[0]. Under CUDA graph capture (and while Inductor's
    CUDA graphs warm up: sparsity.compiling_or_capturing) it is computed afresh and not kept: the capture's memory
    belongs to the graph; so is an inference tensor's, which has no version counter to tell a write in place. On
    CUDA new lists take the computation's replay (run(); not `replayed`: computed directly, as a value that is
    no tensor must be): a mask made afresh every step then costs little host time."""
    first, inputs = lists[0], lists + derived
    if any(t.is_inference() for t in lists) or (first.is_cuda and sparsity.compiling_or_capturing(first.device)):
        return compute(*inputs)
    key = tuple((id(t), t._version) for t in lists) + terms
    entry = table.get(key)
    if entry is not None and entry[0]() is first:
        return entry[1]
    if replayed:  # (the name tells the computations apart)
        value = run(compute, inputs, (compute.__qualname__, ) + terms)
    else:
        value = compute(*inputs)
    table[key] = (weakref.ref(first, lambda _, key=key: table.pop(key, None)), value)
    return value
