"""Nothing lost, nothing silent: every stage refuses to delete what it did not make, checks paths before
work, records what a run folder is made from, keeps the divergence guard across segments, and says one
line instead of a traceback or a silently wrong result."""

import json
import re
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import REPO, run_cli
from diffrelay import config, io, logs
from diffrelay.sampling import folder, sample
from diffrelay.training import checkpoint
from diffrelay.errors import UserError
from test_sample import make_snapshot, settings


@pytest.fixture(autouse=True)
def _quiet_logger():
    yield
    logging.getLogger(logs.LOGGER).handlers.clear()


def error_line(p) -> str:
    """The one `diffrelay: error:` line of a failed command (and no traceback)."""
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("diffrelay: error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def image_folder(root: Path, n: int, classes=("a", "b")) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / classes[i % len(classes)]
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(d / f"{i:03d}.png")
    return root


# ---- 1. Data loss: no stage deletes a folder it did not make ---------------------------------------

def precious(folder: Path) -> dict:
    """A folder of someone's work, e.g. a run folder that a wrong --out would point at."""
    (folder / "checkpoints" / "step_0000400").mkdir(parents=True)
    (folder / "checkpoints" / "step_0000400" / "state.pt").write_bytes(b"weeks of GPU time")
    (folder / "notes.txt").write_text("keep me")
    return tree(folder)


@pytest.mark.parametrize("where", ["run-folder", "cwd", "parent-of-cwd"])
def test_sample_refuses_an_out_folder_it_did_not_make_and_deletes_nothing(tmp_path, where):
    snap = make_snapshot(tmp_path / "snap.safetensors")
    target = tmp_path / "results" / "demo"
    before = precious(target)
    cwd = target if where != "parent-of-cwd" else target / "checkpoints"
    out = {"run-folder": target, "cwd": ".", "parent-of-cwd": ".."}[where]
    p = run_cli("sample", "--snapshot", snap, "--out", out, "--num-images", 4, "--steps", 2, check=False, cwd=cwd)
    line = error_line(p)
    assert "--out" in line or str(target) in line
    assert tree(target) == before
    assert not [p for p in tmp_path.rglob("*.partial")]


def test_sample_replaces_its_own_finished_folder_but_not_a_foreign_work_folder(tmp_path):
    snap = make_snapshot(tmp_path / "snap.safetensors")
    out = tmp_path / "samples"
    sample.run(snap, out, settings(num_images=4))
    sample.run(snap, out, settings(num_images=6))  # other settings: its own folder is replaced
    assert len(sample.image_files(out)) == 6
    other = tmp_path / "other"
    (tmp_path / ".other.partial").mkdir()
    (tmp_path / ".other.partial" / "thesis.tex").write_text("not ours")
    with pytest.raises(UserError, match="not a sample work folder"):
        sample.run(snap, other, settings(num_images=4))
    assert (tmp_path / ".other.partial" / "thesis.tex").read_text() == "not ours"


def test_prepare_refuses_an_out_folder_it_did_not_make(write_config, tmp_path):
    target = tmp_path / "results" / "demo"
    before = precious(target)
    p = run_cli("prepare", "--config", write_config({"data": {"count": 4}}), "--out", target, check=False)
    assert "not a dataset folder" in error_line(p)
    assert tree(target) == before
    # Its own earlier output is replaced as before.
    ok = tmp_path / "mine"
    run_cli("prepare", "--config", write_config({"data": {"count": 4}}), "--out", ok)
    run_cli("prepare", "--config", write_config({"data": {"count": 5}}), "--out", ok)
    assert json.loads((ok / "dataset.json").read_text())["count"] == 5


def test_atomic_dir_replaces_only_folders_its_caller_owns(tmp_path):
    mine, theirs, empty = tmp_path / "mine", tmp_path / "theirs", tmp_path / "empty"
    for d in (mine, theirs, empty):
        d.mkdir()
    (mine / "owned.txt").write_text("1")
    (theirs / "data.txt").write_text("2")

    def owned(p):
        return (p / "owned.txt").exists()

    for target in (mine, empty):
        with io.atomic_dir(target, owned) as tmp:
            (tmp / "owned.txt").write_text("new")
        assert (target / "owned.txt").read_text() == "new"
    with pytest.raises(UserError, match="exists and is not a folder this stage wrote; nothing was deleted"):
        with io.atomic_dir(theirs, owned) as tmp:
            (tmp / "owned.txt").write_text("new")
    assert tree(theirs) == {"data.txt": b"2"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left behind


# ---- 1. Parse-time checks: before any job, with one line ------------------------------------------

def snakemake_dry(workdir, cfg):
    return run_cli("snakemake", "--snakefile", REPO / "Snakefile", "--directory", workdir, "--cores", 1, "-n",
                   "--configfile", cfg, check=False)


def test_mistyped_data_path_stops_the_dry_run_and_the_prepared_dataset_is_kept(write_config, tmp_path):
    imgs = image_folder(tmp_path / "imgs", 6)
    good = write_config({"data": {"kind": "folder", "path": str(imgs)}})
    run_cli("prepare", "--config", good)
    dataset = tmp_path / "results" / "tiny" / "dataset"
    before = tree(dataset)
    typo = write_config({"data": {"kind": "folder", "path": str(tmp_path / "imsg")}}, name="typo.yaml")
    p = snakemake_dry(tmp_path, typo)
    line = error_line(p)
    assert "data.path=" in line and "imsg" in line and "folder not found" in line
    assert "Building DAG" not in p.stdout + p.stderr
    assert tree(dataset) == before


@pytest.mark.parametrize("case", ["missing-path", "path-is-file", "missing-extractor", "no-such-class",
                                  "too-few-for-fid", "ref-images-past-count", "conditional-without-classes",
                                  "one-sample-image"])
def test_validate_checks_the_file_system_before_any_job(write_config, tmp_path, case):
    imgs = image_folder(tmp_path / "imgs", 6)
    (tmp_path / "one").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "one" / "x.png")
    (tmp_path / "flat").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8)).save(tmp_path / "flat" / f"{i}.png")
    folder = {"kind": "folder", "path": str(imgs)}
    over, expect = {
        "missing-path": ({"data": {**folder, "path": str(tmp_path / "nope")}}, "folder not found"),
        "path-is-file": ({"data": {**folder, "path": str(tmp_path / "one" / "x.png")}}, "is not a folder"),
        "missing-extractor": ({"fid": {"extractor": str(tmp_path / "ext.pt")}}, "ext.pt: file not found"),
        "no-such-class": ({"data": folder, "sample": {"class_labels": 2}}, "sample.class_labels=2: no such class"),
        "too-few-for-fid": ({"data": {**folder, "path": str(tmp_path / "one")},
                             "model": {"class_conditional": False}}, "FID needs at least 2"),
        "ref-images-past-count": ({"fid": {"ref_images": 500}}, "fid.ref_images=500"),
        "conditional-without-classes": ({"data": {**folder, "path": str(tmp_path / "flat")}},
                                        "model.class_conditional=true: the dataset has no classes"),
        "one-sample-image": ({"sample": {"num_images": 1}}, "sample.num_images=1"),
    }[case]
    cfg = write_config(over)
    line = error_line(run_cli("validate", "--config", cfg, check=False))
    assert expect in line and str(cfg) in line


