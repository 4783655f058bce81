"""The network of every pipeline family under the diffrelay.nets contract: one diffusers class (the family's
network_class), built from model.kwargs (its config keys) and the contract's text dims, and called as its pipeline
calls it through the family's `call` (families/<family>.py says how: packing, ids, time scale, guidance input, size
conditioning).

Time input: diffusers embeds the timestep with sinusoids (Timesteps); c_noise is multiplied by `time_scale` first,
as nets/dit.py does: 1000 (default) stretches EDM's ln(sigma)/4 and flow's t in [0, 1] (SD3's pipeline gives its
transformer sigma x 1000, so flow with time_scale 1000 is SD3's convention); ddpm's integer steps need time_scale 1
(nets.checks says so). Output: the model's `.sample`; out_channels defaults to C, and 2C is the learned-sigma
layout (PixArt-alpha's, HunyuanDiT's): forward returns the first C channels, forward_all all of them, as DiT does
(ddpm reads the variance half).

diffusers is imported when a network is built, never by importing this module.
"""

import difflib
import inspect

import torch
from torch import nn

from diffrelay.errors import UserError


def diffusers_class(family):
    import diffusers

    return getattr(diffusers, family.network_class)


def config_keys(family) -> tuple:
    """The keys model.kwargs may set for `family`: its diffusers class's __init__ keywords, less those diffrelay sets
    (family.set_keys and the contract's channels), plus diffrelay's own (family.own_kwargs)."""
    taken = set(family.set_keys) | {"self", "in_channels", "args", "kwargs"}
    params = inspect.signature(diffusers_class(family).__init__).parameters
    return tuple(k for k in params if k not in taken) + tuple(family.own_kwargs)


def check(family, config: dict, text: dict | None, num_classes: int) -> None:
    """What every family's builder refuses first: no text dims, a key the class does not take, class labels."""
    arch = family.arch
    if text is None:
        raise UserError(f"model.arch={arch}: a text-conditional network, built without text dims; give the run "
                        "captions (data.captions) and data.text_encoders")
    accepted = config_keys(family)
    for key in config:
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ValueError(f"model.kwargs.{key} is not a config key of diffusers' {family.network_class}; {hint}"
                             "see its __init__ for the keys")
    if num_classes and not family.class_labels:
        raise UserError(f"model.arch={arch}: takes no class labels beside text ({num_classes} classes); set "
                        f"model.class_conditional: false or use arch {' or '.join(family.labelled_archs)}")


def defaults(cls) -> dict:
    """The class's __init__ defaults."""
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}


def width(cls, config: dict) -> int:
    """The transformer's width, heads x head dim, of `config` over the class's defaults."""
    d = defaults(cls)
    return config.get("num_attention_heads", d["num_attention_heads"]) * \
        config.get("attention_head_dim", d["attention_head_dim"])


def out_channels(config: dict, in_channels: int) -> int:
    out = config.get("out_channels") or in_channels
    if out not in (in_channels, 2 * in_channels):
        raise ValueError(f"out_channels={out}: {in_channels} (the image's channels) or {2 * in_channels} "
                         "(the learned-sigma layout)")
    return out


class Recomputed:
    """Mixed into a block's class by `recomputed`: its forward runs under torch's non-reentrant checkpoint while
    gradients are recorded (nets/memory.py says why the gradients stay bitwise a plain backward's). A class, not
    a closure over the block: a deep copy (an EMA's) keeps calling its own weights."""

    def forward(self, *args, **kwargs):
        run = super().forward
        if torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(run, *args, use_reentrant=False, **kwargs)
        return run(*args, **kwargs)


_RECOMPUTED: dict = {}  # a block class -> its Recomputed subclass


def recomputed(block: nn.Module, on: bool) -> None:
    """Checkpoint `block` (on) or not, by swapping its class; its parameters and state-dict keys stay as they are."""
    base = type(block).__mro__[2] if isinstance(block, Recomputed) else type(block)
    if on:
        if base not in _RECOMPUTED:
            _RECOMPUTED[base] = type(f"Recomputed{base.__name__}", (Recomputed, base), {})
        block.__class__ = _RECOMPUTED[base]
    else:
        block.__class__ = base


