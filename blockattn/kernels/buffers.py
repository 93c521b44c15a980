"""Output allocation for the launchers, in one place so tests can poison it (fill with NaN) to catch unwritten
elements."""

import torch


def empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty; tests replace this function to hand the launchers NaN-filled buffers."""
    return torch.empty(*shape, dtype=dtype, device=device)


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """torch.empty_like (strides kept for dense tensors); tests replace this too."""
    return torch.empty_like(tensor)


def empty_strided(shape, stride, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty_strided; tests replace this too."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)
