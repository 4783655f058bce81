"""Classifier-free guidance (Ho & Salimans 2022) and autoguidance (Karras et al. 2024) at sampling time, and
the checks that a network (and a guide) support them.

With text (a text.condition.Text where the labels travel) the unconditional branch is the Text's `null` rows, the
empty caption's embedding or the negative prompt's, set by the sampler: both branches are one batch,
Text.with_null(), as diffusers' pipelines concatenate the negative and the prompt embeddings."""

import dataclasses

import torch

from diffrelay import families
from diffrelay.errors import UserError
from diffrelay.text.condition import Text
from diffrelay.training import checkpoint


def check(scale: float, meta: dict, source) -> None:
    """Guidance needs the unconditional model that label dropout trains; refuse it otherwise, in one line."""
    if scale == 1:
        return
    if not (meta["model"].get("class_conditional") and meta.get("num_classes", 0)):
        raise UserError(f"sample.guidance={scale} (--guidance): {source} is an unconditional network; use 1")
    if not meta.get("config", {}).get("train", {}).get("label_dropout", 0):
        raise UserError(f"sample.guidance={scale} (--guidance): {source} was trained without "
                        "train.label_dropout, so it has no unconditional model; use 1 or retrain with it")


def distilled(model_cfg: dict) -> bool | None:
    """None for a network of a family without a guidance input (and one of no family); else whether it takes one
    (the family's guidance_input: FLUX.1's guidance_embeds, dev). FluxPipeline gives guidance_scale to a
    guidance-distilled transformer as an input, one forward a step; its classifier-free guidance is true_cfg_scale
    with a negative prompt (sample.true_cfg_scale, true_cfg)."""
    family = families.of_config(model_cfg)
    return None if family is None else family.guidance_input(model_cfg)


def classifier_free(model_cfg: dict, scale: float) -> tuple[float, bool | None]:
    """(the classifier-free guidance scale, distilled(model_cfg)) of sample.guidance `scale`: FLUX.1's is 1 (its
    guidance is the network's input); schnell's `scale` must be 1."""
    flux = distilled(model_cfg)
    if flux is False and scale != 1:
        family = families.of_config(model_cfg)
        raise UserError(f"guidance {scale:g}: a {family.short} network without guidance_embeds (schnell) takes no "
                        f"guidance, and {family.pipelines[0]} ignores guidance_scale there; use 1")
    return (scale if flux is None else 1.0), flux


def true_cfg_scale(model_cfg: dict, scale: float) -> float:
    """sample.true_cfg_scale (--true-cfg-scale) of a snapshot: FLUX.1's only (the config's check, for a hand-run)."""
    family = families.of_config(model_cfg)
    if scale != 1 and not (family and family.true_cfg):
        raise UserError(f"--true-cfg-scale={scale:g}: {families.true_cfg_owner()}; use --guidance here")
    return scale


def true_cfg(denoise, scale: float, items: list):
    """FluxPipeline's true CFG (true_cfg_scale above 1, a negative prompt given): two forwards a step, the prompts'
    then the negative prompts' (labels.null, with the same guidance input), and neg + scale (pos - neg), as
    FluxPipeline.__call__ writes it. The rows of `items` (prompted items, one a row) without a negative prompt keep
    their prompt's forward, as the pipeline called without one (their row of the second forward is discarded)."""
    negative = [it.negative_prompt is not None for it in items]

    def fn(x, sigma, labels):
        pos = denoise(x, sigma, labels)
        neg = denoise(x, sigma, dataclasses.replace(labels.null, guidance=labels.guidance))
        rows = torch.tensor(negative, device=pos.device).view(-1, *[1] * (pos.dim() - 1))
        return torch.where(rows, neg + scale * (pos - neg), pos)

    return fn


def _first(channels, guided, plain):
    # The guided value on the first `channels` output channels, the plain (conditional) one on the rest: DiT's
    # forward_with_cfg keeps the learned variance (and all but 3 latent channels) of the conditional pass.
    return guided if channels is None else torch.cat([guided[:, :channels], plain[:, channels:]], 1)


