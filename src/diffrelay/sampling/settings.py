"""The `sample` section as sampling uses it (Settings): what changes the pixels, and the sampler flags.

Imports the base modules and objectives (each objective's sampler settings).
"""

import dataclasses
import json
import math
from pathlib import Path

from diffrelay.data.order import MAX_SEED
from diffrelay.errors import UserError
from diffrelay.sampling.checks import MAX_GUIDANCE
from diffrelay.objectives.edm import SamplerSettings
from diffrelay.objectives.ddpm import SamplerSettings as DdpmSamplerSettings
from diffrelay.objectives.flow import SamplerSettings as FlowSamplerSettings

# Settings that change the pixels: a finished folder with the same values is up to date.
PIXEL_KEYS = ("num_images", "first_seed", "steps", "solver", "weights", "class_labels", "precision", "compile",
              "guidance")  # and ema_decay, guide_sha256, edm, flow, ddpm, guidance_interval where not the default
# sample.edm keys and their `diffrelay sample` flags (argparse attribute names).
EDM_FLAGS = {"sigma_min": "sigma_min", "sigma_max": "sigma_max", "rho": "rho", "S_churn": "s_churn",
             "S_min": "s_min", "S_max": "s_max", "S_noise": "s_noise"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The schema's `sample` section, minus nproc (the process count comes from torchrun)."""

    num_images: int
    first_seed: int
    steps: int
    solver: str  # heun | euler | sde (flow) | ddpm | ddim (ddpm)
    batch_size: int  # images per forward pass per process, before padding to PAD_ROWS
    weights: str  # ema | raw
    class_labels: str | int  # "balanced" or one class index
    precision: str  # fp32 | bf16
    threads: int
    tf32: bool = False  # CUDA: fp32 matmuls/convolutions on TF32 tensor cores (speed.set_backends)
    quantize_base: str | None = None  # a LoRA run's frozen base quantized (int8, fp8, nf4); None = as loaded
    compile: bool = False  # torch.compile the network (one shape: forward_rows)
    edm: SamplerSettings = SamplerSettings()  # sample.edm: schedule and churn
    flow: FlowSamplerSettings = FlowSamplerSettings()  # sample.flow: grid shift and the sde's last step
    ddpm: DdpmSamplerSettings = DdpmSamplerSettings()  # sample.ddpm: DDIM's eta, guided channels, clipping
    guidance_interval: tuple | None = None  # (lo, hi) noise levels where guidance applies; None = every step
    guidance: float = 1.0  # classifier-free guidance scale; 1 = off (one network pass, as without guidance)
    true_cfg_scale: float = 1.0  # FLUX.1: FluxPipeline's true_cfg_scale with negative prompts; 1 = off
    guide: str | None = None  # autoguidance: the guiding snapshot's path; None = the null class (CFG)
    ema_decay: float | None = None  # which of train.ema_decays's EMAs; None = the first
    npz: bool = False  # also samples.npz (export.py); not a pixel setting
    prompts: str | None = None  # text runs: the prompt file (sampling/prompted.py); None = the held-out captions
    scheduler: str | None = None  # a diffusers scheduler's class (sampling/schedulers.py); None = `solver`
    scheduler_kwargs: dict = dataclasses.field(default_factory=dict)  # its other config keys
    # (width, height) in pixels, one of sample.sizes; None = the snapshot's square (a size equal to it counts as None)
    size: tuple | None = None

    @classmethod
    def from_section(cls, section: dict) -> "Settings":
        values = {f.name: section[f.name] for f in dataclasses.fields(cls) if f.name != "size"}
        values["edm"] = SamplerSettings(**values["edm"])
        values["flow"] = FlowSamplerSettings(**values["flow"])
        values["ddpm"] = DdpmSamplerSettings(**values["ddpm"])
        values["scheduler_kwargs"] = dict(values["scheduler_kwargs"] or {})
        values["guidance_interval"] = None if values["guidance_interval"] is None else tuple(values["guidance_interval"])
        g = values["guidance"]
        if isinstance(g, list):  # a sweep: the workflow passes one value a job with --guidance
            if len(g) > 1:
                raise UserError(f"sample.guidance={g}: a list; pass one value with --guidance")
            values["guidance"] = g[0]
        values["guidance"] = float(values["guidance"])
        if isinstance(values["prompts"], list):  # a sweep of prompt files: the workflow passes one with --prompts
            if len(values["prompts"]) > 1:
                raise UserError(f"sample.prompts={values['prompts']}: a list; pass one file with --prompts")
            values["prompts"] = values["prompts"][0]
        # sample.sizes lists the workflow's evaluations; each job of a size other than the square says so with
        # --size (the square's job, and a hand-run without the flag, sample the data.resolution square).
        values["size"] = None
        # sample.ema_decay lists the workflow's evaluations; each job that samples another EMA than the first
        # says so with --ema-decay (a post-hoc EMA reconstruction, or the first EMA, has no flag to pass).
        values["ema_decay"] = None
        return cls(**values)


def _flags(args) -> dict:
    """The Settings values the flags give, each checked in one line naming the flag."""
    over = {k: getattr(args, k) for k in ("num_images", "first_seed", "steps", "batch_size", "threads", "solver",
                                          "weights", "precision", "guidance", "guide", "ema_decay", "tf32",
                                          "prompts", "scheduler", "quantize_base", "true_cfg_scale")
            if getattr(args, k, None) is not None}
    for name, v in over.items():
        low = 0 if name == "first_seed" else 1
        if name in ("guide", "ema_decay", "tf32", "prompts", "scheduler", "quantize_base", "true_cfg_scale"):
            continue
        if isinstance(v, int) and v < low:
            raise UserError(f"--{name.replace('_', '-')}={v}: must be at least {low}")
    if not math.isfinite(over.get("guidance", 1)) or not 0 <= over.get("guidance", 1) <= MAX_GUIDANCE:
        # Checked before any folder: 1e308 is no float32 (the autoguided sampler raised a traceback) and huge ones
        # overflow to NaN after the work folder is made.
        raise UserError(f"--guidance={over['guidance']}: must be a finite number from 0 to {MAX_GUIDANCE:g} (1 = off; "
                        "larger scales overflow float32 in the sampler)")
    if not 1 <= over.get("true_cfg_scale", 1) <= MAX_GUIDANCE:
        raise UserError(f"--true-cfg-scale={over['true_cfg_scale']}: must be a number from 1 (off) to "
                        f"{MAX_GUIDANCE:g}")
    if not 0 < over.get("ema_decay", 0.5) < 1:
        raise UserError(f"--ema-decay={over['ema_decay']}: a decay lies between 0 and 1; give one of train.ema_decays")
    if getattr(args, "scheduler_kwargs", None) is not None:  # a JSON object of the scheduler's config keys
        try:
            over["scheduler_kwargs"] = json.loads(args.scheduler_kwargs)
        except ValueError:
            over["scheduler_kwargs"] = None
        if not isinstance(over["scheduler_kwargs"], dict):
            raise UserError(f"--scheduler-kwargs={args.scheduler_kwargs}: not a JSON object; give e.g. "
                            "'{\"use_karras_sigmas\": true}'")
    if getattr(args, "npz", None) is not None:  # a bool: not range-checked above
        over["npz"] = args.npz
    if args.class_labels is not None:
        cl = args.class_labels.strip()
        if cl != "balanced" and not cl.isdigit():
            raise UserError(f"--class-labels={args.class_labels}: use balanced or a class index (0 or more)")
        over["class_labels"] = cl if cl == "balanced" else int(cl)
    if getattr(args, "held_out_captions", False):  # the held-out captions, whatever sample.prompts names
        if "prompts" in over:
            raise UserError("--held-out-captions and --prompts: one image per held-out caption, or the prompt file's; "
                            "give one of them")
        over["prompts"] = None
    if "solver" in over and "scheduler" not in over:  # --solver asks for the objective's own sampler
        over["scheduler"], over["scheduler_kwargs"] = None, {}
    # sample.ddpm flags: their ranges here; whether they fit the snapshot's objective, when it is read (run()).
    eta, wide = getattr(args, "ddpm_eta", None), getattr(args, "ddpm_guided_channels", None)
    if eta is not None and not 0 <= eta <= 1:
        raise UserError(f"--ddpm-eta={eta}: DDIM's eta lies between 0 and 1")
    if wide is not None and wide < 1:
        raise UserError(f"--ddpm-guided-channels={wide}: must be at least 1")
    return over


# Flags whose config rules are the workflow's plan, not one job's: fid.final.num_images above sample.num_images (the
# second pass samples --num-images fid.final.num_images), the seed sets' last seed (each set's --first-seed). The
# job's own bound (its last seed) is checked in from_args.
PLAN_FLAGS = ("num_images", "first_seed")


def layered(args, files: dict | None) -> dict:
    """The `sample` section's keys the flags set, for the config to be checked with them (config.sample_config):
    a flag overrides its key before any rule reads it (--guidance 3 over a config's 1 with a prompt file's negative
    prompt; --weights, --steps, --scheduler, --quantize-base, ...), not after. `files`: the config files' sample
    section as written. A --guidance that is one of the files' sweep (the workflow's job of it) keeps the sweep:
    the run's rules are the sweep's, and its guidance-1 images of a negative prompt are the sweep's unguided ones
    (prompted.check says so). PLAN_FLAGS are left to from_args, as is --size (not a config key: the network checks
    it before any work, run())."""
    over = {k: v for k, v in _flags(args).items() if k not in (*PLAN_FLAGS, "size")}
    files = files or {}
    sweep = files.get("guidance")
    if "guidance" in over and isinstance(sweep, list) and over["guidance"] in sweep:
        del over["guidance"]
    if getattr(args, "held_out_captions", False):  # this job samples the held-out captions, not beside a file
        over["held_out_captions"] = False
    if "weights" in over or "ema_decay" in over:  # sampling takes its EMA from --ema-decay alone (from_section)
        over["ema_decay"] = over.get("ema_decay")
    for section, flags in (("edm", {k: getattr(args, a, None) for k, a in EDM_FLAGS.items()}),
                           ("flow", {k: getattr(args, f"flow_{k}", None) for k in ("shift", "last_step",
                                                                                     "guided_channels")}),
                           ("ddpm", {k: getattr(args, f"ddpm_{k}", None) for k in ("eta", "guided_channels",
                                                                                     "clip_denoised")})):
        given = {k: v for k, v in flags.items() if v is not None}
        if given:
            over[section] = given
    if getattr(args, "guidance_interval", None) is not None:
        over["guidance_interval"] = list(args.guidance_interval)
    return over


def from_args(args, cfg: dict, validate) -> tuple[Settings, dict]:
    """`cfg` (the run's config, or the schema defaults) overridden by the flags given; cheap checks name the flag.
    validate: config.validate, to check the flags like the config file's values. `diffrelay sample` checks the
    config with the flags already in it (layered); this applies them to the settings, and takes the ones a config
    does not check (PLAN_FLAGS, --size)."""
    over = _flags(args)
    for key in ("guidance", "prompts"):  # the workflow's one value of a sweep
        if key in over:
            cfg["sample"][key] = over[key]
    if getattr(args, "size", None) is not None:  # one size of sample.sizes (or any other: checked when sampled)
        over["size"] = tuple(args.size)
    flags = {k: getattr(args, EDM_FLAGS[k]) for k in EDM_FLAGS if getattr(args, EDM_FLAGS[k], None) is not None}
    flow_flags = {k: getattr(args, f"flow_{k}") for k in ("shift", "last_step", "guided_channels")
                  if getattr(args, f"flow_{k}", None) is not None}
    if flow_flags:
        cfg["sample"]["flow"] = {**cfg["sample"]["flow"], **flow_flags}
    if flags or flow_flags or getattr(args, "guidance_interval", None) is not None:
        # Checked like the config file's values (ranges, sigma_min < sigma_max, S_min < S_max, the interval).
        cfg["sample"]["edm"] = {**cfg["sample"]["edm"], **flags}
        if getattr(args, "guidance_interval", None) is not None:
            cfg["sample"]["guidance_interval"] = list(args.guidance_interval)
        cfg = validate(cfg, source="diffrelay sample's --sigma-*/--rho/--s-*/--flow-*/--guidance-interval flags")
    ddpm_flags = {k: getattr(args, f"ddpm_{k}") for k in ("eta", "guided_channels", "clip_denoised")
                  if getattr(args, f"ddpm_{k}", None) is not None}
    cfg["sample"]["ddpm"] = {**cfg["sample"]["ddpm"], **ddpm_flags}
    if isinstance(cfg["sample"]["guide"], int) and "guide" not in over:
        # A step: this run's snapshot there (the workflow passes the path; this serves a hand-run with --config).
        step = cfg["sample"]["guide"]
        cfg["sample"]["guide"] = str(Path(cfg["run"]["results"]) / cfg["run"]["name"] / "snapshots" / f"step_{step:07d}.safetensors")
    s = dataclasses.replace(Settings.from_section(cfg["sample"]), **over)
    if s.ema_decay is not None and s.weights == "raw":
        raise UserError(f"--ema-decay={s.ema_decay:g}: with --weights raw there is no EMA to choose; drop one of them")
    if s.first_seed + s.num_images - 1 > MAX_SEED:  # before any folder exists: a seed too large for numpy/torch
        raise UserError(f"--first-seed={s.first_seed}: with {s.num_images} images the last seed passes the largest "
                        f"seed {MAX_SEED}; use a smaller one")
    return s, cfg["run"]
