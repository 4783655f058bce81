"""`diffrelay import-dataset kohya.toml`: the `data:` section (and train.batch_size) of a kohya sd-scripts dataset
config (docs/config_README-en.md: [general], [[datasets]], [[datasets.subsets]]), as YAML, and one line on stderr for
each key that cannot be carried over (docs/data.md, "Coming from kohya, OneTrainer or SimpleTuner"). A .json is
SimpleTuner's multidatabackend.json instead (data/simpletuner.py).

kohya's [general] keys are the defaults of every dataset and subset, a dataset's keys those of its subsets. The
subsets' image_dir become data.subsets' paths, inside data.path: their common folder. Torch-free.
"""

import os
import sys
import tomllib
from pathlib import Path

import yaml

from diffrelay import io
from diffrelay.errors import UserError

# kohya's subset keys diffrelay takes one to one, and what it calls them
SUBSET_KEYS = {"num_repeats": "repeats", "class_tokens": "class_tokens", "caption_prefix": "caption_prefix",
               "caption_suffix": "caption_suffix", "is_reg": "is_reg"}
# kohya's keys diffrelay has no equivalent of yet, and why the line says so
NOT_YET = {
    "secondary_separator": "diffrelay splits tags at ',' only",
    "caption_dropout_every_n_epochs": "diffrelay drops captions per row (data.caption_dropout), not per epoch",
    "color_aug": "colour augmentation is not built",
    "face_crop_aug_range": "face crops are not built",
    "token_warmup_min": "token warm-up is not built",
    "token_warmup_step": "token warm-up is not built",
    "enable_wildcard": "caption wildcards are not built",
    "min_bucket_reso": "diffrelay bounds buckets by aspect ratio (data.buckets.max_aspect), not by side",
    "max_bucket_reso": "diffrelay bounds buckets by aspect ratio (data.buckets.max_aspect), not by side",
    "metadata_file": "a kohya fine-tuning metadata JSON is not read; write metadata.jsonl (file_name, text) at data.path",
    "conditioning_data_dir": "ControlNet conditioning images are not read",
    "alpha_mask": "alpha masks are not read",
    "cache_info": "diffrelay's prepare keeps its own records",
}
# kohya's caption keys, one value a run in diffrelay (data.<key>)
RUN_KEYS = {"shuffle_caption": "shuffle_caption", "keep_tokens": "keep_tokens",
            "keep_tokens_separator": "keep_tokens_separator", "caption_tag_dropout_rate": "caption_tag_dropout",
            "random_crop": "random_crop"}
KNOWN = {"resolution", "batch_size", "enable_bucket", "bucket_reso_steps", "bucket_no_upscale", "image_dir",
         "flip_aug", "caption_extension", "caption_dropout_rate", *SUBSET_KEYS, *NOT_YET, *RUN_KEYS}


