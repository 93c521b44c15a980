"""blockattn: exact block-sparse attention for PyTorch, with Triton kernels on NVIDIA GPUs.

Public names: attention, attention_backward, BlockSparsity.
"""

from .api import attention, attention_backward
from .sparsity import BlockSparsity

__all__ = ["attention", "attention_backward", "BlockSparsity"]
__version__ = "0.1.0"
