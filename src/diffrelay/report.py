"""`diffrelay report`: metrics.csv, fid.png, loss.png, best.json and best_grid.png from a run folder.

Example:
  diffrelay report --run-dir results/demo --out results/demo/report

metrics.csv has one row per evaluated step. train_loss_mean and train_images_per_s average the
training records logged after the previous evaluated step, up to and including this one (a resumed
segment's repeated steps count once, the last record wins). The *_s columns are wall-clock seconds
as each stage logged them: train_segment_s is the training loop of the segment holding the step
(no start-up or queueing), sample_s and fid_s the "seconds" of the sample manifest and FID result.
"""

import math
import re
from io import BytesIO
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from diffrelay import io, logs
from diffrelay.errors import UserError

STEP_FILE = re.compile(r"^step_(\d{7})\.json$")
COLUMNS = ["step", "metric", "fid", "kid", "precision", "recall", "train_loss_mean", "train_skipped_steps", "train_images_per_s",
           "train_segment_s", "sample_s", "sample_images_per_s", "fid_s"]


def step_name(step: int) -> str:
    return f"step_{step:07d}"


# ---- Reading the run folder ---------------------------------------------------------------------

def _number(rec: dict, key: str, path: Path, required: bool = True) -> float:
    v = rec.get(key)
    if v is None and not required:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserError(f"{path}: {key}={v!r}: missing or not a number; regenerate this file")
    return float(v)


def _seconds(rec: dict, path: Path) -> float:
    """Wall time of a stage: its "seconds", else finished - started, else unknown (NaN)."""
    if rec.get("seconds") is not None:
        return _number(rec, "seconds", path)
    if rec.get("started") is not None and rec.get("finished") is not None:
        return _number(rec, "finished", path) - _number(rec, "started", path)
    return math.nan


def read_fid(run_dir: Path) -> pd.DataFrame:
    """One row per metrics/fid/step_XXXXXXX.json: step, metric, fid, kid, fid_s."""
    folder = run_dir / "metrics" / "fid"
    files = sorted(p for p in folder.glob("step_*.json") if STEP_FILE.match(p.name)) if folder.is_dir() else []
    if not files:
        raise UserError(f"{folder}: no FID results yet (no step_XXXXXXX.json); "
                        "run the workflow (or `diffrelay fid`) for at least one checkpoint first")
    rows = []
    for path in files:
        rec = io.read_json(path)
        if not isinstance(rec, dict):
            raise UserError(f"{path}: expected a JSON object; regenerate it with `diffrelay fid`")
        metric = rec.get("metric")
        if not isinstance(metric, str) or not metric:
            raise UserError(f"{path}: metric={metric!r}: missing; regenerate it with `diffrelay fid`")
        rows.append({"step": int(STEP_FILE.match(path.name).group(1)), "metric": metric,
                     "fid": _number(rec, "fid", path), "kid": _number(rec, "kid", path, required=False),
                     "precision": _number(rec, "precision", path, required=False),
                     "recall": _number(rec, "recall", path, required=False),
                     "fid_s": _seconds(rec, path)})
    return pd.DataFrame(rows).sort_values("step", ignore_index=True)


