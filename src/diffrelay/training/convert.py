"""`diffrelay import`: a published checkpoint (a plain state dict) into a diffrelay snapshot with a verified record.

  diffrelay import --config run.yaml --checkpoint model.pt --out imported/model.safetensors

The run config names the network (model.arch and model.kwargs) exactly as for training; the file only supplies
weights, so it never chooses which code runs. Accepted files:
  - .safetensors;
  - torch.save zip archives read with torch.load(weights_only=True): a state dict, or a training checkpoint
    whose "ema" (DiT's and SiT's train.py) or "model" entry is one.
Pickles (EDM's and edm2's network-snapshot-*.pkl) are refused before a byte is unpickled: unpickling runs
whatever code the file names. Names are mapped from the official layout (--layout; by default the one of
model.arch: DiT's for dit) and checked against the network the config builds: missing or unexpected keys, a
tensor of another size and a class table for another class count each get one line naming a few keys.

The snapshot holds the weights as its EMA (`ema.`), the weights published checkpoints carry, and records the
source file's name and sha256. A run with sample.snapshot set to it samples and scores it with the full
protocol and trains nothing (workflow: plan_evaluation.smk).
"""

import json
import zipfile
from pathlib import Path

import torch

from diffrelay import config, io, nets
from diffrelay.config import preflight
from diffrelay.data import encoders
from diffrelay.errors import UserError
from diffrelay.nets import dit, edm, edm2, registry
from diffrelay.training import checkpoint

LAYOUTS = {"diffrelay": lambda state: state, "dit": dit.official_keys, "edm": edm.official_keys,
           "edm2": edm2.official_keys}
# model.arch -> the layout its official code saves (EDM's and edm2's releases are pickles, refused; a state
# dict saved from their networks has these names).
DEFAULT_LAYOUT = {"dit": "dit", "sit": "dit", "ddpmpp": "edm", "ncsnpp": "edm", "adm": "edm", "edm2": "edm2"}  # model.arch -> the layout its published checkpoints use
MAX_BYTES = 1 << 40


def _few(keys, n: int = 3) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def read_state(path: Path) -> dict:
    """The tensors of a safetensors file or of a torch zip archive (weights_only); a pickle is refused unread."""
    if io.check_regular_file(path, MAX_BYTES, "checkpoint", "give the path of the checkpoint file") == 0:
        raise UserError(f"{path}: the file is empty (0 bytes); download or save it again")
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # safetensors: an 8-byte header length, then a JSON header
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{path}: unreadable safetensors file ({type(e).__name__}); it is truncated or "
                            "corrupt; download it again") from e
    if head[:2] == b"PK" and not zipfile.is_zipfile(path):  # a zip's directory is at its end: cut off
        raise UserError(f"{path}: a torch zip archive without its end (truncated or corrupt); download or save it "
                        "again")
    if not zipfile.is_zipfile(path):
        # A pickle starts with PROTO (0x80, then its protocol 2..5); anything else is only named unreadable.
        if not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
            raise UserError(f"{path}: neither a torch zip archive (.pt) nor a safetensors file (it starts with "
                            f"{head[:8]!r}): truncated, damaged or of another format; download or save it again")
        raise UserError(f"{path}: a Python pickle, not a tensor archive (EDM's and edm2's network-snapshot-*.pkl "
                        "are pickles); unpickling runs code the file names, so diffrelay never loads one; save its "
                        "state dict with torch.save or safetensors where you trust the file, and import that")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 -- the unpickler's refusals come as several types; each is one line
        reason = " ".join(str(e).split())[:160]
        raise UserError(f"{path}: holds Python objects besides tensors, which weights_only loading refuses "
                        f"({type(e).__name__}: {reason}); save only its state dict (torch.save(model.state_dict())) "
                        "and import that") from e
    return _state_dict(path, obj)


def _state_dict(path: Path, obj) -> dict:
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    for entry in ("ema", "model", "state_dict"):  # training checkpoints: the EMA first, what papers sample
        if isinstance(obj, dict) and isinstance(obj.get(entry), dict):
            return _state_dict(path, obj[entry])
    keys = list(obj)[:5] if isinstance(obj, dict) else type(obj).__name__
    raise UserError(f"{path}: not a state dict (found {keys}); give a file of parameter names and tensors")


def _shapes(model_cfg: dict, resolution: int, in_channels: int, classes: int) -> dict:
    arch, kwargs = nets.arch_kwargs(model_cfg)
    net = registry.build_network(arch, kwargs, resolution, in_channels, classes, device="meta")
    return {k: tuple(v.shape) for k, v in net.state_dict().items()}


