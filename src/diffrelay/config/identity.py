"""A run's identity: which settings change the weights (`trajectory`), its hash (what a run folder, checkpoints and
Snakemake's reruns are keyed by), and whether a file on disk belongs to a run (`is_same_run`)."""

import copy
import functools
import hashlib
import json

from diffrelay import nets, pretrained
from diffrelay.config import text as text_rules
from diffrelay.config.schema import Config, validate
from diffrelay.errors import UserError
from diffrelay.objectives import ddpm_options  # torch-free
from diffrelay.training import settings  # torch-free


def section_hash(cfg: Config, *sections: str) -> str:
    """A short stable hash of some sections: a Snakemake param that reruns a stage when they change."""
    blob = json.dumps({s: cfg.to_dict()[s] for s in sections}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def data_hash(cfg: Config) -> str:
    """section_hash of `data` without the keys that do not change the dataset's bytes (data.workers):
    a Snakemake param that rebuilds the dataset only when its content would change."""
    data = trajectory(cfg)["data"]
    # Latent: the files differ (pixels kept or not) and may come from other weights; text: a cache or not.
    extra = ("encoder_path", "keep_images") * _latent(data) + ("text_cache", "text_encoders") * ("captions" in data)
    # data.on_corrupt skip leaves out images past data.max_image_pixels: another bound, another dataset (its
    # fingerprint too); the default hashes as before the key existed.
    default = _default_config()["data"]["max_image_pixels"]
    extra += ("max_image_pixels",) * (cfg.data.on_corrupt == "skip" and cfg.data.max_image_pixels != default)
    data = data | {k: cfg.to_dict()["data"][k] for k in extra}
    if data.get("buckets") and data["buckets"]["min_images"] is None:  # the global batch is the merge's minimum
        data["buckets"] = data["buckets"] | {"min_images": cfg.train.batch_size}
    blob = json.dumps({"data": data}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _latent(data: dict) -> bool:
    return data.get("encoder", "none") != "none"


# Keys that do not change the training trajectory: how it is split, launched, logged or saved.
_NOT_TRAJECTORY = {"segment_steps", "nproc_per_node", "nnodes", "grad_accum", "threads", "log_every",
                   "snapshot_every", "recovery_every", "keep_recovery", "timeout_minutes", "tensorboard",
                   # speed switches: the same run, numerically equal up to rounding
                   "compile", "tf32", "fused_optimizer", "channels_last", "deterministic", "fused_backward",
                   "block_swap",  # where the frozen weights wait: bitwise the same (runtime/block_swap.py)
                   "activation_checkpointing",  # memory, not arithmetic: bitwise the same (nets/memory.py)
                   "sharding"}  # where the state lives: a resume with the other is refused in one line (state.py)

# data keys that change how the dataset is made, not its bytes (a bound past which an image is refused: the
# dataset's fingerprint holds it where it leaves images out).
_NOT_PIXELS = {"workers", "max_image_pixels"}


# Keys that apply only to one kind of dataset or network. Elsewhere they are read as their schema default, so
# a value a layered base config sets for, say, the UNet is no part of a DiT run's identity (issue 20.7).
# Reset to the default rather than dropped: a run that never set them keeps the hash it always had.
_DATA_ONLY_FOR = {"shapes": ("path", "on_corrupt"), "folder": ("count", "seed")}


@functools.cache
def _default_config() -> dict:
    return validate({})


@functools.cache
def _default_trajectory() -> dict:
    return trajectory_of(validate({}))


def applicable(t: dict) -> dict:
    """trajectory dict -> the same with every key that does not apply to this run set to its default."""
    out, defaults = copy.deepcopy(t), _default_trajectory()
    data = out["data"]
    for key in _DATA_ONLY_FOR.get(data.get("kind"), ()):
        if key in data:
            data[key] = defaults["data"][key]
    out["model"] = applicable_model(out["model"])
    return out


def applicable_model(model: dict) -> dict:
    """A `model` section with the UNet's top-level settings at their defaults where they do not apply: in
    any other network, and where model.kwargs (or its preset) sets the same keyword (nets.unet_settings)."""
    out, defaults = pretrained.trajectory(model), _default_trajectory()["model"]  # its sha256s, not its path
    for key in nets.unused_keys(out) & set(out):
        out[key] = defaults[key]
    if out.get("objective", "edm") == "edm":
        out.pop("objective", None)  # sections from before model.objective existed are EDM's
    return out


def trajectory_of(d: dict) -> dict:
    """Everything that changes the weights, by section, every key as given (what diffrelay < 0.4 hashed)."""
    train = settings.trajectory({k: v for k, v in d["train"].items() if k not in _NOT_TRAJECTORY})
    # Off, post-hoc EMA drops out, so runs from before it keep their hash; on, its profiles are part of
    # the checkpoints' state (every only says how often they are stored).
    phema = train.pop("phema", None) or {}
    if phema.get("every"):
        train["phema"] = {"profiles": phema["profiles"]}
    if train.get("lora"):  # at their defaults, keys added since: runs from before them keep their hash
        train["lora"] = {k: v for k, v in train["lora"].items()
                         if (k, v) not in (("quantize_base", None), ("kind", "lora"))}
    if train["lr_schedule"] != "cosine":
        # Only a cosine schedule looks at the run's length; otherwise a longer run extends this one.
        del train["total_steps"]
    data = {k: v for k, v in d["data"].items() if k not in _NOT_PIXELS}
    # Pixel runs read as they did before latents existed. Where the weights are and whether the pixels are kept
    # too does not change the weights: the dataset's fingerprint names the encoder by its sha256.
    center = ("crop",) if data.get("crop") == "center" else ()  # the default: hashed as before data.crop existed
    if data.get("buckets", 0) is None:
        del data["buckets"]  # off: hashed as before data.buckets existed
    if data.get("subsets", 0) is None:
        del data["subsets"]  # off: hashed as before data.subsets existed
    for key, off in (("min_size", 0), ("shuffle_caption", False), ("keep_tokens", 0), ("keep_tokens_separator", ""),
                     ("caption_tag_dropout", 0.0), ("random_crop", False)):
        if key in data and data[key] == off:
            del data[key]  # off: hashed as before the key existed
    for key in ("encoder_path", "keep_images") + center + (() if _latent(data) else ("encoder", "latent_norm")):
        data.pop(key, None)
    if data.get("encoder") == "sd-vae":
        data["encoder"] = "sd-vae-ft-mse"  # the same weights under their full name
    text_rules.trajectory(data)
    if _latent(data) and ":" in data["encoder"]:
        data.pop("latent_norm", None)  # your own encoder brings its own scaling
    model = pretrained.trajectory(d["model"])  # a copy; its sha256s, not its path, and nothing without one
    if model.get("arch") == "dit":  # a checkpoint of the earlier DiT is another run (nets.DIT_LAYOUT)
        model["dit_layout"] = nets.DIT_LAYOUT
    # The objective's keys apply to its runs only; EDM runs read as they did before objectives existed.
    kind = model.pop("objective", "edm")
    if kind != "edm":
        # EDM's noise-level keys do not apply: reset to their defaults (not dropped, so a record of this run
        # has the same keys as any other and a change of them is no change of the run).
        edm = _default_trajectory()
        model["objective"] = kind
        model["sigma_data"] = edm["model"]["sigma_data"]
        train.update({k: edm["train"][k] for k in ("p_mean", "p_std")})
    ddpm_options.trajectory(kind, model, train)  # train.flow, model.ddpm: in their objective's runs only
    return {"run": {"seed": d["run"]["seed"]}, "data": data, "model": model, "train": train}


def trajectory(cfg) -> dict:
    """Everything that changes the weights, by section: what a run folder is made from. Keys that do not
    apply to this run (a UNet setting in a DiT run, a generator setting in a folder run) read as defaults."""
    return applicable(trajectory_of(cfg.to_dict() if isinstance(cfg, Config) else cfg))


def digest(t: dict) -> str:
    blob = {"seed": t["run"]["seed"], "data": t["data"], "model": t["model"], "train": t["train"]}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def trajectory_hash(cfg: Config) -> str:
    """Hash of trajectory(cfg): reruns training in Snakemake, guards resumes, is written in new checkpoints."""
    return digest(trajectory(cfg))


def run_hash(meta: dict) -> str | None:
    """The trajectory hash of the config a checkpoint's (snapshot's, post-hoc EMA file's) meta records, read
    with today's defaults and rules; its stored hash when the config cannot be read."""
    try:
        return trajectory_hash(validate(meta["config"], "a checkpoint's config"))
    except (KeyError, TypeError, UserError):
        return meta.get("trajectory")


def is_same_run(meta: dict, traj: str) -> bool:
    """The file belongs to the run of trajectory hash `traj`: by the hash it carries, or (written before
    inapplicable keys were set aside, or by a config that set such keys differently) by run_hash."""
    return meta.get("trajectory") == traj or run_hash(meta) == traj


def difference(a, b, prefix: tuple = ()) -> tuple | None:
    """The first key path, as a tuple of keys, where two nested dicts differ; None when they are equal. A tuple, as
    keys may hold dots themselves (model.pretrained.sha256's file names: "unet/diffusion_pytorch_model.safetensors")."""
    for key in sorted(set(a) | set(b), key=str):
        path = prefix + (key,)
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            inner = difference(a[key], b[key], path)
            if inner:
                return inner
        elif a.get(key) != b.get(key):
            return path
    return None


def first_difference(a, b, prefix: str = "") -> str | None:
    """The first key path where two nested dicts differ, e.g. 'train.lr'; None when they are equal."""
    path = difference(a, b)
    return prefix + ".".join(map(str, path)) if path else None


def lookup(d: dict, path):
    """The value at a key path: a tuple of keys (difference's), or a dotted string whose keys hold no dots."""
    for part in path.split(".") if isinstance(path, str) else path:
        d = d.get(part) if isinstance(d, dict) else None
    return d


def check_same_files(was: dict, now: dict, source: str, made: str) -> None:
    """Raise one line when two model sections (or trajectories) differ first in a pretrained folder's file, naming
    the file, both sha256s and the fix; return when they differ elsewhere, or not at all. `made`: what `was` made."""
    path = difference(was, now)
    if not path or "sha256" not in path[:-1] or "pretrained" not in path:
        return
    name = path[-1]
    before, after = (_short_sha(lookup(d, path)) for d in (was, now))
    raise UserError(f"{source}: the pretrained pipeline's {name} has sha256 {after} now, but {made} was made "
                    f"with {before}: the base pipeline changed; restore the pipeline folder it was made with, or "
                    "start a new run.name to train on this one")


def _short_sha(value) -> str:
    return "none (no such file)" if value is None else f"{str(value)[:12]}..."
