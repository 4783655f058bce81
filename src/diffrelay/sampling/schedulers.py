"""sample.scheduler: images drawn with a diffusers scheduler (DPM-Solver++, UniPC, Euler ancestral, DDIM, ...) in
place of the objective's own sampler, in the loop of diffusers' pipelines (pipeline_stable_diffusion's and
pipeline_stable_diffusion_3's denoising loops): set_timesteps(steps), then per timestep scale_model_input, the
network (both guidance branches in one batch), guidance, step. The scheduler's own classes do every step.

The scheduler is built from the run's schedule, so it samples the objective the network was trained on:
  ddpm: num_train_timesteps 1000 and model.ddpm's beta_schedule, beta_start, beta_end, prediction_type and
        rescale_betas_zero_snr; clip_sample = sample.ddpm.clip_denoised (diffrelay's default, no clipping, is
        Stable Diffusion's scheduler config; diffusers' DDPM/DDIM class defaults clip);
  flow: FlowMatch* with num_train_timesteps 1000 and shift = sample.flow.shift; the network's time input is
        timestep / 1000, its t in [0, 1] (SD3's pipeline gives the transformer sigma x 1000: a TextNet with
        time_scale 1000).
A family with pipeline_sigmas and dynamic_shift (families/: FLUX.1's), as FluxPipeline.__call__: set_timesteps(sigmas = linspace(1, 1 / N, N), mu), mu the
dynamic shift of the packed image's token count, (H / 2)(W / 2) of H x W latents: mu = base_shift + (tokens -
base_image_seq_len) (max_shift - base_shift) / (max_image_seq_len - base_image_seq_len) (pipeline_flux's
calculate_shift, the scheduler config's keys, their defaults when absent); any scheduler with use_dynamic_shifting
gets that mu.
sample.scheduler_kwargs adds the scheduler's other config keys (use_karras_sigmas, algorithm_type, ...).
sample.scheduler: pipeline (a model.pretrained run's default) is the class and keys of the folder's
scheduler/scheduler_config.json, the pipeline's own sampler when it is called; the run's keys above are set over
them, and scheduler_kwargs over those. Another class named over a model.pretrained run takes the folder's keys it
accepts first, as diffusers users write `Class.from_config(pipe.scheduler.config)` (SD's timestep_spacing "leading"
and steps_offset 1, not the class defaults "linspace" and 0).

One generator per image, as a pipeline called with generator=[one per image]: the image's seed draws its initial
noise (randn per image, then x init_noise_sigma: prepare_latents) and then every noise the scheduler's step draws
(randn_tensor with a list of generators draws each row from its own). Every step is elementwise per image (the
multistep schedulers' history too), so an image does not depend on the batch size or the process count.

Imports the base modules, families, objectives (the run's schedule) and pretrained (the folder's scheduler).
"""

import inspect
import json
import math

from diffrelay import families

DDPM_FAMILY = ("DDPMScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler", "DPMSolverSinglestepScheduler",
               "DEISMultistepScheduler", "UniPCMultistepScheduler", "EulerDiscreteScheduler",
               "EulerAncestralDiscreteScheduler", "HeunDiscreteScheduler", "KDPM2DiscreteScheduler",
               "KDPM2AncestralDiscreteScheduler", "LMSDiscreteScheduler", "PNDMScheduler")
FLOW_FAMILY = ("FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler")
FAMILY = {"ddpm": DDPM_FAMILY, "flow": FLOW_FAMILY}
T = 1000  # the discrete objective's timesteps (objectives.ddpm.T), and flow's timestep scale in diffusers
# Keys the run sets (its schedule): a scheduler_kwargs entry may not change what the network was trained on.
RUN_KEYS = {"ddpm": {"num_train_timesteps": "the run", "beta_schedule": "model.ddpm", "beta_start": "model.ddpm",
                     "beta_end": "model.ddpm", "prediction_type": "model.ddpm",
                     "rescale_betas_zero_snr": "model.ddpm", "trained_betas": "model.ddpm",
                     "clip_sample": "sample.ddpm.clip_denoised"},
            "flow": {"num_train_timesteps": "the run", "shift": "sample.flow.shift"}}


