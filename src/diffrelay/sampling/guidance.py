"""Classifier-free guidance (Ho & Salimans 2022) at sampling time, and the check that a network supports it."""

import torch

from diffrelay.errors import UserError


def check(scale: float, meta: dict, source) -> None:
    """Guidance needs the unconditional model that label dropout trains; refuse it otherwise, in one line."""
    if scale == 1:
        return
    if not (meta["model"].get("class_conditional") and meta.get("num_classes", 0)):
        raise UserError(f"sample.guidance={scale} (--guidance): {source} is an unconditional network; use 1")
    if not meta.get("config", {}).get("train", {}).get("label_dropout", 0):
        raise UserError(f"sample.guidance={scale} (--guidance): {source} was trained without "
                        "train.label_dropout, so it has no unconditional model; use 1 or retrain with it")


def guided(denoise, scale: float, null: int):
    """denoise(x, sigma, labels) with guidance `scale`; scale 1 (or no labels) is `denoise` itself, untouched."""
    if scale == 1:
        return denoise

    def fn(x, sigma, labels):
        if labels is None:
            return denoise(x, sigma, labels)
        # Conditional and unconditional rows in one batch, then extrapolate from the unconditional one.
        both = denoise(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([labels, torch.full_like(labels, null)]))
        cond, uncond = both.chunk(2)
        return uncond + scale * (cond - uncond)

    return fn
