"""blockattn: exact block-sparse attention for PyTorch, with Triton kernels on NVIDIA GPUs.

Public names: attention, attention_backward, BlockSparsity, select_blocks; modules masks (patterns) and flex
(FlexAttention interop).
"""

from . import flex, masks
from .api import attention, attention_backward
from .select import select_blocks
from .sparsity import BlockSparsity

__all__ = ["attention", "attention_backward", "BlockSparsity", "select_blocks", "masks", "flex"]
__version__ = "0.1.0"
