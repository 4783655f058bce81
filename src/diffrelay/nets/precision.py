"""Regions the papers keep in float32 whatever the training precision: `autocast_off` turns torch.autocast off
there, so the ops compute in the dtypes their inputs are cast to. Used by EDM's attention logits and softmax
(nets/edm.py) and edm2's uncertainty head u(sigma) (nets/edm2.py)."""

import contextlib

import torch


def autocast_off(device: torch.device):
    """A context with autocast off on `device`; none on a device without autocast (the meta device of
    nets.registry's check pass, where torch.autocast refuses even enabled=False)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