def guided(denoise, scale: float, null: int, channels: int | None = None, uncond_first: bool = False):
    """denoise(x, sigma, labels) with guidance `scale`; scale 1 (or no labels) is `denoise` itself, untouched.
    channels: extrapolate only the first so many output channels (None: all). uncond_first: the unconditional
    rows first in the batch, as diffusers' pipelines concatenate them (sample.scheduler): the network's numbers
    are then theirs bit for bit (a row's last bits may depend on its place in the batch)."""
    if scale == 1:
        return denoise

    def fn(x, sigma, labels):
        if labels is None:
            return denoise(x, sigma, labels)
        # Conditional and unconditional rows in one batch, then extrapolate from the unconditional one.
        both_labels = labels.with_null() if isinstance(labels, Text) else \
            torch.cat([labels, torch.full_like(labels, null)])
        if uncond_first:
            n = len(x)
            both_labels = both_labels[torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(x.device)]
        both = denoise(torch.cat([x, x]), torch.cat([sigma, sigma]), both_labels)
        cond, uncond = both.chunk(2)[::-1] if uncond_first else both.chunk(2)
        return _first(channels, uncond + scale * (cond - uncond), cond)

    return fn


def autoguided(denoise, reference, scale: float, channels: int | None = None):
    """Autoguidance: reference + scale (denoise - reference), both with the image's own labels, as edm2's
    generate_images.py guides (`ref_Dx.lerp(Dx, guidance)`); the reference is a weaker network of the same
    kind instead of the null class; with text both get the same Text (its `null` is unused). channels: as in
    guided."""

    def fn(x, sigma, labels):
        ref = reference(x, sigma, labels)
        main = denoise(x, sigma, labels)
        if channels is None:
            return torch.lerp(ref, main, scale)
        # Only the guided channels of each: a guide with or without the learned-variance half fits either way.
        return _first(channels, torch.lerp(ref[:, :channels], main[:, :channels], scale), main)

    return fn


def load_guide(path, meta: dict, weights: str, device):
    """The guiding network of sample.guide, after checking that it can guide the sampled one: the same
    objective, architecture, image shape and classes (its size may differ, as edm2's XS guides its XXL). It is
    built from its own `model` record only where that names the architecture the run's config names, so a
    file never chooses which code runs."""
    from pathlib import Path

    from diffrelay.objectives import objective
    from diffrelay.objectives.ddpm_options import Options

    path = Path(path)
    _, guide_meta = checkpoint.read_snapshot(path)
    ours, theirs = meta["model"], guide_meta.get("model", {})
    checks = [("model.objective", objective(ours), objective(theirs)),
              ("model.ddpm", Options.of(ours.get("ddpm")).sampled(), Options.of(theirs.get("ddpm")).sampled()),
              ("model.arch", ours.get("arch", "unet"), theirs.get("arch", "unet")),
              ("image shape", meta["image_shape"], guide_meta.get("image_shape")),
              # latents of another encoder or scaling mean other numbers in the same shape
              ("latent encoder", _encoder(meta), _encoder(guide_meta)),
              ("text encoders", _text(meta), _text(guide_meta)),  # a text net is guided by one reading the same Text
              ("classes", meta.get("num_classes", 0) if ours.get("class_conditional") else 0,
               guide_meta.get("num_classes", 0) if theirs.get("class_conditional") else 0)]
    for what, want, got in checks:
        # An unconditional guide of a conditional network is edm2's classifier-free guidance with a separately
        # trained unconditional network (edm2 generate_images.py:48, edm2-img512-xs-guid-fid).
        if want != got and not (what == "classes" and got == 0):
            raise UserError(f"sample.guide={path} (--guide): {what} is {got!r} there and {want!r} in the sampled "
                            f"network; a guide must be the same kind of network (it may be smaller or trained "
                            f"less), e.g. an earlier snapshot of this run")
    net, _ = checkpoint.load_snapshot(path, weights, device, dict(theirs))  # its arch is the run's (checked)
    return net if theirs.get("class_conditional") and guide_meta.get("num_classes", 0) else Unconditional(net)


class Unconditional(torch.nn.Module):
    """An unconditional guide called as the sampled network is: the image's class labels are not its to see (a
    text guide still gets the Text, without them)."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, sigma, labels=None, **kwargs):
        if isinstance(labels, Text):
            return self.net(x, sigma, dataclasses.replace(labels, labels=None), **kwargs)
        return self.net(x, sigma, None, **kwargs)


def _text(meta: dict) -> tuple | None:
    """The text encoders (by sha256) and the dims a network reads (text.source.record), None without text."""
    rec = meta.get("text")
    if rec is None:
        return None
    return tuple(r.get("sha256") for r in rec.get("encoders", [])), tuple(sorted((rec.get("dims") or {}).items()))


def _encoder(meta: dict) -> tuple | None:
    rec = meta.get("latent")
    return None if rec is None else (rec.get("sha256"), rec.get("norm"), rec.get("scale"), rec.get("bias"))
