"""`diffrelay report`: metrics.csv, scores.md, fid.png, loss.png, best.json and best_grid.png from a run folder.

Example:
  diffrelay report --run-dir results/demo --out results/demo/report

metrics.csv has one row per evaluated (step, phema, ema_decay, guidance, metric); phema is the width of a
post-hoc EMA reconstruction (sample.phema), empty for the training's own EMA, and phema_error how far its
rebuilt profile is from that width (relative L2, training/profiles.py); ema_decay is the training EMA
sampled (sample.ema_decay), empty for the first of train.ema_decays. Each extractor of fid.extractors is its own
metric, and so is each image count ("FID-2k" of the first pass, "FID-50k" of the second): values of
different metrics are never averaged, compared or drawn on one curve. Result files are named by step and
variant (protocol.py: _n<images> of the second pass, _g<scale> of a guidance sweep, _s<set> of a seed
set, _<width>x<height> of sample.sizes: a `size` column, width x height in pixels, where a run has one); fid,
kid, precision, recall, sfid and is are means over the seed sets, fid_std and fid_min their standard
deviation and minimum. train_loss_mean and train_images_per_s average the
training records logged after the previous evaluated step, up to and including this one (a resumed
segment's repeated steps count once, the last record wins). The *_s columns are wall-clock seconds
as each stage logged them: train_segment_s is the training loop of the segment holding the step
(no start-up or queueing), sample_s and fid_s the "seconds" of the sample manifest and FID result.
"""

import math
import os
import re
from pathlib import Path

import pandas as pd

from diffrelay import io, logs
from diffrelay.evaluation import columns, protocol, refsize, tables
from diffrelay.evaluation.plots import family, plot_fid, plot_loss
from diffrelay.errors import UserError

STEP_FILE = re.compile(rf"^step_(\d{{7}})({protocol.VARIANT})\.json\Z")
# The score columns are columns.SCORES (fid first, then its spread over the seed sets), as the trackers send them.
COLUMNS = ["step", "phema", "phema_error", "ema_decay", "guidance", "metric", "num_images", "seed_sets", "fid", "fid_std",
           "fid_min", *columns.SCORES[1:], "train_loss_mean", "train_skipped_steps", "train_images_per_s",
           "train_segment_s", "sample_s", "sample_images_per_s", "fid_s"]
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
    """One row per score in metrics/fid/step_XXXXXXX<variant>.json (one per extractor): step, guidance, seed
    set, metric, its values, and the sample folder it scored."""
    folder = run_dir / "metrics" / "fid"
    files = sorted(p for p in folder.glob("step_*.json") if STEP_FILE.match(p.name)) if folder.is_dir() else []
    if not files:
        raise UserError(f"{folder}: no FID results yet (no step_XXXXXXX.json); "
                        "run the workflow (or `diffrelay fid`) for at least one checkpoint first")
    rows, held = [], read_val_loss(run_dir)
    for path in files:
        rec = io.read_json(path)
        if not isinstance(rec, dict):
            raise UserError(f"{path}: expected a JSON object; regenerate it with `diffrelay fid`")
        m = STEP_FILE.match(path.name)
        count, guidance, seed_set = protocol.parse_variant(m.group(2))
        ema = protocol.variant_ema(m.group(2))
        decay = protocol.variant_decay(m.group(2))
        prompts = protocol.variant_prompts(m.group(2))  # a text run's prompt file (sample.prompts k)
        size = protocol.variant_size(m.group(2))  # sample.sizes (None: the data.resolution square)
        try:  # files from before several extractors hold one score at the top
            scores = columns.entries(rec)
        except ValueError as e:
            raise UserError(f"{path}: {e}; regenerate it with `diffrelay fid`") from e
        for i, score in enumerate(scores):
            metric = score.get("metric")
            if not isinstance(metric, str) or not metric:
                raise UserError(f"{path}: metric={metric!r}: missing; regenerate it with `diffrelay fid`")
            rows.append({"step": int(m.group(1)), "phema": math.nan if ema is None else ema,
                         "ema_decay": math.nan if decay is None else decay, "guidance": guidance, "seed_set": seed_set, "metric": metric,
                         "primary": i == 0, "num_images": _number(rec, "num_images", path, required=False),
                         # every score column (a text run's CLIP score on the primary row): as the trackers read it
                         **{k: _number(values, k, path, required=k == "fid")
                            for values in [columns.values(rec, score, i == 0)] for k in columns.TRACKED},
                         # the step's held-out loss, on its primary rows of the trained weights (not a reconstruction's)
                         **({k: _number(held[int(m.group(1))][1], k, held[int(m.group(1))][0], required=False)
                             for k in columns.PER_STEP}
                            if i == 0 and ema is None and int(m.group(1)) in held else {}),
                         "num_ref": _number(score, "num_ref", path, required=False),
                         "feature_dim": _number(score, "feature_dim", path, required=False),
                         "reference": score.get("reference"), "protocol": score.get("protocol", "clean-fid"),
                         "mode": rec.get("mode"),
                         "fid_s": _seconds(rec, path), "samples": f"step_{m.group(1)}{m.group(2)}",
                         "prompts": prompts, "size": protocol.size_name(size),
                         "grid": f"step_{m.group(1)}{protocol.variant(count, guidance, 0, ema, decay, prompts, size)}"})
    return pd.DataFrame(rows).sort_values(["step", "guidance", "seed_set"], ignore_index=True)


