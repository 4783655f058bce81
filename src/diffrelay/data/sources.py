"""What a run's dataset was made from, so a changed source is noticed and said.

- `listing`: a cheap digest of the source's file names, sizes and mtimes (data.path, data.val_path, a caption table,
  the text encoders' and the encoder's weights), no file read: the Snakefile's `prepare_dataset` param, so an edited
  caption or image reruns `prepare` instead of leaving a finished run at "Nothing to be done".
- `record`: per source file, its sha256 and caption, with the text encoders' and the encoder's sha256: written beside
  a run's dataset (`<run>/dataset-sources/<fingerprint>.json`) when `prepare` builds it.
- `warn_if_changed`: `prepare` of a run that has checkpoints says what changed in its source (images added, removed
  or changed, captions edited, encoders swapped) before it builds the new dataset; `check_trained_on`: training
  (a resumed segment, or a finished one Snakemake runs again) then refuses in one line, naming what changed.

Torch-free (the Snakefile imports it).
"""

import hashlib
import json
import os
from pathlib import Path

from diffrelay import io, logs
from diffrelay.errors import UserError

RECORDS = "dataset-sources"  # <run>/dataset-sources/<fingerprint>.json: one record a dataset the run made
SHOWN = 3  # names given per kind of change; the count says the rest


