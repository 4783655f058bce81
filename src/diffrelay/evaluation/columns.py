"""The score columns of metrics.csv and how one score file (metrics/fid/<folder>.json) fills them: the one reading
the report (report.read_fid: metrics.csv, scores.md) and the trackers (tracking/records.py) share, so every score
metrics.csv holds reaches W&B and MLflow under its column's name, and a score added here reaches all three.

A score file holds one entry per extractor ("scores", the primary first; a file from before several extractors
holds its one entry at the top level). Each entry is a row of metrics.csv whose SCORES columns are the entry's
values; the PER_FILE values belong to the file (a text run's CLIP score of the same images, which fid.py writes as
{"clip_score": value, "count": ..., ...}; pick_score and class_accuracy alike) and go on the primary row.
Plain Python: no pandas, no torch.
"""

SCORES = ("fid", "kid", "precision", "recall", "sfid", "is")
PER_FILE = ("clip_score", "pick_score", "class_accuracy")
# A snapshot's held-out loss (sampling/val_loss.py, metrics/val_loss/<step>.json): one value a step, on the rows of
# the step's own weights (not a post-hoc EMA's), the primary row of each.
PER_STEP = ("val_loss", "val_loss_low", "val_loss_middle", "val_loss_high")
# fid.best_by: which way each metric is better. Distances lower (FID, sFID, KID, FD_DINOv2); IS, precision, recall,
# the CLIP score, PickScore and class accuracy higher (ADM's evaluator, Kynkaanniemi et al. 2019, Hessel et al.
# 2021, Kirstain et al. 2023).
BETTER = {"fid": "lower", "sfid": "lower", "kid": "lower", "fd_dinov2": "lower",
          "is": "higher", "precision": "higher", "recall": "higher", "clip_score": "higher", "val_loss": "lower",
          "pick_score": "higher", "class_accuracy": "higher"}
TRACKED = SCORES + PER_FILE + PER_STEP
# metrics.csv's other columns, and why none of them is an eval/ value of the trackers. A new column must be
# added to TRACKED or here (tests/test_tracking.py checks that every column is one or the other).
NOT_SCORES = {
    **dict.fromkeys(("step", "guidance", "phema", "ema_decay", "prompts", "size", "seed_sets", "metric",
                     "num_images"),
                    "which evaluation a row is: the trackers' eval/step and <series>, and the metric a row holds"),
    **dict.fromkeys(("fid_std", "fid_min"), "over the seed sets: the trackers get each seed set as its own series"),
    **dict.fromkeys(("train_loss_mean", "train_skipped_steps", "train_images_per_s"),
                    "means of train.jsonl's records: the trackers get each record as train/<key>"),
    **dict.fromkeys(("phema_error", "train_segment_s", "sample_s", "sample_images_per_s", "fid_s"),
                    "how a result was made, not a score of it"),
}


def entries(rec: dict) -> list:
    """The score entries of a score file, primary first; ValueError when "scores" is not a list of objects."""
    scores = rec.get("scores", [rec])
    if not isinstance(scores, list) or not scores or not all(isinstance(r, dict) for r in scores):
        raise ValueError(f"scores={scores!r}: expected a list of results")
    return scores


def values(rec: dict, entry: dict, primary: bool) -> dict:
    """column -> the raw value (None: not computed; not checked) of one entry of the score file `rec`; the file's
    PER_FILE values on the primary entry only."""
    out = {k: entry.get(k) for k in SCORES}
    for k in PER_FILE:
        v = rec.get(k) if primary else None
        out[k] = v.get(k) if isinstance(v, dict) else v
    return out


def step_values(rec: dict | None) -> dict:
    """column -> value of a val_loss file (None where there is none, or a value is missing)."""
    rec = rec if isinstance(rec, dict) else {}
    return {k: rec.get(k) for k in PER_STEP}
