"""Class accuracy: the share of a sample folder's images that a local image classifier (fid.classifier) reads as
the label each was sampled for.

Formula: mean over the images of [argmax_k logits_k(image) == intended label], the classifier's top-1 agreement
with the conditioning (a diffrelay choice: the "classifier accuracy" of conditional samples, with the classifier's
own preprocessing and no test-time augmentation). Higher is better; 1/num_labels is chance.

Each image's intended label:
  a class-conditional run: its class, from the folder's manifest.json (sampling/sample.py class_labels: balanced =
    image i's class is i mod num_classes, a number = that class for every image), named by the run's class_names
    (manifest.json's, else the snapshot's metadata);
  a text run: from the prompt file the folder was sampled from (--prompts; data/prompts.py): the entry's
    `label`, else the one classifier label named as a whole word in the prompt; held-out captions (no prompt file):
    the one label named as a whole word in the image's NNNNNN.txt, and the images whose caption names none or
    several are left out (counted as "left_out"): captions are not written for a classifier, and the same images
    are left out at every checkpoint, so the scores still compare.
Names match case-insensitively, with `_` read as a space; a classifier label such as ImageNet's "tench, Tinca
tinca" answers to the whole string and to each of its comma-separated names. A class or prompt that matches no
label, or a prompt file's entry that names none or several, is one UserError line before any model is loaded.

The classifier is a local folder written by transformers' save_pretrained (AutoModelForImageClassification and
its image processor, e.g. a copy of google/vit-base-patch16-224): nothing is downloaded, only safetensors weights
are read, and their sha256 goes with every score.
"""

import dataclasses
import re
from pathlib import Path

from diffrelay import io, logs
from diffrelay.errors import UserError
from diffrelay.evaluation import clip_score

KEY = "fid.classifier"
FIX = ("set fid.classifier to a local copy of an image classifier written by save_pretrained (model and image "
       "processor, e.g. of google/vit-base-patch16-224)")
log = logs.get()


@dataclasses.dataclass
class Plan:
    """What the cheap checks found: the images and the classifier label id each was sampled for."""
    files: list  # the folder's numbered PNGs, in order
    targets: list  # classifier label id of each file
    id2label: dict
    sha256: str
    left_out: int = 0  # held-out captions that name no single label


@dataclasses.dataclass
class Classifier:
    model: object  # transformers AutoModelForImageClassification, eval mode, on `device`
    image_processor: object
    folder: str
    sha256: str
    device: object


