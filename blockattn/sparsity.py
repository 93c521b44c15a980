"""BlockSparsity: a block mask in the forms the kernels read.

Vocabulary (see DESIGN.md): a *block* is the mask granularity ``block_q x block_kv``; ``nq = ceil(Sq / block_q)``
and ``nk = ceil(Sk / block_kv)``. The *kv lists* give, per query block, the count and the ascending indices of
its kept key blocks; the *q lists* give the same per key block. Lists are padded to the full axis length so a
kernel reads them by shape. Everything here runs on the mask's device with no host synchronization.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Optional

import torch

_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


def check_block_size(block_size) -> tuple[int, int]:
    """block_size as (block_q, block_kv) ints; TypeError / ValueError naming what was given otherwise."""
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise TypeError(f"block_size must be a pair (block_q, block_kv), got {block_size!r}")
    for side in block_size:
        if isinstance(side, bool) or not isinstance(side, int):
            raise TypeError(f"block_size must hold two ints, got {block_size!r}")
        if side <= 0:
            raise ValueError(f"block_size sides must be positive, got {tuple(block_size)}")
    return int(block_size[0]), int(block_size[1])


def _check_seq(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _spans(seq: int, block: int, device):
    """First and last token index of each block: two int64 [n] tensors."""
    first = torch.arange(0, seq, block, device=device)
    return first, torch.clamp(first + block, max=seq) - 1


def _difference_range(seq_q: int, seq_kv: int, block_size, device):
    """For every block pair, the smallest and largest i - j over its token rectangle: two [nq, nk] tensors."""
    block_q, block_kv = check_block_size(block_size)
    q_first, q_last = _spans(_check_seq("seq_q", seq_q), block_q, device)
    k_first, k_last = _spans(_check_seq("seq_kv", seq_kv), block_kv, device)
    return q_first[:, None] - k_last[None, :], q_last[:, None] - k_first[None, :]


def _outside_inference_mode():
    """Builds normal tensors even under torch.inference_mode (a no-op outside it). A BlockSparsity's tensors outlive
    the call that built them, and a training step saves them for its backward, which autograd refuses to do with
    inference tensors: a validation pass under inference_mode must not break the training steps after it."""
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():  # (dynamo cannot trace the test)
        return contextlib.nullcontext()
    return torch.inference_mode(False)


def _normal(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """tensor, or a normal copy of it if it is an inference tensor (see _outside_inference_mode)."""
    if tensor is None or torch.compiler.is_compiling() or not tensor.is_inference():
        return tensor
    with torch.inference_mode(False):
        return tensor.clone()


def build_lists(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count and ascending indices of the kept columns of each row.

    keep: bool [..., R, C]. Returns count int32 [..., R] and index int32 [..., R, C] (contiguous); entries of
    ``index`` past ``count`` are the dropped columns, ascending: kernels never read them.
    """
    if _in_one_launch(keep):  # the same lists: every kept column counts as full
        return _full_first_lists(keep, keep)
    count = keep.sum(-1, dtype=torch.int32)
    # A stable sort on "dropped" puts the kept columns first, each group in ascending order.
    index = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return count.contiguous(), index.contiguous()


def compiling_or_capturing(device: torch.device) -> bool:
    """Whether torch.compile is tracing, or a CUDA graph capturing on a CUDA device, or Inductor's CUDA graphs
    (torch.compile's mode="reduce-overhead") warming up there: then work must go into the graph (nothing cached
    from outside it, no launch that first compiles and loads a module), and nothing computed may be kept (a
    warm-up's allocations go to the graphs' private memory pool, which must hold no tensor past the run: Inductor
    checks, and raises)."""
    # is_compiling first: torch.compile cannot trace is_current_stream_capturing (a graph break)
    return torch.compiler.is_compiling() or (device.type == "cuda" and (torch.cuda.is_current_stream_capturing()
                                                                         or _inductor_graphs_warming_up(device)))