def read_val_loss(run_dir: Path) -> dict:
    """step -> (file, record) of metrics/val_loss/step_XXXXXXX.json (sampling/val_loss.py); {} without any."""
    folder, out = run_dir / "metrics" / "val_loss", {}
    for path in sorted(folder.glob("step_*.json")) if folder.is_dir() else []:
        m = re.fullmatch(r"step_(\d{7})\.json", path.name)
        rec = io.read_json(path) if m else None
        if m and not isinstance(rec, dict):
            raise UserError(f"{path}: expected a JSON object; regenerate it with `diffrelay val-loss`")
        if m:
            out[int(m.group(1))] = (path, rec)
    return out


def reference_notes(fid: pd.DataFrame) -> dict:
    """metric -> the line scores.md prints under its table when its reference held no more images than the
    extractor has features (each score entry's num_ref and feature_dim; refsize.py)."""
    return {r.metric: refsize.note(int(r.num_ref), int(r.feature_dim), family(r.metric))
            for r in fid.drop_duplicates("metric").itertuples() if refsize.singular(r.num_ref, r.feature_dim)}


def over_seed_sets(fid: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, post-hoc EMA width, EMA decay, guidance, prompt file, size, metric): mean, standard
    deviation and minimum over the seed sets. Rows of the training's own (first) EMA have no width or decay (NaN),
    which must stay a group of its own; the square's size is "" (it sorts first)."""
    groups = fid.groupby(["step", "phema", "ema_decay", "guidance", "prompts", "size", "metric"], sort=True,
                         dropna=False)
    means = {f"{k}_" if k == "is" else k: (k, "mean") for k in columns.TRACKED}
    out = groups.agg(num_images=("num_images", "first"), seed_sets=("seed_set", "nunique"), **means,
                     fid_std=("fid", "std"), fid_min=("fid", "min"), reference=("reference", "first"),
                     protocol=("protocol", "first"),
                     mode=("mode", "first"), fid_s=("fid_s", "mean"),
                     primary=("primary", "any"), grid=("grid", "first"), samples=("samples", list))
    return out.reset_index()  # "is_": a namedtuple field cannot be called "is"


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


def read_sample_manifest(run_dir: Path, name: str) -> dict:
    path = run_dir / "samples" / name / "manifest.json"
    if not path.is_file():
        raise UserError(f"{path}: not found, although metrics/fid/{name}.json exists; "
                        f"sample that snapshot again (diffrelay sample) or delete the stale FID result")
    rec = io.read_json(path)
    if not isinstance(rec, dict):
        raise UserError(f"{path}: expected a JSON object; sample that snapshot again")
    phema = rec.get("phema") if isinstance(rec.get("phema"), dict) else {}
    shape = rec.get("image_shape")  # [C, H, W] of the folder's images
    size = f"{shape[2]}x{shape[1]}" if isinstance(shape, list) and len(shape) == 3 else ""
    return {"sample_s": _seconds(rec, path), "num_images": _number(rec, "num_images", path, required=False),
            "phema_error": float(phema.get("error", math.nan)), "size": size}


# ---- Putting it together ------------------------------------------------------------------------

