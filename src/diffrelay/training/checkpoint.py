"""Checkpoints (full training state, a folder) and snapshots (weights for sampling, one file).

A checkpoint folder is written under a temp name and renamed into place, and its manifest.json
(format version + sha256 of every file) is written last, so nothing incomplete ever looks complete.
A snapshot is one .safetensors file whose metadata carries the model config and a sha256 of its
own tensors and metadata, so it verifies itself and loads without a dataset or a process group.
"""

import hashlib
import json
import os
import re
from io import BytesIO
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from diffrelay import io, nets
from diffrelay import objectives
from diffrelay.errors import UserError
from diffrelay.pretrained import lora
from diffrelay.pretrained import weights as base_weights
from diffrelay.training import sharded_checkpoint

CHECKPOINT_FORMAT = "diffrelay-checkpoint/1"
SNAPSHOT_FORMAT = io.SNAPSHOT_FORMAT
STEP_DIR = re.compile(r"^step_(\d{7})\Z")
FILES = ("state.pt", "meta.json", "manifest.json")


def step_name(step: int) -> str:
    return f"step_{step:07d}"


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(path, state: dict, meta: dict) -> Path:
    """`state`: tensors and plain containers (loadable with weights_only=True); `meta`: JSON-able."""
    path = Path(path)
    buf = BytesIO()
    torch.save(state, buf)  # serialise in memory: torch's own file writer hides ENOSPC behind a RuntimeError
    with io.atomic_dir(path, owned=is_checkpoint_folder) as tmp:
        (tmp / "state.pt").write_bytes(buf.getbuffer())
        io.write_json(tmp / "meta.json", meta)
        files = {name: io.sha256_file(tmp / name) for name in ("state.pt", "meta.json")}
        io.write_json(tmp / "manifest.json", {"format": CHECKPOINT_FORMAT, "step": meta["step"], "files": files})
    sharded_checkpoint.remove_stale(path, is_checkpoint_folder)  # io.atomic_dir's of saves killed half-way
    return path


def is_checkpoint_folder(path) -> bool:
    """A folder holding only checkpoint files (complete or not; a sharded one's shards too): replacing it loses
    nothing of the user's."""
    return all(name in FILES or sharded_checkpoint.is_shard(name) for name in os.listdir(path))


def is_complete(path) -> bool:
    """Cheap check (no hashing): the manifest exists and names our format."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text()).get("format") == CHECKPOINT_FORMAT
    except (OSError, ValueError):
        return False


def verify_checkpoint(path) -> dict:
    """Recompute every file's sha256 against the manifest; return the manifest or raise UserError."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: checkpoint folder not found")
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise UserError(f"{path}: incomplete checkpoint (no manifest.json); delete it to resume from an earlier one")
    manifest = io.read_json(manifest_path)
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{manifest_path}: format={manifest.get('format')!r}; expected {CHECKPOINT_FORMAT}")
    if "sharding" in manifest:
        sharded_checkpoint.check_no_strays(path, manifest)
    for name, digest in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise UserError(f"{f}: missing from checkpoint; delete {path} to resume from an earlier one")
        if io.sha256_file(f) != digest:
            raise UserError(f"{f}: sha256 does not match manifest.json (corrupt or altered); "
                            f"delete {path} to resume from an earlier one")
    if "sharding" in manifest:  # each shard's own header: read as DCP will, and naming this run, step and save
        made = io.read_json(path / "meta.json")
        sharded_checkpoint.check_shards(path, manifest["files"], {
            "trajectory": made.get("trajectory"), "step": made.get("step"), "save": manifest["sharding"].get("save")},
            f"delete {path} to resume from an earlier one")
    return manifest


