"""`diffrelay import-dataset multidatabackend.json`: the `data:` section of a SimpleTuner dataloader config
(documentation/DATALOADER.md), as YAML, and one line for each key that cannot be carried over (docs/data.md,
"Coming from kohya, OneTrainer or SimpleTuner"). Its image backends become data.subsets inside their common
folder. Torch-free.
"""

import json
import os
from pathlib import Path

from diffrelay import io
from diffrelay.errors import UserError

# kept by SimpleTuner for its own caches and bookkeeping: diffrelay's prepare keeps its own
CACHES = {"id", "type", "dataset_type", "default", "cache_dir", "cache_dir_vae", "vae_cache_clear_each_epoch",
          "skip_file_discovery", "metadata_backend", "text_embeds", "image_embeds", "disabled", "preserve_data_backend_cache",
          "scan_for_errors", "hash_filenames"}
HANDLED = {"instance_data_dir", "repeats", "caption_strategy", "instance_prompt", "prepend_instance_prompt",
           "only_instance_prompt", "resolution", "resolution_type", "minimum_image_size", "crop", "crop_style",
           "crop_aspect", "is_regularisation_data", "is_regularization_data", "probability"}


def convert(path: Path) -> tuple[dict, list[str]]:
    """(the config overlay {data}, the lines of what was not carried over)."""
    try:
        io.check_regular_file(path, 1 << 24, "SimpleTuner dataloader config", "give the multidatabackend.json")
        backends = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: not a readable JSON list of backends ({e}); give SimpleTuner's "
                        "multidatabackend.json") from e
    if not isinstance(backends, list) or not all(isinstance(b, dict) for b in backends):
        raise UserError(f"{path}: not a JSON list of backend objects; give SimpleTuner's multidatabackend.json")
    lines, subsets, dirs, first = [], [], [], None
    for i, b in enumerate(backends):
        where, kind = f"[{i}] ({b.get('id', '?')})", b.get("dataset_type", "image")
        if kind != "image" or b.get("disabled"):
            lines.append(f"{where}: dataset_type {kind}{' (disabled)' if b.get('disabled') else ''}: not carried over "
                         "(diffrelay's prepare makes its own latent and text caches)")
            continue
        if b.get("type", "local") != "local":
            lines.append(f"{where}: type {b.get('type')}: only local folders are read; left out")
            continue
        if b.get("is_regularisation_data") or b.get("is_regularization_data"):
            lines.append(f"{where}: is_regularisation_data is SimpleTuner's parent-teacher regularisation (LyCORIS), "
                         "not DreamBooth's prior preservation; left out (move its folder out of data.path)")
            continue
        for key in sorted(set(b) - CACHES - HANDLED):
            lines.append(f"{where}.{key}={b[key]!r}: not carried over")
        if "instance_data_dir" not in b:
            raise UserError(f"{path}: {where}: no instance_data_dir; give each image backend its folder")
        dirs.append(os.path.abspath(os.path.expanduser(b["instance_data_dir"])))
        sub = {"path": dirs[-1]}
        if int(b.get("repeats", 0)):  # SimpleTuner's 0 is no repeat: seen repeats + 1 times an epoch
            sub["repeats"] = int(b["repeats"]) + 1
        strategy, prompt = b.get("caption_strategy", "filename"), b.get("instance_prompt")
        if strategy == "instanceprompt" or b.get("only_instance_prompt"):
            sub["class_tokens"] = prompt
            lines.append(f"{where}: the instance prompt is carried as class_tokens, the caption of an image without "
                         "a caption file (SimpleTuner gives it to every image)")
        elif b.get("prepend_instance_prompt") and prompt:
            sub["caption_prefix"] = prompt
        if strategy not in ("textfile", "instanceprompt"):
            lines.append(f"{where}.caption_strategy={strategy!r}: diffrelay reads a .txt (or .caption) beside each "
                         "image, or metadata.jsonl; not carried over")
        if b.get("probability", 1.0) != 1.0:
            lines.append(f"{where}.probability={b['probability']}: diffrelay has no per-step draw of a backend; give "
                         "the subset a weight (its share of each epoch) instead")
        subsets.append(sub)
        first = first or b
    if not subsets:
        raise UserError(f"{path}: no local image backend to import")
    root = os.path.commonpath(dirs)
    data = {"kind": "folder", "path": root, "captions": "auto",
            "subsets": [s | {"path": os.path.relpath(s["path"], root)} for s in subsets]}
    data |= _sizes(first, lines)
    return {"data": data}, lines


def _sizes(b: dict, lines: list) -> dict:
    """data.resolution, min_size, buckets and random_crop from the first image backend's."""
    out, kind, res = {}, b.get("resolution_type", "pixel"), b.get("resolution")
    if res is not None:
        out["resolution"] = int(round((res * 1e6) ** 0.5)) if kind == "area" else int(res)
        if kind == "pixel":
            lines.append("resolution_type=pixel: SimpleTuner's resolution is the shorter edge; diffrelay's "
                         "data.resolution is a square's side (and buckets keep about its area)")
    if b.get("minimum_image_size"):
        if kind == "area":
            lines.append("minimum_image_size: in megapixels (resolution_type=area); diffrelay's data.min_size is "
                         "the shorter side in pixels: not carried over")
        else:
            out["min_size"] = int(b["minimum_image_size"])
    aspect = b.get("crop_aspect", "square")
    if not b.get("crop", False) or aspect in ("preserve", "closest", "random"):
        out["buckets"] = {}
        if aspect == "random":
            lines.append("crop_aspect=random: diffrelay gives each image its nearest bucket; not carried over")
    if b.get("crop") and b.get("crop_style", "random") == "random":
        out["random_crop"] = True
    elif b.get("crop") and b.get("crop_style") in ("corner", "face"):
        lines.append(f"crop_style={b['crop_style']}: diffrelay cuts centred or at random; took the centre")
    return out
