"""The backward's per-mask preparation replayed from CUDA graphs (kernels/replay.py): the same results as computed
eagerly, mask after mask; one graph per computation and shapes; none while a graph is captured; at most KEPT kept.
On the CPU the preparation runs eagerly and keeps no graph."""

import contextlib
import warnings
from collections import OrderedDict

import pytest
import torch

import blockattn
from blockattn.kernels import backward_ws, replay

from conftest import DEVICE, ON_GPU, captured_replay


@pytest.fixture
def graphs(monkeypatch) -> OrderedDict:
    """The graphs kept, empty at the start (and the tables of prepared lists too)."""
    kept = OrderedDict()
    monkeypatch.setattr(replay, "_GRAPHS", kept)
    for table in ("_TILE_ORDERS", "_PAIRED_ORDERS", "_PAIR_LISTS"):
        monkeypatch.setattr(backward_ws, table, {})
    return kept


def _lists(seed: int, heads: int, nq: int, nk: int, density: float = 0.3) -> tuple:
    """A random mask's q lists (q_count int32 [1, heads, nk], q_index int32 [1, heads, nk, nq]) on DEVICE."""
    keep = torch.rand(1, heads, nq, nk, generator=torch.Generator().manual_seed(seed)) < density
    return tuple(t.to(DEVICE) for t in blockattn.sparsity.build_lists(keep.transpose(-1, -2)))


@pytest.mark.parametrize("heads, kv_heads, tiles_per_block", [(4, 4, 1), (8, 2, 1), (1, 2, 1), (4, 4, 2)])
def test_new_masks_get_the_eager_preparation_bit_for_bit(graphs, monkeypatch, heads, kv_heads, tiles_per_block):
    """Three masks of one shape in turn through the cached preparation (matched tile order, pair lists merged over
    the group): each equals the eager computation on its lists, also after the later masks' replays (a result is
    the graph's output cloned), and on a GPU the three share one graph per computation."""
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    group = heads // kv_heads if heads > 1 else 2
    got, want = [], []
    for seed in range(3):
        q_count, q_index = _lists(seed, heads, 12, 16)
        order = backward_ws.cached_paired_tile_order(q_count, q_index, kv_heads, tiles_per_block)
        lists = backward_ws.cached_pair_lists(q_count, q_index, order, kv_heads, tiles_per_block, group)
        got.append((order, *lists))
        eager_order = backward_ws.paired_tile_order(q_count, q_index, kv_heads, tiles_per_block)
        eager_lists = backward_ws.pair_lists(q_count, q_index, eager_order, tiles_per_block)
        eager_lists = backward_ws.merge_group_lists(*eager_lists, group) if group > 1 else eager_lists
        want.append((eager_order, *eager_lists))
    for results, expected in zip(got, want):
        for result, value in zip(results, expected):
            assert result.dtype == value.dtype and torch.equal(result, value)
    assert not torch.equal(got[0][0], got[1][0]), "the masks gave one order: the test cannot tell them apart"
    assert len(graphs) == (2 if ON_GPU else 0)


def test_tile_order_of_new_masks_and_the_graphs_kept(graphs, monkeypatch):
    """The tile order of 128-key programs replays too; KEPT bounds the graphs, the least recently used going first;
    clear() drops them all."""
    monkeypatch.setattr(replay, "KEPT", 2)
    orders = {}
    for nk in (8, 16, 8, 24):  # three shapes, the first used again before the third comes
        q_count, _ = _lists(nk, 4, 6, nk)
        orders[nk] = backward_ws.cached_tile_order(q_count, 2, 1)
        assert torch.equal(orders[nk], backward_ws.tile_order(q_count, 2, 1))
    if ON_GPU:
        assert [key[3][0][0][-1] for key in graphs] == [8, 24]  # (the lists' nk: 16 went first)
    else:
        assert not graphs
    replay.clear()
    assert not graphs