# ---- 1. A run folder records what it was made from ------------------------------------------------

def test_reusing_a_run_name_with_another_dataset_is_refused_everywhere(write_config, tmp_path):
    cfg = write_config({"train": {"total_steps": 4, "segment_steps": 2}})
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg, "--until-step", 2)
    run = tmp_path / "results" / "tiny"
    assert json.loads((run / "run.json").read_text())["trajectory"]["data"]["count"] == 96
    before = tree(run / "checkpoints")
    other = write_config({"data": {"seed": 7}, "train": {"total_steps": 4, "segment_steps": 2}}, name="other.yaml")
    for stage in (["validate"], ["prepare"], ["train", "--until-step", 4]):
        line = error_line(run_cli(stage[0], "--config", other, *stage[1:], check=False))
        assert "data.seed=7" in line and str(run) in line and "new run.name" in line, (stage, line)
    assert "data.seed=7" in error_line(snakemake_dry(tmp_path, other))
    # An older run folder without run.json is judged by its newest checkpoint.
    (run / "run.json").unlink()
    assert "data.seed=7" in error_line(run_cli("train", "--config", other, "--until-step", 4, check=False))
    assert tree(run / "checkpoints") == before
    # Settings that do not change the weights, and a longer run, are not a different run.
    longer = write_config({"train": {"total_steps": 8, "segment_steps": 4, "threads": 2}}, name="longer.yaml")
    run_cli("validate", "--config", longer)


