"""Load, validate and freeze a run config. Imports only yaml and jsonschema, so the Snakefile can use it."""

import copy
import functools
import hashlib
import importlib.util
import json
import math
from importlib import resources
from pathlib import Path

import jsonschema
import yaml

from diffrelay import config_paths, nets, pretrained
from diffrelay.nets import checks
from diffrelay import config_text as text_checks  # torch-free
from diffrelay.training import settings  # torch-free
from diffrelay.objectives import ddpm_options  # torch-free
from diffrelay.yamlfile import read_yaml  # noqa: F401 -- config.read_yaml is the Snakefile's reader too
from diffrelay.errors import UserError

SCHEMA_FILE = "config.schema.yaml"
MAX_WIDTH = 16384  # channels at a UNet's widest level; more is a typo, not a model


@functools.cache  # parsed once a process, by libyaml where PyYAML has it (5 ms, not 55); callers only read it
def load_schema() -> dict:
    text = resources.files("diffrelay").joinpath(SCHEMA_FILE).read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


class Config:
    """A read-only view of a validated config dict: `cfg.train.batch_size`."""

    __slots__ = ("_d",)

    def __init__(self, d: dict):
        object.__setattr__(self, "_d", d)

    def __getattr__(self, key):
        try:
            v = self._d[key]
        except KeyError:
            raise AttributeError(key) from None
        return Config(v) if isinstance(v, dict) else (tuple(v) if isinstance(v, list) else v)

    def __setattr__(self, key, value):
        raise AttributeError("Config is read-only")

    def to_dict(self) -> dict:
        return copy.deepcopy(self._d)

    def __eq__(self, other):
        return isinstance(other, Config) and self._d == other._d

    def __repr__(self):
        return f"Config({json.dumps(self._d, sort_keys=True)})"


def _is_strict_integer(checker, instance) -> bool:
    # JSON Schema counts 6.0 as an integer; refuse it, since range() and step arithmetic need real ints.
    return isinstance(instance, int) and not isinstance(instance, bool)


@functools.cache
def _filling_validator():
    # Same idea as snakemake.utils.validate(set_default=True): fill each property's default, then descend.
    base = jsonschema.Draft202012Validator
    base = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", _is_strict_integer))

    def properties(validator, props, instance, schema):
        if isinstance(instance, dict):
            for key, sub in props.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from base.VALIDATORS["properties"](validator, props, instance, schema)

    return jsonschema.validators.extend(base, {"properties": properties})


def _key_path(err) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top level)"


def _explain(err) -> str:
    """One line for a jsonschema error: where, what was found, what is allowed."""
    if err.validator == "anyOf" and isinstance(err.instance, dict):  # a section or null (track.wandb): the section's
        err = next((e for e in err.context if e.validator != "type"), err)
    where = _key_path(err)
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        name = ".".join(filter(None, [where if where != "(top level)" else "", extra[0]]))
        return f"{name}: unknown key; allowed here: {', '.join(allowed)}"
    value = json.dumps(err.instance)
    if len(value) > 60:
        value = value[:57] + "..."
    if err.validator == "type":
        want = err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
        return f"{where}={value}: wrong type; expected {want}"
    if err.validator == "enum":
        return f"{where}={value}: not allowed; choose one of {', '.join(map(str, err.validator_value))}"
    if err.validator in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        words = {"minimum": "at least", "exclusiveMinimum": "greater than",
                 "maximum": "at most", "exclusiveMaximum": "less than"}[err.validator]
        return f"{where}={value}: must be {words} {err.validator_value}"
    if err.validator in ("minLength", "maxLength", "minItems", "maxItems"):
        if err.validator.startswith("min") and err.validator_value == 1:
            return f"{where}={value}: must not be empty"
        words = "at least" if err.validator.startswith("min") else "at most"
        unit = "characters" if err.validator.endswith("Length") else "items"
        return f"{where}={value}: must have {words} {err.validator_value} {unit}"
    if err.validator == "oneOf":
        return f"{where}={value}: not one of the allowed forms; see its description in config/config.yaml"
    if err.validator == "pattern":
        return (f"{where}={value}: must start with a letter or digit, then only letters, digits, '.', '_' and '-' "
                "(no spaces or shell characters)")
    return f"{where}={value}: {err.message}"