PIPELINE = "pipeline"  # model.pretrained's own scheduler: scheduler/scheduler_config.json's class and keys


def _supported() -> str:
    return f"{', '.join(DDPM_FAMILY)} (model.objective ddpm); {', '.join(FLOW_FAMILY)} (flow)"


def problems(name, kwargs, kind: str, eta: float = 0.0, interval=None, pretrained: bool = True) -> list[tuple[str, str]]:
    """(key, message) pairs for sample.scheduler against the objective `kind`; pure Python (the config's checks).
    `pretrained`: the run has model.pretrained (sample.scheduler: pipeline needs it)."""
    if name is None:
        return [("sample.scheduler_kwargs", "applies with sample.scheduler only; set a scheduler or remove it")] \
            if kwargs else []
    key = f"sample.scheduler={name}"
    if name == PIPELINE and not pretrained:
        return [(key, "the scheduler of model.pretrained's folder, and this run has none; name a scheduler class "
                 f"({_supported()}) or set model.pretrained")]
    if name == PIPELINE:
        pass  # its class is the folder's, which fits the objective the folder gave (pretrained.parts.objective)
    elif name not in DDPM_FAMILY + FLOW_FAMILY:
        return [(key, f"not a scheduler diffrelay samples with; use one of {_supported()}")]
    if kind not in FAMILY:
        return [(key, f"model.objective {kind} has no diffusers scheduler here; use sample.solver (heun or euler), "
                 "or remove sample.scheduler")]
    if name != PIPELINE and name not in FAMILY[kind]:
        return [(key, f"does not fit model.objective {kind}'s network; use one of {', '.join(FAMILY[kind])}")]
    for k in kwargs or {}:
        if k in RUN_KEYS[kind]:
            return [(f"sample.scheduler_kwargs.{k}", f"is set from {RUN_KEYS[kind][k]}, so the scheduler samples "
                     "what the network was trained on; remove it")]
    if interval is not None:
        return [("sample.guidance_interval", "not with sample.scheduler (the pipelines guide at every step); set "
                 "it to null or drop sample.scheduler")]
    if eta and name not in ("DDIMScheduler", PIPELINE):
        return [(f"sample.ddpm.eta={eta}", f"DDIM's eta, which {name}.step does not take; remove it or use "
                 "DDIMScheduler")]
    return []


def check(s, kind: str, source) -> None:
    """problems() as one UserError naming `source` (a hand-run's snapshot), before any folder."""
    from diffrelay.errors import UserError

    bad = problems(s.scheduler, s.scheduler_kwargs, kind, s.ddpm.eta if kind == "ddpm" else 0.0,
                   s.guidance_interval if s.guidance != 1 else None)
    if bad:
        raise UserError(f"{bad[0][0]} (--scheduler): {source}: {bad[0][1]}")


def run_config(kind: str, model_cfg: dict, s) -> dict:
    """The scheduler config keys the run decides (RUN_KEYS)."""
    if kind == "flow":
        return {"num_train_timesteps": T, "shift": s.flow.shift}
    from diffrelay.objectives.ddpm_options import Options

    o = Options.of(model_cfg.get("ddpm"))
    return {"num_train_timesteps": T, "beta_schedule": o.beta_schedule, "beta_start": o.beta_start,
            "beta_end": o.beta_end, "prediction_type": o.prediction_type,
            "rescale_betas_zero_snr": o.rescale_betas_zero_snr, "clip_sample": s.ddpm.clip_denoised}


