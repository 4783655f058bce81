"""The config of sampling a diffusers pipeline folder with no run (`diffrelay sample --snapshot <folder>`,
sampling/pipeline.py): the folder's own, read as model.pretrained reads it, under the keys a run config gives.

Imports the base modules, the config schema and sampling.pipeline (which folder is a pipeline's).
"""

from diffrelay.config.schema import load, merged, validate
from diffrelay.errors import UserError


def sample_config(snapshot, files, resolution: int | None, prompts: str | None,
                  sample: dict | None = None) -> tuple[dict, bool]:
    """`diffrelay sample`'s config, and whether it names the network: --config's files for a snapshot (the
    defaults without them: a built-in network's snapshot samples alone); for a pipeline folder, its own config
    under those files' keys (pipeline_config). `sample`: the sample keys the flags set (sampling.settings.layered),
    over the files' before any rule reads them; without files there is no run's config to check them against."""
    from diffrelay.sampling import pipeline

    if pipeline.is_pipeline(snapshot):
        return pipeline_config(snapshot, merged(files) if files else None, resolution, prompts, sample), True
    if not files:
        return validate({}), False
    return (validate(_layer(merged(files), sample), ", ".join(map(str, files))) if sample else load(files).to_dict(),
            True)


def _layer(d: dict, sample: dict | None) -> dict:
    """`d` with `sample`'s keys over its sample section: each replaces the file's value (--scheduler-kwargs its whole
    object, --solver's {} the file's), but a flag of sample.edm, flow or ddpm keeps that section's other keys."""
    d = dict(d)
    d["sample"] = dict(d.get("sample") or {})
    for k, v in (sample or {}).items():
        keep = k in ("edm", "flow", "ddpm") and isinstance(d["sample"].get(k), dict)
        d["sample"][k] = {**d["sample"][k], **v} if keep else v
    return d


def pipeline_config(folder, layered: dict | None, resolution: int | None, prompts: str | None,
                    sample: dict | None = None) -> dict:
    """The validated config that samples `folder`: the run config given with --config (its model.pretrained set to
    the folder), else the folder's defaults; data.resolution from --resolution, else the config's; `sample`'s keys
    (the flags') over its sample section."""
    d = dict(layered or {})
    d["model"] = {**(d.get("model") or {}), "pretrained": str(folder)}
    d["data"] = {**(d.get("data") or {}), "captions": (d.get("data") or {}).get("captions") or "auto"}
    if d["data"]["captions"] == "none":
        d["data"]["captions"] = "auto"
    if resolution is not None:
        d["data"]["resolution"] = resolution
    elif layered is None:
        raise UserError(f"{folder}: a pipeline folder sampled without --config: give --resolution (the image side in "
                        "pixels, e.g. 1024 for SDXL or FLUX.1, 512 for SD 1.5)")
    if prompts or sample:
        d = _layer(d, ({"prompts": prompts} if prompts else {}) | (sample or {}))
    return validate(d, str(folder))
