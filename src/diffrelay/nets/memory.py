"""Activation checkpointing (train.activation_checkpointing): keep only each block's input during the forward
pass and recompute the block in the backward pass, trading about one more forward for the memory of every
block's activations (fast-DiT reports DiT-XL/2 at batch 128 out of memory on one 80 GB A100 without it).

A network opts in by having an attribute `checkpointing` (False by default) and running its blocks through
`call`: every built-in network does. torch's non-reentrant checkpoint restores the RNG state before the
recomputation, so dropout draws the same mask twice and the gradients are bitwise those of a plain backward
(tests/test_memory.py trains with it on and off and compares the weights bit for bit; on a GPU this holds
with train.deterministic, as for any two runs).
"""

import torch
from torch.utils.checkpoint import checkpoint


def call(enabled: bool, block, *args):
    """block(*args), recomputed in the backward pass when `enabled` and gradients are being recorded."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


def enable(net: torch.nn.Module) -> int:
    """Turn checkpointing on in every module of `net` that supports it; the number of such modules (0: the
    network cannot checkpoint, which the caller reports)."""
    found = [m for m in net.modules() if isinstance(getattr(m, "checkpointing", None), bool)]
    for m in found:
        m.checkpointing = True
    return len(found)
