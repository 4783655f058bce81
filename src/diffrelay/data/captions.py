"""Captions of a dataset (data.captions): read while planning, indexed into unique texts, written as captions.json
beside the images, picked one per row at each training step.

Sources:
  auto, a folder: beside each image `name.txt`, else `name.caption` (kohya's default); each non-empty line is one
    caption. When the folder holds metadata.jsonl at its root (Hugging Face's imagefolder), that instead: one JSON
    object a line with data.file_column (the image, relative to the folder) and data.caption_column (a string or a
    list of strings).
  auto, shapes: generated, two wordings of what each image holds (shapes.captions: "a red circle top left").
  a .csv, .parquet or .jsonl table of data.file_column and data.caption_column; a relative table path is read from
    the current folder, the files it names from data.path. A file may have several rows (several captions).
Every image needs a caption; each is stripped of surrounding whitespace; a UTF-8 byte order mark is accepted.

Held out, never trained on: data.val_path, a folder captioned the `auto` way (its sidecars or metadata.jsonl), or
data.val_fraction: an image is held out when sha256("<data.seed>/<name>") is among the k smallest of the set, with
name its path relative to data.path (a shapes image: its index) and k = round(fraction x n) clamped to [1, n - 1].
The choice depends on the names and the seed alone (not on the process count or the listing order), and adding
images moves at most the images next to the boundary.

captions.json: {"texts": [...], "rows": [[text ids of row 0], ...]}: texts are unique, texts[0] == "" (the empty
caption, for dropout and guidance), the others in order of first appearance (files in sorted order, each file's
captions in source order); text id = position in texts. The held-out split has its own in val/.
"""

import csv
import dataclasses
import hashlib
import io as text_io
import json
import math
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from diffrelay import io
from diffrelay.data import shapes, subsets
from diffrelay.errors import UserError

FORMAT = "captions/1"
FILE = "captions.json"
VAL = "val"  # the held-out split's folder inside the dataset
SIDECARS = (".txt", ".caption")
METADATA = "metadata.jsonl"
TABLES = (".csv", ".parquet", ".jsonl")
MAX_SIDECAR_BYTES = 1 << 20
MAX_TABLE_BYTES = 1 << 34
REBUILD = "rerun `diffrelay prepare --config <your config>`"


def config_problems(data: dict) -> list[tuple[str, str]]:
    """(key, message) of caption settings that contradict each other (config validation calls it)."""
    cap, fraction, val_path = data.get("captions", "none"), data.get("val_fraction", 0.0), data.get("val_path")
    bad = []
    if data.get("kind") == "shapes" and cap not in ("none", "auto"):
        bad.append((f"data.captions={cap}", "shapes make their own captions; use auto, or none"))
    elif cap not in ("none", "auto") and not cap.lower().endswith(TABLES):
        bad.append((f"data.captions={cap}", f"a caption table ends in {', '.join(TABLES)}; rename it, or use auto "
                    "(sidecar .txt/.caption files or metadata.jsonl) or none"))
    if cap == "none":
        for key, on in (("val_fraction", fraction > 0), ("val_path", bool(val_path)),
                        ("caption_dropout", data.get("caption_dropout", 0.0) > 0),
                        ("text_encoders", bool(data.get("text_encoders")))):
            if on:
                bad.append((f"data.{key}", "applies to captioned datasets only; set data.captions (auto or a table), "
                            "or drop it"))
    if fraction > 0 and val_path:
        bad.append((f"data.val_fraction={fraction}", "and data.val_path both hold images out; keep one"))
    if data.get("kind") == "shapes" and val_path:
        bad.append((f"data.val_path={val_path}", "shapes hold images out with data.val_fraction; drop it"))
    return bad


# ---------------------------------------------------------------- reading

