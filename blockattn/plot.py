"""Pictures of block masks (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def plot_block_mask(mask: torch.Tensor, path, *, batch: int = 0, max_heads: int = 16, title: str = "") -> Path:
    """Write a PNG of a block mask bool [Bm, Hm, nq, nk] (one panel per head of one batch entry, up to max_heads;
    query blocks down, key blocks across, kept blocks dark), each panel titled with its density."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = mask[batch].detach().to("cpu", torch.float32)
    heads = min(grid.shape[0], max_heads)
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for panel, ax in enumerate(axes.flat):
        if panel >= heads:
            ax.axis("off")
            continue
        ax.imshow(grid[panel].numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest", aspect="auto")
        ax.set_title(f"head {panel}: density {grid[panel].mean().item():.3f}", fontsize=9)
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
    overall = grid.mean().item()
    fig.suptitle(f"{title + ' - ' if title else ''}{tuple(mask.shape)} blocks, density {overall:.3f}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