def build(s, model_cfg: dict, source):
    """The scheduler of sample.scheduler for a network of `model_cfg`, checked by drawing its whole schedule on
    one number (an option it lacks, a prediction type it does not implement: one line, before any folder)."""
    import diffusers
    import torch

    from diffrelay.errors import UserError
    from diffrelay.objectives import objective

    kind = objective(model_cfg)
    check(s, kind, source)
    if s.scheduler == PIPELINE:
        name, config = pipeline_scheduler(model_cfg, kind, source)
    else:  # another class over a pipeline's folder: its keys too, as Class.from_config(pipe.scheduler.config)
        name, config = s.scheduler, folder_keys(model_cfg)
    cls = getattr(diffusers, name)
    params = inspect.signature(cls.__init__).parameters
    # The folder's keys the class takes (a Hub config may carry keys of other classes, which diffusers'
    # from_config ignores too), then the run's schedule, then the user's; a key of the user's that the class
    # lacks is an error below.
    run = run_config(kind, model_cfg, s)
    if s.scheduler == PIPELINE and kind == "flow" and s.flow.shift == 1.0:
        run["shift"] = config.get("shift", 1.0)  # sample.flow.shift left at its default: the folder's (as expand)
    config = {k: v for k, v in config.items() if k in params and k not in RUN_KEYS[kind]}
    for k, v in run.items():
        if k in params:
            config[k] = v
        elif v:  # a schedule or clipping the class cannot make (False/0 is every class's behaviour)
            has = [n for n in FAMILY[kind] if k in inspect.signature(getattr(diffusers, n).__init__).parameters]
            raise UserError(f"sample.scheduler={name}: {source}: has no {k} ({RUN_KEYS[kind][k]}={v}); use "
                            f"one of {', '.join(has)}")
    where = f"sample.scheduler={name}, sample.scheduler_kwargs={json.dumps(s.scheduler_kwargs or {})}"
    try:
        scheduler = cls(**{**config, **(s.scheduler_kwargs or {})})
        probe = cls.from_config(scheduler.config)
        x = torch.zeros(1, 1, 1, 1)
        probe.set_timesteps(**timestep_args(probe, s.steps, (2, 2), families.of_config(model_cfg)))
        # its own generator: the probe leaves torch's global random state as it found it
        extra = {"generator": torch.Generator().manual_seed(0)} if "generator" in inspect.signature(
            probe.step).parameters else {}
        for t in probe.timesteps:
            x = probe.step(torch.zeros_like(x), t, _scaled(probe, x, t), return_dict=False, **extra)[0]
    except (TypeError, ValueError, NotImplementedError, KeyError, IndexError) as e:
        raise UserError(f"{where}: {source}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}; "
                        f"see {name}'s config keys in diffusers' documentation") from e
    return scheduler


def folder_keys(model_cfg: dict) -> dict:
    """model.pretrained's scheduler_config.json keys ({} without a pipeline): what diffusers users pass another
    class with `Class.from_config(pipe.scheduler.config)` (timestep_spacing, steps_offset, ...)."""
    from diffrelay.pretrained import folder

    spec = (model_cfg or {}).get("pretrained")
    if spec is None:
        return {}
    c = folder.config(folder.read(spec), "scheduler", "scheduler_config.json")
    return {k: v for k, v in c.items() if not k.startswith("_")}


def pipeline_scheduler(model_cfg: dict, kind: str, source) -> tuple[str, dict]:
    """(class name, config keys) of model.pretrained's scheduler/scheduler_config.json (sample.scheduler: pipeline):
    what the pipeline samples with when called, the run's own schedule keys then set over it by build."""
    from diffrelay.errors import UserError
    from diffrelay.pretrained import folder

    spec = (model_cfg or {}).get("pretrained")
    if spec is None:
        raise UserError(f"sample.scheduler={PIPELINE}: {source}: was not trained from model.pretrained, so there is "
                        f"no pipeline scheduler; name a scheduler class ({_supported()})")
    pipe = folder.read(spec)
    c = folder.config(pipe, "scheduler", "scheduler_config.json")
    name = c.get("_class_name")
    if name not in FAMILY[kind]:
        raise UserError(f"{pipe.root / 'scheduler' / 'scheduler_config.json'}: _class_name {name} does not sample "
                        f"model.objective {kind}; set sample.scheduler to one of {', '.join(FAMILY[kind])}")
    return name, folder_keys(model_cfg)


