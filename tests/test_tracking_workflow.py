"""Experiment trackers end to end (issue 41's "Done when"): the workflow with W&B offline and MLflow's sqlite
store, two segments, two checkpoints, a guidance list and grids, after a kill -9 mid-segment and the rerun; the
offline W&B run files and the MLflow store then hold each series once."""

import collections
import json
import os
import signal
import subprocess
import time

import pytest
import yaml

from conftest import BIN, REPO, TINY, deep_merge, run_cli
from test_tracking import history_row, read_wandb

from diffrelay import config, logs

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def wait_for_step(run_dir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.get("step", 0) >= step and "loss" in r for r in logs.read_jsonl(run_dir / "metrics" / "train.jsonl")):
            return
        assert proc.poll() is None, "training ended before the kill"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")


@pytest.mark.slow
def test_both_trackers_offline_hold_one_series_of_everything_after_a_kill_and_rerun(tmp_path):
    d = deep_merge(TINY, {
        "run": {"results": str(tmp_path / "results"), "resources": str(tmp_path / "resources")},
        "train": {"total_steps": 80, "segment_steps": 40, "recovery_every": 10, "log_every": 1, "label_dropout": 0.2},
        "sample": {"guidance": [1.0, 2.0]},
        "track": {"wandb": {"project": "p", "tags": ["test"]}, "mlflow": {}}})
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(d, sort_keys=False))
    run_dir = tmp_path / "results" / "tiny"
    env = {**os.environ, **{v: str(tmp_path / "wandb-home" / v) for v in
                            ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}}
    env.pop("WANDB_API_KEY", None)
    env.pop("MLFLOW_TRACKING_URI", None)

    # kill -9 in the middle of segment 1, after a recovery checkpoint: the rerun logs some steps again.
    run_cli("prepare", "--config", cfg_path)
    job = subprocess.Popen([BIN / "diffrelay", "train", "--config", cfg_path, "--until-step", "40"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_step(run_dir, 13, job)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    # The first segment's track job on its own, then the rest: at least two jobs continue the one tracker run
    # (in one invocation the first job may already find everything and leave the next with nothing to send).
    for target in ([run_dir / "track" / "step_0000040.json"], []):
        p = subprocess.run([BIN / "snakemake", *target, "--snakefile", REPO / "Snakefile", "--directory", tmp_path,
                            "--cores", "2", "--configfile", cfg_path], capture_output=True, text=True, env=env,
                           timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "warning" not in (p.stdout + p.stderr).lower().replace("warnings", "")
    logged = collections.Counter(r["step"] for r in logs.read_jsonl(run_dir / "metrics/train.jsonl") if "loss" in r)
    assert max(logged.values()) == 2, "the kill should have left steps logged twice"

    # W&B: every job's offline folder of the one run id, read in start-time order (as `wandb sync` uploads them).
    folders = sorted((run_dir / "track" / "wandb").glob("offline-run-*"))
    assert len(folders) >= 2 and len({f.name.rsplit("-", 1)[1] for f in folders}) == 1
    rows, configs = [], {}
    for f in folders:
        for r in read_wandb(next(f.glob("run-*.wandb"))):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                rows.append(history_row(r))
            elif kind in ("config", "run"):
                for u in (r.config if kind == "config" else r.run.config).update:
                    configs[u.key] = json.loads(u.value_json)
    assert [r["train/step"] for r in rows if "train/loss" in r] == list(range(1, 81))
    fids = sorted((r["eval/step"], k) for r in rows for k in r if isinstance(k, str) and k.endswith("/fid"))
    assert fids == [(40, "eval/g2/fid"), (40, "eval/main/fid"), (80, "eval/g2/fid"), (80, "eval/main/fid")]
    grids = sorted((r["eval/step"], k[0], r[k]) for r in rows for k in r if isinstance(k, tuple) and k[1] == "_type")
    assert grids == [(40, "samples/g2", "image-file"), (40, "samples/main", "image-file"),
                     (80, "samples/g2", "image-file"), (80, "samples/main", "image-file")]
    trajectory = config.trajectory_hash(config.load(cfg_path))
    assert configs["trajectory"] == trajectory and set(configs["snapshots_sha256"]) == {"40", "80"}
    assert configs["config"]["sample"]["guidance"] == [1.0, 2.0] and "name" not in configs["config"]["run"]

    # MLflow: the sqlite store in the working directory (the default tracking URI).
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("diffrelay").experiment_id])
    assert len(runs) == 1
    rid = runs[0].info.run_id
    assert [m.step for m in client.get_metric_history(rid, "train/loss")] == list(range(1, 81))
    for series in ("main", "g2"):
        assert sorted(m.step for m in client.get_metric_history(rid, f"eval/{series}/fid")) == [40, 80]
    images = sorted(a.path.split("/")[-1].split("+timestamp")[0] for a in client.list_artifacts(rid, "images")
                    if a.path.endswith(".png"))
    assert images == ["samples~g2+step+40", "samples~g2+step+80", "samples~main+step+40", "samples~main+step+80"]
    sent = json.loads(open(client.download_artifacts(rid, "diffrelay/config.json", str(tmp_path))).read())
    assert sent["trajectory"] == trajectory and runs[0].data.tags["diffrelay.trajectory"] == trajectory

    final = json.loads((run_dir / "track" / "report.json").read_text())
    assert final["pending"] == 0 and set(final["trackers"]) == {"wandb", "mlflow"}
