"""What each tracker has been sent, per run: results/<run>/track/ledger.json, written atomically after a
tracker took a batch. A tracker that failed keeps its old entry, so the next `track` job sends the backlog;
nothing in it is sent twice.

{"format": "diffrelay-track-ledger/1", "<tracker>": {"run_id": "<tracker run id>", "destination": "<digest of
 where it was sent>", "train": [steps], "evals": [[series, step]], "grids": [[series, step]],
 "config": "<sha256 of the config sent>"}}

An entry holds only for its run id and destination: another W&B project or MLflow store (or a new run folder)
starts the entry afresh, so the new destination gets the whole backlog.
"""

import hashlib
import json
from pathlib import Path

from diffrelay import io

FORMAT = "diffrelay-track-ledger/1"


def empty(run_id: str | None = None, destination: str | None = None) -> dict:
    return {"run_id": run_id, "destination": destination, "train": [], "evals": [], "grids": [], "config": None}


def load(path) -> dict:
    """The ledger, or an empty one (none yet). A damaged file reads as empty: publishing then starts over,
    which sends duplicates but loses nothing (it is rewritten whole, atomically, so only a hand edit breaks it)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {"format": FORMAT}
    return d if isinstance(d, dict) and d.get("format") == FORMAT else {"format": FORMAT}


def entry(ledger: dict, tracker: str, run_id: str | None = None, destination: str | None = None) -> dict:
    """`tracker`'s entry, or an empty one where it was sent to another run id or destination."""
    old = ledger.get(tracker) or {}
    if old.get("run_id") != run_id or old.get("destination") != destination:
        return empty(run_id, destination)
    return {**empty(run_id, destination), **old}


def config_digest(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def pending(entry: dict, records, config: dict) -> dict:
    """What `records` holds that `entry` says was not sent: {"train": {step: values}, "evals": {(series, step):
    values}, "grids": {(series, step): path}, "config": config or None, "times": records.times}."""
    sent_evals = {tuple(x) for x in entry["evals"]}
    sent_grids = {tuple(x) for x in entry["grids"]}
    sent_train = set(entry["train"])
    return {"train": {s: v for s, v in records.train.items() if s not in sent_train},
            "evals": {k: v for k, v in records.evals.items() if k not in sent_evals},
            "grids": {k: v for k, v in records.grids.items() if k not in sent_grids},
            "config": config if entry["config"] != config_digest(config) else None, "times": records.times}


def count(batch: dict) -> int:
    return len(batch["train"]) + len(batch["evals"]) + len(batch["grids"]) + (batch["config"] is not None)


def advance(entry: dict, batch: dict) -> dict:
    """The entry after `batch` was sent."""
    return {"run_id": entry.get("run_id"), "destination": entry.get("destination"),
            "train": sorted(set(entry["train"]) | set(batch["train"])),
            "evals": sorted({tuple(x) for x in entry["evals"]} | set(batch["evals"])),
            "grids": sorted({tuple(x) for x in entry["grids"]} | set(batch["grids"])),
            "config": config_digest(batch["config"]) if batch["config"] is not None else entry["config"]}


def save(path, ledger: dict) -> None:
    io.write_json(path, {**ledger, "format": FORMAT})