class TextNet(nn.Module):
    """F(x, c_noise, labels, text) -> like x, around one diffusers model (`model`, its parameters named as in
    diffusers under `model.`, so diffusers' state dicts load with that prefix). `family` is the model's
    families.Family (families.of_network(model.arch, model.config): SDXL's UNet, not SD's), which says how the
    model is called."""

    def __init__(self, family, model: nn.Module, in_channels: int, num_classes: int, time_scale: float,
                 use_mask: bool, pixel_size: int, guidance: float | None = None):
        super().__init__()
        self.arch, self.model, self.in_channels, self.num_classes = family.arch, model, in_channels, num_classes
        self.family = family
        # a guidance-distilled network's training guidance input (FLUX.1-dev's)
        self.guidance = float(self.family.guidance if guidance is None else guidance)
        self.time_scale, self.use_mask = float(time_scale), bool(use_mask)
        # Size conditioning in pixels (SDXL's time ids, PixArt's resolution, HunyuanDiT's image_meta_size): a
        # buffer, so a step copies nothing from the host; not persistent, so state dicts are diffusers' alone.
        self.register_buffer("pixels", torch.tensor([float(pixel_size)]), persistent=False)
        self.cache = {}  # the family's per-shape inputs (rotary embeddings, image ids): (shape, device) -> tensors

    @property
    def checkpointing(self) -> bool:
        """train.activation_checkpointing (nets.memory.enable): diffusers' own gradient checkpointing, which is
        torch's non-reentrant checkpoint of each block (modeling_utils.enable_gradient_checkpointing); for a class
        without one, the same around each of the blocks its family names (recomputed)."""
        blocks = self.family.recompute_blocks(self.model)
        if blocks is not None:
            return any(isinstance(b, Recomputed) for b in blocks)
        return bool(self.model.is_gradient_checkpointing)

    @checkpointing.setter
    def checkpointing(self, on: bool) -> None:
        blocks = self.family.recompute_blocks(self.model)
        if blocks is not None:
            for block in blocks:
                recomputed(block, on)
            return
        if on and not self.model._supports_gradient_checkpointing:
            raise UserError(f"train.activation_checkpointing: diffusers' {type(self.model).__name__} has no gradient "
                            "checkpointing (its _supports_gradient_checkpointing is false); set it false")
        if on:
            self.model.enable_gradient_checkpointing()
        else:
            self.model.disable_gradient_checkpointing()

    def forward_all(self, x, c_noise, labels=None, text=None):
        """Every output channel, the learned-sigma half too."""
        if text is None:
            raise ValueError(f"model.arch={self.arch} is text-conditional: call it with text=Text(...)")
        t = c_noise if self.time_scale == 1 else c_noise * self.time_scale
        mask = text.mask if self.use_mask else None
        return self.family.call(self, x, t, labels, text, text.states.to(x.dtype), mask)

    def size_ids(self, x) -> torch.Tensor:
        """(6,) in x's dtype: original height, width, crop top, left, target height, width in pixels, as the
        pipelines' _get_add_time_ids make them at their defaults (original = target = the image's size, crop (0,
        0)): x's sides times pixel_size / the network's side (sample_size). Square x: pixel_size itself."""
        size = self.pixels.to(x.dtype)
        side = self.model.config.sample_size
        side = side if isinstance(side, int) else side[0]
        h, w = x.shape[-2:]
        if h == w == side:
            return torch.cat([size, size, torch.zeros_like(size), torch.zeros_like(size), size, size])
        ph, pw = (size * n / side for n in (h, w))  # exact: pixel_size is a multiple of side in every family
        return torch.cat([ph, pw, torch.zeros_like(size), torch.zeros_like(size), ph, pw])

    def forward(self, x, c_noise, labels=None, text=None):
        out = self.forward_all(x, c_noise, labels, text)
        return out[:, :self.in_channels] if out.shape[1] != self.in_channels else out
