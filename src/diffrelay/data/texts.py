"""A few of a text run's own texts, read cheaply before any job: its prompt files' prompts, then the captions of
data.path (and data.val_path) as prepare reads them (captions.py). `diffrelay validate` and Snakemake's parse show them
to each text encoder's tokenizer (text/tokens.py), which must spell them as more than unknown tokens.

Only the first rows of a table are read, and the first images' sidecars: a file that cannot be read is skipped
here, as prepare and the sampling jobs name it in their own line.
"""

import csv
import json
import os
from itertools import islice
from pathlib import Path

from diffrelay.errors import UserError

LIMIT = 64


def sample(d: dict, limit: int = LIMIT) -> list[str]:
    """Up to `limit` texts of the run's config `d` (validated): half prompts at most, the rest captions."""
    from diffrelay.data import prompts

    out = []
    for f in [] if d["sample"].get("prompts") is None else [d["sample"]["prompts"]] if isinstance(
            d["sample"]["prompts"], str) else d["sample"]["prompts"]:
        try:
            entries = prompts.read(f)
        except UserError:
            continue
        out += [t for e in entries for t in (e.prompt, e.negative_prompt) if t]
    out = out[:limit // 2]
    data = d["data"]
    for root, setting in ((data.get("path"), data["captions"]), (data.get("val_path"), "auto")):
        if len(out) < limit and (root or data["kind"] == "shapes"):
            try:
                out += list(islice(_captions(data, root, setting), limit - len(out)))
            except (UserError, OSError, ValueError):
                continue
        if data["kind"] == "shapes":
            break
    return out


def _captions(data: dict, root, setting: str):
    from diffrelay.data import captions, shapes

    if data["kind"] == "shapes":
        for i in range(data["count"]):
            yield from shapes.captions(data["seed"], i, data["resolution"])
        return
    root = Path(root).expanduser()
    table = root / captions.METADATA if setting == "auto" else Path(setting).expanduser()
    if setting == "auto" and not table.is_file():
        for rel in _images(root):
            try:
                yield from captions.sidecar(root, rel) or []
            except UserError:
                continue
        return
    column, suffix = data["caption_column"], table.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(table).iter_batches(batch_size=LIMIT, columns=[column]), None)
        rows = [] if batch is None else [{column: v} for v in batch.column(0).to_pylist()]
    else:
        with open(table, encoding="utf-8-sig", newline="") as f:
            rows = list(islice(csv.DictReader(f) if suffix == ".csv" else map(_json, f), LIMIT))
    for row in rows:
        value = row.get(column) if isinstance(row, dict) else None
        yield from (v.strip() for v in (value if isinstance(value, list) else [value]) if isinstance(v, str))


def _json(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def _images(root: Path):
    """Relative paths of the first images under `root` in the folder's own order (not sorted: a million names would
    cost a second at every parse), prepare's extensions, hidden ones left out."""
    from diffrelay.data.files import EXTENSIONS

    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith(".") and name.lower().endswith(EXTENSIONS):
                yield os.path.relpath(os.path.join(dirpath, name), root)


def check_tokenizers(d: dict) -> None:
    """Each text encoder's tokenizer (data.text_encoders) spells the run's own texts, before prepare loads it; one
    line naming the tokenizer's folder if not (text/tokens.py)."""
    if d["data"]["captions"] != "none" and d["data"]["text_encoders"]:
        from diffrelay.text import tokens

        tokens.check_entries(d["data"]["text_encoders"], sample(d))