TINY_DIT = {"arch": "dit", "kwargs": {"patch": 4, "depth": 2, "hidden_size": 32, "num_heads": 2}}


def test_settings_that_do_not_apply_are_no_part_of_a_runs_identity(write_config, tmp_path):
    """A DiT run does not use the UNet's channels; a generated dataset has no data.path. Another base config
    that sets them differently is the same run: it validates, resumes, plans nothing new and samples."""
    two = {"train": {"total_steps": 4, "segment_steps": 2}}
    a = write_config({"model": {**TINY_DIT, "channels": 16}, **two}, name="a.yaml")
    run_cli("prepare", "--config", a)
    run_cli("train", "--config", a, "--until-step", 2)
    b = write_config({"model": {**TINY_DIT, "channels": 64, "attn_resolutions": [8]},
                      "data": {"path": str(tmp_path / "unused")}, **two}, name="b.yaml")
    run_cli("validate", "--config", b)
    p = run_cli("train", "--config", b, "--until-step", 4)
    assert "resumed from" in p.stderr and "step_0000002" in p.stderr, p.stderr
    # The workflow counts both checkpoints as this run's: a new segment length plans no new segment end.
    b3 = write_config({"model": {**TINY_DIT, "channels": 64}, "train": {"total_steps": 4, "segment_steps": 3}},
                      name="b3.yaml")
    planned = re.findall(r"--until-step (\d+)", snakemake_dry(tmp_path, b3).stdout)
    assert sorted(set(planned)) == ["2", "4"], planned
    snap = tmp_path / "results/tiny/snapshots/step_0000004.safetensors"
    run_cli("sample", "--config", a, "--snapshot", snap, "--out", tmp_path / "samples")
    # A setting the DiT uses is still a different run.
    c = write_config({"model": {**TINY_DIT, "kwargs": {**TINY_DIT["kwargs"], "depth": 3}}, **two}, name="c.yaml")
    assert "model.kwargs.depth=3" in error_line(run_cli("validate", "--config", c, check=False))


def test_a_checkpoint_written_with_every_key_in_its_hash_still_belongs_to_its_run(write_config, tmp_path):
    """Checkpoints and run.json written before inapplicable keys were set aside carry the hash of every key
    as given; the same run resumes from them, and a config that differs only in such keys does too."""
    two = {"train": {"total_steps": 4, "segment_steps": 2}}
    a = write_config({"model": {**TINY_DIT, "channels": 16}, **two}, name="a.yaml")
    run_cli("prepare", "--config", a)
    old = tmp_path / "old.py"  # the earlier rule: every key, applicable or not, in the trajectory
    old.write_text("import sys\n"
                   "from diffrelay import config\n"
                   "from diffrelay.config import identity\n"
                   "from diffrelay.training import train\n"
                   "identity.trajectory = lambda cfg: identity.trajectory_of(cfg.to_dict() if isinstance(cfg, config.Config) else cfg)\n"
                   "assert train.run(config.load(sys.argv[1]), until_step=2) == 0\n")
    run_cli(sys.executable, old, a)
    meta = json.loads((tmp_path / "results/tiny/checkpoints/step_0000002/meta.json").read_text())
    cfg_a = config.load(a)
    assert meta["trajectory"] != config.trajectory_hash(cfg_a)  # really the old hash
    assert config.is_same_run(meta, config.trajectory_hash(cfg_a))
    b = write_config({"model": {**TINY_DIT, "channels": 64}, **two}, name="b.yaml")
    run_cli("validate", "--config", b)
    p = run_cli("train", "--config", b, "--until-step", 4)
    assert "resumed from" in p.stderr and "step_0000002" in p.stderr, p.stderr