def check_state(path, state: dict, model_cfg: dict, resolution: int, in_channels: int, classes: int) -> None:
    """One line for the first way `state` does not fit the configured network: keys, class count, size."""
    want = _shapes(model_cfg, resolution, in_channels, classes)
    missing, extra = set(want) - set(state), set(state) - set(want)
    if missing or extra:
        parts = ([f"{len(missing)} missing ({_few(missing)})"] if missing else []) + \
                ([f"{len(extra)} unexpected ({_few(extra)})"] if extra else [])
        raise UserError(f"{path}: its names do not fit model.arch={model_cfg.get('arch')}: {'; '.join(parts)}; "
                        "check model.arch, model.class_conditional and --layout")
    # The tensors whose shape follows the class count: those that change when the network gets one class more.
    # Sizes are checked first: a wider network's class table differs too, and its width is the news.
    by_class = {k for k, s in _shapes(model_cfg, resolution, in_channels, classes + 1).items()
                if k in want and s != want[k]}  # an unconditional network gains a class table: not in want
    for key in sorted(want, key=lambda k: (k in by_class, k)):
        got = tuple(state[key].shape)
        if got == want[key]:
            continue
        if key in by_class:
            raise UserError(f"{path}: {key} is {list(got)}, made for another class count: the dataset has {classes} "
                            f"classes, which need {list(want[key])}; use the dataset the checkpoint was trained on")
        if _is_latent(state, model_cfg, resolution, classes):
            raise UserError(f"{path}: a latent model (4 input channels: DiT's and SiT's released checkpoints are); "
                            "set data.encoder: sd-vae (the VAE it was trained with) and data.resolution to its "
                            "image size (256 for DiT-XL/2-256)")
        raise UserError(f"{path}: {key} is {list(got)}, the network of model.kwargs="
                        f"{json.dumps(nets.arch_kwargs(model_cfg)[1])} has {list(want[key])}: a checkpoint of "
                        "another size; set model.kwargs to the checkpoint's (size, patch, out_channels, ...)")


def _is_latent(state: dict, model_cfg: dict, resolution: int, classes: int) -> bool:
    """The state fits the configured network made for 4 input channels (SD-VAE latents)."""
    kwargs = dict(model_cfg.get("kwargs") or {})
    if kwargs.get("out_channels") in (3, 6):  # DiT's layouts for 3 channels: the same layout for 4
        kwargs["out_channels"] = kwargs["out_channels"] // 3 * 4
    try:
        shapes = _shapes(model_cfg | {"kwargs": kwargs}, resolution, 4, classes)
    except UserError:
        return False
    return all(k in state and tuple(state[k].shape) == v for k, v in shapes.items())


def convert(cfg, source: Path, out: Path, layout: str | None = None, step: int = 0) -> dict:
    """Check and write; returns the snapshot's meta."""
    top = config.load_schema()["properties"]["train"]["properties"]["total_steps"]["maximum"]
    if step > top:  # the workflow names steps with 7 digits; the config refuses such a run too
        raise UserError(f"--step {step}: past the last step a run can have; give at most {top} "
                        "(train.total_steps's maximum)")
    m, d = cfg.to_dict()["model"], cfg.to_dict()["data"]
    layout = layout or DEFAULT_LAYOUT.get(m["arch"], "diffrelay")
    if layout not in LAYOUTS:
        raise UserError(f"--layout {layout}: choose one of {', '.join(LAYOUTS)}")
    scale = m["kwargs"].get("time_scale", 1000)
    if layout == "dit" and m["arch"] == "dit" and scale != 1:
        # Refused, not defaulted: the config is the run's identity, and a quiet time_scale 1 here would give the
        # snapshot another network than the config names. DiT's code embeds its time input as it is.
        raise UserError(f"model.kwargs.time_scale={scale}: DiT's code embeds the time input as it is, so {source} "
                        f"would compute another function under model.objective {m['objective']}; set "
                        "model.kwargs.time_scale: 1")
    io.check_file_target(out, lambda p: _is_import(p), "a snapshot written by diffrelay import",
                         "choose another --out; nothing was overwritten")
    classes = preflight.num_classes(cfg) if m["class_conditional"] else 0
    state = LAYOUTS[layout](read_state(source))
    channels, side = preflight.net_geometry(cfg)  # the images, or their latents (data.encoder)
    check_state(source, state, m, side, channels, classes)
    meta = {"step": step, "trajectory": config.trajectory_hash(cfg), "config": cfg.to_dict(), "model": m,
            "image_shape": [channels, side, side], "num_classes": classes, "class_names": [],
            "imported": {"file": source.name, "sha256": io.sha256_file(source), "layout": layout}}
    latent = encoders.resolve(cfg.data, cfg.run.resources)  # the decoder its samples need, found and hashed
    if latent:
        meta["latent"] = latent | {"image_shape": [3, d["resolution"], d["resolution"]]}
    if m["arch"] in ("dit", "sit"):
        meta["dit_layout"] = nets.DIT_LAYOUT
    # The objective wraps the network as `net` (edm.Denoiser, flow.VelocityModel): snapshots hold its names.
    checkpoint.save_snapshot(out, {f"net.{k}": v.contiguous() for k, v in state.items()}, {}, meta)
    checkpoint.load_snapshot(out, model_cfg=m)  # the file loads into the network it records, strictly
    return meta


def _is_import(path) -> bool:
    try:
        return "imported" in checkpoint.read_signed_meta(path, checkpoint.SNAPSHOT_FORMAT, "snapshot")
    except UserError:
        return False


def main(args) -> int:
    cfg = config.load(args.config)
    try:
        meta = convert(cfg, Path(args.checkpoint), Path(args.out), args.layout, args.step)
    except UserError as e:
        raise UserError(f"{', '.join(args.config)}: {e}") from e
    print(f"diffrelay: {args.out}: {meta['model']['arch']} weights of {args.checkpoint} (sha256 "
          f"{meta['imported']['sha256'][:12]}), {meta['num_classes']} classes; sample and score it with "
          f"sample.snapshot: {args.out}")
    return 0