def check(folder, images, prompts=None) -> Plan:
    """The classifier folder (config with id2label, safetensors weights, image processor) and every image's
    intended label: all cheap, before any model or image is read (`diffrelay fid` makes them before its scoring
    child starts). `prompts`: the prompt file a text run's folder was sampled from (None: held-out captions)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: classifier folder not found; nothing is downloaded: {FIX}")
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{folder}: no config.json, not a transformers model folder; {FIX}")
    config = io.read_json(path, max_bytes=1 << 26)
    raw = config.get("id2label") if isinstance(config, dict) else None
    try:
        id2label = {int(k): str(v) for k, v in (raw or {}).items()}
    except (TypeError, ValueError):
        id2label = {}
    if not id2label:
        raise UserError(f"{path}: no id2label, so the classifier's outputs have no names to match; {FIX}")
    digest = clip_score.weights_sha256(folder, FIX, "AutoModelForImageClassification")
    if not (folder / "preprocessor_config.json").is_file():
        raise UserError(f"{folder}: no image processor (preprocessor_config.json); save the classifier's image "
                        "processor there too (AutoImageProcessor.save_pretrained)")
    images = Path(images)
    files = sorted(p for p in images.iterdir() if clip_score.PNG.match(p.name)) if images.is_dir() else []
    if not files:
        raise UserError(f"{images}: no numbered images (000000.png ...); sample the checkpoint first")
    index = _names(id2label)
    if all(p.with_suffix(".txt").is_file() for p in files):  # a text run: each image's prompt beside it
        targets = _prompt_targets(files, index, id2label, prompts)
    else:
        targets = _class_targets(images, files, index, id2label)
    kept = [(f, t) for f, t in zip(files, targets) if t is not None]
    if not kept:
        raise UserError(f"{images}: no held-out caption names exactly one of the classifier's labels as a whole word "
                        f"({_shown(id2label, id2label)}); sample a prompt file whose entries carry label: keys "
                        f"(sample.prompts), or unset {KEY}")
    if len(kept) < len(files):
        log.warning(f"{images}: class_accuracy of {len(kept)} of {len(files)} images: the other captions name none or "
                    "several of the classifier's labels as a whole word")
    return Plan([f for f, _ in kept], [t for _, t in kept], id2label, digest, len(files) - len(kept))


def load(folder, device="cpu") -> Classifier:
    """The classifier of a local save_pretrained folder; one UserError line when it cannot be loaded."""
    folder = Path(folder)
    import torch
    import transformers

    try:
        model = transformers.AutoModelForImageClassification.from_pretrained(
            folder, local_files_only=True, use_safetensors=True, dtype=torch.float32)
        processor = transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{folder}: cannot load the classifier ({first}); {FIX}") from e
    digest = clip_score.weights_sha256(folder, FIX, "AutoModelForImageClassification")
    log.info("classifier %s (%s, %d labels, sha256 %s...)", folder, type(model).__name__,
             model.config.num_labels, digest[:12])
    return Classifier(model.to(device).eval().requires_grad_(False), processor, str(folder), digest, device)


def score(classifier: Classifier, images, targets, batch_size: int = 32) -> dict:
    """Top-1 agreement of `images` ((H, W, 3) uint8 arrays, read one batch at a time) with `targets` (a label id
    each): {"class_accuracy", "count", "correct", "per_image" (the predicted ids), "model", "sha256"}."""
    import torch

    n = len(images)
    if n != len(targets):
        raise ValueError(f"{n} images but {len(targets)} targets")
    if n == 0:
        raise ValueError("no images to score")
    predicted = []
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            batch = [clip_score.rgb_array(images[i], i) for i in range(start, min(start + batch_size, n))]
            pixels = classifier.image_processor(images=batch, return_tensors="pt", input_data_format="channels_last")
            logits = classifier.model(pixel_values=pixels["pixel_values"].to(classifier.device)).logits
            predicted.extend(logits.argmax(-1).tolist())
    correct = sum(int(p == t) for p, t in zip(predicted, targets))
    return {"class_accuracy": correct / n, "count": n, "correct": correct, "per_image": predicted,
            "model": classifier.folder, "sha256": classifier.sha256}


def score_folder(plan: Plan, classifier: Classifier, batch_size: int = 32) -> dict:
    """Class accuracy of the images `check` planned, decoded a batch at a time."""
    from diffrelay.evaluation import features

    if classifier.sha256 != plan.sha256:
        raise UserError(f"{classifier.folder}: the weights changed since they were checked; score again")
    result = score(classifier, clip_score.Lazy(plan.files, features.decode), plan.targets, batch_size)
    return {**result, "left_out": plan.left_out, "folder": str(plan.files[0].parent)}


# ---------------------------------------------------------------------------- intended labels

def _norm(name: str) -> str:
    return " ".join(str(name).replace("_", " ").split()).casefold()


def _names(id2label: dict) -> dict:
    """normalised name -> the label ids answering to it (a label's whole string and its comma-separated names)."""
    out: dict = {}
    for k, label in id2label.items():
        for name in {_norm(label), *(_norm(part) for part in str(label).split(","))}:
            if name:
                out.setdefault(name, set()).add(k)
    return out


def _in_words(prompt: str, index: dict) -> set:
    """The label ids named as a whole word (or words) in `prompt`."""
    text = _norm(prompt)
    return {k for name, ids in index.items() if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) for k in ids}


def _shown(id2label: dict, ids) -> str:
    return ", ".join(repr(id2label[k]) for k in sorted(ids)[:4]) + (" ..." if len(ids) > 4 else "")


