"""data.subsets: several image folders in one run, each with its repeats and its trigger words (docs/data.md,
"Subsets"; kohya sd-scripts' [[datasets.subsets]], docs/config_README-en.md).

A subset is a folder inside data.path, so one root keeps its one fingerprint, caption sources and held-out split;
every image of data.path must lie in exactly one subset (a stray one is refused in one line, not trained silently).
- captions: caption_prefix and caption_suffix are joined to each caption with a space, and class_tokens is the
  caption of an image that has none, as kohya's train_util does (`caption_prefix + " " + caption`; DreamBooth-style
  folders captioned by their class tokens). They are applied when `prepare` reads the captions, so the cached
  embeddings hold the trigger words.
- repeats: an image counts `repeats` times in an epoch (kohya's num_repeats). The data order draws each epoch's
  permutation over the repeated rows (order.DataOrder), so the order stays a function of the seed and the position
  alone, and changing repeats changes the order, not the prepared dataset.
- `subsets.npy` in the dataset folder holds each trained row's subset; train.jsonl counts them per logged window.

Torch-free (config checks at Snakefile parse time).
"""

import os
from pathlib import Path

import numpy as np

from diffrelay.errors import UserError

FILE = "subsets.npy"


def relative(data: dict) -> list[str]:
    """Each subset's folder as a posix path relative to data.path ("" is data.path itself; check_config first)."""
    root = Path(os.path.abspath(os.path.expanduser(data["path"])))
    out = []
    for s in data["subsets"]:
        path = Path(os.path.expanduser(s["path"]))
        posix = (path.relative_to(root) if path.is_absolute() else path).as_posix()
        out.append("" if posix == "." else posix.strip("/"))
    return out


def _within(a: str, b: str) -> bool:
    """Folder a (relative) is b or lies inside it."""
    return not b or a == b or a.startswith(b + "/")


def check_config(d: dict) -> list[tuple[str, str]]:
    """(key, message) of data.subsets that cannot work, before any file is read."""
    data = d["data"]
    subsets = data.get("subsets")
    if subsets is None:
        return []
    if data["kind"] != "folder" or not data.get("path"):
        return [("data.subsets", "are folders inside data.path; set data.kind: folder and data.path")]
    if not subsets:
        return [("data.subsets", "is an empty list; give at least one subset, or set it to null")]
    root = Path(os.path.abspath(os.path.expanduser(data["path"])))
    for i, s in enumerate(subsets):
        path = Path(os.path.expanduser(s["path"]))
        if path.is_absolute() and not path.is_relative_to(root) or ".." in path.parts:
            return [(f"data.subsets[{i}].path={s['path']}", f"lies outside data.path ({data['path']}); give a folder "
                     "inside it (relative to data.path, or absolute), or set data.path to a folder that holds every "
                     "subset")]
    if any(s.get("is_reg") for s in subsets):
        bad = _check_reg(d)
        if bad:
            return bad
    weighted = next((i for i, s in enumerate(subsets) if s.get("weight") is not None), None)
    repeated = next((i for i, s in enumerate(subsets) if s.get("repeats", 1) != 1), None)
    if weighted is not None and repeated is not None:
        return [(f"data.subsets[{repeated}].repeats={subsets[repeated]['repeats']}", f"and data.subsets[{weighted}]"
                 ".weight both set how often images come; give every subset a weight, or repeats, not both")]
    dropped = next((i for i, s in enumerate(subsets) if s.get("caption_dropout")), None)
    if dropped is not None and data.get("captions", "none") == "none":
        return [(f"data.subsets[{dropped}].caption_dropout", "applies to captioned datasets only; set data.captions, "
                 "or drop it")]
    flipped = next((i for i, s in enumerate(subsets) if s.get("flip")), None)
    if flipped is not None and data.get("encoder", "none") != "none" and not data.get("xflip"):
        return [(f"data.subsets[{flipped}].flip={subsets[flipped]['flip']}", "flips a latent run by its mirrored "
                 "latents, which prepare encodes where data.xflip > 0; set data.xflip (its probability for the "
                 "subsets without a flip of their own)")]
    rels = relative(data)
    for i, a in enumerate(rels):
        for j, b in enumerate(rels[:i]):
            if _within(a, b) or _within(b, a):
                return [(f"data.subsets[{i}].path={subsets[i]['path']}", f"lies in data.subsets[{j}].path="
                         f"{subsets[j]['path']}; an image belongs to one subset: give folders side by side")]
    return []


def _check_reg(d: dict) -> list[tuple[str, str]]:
    """What prior preservation (is_reg subsets) cannot take."""
    data, t = d["data"], d["train"]
    key = "data.subsets[].is_reg"
    if all(s.get("is_reg") for s in data["subsets"]):
        return [(key, "marks every subset; prior preservation needs instance images too: unmark one")]
    if t["batch_size"] % 2:
        return [(f"train.batch_size={t['batch_size']}", "is half instance, half regularisation images with is_reg "
                 "subsets; use an even batch size")]
    if data.get("buckets") is not None:
        return [(key, "with data.buckets is not built (a bucket's batch is not split in halves yet); set "
                 "data.buckets: null, or drop is_reg")]
    return []


def of_rels(rels, subset_rels: list[str]) -> np.ndarray:
    """int16: the subset of each image (relative posix path); -1 where it lies in none."""
    out = np.full(len(rels), -1, dtype=np.int16)
    for i, rel in enumerate(rels):
        for k, folder in enumerate(subset_rels):
            if _within(rel, folder):
                out[i] = k
                break
    return out