def test_a_capture_takes_the_preparation_in(graphs, monkeypatch):
    """While a CUDA graph is being captured the preparation joins it (no graph of its own), and the captured graph's
    replay on lists rewritten in place gives their eager order."""
    monkeypatch.setattr(backward_ws, "PAIR_MIN_TILES", 2)
    q_count, q_index = _lists(0, 4, 12, 16)
    if not ON_GPU:
        assert torch.equal(backward_ws.cached_paired_tile_order(q_count, q_index, 4, 1),
                           backward_ws.paired_tile_order(q_count, q_index, 4, 1))
        return
    new_count, new_index = _lists(1, 4, 12, 16)
    # (warmed up uncached: a cached call outside the capture would make a graph of its own)
    captured = captured_replay(lambda: backward_ws.cached_paired_tile_order(q_count, q_index, 4, 1),
                               (q_count, q_index), (new_count, new_index),
                               warm_up=lambda: backward_ws.paired_tile_order(q_count, q_index, 4, 1))
    assert not graphs
    assert torch.equal(captured, backward_ws.paired_tile_order(new_count, new_index, 4, 1))


def test_a_refused_capture_warns_once_and_computes_eagerly(graphs, monkeypatch):
    """Where CUDA refuses a capture (CaptureRefused), run() warns, returns the eager result and computes eagerly from
    then on, trying no capture again (on any machine: the capture is stood in for)."""
    attempts = []

    class Refused:
        def __init__(self, compute, inputs):
            attempts.append(len(inputs))
            raise replay.CaptureRefused("operation not permitted when stream is capturing")
    monkeypatch.setattr(replay, "ENABLED", True)
    monkeypatch.setattr(replay, "_graphable", lambda tensor: True)
    monkeypatch.setattr(replay, "_stream", lambda device: 0)
    monkeypatch.setattr(replay, "_Replay", Refused)
    q_count, _ = _lists(5, 4, 6, 8)
    with pytest.warns(RuntimeWarning, match="could not capture"):
        first = replay.run(lambda counts: backward_ws.tile_order(counts, 2, 1), (q_count, ), ("test", ))
    assert torch.equal(first, backward_ws.tile_order(q_count, 2, 1)) and attempts == [1]
    assert not replay.ENABLED and not graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = replay.run(lambda counts: backward_ws.tile_order(counts, 2, 1), (q_count, ), ("test", ))
    assert torch.equal(again, first) and attempts == [1]


class _Recorder:
    """Stand-ins for CUDA's stream, device and graph objects (torch.cuda.*), logging what _Replay asks of them."""

    def __init__(self, monkeypatch, refuse):
        self.log, self.refuse, self.capturing = [], refuse, False
        recorder = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                recorder.log.append(f"{self.name} waits for {other.name}")

        class Graph:
            def capture_begin(self, capture_error_mode):
                recorder.log.append(f"capture ({capture_error_mode})")
                if refuse == "begin":
                    raise RuntimeError("capture not permitted")
                recorder.capturing = True

            def capture_end(self):
                recorder.log.append("end")
                recorder.capturing = False

            def replay(self):
                recorder.log.append("replay")

        @contextlib.contextmanager
        def on_stream(stream):
            recorder.log.append(f"on {stream.name}")
            yield
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("current"))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("side"))
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "stream", on_stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)

    def compute(self, counts):
        self.log.append("compute")
        if self.capturing and self.refuse == "inside":
            raise RuntimeError("operation not permitted when stream is capturing")
        return counts * 2, counts + 1


@pytest.mark.parametrize("refuse", [None, "begin", "inside"])
def test_the_capture_sequence_with_cuda_stood_in_for(monkeypatch, refuse):
    """_Replay's steps, CUDA's objects stood in for (on any machine): the side stream waits for the current one, the
    computation runs once outside the capture and once inside, the current stream waits for the side one. A capture
    refused at its start, or by an operation inside it (the capture then ended), comes out as CaptureRefused, the
    streams joined all the same. A replay copies the new inputs into the static ones, replays and returns clones of
    the captured outputs."""
    recorder = _Recorder(monkeypatch, refuse)
    counts = torch.arange(6, dtype=torch.int32)
    start = ["side waits for current", "on side", "compute", "capture (thread_local)"]
    if refuse:
        with pytest.raises(replay.CaptureRefused, match="not permitted"):
            replay._Replay(recorder.compute, (counts, ))
        inside = ["compute", "end"] if refuse == "inside" else []
        assert recorder.log == start + inside + ["current waits for side"]
        return
    captured = replay._Replay(recorder.compute, (counts, ))
    assert recorder.log == start + ["compute", "end", "current waits for side"]
    new = torch.arange(6, 12, dtype=torch.int32)
    results = captured((new, ))
    assert recorder.log[-1] == "replay" and torch.equal(captured.inputs[0], new)
    for result, output in zip(results, captured.outputs):
        assert torch.equal(result, output) and result.data_ptr() != output.data_ptr()