def _prompt_targets(files: list, index: dict, id2label: dict, prompts) -> list:
    from diffrelay.data import prompts as prompt_files

    texts = [clip_score.prompt_of(png) for png in files]
    entries = items = None
    if prompts is not None:
        entries = prompt_files.read(prompts)
        items = prompt_files.expand(entries, 0)  # the image -> entry order (seeds do not matter here)
    targets, memo = [], {}
    for png, text in zip(files, texts):
        i = int(png.stem)
        if items is not None:
            if i >= len(items) or items[i].prompt != text:
                raise UserError(f"{png.with_suffix('.txt')}: its prompt is not image {i}'s of {prompts}; the folder "
                                "was sampled from another prompt file: score it with that file (sample.prompts)")
            k = items[i].prompt_index
            where = f"{prompts}: prompt {k + 1} ({text[:60]!r})"
            label = entries[k].label
        else:  # a held-out caption: its one label word, else left out (None)
            ids = _in_words(text, index)
            targets.append(next(iter(ids)) if len(ids) == 1 else None)
            continue
        if (k, label) not in memo:
            memo[k, label] = _target(label, text, where, index, id2label)
        targets.append(memo[k, label])
    return targets


def _target(label, text: str, where: str, index: dict, id2label: dict) -> int:
    if label is not None:
        ids = index.get(_norm(label), set())
        if len(ids) != 1:
            raise UserError(f"{where}: label {label!r} is {'none' if not ids else 'several'} of the classifier's "
                            f"labels ({_shown(id2label, ids or id2label)}); write one of its id2label names")
        return next(iter(ids))
    ids = _in_words(text, index)
    if len(ids) != 1:
        raise UserError(f"{where}: names {'none' if not ids else 'several'} of the classifier's labels as a whole "
                        f"word ({_shown(id2label, ids or id2label)}), so its intended label is unknown; add label: <one of "
                        "them> to the entry")
    return next(iter(ids))


def _class_targets(images: Path, files: list, index: dict, id2label: dict) -> list:
    path = images / "manifest.json"
    if not path.is_file():
        raise UserError(f"{path}: not found; class_accuracy reads each image's class from the sample folder's "
                        "manifest (sample the checkpoint with diffrelay sample), or a text run's NNNNNN.txt prompts")
    manifest = io.read_json(path, max_bytes=1 << 28)
    n, spec = int(manifest.get("num_classes") or 0), manifest.get("class_labels", "balanced")
    if n <= 0:
        raise UserError(f"{path}: an unconditional model's samples, which have no intended class; class_accuracy "
                        f"needs a class-conditional or a text run: unset {KEY}")
    names = manifest.get("class_names") or _snapshot_class_names(path, manifest)
    if len(names) != n:
        raise UserError(f"{path}: {len(names)} class names for {n} classes; the run's class names are unknown, so "
                        f"no class can be matched to the classifier's labels: unset {KEY}, or sample again")
    classes = [i % n if spec == "balanced" else int(spec) for i in (int(p.stem) for p in files)]
    to_label = {}
    for c in sorted(set(classes)):
        ids = index.get(_norm(names[c]), set())
        if len(ids) != 1:
            raise UserError(f"{path}: class {c} {names[c]!r} matches {'none' if not ids else 'several'} of the "
                            f"classifier's labels ({_shown(id2label, ids or id2label)}); use a classifier whose "
                            f"id2label names the dataset's classes, or unset {KEY}")
        to_label[c] = next(iter(ids))
    return [to_label[c] for c in classes]


def _snapshot_class_names(path: Path, manifest: dict) -> list:
    """Folders sampled before manifests held class_names: the snapshot's metadata (its header only)."""
    snapshot = manifest.get("snapshot")
    meta = io.signed_header(snapshot, "snapshot", f"{path} names it as its snapshot but it has moved; sample the "
                            "folder again (its manifest then holds the class names)")[1] if snapshot else {}
    return list(meta.get("class_names") or [])
