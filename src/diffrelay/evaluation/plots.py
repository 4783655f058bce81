"""The report's plots: fid.png (a panel per metric family, fid.best_by's metric in one of its own, step 0 as a line
across each) and loss.png (the training loss by step, segment ends and skipped windows marked); written atomically.

Imports the base modules, evaluation.columns and protocol; matplotlib and pandas.
"""

import math
import re
from io import BytesIO
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from diffrelay import io
from diffrelay.evaluation import columns, protocol

# "FID-50k" -> ("FID", "50k"); "FD-256 (random features)" -> ("FD (random features)", "256")
COUNTED = re.compile(r"^(\S+?)-(\d+(?:\.\d+)?[kM]?)( .*)?\Z")


def family(metric: str) -> str:
    """The metric without its image count: scores of one family share a plot panel, one curve per count."""
    m = COUNTED.match(metric)
    return m.group(1) + (m.group(3) or "") if m else metric


def save_png(fig: Figure, path: Path) -> None:
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")  # no label cut at the edge
    io.write_bytes(path, buf.getvalue())


def plot_fid(table: pd.DataFrame, best: pd.Series, run_name: str, path: Path, by: str = "fid") -> None:
    """One panel per metric family (FID, FD_DINOv2, ...), primary first; one curve per image count, guidance
    scale and prompt file, each labelled with its metric name; bars of one standard deviation over seed sets.
    by: the metric that picked the best (fid.best_by), which its star says when it is not the primary distance."""
    families = list(dict.fromkeys(map(family, table.sort_values("primary", ascending=False, kind="stable").metric)))
    own = by not in ("fid", "fd_dinov2")  # fid.best_by's metric gets a panel of its own, under the distances
    fig = Figure(figsize=(6.4, 2.2 + 1.8 * (len(families) + own)), layout="constrained")
    axes = fig.subplots(len(families) + own, 1, sharex=True, squeeze=False)[:, 0]
    several_scales = table.guidance.nunique() > 1
    several_sizes = bool("square" in table and (~table.square).any())  # sample.sizes: each curve says its size
    if own:
        _plot_best_by(axes[-1], table, best, by, several_scales)
    for ax, fam in zip(axes, families):
        part = table[table.metric.map(family) == fam]
        keys = ["metric", "guidance", "phema", "ema_decay", "prompts"] + (["size"] if several_sizes else [])
        for (m, g, ema, decay, k, *size), curve in part.groupby(keys, sort=True, dropna=False):
            label = m + (f", guidance {g:g}" if several_scales else "") + (
                ", held-out captions" if k == protocol.HELD_OUT else f", prompt file {k + 1}" if k else "")
            label += "".join(f", {z}" for z in size)  # sample.sizes: width x height
            label += "" if math.isnan(ema) else f", post-hoc EMA {ema:g}"
            label += "" if math.isnan(decay) else f", EMA decay {decay:g}"
            if curve.seed_sets.max() > 1:
                label += f" (mean of {int(curve.seed_sets.max())} seed sets, bars: std)"
            bars = ax.errorbar(curve.step, curve.fid, yerr=curve.fid_std.fillna(0) if curve.seed_sets.max() > 1
                               else None, marker="o", capsize=3, label=label, linestyle="-" if len(curve) > 1 else "none")
            _baseline(ax, curve, "fid", bars.lines[0].get_color())
        if fam == family(best.metric):
            at = f"step {best.step}" + (f", guidance {best.guidance:g}" if several_scales else "")
            at += "" if math.isnan(best.ema_decay) else f", EMA decay {best.ema_decay:g}"
            said = f" (by {by} {best[by]:.4g})" if by in columns.TRACKED and by != "fid" else (
                " (by fd_dinov2)" if by == "fd_dinov2" else "")
            ax.plot([best.step], [best.fid], marker="*", markersize=16, color="tab:red", linestyle="none",
                    label=f"best{said} {best.metric}: {best.fid:.4g} at {at}")
        ax.set(ylabel=fam.split(" ")[0])
        ax.set_title(fam, fontsize="medium")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{run_name}: scores by training step" + ("" if own else " (lower is better)"))
    axes[-1].set(xlabel="training step")
    axes[-1].set_xlim(left=0)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    save_png(fig, path)


def _baseline(ax, curve: pd.DataFrame, column: str, color) -> None:
    """The step-0 evaluation (sample.baseline: the pretrained pipeline before any training) as a dashed line
    across the panel, so that every checkpoint reads against the base model at a glance."""
    base = curve[(curve.step == 0) & curve[column].notna()]
    if len(base) and curve.step.max() > 0:
        ax.axhline(float(base[column].iloc[0]), color=color, linestyle="--", linewidth=1,
                   label=f"step 0 (before training): {float(base[column].iloc[0]):.4g}")


def _plot_best_by(ax, table: pd.DataFrame, best: pd.Series, by: str, several_scales: bool) -> None:
    """The panel of fid.best_by's metric when it is not a distance: its curves, the step-0 line and the star."""
    rows = table[table[by].notna()]
    if by in columns.PER_STEP:  # one value a snapshot, whatever was sampled from it
        rows = rows.assign(guidance=rows.guidance.min(), prompts=0)
    sizes = ["size"] if by not in columns.PER_STEP and "square" in rows and (~rows.square).any() else []
    for (g, k, *size), curve in rows.groupby(["guidance", "prompts", *sizes], sort=True):
        curve = curve[curve.phema.isna()].drop_duplicates("step")
        label = by + (f", guidance {g:g}" if several_scales else "") + (
            ", held-out captions" if k == protocol.HELD_OUT else f", prompt file {k + 1}" if k else "")
        label += "".join(f", {z}" for z in size)  # sample.sizes: a curve a size
        line = ax.plot(curve.step, curve[by], marker="o", label=label, linestyle="-" if len(curve) > 1 else "none")
        _baseline(ax, curve, by, line[0].get_color())
    ax.plot([best.step], [best[by]], marker="*", markersize=16, color="tab:red", linestyle="none",
            label=f"best by {by}: {best[by]:.4g} at step {best.step}")
    ax.set(ylabel=by)
    ax.set_title(f"{by} ({columns.BETTER[by]} is better)", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


# The loss each model.objective trains (objectives/): loss.png's y-label names the run's one, short enough to fit.
LOSS_NAMES = {"edm": "EDM's weighted MSE", "flow": "velocity MSE", "ddpm": "noise MSE (+ L_vlb if learned σ)"}


def plot_loss(train: pd.DataFrame, segments: pd.DataFrame, run_name: str, path: Path, evaluated=None,
              objective: str | None = None) -> None:
    fig = Figure(figsize=(6.4, 4), layout="constrained")
    ax = fig.add_subplot()
    if evaluated:
        ax.text(0.5, 0.5, f"no training: this run evaluates\n{Path(evaluated).name}", ha="center", va="center")
        ax.set(title=f"{run_name}: training loss", xticks=[], yticks=[])
        return save_png(fig, path)
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
    loss = LOSS_NAMES.get(objective)
    ax.set(xlabel="training step", ylabel=f"training loss ({loss})" if loss else "training loss", title=title)
    ax.set_xlim(left=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)