# ---- 2. The divergence guard ---------------------------------------------------------------------

def test_divergence_guard_holds_across_segments_and_retries(write_config, tmp_path):
    # Every step is non-finite (huge noise levels); segments are shorter than the guard's limit.
    cfg = write_config({"train": {"p_mean": 800.0, "max_skipped_steps": 3, "total_steps": 8, "segment_steps": 2,
                                  "log_every": 2}})
    run_cli("prepare", "--config", cfg)
    run = tmp_path / "results" / "tiny"
    run_cli("train", "--config", cfg, "--until-step", 2)  # 2 skipped in a row: under the limit
    p = run_cli("train", "--config", cfg, "--until-step", 4, check=False)
    assert "3 consecutive non-finite steps up to step 3" in error_line(p)
    assert not (run / "checkpoints" / "step_0000004").exists()
    assert not (run / "snapshots" / "step_0000004.safetensors").exists()
    # A retry (SLURM's retries, a rerun) and the next segment refuse to go on from the diverged state.
    for until in (4, 6):
        line = error_line(run_cli("train", "--config", cfg, "--until-step", until, check=False))
        assert "diverged" in line and "new run.name" in line
    assert not (run / "checkpoints" / "step_0000004").exists()
    records = [r for r in logs.read_jsonl(run / "metrics" / "train.jsonl") if "event" not in r]
    assert records and all(r["loss"] is None and r["grad_norm"] is None for r in records)
    assert records[-1]["skipped"] == 2 and records[-1]["skipped_in_window"] == 2
    assert any(r.get("event") == "diverged" for r in logs.read_jsonl(run / "metrics" / "train.jsonl"))


# ---- 3. Silent wrong results ------------------------------------------------------------------------

def test_changed_image_folder_between_segments_is_refused(write_config, tmp_path):
    imgs = image_folder(tmp_path / "imgs", 8)
    cfg = write_config({"data": {"kind": "folder", "path": str(imgs)}, "train": {"total_steps": 4, "segment_steps": 2}})
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg, "--until-step", 2)
    Image.new("RGB", (16, 16), "red").save(imgs / "a" / "new.png")
    run_cli("prepare", "--config", cfg)
    line = error_line(run_cli("train", "--config", cfg, "--until-step", 4, check=False))
    assert "fingerprint" in line and "step_0000002" in line and "images added, removed or changed" in line
    assert not (tmp_path / "results/tiny/checkpoints/step_0000004").exists()


def test_init_past_until_step_and_init_from_another_model_are_one_line(write_config, tmp_path):
    cfg = write_config({"train": {"total_steps": 4, "segment_steps": 2}})
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg, "--until-step", 4)
    run = tmp_path / "results" / "tiny"
    late = run / "checkpoints" / "step_0000004"
    line = error_line(run_cli("train", "--config", cfg, "--init", late, "--until-step", 2, check=False))
    assert "step 4, not before --until-step 2" in line
    assert not (run / "checkpoints" / "step_0000002").exists() or \
        checkpoint.load_checkpoint(run / "checkpoints" / "step_0000002")[1]["step"] == 2
    wide = write_config({"run": {"name": "wide"}, "model": {"channels": 12}, "train": {"total_steps": 8}},
                        name="wide.yaml")
    run_cli("prepare", "--config", wide)
    line = error_line(run_cli("train", "--config", wide, "--init", late, "--until-step", 6, check=False))
    assert "model.channels=8" in line and "model.channels=12" in line


