"""Networks by name: the one place that says what a network is and how `model.arch` finds it.

The contract. `model.arch` is `unet`, `dit` or "package.module:callable". The callable is called as

    callable(resolution=R, in_channels=C, num_classes=K, **model.kwargs)

and returns a torch.nn.Module F with forward(x, c_noise, labels) -> a tensor shaped like x, where
x is (B, C, R, R) (the noisy image already scaled by EDM's c_in), c_noise is (B,) (EDM's ln(sigma)/4)
and labels is a (B,) integer tensor, or None when K is 0. A conditional network (K > 0) must accept the
label K as "no class": label dropout trains it and classifier-free guidance samples with it.
diffrelay wraps F in edm.Denoiser, which adds the preconditioning; F never sees sigma itself.

A text run (captions and data.text_encoders) calls the builder with one keyword more, and only then, so every
builder written before text keeps its call:

    callable(resolution=R, in_channels=C, num_classes=K, text={"states": D, "length": L, "pooled": P or 0},
             **model.kwargs)

and F gets forward(x, c_noise, labels, text=Text(states (B, L, D), mask (B, L), pooled (B, P) or None)), a
diffrelay.text.condition.Text; the objectives' wrappers unpack it (condition.call).

The user's module is imported from sys.path: PYTHONPATH, or the current working directory (Snakemake
runs every job, local or on a cluster, in the workflow's working directory, so a module beside
config/ is found there). Only names written in the config are imported, never names read from a
checkpoint or snapshot (see edm.build). It is imported as a library: it must not parse sys.argv or exit
at import (keep that under `if __name__ == "__main__":`); nets.registry reports either as one line.

This module is torch-free (config validation uses it at Snakefile parse time); nets.registry builds.
Imports the base modules (errors) and families (the pipeline families' networks); nets.registry also imports text
(the Text of its network check).
"""

import difflib

from diffrelay import families

# By source: EDM's DDPM++, NCSN++ and ADM (nets/edm.py), edm2's UNet (nets/edm2.py), DiT and SiT (nets/dit.py), and
# diffrelay's own small UNet (nets/unet.py), which the runs made before the papers' networks keep using; then the
# pipeline families' diffusers networks (families/: their model.kwargs are the diffusers class's config keys, checked
# against its __init__ when built, besides each family's own_kwargs).
PAPERS = ("ddpmpp", "ncsnpp", "adm", "edm2", "dit", "sit", "unet")
TEXT_ARCHS = families.ARCHS
BUILTIN = PAPERS + TEXT_ARCHS
# The DiT as checked against DiT's code (columns-first position table, DiT's initialisation). Part of a DiT
# run's identity and recorded in its snapshots as dit_layout; files without it were made by layout 1 (rows
# first), which still loads them (pos_order rows) but trains no further.
DIT_LAYOUT = 2
EDM2_SIZES = ("xs", "s", "m", "l", "xl", "xxl")  # edm2.PRESETS, named here for config checks without torch
UNET_SETTINGS = ("channels", "channel_mult", "num_blocks", "attn_resolutions", "dropout")
# Named UNet settings. cifar10 is diffrelay's own UNet (nets/unet.py, 55.09 M parameters) given DDPM++'s CIFAR-10
# sizes (score_sde's cifar10_ddpmpp, EDM's --arch=ddpmpp): 128 channels, multipliers [2, 2, 2], 4 blocks a level,
# attention at 16x16, dropout 0.1 (EDM trains with 0.13). It is not DDPM++'s network: that is model.arch ddpmpp.
UNET_PRESETS = {
    "cifar10": {"channels": 128, "channel_mult": [2, 2, 2], "num_blocks": 4, "attn_resolutions": [16],
                "dropout": 0.1},
}


_EDM = ("model_channels", "channel_mult", "channel_mult_emb", "num_blocks", "attn_resolutions", "dropout", "augment_dim")
_SONG = ("embedding_type", "channel_mult_noise", "encoder_type", "decoder_type", "resample_filter")
# Levels of the UNets of the papers when model.kwargs.channel_mult does not say (each halves the resolution).
DEFAULT_LEVELS = {"ddpmpp": 3, "ncsnpp": 3, "adm": 4, "edm2": 4}
# augment_dim of EDM's presets (nets/edm.py PRESETS): how many augmentation labels each takes (train.augment).
EDM_AUGMENT_DIM = {"ddpmpp": 9, "ncsnpp": 9, "adm": 0}