def _inductor_graphs_warming_up(device: torch.device) -> bool:
    """Whether Inductor's CUDA graph trees run a warm-up on this thread for device now: their manager is warming up
    and the current stream is its own (the warm-up's, which allocates into the pool). Read from Inductor's private
    state, where torch.compile has imported it: False if absent or laid out otherwise."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        # (no get_manager: it would create a container for a thread that never had one)
        if not hasattr(trees.local, "tree_manager_containers") and not torch._C._is_key_in_tls(
                "tree_manager_containers"):
            return False
        index = torch.cuda.current_device() if device.index is None else device.index
        container = trees.get_obj(trees.local, "tree_manager_containers").get(index)
        manager = None if container is None else container.tree_manager
        return manager is not None and manager.in_warmup and torch.cuda.current_stream(device) == manager.stream
    except (AttributeError, KeyError, RuntimeError, TypeError):
        return False


def _in_one_launch(keep: torch.Tensor) -> bool:
    """Whether the lists over keep come from the list kernel (kernels/lists.py): on a CUDA tensor, except while
    torch.compile traces (there the PyTorch operations go into the graph, and Inductor fuses them) or a CUDA graph
    captures (the kernel's first launch compiles and loads it, which a capture may not allow; the operations are
    captured as they always were)."""
    return keep.is_cuda and not compiling_or_capturing(keep.device)


def _full_first_lists(keep: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """build_lists(keep) with each row's full columns first and the others stored plus the column count C, both
    groups ascending (so the whole kept part is ascending); the dropped columns follow. keep, full: bool
    [..., R, C], full within keep. Each column's slot comes from running counts, with no sort (these lists are
    rebuilt on every call that gives kv_valid; on a GPU they take one kernel launch)."""
    if _in_one_launch(keep):
        from .kernels import lists  # (imports Triton)
        return lists.full_first_lists(keep, full)
    return _full_first_lists_by_operations(keep, full)


def _full_first_lists_by_operations(keep: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_full_first_lists in PyTorch operations (the CPU's, and torch.compile's)."""
    columns = keep.shape[-1]
    column = torch.arange(columns, device=keep.device, dtype=torch.int32)
    partial = keep & ~full

    def running(flags):  # per column, how many of the row's columns up to it have the flag, less one
        return flags.cumsum(-1, dtype=torch.int32) - 1
    count = keep.sum(-1, dtype=torch.int32)
    slot = torch.where(full, running(full),
                       torch.where(partial, full.sum(-1, keepdim=True, dtype=torch.int32) + running(partial),
                                   count.unsqueeze(-1) + running(~keep)))
    index = torch.empty(keep.shape, device=keep.device, dtype=torch.int32)
    index.scatter_(-1, slot.long(), torch.where(partial, column + columns, column).expand(keep.shape))
    return count.contiguous(), index


def _mask_from_lists(count: torch.Tensor, index: torch.Tensor, columns: int) -> torch.Tensor:
    """Inverse of build_lists: bool [..., R, columns] with the listed columns set."""
    slot = torch.arange(index.shape[-1], device=index.device, dtype=torch.int32)
    listed = slot < count.unsqueeze(-1)
    # Unlisted slots write into a spare column that is cut off afterwards.
    target = torch.where(listed, index, torch.full_like(index, columns)).long()
    keep = torch.zeros(*index.shape[:-1], columns + 1, dtype=torch.bool, device=index.device)
    keep.scatter_(-1, target, True)
    return keep[..., :columns].contiguous()