def test_final_checkpoint_made_with_other_settings_is_not_called_done(write_config, tmp_path):
    cfg = write_config({"train": {"total_steps": 2, "segment_steps": 2}})
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg)
    (tmp_path / "results/tiny/run.json").unlink()
    other = write_config({"train": {"total_steps": 2, "segment_steps": 2, "lr": 0.01}}, name="other.yaml")
    p = run_cli("train", "--config", other, check=False)
    assert "train.lr" in error_line(p) and "nothing to do" not in p.stderr


def test_damaged_image_in_a_finished_sample_folder_is_made_again(tmp_path):
    snap = make_snapshot(tmp_path / "snap.safetensors")
    out = tmp_path / "samples"
    m = sample.run(snap, out, settings(num_images=8))
    assert set(m["files"]) == {f"{i:06d}.png" for i in range(8)} | {"grid.png"}
    good = tree(out)
    damaged = out / "000003.png"
    damaged.write_bytes(damaged.read_bytes()[:-20])  # truncated
    (out / "000005.png").write_bytes(bytes(reversed((out / "000005.png").read_bytes())))  # same size, other bytes
    assert folder.damaged_files(out, m) == ["000003.png", "000005.png"]
    sample.run(snap, out, settings(num_images=8))
    assert {k: v for k, v in tree(out).items() if k != "manifest.json"} == \
        {k: v for k, v in good.items() if k != "manifest.json"}
    assert json.loads((out / "manifest.json").read_text())["generated"] == 2  # only the damaged ones


# ---- 4. Hangs: only regular files are read ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "device-link"])
def test_fifo_or_device_named_like_an_image_does_not_hang_prepare(write_config, tmp_path, kind):
    imgs = image_folder(tmp_path / "imgs", 4)
    bad = imgs / "a" / "zz.png"
    os.mkfifo(bad) if kind == "fifo" else bad.symlink_to("/dev/zero")
    cfg = write_config({"data": {"kind": "folder", "path": str(imgs)}})
    line = error_line(run_cli("prepare", "--config", cfg, check=False, timeout=60))
    assert "zz.png" in line and "not a regular file" in line
    skip = write_config({"run": {"name": "skip"}, "data": {"kind": "folder", "path": str(imgs), "on_corrupt": "skip"}},
                        name="skip.yaml")
    run_cli("prepare", "--config", skip, timeout=60)
    assert json.loads((tmp_path / "results/skip/dataset/dataset.json").read_text())["skipped"] == ["a/zz.png"]


def test_config_path_that_is_a_fifo_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "config.yaml")
    line = error_line(run_cli("validate", "--config", tmp_path / "config.yaml", check=False, timeout=60))
    assert "config.yaml" in line and "not a regular file" in line


# ---- 5. Numbers, YAML and files: one line each ------------------------------------------------------

@pytest.mark.parametrize("text, expect", [
    ("train:\n  lr: .nan\n", "train.lr=nan: not a finite number"),
    ("train:\n  betas: [0.9, .inf]\n", "train.betas[1]=inf: not a finite number"),
    ("fid:\n  timeout_minutes: -.inf\n", "fid.timeout_minutes=-inf: not a finite number"),
    ("run:\n  seed: 18446744073709551616\n", "run.seed=18446744073709551616: must be at most"),
    ("train:\n  batch_size: 1000000000\n", "train.batch_size=1000000000: must be at most"),
    ("model:\n  channels: 100000\n", "model.channels=100000: must be at most"),
    ("model:\n  channels: 4096\n  channel_mult: [1, 64]\n", "gives 262144 channels"),
    ("train:\n  total_steps: 10000000\n  segment_steps: 10\n", "train.total_steps=10000000: must be at most 9999999"),
    ("sample:\n  first_seed: 9223372036854775800\n", "passes the largest seed"),
    ("train:\n  lr: 1e-3\n  lr: 2e-3\n", "key 'lr' appears twice (again at line 3)"),
    ("run: {name: a}\nrun: {name: b}\n", "key 'run' appears twice"),
])
def test_numbers_and_yaml_that_pass_the_schema_but_break_later_are_one_line(write_config, tmp_path, text, expect):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    line = error_line(run_cli("validate", "--config", write_config(), "--config", cfg, check=False))
    assert expect in line, line


