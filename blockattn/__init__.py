"""blockattn: exact block-sparse attention for PyTorch, with Triton kernels on NVIDIA GPUs.

Public names: attention, BlockSparsity.
"""

from .api import attention
from .sparsity import BlockSparsity

__all__ = ["attention", "BlockSparsity"]
__version__ = "0.1.0"