def load_checkpoint(path, map_location="cpu") -> tuple[dict, dict]:
    """Verify, then load (weights only: a pickle that would run code is refused)."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch raises UnpicklingError, RuntimeError, ...; all mean "refuse"
        raise UserError(f"{path / 'state.pt'}: refused by the weights-only loader ({type(e).__name__}); "
                        "checkpoints must hold tensors and plain containers only") from e
    return state, io.read_json(path / "meta.json")


def list_checkpoints(folder) -> list[tuple[int, Path]]:
    """Complete checkpoints in `folder`, sorted by step."""
    folder = Path(folder)
    found = []
    if folder.is_dir():
        for p in folder.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir() and is_complete(p):
                found.append((int(m.group(1)), p))
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# Snapshots


def _digest(tensors: dict, meta: dict) -> str:
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        # reshape(-1): a 0-d tensor (edm2's output gain) has no byte view; the bytes are the same for the rest.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_signed(path, tensors: dict, meta: dict) -> Path:
    """One .safetensors file carrying `meta` (with its "format") and a sha256 of tensors and meta, atomically."""
    # safetensors stores row-major bytes: channels_last weights (train.channels_last) are copied to that order.
    tensors = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    blob = save(tensors, metadata={"meta": json.dumps(meta, sort_keys=True), "sha256": _digest(tensors, meta)})
    io.write_bytes(path, blob)
    return Path(path)


def read_signed_meta(path, fmt: str, what: str, fix: str = "check the path") -> dict:
    """The meta of a write_signed file of format `fmt` (header only: cheap, not verified)."""
    meta = io.signed_header(path, what, fix)[1]
    if meta.get("format") != fmt:
        raise UserError(f"{path}: format={meta.get('format')!r}; expected {fmt}")
    return meta


def read_signed(path, fmt: str, what: str, fix: str) -> tuple[dict, dict]:
    """(tensors, meta) of a write_signed file of format `fmt` after checking its sha256; else a UserError
    naming the file, `what` it is and the `fix`."""
    stored, meta = io.signed_header(path, what, fix)
    if meta.get("format") != fmt:
        raise UserError(f"{path}: format={meta.get('format')!r}; expected {fmt}")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable {what} ({type(e).__name__}); it is truncated or not a "
                        f"diffrelay {what}; {fix}") from e
    if _digest(tensors, meta) != stored["sha256"]:
        raise UserError(f"{path}: sha256 of the weights does not match the file's record (corrupt or altered); {fix}")
    return tensors, meta


def ema_prefix(index: int) -> str:
    """Key prefix of the EMA of train.ema_decays[index]: `ema.` for the first (the one sampled by default, and
    the only one a snapshot held before every EMA was kept), `ema1.`, `ema2.`, ... for the others."""
    return "ema." if index == 0 else f"ema{index}."


def save_snapshot(path, ema_state: dict, raw_state: dict, meta: dict, more_emas: tuple = ()) -> Path:
    """meta: step, model (config dict), image_shape [C,H,W], num_classes, class_names, config, ...
    more_emas: the EMAs of the second, third, ... of train.ema_decays (none: a file as before they were kept).
    ema_state {}: a run that keeps no EMA (train.ema_decays: []), whose file holds the raw weights only (keeps_no_ema)."""
    tensors = {f"raw.{k}": v for k, v in raw_state.items()}
    for i, state in enumerate([ema_state, *more_emas]):
        tensors |= {f"{ema_prefix(i)}{k}": v for k, v in state.items()}
    return write_signed(path, tensors, {"format": SNAPSHOT_FORMAT, **meta})


def ema_decays(meta: dict) -> list[float]:
    """train.ema_decays of the run that wrote a snapshot ([] if its record does not say)."""
    return [float(d) for d in ((meta.get("config") or {}).get("train") or {}).get("ema_decays") or []]


def keeps_no_ema(meta: dict) -> bool:
    """Whether a snapshot's run kept no EMA (train.ema_decays: [] without train.ema_halflife_kimg, as diffusers' LoRA
    scripts train): its file holds the `raw.` weights only, and they are what `ema` (the default) samples and exports."""
    if "phema" in meta or "imported" in meta:  # files of one set of weights, their `ema.`
        return False
    train = (meta.get("config") or {}).get("train") or {}
    return train.get("ema_decays") == [] and train.get("ema_halflife_kimg") is None


def weights_of(meta: dict, weights: str) -> str:
    """The weights that `weights` (ema or raw) reads in a snapshot: raw for ema where its run kept no EMA."""
    return "raw" if weights == "ema" and keeps_no_ema(meta) else weights


def ema_index(path, meta: dict, decay: float | None) -> int:
    """Where train.ema_decays holds `decay` (None: the first), or one line naming the decays there are."""
    if decay is None:
        return 0
    if keeps_no_ema(meta):
        raise UserError(f"sample.ema_decay={decay:g} (--ema-decay): {path} was trained without an EMA "
                        "(train.ema_decays: []), so its raw weights are sampled; drop sample.ema_decay (--ema-decay)")
    if "phema" in meta:
        raise UserError(f"{path}: a post-hoc EMA reconstruction holds one EMA (sigma_rel "
                        f"{meta['phema'].get('sigma_rel')}); sample it without sample.ema_decay (--ema-decay)")
    decays = ema_decays(meta)
    halflife = ((meta.get("config") or {}).get("train") or {}).get("ema_halflife_kimg")
    if halflife is not None:
        raise UserError(f"sample.ema_decay={decay:g} (--ema-decay): {path} was trained with one EMA "
                        f"(train.ema_halflife_kimg={halflife}); sample it without sample.ema_decay (--ema-decay)")
    if float(decay) not in decays:
        raise UserError(f"sample.ema_decay={decay:g} (--ema-decay): {path} was trained with train.ema_decays="
                        f"{decays}; choose one of those")
    return decays.index(float(decay))


def read_snapshot(path) -> tuple[dict, dict]:
    """(tensors, meta) after checking the embedded sha256; UserError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: snapshot not found; train to that step first or check the path")
    return read_signed(path, SNAPSHOT_FORMAT, "snapshot", "re-create it from its checkpoint or rerun training")