@pytest.mark.parametrize("name", ["-x", ".hidden", "_a", "a b", "a;b"])
def test_run_name_message_states_the_rule_it_broke(name):
    with pytest.raises(UserError, match=r"run.name=.*must start with a letter or digit, then only letters"):
        config.validate({"run": {"name": name}})


def test_exponent_without_a_dot_is_a_number(tmp_path):
    cfg = tmp_path / "lr.yaml"
    cfg.write_text("train:\n  lr: 1e-3\n  weight_decay: 5E-2\n")
    c = config.load(cfg)
    assert c.train.lr == 0.001 and c.train.weight_decay == 0.05


def test_nested_yaml_aliases_are_refused_before_they_expand(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
              f"*a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    cfg = tmp_path / "laughs.yaml"
    cfg.write_text("\n".join(lines) + "\n")  # 10^9 values once expanded
    t0 = time.time()
    with pytest.raises(UserError, match="YAML aliases expand to more than"):
        config.load(cfg)
    assert time.time() - t0 < 10


def test_nan_in_a_workflow_config_is_blamed_on_the_file_and_1e_minus_3_is_accepted(write_config, tmp_path):
    nan = write_config({"train": {"lr": float("nan")}}, name="nan.yaml")
    line = error_line(snakemake_dry(tmp_path, nan))
    assert "train.lr=nan" in line and "nan.yaml" in line and "--config" not in line.split("nan.yaml")[1]
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(yaml.safe_load(write_config().read_text())).replace("lr: 0.002", "lr: 2e-3"))
    assert "lr: 2e-3" in exp.read_text()
    p = snakemake_dry(tmp_path, exp)
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a read-only tmpfs")
def test_read_only_results_folder_is_one_line_in_train(write_config, tmp_path):
    run_cli("prepare", "--config", write_config(), "--out", tmp_path / "dataset")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1000k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        cfg = write_config({"run": {"results": str(mnt)}}, name="ro.yaml")
        line = error_line(run_cli("train", "--config", cfg, "--dataset", tmp_path / "dataset", "--until-step", 3,
                                  check=False))
        assert "cannot write" in line and "run.results" in line
    finally:
        subprocess.run(["umount", str(mnt)])


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_killing_fid_kills_its_scoring_child_and_leaves_no_result(tmp_path):
    from diffrelay.evaluation import extractor, fid
    from test_fid import shapes, write_dataset, write_pngs

    imgs = shapes(24, seed=0)
    ext = extractor.build_random(tmp_path / "ext.pt", seed=0)
    ref = fid.make_ref(write_dataset(tmp_path / "dataset", imgs[:12], "f" * 64), ext, out=tmp_path / "ref.npz")
    images = write_pngs(tmp_path / "images", imgs[12:])
    out = tmp_path / "score.json"
    parent = subprocess.Popen([sys.executable, "-m", "diffrelay", "fid", "--images", str(images), "--ref", str(ref),
                               "--extractor", str(ext), "--out", str(out)], stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (kids := children(parent.pid)) and time.time() < deadline:
        time.sleep(0.05)
    assert kids, "the scoring child never started"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while any(Path(f"/proc/{k}").exists() and "Z" not in Path(f"/proc/{k}/stat").read_text().split()[2]
              for k in kids) and time.time() < deadline:
        time.sleep(0.05)
    alive = [k for k in kids if Path(f"/proc/{k}").exists() and Path(f"/proc/{k}/stat").read_text().split()[2] != "Z"]
    assert not alive
    time.sleep(1)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_fid_names_an_undecodable_image_instead_of_a_traceback(tmp_path):
    from diffrelay.evaluation import extractor, fid
    from test_fid import shapes, write_dataset, write_pngs

    imgs = shapes(24, seed=0)
    ext = extractor.build_random(tmp_path / "ext.pt", seed=0)
    ref = fid.make_ref(write_dataset(tmp_path / "dataset", imgs[:12], "f" * 64), ext, out=tmp_path / "ref.npz")
    images = write_pngs(tmp_path / "images", imgs[12:])
    bad = sorted(images.glob("*.png"))[5]
    bad.write_bytes(bad.read_bytes()[:40])
    p = run_cli("fid", "--images", images, "--ref", ref, "--extractor", ext, "--out", tmp_path / "s.json", check=False)
    line = error_line(p)
    assert bad.name in line and "damaged or not an image" in line
    assert not (tmp_path / "s.json").exists()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height (greyscale), with no pixels: a decompression bomb's shape, 57 bytes."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [12000, 20000])  # past Pillow's warning (89.5 M pixels), past its error (179 M)
def test_an_image_past_max_image_pixels_is_refused_from_its_header_naming_file_size_and_key(tmp_path, side):
    """A 12000 x 12000 PNG got Pillow's DecompressionBombWarning, naming no file, and was decoded (1.74 GB)."""
    import warnings

    from diffrelay.data import datasets

    (tmp_path / "big.png").write_bytes(png_header(side, side))
    row = lambda on_corrupt, bound, name: datasets._file_row(tmp_path, 16, on_corrupt, "center", bound,  # noqa: E731
                                                             (name, "sha"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(UserError) as e:
            row("error", datasets.MAX_IMAGE_PIXELS, "big.png")
        assert row("skip", datasets.MAX_IMAGE_PIXELS, "big.png") is None
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)], seen
    line = str(e.value)
    assert line.startswith(f"{tmp_path / 'big.png'}: ") and f"{side * side:,} pixels, more than " \
        "data.max_image_pixels=89,478,485" in line and "data.on_corrupt: skip" in line, line
    # The bound is the config's, either way; Pillow's own gives way to a higher one.
    Image.new("RGB", (64, 64)).save(tmp_path / "ok.png")
    with pytest.raises(UserError, match=r"ok\.png: 64x64 = 4,096 pixels, more than data\.max_image_pixels=4,000"):
        row("error", 4000, "ok.png")
    assert row("error", 4096, "ok.png").shape == (16, 16, 3)
    with pytest.raises(UserError, match="big.png: corrupt or unsupported image"):  # read past the header: no pixels
        row("error", 500_000_000, "big.png")
    assert datasets.Image.MAX_IMAGE_PIXELS == datasets.MAX_IMAGE_PIXELS  # Pillow's bound is back as it was


def test_a_file_name_with_a_newline_stays_on_the_messages_one_line(tmp_path):
    """A newline in an image's name split the "image changed" refusal (and others) over two lines: names are quoted
    (Python's repr) where they hold such a character, and left as they are otherwise."""
    from types import SimpleNamespace

    from diffrelay.data import datasets, sources

    odd = "a\nb.png"
    assert sources.changes({"files": {odd: "1", "c.png": "2"}}, {"files": {odd: "3"}}) == \
        "image 'a\\nb.png' changed, image c.png removed"
    assert sources.changes({}, {"files": {"x\t.png": "1", "y\u2028.png": "2"}}) == \
        "2 images added ('x\\t.png', 'y\\u2028.png')"
    run = tmp_path / "run"
    for fp, sha in (("old", "1"), ("new", "2")):
        io.write_json(run / sources.RECORDS / f"{fp}.json", {"files": {odd: sha}})
    with pytest.raises(UserError) as e:
        sources.check_trained_on(run / "step", "old", SimpleNamespace(path=tmp_path / "imgs", fingerprint="new"), run)
    assert "image 'a\\nb.png' changed" in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)
    (tmp_path / odd).write_bytes(b"not an image")
    os.mkfifo(tmp_path / "f\n.png")
    for call in (lambda: datasets._file_row(tmp_path, 16, "error", "center", datasets.MAX_IMAGE_PIXELS, (odd, "s")),
                 lambda: io.check_regular_file(tmp_path / "f\n.png", 1 << 20, "image file")):
        with pytest.raises(UserError) as e:
            call()
        assert len(str(e.value).splitlines()) == 1 and str(e.value).startswith(f"'{tmp_path}/"), str(e.value)
    assert io.shown(tmp_path / "plain name.png") == str(tmp_path / "plain name.png")