def build_table(fid: pd.DataFrame, train: pd.DataFrame, segments: pd.DataFrame, run_dir: Path) -> pd.DataFrame:
    """metrics.csv's rows (COLUMNS), plus `primary` and `grid` for picking the best evaluation."""
    rows, steps = [], sorted(set(fid.step))
    for r in over_seed_sets(fid).itertuples(index=False):
        i = steps.index(r.step)
        prev = steps[i - 1] if i else -1
        window = train[(train.step > prev) & (train.step <= r.step)]
        seg = segments[(segments.start < r.step) & (segments.end >= r.step)]
        samples = [read_sample_manifest(run_dir, name) for name in r.samples]
        sample_s = sum(m["sample_s"] for m in samples) / len(samples)
        made = sum(m["num_images"] for m in samples) / len(samples)
        rows.append({
            "step": r.step, "phema": r.phema, "phema_error": samples[0]["phema_error"], "ema_decay": r.ema_decay,
            "guidance": r.guidance, "metric": r.metric, "num_images": r.num_images,
            "seed_sets": r.seed_sets, **{k: getattr(r, f"{k}_" if k == "is" else k) for k in columns.TRACKED},
            "fid_std": r.fid_std, "fid_min": r.fid_min, "reference": r.reference, "protocol": r.protocol, "mode": r.mode,
            "train_loss_mean": window.loss.mean() if len(window) else math.nan,
            # Updates skipped for non-finite loss or gradients since the start of the run, up to this step.
            "train_skipped_steps": train[train.step <= r.step].skipped.iloc[-1] if (train.step <= r.step).any()
            else math.nan,
            "train_images_per_s": window.images_per_s.mean() if len(window) else math.nan,
            "train_segment_s": seg.seconds.iloc[-1] if len(seg) else math.nan,
            "sample_s": sample_s, "sample_images_per_s": made / sample_s if sample_s > 0 else math.nan,
            "fid_s": r.fid_s, "primary": r.primary, "grid": r.grid, "prompts": r.prompts,
            # width x height: the variant's (sample.sizes), else the square's from its folder's manifest
            "size": r.size or samples[0]["size"], "square": not r.size,
        })
    return pd.DataFrame(rows, columns=[*COLUMNS, "primary", "grid", "reference", "protocol", "mode",
                                       *columns.PER_FILE, *columns.PER_STEP, "prompts", "size", "square"])


def csv_columns(table: pd.DataFrame) -> list:
    """metrics.csv's columns: COLUMNS, and the per-file scores (clip_score), prompts (sample.prompts's file k) and
    size (sample.sizes: width x height) where a run has them (other runs keep their file)."""
    return COLUMNS + [k for k in columns.PER_FILE + columns.PER_STEP if table[k].notna().any()] + (
        ["prompts"] if (table.prompts != 0).any() else []) + (["size"] if (~table.square).any() else [])


def best_row(table: pd.DataFrame, by: str = "fid", size: tuple[int, int] | None = None) -> pd.Series:
    """Lowest mean of the primary metric (the first extractor's), in the pass with the most images (the
    second pass when it ran), among results of the newest step's metric: scores of other extractors or
    image counts are never compared. By another metric (fid.best_by): its lowest or highest value
    (columns.BETTER) among the same results; fd_dinov2: the DINOv2 extractor's distance at the same count.
    Among one image size's results (sample.sizes): `size`'s (the first of sample.sizes: --best-size), else the
    data.resolution square's, else the first size's."""
    table = _of_size(table, size)
    # A text run's held-out captions pick where sampled (the FID's own images), else its first prompt file.
    picks = protocol.HELD_OUT if (table.prompts == protocol.HELD_OUT).any() else 0
    primary = table[table.primary & (table.prompts == picks)]
    top = primary[primary.num_images.fillna(0) == primary.num_images.fillna(0).max()]
    metric = top.metric.iloc[-1]
    ours = top[top.metric == metric]
    same = ours[ours.fid.notna()]
    if same.empty:
        raise UserError(f"every {metric} value in metrics/fid is NaN (step(s) {_evaluations(ours)}); the samples are "
                        "broken (check the training loss) and no step can be called best")
    if by == "fid":
        _say_skipped(by, [(ours[ours.fid.isna()], f"{metric} NaN")])
        return same.loc[same.fid.idxmin()]
    if by == "fd_dinov2":  # a row of its own: the DINOv2 extractor's, of the same images
        held = table[(table.prompts == picks) & table.metric.str.startswith("FD_DINOv2")]
        held = held[held.num_images.fillna(0) == top.num_images.fillna(0).max()]
        rows, column, nan = held[held.fid.notna()], "fid", (held[held.fid.isna()], "FD_DINOv2 NaN")
    else:
        held, column = same, by
        rows = same[same[by].notna()] if by in same else same.iloc[:0]
        nan = (same[same[by].isna()] if by in same else same, f"{by} NaN or missing")
    if rows.empty and held.empty:
        raise UserError(f"fid.best_by={by}: no result holds {by}; add it to fid.metrics (clip_score, pick_score, "
                        "class_accuracy: set fid.clip_model, fid.pick_model, fid.classifier), or pick another best_by")
    if rows.empty:  # the metric was computed (or its rows exist), and every value is NaN or missing
        raise UserError(f"fid.best_by={by}: no result holds {by}: it is NaN or missing at every evaluated step "
                        f"({_evaluations(held)}); {NO_VALUE.get(by, NO_VALUE[None])}")
    _say_skipped(by, [nan, (ours[ours.fid.isna()], f"{metric} NaN")])
    return rows.loc[rows[column].idxmin() if columns.BETTER[by] == "lower" else rows[column].idxmax()]


