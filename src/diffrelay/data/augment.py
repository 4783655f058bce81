"""Per-sample training draws keyed by global stream position: label dropout (for guidance), x-flips, and a text
run's pick among an image's captions and its caption dropout.

Each step draws one uniform per sample of the whole global batch from a generator seeded by
(seed, tag, step); a process keeps its rows with order.rank_slice. The draws therefore depend on
neither the process count nor grad_accum, and a resumed segment redraws exactly what one run drew.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from diffrelay.data.order import derive_seed, rank_slice
from diffrelay.text.condition import Text

LABEL_DROPOUT, XFLIP = 0x1AB3, 0xF11B  # tags that keep the two draws independent
CAPTION, CAPTION_DROPOUT = 0xCA97, 0xCAD0  # which of an image's captions, and the empty caption (text runs)
CROP = 0xC209  # where data.random_crop cuts a row's square (data/wide.py)


def uniforms(seed: int, tag: int, step: int, global_batch: int) -> np.ndarray:
    """One U[0, 1) per global-batch position of `step` (float64, the same on every machine)."""
    return np.random.Generator(np.random.PCG64(derive_seed(seed, tag, step))).random(global_batch)


def masks(seed: int, step: int, global_batch: int, rank: int, world: int, label_dropout: float,
          xflip) -> tuple[np.ndarray, np.ndarray]:
    """(drop, flip): boolean arrays over this process's rows of the global batch; xflip a probability, or one for
    each of the process's rows (data.subsets[].flip)."""
    drop = rank_slice(uniforms(seed, LABEL_DROPOUT, step, global_batch), rank, world) < label_dropout
    flip = rank_slice(uniforms(seed, XFLIP, step, global_batch), rank, world) < xflip
    return drop, flip


@dataclass
class Rows:
    """A boolean mask over a batch's rows, already on the batch's device, and whether any row is set (known
    on the host, so applying it never reads the device)."""

    mask: torch.Tensor
    any: bool


def to_device(mask: np.ndarray, device, pin: bool = False) -> Rows:
    """The mask as Rows on `device`; from pinned memory the copy does not block the host (the loader thread
    makes them, so the training loop pays no host-device synchronisation for them)."""
    rows = torch.from_numpy(mask)
    if pin:
        rows = rows.pin_memory()
    return Rows(rows.to(device, non_blocking=True), bool(mask.any()))


def apply(images: torch.Tensor, labels: torch.Tensor | None, drop, flip, null: int):
    """Flip the rows in `flip` left to right; give the rows in `drop` the null class. The masks are Rows, or
    numpy arrays (copied here, which on a GPU waits for it)."""
    drop, flip = (to_device(m, images.device) if isinstance(m, np.ndarray) else m for m in (drop, flip))
    if flip.any:
        images = torch.where(flip.mask[:, None, None, None], images.flip(3), images)
    text = labels if isinstance(labels, Text) else None  # a text run: class labels, if any, ride in the Text
    if text is not None:
        labels = text.labels
    if labels is not None and drop.any:
        labels = torch.where(drop.mask, torch.full_like(labels, null), labels)
    if text is not None:
        return images, dataclasses.replace(text, labels=labels)
    return images, labels


def captions(seed: int, step: int, global_batch: int, rank: int, world: int, dropout: float) -> tuple[np.ndarray,
                                                                                                      np.ndarray]:
    """(u, drop) over this process's rows: u picks each row's caption among its image's captions (Prepared.captions
    .pick), drop gives it the empty caption (data.caption_dropout). Both from the step's generators, by global
    position: the same for any process count and on resume, like label dropout."""
    u = rank_slice(uniforms(seed, CAPTION, step, global_batch), rank, world)
    drop = rank_slice(uniforms(seed, CAPTION_DROPOUT, step, global_batch), rank, world) < dropout
    return u, drop