def _check_combinations(d: dict) -> list[tuple[str, str]]:
    """Rules that span several keys. Returns (key path, message) pairs; empty when all is well."""
    bad = config_paths.check_paths(d)
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

    bad += check_phema(t, s) + settings.check_config(d)
    if data["encoder"] == "none":  # a latent run's network sees the latents: preflight.check_latent checks it
        bad += checks.check_model(m, data["resolution"])
    bad += _check_latent(d)
    from diffrelay.runtime.gpus import check_pool  # light: no torch
    bad += check_pool(d)
    if data["kind"] == "folder" and not data["path"]:
        bad.append(("data.path", "required when data.kind is folder; give the image folder"))
    elif data["kind"] == "shapes" and data["crop"] != "center":
        bad.append((f"data.crop={data['crop']}", "crops folder images; shapes are drawn at data.resolution: drop it"))
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
    parts = load_schema()["properties"]["sample"]["properties"]
    edm, flow, ddpm = ({k: v.get("default") for k, v in parts[p]["properties"].items()} for p in ("edm", "flow", "ddpm"))
    return bad + check_sampling(d, edm, flow, ddpm) + text_checks.check_config(d) + ddpm_options.check_config(d)


def _check_latent(d: dict) -> list[tuple[str, str]]:
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


def non_finite(d, prefix="") -> str | None:
    """The first key holding NaN or an infinity (YAML's .nan, .inf), which every schema bound lets through."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        path = f"{prefix}.{k}" if prefix and isinstance(k, str) else f"{prefix}[{k}]" if prefix else str(k)
        if isinstance(v, float) and not math.isfinite(v):
            return f"{path}={v}"
        found = non_finite(v, path)
        if found:
            return found
    return None


def validate(raw: dict, source: str = "config") -> dict:
    """Return a new dict with defaults filled, or raise UserError naming the source, key, value and fix."""
    if not isinstance(raw, dict):
        raise UserError(f"{source}: the config must be a mapping of sections (run, data, model, train, sample, fid)")
    bad_number = non_finite(raw)
    if bad_number:
        raise UserError(f"{source}: {bad_number}: not a finite number; write a real number")
    d = copy.deepcopy(raw)
    errors = sorted(_filling_validator()(load_schema()).iter_errors(d), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        # Report the first problem only: one actionable line beats a wall of text.
        raise UserError(f"{source}: {_explain(errors[0])}")
    bad = pretrained.expand(d) or _check_combinations(d)  # model.pretrained's keys first (docs/pretrained.md)
    if bad:
        key, msg = bad[0]
        raise UserError(f"{source}: {key}: {msg}")
    return d


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load(paths, overrides: dict | None = None) -> Config:
    """Read one or more YAML files (later ones override earlier ones), validate, freeze."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    merged: dict = {}
    for p in paths:
        d = read_yaml(p)
        if not isinstance(d, dict):
            raise UserError(f"{p}: the config must be a mapping of sections (run, data, model, train, sample, fid)")
        merged = _merge(merged, d)
    if overrides:
        merged = _merge(merged, overrides)
    return Config(validate(merged, source=", ".join(map(str, paths)) or "config"))


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.results) / cfg.run.name


def segment_ends(cfg: Config, done=()) -> list[int]:
    """Steps at which a training segment stops and writes a checkpoint.

    `done`: steps of segment checkpoints this run already has. They stay segment ends, and
    train.segment_steps spaces only the segments still to train, so changing it retrains nothing."""
    t = cfg.train
    done = sorted(s for s in set(done) if 0 < s <= t.total_steps)
    last = done[-1] if done else 0
    if last == t.total_steps:
        return done
    return done + list(range(last + t.segment_steps, t.total_steps, t.segment_steps)) + [t.total_steps]