def convert(path: Path) -> tuple[dict, list[str]]:
    """(the config overlay {data, train}, the lines of what was not carried over)."""
    try:
        io.check_regular_file(path, 1 << 24, "kohya dataset config", "give the .toml file")
        doc = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e}); give the kohya dataset config (.toml)") from e
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not TOML ({e}); give the kohya dataset config (.toml)") from e
    general, datasets = doc.get("general", {}), doc.get("datasets", [])
    if not datasets or not datasets[0].get("subsets"):
        raise UserError(f"{path}: no [[datasets]] with [[datasets.subsets]]; give a kohya dataset config")
    lines = [f"datasets[{i}]: left out: diffrelay trains one dataset a run; import it into its own config"
             for i in range(1, len(datasets))]
    first = {k: v for k, v in datasets[0].items() if k != "subsets"}
    for key in sorted(set(general) | set(first)):
        if key not in KNOWN:
            lines.append(f"{key}: not a kohya dataset key diffrelay knows; not carried over")
    base = general | first
    subsets, flips, drops, dirs, run_values = [], set(), set(), [], {k: [] for k in RUN_KEYS}
    for i, raw in enumerate(datasets[0]["subsets"]):
        s, where = base | raw, f"datasets[0].subsets[{i}]"
        for key in sorted(s):
            if key in NOT_YET and s[key] not in (None, False, 0, 0.0, "", [0.0, 0.0]):
                lines.append(f"{where}.{key}={s[key]!r}: not carried over: {NOT_YET[key]}")
            elif key not in KNOWN:
                lines.append(f"{where}.{key}: not a kohya subset key diffrelay knows; not carried over")
        if s.get("is_reg"):
            lines.append(f"{where}.is_reg: carried over; diffrelay makes each batch half instance, half "
                         "regularisation images (diffusers' DreamBooth), where kohya mixes them in and weighs their "
                         "loss; set train.prior_loss_weight (kohya's --prior_loss_weight)")
        if "image_dir" not in s:
            raise UserError(f"{path}: {where}: no image_dir; give each subset its folder")
        ext = s.get("caption_extension", ".caption")
        if ext not in (".txt", ".caption"):
            lines.append(f"{where}.caption_extension={ext!r}: diffrelay reads .txt, else .caption, beside each image")
        dirs.append(os.path.abspath(os.path.expanduser(s["image_dir"])))
        sub = {"path": dirs[-1]} | {SUBSET_KEYS[k]: s[k] for k in SUBSET_KEYS if s.get(k) not in (None, "", False)}
        subsets.append(sub)
        flips.add(bool(s.get("flip_aug", False)))
        for k in RUN_KEYS:
            run_values[k].append(s.get(k))
        drops.add(float(s.get("caption_dropout_rate", 0.0)))
    if subsets and all(s.get("is_reg") for s in subsets):
        raise UserError(f"{path}: every subset is is_reg; there are no training images to import")
    root = os.path.commonpath(dirs)
    data = {"kind": "folder", "path": root, "captions": "auto",
            "subsets": [s | {"path": os.path.relpath(s["path"], root)} for s in subsets]}
    res = base.get("resolution")
    if isinstance(res, list):
        if len(res) != 2 or res[0] != res[1]:
            lines.append(f"resolution={res}: diffrelay's data.resolution is a square's side; took {max(res)}")
        res = max(res)
    if res is not None:
        data["resolution"] = int(res)
    if len(flips) > 1:  # kohya flips half of a flip_aug subset's samples
        for sub, raw in zip(data["subsets"], datasets[0]["subsets"]):
            if (base | raw).get("flip_aug"):
                sub["flip"] = 0.5
        lines.append("flip_aug: on some subsets only: data.subsets[].flip 0.5 there (a latent run needs data.xflip "
                     "above 0 for its mirrored latents)")
    elif flips == {True}:
        data["xflip"] = 0.5
    if len(drops) > 1:  # each subset its own rate
        for sub, raw in zip(data["subsets"], datasets[0]["subsets"]):
            sub["caption_dropout"] = float((base | raw).get("caption_dropout_rate", 0.0))
    elif max(drops) > 0:
        data["caption_dropout"] = max(drops)
    for k, values in run_values.items():
        given = [v for v in values if v not in (None, False, 0, 0.0, "")]
        if given:
            data[RUN_KEYS[k]] = given[0]
            if len(set(map(str, values))) > 1:
                lines.append(f"{k}: differs between subsets; diffrelay keeps one value a run; took {given[0]!r}")
    if data.get("shuffle_caption") or data.get("caption_tag_dropout"):
        data["text_cache"] = False
        lines.append("shuffle_caption / caption_tag_dropout_rate: set data.text_cache: false (a new caption each "
                     "step is encoded in the training job, as kohya refuses them with cache_text_encoder_outputs)")
    if base.get("enable_bucket"):
        data["buckets"] = {"step": int(base.get("bucket_reso_steps", 64)),
                           "upscale": not base.get("bucket_no_upscale", False)}
    out = {"data": data}
    if "batch_size" in base:
        out["train"] = {"batch_size": int(base["batch_size"])}
    return out, lines


def main(args) -> int:
    """kohya's .toml, or SimpleTuner's multidatabackend .json (data/simpletuner.py)."""
    source = Path(args.config_file)
    if source.suffix.lower() == ".json":
        from diffrelay.data import simpletuner

        overlay, lines = simpletuner.convert(source)
    else:
        overlay, lines = convert(source)
    for line in lines:
        print(f"diffrelay: import-dataset: {args.config_file}: {line}", file=sys.stderr, flush=True)
    text = "# from " + str(args.config_file) + " (diffrelay import-dataset)\n" + yaml.safe_dump(overlay, sort_keys=False)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if out.exists():
        raise UserError(f"{out}: exists; give --out a new file (import-dataset never overwrites one)")
    io.write_text(out, text)
    return 0
