"""Per-sample training draws keyed by global stream position: label dropout (for guidance) and x-flips.

Each step draws one uniform per sample of the whole global batch from a generator seeded by
(seed, tag, step); a process keeps its rows with order.rank_slice. The draws therefore depend on
neither the process count nor grad_accum, and a resumed segment redraws exactly what one run drew.
"""

import numpy as np
import torch

from diffrelay.data.order import derive_seed, rank_slice

LABEL_DROPOUT, XFLIP = 0x1AB3, 0xF11B  # tags that keep the two draws independent


def uniforms(seed: int, tag: int, step: int, global_batch: int) -> np.ndarray:
    """One U[0, 1) per global-batch position of `step` (float64, the same on every machine)."""
    return np.random.Generator(np.random.PCG64(derive_seed(seed, tag, step))).random(global_batch)


def masks(seed: int, step: int, global_batch: int, rank: int, world: int, label_dropout: float,
          xflip: float) -> tuple[np.ndarray, np.ndarray]:
    """(drop, flip): boolean arrays over this process's rows of the global batch."""
    drop = rank_slice(uniforms(seed, LABEL_DROPOUT, step, global_batch), rank, world) < label_dropout
    flip = rank_slice(uniforms(seed, XFLIP, step, global_batch), rank, world) < xflip
    return drop, flip


def apply(images: torch.Tensor, labels: torch.Tensor | None, drop: np.ndarray, flip: np.ndarray, null: int):
    """Flip the rows in `flip` left to right; give the rows in `drop` the null class."""
    if flip.any():
        rows = torch.from_numpy(flip).to(images.device)
        images = torch.where(rows[:, None, None, None], images.flip(3), images)
    if labels is not None and drop.any():
        labels = torch.where(torch.from_numpy(drop).to(labels.device), torch.full_like(labels, null), labels)
    return images, labels
