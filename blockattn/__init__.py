"""blockattn: exact block-sparse attention for PyTorch, with Triton kernels on NVIDIA GPUs.

Public names: attention, attention_backward, BlockSparsity, select_blocks; modules masks (patterns), flex
(FlexAttention interop) and video (tile order of a video grid, video sparse attention).
"""

from . import flex, masks, video
from .api import attention, attention_backward
from .select import select_blocks
from .sparsity import BlockSparsity

__all__ = ["attention", "attention_backward", "BlockSparsity", "select_blocks", "masks", "flex", "video"]
__version__ = "0.1.0"
