"""Pipeline families as plug-ins: one module a family (sd, sdxl, sd3, pixart, hunyuandit, flux), each a
families.base.Family that declares everything that makes it different; the rest of diffrelay asks these functions
and names no family. Adding one is a module and a line in FAMILIES (docs/development.md, "Adding a pipeline
family"). The papers' from-scratch networks (EDM, edm2, DiT, SiT, the UNet) are not families: nets/ holds them.

Torch-free at import (config validation reads the families at Snakefile parse time); families.network, the
diffusers network every family builds, imports torch and is imported by the families' `build` alone.
Imports the base modules only (errors).
"""

from diffrelay.families import flux, hunyuandit, pixart, sd, sd3, sdxl
from diffrelay.families.base import Family

FAMILIES: tuple[Family, ...] = (sd.FAMILY, sdxl.FAMILY, pixart.FAMILY, sd3.FAMILY, hunyuandit.FAMILY, flux.FAMILY)
ARCHS = tuple(dict.fromkeys(f.arch for f in FAMILIES))  # the model.arch names of the families' networks
PIPELINES = tuple(p for f in FAMILIES for p in f.pipelines)  # model_index.json's _class_name values read
NETWORK_CLASSES = tuple(dict.fromkeys(f.network_class for f in FAMILIES))
Family.labelled_archs = tuple(dict.fromkeys(f.arch for f in FAMILIES if f.class_labels))  # for refusals' fixes


def of_network(arch: str, config: dict | None = None) -> Family | None:
    """The family of model.arch `arch` whose `matches` takes the network's `config` (model.kwargs, or the
    network's config.json); None for a network that is no family's (the papers', your own)."""
    mine = [f for f in FAMILIES if f.arch == arch]
    return next((f for f in mine if f.matches(config or {})), mine[0] if mine else None)


def of_config(model_cfg: dict | None) -> Family | None:
    """The family of a run's `model` section, or None."""
    model_cfg = model_cfg or {}
    return of_network(model_cfg.get("arch", "unet"), model_cfg.get("kwargs") or {})


def of_class(network_class: str, config: dict) -> Family | None:
    """The family of a pipeline folder's network: its class and its config.json."""
    mine = [f for f in FAMILIES if f.network_class == network_class]
    return next((f for f in mine if f.matches(config)), mine[0] if mine else None)


def set_keys(arch: str) -> tuple:
    """The network config keys diffrelay sets itself for `arch` (empty for a network that is no family's)."""
    family = of_network(arch)
    return family.set_keys if family else ()


def names(attribute: str) -> str:
    """The short names of the families with `attribute` set, for messages: "SD3, FLUX.1"."""
    return ", ".join(dict.fromkeys(f.short for f in FAMILIES if getattr(f, attribute)))


def pipelines_of(attribute: str) -> str:
    """The first pipeline class of each family with `attribute` set, for messages: "FluxPipeline"."""
    return ", ".join(dict.fromkeys(f.pipelines[0] for f in FAMILIES if getattr(f, attribute)))


def true_cfg_owner() -> str:
    """Who has sample.true_cfg_scale, for messages: "FluxPipeline's true classifier-free guidance, for FLUX.1
    networks"."""
    return f"{pipelines_of('true_cfg')}'s true classifier-free guidance, for {names('true_cfg')} networks"
