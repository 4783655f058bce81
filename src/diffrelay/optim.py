"""Optimizer, learning-rate schedule and EMA of the weights."""

import copy
import math

import torch


def build_optimizer(params, t) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    # foreach=False keeps the update order fixed, which the bitwise-resume tests rely on.
    return cls(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, foreach=False)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base LR for the update at `step` (0-based): linear warm-up, then hold or cosine."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def build_schedule(opt, t) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, t.warmup_steps, t.total_steps, t.lr_schedule))


class EMA:
    """One exponential moving average of the weights per decay rate."""

    def __init__(self, net: torch.nn.Module, decays):
        self.decays = list(decays)
        self.nets = [copy.deepcopy(net).eval().requires_grad_(False) for _ in self.decays]

    @torch.no_grad()
    def update(self, net: torch.nn.Module, step: int) -> None:
        for decay, ema in zip(self.decays, self.nets):
            # Ramp the decay up early so the average is not dominated by the random initial weights.
            d = min(decay, (1 + step) / (10 + step))
            for pe, p in zip(ema.parameters(), net.parameters()):
                pe.lerp_(p.detach(), 1 - d)
            for be, b in zip(ema.buffers(), net.buffers()):
                be.copy_(b)

    def state_dict(self) -> list[dict]:
        return [ema.state_dict() for ema in self.nets]

    def load_state_dict(self, states: list[dict]) -> None:
        for ema, state in zip(self.nets, states, strict=True):
            ema.load_state_dict(state)
