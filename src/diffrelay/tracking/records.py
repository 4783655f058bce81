"""What a run folder holds for the trackers, read from the files its jobs wrote (never from a live process):

- training records of metrics/train.jsonl up to the last finished segment (trained/step_X.json), one per step:
  a killed and resumed segment logs its steps after the last recovery checkpoint again, and the last record of
  a step (the run that went on) wins;
- every evaluation's scores (metrics/fid/<folder>.json; a snapshot's held-out loss, metrics/val_loss/, in `main`) and grid (samples/<folder>/grid.png), each under a
  series named by the folder's variant suffix (evaluation/protocol.py): `main` for the plain folder, else the
  suffix without its underscore (g1.5, ema0.08, n50000_g1.5_s1, p1 ...). The scores are metrics.csv's score
  columns, read as the report reads them (evaluation/columns.py), so every one reaches the trackers under its
  column's name; a value that is not a finite number is kept out and named (`Records.rejected`);
- the snapshots' sha256 by step, from the sample folders' manifests (no snapshot is hashed again here).
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from diffrelay import logs
from diffrelay.evaluation import columns, protocol

TRAIN_KEYS = ("loss", "lr", "grad_norm", "images_per_s", "steps_per_s", "skipped")


@dataclass
class Records:
    train: dict = field(default_factory=dict)  # step -> {key: value}
    evals: dict = field(default_factory=dict)  # (series, step) -> {metric: value}
    grids: dict = field(default_factory=dict)  # (series, step) -> grid.png path
    snapshots: dict = field(default_factory=dict)  # step -> sha256
    trained_until: int = 0
    # When each value was recorded, ms since the epoch: ("train", step) -> train.jsonl's time, (series, step) ->
    # the score file's `finished`. MLflow stamps metrics with them, so a re-sent metric is an exact duplicate.
    times: dict = field(default_factory=dict)
    # (series, step) -> (score file, {metric: value}) of the values no tracker can take (not finite numbers)
    rejected: dict = field(default_factory=dict)


def series_of(variant: str) -> str:
    return variant.lstrip("_") or "main"


def _folder(stem: str):
    """(series, step) of an evaluation's name (step_0000400_g1.5), or None for other files."""
    m = protocol.STEP_STEM.match(stem)
    return (series_of(m.group(2)), int(m.group(1))) if m else None


def _number(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def trained_until(run_dir: Path) -> int:
    """The last step of a finished segment of this run (its trained/step_X.json record), 0 before any."""
    steps = [int(p.stem[5:]) for p in (run_dir / "trained").glob("step_*.json") if p.stem[5:].isdigit()]
    return max(steps, default=0)


def train_records(run_dir: Path, until: int, times: dict | None = None) -> dict:
    """step -> the tracked values of its last record, for steps <= until (finished segments only); `times`
    gets ("train", step) -> that record's time in ms."""
    out = {}
    times = {} if times is None else times
    for r in logs.read_jsonl(run_dir / "metrics" / "train.jsonl"):
        step = r.get("step")
        if "event" in r or not isinstance(step, int) or step > until or "loss" not in r:
            continue
        values = {k: _number(r.get(k)) for k in TRAIN_KEYS}
        out[step] = {k: v for k, v in values.items() if v is not None}
        times[("train", step)] = _ms(r.get("time"))
    return dict(sorted(out.items()))


def _ms(seconds) -> int:
    return int(round(_number(seconds) * 1000)) if _number(seconds) is not None else 0


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def score_values(result: dict) -> tuple[dict, dict]:
    """(metric -> value, metric -> rejected value) of one score file: each value metrics.csv has of it
    (evaluation/columns.py), the primary extractor's row under its column's name (fid, kid, ..., clip_score),
    another extractor's as <column>_<its reference file's stem>. A value that is not a finite number (NaN, a
    string) goes to the second dict; one that is absent (None: not computed) to neither."""
    try:
        entries = columns.entries(result)
    except ValueError:
        return {}, {}  # not a score file's shape: `diffrelay report` refuses it with one line
    out, bad = {}, {}
    for i, entry in enumerate(entries):
        tag = "" if i == 0 else "_" + _slug(Path(str(entry.get("reference") or entry.get("extractor") or "extra")).stem)
        for k, v in columns.values(result, entry, i == 0).items():
            if v is None:
                continue
            name = f"{k}{tag}" if f"{k}{tag}" not in out | bad else f"{k}{tag}_{i}"  # two references of one stem
            if _number(v) is None:
                bad[name] = v
            else:
                out[name] = _number(v)
    return out, bad


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # written atomically by its job: unreadable means not ours to publish yet


def collect(run_dir, until: int | None = None) -> Records:
    """Everything the trackers may get from `run_dir` now. `until` caps the training records (default: the
    last finished segment)."""
    run_dir = Path(run_dir)
    rec = Records(trained_until=trained_until(run_dir) if until is None else until)
    rec.train = train_records(run_dir, rec.trained_until, rec.times)
    for path in sorted((run_dir / "metrics" / "fid").glob("step_*.json")):
        key, result = _folder(path.stem), _read_json(path)
        if not key or not isinstance(result, dict):
            continue
        values, bad = score_values(result)
        if values or bad:  # a file of rejected values only is sent as nothing, so it is named once
            rec.evals[key] = values
            rec.times[key] = _ms(result.get("finished"))
        if bad:
            rec.rejected[key] = (str(path), bad)
    for path in sorted((run_dir / "metrics" / "val_loss").glob("step_*.json")):  # a snapshot's held-out loss
        key, result = _folder(path.stem), _read_json(path)
        if key and isinstance(result, dict):
            for k, v in columns.step_values(result).items():
                if v is not None and _number(v) is None:
                    rec.rejected.setdefault(key, (str(path), {}))[1][k] = v
                elif v is not None:
                    rec.evals.setdefault(key, {})[k] = _number(v)
            rec.times.setdefault(key, _ms(result.get("finished")))
    for folder in sorted((run_dir / "samples").glob("step_*")):
        key = _folder(folder.name)
        manifest = _read_json(folder / "manifest.json") if key else None
        if not isinstance(manifest, dict):
            continue  # unfinished (no manifest yet)
        if (folder / "grid.png").is_file():
            rec.grids[key] = str(folder / "grid.png")
        sha = manifest.get("snapshot_sha256")
        if isinstance(sha, str) and not key[0].startswith("ema"):  # a post-hoc EMA file is not the snapshot
            rec.snapshots.setdefault(key[1], sha)
    return rec
