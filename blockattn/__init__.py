"""blockattn: exact block-sparse attention for PyTorch, with Triton kernels on NVIDIA GPUs.

Public names: attention, attention_backward, BlockSparsity, select_blocks; modules masks (patterns), flex
(FlexAttention interop), video (tile order of a video grid, video sparse attention) and distributed (sequence
parallel over torch.distributed).
"""

from . import distributed, flex, masks, video
from .api import attention, attention_backward
from .select import select_blocks
from .sparsity import BlockSparsity

__all__ = ["attention", "attention_backward", "BlockSparsity", "select_blocks", "masks", "flex", "video",
           "distributed"]
__version__ = "0.1.0"