def read_train(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(training records by step, segments with start, end and seconds) from metrics/train.jsonl."""
    path = run_dir / "metrics" / "train.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: not found; the report needs the training log of the run (train a segment first)")
    records = logs.read_jsonl(path)  # a torn last line from a killed writer is skipped
    # A window whose every step was skipped (non-finite) logs loss null: kept as NaN, never as 0.
    train = [r | {"loss": math.nan if r.get("loss") is None else r["loss"]} for r in records
             if "event" not in r and isinstance(r.get("step"), int)
             and (isinstance(r.get("loss"), (int, float)) or (r.get("loss") is None and "skipped" in r))]
    if not train:
        raise UserError(f"{path}: no training records (step, loss); the file is empty or corrupt")
    df = pd.DataFrame(train).drop_duplicates("step", keep="last").sort_values("step", ignore_index=True)
    for col in ("images_per_s", "skipped", "skipped_in_window"):
        if col not in df:
            df[col] = math.nan

    # Pair each segment_end with the latest segment_start before it; a crashed segment has no end.
    def num(rec, key):
        v = rec.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan

    segments, start = [], None
    for r in (r for r in records if isinstance(r.get("step"), int)):
        if r.get("event") == "segment_start":
            start = r
        elif r.get("event") == "segment_end" and start is not None:
            secs = num(r, "seconds")
            if math.isnan(secs):
                secs = num(r, "time") - num(start, "time")
            segments.append({"start": start["step"], "end": r["step"], "seconds": secs})
            start = None
    return df, pd.DataFrame(segments, columns=["start", "end", "seconds"])


def read_sample_manifest(run_dir: Path, step: int) -> dict:
    path = run_dir / "samples" / step_name(step) / "manifest.json"
    if not path.is_file():
        raise UserError(f"{path}: not found, although metrics/fid/{step_name(step)}.json exists; "
                        f"sample that snapshot again (diffrelay sample) or delete the stale FID result")
    rec = io.read_json(path)
    if not isinstance(rec, dict):
        raise UserError(f"{path}: expected a JSON object; sample that snapshot again")
    return {"sample_s": _seconds(rec, path), "num_images": _number(rec, "num_images", path, required=False)}


# ---- Putting it together ------------------------------------------------------------------------

def build_table(fid: pd.DataFrame, train: pd.DataFrame, segments: pd.DataFrame, run_dir: Path) -> pd.DataFrame:
    rows, prev = [], -1
    for r in fid.itertuples(index=False):
        window = train[(train.step > prev) & (train.step <= r.step)]
        seg = segments[(segments.start < r.step) & (segments.end >= r.step)]
        sample = read_sample_manifest(run_dir, r.step)
        rows.append({
            "step": r.step, "metric": r.metric, "fid": r.fid, "kid": r.kid, "precision": r.precision,
            "recall": r.recall,
            "train_loss_mean": window.loss.mean() if len(window) else math.nan,
            # Updates skipped for non-finite loss or gradients since the start of the run, up to this step.
            "train_skipped_steps": train[train.step <= r.step].skipped.iloc[-1] if (train.step <= r.step).any()
            else math.nan,
            "train_images_per_s": window.images_per_s.mean() if len(window) else math.nan,
            "train_segment_s": seg.seconds.iloc[-1] if len(seg) else math.nan,
            "sample_s": sample["sample_s"],
            "sample_images_per_s": sample["num_images"] / sample["sample_s"] if sample["sample_s"] > 0 else math.nan,
            "fid_s": r.fid_s,
        })
        prev = r.step
    return pd.DataFrame(rows, columns=COLUMNS)


def best_row(table: pd.DataFrame) -> pd.Series:
    """Lowest value among results with the newest step's metric (FID and FD are not comparable)."""
    same = table[(table.metric == table.metric.iloc[-1]) & table.fid.notna()]
    if same.empty:
        raise UserError(f"every {table.metric.iloc[-1]} value in metrics/fid is NaN; the samples are broken "
                        "(check the training loss) and no step can be called best")
    return same.loc[same.fid.idxmin()]


def _save_png(fig: Figure, path: Path) -> None:
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    io.write_bytes(path, buf.getvalue())


def plot_fid(table: pd.DataFrame, best: pd.Series, run_name: str, path: Path) -> None:
    fig = Figure(figsize=(6.4, 4), layout="constrained")
    ax = fig.add_subplot()
    metrics = list(dict.fromkeys(table.metric))
    for m in metrics:
        part = table[table.metric == m]
        ax.plot(part.step, part.fid, marker="o", label=m)
    ax.plot([best.step], [best.fid], marker="*", markersize=16, color="tab:red", linestyle="none",
            label=f"best: {best.fid:.4g} at step {best.step}")
    label = metrics[0] if len(metrics) == 1 else " / ".join(metrics)
    ax.set(xlabel="training step", ylabel=label, title=f"{run_name}: {label} by training step (lower is better)")
    ax.set_xlim(left=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    ax.grid(alpha=0.3)
    ax.legend()
    _save_png(fig, path)


def plot_loss(train: pd.DataFrame, segments: pd.DataFrame, run_name: str, path: Path) -> None:
    fig = Figure(figsize=(6.4, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(train.step, train.loss, color="tab:blue", alpha=0.35, linewidth=1, label="logged (mean per log interval)")
    window = min(len(train), max(3, len(train) // 20))
    smooth = train.loss.rolling(window, min_periods=1, center=True).mean()
    ax.plot(train.step, smooth, color="tab:blue", linewidth=2, label=f"smoothed ({window}-record moving mean)")
    for i, end in enumerate(segments.end.iloc[:-1] if len(segments) else []):
        ax.axvline(end, color="gray", linestyle=":", linewidth=1, label="segment end" if i == 0 else None)
    skipped = train[train.skipped_in_window.fillna(0) > 0]
    for i, step in enumerate(skipped.step):
        ax.axvline(step, color="tab:red", alpha=0.5, linewidth=1,
                   label="window with skipped (non-finite) steps" if i == 0 else None)
    total = train.skipped.dropna().iloc[-1] if train.skipped.notna().any() else 0
    title = f"{run_name}: training loss" + (f" ({int(total)} steps skipped)" if total else "")
    ax.set(xlabel="training step", ylabel="EDM training loss (weighted MSE)", title=title)
    ax.set_xlim(left=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    ax.grid(alpha=0.3)
    ax.legend()
    _save_png(fig, path)


def main_collect(args) -> int:
    """`diffrelay collect`: the per-segment aggregate the workflow's report waits for."""
    logs.setup()
    io.write_json(args.out, {"scores": sorted(map(str, args.scores))})
    return 0


def main(args) -> int:
    log = logs.setup()
    run_dir, out = Path(args.run_dir), Path(args.out)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: run folder not found; pass --run-dir results/<run>")

    # Read and check everything before writing anything.
    fid = read_fid(run_dir)
    train, segments = read_train(run_dir)
    table = build_table(fid, train, segments, run_dir)
    best = best_row(table)
    grid = run_dir / "samples" / step_name(best.step) / "grid.png"
    if not grid.is_file():
        raise UserError(f"{grid}: not found; sample step {best.step} again (diffrelay sample) to make its grid")

    io.write_text(out / "metrics.csv", table.to_csv(index=False, float_format="%.6g"))
    plot_fid(table, best, run_dir.name, out / "fid.png")
    plot_loss(train, segments, run_dir.name, out / "loss.png")
    io.write_bytes(out / "best_grid.png", grid.read_bytes())  # a copy, so `snakemake --report` can embed it
    io.write_json(out / "best.json", {
        "step": int(best.step), "metric": best.metric, "fid": float(best.fid),
        "kid": None if math.isnan(best.kid) else float(best.kid),
        "snapshot": str(run_dir / "snapshots" / f"{step_name(best.step)}.safetensors"),
        "samples": str(run_dir / "samples" / step_name(best.step)),
        "grid": str(out / "best_grid.png"),
    })
    log.info(f"report: {len(table)} evaluated step(s); best {best.metric} {best.fid:.4g} at step {best.step} -> {out}")
    return 0