class BlockSparsity:
    """A block mask prepared for attention(): kv lists (built once), q lists and variants built lazily and cached.

    Build it with :meth:`from_mask`, or from lists you already have::

        BlockSparsity(kv_count, kv_index, block_size=(128, 64), seq_q=Sq, seq_kv=Sk)

    kv_count: int32 [Bm, Hm, nq]; kv_index: int32 [Bm, Hm, nq, L] with ``L >= nk`` and the first ``kv_count``
    entries of each row the kept key blocks in ascending order. ``Bm`` is 1 or the batch, ``Hm`` is 1 or the
    number of query heads (size-1 dims broadcast). Reuse one object across calls and layers: attention() then
    does no conversion. Built or used under torch.inference_mode, it still holds normal tensors, so one object
    serves validation passes and the training steps after them.
    """

    def __init__(self, kv_count: torch.Tensor, kv_index: torch.Tensor, block_size, seq_q: int, seq_kv: int,
                 *, _mask: Optional[torch.Tensor] = None):
        if block_size is None:
            raise ValueError("block_size is required: the (block_q, block_kv) the lists were built for")
        self.block_size = check_block_size(block_size)
        self.seq_q = _check_seq("seq_q", seq_q)
        self.seq_kv = _check_seq("seq_kv", seq_kv)
        if kv_count is None or kv_index is None:
            missing = "kv_index" if kv_index is None else "kv_count"
            raise ValueError(f"{missing} is missing: a BlockSparsity needs both kv_count and kv_index")
        for name, lists in (("kv_count", kv_count), ("kv_index", kv_index)):
            if not isinstance(lists, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(lists).__name__}")
            if lists.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {lists.dtype}")
            if not lists.is_contiguous():
                raise ValueError(f"{name} must be contiguous (kernels read it by shape), got strides {lists.stride()}")
        nq, nk = self.num_blocks
        if kv_count.ndim != 3 or kv_count.shape[-1] != nq:
            raise ValueError(f"kv_count must have shape [Bm, Hm, nq={nq}], got {tuple(kv_count.shape)}")
        if kv_index.ndim != 4 or tuple(kv_index.shape[:3]) != tuple(kv_count.shape) or kv_index.shape[-1] < nk:
            raise ValueError(
                f"kv_index must have shape [{kv_count.shape[0]}, {kv_count.shape[1]}, {nq}, L >= nk={nk}] "
                f"(padded to the key-block count), got {tuple(kv_index.shape)}")
        if kv_index.device != kv_count.device:
            raise ValueError(f"kv_count is on {kv_count.device} but kv_index is on {kv_index.device}")
        self.kv_count, self.kv_index, self._mask = _normal(kv_count), _normal(kv_index), _normal(_mask)
        self._cache: dict = {}
        self._build_q_lists = None  # full_first's lists build their own q lists, when asked

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_mask(cls, mask: torch.Tensor, block_size, seq_q: int, seq_kv: int) -> "BlockSparsity":
        """Prepare a block mask: bool/int8/uint8 (nonzero = keep) shaped [nq, nk], [H|1, nq, nk] or
        [B|1, H|1, nq, nk], with ``nq = ceil(seq_q / block_q)`` and ``nk = ceil(seq_kv / block_kv)``."""
        block_q, block_kv = check_block_size(block_size)
        seq_q, seq_kv = _check_seq("seq_q", seq_q), _check_seq("seq_kv", seq_kv)
        with _outside_inference_mode():
            keep = normalize_block_mask(mask, math.ceil(seq_q / block_q), math.ceil(seq_kv / block_kv))
            count, index = build_lists(keep)
        return cls(count, index, (block_q, block_kv), seq_q, seq_kv, _mask=keep)

    @classmethod
    def dense(cls, block_size, seq_q: int, seq_kv: int, device=None) -> "BlockSparsity":
        """Every block kept."""
        block_q, block_kv = check_block_size(block_size)
        nq, nk = math.ceil(seq_q / block_q), math.ceil(seq_kv / block_kv)
        return cls.from_mask(torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device), block_size, seq_q, seq_kv)

    # ---------------------------------------------------------------- properties
    @property
    def num_blocks(self) -> tuple[int, int]:
        """(nq, nk)."""
        return math.ceil(self.seq_q / self.block_size[0]), math.ceil(self.seq_kv / self.block_size[1])

    @property
    def device(self) -> torch.device:
        return self.kv_count.device

    @property
    def batch(self) -> int:
        return self.kv_count.shape[0]

    @property
    def heads(self) -> int:
        return self.kv_count.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        """The block mask, bool [Bm, Hm, nq, nk]."""
        if self._mask is None:
            with _outside_inference_mode():
                self._mask = _mask_from_lists(self.kv_count, self.kv_index, self.num_blocks[1])
        return self._mask

    def density(self) -> float:
        """Kept blocks / all blocks, averaged over the mask's batch and heads (reads the device: a sync)."""
        return float(self.kv_count.sum().item()) / self.kv_count.numel() / self.num_blocks[1]

    def plot(self, path, *, batch: int = 0, max_heads: int = 16, title: str = ""):
        """Write a PNG picture of the block mask (a panel per head, with densities); returns the path."""
        from .plot import plot_block_mask
        return plot_block_mask(self.mask, path, batch=batch, max_heads=max_heads, title=title)

    def to(self, device) -> "BlockSparsity":
        return BlockSparsity(self.kv_count.to(device), self.kv_index.to(device), self.block_size, self.seq_q,
                             self.seq_kv, _mask=None if self._mask is None else self._mask.to(device))

    def __repr__(self) -> str:
        nq, nk = self.num_blocks
        return (f"BlockSparsity(block_size={self.block_size}, seq_q={self.seq_q}, seq_kv={self.seq_kv}, "
                f"mask=[{self.batch}, {self.heads}, {nq}, {nk}], device={self.device})")

    # ---------------------------------------------------------------- derived forms (cached)
    def _derived(self, key, build):
        """self._cache[key], made by build() on first use, outside inference mode (_outside_inference_mode)."""
        if key not in self._cache:
            with _outside_inference_mode():
                self._cache[key] = build()
        return self._cache[key]

    def q_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per key block, the count int32 [Bm, Hm, nk] and ascending indices int32 [Bm, Hm, nk, nq] of the
        query blocks that kept it: the transpose of the kv lists, for the dK/dV walk."""
        # "is None", not "or": Dynamo in torch 2.11 cannot take the truth value of a closure (a graph break).
        build = self._build_q_lists
        if build is None:
            build = lambda: build_lists(self.mask.transpose(-1, -2))  # noqa: E731
        return self._derived("q_lists", build)

    def causal(self) -> "BlockSparsity":
        """The same mask without the blocks that lie wholly above the diagonal (key > query for every pair,
        top-left aligned). Blocks crossing the diagonal stay; the kernels resolve them per element."""
        return self._derived("causal", self._causal)

    def _causal(self) -> "BlockSparsity":
        _, largest = _difference_range(self.seq_q, self.seq_kv, self.block_size, self.device)  # query - key
        keep = self.mask & (largest >= 0)
        count, index = build_lists(keep)
        return BlockSparsity(count, index, self.block_size, self.seq_q, self.seq_kv, _mask=keep)

    def tiled(self, tile_q: int, tile_kv: int) -> "BlockSparsity":
        """The mask at tile granularity: a ``tile_q x tile_kv`` tile is kept when any block it overlaps is kept.

        This serves block shapes that no kernel tile nests in (8x128, 100x100): the kernel walks these tile
        lists and tests each element against the original block mask."""
        return self._derived(("tiled", tile_q, tile_kv), lambda: self._tiled(tile_q, tile_kv))

    def full_first(self, tile_q: int, tile_kv: int, is_causal: bool,
                   kv_valid: Optional[torch.Tensor] = None) -> "BlockSparsity":
        """The kernels' full-first lists (kernels/README.md) over tile_q x tile_kv tiles (the blocks themselves,
        tiles nested in them, or tiled()'s view for block shapes no tile nests in): each kv list holds first, in
        ascending order, the *full* tiles, whose every element is visible (inside the sequence, inside kept blocks
        only, with is_causal wholly at or below the diagonal, and with kv_valid only keys below their block's valid
        count), so none needs a test; then the other kept tiles, each stored plus the tile count nk, ascending too.
        The q lists (q_lists(), built when first asked) hold the same with nq.

        kv_valid: int32 [Bv, nk] as attention() takes it (keys per key block that are real). Tiles with no real key
        are left out (they add nothing), the lists have max(Bm, Bv) batch rows, and they are built on each call
        rather than cached, since kv_valid changes between calls (the mask-only part is cached).
        Kernel input only: these lists are not a BlockSparsity's usual ones."""
        if kv_valid is not None:
            with _outside_inference_mode():
                return self._full_first(tile_q, tile_kv, bool(is_causal), kv_valid)
        return self._derived(("full_first", tile_q, tile_kv, bool(is_causal)),
                             lambda: self._full_first(tile_q, tile_kv, bool(is_causal), None))

    def _tiled(self, tile_q: int, tile_kv: int) -> "BlockSparsity":
        tile_keep, _ = self._tile_masks(tile_q, tile_kv)
        count, index = build_lists(tile_keep)
        return BlockSparsity(count, index, (tile_q, tile_kv), self.seq_q, self.seq_kv, _mask=tile_keep)

    def _tile_masks(self, tile_q: int, tile_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept, full), bool [Bm, Hm, nq', nk'] over tile_q x tile_kv tiles of any shape: kept if the tile
        overlaps a kept block, full if it lies inside the sequence and inside kept blocks only."""
        block_q, block_kv = self.block_size
        device = self.device
        keep = self.mask.to(torch.int32)
        # Summed-area table with a zero first row and column: any block rectangle's count in four reads.
        table = torch.nn.functional.pad(keep.cumsum(-2).cumsum(-1), (1, 0, 1, 0))

        def block_span(seq, tile, block):
            starts, ends = _spans(seq, tile, device)
            return starts // block, ends // block + 1, ends - starts + 1 == tile

        q_lo, q_hi, q_whole = block_span(self.seq_q, tile_q, block_q)
        k_lo, k_hi, k_whole = block_span(self.seq_kv, tile_kv, block_kv)

        def corner(rows, cols):
            return table[..., rows[:, None], cols[None, :]]

        kept = corner(q_hi, k_hi) - corner(q_lo, k_hi) - corner(q_hi, k_lo) + corner(q_lo, k_lo)
        tile_keep = kept > 0
        full = (kept == (q_hi - q_lo)[:, None] * (k_hi - k_lo)[None, :]) & q_whole[:, None] & k_whole[None, :]
        return tile_keep, full

    def _full_first(self, tile_q: int, tile_kv: int, is_causal: bool,
                    kv_valid: Optional[torch.Tensor]) -> "BlockSparsity":
        keep, full = self._derived(("full_first_masks", tile_q, tile_kv, is_causal),
                                   lambda: self._full_first_masks(tile_q, tile_kv, is_causal))
        if kv_valid is not None:
            some, every = _real_key_tiles(kv_valid, self.block_size[1], self.seq_kv, tile_kv)
            keep = keep & some[:, None, None, :]
            full = full & every[:, None, None, :] & keep
        kv_count, kv_index = _full_first_lists(keep, full)
        lists = BlockSparsity(kv_count, kv_index, (tile_q, tile_kv), self.seq_q, self.seq_kv, _mask=keep)
        lists._build_q_lists = lambda: _full_first_lists(keep.transpose(-1, -2), full.transpose(-1, -2))
        return lists

    def _full_first_masks(self, tile_q: int, tile_kv: int, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept, full), bool [Bm, Hm, nq', nk'] over tile_q x tile_kv tiles, from the block mask alone: a tile is
        kept if it overlaps a kept block, full if it lies inside the sequence and inside kept blocks only (and
        with is_causal wholly at or below the diagonal). Tiles nesting in the blocks repeat the mask."""
        (block_q, block_kv), device = self.block_size, self.device
        if block_q % tile_q == 0 and block_kv % tile_kv == 0:
            nq, nk = math.ceil(self.seq_q / tile_q), math.ceil(self.seq_kv / tile_kv)
            keep = self.mask.repeat_interleave(block_q // tile_q, -2)[..., :nq, :]
            keep = keep.repeat_interleave(block_kv // tile_kv, -1)[..., :nk].contiguous()
            q_first, q_last = _spans(self.seq_q, tile_q, device)
            k_first, k_last = _spans(self.seq_kv, tile_kv, device)
            whole = (q_last - q_first + 1 == tile_q)[:, None] & (k_last - k_first + 1 == tile_kv)[None, :]
            full = keep & whole
        else:
            keep, full = self._tile_masks(tile_q, tile_kv)
        if is_causal:
            smallest, _ = _difference_range(self.seq_q, self.seq_kv, (tile_q, tile_kv), device)  # query - key
            full = full & (smallest >= 0)
        return keep, full


def _real_key_tiles(kv_valid: torch.Tensor, block_kv: int, seq_kv: int,
                    tile_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(some, all): which key tiles of tile_kv keys hold at least one real key, and which real keys only, two bool
    [Bv, nk'] from kv_valid int32 [Bv, nk], the count of real keys at the start of each block_kv block (real keys
    are a prefix of each block). A tile's keys run from its first block to its last and cover the start of every
    block after the first: it holds a real key if its first key is real or one of those blocks has any, and real
    keys only if every block before its last is wholly real and its final key lies below the last one's count."""
    first_key, last_key = _spans(seq_kv, tile_kv, kv_valid.device)
    first, last = first_key // block_kv, last_key // block_kv

    def running(flags):  # per block, how many blocks before it have the flag
        return torch.nn.functional.pad(flags.to(torch.int32).cumsum(-1), (1, 0))
    with_some, whole = running(kv_valid > 0), running(kv_valid >= block_kv)
    some = (first_key % block_kv < kv_valid[:, first]) | (with_some[:, last + 1] > with_some[:, first + 1])
    every = (whole[:, last] - whole[:, first] == last - first) & (last_key % block_kv < kv_valid[:, last])
    return some, every


def normalize_block_mask(mask: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """Check a block mask's type and shape and return it as bool [Bm, Hm, nq, nk] (contiguous)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"blocks must be a block-mask tensor, a BlockSparsity or None, got {type(mask).__name__}")
    if mask.dtype not in _MASK_DTYPES:
        raise TypeError(f"the block mask must be bool, int8 or uint8 (nonzero = keep), got {mask.dtype}")
    if mask.ndim not in (2, 3, 4) or tuple(mask.shape[-2:]) != (nq, nk):
        raise ValueError(
            f"the block mask must have shape [nq, nk], [H|1, nq, nk] or [B|1, H|1, nq, nk] with nq={nq}, nk={nk} "
            f"(ceil of sequence / block), got {tuple(mask.shape)}")
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    return (mask != 0).contiguous()
