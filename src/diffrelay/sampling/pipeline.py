"""Sampling a diffusers pipeline folder with no run at all: `diffrelay sample --snapshot <pipeline folder>`.

The folder is read as `model.pretrained` reads it for a run (pretrained/: network, scheduler, VAE, text encoders,
checked and hashed), and the network gets the folder's weights as step 0 of a run would: what is sampled is the
pipeline as it came, with the same sampler, prompts files and seeds as any snapshot, so its folder compares with a
fine-tune's checkpoints (issue 58's "did my fine-tune beat the base model?", before any run exists). The weights
are the folder's own (no EMA); the sample folder's key names the folder's files' sha256 digest instead of a
snapshot's.

Imports torch, diffusers and transformers when used.
"""

from pathlib import Path

from diffrelay.errors import UserError

INDEX = "model_index.json"


def is_pipeline(path) -> bool:
    """A folder written by DiffusionPipeline.save_pretrained (its model_index.json), not a snapshot file."""
    return Path(path).is_dir() and (Path(path) / INDEX).is_file()


def load(folder, cfg: dict, device):
    """(net, meta, digest) of a pipeline folder under `cfg` (config.pipeline_config: its model, data and run): the network with the folder's weights,
    in eval mode, and the record a snapshot would carry (image shape, latent encoder, text encoders)."""
    from types import SimpleNamespace

    from diffrelay import objectives
    from diffrelay.data import encoders
    from diffrelay.pretrained import folder as pipe_folder
    from diffrelay.pretrained import weights
    from diffrelay.text import encoders as text_encoders
    from diffrelay.text import source

    res = cfg["data"]["resolution"]
    latent = encoders.resolve(SimpleNamespace(**cfg["data"]), cfg["run"]["resources"], fetch_missing=False)
    if res % latent["factor"]:
        raise UserError(f"--resolution {res}: not a multiple of the VAE's factor {latent['factor']}; use a multiple of "
                        f"{latent['factor']}")
    entries = [dict(e) for e in cfg["data"]["text_encoders"]]
    records = text_encoders.records(entries)
    text = source.TextSource([dict(r) | {"entry": e} for r, e in zip(records, entries)],
                             text_encoders.combined_dims(records))
    shape = [latent["channels"], res // latent["factor"], res // latent["factor"]]
    net = objectives.build(cfg["model"], resolution=shape[1], num_classes=0, in_channels=shape[0], text=text.dims)
    weights.load_initial(net, cfg["model"]["pretrained"])
    meta = {"step": 0, "config": cfg, "model": cfg["model"], "image_shape": shape, "num_classes": 0,
            "class_names": [], "latent": latent | {"image_shape": [3, res, res]}, "text": source.record(text)}
    digest = pipe_folder.digest(pipe_folder.manifest(pipe_folder.read(cfg["model"]["pretrained"])))
    return net.to(device).eval().requires_grad_(False), meta, digest


def open_any(snapshot, s, device, model_cfg, data_cfg, resources):
    """(net, meta, the sample key's snapshot_sha256, settings) of what `diffrelay sample` was given: a snapshot
    (verified by its own sha256), or a pipeline folder (its own weights, raw, named by its files' digest)."""
    import dataclasses

    from diffrelay import io
    from diffrelay.training import checkpoint

    what = _not_a_snapshot(snapshot)
    if what:
        raise UserError(f"{snapshot}: {what}; pass --snapshot a snapshot file (<run>/snapshots/step_XXXXXXX."
                        "safetensors) or a folder DiffusionPipeline.save_pretrained wrote (with its model_index.json)")
    if s.quantize_base is not None:  # sample.quantize_base: a LoRA snapshot's base, as training held it
        _check_quantize(snapshot, s.quantize_base, device)
    if is_pipeline(snapshot):
        net, meta, digest = load(snapshot, {"model": model_cfg, "data": data_cfg, "run": {"resources": resources}},
                                 device)
        return net, meta, digest, dataclasses.replace(s, weights="raw")
    net, meta = checkpoint.load_snapshot(snapshot, s.weights, device, model_cfg, s.ema_decay,
                                         quantize=(s.quantize_base, s.precision))
    return net, meta, io.sha256_file(snapshot), s


def _not_a_snapshot(path) -> str | None:
    """What an existing `path` is when it is neither a pipeline folder nor a regular file (a snapshot's own checks
    then name a file that is not one); None otherwise: "snapshot not found; train to that step first" said of an
    existing folder sent the user to train."""
    import stat

    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # not there: checkpoint.read_snapshot's line
    if stat.S_ISDIR(mode) and not is_pipeline(path):
        return f"a folder, and neither a diffusers pipeline folder (no {INDEX} in it) nor a snapshot file"
    if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
        return "not a regular file (a pipe, socket or device)"
    return None


def _check_quantize(snapshot, kind: str, device) -> None:
    """sample.quantize_base (or --quantize-base) needs a LoRA run's snapshot, its library and, for nf4, CUDA; one
    line before any weight is read. nf4 in eval mode on a CPU takes bitsandbytes' packed CPU kernel, which fails
    on a layer narrower than its 64-value block (training's CPU runs take the other path)."""
    from diffrelay.pretrained import lora
    from diffrelay.training import checkpoint

    meta = None if is_pipeline(snapshot) else checkpoint.read_signed_meta(snapshot, checkpoint.SNAPSHOT_FORMAT,
                                                                          "snapshot")
    if meta is None or not lora.enabled(meta.get("config")):
        raise UserError(f"{snapshot}: sample.quantize_base={kind} quantizes a LoRA run's frozen base, and this is "
                        f"{'a pipeline folder' if meta is None else 'no LoRA snapshot'}; set it to null (drop "
                        "--quantize-base)")
    for key, message in lora.quantize_problems({"quantize_base": kind}, {}, "sample.quantize_base"):
        raise UserError(f"{key}: {message}")
    if kind == "nf4" and str(device).split(":")[0] != "cuda":
        raise UserError(f"sample.quantize_base=nf4: bitsandbytes' 4-bit inference is sampled on CUDA here, and this "
                        f"process samples on {device}; use int8 or fp8 (torchao, the CPU too), or a GPU")