def check_files(root: Path, files, subset_rels: list[str]) -> None:
    """Refuse an image of data.path that lies in no subset (planning, before any image is decoded)."""
    which = of_rels([f[0] for f in files], subset_rels)
    stray = [f[0] for f, k in zip(files, which) if k < 0]
    if stray:
        more = f" and {len(stray) - 1} more" if len(stray) > 1 else ""
        raise UserError(f"{root / stray[0]}{more}: in no folder of data.subsets ({', '.join(subset_rels)}); add a "
                        "subset for its folder, or move it out of data.path")
    empty = [folder for k, folder in enumerate(subset_rels) if not (which == k).any()]
    if empty:
        raise UserError(f"{root / empty[0]}: data.subsets folder with no image (searched recursively); add images, "
                        "or drop the subset")


def captions(caps: list[str] | None, subset: dict) -> list[str] | None:
    """A subset's captions of one image: class_tokens where it has none, prefix and suffix joined by a space."""
    if not caps and subset.get("class_tokens"):
        caps = [subset["class_tokens"]]
    if caps is None:
        return None
    pre, post = subset.get("caption_prefix") or "", subset.get("caption_suffix") or ""
    return [" ".join(x for x in (pre, c, post) if x) for c in caps]


def repeats(subsets: list[dict] | None, of_row: np.ndarray | None) -> np.ndarray | None:
    """Each trained row's repeats (None: all once, the order of a run without subsets)."""
    if subsets is None or of_row is None:
        return None
    per = np.asarray([s["repeats"] for s in subsets], dtype=np.int64)
    if len(of_row) and int(of_row.max()) >= len(per):
        raise UserError(f"the prepared dataset has more subsets than data.subsets' {len(per)}; rerun `diffrelay "
                        "prepare --config <your config>`")
    if any(s.get("weight") is not None for s in subsets):
        per = weighted_repeats(subsets, np.bincount(np.asarray(of_row, dtype=np.int64), minlength=len(subsets)))
    out = per[np.asarray(of_row, dtype=np.int64)]
    return None if (out == 1).all() else out


def per_row(subsets: list[dict] | None, of_row: np.ndarray | None, key: str, default: float):
    """A probability a subset may set for itself (data.subsets[].flip, .caption_dropout): `default` where none
    does, else float64 (N,), each row's (the subset's own, or `default`)."""
    if subsets is None or of_row is None or all(s.get(key) is None for s in subsets):
        return default
    per = np.asarray([default if s.get(key) is None else s[key] for s in subsets], dtype=np.float64)
    return per[np.asarray(of_row, dtype=np.int64)]


def probabilities(data: dict, of_row: np.ndarray | None) -> tuple:
    """(data.xflip, data.caption_dropout, data.random_crop), each a subset's own per row where one sets it
    (per_row; random_crop's as 1.0 or 0.0)."""
    subs = data.get("subsets")
    return (per_row(subs, of_row, "flip", data["xflip"]),
            per_row(subs, of_row, "caption_dropout", data["caption_dropout"]),
            per_row(subs, of_row, "random_crop", float(data.get("random_crop", False))))


def weighted_repeats(subsets: list[dict], counts: np.ndarray) -> np.ndarray:
    """int64 repeats a subset from weights (absent: 1): subset s of n_s images gets r_s = max(1, round(w_s T / n_s)),
    T = max(n / w) over its group (the instance subsets, or the regularisation ones), so r_s n_s is about in
    proportion to w_s and the subset that needs the fewest copies appears once an epoch."""
    out = np.ones(len(subsets), dtype=np.int64)
    for reg in (False, True):
        group = [i for i, s in enumerate(subsets) if bool(s.get("is_reg")) == reg and counts[i]]
        if not group:
            continue
        w = {i: float(subsets[i].get("weight") or 1.0) for i in group}
        top = max(counts[i] / w[i] for i in group)
        for i in group:
            out[i] = max(1, round(w[i] * top / counts[i]))
    return out


def regularisation(subsets: list[dict] | None, of_row: np.ndarray | None) -> np.ndarray | None:
    """bool (N,): the rows of is_reg subsets (prior preservation), None where no subset is one."""
    if subsets is None or of_row is None or not any(s.get("is_reg") for s in subsets):
        return None
    return np.asarray([s.get("is_reg", False) for s in subsets], dtype=bool)[np.asarray(of_row, dtype=np.int64)]


def prior_weights(global_batch: int, weight: float) -> np.ndarray:
    """float32 (global_batch,): each row's loss weight under prior preservation, the instance half first (order.
    PairedOrder): 2 and 2 x weight, so that a batch's weighted mean is the instance rows' mean plus weight x the
    regularisation rows' mean, diffusers' train_dreambooth.py `loss + args.prior_loss_weight * prior_loss`; a rank's
    rows r::world keep their weights, and DDP's average over ranks gives the same sum."""
    half = global_batch // 2
    return np.where(np.arange(global_batch) < half, 2.0, 2.0 * weight).astype(np.float32)


def tally(window: dict, bucket: int | None, counts: np.ndarray | None, data) -> None:
    """Add one step to a logged window: its bucket's steps and each subset's rows of the global batch (train.jsonl's
    "buckets" and "subsets": a user sees that the repeats did what they set)."""
    if bucket is not None:
        key = "x".join(map(str, data.buckets.sizes[bucket]))
        window.setdefault("buckets", {})[key] = window.get("buckets", {}).get(key, 0) + 1
    if counts is not None:
        total = window.setdefault("subsets", dict.fromkeys([n or "." for n in data.subset_names], 0))
        for name, n in zip(list(total), counts.tolist(), strict=True):
            total[name] += n