# The keyword arguments each built-in builder takes besides the contract's three (tests/test_nets.py checks
# them against unet.build/UNet and dit.build/DiT), so a typo in model.kwargs is caught without torch.
BUILTIN_KWARGS = {
    "unet": ("preset", *UNET_SETTINGS),
    "dit": ("size", "patch", "depth", "hidden_size", "num_heads", "mlp_ratio", "out_channels", "time_scale",
            "pos_order"),
    "sit": ("size", "patch", "depth", "hidden_size", "num_heads", "mlp_ratio", "out_channels"),
    "ddpmpp": _EDM + _SONG,
    "ncsnpp": _EDM + _SONG,
    "adm": _EDM,
    "edm2": ("preset", "model_channels", "channel_mult", "channel_mult_noise", "channel_mult_emb", "num_blocks",
             "attn_resolutions", "label_balance", "concat_balance", "dropout", "logvar_channels",
             "channels_per_head", "res_balance", "attn_balance", "clip_act", "resample_filter"),
}
CONTRACT = ("resolution", "in_channels", "num_classes", "text")


def is_builtin(arch: str) -> bool:
    return arch in BUILTIN


def unet_settings(model_cfg: dict) -> dict:
    """UNet keywords of a `model` section: its top-level keys, then model.kwargs.preset, then model.kwargs."""
    out = {k: model_cfg[k] for k in UNET_SETTINGS if k in model_cfg}
    kwargs = dict(model_cfg.get("kwargs") or {})
    preset = kwargs.pop("preset", None)
    if preset is not None:
        out |= UNET_PRESETS[preset]
    return out | kwargs


def unused_keys(model_cfg: dict) -> set:
    """Top-level UNet settings of a `model` section that build nothing: all of them for another network,
    and those model.kwargs (or its preset) sets again for the UNet (unet_settings: kwargs win)."""
    if model_cfg.get("arch", "unet") != "unet":
        return set(UNET_SETTINGS)
    kwargs = dict(model_cfg.get("kwargs") or {})
    preset = kwargs.pop("preset", None)
    return set(UNET_SETTINGS) & (set(kwargs) | set(UNET_PRESETS.get(preset, {})))


def arch_kwargs(model_cfg: dict) -> tuple[str, dict]:
    """(arch, keyword arguments) of a `model` section; the UNet also takes its top-level keys and a preset."""
    arch = model_cfg.get("arch", "unet")
    if arch == "unet":
        return arch, unet_settings(model_cfg)
    return arch, dict(model_cfg.get("kwargs") or {})


def check_kwargs(model_cfg: dict) -> list[tuple[str, str]]:
    """(key, message) pairs for model.kwargs that no build can take: a keyword the contract sets itself, and,
    for a built-in network, a keyword its builder does not know (config validation reports the first)."""
    arch, bad = model_cfg.get("arch", "unet"), []
    for key in model_cfg.get("kwargs") or {}:
        if key in CONTRACT or key in families.set_keys(arch):
            bad.append((f"model.kwargs.{key}", "set by diffrelay itself (from data.resolution, the images' channels, "
                        "the dataset's classes and the text encoders' widths); remove it from model.kwargs"))
        elif arch in BUILTIN_KWARGS and key not in BUILTIN_KWARGS[arch]:
            accepted = BUILTIN_KWARGS[arch]
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            bad.append((f"model.kwargs.{key}", f"not a keyword of the built-in {arch} network; {hint}"
                        f"it takes {', '.join(accepted)}"))
    return bad


def text_problems(model_cfg: dict, has_text: bool) -> list[tuple[str, str]]:
    """(key, message) pairs when the network and the data disagree about text: a text-conditional arch without
    captions and text encoders, or a built-in arch that takes no text given them (a network of one's own is
    asked at build time: the contract passes text= only to text runs)."""
    arch = model_cfg.get("arch", "unet")
    if arch in TEXT_ARCHS and not has_text:
        return [(f"model.arch={arch}", "a text-conditional network needs captions (data.captions) and the text "
                 "encoders that embed them (data.text_encoders); set both, or choose a network without text")]
    if has_text and is_builtin(arch) and arch not in TEXT_ARCHS:
        return [(f"model.arch={arch}", f"takes no text, and data.captions and data.text_encoders give it captions; "
                 f"use one of {', '.join(TEXT_ARCHS)} (or a network of your own that takes text=), or set "
                 "data.captions: none")]
    return []


def _files(spec):
    return spec.get("sha256") if isinstance(spec, dict) else spec


def same_network(recorded: dict, wanted: dict) -> str | None:
    """None when a snapshot's recorded `model` section builds the network `wanted` names, else the first
    differing key. Sections from before model.arch existed read as arch unet with no kwargs."""
    recorded = {"arch": "unet", "kwargs": {}, "objective": "edm"} | recorded
    wanted = {"objective": "edm"} | wanted
    # A pipeline is its files' sha256 (docs/pretrained.md: moving the folder keeps the run), not where it lies.
    recorded, wanted = ({**m, "pretrained": _files(m.get("pretrained"))} if m.get("pretrained") else m
                        for m in (recorded, wanted))
    # Settings neither network uses (a UNet key in a DiT's section) do not make it another network.
    unused = unused_keys(recorded) & unused_keys(wanted)
    for key in sorted((set(recorded) | set(wanted)) - unused):
        if recorded.get(key) != wanted.get(key):
            return key
    return None