# fid.best_by's metric present but NaN or missing at every step: what that means, and the fix.
NO_VALUE = {
    "val_loss": "a NaN one (metrics/val_loss/step_XXXXXXX.json) is a diverged checkpoint (check the training loss), a "
                "missing one a step not scored yet (its compute_val_loss job, or `diffrelay val-loss`); or pick another "
                "best_by",
    None: "a metric is computed only when fid.metrics lists it (clip_score, pick_score, class_accuracy: when "
          "fid.clip_model, fid.pick_model or fid.classifier is set); a listed one that is NaN comes from broken samples: "
          "check the training loss and score the folders again (`diffrelay fid`); or pick another best_by",
}


def _evaluations(rows: pd.DataFrame) -> str:
    """'2, 4 (guidance 1.5), 6': the evaluations of `rows`, by step, each once."""
    def name(r):
        g, ema = float(r.get("guidance", 1.0)), r.get("phema", math.nan)
        return (f"{int(r['step'])}" + ("" if g == 1 else f" guidance {g:g}")
                + ("" if ema is None or math.isnan(ema) else f" post-hoc EMA {ema:g}"))
    return ", ".join(dict.fromkeys(map(name, rows.to_dict("records"))))


def _say_skipped(by: str, skipped: list) -> None:
    """One line naming the evaluations left out of the pick (NaN or missing values), where there are any."""
    parts = [f"{_evaluations(rows)} ({why})" for rows, why in skipped if len(rows)]
    if parts:
        logs.get().warning(f"report: fid.best_by={by}: step(s) {', '.join(parts)} left out of the pick")


def _of_size(table: pd.DataFrame, size) -> pd.DataFrame:
    """The rows of one image size that pick the best (best_row says which)."""
    if "square" not in table:  # a table of one size (made without build_table's columns)
        return table
    if size is not None:
        name = protocol.size_name(size)
        rows = table[table["size"] == name]
        if rows.empty:
            raise UserError(f"--best-size {name}: no result of that size in metrics/fid (sizes: "
                            f"{', '.join(dict.fromkeys(table['size']))}); sample and score it, or name another")
        return rows
    return table[table.square] if table.square.any() else table[table["size"] == table["size"].iloc[0]]


def objective_of(run_dir: Path) -> str | None:
    """model.objective recorded in the run's snapshots (their headers only); None when none can be read."""
    for p in sorted((run_dir / "snapshots").glob("step_*.safetensors")):
        try:
            return io.signed_header(p, "snapshot", "")[1].get("model", {}).get("objective", "edm")
        except (UserError, AttributeError):
            continue
    return None


def main_collect(args) -> int:
    """`diffrelay collect`: the per-segment aggregate the workflow's report waits for."""
    logs.setup()
    io.check_file_target(args.out, lambda p: io.is_json_object(p, ["scores"], exact=True),
                         "a segment's list of score files written by `diffrelay collect`")
    io.write_json(args.out, {"scores": sorted(map(str, args.scores))})
    return 0


