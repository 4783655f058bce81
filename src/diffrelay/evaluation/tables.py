"""scores.md: the scores of each evaluated snapshot as the papers' tables print them.

Columns in the order of DiT's Table 4 and SiT's and REPA's tables (FID, sFID, IS, Precision, Recall), then
KID (x 1e3) where computed, edm2's FD_DINOv2 and any other extractor's distance, a text run's CLIP score, the held-out
val_loss where computed or where fid.best_by picks by it; two
decimals, as those tables round (3 significant digits where two decimals show fewer); every header carries its
image count (FID-50k), and each table names the reference file, the protocol (ADM's evaluator arithmetic or
clean-fid's) and the resize mode it was scored with. One table per image count: FID-2k of the first pass and
FID-50k of the second are different metrics.
"""

import math

import pandas as pd

from diffrelay.evaluation import metrics

# (column of metrics.csv, name in the header, better)
PRIMARY = (("fid", None, "↓"), ("sfid", "sFID", "↓"), ("is", "IS", "↑"), ("precision", "Precision", "↑"),
           ("recall", "Recall", "↑"))
# The per-file scores of how well images follow their conditioning, after the distances (column, header)
ADHERENCE = (("clip_score", "CLIP score ↑"), ("pick_score", "PickScore ↑"), ("class_accuracy", "Class accuracy ↑"))
# A step's held-out loss (evaluation/columns.py PER_STEP), last: shown where computed or where it picks the best
HELD_OUT = (("val_loss", "val_loss ↓"),)
NAMES = {"sfid": "sFID", "is": "IS", "precision": "Precision", "recall": "Recall", "kid": "KID"}


def picked_by(best, by: str) -> str:
    """The name of the metric that picked `best` (fid.best_by): a distance's own metric (FID-2k, FD_DINOv2-2k),
    another score of that row as its scores.md header names it (KID-2k), else the column's name (val_loss)."""
    if by in ("fid", "fd_dinov2"):
        return str(best["metric"])
    n = best.get("num_images", math.nan)
    count = f"-{metrics.count_label(int(n))}" if n == n and n else ""
    return f"{NAMES[by]}{count}" if by in NAMES else by


def _cell(v) -> str:
    """Two decimals as the papers' tables (FID 2.27, IS 278.24), but never fewer than 3 significant digits:
    random-feature FDs of 0.0055 to 0.0157 all printed as 0.01 or 0.02 and could not rank the checkpoints."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    digits = 2 if v == 0 or not math.isfinite(v) else max(2, 2 - math.floor(math.log10(abs(v))))
    return f"{v:.{digits}f}"


def _snapshot(r: dict, sized: bool = False) -> str:
    out = f"step {int(r['step'])}"
    out += "" if math.isnan(r["phema"]) else f", post-hoc EMA {r['phema']:g}"
    k = int(r.get("prompts") or 0)
    out += ", held-out captions" if k < 0 else f", prompt file {k + 1}" if k else ""
    out += f", {r['size']}" if sized else ""  # sample.sizes: width x height, the square's too
    return out + ("" if math.isnan(r["ema_decay"]) else f", EMA decay {r['ema_decay']:g}")


def _same(part: pd.DataFrame, r: dict) -> pd.Series:
    """Rows of `part` for the snapshot and guidance of `r` (NaN widths and decays compare equal)."""
    same = (part.step == r["step"]) & (part.guidance == r["guidance"])
    if "prompts" in part:
        same &= part.prompts == r.get("prompts", 0)
    if "size" in part:
        same &= part["size"] == r.get("size")
    for col in ("phema", "ema_decay"):
        same &= part[col].fillna(-1) == (-1 if math.isnan(r[col]) else r[col])
    return same


def scores_table(table: pd.DataFrame, run_name: str, notes: dict | None = None, by: str = "fid") -> str:
    """Markdown of the report's rows (report.build_table): one row per (snapshot, guidance) and image count;
    under each table, the `notes` (metric -> line: a singular reference, refsize.py) of its metrics. `by`
    (fid.best_by): the metric that picks the best has its column, even where no row holds a value."""
    out = [f"# {run_name}: scores of each evaluated snapshot", ""]
    for count, part in table.groupby(table.num_images.fillna(0), sort=True):
        label = metrics.count_label(int(count)) if count else "?"
        # NaN first: a step's training-EMA row (no post-hoc width) before its post-hoc reconstructions
        keys = ["step", "phema", "ema_decay", "guidance"] + (["prompts"] if "prompts" in part else []) + (
            ["size"] if "size" in part else [])
        primary = part[part.primary].sort_values(keys, kind="stable", na_position="first")
        others = list(dict.fromkeys(part[~part.primary].metric))
        # sFID and IS belong to the Inception row, which need not be the primary (an edm2-style [dinov2, inception])
        anywhere = {"sfid", "is"}
        heads = [(col, f"{name}-{label}" if name else primary.metric.iloc[0], better) for col, name, better in PRIMARY
                 if col == "fid" or (part if col in anywhere else primary)[col].notna().any()]
        # KID in units of 1e-3, as StyleGAN2-ADA's tables print it: two decimals of the raw value are all zero
        kid = bool("kid" in primary and primary.kid.notna().any())
        # a text run's CLIP score and PickScore, a conditional run's class accuracy (evaluation/columns.py PER_FILE)
        adherence = [k for k, _ in ADHERENCE + HELD_OUT if k in primary and (primary[k].notna().any() or k == by)]
        header = ["Snapshot", "Guidance", *(f"{n} {b}" for _, n, b in heads), *([f"KID-{label} ×10³ ↓"] * kid),
                  *(f"{m} ↓" for m in others), *(name for k, name in ADHERENCE + HELD_OUT if k in adherence)]
        out += [" | ".join(header).join(["| ", " |"]), "|" + "---|" * len(header)]
        sized = bool("square" in part and (~part.square).any())  # sample.sizes: every row says its size
        for r in primary.to_dict("records"):
            same = part[_same(part, r)]
            cells = [_snapshot(r, sized), f"{r['guidance']:g}",
                     *(_cell(same[col].dropna().iloc[0] if col in anywhere and same[col].notna().any() else r[col])
                       for col, _, _ in heads), *([_cell(None if r["kid"] is None else r["kid"] * 1e3)] if kid else [])]
            for m in others:
                match = part[_same(part, r) & (part.metric == m)]
                cells.append(_cell(match.fid.iloc[0]) if len(match) else "–")
            cells += [_cell(r[k]) for k in adherence]
            out.append(" | ".join(cells).join(["| ", " |"]))
        named = "; ".join(f"{r['metric']} against {r['reference']} ({'ADM evaluator' if r['protocol'] == 'adm' else 'clean-fid'}"
                          f", {r['mode']} mode)" for r in part.drop_duplicates("metric").to_dict("records"))
        out += ["", f"{named}. Means over {int(part.seed_sets.max())} seed set(s).", ""]
        said = dict.fromkeys(notes[m] for m in part.metric.unique() if m in (notes or {}))  # once each, in order
        out += [line for text in said for line in (f"**Warning:** {text}.", "")]
    return "\n".join(out)
