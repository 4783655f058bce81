"""model.pretrained: a local diffusers pipeline folder, resolved here once into the config keys of its parts
(docs/pretrained.md). Config validation calls expand (torch-free, JSON and sha256 only); training's first step
loads the network's weights with weights.load_initial.

  network         model.arch and model.kwargs from unet/ or transformer/ config.json (parts.network)
  objective       model.objective and model.ddpm (or train.flow.shift) from scheduler/scheduler_config.json
  VAE             data.encoder sd-vae, data.encoder_path the vae/ folder (its config.json's scaling_factor)
  text encoders   data.text_encoders, each family's settings (parts.text_encoders); tokenizers from tokenizer*/
  LoRA            train.lora's defaults and checks (lora.check_config)
  sampler         sample.scheduler: pipeline (the folder's scheduler) unless sample.scheduler or sample.solver is set
  identity        model.pretrained.sha256: {file: sha256} of model_index.json and every file of those parts.
                  It is part of the trajectory (the folder's path is not), so a changed file is refused on
                  resume (preflight.check_run_folder names it) and every checkpoint and snapshot records it.

Keys a user sets beside model.pretrained: a key at its schema default counts as not given and takes the
pipeline's value; one that contradicts the pipeline is refused in one line, except the fine-tuning choices
(model.ddpm prediction_type, rescale_betas_zero_snr, snr_gamma and noise_offset; train.flow and sample.flow's
shift; model.kwargs use_mask and pixel_size; data.encoder_path, another VAE), which are the user's.

Imports the base modules, families, nets, objectives (ddpm_options) and text.
"""

import dataclasses
from pathlib import Path

from diffrelay import families
from diffrelay.errors import UserError

ENCODER_DEFAULTS = {"max_length": None, "layer": "last", "pooled": False, "use_mask": True}
# diffrelay's keys that a user may set beside the pipeline's config: the families' own_kwargs (time_scale is the
# objective's)
OWN_KWARGS = tuple(dict.fromkeys(k for f in families.FAMILIES for k in f.own_kwargs if k != "time_scale"))
DDPM_CHOICES = ("prediction_type", "rescale_betas_zero_snr", "snr_gamma", "noise_offset")
SOLVER_DEFAULT = "heun"  # sample.solver's schema default: left there, a pipeline run samples with its scheduler


def path_of(spec) -> str | None:
    return None if spec is None else spec["path"] if isinstance(spec, dict) else spec


def expand(d: dict) -> list[tuple[str, str]]:
    """Fill a schema-validated config (in place) from model.pretrained; (key, message) pairs of what is wrong,
    the first of which config.validate reports. Nothing to do without model.pretrained."""
    from diffrelay.pretrained import lora

    spec = d["model"].get("pretrained")
    if spec is None:
        return lora.check_config(d)  # train.lora needs a pipeline
    try:
        return _expand(d, spec) or lora.check_config(d)
    except UserError as e:
        return [(f"model.pretrained={path_of(spec)}", str(e))]


def _conflict(key: str, value, want, fix: str = "drop it") -> tuple[str, str]:
    return (f"{key}={value}", f"contradicts model.pretrained, whose pipeline gives {want}; {fix}")


