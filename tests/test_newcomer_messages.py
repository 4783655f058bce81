"""Messages a new user tripped on (issue 38): the sampling progress line, scores.md's digits, loss.png's label
and `diffrelay sample --help`."""

import logging
import re

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg

from diffrelay import cli, logs
from diffrelay.evaluation import plots, report, tables
from diffrelay.sampling import sample
from diffrelay.sampling.progress import Progress
from test_sample import make_snapshot, settings


def test_progress_counts_whole_batches_and_rates_them_from_completed_ones():
    """A batch's 64 images arrive together after 30 s: the first line used to read "images 1/512 | 0.0 img/s |
    eta 27h..." (one image over the whole batch's time)."""
    now = [0.0]
    p = Progress(512, 64, every=10, clock=lambda: now[0])
    now[0] = 30.0
    lines = [p.update(n) for n in range(1, 65)]
    assert lines[:-1] == [None] * 63  # mid-batch: nothing
    assert lines[-1] == "batch 1/8 (64/512 images) | 2.13 img/s | eta 3m30s"
    now[0] = 35.0
    assert p.update(128) is None  # within 10 s of the last line
    now[0] = 240.0
    assert p.update(512) == "batch 8/8 (512/512 images) | 2.13 img/s | eta 0s"


def test_the_sampling_log_counts_batches(tmp_path, caplog):
    snap = make_snapshot(tmp_path / "s.safetensors", conditional=False, num_classes=0)
    caplog.set_level(logging.INFO, logger=logs.get().name)
    sample.run(snap, tmp_path / "out", settings(num_images=10, batch_size=4, steps=2))
    got = [r.getMessage() for r in caplog.records if "img/s | eta" in r.getMessage()]
    assert len(got) == 1 and re.fullmatch(r"batch 3/3 \(10/10 images\) \| [\d.e+-]+ img/s \| eta 0s", got[0]), got


def test_scores_md_prints_three_significant_digits_where_two_decimals_show_fewer():
    nan = float("nan")
    common = dict(ema_decay=nan, phema=nan, guidance=1.0, metric="FD-512 (random features)", num_images=512,
                  seed_sets=1, sfid=nan, **{"is": nan}, precision=nan, recall=nan, kid=None, primary=True,
                  reference="ref.npz", protocol="clean-fid", mode="clean")
    rows = [dict(common, step=s, fid=f) for s, f in ((100, 0.0157), (200, 0.0055), (300, 0.0098), (400, 2.2712))]
    body = [x for x in tables.scores_table(pd.DataFrame(rows), "mine").splitlines() if x.startswith("| step")]
    assert body == ["| step 100 | 1 | 0.0157 |", "| step 200 | 1 | 0.00550 |", "| step 300 | 1 | 0.00980 |",
                    "| step 400 | 1 | 2.27 |"]  # two decimals stay where they show 3 digits, as the papers print


def test_loss_png_names_the_runs_objective_and_its_label_fits(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figs.append(fig))
    train = pd.DataFrame({"step": [100, 200, 300], "loss": [0.5, 0.4, 0.35], "skipped": [0, 0, 0],
                          "skipped_in_window": [0, 0, 0]})
    segments = pd.DataFrame({"start": [0], "end": [300], "seconds": [10.0]})
    for objective, name in (("flow", "velocity MSE"), ("ddpm", "noise MSE"), ("edm", "EDM's weighted MSE")):
        report.plot_loss(train, segments, "run", tmp_path / "loss.png", objective=objective)
        fig = figs[-1]
        FigureCanvasAgg(fig).draw()
        label = fig.axes[0].yaxis.label
        assert name in label.get_text() and sum(k in label.get_text() for k in ("EDM", "velocity", "noise")) == 1
        box = label.get_window_extent()
        assert box.y0 >= 0 and box.y1 <= fig.bbox.height, (box, fig.bbox)  # not cut at the figure's edge
    run = tmp_path / "results" / "run"
    make_snapshot(run / "snapshots" / "step_0000040.safetensors", conditional=False, num_classes=0)
    assert report.objective_of(run) == "edm" and report.objective_of(tmp_path) is None


def test_every_flag_of_sample_and_fid_has_a_description():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    bare = [(name, a.option_strings[0]) for name in ("sample", "fid", "fid-ref") for a in sub[name]._actions
            if a.option_strings and not a.help]
    assert not bare
