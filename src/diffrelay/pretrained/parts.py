"""What each part of a pipeline folder makes of a run's config (torch-free, JSON only): the network's arch and
kwargs, the objective from the scheduler, the VAE as the latent encoder, the text encoders with their family's
settings. Each returns config values; pretrained.expand merges them and refuses contradictions.
"""

from diffrelay import families
from diffrelay.errors import UserError
from diffrelay.pretrained.folder import FIX, Pipeline, config

DDPM_SCHEDULERS = ("DDPMScheduler", "DDIMScheduler", "PNDMScheduler", "LMSDiscreteScheduler", "EulerDiscreteScheduler",
                   "EulerAncestralDiscreteScheduler", "HeunDiscreteScheduler", "DPMSolverMultistepScheduler",
                   "DPMSolverSinglestepScheduler", "KDPM2DiscreteScheduler", "KDPM2AncestralDiscreteScheduler",
                   "UniPCMultistepScheduler", "DEISMultistepScheduler")
FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)
# The DDPM-family schedulers whose __init__ takes these run keys (diffusers 0.42; tests/test_pretrained.py checks the
# installed diffusers): sample.scheduler: pipeline cannot sample a schedule its class cannot make.
TAKES = {"rescale_betas_zero_snr": ("DDPMScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler",
                                    "UniPCMultistepScheduler", "EulerDiscreteScheduler",
                                    "EulerAncestralDiscreteScheduler"),
         "clip_sample": ("DDPMScheduler", "DDIMScheduler", "HeunDiscreteScheduler")}
# FlowMatchEulerDiscreteScheduler's dynamic-shift keys and their class defaults (FluxPipeline reads them with
# these defaults: scheduler.config.get(key, default)).
DYNAMIC_SHIFT = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}


def family(pipe: Pipeline):
    """The families.Family of the folder's network (its class and config.json; folder.read admits only theirs)."""
    return families.of_class(pipe.parts[pipe.net], config(pipe, pipe.net))


def network(pipe: Pipeline) -> tuple[str, dict]:
    """(model.arch, model.kwargs, before the objective's time_scale) from the unet/ or transformer/ config.json:
    every config key but those diffrelay sets from the data (the family's set_keys, in_channels), checked later."""
    c = config(pipe, pipe.net)
    set_here = set(family(pipe).set_keys) | {"in_channels"}
    return family(pipe).arch, {k: v for k, v in c.items() if not k.startswith("_") and k not in set_here}


def text_encoders(pipe: Pipeline) -> list[dict]:
    """data.text_encoders as the family's pipeline encodes a prompt (docs/pretrained.md)."""
    root = pipe.root
    want, what = family(pipe).encoders(pipe)
    for name, _ in want:
        if name not in pipe.parts:
            raise UserError(f"{root / 'model_index.json'}: no {name}; {what} needs "
                            f"{' and '.join(n for n, _ in want)}; save the pipeline with all its text encoders")
    return [{"path": str(root / name), **extra} for name, extra in want]


