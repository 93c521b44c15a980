"""The backward's per-mask preparation replayed from CUDA graphs, so that a mask that changes every step costs little
host time.

Where a mask's q lists are new, the warp-specialized backward derives from them a tile order and, for 64-key tiles,
the paired programs' lists (backward_ws: tile_order, paired_tile_order, pair_lists, merge_group_lists): about 200
small PyTorch operations, 4-5 ms of host time at B1 H24 S32k, more than the backward's own GPU time at S=16k. Masks
made afresh every step (a video model's top-k blocks) pay it on every call. On CUDA, run() captures such a
computation once per shapes, settings and stream in a CUDA graph and replays it after: two copies in, one graph
launch, a clone per output. Results are the eager computation's, bit for bit (the same kernels on the same values).

Each graph keeps its static inputs, outputs and intermediate memory (tens of MB at S=32k, a few hundred at S=128k),
so only the KEPT most recently used stay; clear() drops them all.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Sequence

import torch

from .. import sparsity

# Whether run() replays CUDA computations from graphs (benchmarks switch it off to time the eager path).
ENABLED = True
# Graphs kept, the least recently used dropped first.
KEPT = 4

_GRAPHS: OrderedDict = OrderedDict()


class _Replay:
    """compute(*inputs) captured in a CUDA graph on the current stream's device, with the static inputs it reads."""

    def __init__(self, compute: Callable, inputs: Sequence[torch.Tensor]):
        device = inputs[0].device
        current = torch.cuda.current_stream(device)
        self.inputs = [t.clone(memory_format=torch.contiguous_format) for t in inputs]
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.device(device), torch.cuda.stream(side):
            compute(*self.inputs)  # once outside the capture: lazy initializations (cuBLAS's) must not be captured
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' calls that a capture forbids (a synchronization) do not break this one
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = compute(*self.inputs)
            finally:
                self.graph.capture_end()
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
    computation then joins that graph)."""
    first = inputs[0]
    if not ENABLED or not first.is_cuda or sparsity.compiling_or_capturing(first.device):
        return compute(*inputs)
    stream = torch.cuda.current_stream(first.device)
    key = (terms, first.device, stream.cuda_stream, tuple((t.shape, t.dtype) for t in inputs))
    replay = _GRAPHS.get(key)
    if replay is None:
        replay = _Replay(compute, inputs)
        _GRAPHS[key] = replay
        while len(_GRAPHS) > KEPT:
            _GRAPHS.popitem(last=False)
    _GRAPHS.move_to_end(key)
    return replay(inputs)


def clear() -> None:
    """Drop every graph kept, and with them their memory."""
    _GRAPHS.clear()