def listing(data: dict) -> str:
    """A digest of (name, size, mtime) of every file under the source's folders and files; no file is read."""
    roots = [data.get("path"), data.get("val_path"), data.get("encoder_path")]
    roots += [e.get("path") for e in data.get("text_encoders") or []]
    cap = data.get("captions", "none")
    if cap not in ("none", "auto"):  # a caption table, wherever it lies
        roots.append(cap)
    h = hashlib.sha256()
    for root in (os.path.expanduser(r) for r in roots if r):
        h.update(f"{root}\0".encode())
        try:
            st = os.stat(root)
        except OSError:
            continue  # prepare says why, in one line
        if os.path.isdir(root):
            _walk(root, "", h, {(st.st_dev, st.st_ino)})
        else:
            h.update(f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _walk(folder: str, rel: str, h, seen: set) -> None:
    """Each file's relative path, size and mtime below `folder`, in name order, into `h` (os.scandir: one stat a
    file, no Path objects); what cannot be read is skipped (prepare says why, in one line). Linked folders are
    followed once (`seen`: their device and inode), so a link to a parent ends."""
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        try:
            if e.is_dir():
                st = e.stat()
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    _walk(e.path, f"{rel}{e.name}/", h, seen)
            else:
                st = e.stat()
                h.update(f"{rel}{e.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            continue


def record(plan) -> dict:
    """Per source file its sha256 (first 16 hex digits) and caption, and the encoders' sha256, of a dataset plan."""
    def captions(files, rows, texts):
        return {str(f[0]): " | ".join(texts[i] for i in r) for f, r in zip(files, rows)} if texts else {}

    return {"fingerprint": plan.fingerprint,
            "files": {str(f[0]): (f[1] or "")[:16] if len(f) > 1 else "" for f in plan.files},
            "captions": captions(plan.files, plan.caption_rows, plan.texts),
            "val_files": {str(f[0]): (f[1] or "")[:16] if len(f) > 1 else "" for f in plan.val_files},
            "val_captions": captions(plan.val_files, plan.val_caption_rows, plan.val_texts),
            "text_encoders": [r.get("sha256") for r in plan.text],
            "encoder": (plan.latent or {}).get("sha256")}


def changes(was: dict, now: dict) -> str:
    """What differs between two records, in words: 'image a.png changed, 2 images added (b.png, c.png), ...'."""
    out = []
    for key, what in (("files", "image"), ("val_files", "held-out image")):
        a, b = was.get(key, {}), now.get(key, {})
        out += _said(what, "changed", [k for k in b if k in a and a[k] != b[k]])
        out += _said(what, "added", [k for k in b if k not in a])
        out += _said(what, "removed", [k for k in a if k not in b])
    for key, what in (("captions", "caption"), ("val_captions", "held-out caption")):
        a, b = was.get(key, {}), now.get(key, {})
        edited = [k for k in b if k in a and a[k] != b[k]]
        out += [f"{what} of {_names(edited)} edited" if len(edited) == 1 else
                f"{len(edited)} {what}s edited ({_names(edited)})"] if edited else []
    if was.get("text_encoders") != now.get("text_encoders"):
        out.append("the text encoders' weights changed (sha256 " + ", ".join(
            f"{str(x)[:12]} -> {str(y)[:12]}" for x, y in zip(was.get("text_encoders") or [None],
                                                            now.get("text_encoders") or [None]) if x != y) + ")")
    if was.get("encoder") != now.get("encoder"):
        out.append(f"the encoder's weights changed (sha256 {str(was.get('encoder'))[:12]} -> "
                   f"{str(now.get('encoder'))[:12]})")
    return ", ".join(out) or "its settings changed"


def _said(what: str, how: str, names: list) -> list:
    if not names:
        return []
    return [f"{what} {io.shown(names[0])} {how}" if len(names) == 1 else f"{len(names)} {what}s {how} ({_names(names)})"]


def _names(names: list) -> str:
    # io.shown: a file name holding a newline (or another odd character) stays on the message's one line
    return ", ".join(map(io.shown, names[:SHOWN])) + (f", ... {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def trained_on(run_dir: Path) -> str | None:
    """The dataset fingerprint the run's newest checkpoint was trained on (its meta.json: no torch), None when
    the run has none."""
    for meta in sorted(Path(run_dir).glob("checkpoints/step_*/meta.json"), reverse=True):
        try:
            fp = io.read_json(meta).get("dataset_fingerprint")
        except (UserError, AttributeError):
            continue
        if isinstance(fp, str):
            return fp
    return None


def read(run_dir: Path, fingerprint: str | None) -> dict | None:
    """The record of the run's dataset of that fingerprint, when prepare made it into the run."""
    path = Path(run_dir) / RECORDS / f"{fingerprint}.json"
    if fingerprint is None or not path.is_file():
        return None
    rec = io.read_json(path)
    return rec if isinstance(rec, dict) else None


def what_changed(run_dir: Path, was: str, now) -> str:
    """In words, from the run's records of both datasets (`now`: a fingerprint or a plan); generic without them."""
    old, new = read(run_dir, was), record(now) if hasattr(now, "files") else read(run_dir, now)
    return changes(old, new) if old is not None and new is not None else ""


def warn_if_changed(run_dir: Path, plan, where: str) -> None:
    """`prepare` builds a changed source anew (the run's checkpoints then refuse to continue on it): say first
    what changed since they were trained."""
    was = trained_on(run_dir)
    if was is not None and was != plan.fingerprint:
        what = what_changed(run_dir, was, plan) or "images or captions added, removed or changed"
        logs.get().warning(f"{io.shown(where)}: changed since {Path(run_dir).name} was trained on it: {what}; preparing the "
                           f"new dataset (fingerprint {plan.fingerprint[:12]}); the run's checkpoints will not "
                           "continue on it: restore the files, or start a new run.name to train on them")


def write(run_dir: Path, plan) -> None:
    """Record what the run's dataset of this fingerprint is made from (atomically, once)."""
    path = Path(run_dir) / RECORDS / f"{plan.fingerprint}.json"
    if not path.is_file():
        io.write_bytes(path, json.dumps(record(plan), sort_keys=True).encode())


def check_trained_on(path, trained: str | None, data, run_dir: Path) -> None:
    """A checkpoint (at `path`, trained on the dataset of fingerprint `trained`) continues only on that dataset:
    one line naming both fingerprints and, where the run's records know it, what changed."""
    if trained == data.fingerprint:
        return
    what = what_changed(run_dir, trained, data.fingerprint)
    raise UserError(f"{io.shown(path)}: trained on a dataset with fingerprint {str(trained)[:12]}, but "
                    f"{io.shown(data.path)} now has "
                    f"{data.fingerprint[:12]} (images added, removed or changed, or captions edited"
                    f"{': ' + what if what else ''}); restore them, or start a new run.name to train on the new set")