# ---- No command overwrites a file it did not make -------------------------------------------------

def out_commands(tmp_path):
    """Each command that writes one named file (or a report folder's files), given a target to write."""
    from diffrelay.evaluation import extractor

    ext = extractor.build_random(tmp_path / "ext.pt")
    return {
        "collect": lambda out: ["collect", "--out", out, "a.json"],
        "select-best": lambda out: ["select-best", "--best", 1, "--out", out, tmp_path / "seg.json"],
        "fid": lambda out: ["fid", "--images", tmp_path / "none", "--ref", tmp_path / "r.npz", "--extractor", ext,
                            "--out", out],
        "fid-ref": lambda out: ["fid-ref", "--dataset", tmp_path / "none", "--extractor", ext, "--out", out],
        "fetch-extractor": lambda out: ["fetch-extractor", "--extractor", ext, "--out", out],
        "report": lambda out: ["report", "--run-dir", tmp_path, "--out", out.parent],
    }


@pytest.mark.parametrize("command", ["collect", "select-best", "fid", "fid-ref", "fetch-extractor", "report"])
@pytest.mark.parametrize("target", ["user-file", "checkpoint-file"])
def test_no_command_overwrites_a_file_it_did_not_make(tmp_path, command, target):
    if target == "user-file":
        out = tmp_path / "mine" / ("best.json" if command == "report" else "notes.json")
        out.parent.mkdir()
        out.write_text('{"mine": true}')
    else:  # a run's final checkpoint, as a wrong --out would name it
        out = tmp_path / "run" / "checkpoints" / "step_0000400" / ("best.json" if command == "report" else "state.pt")
        out.parent.mkdir(parents=True)
        out.write_bytes(b"weeks of GPU time")
    before = out.read_bytes()
    line = error_line(run_cli(*out_commands(tmp_path)[command](out), check=False))
    assert f"{out}: exists and is not" in line and "nothing was overwritten" in line, line
    assert out.read_bytes() == before


def test_a_command_may_replace_its_own_earlier_result(tmp_path):
    out = tmp_path / "seg.json"
    run_cli("collect", "--out", out, "a.json")
    run_cli("collect", "--out", out, "b.json")
    assert json.loads(out.read_text()) == {"scores": ["b.json"]}
    # A fid result is not a collect file, nor the reverse: each refuses the other's.
    (tmp_path / "r.json").write_text(json.dumps({"scores": [], "num_images": 1, "mode": "clean", "images": "x"}))
    assert "exists and is not" in error_line(run_cli("collect", "--out", tmp_path / "r.json", check=False))


def test_a_self_looping_symlink_is_called_a_loop_not_a_permission_problem(tmp_path):
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    with pytest.raises(UserError, match=r"loop.json: cannot read JSON file \(Too many levels of symbolic links\); "
                                        r"it is a symlink loop"):
        io.read_json(loop)