REPORT_FILES = ("metrics.csv", "scores.md", "fid.png", "loss.png", "best_grid.png", "best.json")
BEST_KEYS = ("step", "guidance", "metric", "fid", "snapshot", "samples", "grid")


def check_out(out: Path) -> None:
    """The report's files may replace only an earlier report's: a folder whose best.json is ours."""
    if os.path.lexists(out) and (out.is_symlink() or not out.is_dir()):
        raise UserError(f"{out}: exists and is not a folder; nothing was changed; choose another --out")
    ours = io.is_json_object(out / "best.json", BEST_KEYS)
    for name in REPORT_FILES:
        io.check_file_target(out / name, lambda p: ours, "a file of an earlier `diffrelay report` (its folder has "
                             "no report best.json)", "choose another --out or move the file aside")


def main(args) -> int:
    log = logs.setup()
    run_dir, out = Path(args.run_dir), Path(args.out)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: run folder not found; pass --run-dir results/<run>")
    check_out(out)

    # Read and check everything before writing anything.
    fid = read_fid(run_dir)
    if args.evaluated:  # sample.snapshot: a run that trained nothing has no training log
        step = io.signed_header(args.evaluated, "snapshot", "check sample.snapshot")[1].get("step")
        fid = fid[fid.step == step]  # scores of a file named here before are not this file's
        if fid.empty:
            raise UserError(f"{run_dir}/metrics/fid: no score at step {step} of {args.evaluated}; score it first")
        train = pd.DataFrame(columns=["step", "loss", "images_per_s", "skipped", "skipped_in_window"], dtype=float)
        segments = pd.DataFrame(columns=["start", "end", "seconds"], dtype=float)
    else:
        train, segments = read_train(run_dir)
    table = build_table(fid, train, segments, run_dir)
    by = getattr(args, "best_by", None) or "fid"
    best = best_row(table, by, getattr(args, "best_size", None))
    grid = run_dir / "samples" / best.grid / "grid.png"
    if not grid.is_file():
        raise UserError(f"{grid}: not found; sample step {best.step} again (diffrelay sample) to make its grid")

    value = float(best.fid if by in ("fid", "fd_dinov2") else best[by])  # the value that picked
    io.write_text(out / "metrics.csv", table[csv_columns(table)].to_csv(index=False, float_format="%.6g"))
    io.write_text(out / "scores.md", tables.scores_table(table, run_dir.name, reference_notes(fid), by))
    plot_fid(table, best, run_dir.name, out / "fid.png", by=by)
    plot_loss(train, segments, run_dir.name, out / "loss.png", args.evaluated, objective_of(run_dir))
    io.write_bytes(out / "best_grid.png", grid.read_bytes())  # a copy, so `snakemake --report` can embed it
    io.write_json(out / "best.json", {
        # "metric": the one that picked (fid.best_by); "fid_metric": the one of "fid", "fid_min" and "fid_std"
        "step": int(best.step), "guidance": float(best.guidance), "metric": tables.picked_by(best, by),
        "fid_metric": best.metric, "fid": float(best.fid),
        "kid": None if math.isnan(best.kid) else float(best.kid), "seed_sets": int(best.seed_sets),
        "fid_min": float(best.fid_min), "fid_std": None if math.isnan(best.fid_std) else float(best.fid_std),
        "phema": None if math.isnan(best.phema) else float(best.phema),
        "ema_decay": None if math.isnan(best.ema_decay) else float(best.ema_decay),
        "snapshot": args.evaluated or str(run_dir / "snapshots" / (
            f"step_{int(best.step):07d}.safetensors" if math.isnan(best.phema)
            else f"phema/step_{int(best.step):07d}_ema{best.phema:g}.safetensors")),
        "samples": str(run_dir / "samples" / best.grid),
        "clip_score": None if math.isnan(best.clip_score) else float(best.clip_score),
        "best_by": by, "best_value": value,
        "grid": str(out / "best_grid.png"),
    } | ({"size": best["size"]} if (~table.square).any() else {}))  # sample.sizes: which size picked it
    log.info(f"report: {len(table)} evaluated step(s); best {tables.picked_by(best, by)} {value:.4g} at step "
             f"{best.step} -> {out}")
    return 0
