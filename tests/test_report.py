"""`diffrelay report` on a hand-made run folder: the CSV, the plots, best.json and the errors."""

import csv
import json

import numpy as np

import pytest
from conftest import run_cli
from PIL import Image

from diffrelay import cli
from diffrelay.evaluation.report import COLUMNS

# Evaluated steps and their FD; step 4 is the best (neither the first nor the last).
FD = {2: 80.0, 4: 30.0, 6: 45.0, 8: 35.0}
KID = {2: 0.08, 4: 0.03, 6: 0.05, 8: 0.04}
LOSS = {1: 1.0, 2: 0.8, 3: 0.6, 4: 0.5, 5: 0.45, 6: 0.35, 7: 0.3, 8: 0.25}
COLOURS = {2: (255, 0, 0), 4: (0, 255, 0), 6: (0, 0, 255), 8: (255, 255, 0)}


def _train_record(step, loss):
    return {"step": step, "loss": loss, "lr": 0.001, "grad_norm": 0.5, "skipped": 0,
            "steps_per_s": 2.0, "images_per_s": 16.0 * step, "elapsed": step / 2, "time": 1000.0 + step}


def make_run(root):
    """A run of 8 steps in two segments, evaluated every 2 steps, with one crashed attempt in between."""
    run = root / "results" / "toy"
    lines = [{"event": "segment_start", "step": 0, "time": 1000.0}]
    lines += [_train_record(s, LOSS[s]) for s in (1, 2, 3, 4)]
    lines += [{"event": "segment_end", "step": 4, "seconds": 12.5, "time": 1013.0}]
    # A killed attempt at the second segment: its step 5 is trained again and must not count.
    lines += [{"event": "segment_start", "step": 4, "time": 1020.0}, _train_record(5, 9.0)]
    lines += [{"event": "segment_start", "step": 4, "time": 1030.0}]
    lines += [_train_record(s, LOSS[s]) for s in (5, 6, 7, 8)]
    lines += [{"event": "segment_end", "step": 8, "time": 1040.0}]  # no "seconds": time difference is used
    (run / "metrics" / "fid").mkdir(parents=True)
    (run / "metrics" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for step, fd in FD.items():
        name = f"step_{step:07d}"
        (run / "metrics" / "fid" / f"{name}.json").write_text(json.dumps({
            "metric": "FD (random features)", "fid": fd, "kid": KID[step], "num_images": 8, "num_ref": 96,
            "seconds": 3.0 + step, "started": 0.0, "finished": 3.0 + step}))
        samples = run / "samples" / name
        samples.mkdir(parents=True)
        (samples / "manifest.json").write_text(json.dumps({
            "num_images": 8, "seconds": 2.0, "started": 50.0, "finished": 52.0, "some_new_key": [1]}))
        Image.new("RGB", (34, 34), COLOURS[step]).save(samples / "grid.png")
    return run


@pytest.fixture
def run_dir(tmp_path):
    return make_run(tmp_path)


@pytest.fixture(scope="module")
def good_report(tmp_path_factory):
    """One report through the real `diffrelay` executable, shared by the read-only checks."""
    run = make_run(tmp_path_factory.mktemp("good"))
    run_cli("report", "--run-dir", run, "--out", run / "report")
    return run, run / "report"


def _report_in_process(run_dir, capsys):
    """The same CLI entry point, without paying for a new interpreter: (out, exit code, stderr)."""
    out = run_dir / "report"
    rc = cli.main(["report", "--run-dir", str(run_dir), "--out", str(out)])
    return out, rc, capsys.readouterr().err


def _rows(out):
    with open(out / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_metrics_csv_has_one_row_per_evaluated_step_with_input_values(good_report):
    _, out = good_report
    fields, rows = _rows(out)
    assert fields == COLUMNS
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    for r in rows:
        step = int(r["step"])
        assert r["metric"] == "FD (random features)"
        assert float(r["fid"]) == FD[step] and float(r["kid"]) == pytest.approx(KID[step])
        assert float(r["fid_s"]) == 3.0 + step
        assert float(r["sample_s"]) == 2.0 and float(r["sample_images_per_s"]) == 4.0
        # Mean of the records after the previous evaluated step, up to this one.
        assert float(r["train_loss_mean"]) == pytest.approx((LOSS[step - 1] + LOSS[step]) / 2)
        assert float(r["train_images_per_s"]) == pytest.approx(16.0 * (step - 0.5))
    # First segment reports its own seconds; the second is timed from its (retried) start to its end.
    assert [float(r["train_segment_s"]) for r in rows] == [12.5, 12.5, 10.0, 10.0]


def test_best_json_picks_the_lowest_fd_and_copies_its_grid(good_report):
    run_dir, out = good_report
    best = json.loads((out / "best.json").read_text())
    assert best["step"] == 4 and best["fid"] == 30.0 and best["metric"] == "FD (random features)"
    assert best["snapshot"].endswith("toy/snapshots/step_0000004.safetensors")
    assert best["samples"].endswith("toy/samples/step_0000004")
    grid = out / "best_grid.png"
    assert not grid.is_symlink()
    assert grid.read_bytes() == (run_dir / "samples" / "step_0000004" / "grid.png").read_bytes()


def test_plots_are_valid_png_images(good_report):
    _, out = good_report
    for name in ("fid.png", "loss.png"):
        with Image.open(out / name) as im:
            assert im.format == "PNG" and im.width > 300 and im.height > 200
            im.verify()
    assert not list(out.glob(".*.tmp"))  # atomic writes left no temp files behind


def test_torn_last_line_of_train_log_is_ignored(run_dir, capsys):
    with open(run_dir / "metrics" / "train.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 0.2, "images_per')  # writer killed mid-line
    out, rc, err = _report_in_process(run_dir, capsys)
    assert rc == 0, err
    _, rows = _rows(out)
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]


def test_missing_fid_folder_is_one_line_error(run_dir, capsys):
    for f in (run_dir / "metrics" / "fid").iterdir():
        f.unlink()
    (run_dir / "metrics" / "fid").rmdir()
    out, rc, err = _report_in_process(run_dir, capsys)
    assert rc == 2
    err = err.strip()
    assert err.count("\n") == 0 and err.startswith("diffrelay: error: ")
    assert "metrics/fid" in err and "no FID results yet" in err
    assert not out.exists()


@pytest.mark.parametrize("name, text, expect", [
    ("metrics/fid/step_0000006.json", '{"metric": "FD", "fid": ', "not valid JSON"),
    ("metrics/fid/step_0000006.json", '{"metric": "FD", "kid": 0.1}', "fid=None"),
    ("samples/step_0000006/manifest.json", None, "not found"),
    ("metrics/train.jsonl", "", "no training records"),
])
def test_bad_or_missing_input_file_is_named(run_dir, capsys, name, text, expect):
    path = run_dir / name
    if text is None:
        path.unlink()
    else:
        path.write_text(text)
    out, rc, err = _report_in_process(run_dir, capsys)
    assert rc == 2, err
    err = err.strip()
    assert err.count("\n") == 0 and str(path) in err and expect in err
    assert not out.exists()  # inputs are all checked before any output is written


def test_skipped_windows_show_as_no_loss_and_skipped_steps_are_counted(run_dir, capsys):
    path = run_dir / "metrics" / "train.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        if r.get("step") in (3, 4) and "event" not in r:  # every step of these windows was skipped
            r.update(loss=None, grad_norm=None, skipped=r["step"] - 2, skipped_in_window=1)
        elif r.get("step", 0) > 4 and "event" not in r:
            r.update(skipped=2, skipped_in_window=0)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out, rc, err = _report_in_process(run_dir, capsys)
    assert rc == 0, err
    rows = {int(r["step"]): r for r in csv.DictReader((out / "metrics.csv").open())}
    assert rows[4]["train_loss_mean"] == ""  # both windows of (2, 4] were skipped: no loss, not 0
    assert float(rows[2]["train_loss_mean"]) == pytest.approx((LOSS[1] + LOSS[2]) / 2)
    assert [rows[s]["train_skipped_steps"] for s in (2, 4, 6, 8)] == ["0", "2", "2", "2"]


def _protocol_run(root):
    """make_run's training log, evaluated with two extractors over two seed sets, and a second pass
    (64 images) of steps 4 and 6 in which step 6 wins although step 4 won the first pass."""
    run = make_run(root)
    for p in (run / "metrics" / "fid").iterdir():
        p.unlink()
    first = {(2, 0): 80.0, (2, 1): 84.0, (4, 0): 30.0, (4, 1): 34.0, (6, 0): 45.0, (6, 1): 41.0, (8, 0): 35.0,
             (8, 1): 37.0}
    final = {(4, 0): 20.0, (4, 1): 22.0, (6, 0): 18.0, (6, 1): 19.0}
    for values, count in ((first, None), (final, 64)):
        n = count or 8
        for (step, seed_set), fd in values.items():
            name = f"step_{step:07d}" + (f"_n{count}" if count else "") + (f"_s{seed_set}" if seed_set else "")
            scores = [{"metric": f"FD-{n} (random features)", "fid": fd, "kid": fd / 1000},
                      {"metric": f"FD_DINOv2-{n}", "fid": 10 * fd, "kid": None}]
            (run / "metrics" / "fid" / f"{name}.json").write_text(json.dumps(
                {**scores[0], "scores": scores, "num_images": n, "seconds": 1.0}))
            samples = run / "samples" / name
            samples.mkdir(parents=True, exist_ok=True)
            (samples / "manifest.json").write_text(json.dumps({"num_images": n, "seconds": 2.0}))
            Image.new("RGB", (34, 34), (step * 20, seed_set * 100, n)).save(samples / "grid.png")
    return run


def test_seed_sets_extractors_and_the_second_pass_are_separate_rows_and_the_best_comes_from_the_second(tmp_path):
    run = _protocol_run(tmp_path)
    run_cli("report", "--run-dir", run, "--out", run / "report")
    fields, rows = _rows(run / "report")
    assert fields == COLUMNS
    by = {(int(r["step"]), r["metric"]): r for r in rows}
    assert len(rows) == 2 * 4 + 2 * 2  # (2 metrics) x (4 first-pass steps + 2 second-pass steps)
    r = by[(4, "FD-8 (random features)")]
    assert (int(r["seed_sets"]), float(r["fid"]), float(r["fid_min"])) == (2, 32.0, 30.0)
    assert float(r["fid_std"]) == pytest.approx(np.std([30.0, 34.0], ddof=1), rel=1e-5)  # CSV keeps 6 digits
    assert float(by[(4, "FD_DINOv2-8")]["fid"]) == 320.0 and by[(4, "FD_DINOv2-8")]["kid"] == ""
    assert int(by[(6, "FD-64 (random features)")]["num_images"]) == 64
    assert (2, "FD-64 (random features)") not in by
    best = json.loads((run / "report" / "best.json").read_text())
    assert (best["step"], best["metric"], best["fid"], best["fid_min"]) == (6, "FD-64 (random features)", 18.5, 18.0)
    assert best["samples"].endswith("samples/step_0000006_n64")
    assert (run / "report" / "best_grid.png").read_bytes() == (run / "samples/step_0000006_n64/grid.png").read_bytes()
    with Image.open(run / "report" / "fid.png") as im:
        assert im.height > 600  # one panel per metric family


def test_report_of_a_run_scored_before_several_extractors_still_reads(good_report):
    # make_run's files hold one score at the top level, without "scores" (the format before).
    _, out = good_report
    assert json.loads((out / "best.json").read_text())["seed_sets"] == 1


def add_phema_evaluation(run, name, **manifest):
    """A post-hoc EMA reconstruction's score, sample manifest and grid, as the workflow leaves them."""
    (run / "metrics" / "fid" / f"{name}.json").write_text(json.dumps(
        {"metric": "FD (random features)", "fid": 20.0, "kid": 0.02, "num_images": 8, "seconds": 1.0}))
    (run / "samples" / name).mkdir(parents=True)
    (run / "samples" / name / "manifest.json").write_text(json.dumps({"num_images": 8, "seconds": 2.0, **manifest}))
    Image.new("RGB", (34, 34), (9, 9, 9)).save(run / "samples" / name / "grid.png")


def test_a_post_hoc_ema_reconstruction_is_a_row_of_its_own_and_can_be_the_best(tmp_path):
    run = make_run(tmp_path)
    name = "step_0000008_ema0.08"
    add_phema_evaluation(run, name)
    run_cli("report", "--run-dir", run, "--out", run / "report")
    _, rows = _rows(run / "report")
    at_8 = [(r["phema"], float(r["fid"])) for r in rows if r["step"] == "8"]
    assert sorted(at_8) == [("", FD[8]), ("0.08", 20.0)]  # not averaged with the training's EMA
    best = json.loads((run / "report" / "best.json").read_text())
    assert best["phema"] == 0.08 and best["snapshot"].endswith("snapshots/phema/step_0000008_ema0.08.safetensors")
    assert (run / "report" / "best_grid.png").read_bytes() == (run / "samples" / name / "grid.png").read_bytes()


def test_a_reconstructions_error_is_a_column_of_metrics_csv(tmp_path):
    run = make_run(tmp_path)
    add_phema_evaluation(run, "step_0000008_ema0.08", phema={"sigma_rel": 0.08, "step": 8, "error": 0.0406})
    run_cli("report", "--run-dir", run, "--out", run / "report")
    _, rows = _rows(run / "report")
    errors = {r["phema"]: r["phema_error"] for r in rows if r["step"] == "8"}
    assert errors == {"": "", "0.08": "0.0406"}


def test_best_by_picks_the_lowest_distance_or_the_highest_score_of_any_metric_the_results_hold():
    import pandas as pd

    from diffrelay import config
    from diffrelay.errors import UserError
    from diffrelay.evaluation.report import best_row

    rows = []
    for step, fid, kid, prec, score, dino in [(1, 3.0, 0.3, 0.2, 1.0, 10.0), (2, 2.0, 0.5, 0.9, 2.0, 30.0),
                                              (3, 4.0, 0.1, 0.5, 3.0, 5.0)]:
        common = {"step": step, "prompts": 0, "num_images": 8, "recall": np.nan, "sfid": np.nan, "clip_score": np.nan}
        rows.append(common | {"primary": True, "metric": "FID-8", "fid": fid, "kid": kid, "precision": prec,
                              "is": score})
        rows.append(common | {"primary": False, "metric": "FD_DINOv2-8", "fid": dino, "kid": np.nan,
                              "precision": np.nan, "is": np.nan})
    table = pd.DataFrame(rows)
    picked = {by: int(best_row(table, by).step) for by in ("fid", "kid", "precision", "is", "fd_dinov2")}
    assert picked == {"fid": 2, "kid": 3, "precision": 2, "is": 3, "fd_dinov2": 3}
    with pytest.raises(UserError, match="fid.best_by=recall: no result holds recall"):
        best_row(table, "recall")
    base = {"fid": {"best_by": "precision", "metrics": ["fid", "kid"]}}
    with pytest.raises(UserError, match=r"fid.best_by=precision: not among the metrics .* add precision to fid.metrics"):
        config.validate(base)
    with pytest.raises(UserError, match=r"fid.best_by=sfid: not among the metrics each result holds \(fid.metrics=null"):
        config.validate({"fid": {"best_by": "sfid"}})
    assert config.validate({"fid": {"best_by": "precision", "metrics": ["fid", "precision"]}})["fid"]["best_by"] == \
        "precision"


def test_step_0_and_val_loss_are_rows_lines_and_a_best_by_of_their_own(run_dir, capsys, monkeypatch):
    """sample.baseline's step 0 is a row and a dashed line on every panel; val_loss (metrics/val_loss/<step>.json)
    fills its columns on each step's row, and fid.best_by val_loss picks the lowest, in a panel of its own."""
    from diffrelay.evaluation import plots

    (run_dir / "metrics" / "fid" / "step_0000000.json").write_text(json.dumps({
        "metric": "FD (random features)", "fid": 90.0, "kid": 0.1, "num_images": 8, "num_ref": 96, "seconds": 3.0}))
    samples = run_dir / "samples" / "step_0000000"
    samples.mkdir(parents=True)
    (samples / "manifest.json").write_text(json.dumps({"num_images": 8, "seconds": 2.0}))
    Image.new("RGB", (34, 34), (9, 9, 9)).save(samples / "grid.png")
    held = {0: 1.0, 2: 0.9, 4: 0.8, 6: 0.7, 8: 0.75}  # the lowest at step 6, not FD's best (4)
    (run_dir / "metrics" / "val_loss").mkdir()
    for step, v in held.items():
        (run_dir / "metrics" / "val_loss" / f"step_{step:07d}.json").write_text(json.dumps(
            {"val_loss": v, "val_loss_low": v + 1, "val_loss_middle": v, "val_loss_high": v - 0.5, "step": step}))
    figures = []
    save = plots.save_png
    monkeypatch.setattr(plots, "save_png", lambda fig, path: (figures.append(fig), save(fig, path)))
    out = run_dir / "report"
    assert cli.main(["report", "--run-dir", str(run_dir), "--out", str(out), "--best-by", "val_loss"]) == 0
    fields, rows = _rows(out)
    assert fields[-4:] == ["val_loss", "val_loss_low", "val_loss_middle", "val_loss_high"]
    assert {int(r["step"]): float(r["val_loss"]) for r in rows} == held
    assert float(rows[0]["val_loss_low"]) == 2.0 and rows[0]["train_loss_mean"] == ""  # step 0: nothing trained yet
    best = json.loads((out / "best.json").read_text())
    assert (best["step"], best["best_by"], best["best_value"]) == (6, "val_loss", 0.7)
    # best.json names the metric that picked, and the FD's own; scores.md holds the metric that picked
    assert (best["metric"], best["fid_metric"]) == ("val_loss", "FD (random features)")
    table = (out / "scores.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| Snapshot"))
    assert header.endswith("| val_loss ↓ |")
    assert next(line for line in table if line.startswith("| step 6 |")).endswith("| 0.700 |")
    fd, own = figures[0].axes  # the distances' panel, then best_by's
    for ax, at in ((fd, 90.0), (own, 1.0)):
        lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("step 0 (before training)")]
        assert len(lines) == 1 and set(lines[0].get_ydata()) == {at}, [ln.get_label() for ln in ax.get_lines()]
    assert "val_loss (lower is better)" == own.get_title()