def _expand(d: dict, spec) -> list[tuple[str, str]]:
    from diffrelay.objectives import ddpm_options
    from diffrelay.pretrained import folder, parts

    pipe = folder.read(spec)
    arch, kwargs = parts.network(pipe)
    kind, schedule = parts.objective(pipe)
    encoders = [ENCODER_DEFAULTS | e for e in parts.text_encoders(pipe)]
    vae = parts.vae(pipe)
    family = parts.family(pipe)
    parts.check_dims(pipe, encoders)
    m, data, bad = d["model"], d["data"], []
    if data["captions"] == "none":
        bad.append(("data.captions=none", "model.pretrained is a text-to-image pipeline: caption the dataset "
                    "(data.captions: auto, or a caption table)"))
    if m["arch"] not in ("unet", arch):
        bad.append(_conflict("model.arch", m["arch"], arch))
    kwargs["time_scale"] = family.time_scale(kind)  # ddpm's integer steps; flow's sigma x 1000 (the family says)
    if family.pixel_sizes:  # size conditioning in pixels (SDXL's time ids, PixArt's resolution, ...)
        kwargs["pixel_size"] = data["resolution"]
    for key, value in m["kwargs"].items():
        if key in OWN_KWARGS:
            kwargs[key] = value
        elif kwargs.get(key, ...) != value:
            bad.append(_conflict(f"model.kwargs.{key}", value, kwargs.get(key, "no such key"),
                                 f"drop it ({pipe.net}/config.json is the network's config)"))
    if m["objective"] not in ("edm", kind):
        bad.append(_conflict("model.objective", m["objective"], kind, "drop it (its scheduler says)"))
    # The pipeline decides: its network takes prompts, not classes (the base config's class_conditional: true
    # would otherwise refuse every pipeline layered over it).
    m.update(arch=arch, kwargs=kwargs, objective=kind, class_conditional=False)
    if kind == "ddpm":
        given = m.get("ddpm") or {}
        for key in ("beta_schedule", "beta_start", "beta_end"):
            value = given.get(key, getattr(ddpm_options.DEFAULT, key))
            if value not in (getattr(ddpm_options.DEFAULT, key), schedule[key]):
                bad.append(_conflict(f"model.ddpm.{key}", value, schedule[key], "drop it (the weights were trained "
                                     "on the scheduler's schedule)"))
        default = dataclasses.asdict(ddpm_options.DEFAULT)
        m["ddpm"] = default | schedule | {k: given[k] for k in DDPM_CHOICES if k in given and given[k] != default[k]}
    else:
        for section in (d["train"]["flow"], d["sample"].get("flow", {})):
            if section.get("shift", 1.0) == 1.0:
                section["shift"] = schedule["shift"]
    bad += family.expand(pipe, kwargs, d["sample"])  # the family's own keys (FLUX.1's guidance input)
    swap, blocks = d["train"].get("block_swap", 0), family.block_count(kwargs)
    if swap and family.swap_lists and blocks is not None and swap > blocks:
        bad.append((f"train.block_swap={swap}", f"{pipe.root / pipe.net}/config.json has {blocks} blocks "
                    f"({' + '.join(family.swap_lists)}); swap at most {blocks}"))
    if data["encoder"] not in ("none", "sd-vae", "sd-vae-ft-mse", "sd-vae-ft-ema"):
        bad.append(_conflict("data.encoder", data["encoder"], "sd-vae (its vae/)", "drop it, or give data.encoder_path "
                             "another AutoencoderKL folder"))
    if data["latent_norm"] != "dit":
        bad.append(_conflict("data.latent_norm", data["latent_norm"], "dit (latents x its scaling_factor)"))
    data["encoder"], data["encoder_path"] = "sd-vae", data["encoder_path"] or vae
    if data["text_encoders"] and data["text_encoders"] != encoders:
        bad.append(("data.text_encoders", f"contradicts model.pretrained, whose pipeline gives its own "
                    f"({', '.join(Path(e['path']).name for e in encoders)}); drop it"))
    data["text_encoders"] = encoders
    sample = d["sample"]
    if sample.get("scheduler") is None and sample["solver"] == SOLVER_DEFAULT and not sample.get("scheduler_kwargs") \
            and sample.get("guidance_interval") is None:  # the pipelines guide at every step
        sample["scheduler"] = "pipeline"  # validation images as the pipeline samples them (sampling/schedulers.py)
    if sample.get("scheduler") == "pipeline":
        bad += parts.pipeline_sampler_problems(pipe, m, sample)
    used = ([] if pipe.single else [pipe.net]) + (["vae"] if data["encoder_path"] == vae else []) + [
        Path(e["path"]).name for e in encoders]  # the parts this run loads from the folder
    why = next((w for w in (folder.weights_problem(pipe, name) for name in used) if w), None)
    if why:  # a variant-only part would fail only at the first step (the network) or in prepare (the VAE)
        bad.append((f"model.pretrained={path_of(spec)}", why))
    sums = folder.manifest(pipe)
    pinned = spec.get("sha256") if isinstance(spec, dict) else None
    if pinned and pinned != sums:
        name = next(k for k in sorted(set(sums) | set(pinned)) if sums.get(k) != pinned.get(k))
        bad.insert(0, ("model.pretrained.sha256", f"{pipe.root / name}: sha256 {str(sums.get(name))[:12]}..., but "
                       f"this config records {str(pinned.get(name))[:12]}...: the pipeline folder changed; restore "
                       "it, or start a new run.name (and drop model.pretrained.sha256)"))
    given = spec.get("config") if isinstance(spec, dict) else None
    m["pretrained"] = {"path": str(path_of(spec)), "config": given, "sha256": sums}
    return bad


@dataclasses.dataclass(frozen=True)
class PromptRules:
    """What the folder's pipeline's __call__ does to prompts before its text encoders, which sampling repeats.
    zeros: StableDiffusionXLPipeline's force_zeros_for_empty_prompt (model_index.json, default true): an image
    without a negative prompt is guided against zero states and pooled embedding, not the empty caption's.
    lower: PixArtAlphaPipeline's and PixArtSigmaPipeline's _text_preprocessing, prompt and negative prompt
    lower-cased and stripped (what it does with clean_caption off, or without bs4 and ftfy; diffrelay does not
    clean captions). Training captions are encoded as written, as PixArt's own train.py tokenizes them."""

    zeros: bool = False
    lower: bool = False

    def text(self, prompt: str) -> str:
        return prompt.lower().strip() if self.lower else prompt

    def key(self) -> dict:
        """The sample folder's keys: only those set, so folders made before them keep their key."""
        return {k: True for k, on in (("zeros_for_empty_prompt", self.zeros), ("lower_strip_prompts", self.lower))
                if on}


def prompt_rules(model: dict) -> PromptRules:
    """The PromptRules of a run's `model` section: none without model.pretrained."""
    from diffrelay import io
    from diffrelay.pretrained import folder, parts

    spec = (model or {}).get("pretrained")
    if spec is None:
        return PromptRules()
    pipe = folder.read(spec)
    family = parts.family(pipe)
    zeros = family.zeros_for_empty_prompt(io.read_json(pipe.root / "model_index.json"))
    return PromptRules(zeros=zeros, lower=family.lowercase_prompts)


def trajectory(model: dict) -> dict:
    """A `model` section with model.pretrained as it enters a run's identity: the files' sha256, not where the
    folder lies; absent without a pipeline, so runs from before it keep their hash."""
    out = dict(model)
    spec = out.pop("pretrained", None)
    if spec is not None:
        out["pretrained"] = {"sha256": spec.get("sha256")} if isinstance(spec, dict) else spec
    return out
