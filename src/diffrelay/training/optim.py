"""Optimizer, learning-rate schedule and EMA of the weights."""

import copy
import math

import torch

from diffrelay.training import eager, optimizers, sharding


def build_optimizer(params, t, fused: bool = False) -> torch.optim.Optimizer:
    """train.optimizer's optimizer over `params`: torch's Adam(W) here, the others from their libraries
    (optimizers.py). `fused` applies to torch's Adam(W) only (the config check refuses it elsewhere)."""
    if t.optimizer not in optimizers.TORCH_ADAM:
        if not t.compile:
            eager.settle(optimizers.optimizer_class(t.optimizer), torch.optim.lr_scheduler.LambdaLR)
        opt = optimizers.build(params, t)
        if not t.compile:
            eager.eager_step(opt)
        return opt
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    if not t.compile:  # nothing in this process is compiled: no torch._dynamo import (1.35 s; eager.py)
        eager.settle(cls, torch.optim.lr_scheduler.LambdaLR)
    # foreach=False keeps the update order fixed, which the bitwise-resume tests rely on. fused=True is
    # one kernel for all parameters (train.fused_optimizer); deterministic too, but not bitwise equal to
    # the per-parameter loop, so a run compared bit for bit with another must use the same setting.
    opt = cls(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, foreach=False,
              fused=fused or None)
    if not t.compile:
        eager.eager_step(opt)
    return opt


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """opt.load_state_dict, keeping this run's implementation (fused or not).

    The saved state has the same format either way, but load_state_dict also copies the saved groups'
    `fused`/`foreach` flags, so a checkpoint of a fused run would silently switch fusing on (and the
    reverse off). The step counters then go where the chosen implementation wants them: a float32
    tensor on the parameter's device for fused kernels, on the CPU for the loop.
    """
    flags = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in opt.param_groups]
    opt.load_state_dict(optimizers.rebuilt_state(state))
    for group, kept in zip(opt.param_groups, flags, strict=True):
        group.update(kept)
        if "fused" not in kept:  # another library's optimizer: its state is its own (no step counter to move)
            continue
        on_device = bool(kept["fused"] or kept["capturable"])
        for p in group["params"]:
            s = opt.state.get(p, {})
            if isinstance(s.get("step"), torch.Tensor):
                s["step"] = s["step"].to(device=p.device if on_device else "cpu", dtype=torch.float32)
            # Moments in the parameter's own memory layout (same values): load_state_dict keeps the saved
            # strides, and after a train.channels_last switch a fused kernel would pair exp_avg and the
            # parameter element by element in different orders (silently wrong on the CPU, refused on CUDA).
            for key, value in s.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.stride() != p.stride():
                    s[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def lr_factor(step: int, warmup: int, total: int, schedule: str, batch_size: int = 1, warmup_kimg=None,
              ref_batches=None) -> float:
    """Multiplier of the base LR for the update at `step` (0-based): linear warm-up over `warmup` steps, then
    hold, cosine, or inv_sqrt; times EDM's ramp over `warmup_kimg` thousand images when that is set."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    nimg = step * batch_size  # images trained before this update, EDM's and edm2's cur_nimg
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        factor = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    elif schedule == "inv_sqrt":
        # edm2 training/training_loop.py:49-50: 1 / sqrt(max(cur_nimg / (ref_batches * batch_size), 1)).
        factor = 1 / math.sqrt(max(nimg / (ref_batches * batch_size), 1))
    else:
        factor = 1.0
    if warmup_kimg is not None:
        # EDM training/training_loop.py:136, edm2 training_loop.py:51-52: min(cur_nimg / rampup_nimg, 1).
        factor *= min(nimg / (warmup_kimg * 1000), 1)
    return factor


def build_schedule(opt, t) -> torch.optim.lr_scheduler.LambdaLR:
    if optimizers.schedule_is_the_optimizers(t):  # schedule-free: its own warm-up, no schedule (optimizers.py)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, t.warmup_steps, t.total_steps, t.lr_schedule, t.batch_size, t.warmup_kimg,
                                 t.lr_ref_batches))


def average_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of `net` to hold an average of its weights (EMA, post-hoc EMA), in eval mode, without gradients. A
    frozen parameter never changes, so its average is itself: the copy shares it with the network instead of
    holding its own. A LoRA run's whole base is frozen (10 GB of SDXL's UNet in fp32 a copy)."""
    frozen = {id(p): p for p in net.parameters() if not p.requires_grad}
    return copy.deepcopy(net, frozen).eval().requires_grad_(False)


class Pairs:
    """The tensors an average (average_copy of `net`) moves towards `net`'s, found once: the parameters the average
    holds itself (the trainable ones: a frozen parameter is shared with the network, average_copy, and never moves)
    and the buffers. A LoRA run trains a few adapter tensors among hundreds of frozen ones; walking every parameter
    pair of the network each step to find them took 7-9 % of a tiny SD LoRA step (py-spy; benchmarks/bench_ema.py).

    Held are the Parameter objects themselves, which load_state_dict (copying into them) and .to() (swapping a
    parameter's .data, not the Parameter) keep current. Buffers are held as the tensors they are: .to() replaces
    them, and a network is moved and converted (train.channels_last) before its averages are made (state.py)."""

    def __init__(self, avg: torch.nn.Module, net: torch.nn.Module):
        self.net = net
        # A frozen parameter is shared (a is p), except under train.sharding: fsdp2, where fully_shard gave the
        # network and each average their own copy of it; frozen, both stay equal: nothing to move.
        pairs = [(a, p) for a, p in zip(avg.parameters(), net.parameters(), strict=True)
                 if a is not p and p.requires_grad]
        self.avg = [a for a, _ in pairs]
        self.src = [p for _, p in pairs]
        self.sharded = any(sharding.is_dtensor(p) for p in self.src)
        self.avg_buffers, self.src_buffers = list(avg.buffers()), list(net.buffers())

    @torch.no_grad()
    def lerp(self, weight: float) -> None:
        """The average's parameters move `weight` of the way to the network's, and its buffers become the network's.
        One foreach call for all tensors, not one kernel per tensor (393 a step for the cifar10 UNet): on a GPU the
        launches would cost more than the arithmetic. On the CPU foreach runs the same per-tensor lerp, bit for bit.
        Sharded (fsdp2): each process moves its own shards, the same slices of both (sharding.py); no communication."""
        if self.sharded:
            torch._foreach_lerp_([sharding.local(a) for a in self.avg], [sharding.local(p) for p in self.src], weight)
        elif self.avg:
            torch._foreach_lerp_(self.avg, self.src, weight)
        if self.avg_buffers:
            torch._foreach_copy_(self.avg_buffers, self.src_buffers)


def pairs_for(cache: list, avgs: list, net: torch.nn.Module) -> list:
    """The Pairs of each average in `avgs` towards `net`, kept in `cache` (found again for another network)."""
    if len(cache) != len(avgs) or any(c.net is not net for c in cache):
        cache[:] = [Pairs(avg, net) for avg in avgs]
    return cache


class EMA:
    """One exponential moving average of the weights per decay rate; or, with a half-life (train.ema_halflife_kimg,
    decays empty), EDM's one EMA whose decay follows the images trained; or none (decays empty, no half-life: what
    diffusers' LoRA scripts keep), whose snapshots hold the raw weights only (TrainState.snapshot)."""

    def __init__(self, net: torch.nn.Module, decays, halflife_kimg=None, rampup_ratio=None, batch_size: int = 1):
        self.decays = list(decays)
        self.halflife_kimg, self.rampup_ratio, self.batch_size = halflife_kimg, rampup_ratio, batch_size
        count = 1 if halflife_kimg is not None else len(self.decays)  # none: train.ema_decays [] keeps no EMA
        self.nets = [average_copy(net) for _ in range(count)]
        self.pairs = [Pairs(avg, net) for avg in self.nets]  # what each update moves, found once

    def beta(self, step: int) -> float:
        """EDM's decay for the update at `step` (NVlabs/edm training/training_loop.py:143-146): the half-life in
        images, capped by rampup_ratio x the images trained before this update (None: no cap), gives
        beta = 0.5 ** (batch_size / half-life); at step 0 the cap is 0, so beta is 0 and the EMA copies the net."""
        halflife = self.halflife_kimg * 1000
        if self.rampup_ratio is not None:
            halflife = min(halflife, step * self.batch_size * self.rampup_ratio)
        return 0.5 ** (self.batch_size / max(halflife, 1e-8))

    @torch.no_grad()
    def update(self, net: torch.nn.Module, step: int) -> None:
        pairs = pairs_for(self.pairs, self.nets, net)
        if self.halflife_kimg is not None:
            pairs[0].lerp(1 - self.beta(step))
            return
        for decay, ema in zip(self.decays, pairs):
            # Ramp the decay up early so the average is not dominated by the random initial weights.
            d = min(decay, (1 + step) / (10 + step))
            ema.lerp(1 - d)

    def state_dict(self) -> list[dict]:
        return [ema.state_dict() for ema in self.nets]

    def load_state_dict(self, states: list[dict]) -> None:
        for ema, state in zip(self.nets, states, strict=True):
            ema.load_state_dict(state)