def load_snapshot(path, weights: str = "ema", device="cpu", model_cfg: dict | None = None, decay: float | None = None,
                  quantize: tuple = (None,)):
    """(net, meta): the EDM denoiser with the chosen weights, in eval mode, gradients off. `decay` picks which of
    train.ema_decays's EMAs (None: the first) when weights is ema; a run that kept no EMA gives its raw weights.
    `quantize`: a LoRA run's frozen base quantized before its adapter is attached, as training holds it
    (sample.quantize_base: lora.quantize's kind and precision); (None,) = the pipeline's weights as they are.

    The network is the one `model_cfg` (the run config's `model` section) names; a snapshot recording
    another is refused. Without a config only a built-in arch is built from the snapshot's record, so
    a file never chooses which code is imported.
    """
    tensors, meta = read_snapshot(path)
    if weights not in ("ema", "raw"):
        raise UserError(f"weights={weights!r}: choose ema or raw")
    recorded, spec = meta["model"], lora.enabled(meta.get("config"))
    if spec:  # before the network's check: another base pipeline is named as such; the same one anywhere is fine
        base = lora.check_base(path, meta, model_cfg)
        model_cfg = (model_cfg or recorded) | {"pretrained": recorded.get("pretrained")}
    if model_cfg is None:
        if not nets.is_builtin(recorded.get("arch", "unet")):
            raise UserError(f"{path}: records model.arch={recorded['arch']!r}, which is not built in; pass the "
                            "run's config with --config so the config, not the file, names the code to run")
        model_cfg = recorded
    else:
        key = nets.same_network(recorded, model_cfg)
        if key is not None:
            raise UserError(f"{path}: made by a different network (model.{key}={json.dumps(recorded.get(key))} "
                            f"in the snapshot, {json.dumps(model_cfg.get(key))} in the config); "
                            "sample it with the config it was trained with")
    index = ema_index(path, meta, decay) if weights == "ema" else 0  # a decay the run did not train: one line
    prefix = "raw." if weights_of(meta, weights) == "raw" else ema_prefix(index)
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not state and prefix not in ("ema.", "raw."):
        raise UserError(f"{path}: holds only the EMA of the first of train.ema_decays (written before snapshots "
                        f"kept every EMA); sample it without sample.ema_decay, or train again to get the others")
    if not state:
        raise UserError(f"{path}: holds no {weights} weights (a post-hoc EMA reconstruction has ema only); "
                        "sample it with --weights ema")
    if model_cfg.get("arch") == "dit" and "dit_layout" not in meta:
        # Written by diffrelay's DiT before it matched DiT's (rows-first position table): its own network.
        model_cfg = model_cfg | {"kwargs": {**(model_cfg.get("kwargs") or {}), "pos_order": "rows"}}
    _, h, w = meta["image_shape"]
    net = objectives.build(model_cfg, resolution=h, num_classes=meta["num_classes"], in_channels=meta["image_shape"][0],
                           text=(meta.get("text") or {}).get("dims"))
    if spec:  # the pipeline's base, then the adapter
        base_weights.load_initial(net, base)
        lora.quantize(net, *quantize)
        lora.attach(net, spec, 0)
        lora.load(net, state, path)
    else:
        net.load_state_dict(state)
    return net.to(device).eval().requires_grad_(False), meta
