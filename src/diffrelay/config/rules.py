"""Rules that span several keys, run after the schema has filled the defaults. Each concern checks its own section
(sampling.checks, evaluation.protocol, training.settings, data.captions, nets, runtime.gpus, ...); this module calls
them in a fixed order and adds the few rules that belong to no single concern. Each problem is a (key path,
message) pair; schema.validate reports the first. Torch-free: the Snakefile runs it at parse time."""

import importlib.util

from diffrelay.config import paths
from diffrelay.config import text as text_rules
from diffrelay.nets import checks
from diffrelay.objectives import ddpm_options  # torch-free
from diffrelay.training import settings  # torch-free

MAX_WIDTH = 16384  # channels at a UNet's widest level; more is a typo, not a model


def check(d: dict, schema: dict) -> list[tuple[str, str]]:
    """Rules that span several keys of `d` (defaults filled from `schema`): (key path, message) pairs, empty when
    all is well."""
    bad = paths.check_paths(d)
    t, m, data, s = d["train"], d["model"], d["data"], d["sample"]
    if t["tensorboard"] and importlib.util.find_spec("tensorboard") is None:  # not at the first training job
        bad.append(("train.tensorboard=true", "the tensorboard package is not installed; pip install tensorboard, "
                    "or set train.tensorboard: false"))
    per_step = t["nproc_per_node"] * t["nnodes"] * t["grad_accum"]
    if t["batch_size"] % per_step:
        up = -(-t["batch_size"] // per_step) * per_step
        bad.append((f"train.batch_size={t['batch_size']}",
                    f"not divisible by processes x grad_accum = {per_step}; use a multiple of {per_step} such as {up}"))
    if t["segment_steps"] > t["total_steps"]:
        bad.append((f"train.segment_steps={t['segment_steps']}",
                    f"longer than the run (train.total_steps={t['total_steps']}); use at most {t['total_steps']}"))
    for key in ("snapshot_every", "recovery_every"):
        n = t[key]
        if n and t["segment_steps"] % n:
            bad.append((f"train.{key}={n}",
                        f"does not divide train.segment_steps={t['segment_steps']}; use a divisor of it or 0"))
    from diffrelay.training.profiles import check_config as check_phema  # numpy only

    from diffrelay.training import optimizers  # no torch at module level

    bad += check_phema(t, s) + settings.check_config(d) + optimizers.check_config(d)
    if data["encoder"] == "none":  # a latent run's network sees the latents: preflight.check_latent checks it
        bad += checks.check_model(m, data["resolution"])
        bad += checks.check_sizes(m, s.get("sizes"), 1, data["resolution"])  # a latent run's: preflight.check_sizes
    bad += _latent_rules(d)
    from diffrelay.runtime.gpus import check_pool  # light: no torch
    bad += check_pool(d)
    if data["kind"] == "folder" and not data["path"]:
        bad.append(("data.path", "required when data.kind is folder; give the image folder"))
    elif data["kind"] == "shapes" and data["crop"] != "center":
        bad.append((f"data.crop={data['crop']}", "crops folder images; shapes are drawn at data.resolution: drop it"))
    from diffrelay.data import subsets, tags, wide  # torch-free

    bad += subsets.check_config(d) + tags.check_config(d) + wide.check_config(d)
    width = m["channels"] * max(m["channel_mult"])
    if width > MAX_WIDTH:
        bad.append((f"model.channels={m['channels']}",
                    f"x max(model.channel_mult)={max(m['channel_mult'])} gives {width} channels at the widest level; "
                    f"keep it at most {MAX_WIDTH}"))
    from diffrelay.evaluation.protocol import check_config  # light: no torch

    bad += check_config(d)
    if m["class_conditional"] and data["labels"] == "none":
        bad.append(("model.class_conditional=true", "needs class labels but data.labels is none"))
    from diffrelay.sampling.checks import check_config as check_sampling  # light: no torch
    parts = schema["properties"]["sample"]["properties"]
    edm, flow, ddpm = ({k: v.get("default") for k, v in parts[p]["properties"].items()} for p in ("edm", "flow", "ddpm"))
    return bad + check_sampling(d, edm, flow, ddpm) + text_rules.check_config(d) + ddpm_options.check_config(d)


def _latent_rules(d: dict) -> list[tuple[str, str]]:
    data, spec = d["data"], d["data"]["encoder"]
    known = ("none", "sd-vae", "sd-vae-ft-mse", "sd-vae-ft-ema")
    if spec not in known and ":" not in spec:
        return [(f"data.encoder={spec}", f"use one of {', '.join(known)}, or \"package.module:Name\" for your own")]
    if spec == "none":
        return [(f"data.{k}={data[k]}", "applies to latent runs only; set data.encoder, or drop it")
                for k, default in (("encoder_path", None), ("latent_norm", "dit"), ("keep_images", True))
                if data[k] != default]
    bad = []
    if ":" in spec and data["latent_norm"] != "dit":
        bad.append((f"data.latent_norm={data['latent_norm']}", "is the SD-VAE's; your own encoder brings its scale "
                    "and bias, so drop it"))
    from diffrelay.evaluation import protocol  # light: no torch

    own = [n for n in protocol.extractor_names(d["fid"]) if protocol.reference_file(d["fid"], n) is None]
    if not data["keep_images"] and own:
        bad.append(("data.keep_images=false", f"leaves no images for the {own[0]} reference statistics of the "
                    "dataset; give fid.reference for every extractor (e.g. ADM's or clean-fid's statistics of the "
                    "dataset), or keep the images"))
    return bad