def read_text(path: Path, what: str, fix: str, max_bytes: int = MAX_SIDECAR_BYTES) -> str:
    """A UTF-8 text file (a leading byte order mark dropped); one line naming the byte that is not UTF-8."""
    io.check_regular_file(path, max_bytes, what, fix)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror}); {io.advice(e)}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}: line {line}: not UTF-8 text (byte offset {e.start}: {e.reason}); save the file "
                        "as UTF-8") from e
    return text.removeprefix("\ufeff")


def sidecar(root: Path, rel: str) -> list[str] | None:
    """The captions of image `rel` from name.txt, else name.caption; None when neither is there."""
    stem = (root / rel).with_suffix("")
    for ext in SIDECARS:
        path = stem.with_name(stem.name + ext)
        if path.exists() or path.is_symlink():  # a dangling link is reported by read_text
            text = read_text(path, "caption file", "write the caption, one a line")
            found = [line.strip() for line in text.split("\n")]
            if not any(found):
                raise UserError(f"{path}: line 1: empty caption (the file holds only whitespace); write the caption, "
                                "one a line, or remove the image")
            return [c for c in found if c]
    return None


def _jsonl(path: Path):
    text = read_text(path, "caption table", "check data.captions", MAX_TABLE_BYTES)
    for no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {no}: not valid JSON ({e.msg} at column {e.colno}); fix the line") from e
        if not isinstance(record, dict):
            raise UserError(f"{path}: line {no}: not a JSON object; write one object a line, "
                            '{"file_name": "a.png", "text": "a cat"}')
        yield f"line {no}", record


def _csv(path: Path):
    # The csv module, not pandas: it knows the line each record starts on, even with newlines inside quotes.
    reader = csv.reader(text_io.StringIO(read_text(path, "caption table", "check data.captions", MAX_TABLE_BYTES),
                                         newline=""), strict=True)
    try:
        header, first = [c.strip() for c in next(reader, [])], reader.line_num + 1
        for row in reader:
            if row and len(row) != len(header):
                raise UserError(f"{path}: line {first}: {len(row)} fields where the header has {len(header)}; fix the "
                                "line (quote a field that holds a comma)")
            if row:
                yield f"line {first}", dict(zip(header, row))
            first = reader.line_num + 1
    except csv.Error as e:
        raise UserError(f"{path}: line {reader.line_num}: not valid CSV ({e}); fix the line") from e


