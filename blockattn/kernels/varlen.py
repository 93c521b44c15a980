"""The description of a packed ("thd") batch that the launchers take. Plain Python: importing it loads no kernel."""

from typing import NamedTuple

import torch


class Varlen(NamedTuple):
    """A packed batch: int32 offsets [N + 1] of each sequence's first token (queries, keys) and the longest
    lengths (which size the grid)."""
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    max_q: int
    max_kv: int

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1