def test_best_by_names_the_rows_it_skips_and_says_when_every_value_is_nan_or_missing(caplog):
    """fid.best_by's NaN or missing values are skipped in one line naming the steps; with none left, the one line
    says that every step's value is NaN or missing (which steps), not that the metric is missing from fid.metrics."""
    import pandas as pd

    from diffrelay import logs
    from diffrelay.errors import UserError
    from diffrelay.evaluation.report import best_row

    def table(rows):
        return pd.DataFrame([{"step": s, "guidance": 1.0, "prompts": 0, "num_images": 8, "primary": True,
                              "metric": "FID-8", "fid": f, "val_loss": v} for s, f, v in rows])

    logs.get().addHandler(caplog.handler)
    try:
        best = best_row(table([(2, 3.0, 0.5), (4, 2.0, np.nan), (6, 1.0, 0.9), (8, np.nan, 0.1)]), "val_loss")
    finally:
        logs.get().removeHandler(caplog.handler)
    assert int(best.step) == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "fid.best_by=val_loss" in said[0], said
    assert "step(s) 4 (val_loss NaN or missing)" in said[0] and "8 (FID-8 NaN)" in said[0], said
    with pytest.raises(UserError) as e:
        best_row(table([(2, 3.0, np.nan), (4, 2.0, np.nan)]), "val_loss")
    line = str(e.value)
    assert "\n" not in line and "fid.metrics" not in line and "NaN or missing at every evaluated step (2, 4)" in line
    assert "metrics/val_loss" in line