def _parquet(path: Path):
    import pandas as pd
    import pyarrow as pa

    io.check_regular_file(path, MAX_TABLE_BYTES, "caption table", "check data.captions")
    try:
        table = pd.read_parquet(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise UserError(f"{path}: not a readable Parquet file ({e}); rewrite it, e.g. with pandas' to_parquet") from e
    for i, record in enumerate(table.to_dict("records"), 1):
        yield f"row {i}", record


def caption_list(value, path: Path, where: str, column: str) -> list[str]:
    if isinstance(value, np.ndarray):  # a Parquet list column
        value = value.tolist()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise UserError(f"{path}: {where}: '{column}' is an empty list; give at least one caption, or remove the row")
    out = []
    for v in values:
        if not isinstance(v, str):
            raise UserError(f"{path}: {where}: '{column}' holds {type(v).__name__} {str(v)[:40]!r}, not text; write "
                            "the caption as a string or a list of strings")
        if not v.strip():
            raise UserError(f"{path}: {where}: empty caption (only whitespace) in '{column}'; write the caption, or "
                            "remove the row")
        out.append(v.strip())
    return out


def records(path: Path):
    """(where, record) of each row of a .csv, .parquet or .jsonl table, by its extension."""
    return {".csv": _csv, ".parquet": _parquet}.get(path.suffix.lower(), _jsonl)(path)


def table(path: Path, root: Path, rels, file_col: str, cap_col: str, key: str) -> dict[str, list[str]]:
    """{relative image path: its captions} from a .csv, .parquet or .jsonl table (metadata.jsonl is one)."""
    ext = path.suffix.lower()
    if ext not in TABLES:
        raise UserError(f"{path}: data.captions: a caption table ends in {', '.join(TABLES)}; rename it")
    known, got = set(rels), {}
    for where, record in records(path):
        for col, setting, what in ((file_col, "file_column", "images"), (cap_col, "caption_column", "captions")):
            if col not in record:
                raise UserError(f"{path}: {where}: no column '{col}' (columns: {', '.join(map(str, record))}); set "
                                f"data.{setting} to the one that holds the {what}")
        name = record[file_col]
        rel = PurePosixPath(name.strip()).as_posix() if isinstance(name, str) and name.strip() else None
        if rel not in known:
            raise UserError(f"{path}: {where}: {file_col} {str(name)[:200]!r} is not an image in {root} ({key}); "
                            f"fix the name (relative to {key}) or add the image")
        got.setdefault(rel, []).extend(caption_list(record[cap_col], path, where, cap_col))
    return got


def folder(root: Path, files, setting: str, file_col: str, cap_col: str, key: str = "data.path",
           subset_rels=(), subset_settings=()) -> tuple:
    """(source, [captions of each (rel, sha) of `files`]); an unreadable image (sha None: skipped) may have none.
    With data.subsets, each image's captions get its subset's trigger words (subsets.captions)."""
    rels = [f[0] for f in files]
    meta = root / METADATA
    if setting == "auto" and not (meta.exists() or meta.is_symlink()):
        source, found = "sidecars", [sidecar(root, rel) for rel in rels]
    else:
        path = meta if setting == "auto" else Path(setting).expanduser()
        source = METADATA if setting == "auto" else str(path.resolve())
        by = table(path, root, rels, file_col, cap_col, key)
        found = [by.get(rel) for rel in rels]
    if subset_rels:
        which = subsets.of_rels(rels, list(subset_rels))
        found = [subsets.captions(caps, subset_settings[k]) for caps, k in zip(found, which)]
    for (rel, sha), caps in zip(files, found):
        if caps is None and sha is not None:
            stem = Path(rel).with_suffix("").name
            why = (f"{stem}.txt or {stem}.caption not found beside it; write one" + (
                   ", give its data.subsets entry class_tokens" if subset_rels else "") if source == "sidecars" else
                   f"no row of {path} names it in column '{file_col}'; add one")
            raise UserError(f"{root / rel}: no caption ({why}, or remove the image)")
    return source, [caps or [] for caps in found]


# ---------------------------------------------------------------- planning

def held_out(names: list[str], fraction: float, seed: int, key: str) -> list[int]:
    """Positions of the held-out images (sorted): the module docstring's rule."""
    n = len(names)
    if fraction <= 0:
        return []
    if n < 2:
        raise UserError(f"{key}: data.val_fraction={fraction} needs at least 2 images (one held out, one to train); "
                        f"there is {n}; add images or set data.val_fraction: 0")
    k = min(n - 1, max(1, math.floor(fraction * n + 0.5)))
    order = sorted(range(n), key=lambda i: hashlib.sha256(f"{seed}/{names[i]}".encode()).digest())
    return sorted(order[:k])


def index(per_row) -> tuple[tuple, tuple]:
    """(texts, rows): the unique captions, "" first, and each row's caption ids."""
    ids = {"": 0}
    rows = tuple(tuple(ids.setdefault(c, len(ids)) for c in caps) for caps in per_row)
    return tuple(ids), rows


def _top(rel: str):
    return rel.split("/")[0] if "/" in rel else None


def _check_classes(p, files, val_files, val_root, folder_labels) -> None:
    """Held-out images of a labelled folder must belong to the training set's classes."""
    names = folder_labels([f[0] for f in files])[1]
    if val_root is None:
        lost = sorted(set(folder_labels([f[0] for f in p.files])[1]) - {_top(f[0]) for f in files})
        if lost:
            rel = next(f[0] for f in val_files if _top(f[0]) == lost[0])
            raise UserError(f"{p.root / rel}: held out by data.val_fraction, which leaves class '{lost[0]}' no "
                            "training image; add images to it, or lower data.val_fraction")
        return
    for rel, _ in val_files if names else ():
        if _top(rel) not in names:
            raise UserError(f"{val_root / rel}: data.val_path image outside the classes of data.path "
                            f"({', '.join(names)}); put it in a subfolder named as its class, or set data.labels: none")


def attach(p, data, hash_files, folder_labels):
    """Plan `p` (datasets.Plan, uncaptioned, of every source image) with its captions and held-out split; its
    fingerprint then covers them. Captions none returns `p` as it is: those fingerprints stay as they were.
    (datasets' hash_files and folder_labels come as arguments: that module imports this one.)"""
    if getattr(data, "captions", "none") == "none":
        return p
    fraction, val_root, split = data.val_fraction, None, {}
    if p.kind == "shapes":
        held = held_out([str(i) for i in range(p.count)], fraction, p.seed, "data.count")
        gone = set(held)
        files = tuple((i,) for i in range(p.count) if i not in gone) if held else ()  # () = all
        val_files = tuple((i,) for i in held)
        source = f"shapes/{shapes.CAPTIONS_VERSION}"
        per, val_per = ([shapes.captions(p.seed, f[0], p.resolution) for f in fs]
                        for fs in (files or [(i,) for i in range(p.count)], val_files))
    else:
        source, per = folder(p.root, p.files, data.captions, data.file_column, data.caption_column,
                             subset_rels=p.subsets, subset_settings=p.subset_settings)
        if data.val_path:
            val_root = Path(data.val_path).expanduser()
            a, b = p.root.resolve(), val_root.resolve()
            if a == b or a in b.parents or b in a.parents:
                raise UserError(f"{val_root}: data.val_path overlaps data.path ({p.root}), so held-out images would be "
                                "trained on; give a separate folder")
            files, val_files, split = p.files, hash_files(val_root, p.on_corrupt, "data.val_path"), {"path": 1}
            val_per = folder(val_root, val_files, "auto", data.file_column, data.caption_column, "data.val_path")[1]
        else:
            gone = set(held_out([f[0] for f in p.files], fraction, data.seed, "data.path"))
            files, val_files = (tuple(f for i, f in enumerate(p.files) if (i in gone) == v) for v in (False, True))
            per, val_per = ([c for i, c in enumerate(per) if (i in gone) == v] for v in (False, True))
        if p.labels == "auto":
            _check_classes(p, files, val_files, val_root, folder_labels)
    if fraction > 0 and not data.val_path:
        split = {"fraction": fraction, "seed": data.seed}
    texts, rows = index(per)
    val_texts, val_rows = index(val_per) if val_files else ((), ())
    kind = source if source in ("sidecars", METADATA) or source.startswith("shapes") else "table"
    part = {"format": FORMAT, "source": kind, "texts": texts, "rows": rows, "split": split,
            "val": {"files": val_files, "texts": val_texts, "rows": val_rows}}
    digest = hashlib.sha256(json.dumps({"pixels": p.fingerprint, "captions": part}, sort_keys=True,
                                       separators=(",", ":")).encode()).hexdigest()  # as datasets._digest
    return dataclasses.replace(
        p, fingerprint=digest, files=files, texts=texts,
        caption_rows=rows, val_files=val_files, val_texts=val_texts, val_caption_rows=val_rows,
        val_root=None if val_root is None else str(val_root), caption_source=source)


# ---------------------------------------------------------------- writing

def val_plan(p):
    """The plan of the held-out split's pixels: its images, with its captions, nothing held out of it."""
    root = p.root if p.val_root is None else Path(p.val_root)
    return dataclasses.replace(
        p, files=p.val_files, root=root, source=str(root.resolve()) if root else p.source, texts=p.val_texts,
        caption_rows=p.val_caption_rows, val_files=(), val_texts=(), val_caption_rows=(), val_root=None, latent=None,
        xflip=False, keep_images=True, buckets=(), bucket_of=(), bucket_settings=None,  # held-out images: squares
        subsets=(), subset_settings=(), too_small=(), random_crop=False)


def label_of(rels, class_names, where: Path) -> tuple[list[int], list]:
    """(labels, class_names) of held-out images by the training set's class names (their first-level subfolder)."""
    if not class_names:
        return [0] * len(rels), class_names
    index_of = {n: i for i, n in enumerate(class_names)}
    for rel in rels:
        if _top(rel) not in index_of:
            raise UserError(f"{where / rel}: held-out image of class '{_top(rel)}', which no readable training image "
                            f"has (classes: {', '.join(class_names)}); fix the unreadable images, or move it")
    return [index_of[_top(rel)] for rel in rels], class_names


def write(p, out: Path, rels, build, workers: int, class_names) -> dict:
    """captions.json of the rows kept (`rels`: their relative paths; None for shapes), and the held-out split in
    val/ made by datasets.build (pixels, latent runs too: they are scored as images); dataset.json's entry."""
    val_count = 0
    if p.val_files:
        # Spawned decoders: prepare may run gloo's or CUDA's threads here (runtime/parallel.py).
        val_count = build(val_plan(p), out / VAL, workers, "spawn", class_names)["count"]
    if p.kind == "shapes":
        rows = p.caption_rows
    else:
        by = dict(zip((f[0] for f in p.files), p.caption_rows))
        rows = [by[rel] for rel in rels]
    io.write_text(out / FILE, json.dumps({"texts": list(p.texts), "rows": [list(r) for r in rows]},
                                         separators=(",", ":")))
    return {"source": p.caption_source, "texts": len(p.texts), "rows": len(rows), "val": val_count}


@dataclass(frozen=True)
class Captions:
    """A dataset's captions: `texts`, and row r's text ids ids[starts[r]:starts[r + 1]] (CSR)."""

    texts: list
    starts: np.ndarray  # int64 (N + 1,)
    ids: np.ndarray  # int64

    def pick(self, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
        """One caption id per dataset row: ids[starts[r] + floor(u * n_r)], u uniform in [0, 1) from the step's
        generator; a row with no caption gets 0, the empty caption."""
        rows = np.asarray(rows, dtype=np.int64)
        n = self.starts[rows + 1] - self.starts[rows]
        k = np.minimum(np.floor(np.asarray(u, dtype=np.float64) * n).astype(np.int64), np.maximum(n - 1, 0))
        at = np.where(n > 0, self.starts[rows] + k, 0)
        return np.where(n > 0, self.ids[at] if len(self.ids) else 0, 0).astype(np.int64)

    def of(self, row: int) -> list[str]:
        return [self.texts[i] for i in self.ids[self.starts[row]:self.starts[row + 1]]]


def open_file(path: Path, count: int) -> Captions:
    """captions.json, checked against the dataset's row count."""
    d = io.read_json(path, max_bytes=MAX_TABLE_BYTES)
    texts, rows = (d.get("texts"), d.get("rows")) if isinstance(d, dict) else (None, None)
    ok = (isinstance(texts, list) and texts[:1] == [""] and all(isinstance(t, str) for t in texts)
          and isinstance(rows, list) and len(rows) == count and all(isinstance(r, list) for r in rows))
    if ok:
        ids = np.fromiter((i for r in rows for i in r), dtype=np.int64) if all(
            type(i) is int for r in rows for i in r) else np.array([-1])
        ok = not len(ids) or (ids.min() >= 0 and ids.max() < len(texts))
    if not ok:
        raise UserError(f"{path}: does not match the dataset (needs texts starting with \"\", {count} rows of text "
                        f"ids); {REBUILD}")
    starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=starts[1:])
    return Captions(texts, starts, ids)