def record(scheduler) -> dict:
    """The sample folder's key: the class and its whole config (diffusers' defaults included), as JSON reads it
    back."""
    # a non-finite float (DPMSolverMultistep's lambda_min_clipped -inf) as text: manifest.json stays strict JSON
    config = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
              for k, v in scheduler.config.items() if not k.startswith("_")}
    return json.loads(json.dumps({"class": type(scheduler).__name__, "config": config}))


def timestep_args(scheduler, steps: int, side: tuple, family=None) -> dict:
    """set_timesteps' arguments for `steps` steps of latents of `side` (H, W): the family's pipeline sigmas and its
    dynamic shift's mu (FLUX.1's; docstring); `family` None for a network of no family."""
    import numpy as np

    from diffrelay.pretrained.parts import DYNAMIC_SHIFT

    c, takes = scheduler.config, inspect.signature(scheduler.set_timesteps).parameters
    args = {"num_inference_steps": steps}
    if family and family.pipeline_sigmas and not c.get("use_flow_sigmas", False) and "sigmas" in takes:
        args = {"sigmas": np.linspace(1.0, 1 / steps, steps)}  # retrieve_timesteps passes the sigmas alone
    if c.get("use_dynamic_shifting", False) and "mu" in takes:
        k = {key: c.get(key) if c.get(key) is not None else default for key, default in DYNAMIC_SHIFT.items()}
        tokens = family.tokens(side) if family else side[0] * side[1]
        slope = (k["max_shift"] - k["base_shift"]) / (k["max_image_seq_len"] - k["base_image_seq_len"])
        args["mu"] = tokens * slope + (k["base_shift"] - slope * k["base_image_seq_len"])
    return args


def _scaled(scheduler, x, t):
    # FlowMatch* have no scale_model_input; the pipelines call it where it exists.
    return scheduler.scale_model_input(x, t) if hasattr(scheduler, "scale_model_input") else x


def sample(net, latents, labels, num_steps: int, scheduler, generators: list, eta: float = 0.0, family=None):
    """From latents ~ N(0, 1) (one row per image, drawn from generators[k]) to images, with a fresh copy of
    `scheduler` (its multistep history is per batch). net(x, time, labels) is the objective's network, guided;
    time is the scheduler's timestep (ddpm: 0..999) or timestep / 1000 (flow's t). family: the network's (its
    pipeline's timesteps, timestep_args), or None."""
    import torch

    sched = type(scheduler).from_config(scheduler.config)
    dev, c = latents.device, latents.shape[1]
    sched.set_timesteps(device=dev, **timestep_args(sched, num_steps, tuple(latents.shape[-2:]), family))
    params = inspect.signature(sched.step).parameters
    extra = {"generator": generators} if "generator" in params else {}
    if "eta" in params:  # DDIM's, as the pipelines' prepare_extra_step_kwargs pass it
        extra["eta"] = eta
    flow = type(scheduler).__name__ in FLOW_FAMILY
    # A learned-sigma network's variance half is used by DDPMScheduler's variance_type learned(_range) only;
    # the others get the noise half, as diffusers' DiTPipeline gives them.
    learned = getattr(sched.config, "variance_type", None) in ("learned", "learned_range")
    # prepare_latents' scaling; FlowMatch* have none (SD3's pipeline does not scale)
    x = latents.float() * getattr(sched, "init_noise_sigma", 1.0)
    with torch.no_grad():
        for t in sched.timesteps:
            time = t.to(dev).expand(x.shape[0])
            out = net(_scaled(sched, x, t), time / sched.config.num_train_timesteps if flow else time, labels)
            out = out if learned or out.shape[1] == c else out[:, :c]
            x = sched.step(out, t, x, return_dict=False, **extra)[0]
    return x
