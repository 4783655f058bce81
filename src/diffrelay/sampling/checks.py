"""Checks of the `sample` section against the rest of the config, at parse time (no torch: the Snakefile
runs them). config.validate reports the first; each names the key and the fix.
"""

import json

from diffrelay import families

# MAX_GUIDANCE: the largest guidance scale, for the config, --guidance and prompt files (data/prompts.py holds it):
# far beyond any useful one (the papers use 1-10, SD 7.5). Larger ones overflow float32 in the sampler: 1e39 is
# not a float32 at all, 1e30 turns every image to NaN.
from diffrelay.data.prompts import MAX_GUIDANCE
from diffrelay.sampling.schedulers import problems


def check_config(d: dict, edm_defaults: dict, flow_defaults: dict, ddpm_defaults: dict) -> list[tuple[str, str]]:
    """(key, message) pairs for sample settings that cannot work with the model and training chosen;
    *_defaults: the schema's sample.edm (EDM's deterministic sampler), sample.flow and sample.ddpm defaults."""
    bad, s, m, t = [], d["sample"], d["model"], d["train"]
    scales = s["guidance"] if isinstance(s["guidance"], list) else [s["guidance"]]
    guided = [g for g in scales if g != 1]
    if max(scales) > MAX_GUIDANCE:
        bad.append((f"sample.guidance={max(scales)}", f"must be at most {MAX_GUIDANCE:g}: far larger scales "
                    "overflow float32 in the sampler (useful ones are 1 to 10); use a smaller scale"))
    if s.get("guide") is not None:
        guided = []  # autoguidance: the guide network replaces the null class, no label dropout needed
    text = d["data"].get("captions", "none") != "none"
    # A pretrained pipeline's network learnt its unconditional model in pretraining (SD and SDXL dropped captions
    # then); fine-tuning it without dropout keeps it, and diffusers' fine-tuning scripts validate with guidance.
    if guided and text and not d["data"]["caption_dropout"] and m.get("pretrained") is None:
        bad.append((f"sample.guidance={guided[0]}", "the network is trained without caption dropout, so it has no "
                    "unconditional model to guide with; set data.caption_dropout (e.g. 0.1) or sample.guidance: 1"))
    elif text:
        pass  # a text run guides with the empty caption's embedding (caption dropout), not the null class
    elif guided and not m["class_conditional"]:
        bad.append((f"sample.guidance={guided[0]}", "guidance needs a class-conditional network; "
                    "set model.class_conditional: true or sample.guidance: 1"))
    elif guided and not t["label_dropout"]:
        bad.append((f"sample.guidance={guided[0]}", "the network is trained without label dropout, so it has "
                    "no unconditional model to guide with; set train.label_dropout (e.g. 0.1) or sample.guidance: 1"))
    family = families.of_config(m)
    if s.get("true_cfg_scale", 1) != 1 and not (family and family.true_cfg):
        bad.append((f"sample.true_cfg_scale={s['true_cfg_scale']}", f"{families.true_cfg_owner()}; "
                    "use sample.guidance here, and set it to 1"))
    e, kind = s["edm"], m["objective"]
    flow, ddpm = kind == "flow", kind == "ddpm"
    if kind != "edm" and e != edm_defaults:
        bad.append(("sample.edm", f"EDM's sampler settings do not apply to model.objective: {kind}; remove them "
                    f"(the {kind} samplers take sample.{kind})"))
    if not flow and s["solver"] == "sde":
        bad.append(("sample.solver=sde", "a flow sampler (model.objective: flow); EDM's stochastic sampler is "
                    "heun with sample.edm.S_churn > 0"))
    # sample.scheduler replaces sample.solver (sampling/schedulers.py; pure Python, no diffusers here)
    bad += problems(s.get("scheduler"), s.get("scheduler_kwargs"), kind, s["ddpm"]["eta"] if ddpm else 0.0,
                    s["guidance_interval"] if max(scales) != 1 or min(scales) != 1 else None,
                    m.get("pretrained") is not None)
    chain = s.get("scheduler") is None  # the objective's own sampler: its solver must fit
    if chain and ddpm and s["solver"] not in ("ddpm", "ddim"):
        bad.append((f"sample.solver={s['solver']}", "model.objective: ddpm samples with its own chain; set "
                    "sample.solver: ddpm (DiT's sampler, with sample.steps: 250) or ddim, or sample.scheduler (a "
                    "diffusers class; pipeline: a model.pretrained folder's own)"))
    if chain and not ddpm and s["solver"] in ("ddpm", "ddim"):
        bad.append((f"sample.solver={s['solver']}", f"a sampler of model.objective: ddpm; for {kind} use heun or "
                    f"euler{' or sde' if flow else ''}"))
    if ddpm and s["steps"] > 1000:
        bad.append((f"sample.steps={s['steps']}", "model.objective ddpm has 1000 timesteps; use at most 1000 "
                    "(DiT samples with 250)"))
    if not ddpm and s["ddpm"] != ddpm_defaults:
        bad.append(("sample.ddpm", f"the ddpm samplers' settings do not apply to model.objective: {kind}; remove them"))
    if not flow and s["flow"] != flow_defaults:
        bad.append(("sample.flow", f"flow's sampler settings do not apply to model.objective: {kind}; remove them"))
    # The image channels the sampler sees: 3 for pixels, 4 for the SD-VAE's latents (your own encoder: at sampling).
    wide = s["ddpm"]["guided_channels"] if ddpm else s["flow"]["guided_channels"] if flow else None
    have = {"none": 3}.get(d["data"]["encoder"], None if ":" in d["data"]["encoder"] else 4)
    if wide and have and wide > have:
        bad.append((f"sample.{kind}.guided_channels={wide}", f"the network sees {have} channels; use at most {have} "
                    "(or null for all)"))
    if chain and ddpm and s["solver"] == "ddpm" and s["ddpm"]["eta"]:
        bad.append((f"sample.ddpm.eta={s['ddpm']['eta']}", "eta is DDIM's; set sample.solver: ddim or remove it"))
    if e["sigma_min"] >= e["sigma_max"]:
        bad.append((f"sample.edm.sigma_min={e['sigma_min']}", f"must be below sample.edm.sigma_max={e['sigma_max']}"))
    if e["S_max"] is not None and e["S_min"] >= e["S_max"]:
        bad.append((f"sample.edm.S_min={e['S_min']}", f"must be below sample.edm.S_max={e['S_max']} (or S_max: null)"))
    gi = s["guidance_interval"]
    lo, hi, unit = (0.0, 1.0, "t of model.objective flow") if flow else \
        (0.01, 157.5, "the sigma of ddpm's timesteps 0..999") if ddpm else \
        (e["sigma_min"], e["sigma_max"], "sample.edm.sigma_min/max")
    if gi is not None and (gi[0] >= gi[1] or gi[1] < lo or gi[0] > hi):
        bad.append((f"sample.guidance_interval={gi}", f"needs lo < hi and to meet the schedule [{lo}, {hi}] "
                    f"({unit}); e.g. {'[0, 0.7]' if flow else '[0.28, 2.9]'}, or null for every step"))
    want = s.get("ema_decay")
    have = [float(x) for x in t["ema_decays"]]
    for x in want if isinstance(want, list) else [] if want is None else [want]:
        if s["weights"] == "raw":
            bad.append((f"sample.ema_decay={x}", "sample.weights is raw, which has no EMA; remove sample.ema_decay "
                        "or set sample.weights: ema"))
        elif float(f"{float(x):g}") != float(x):
            bad.append((f"sample.ema_decay={x}", "more than 6 significant digits, which an evaluation's name "
                        "(_decay<d>) cannot tell apart; use a decay of at most 6 digits, e.g. 0.9999"))
        elif float(x) not in have:
            bad.append((f"sample.ema_decay={x}", f"not one of train.ema_decays={have}; choose one of them (a decay "
                        "the run did not train has no weights)"))
    g = s.get("guide")
    if isinstance(g, int) and not isinstance(g, bool) and g > t["total_steps"]:
        bad.append((f"sample.guide={g}", f"a step past train.total_steps={t['total_steps']}; name a step this run "
                    "writes a snapshot at, or a snapshot file"))
    cl = s["class_labels"]
    if isinstance(cl, str) and cl != "balanced":
        bad.append((f"sample.class_labels={json.dumps(cl)}", "use balanced or a class index"))
    if isinstance(cl, int) and cl < 0:
        bad.append((f"sample.class_labels={cl}", "a class index must be 0 or more"))
    return bad