def snapshot_steps(cfg: Config, start: int, end: int) -> list[int]:
    """Evaluation snapshots written by the segment that trains (start, end]."""
    every = cfg.train.snapshot_every
    steps = set(range(start + every, end, every)) if every else set()
    return sorted(steps | {end})


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
    data = data | {k: cfg.to_dict()["data"][k] for k in extra}
    blob = json.dumps({"data": data}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _latent(data: dict) -> bool:
    return data.get("encoder", "none") != "none"


# Keys that do not change the training trajectory: how it is split, launched, logged or saved.
_NOT_TRAJECTORY = {"segment_steps", "nproc_per_node", "nnodes", "grad_accum", "threads", "log_every",
                   "snapshot_every", "recovery_every", "keep_recovery", "timeout_minutes", "tensorboard",
                   # speed switches: the same run, numerically equal up to rounding
                   "compile", "tf32", "fused_optimizer", "channels_last", "deterministic",
                   "activation_checkpointing"}  # memory, not arithmetic: bitwise the same (nets/memory.py)

# data keys that change how the dataset is made, not its bytes.
_NOT_PIXELS = {"workers"}


# Keys that apply only to one kind of dataset or network. Elsewhere they are read as their schema default, so
# a value a layered base config sets for, say, the UNet is no part of a DiT run's identity (issue 20.7).
# Reset to the default rather than dropped: a run that never set them keeps the hash it always had.
_DATA_ONLY_FOR = {"shapes": ("path", "on_corrupt"), "folder": ("count", "seed")}


@functools.cache
def _default_trajectory() -> dict:
    return _trajectory_of(validate({}))


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


def _trajectory_of(d: dict) -> dict:
    """Everything that changes the weights, by section, every key as given (what diffrelay < 0.4 hashed)."""
    train = settings.trajectory({k: v for k, v in d["train"].items() if k not in _NOT_TRAJECTORY})
    # Off, post-hoc EMA drops out, so runs from before it keep their hash; on, its profiles are part of
    # the checkpoints' state (every only says how often they are stored).
    phema = train.pop("phema", None) or {}
    if phema.get("every"):
        train["phema"] = {"profiles": phema["profiles"]}
    if train["lr_schedule"] != "cosine":
        # Only a cosine schedule looks at the run's length; otherwise a longer run extends this one.
        del train["total_steps"]
    data = {k: v for k, v in d["data"].items() if k not in _NOT_PIXELS}
    # Pixel runs read as they did before latents existed. Where the weights are and whether the pixels are kept
    # too does not change the weights: the dataset's fingerprint names the encoder by its sha256.
    center = ("crop",) if data.get("crop") == "center" else ()  # the default: hashed as before data.crop existed
    for key in ("encoder_path", "keep_images") + center + (() if _latent(data) else ("encoder", "latent_norm")):
        data.pop(key, None)
    if data.get("encoder") == "sd-vae":
        data["encoder"] = "sd-vae-ft-mse"  # the same weights under their full name
    text_checks.trajectory(data)
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
    return applicable(_trajectory_of(cfg.to_dict() if isinstance(cfg, Config) else cfg))


def _hash(t: dict) -> str:
    blob = {"seed": t["run"]["seed"], "data": t["data"], "model": t["model"], "train": t["train"]}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def trajectory_hash(cfg: Config) -> str:
    """Hash of trajectory(cfg): reruns training in Snakemake, guards resumes, is written in new checkpoints."""
    return _hash(trajectory(cfg))


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


def first_difference(a, b, prefix: str = "") -> str | None:
    """The first key path where two nested dicts differ, e.g. 'train.lr'; None when they are equal."""
    for key in sorted(set(a) | set(b), key=str):
        path = f"{prefix}{key}"
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            inner = first_difference(a[key], b[key], f"{path}.")
            if inner:
                return inner
        elif a.get(key) != b.get(key):
            return path
    return None


def lookup(d: dict, path: str):
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d