def objective(pipe: Pipeline) -> tuple[str, dict]:
    """("ddpm", model.ddpm keys) or ("flow", {"shift": s}) from scheduler/scheduler_config.json. A FLUX.1
    scheduler's use_dynamic_shifting: training draws from its unshifted sigmas (FlowMatchEulerDiscreteScheduler's
    __init__ shifts them only without it, and train_dreambooth_lora_flux.py indexes those), so shift 1; the
    sampler shifts by the image's size (sampling/schedulers.py)."""
    path = pipe.root / "scheduler" / "scheduler_config.json"
    c = config(pipe, "scheduler", "scheduler_config.json")
    cls = c.get("_class_name")
    if c.get("num_train_timesteps", 1000) != 1000:
        raise UserError(f"{path}: num_train_timesteps {c['num_train_timesteps']}; diffrelay's objectives train "
                        "1000 timesteps, as every supported pipeline does")
    if cls in FLOW_SCHEDULERS:
        if c.get("use_dynamic_shifting"):
            if not family(pipe).dynamic_shift:
                raise UserError(f"{path}: use_dynamic_shifting true (a resolution-dependent shift) is supported for "
                                f"{families.names('dynamic_shift')} only ({families.pipelines_of('dynamic_shift')} "
                                "computes its mu); give the scheduler a fixed shift")
            return "flow", {"shift": 1.0, "dynamic": True}
        return "flow", {"shift": float(c.get("shift", 1.0))}
    if cls not in DDPM_SCHEDULERS:
        raise UserError(f"{path}: _class_name {cls}: not supported; diffrelay reads the schedule of "
                        f"{', '.join(DDPM_SCHEDULERS + FLOW_SCHEDULERS)}")
    if c.get("trained_betas") is not None:
        raise UserError(f"{path}: trained_betas (an explicit beta table) is not supported; diffrelay's schedules "
                        "are linear and scaled_linear")
    ddpm = {"beta_schedule": c.get("beta_schedule", "linear"), "beta_start": float(c.get("beta_start", 0.0001)),
            "beta_end": float(c.get("beta_end", 0.02)), "prediction_type": c.get("prediction_type", "epsilon"),
            "rescale_betas_zero_snr": bool(c.get("rescale_betas_zero_snr", False))}
    for key, allowed in (("beta_schedule", ("linear", "scaled_linear")),
                         ("prediction_type", ("epsilon", "v_prediction", "sample"))):
        if ddpm[key] not in allowed:
            raise UserError(f"{path}: {key} {ddpm[key]}: not supported; diffrelay trains {', '.join(allowed)}")
    return "ddpm", ddpm


def vae(pipe: Pipeline) -> str:
    """data.encoder_path: the vae/ folder, whose config.json must say its scaling_factor."""
    c = config(pipe, "vae")
    if not isinstance(c.get("scaling_factor"), (int, float)) or isinstance(c.get("scaling_factor"), bool):
        raise UserError(f"{pipe.root / 'vae' / 'config.json'}: no scaling_factor, so the latents' scale is unknown; "
                        "write the one the pipeline was trained with (SD 1.x/2.x 0.18215, SDXL 0.13025, SD3 1.5305)")
    return str(pipe.root / "vae")


def check_dims(pipe: Pipeline, encoders: list[dict]) -> None:
    """The network's config takes the VAE's latents and the encoders' widths: else the weights cannot be these."""
    from diffrelay.text import encoders as text_encoders

    c, v, fam = config(pipe, pipe.net), config(pipe, "vae"), family(pipe)
    where = pipe.root / pipe.net / "config.json"
    packed = fam.packing ** 2  # latent pixels a token (FLUX.1: 2 x 2)
    if c.get("in_channels", 4 * packed) != packed * v.get("latent_channels", 4):
        raise UserError(f"{where}: in_channels {c.get('in_channels', 4 * packed)}, but the VAE makes "
                        f"{v.get('latent_channels', 4)} latent channels{f' (x {packed} packed)' * (packed > 1)}; {FIX}")
    recs = text_encoders.records(encoders, hashed=False)
    fam.check_dims(c, recs, text_encoders.combined_dims(recs), where, FIX)


def pipeline_sampler_problems(pipe: Pipeline, model: dict, sample: dict) -> list[tuple[str, str]]:
    """sample.scheduler: pipeline against the folder's scheduler class, before any work: the run's schedule keys
    and DDIM's eta that the class cannot take (sampling/schedulers.py would refuse them at the first sample job)."""
    cls = config(pipe, "scheduler", "scheduler_config.json").get("_class_name")
    if cls in FLOW_SCHEDULERS:
        return []
    given = {"rescale_betas_zero_snr": (model.get("ddpm") or {}).get("rescale_betas_zero_snr", False),
             "clip_sample": sample["ddpm"]["clip_denoised"]}
    for key, value in given.items():
        if value and cls not in TAKES[key]:
            where = "model.ddpm" if key == "rescale_betas_zero_snr" else "sample.ddpm.clip_denoised"
            return [("sample.scheduler=pipeline", f"the folder's {cls} has no {key} ({where} is {value}); set "
                     f"sample.scheduler to one of {', '.join(TAKES[key])}")]
    if sample["ddpm"]["eta"] and cls != "DDIMScheduler":
        return [("sample.scheduler=pipeline", f"the folder's {cls} takes no eta (sample.ddpm.eta="
                 f"{sample['ddpm']['eta']}); remove it or set sample.scheduler: DDIMScheduler")]
    return []
