"""Experiment trackers (issue 41), in-process: what a run folder yields for them, the ledger that sends each thing
once, a failing tracker (one warning, backlog kept, job succeeds), privacy, and the parse-time credentials check."""

import glob
import json
import os
import re
import struct
import subprocess
import sys

import pytest
import yaml

from conftest import TINY, deep_merge

from diffrelay import config
from diffrelay.config import preflight
from diffrelay.errors import UserError
from diffrelay.tracking import ledger as ledgers
from diffrelay.tracking import publish, records, settings, wandb_sink

SECRET = "0123456789abcdef0123456789abcdef01234567"


def read_wandb(path) -> list:
    """The records of an offline W&B run file (run-<id>.wandb): a LevelDB-style log of 32 KiB blocks after a
    7-byte header, each record a (crc, length, type) header and a piece of a serialized wandb Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def wandb_history(run_dir) -> list[dict]:
    """Every history row of every offline run folder of a diffrelay run, in start-time order."""
    rows = []
    for f in sorted(glob.glob(str(run_dir / "track" / "wandb" / "offline-run-*" / "run-*.wandb"))):
        for r in read_wandb(f):
            if r.WhichOneof("record_type") == "history":
                rows.append(history_row(r))
    return rows


def history_row(record) -> dict:
    """One W&B history row: key (a nested value, such as an image's fields, as a tuple) -> value."""
    return {(i.key or (i.nested_key[0] if len(i.nested_key) == 1 else tuple(i.nested_key))): json.loads(i.value_json)
            for i in record.history.item}


def make_config(tmp_path, track, name="secret-run-name") -> config.Config:
    d = deep_merge(TINY, {"run": {"name": name, "results": str(tmp_path / "results"),
                                  "resources": str(tmp_path / "resources")}, "track": track})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(d))
    return config.load(path)


def fake_run(run_dir, resumed=True):
    """A run folder as its jobs leave it: segment 1 (steps 1-4) killed after step 3 and resumed from step 2,
    segment 2 half trained; two evaluations of step 4, one sample folder still being written."""
    lines = [{"event": "segment_start", "step": 0}]
    lines += [{"step": s, "loss": 1.0 / s, "lr": 0.1, "grad_norm": 2.0, "images_per_s": 9.0, "skipped": 0}
              for s in (1, 2, 3)]
    if resumed:
        lines += [{"event": "segment_start", "step": 2}]
    lines += [{"step": s, "loss": 10.0 + s, "lr": 0.1, "grad_norm": 2.0, "images_per_s": 9.0, "skipped": 0}
              for s in (3, 4, 5)]
    (run_dir / "metrics" / "fid").mkdir(parents=True)
    (run_dir / "metrics" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "lo')
    (run_dir / "trained").mkdir()
    (run_dir / "trained" / "step_0000004.json").write_text('{"step": 4}')
    for name, fid in (("step_0000004", 3.0), ("step_0000004_g2", 2.0)):
        (run_dir / "metrics" / "fid" / f"{name}.json").write_text(json.dumps(
            {"fid": fid, "kid": 0.1, "images": str(run_dir / "samples" / name), "scores": [{"fid": fid, "kid": 0.1}]}))
    from PIL import Image

    for name, done in (("step_0000004", True), ("step_0000004_g2", False)):
        folder = run_dir / "samples" / name
        folder.mkdir(parents=True)
        Image.new("RGB", (8, 8), (200, 10, 10)).save(folder / "grid.png")
        if done:
            (folder / "manifest.json").write_text(json.dumps({"snapshot_sha256": "ab" * 32}))


def test_records_keep_the_last_record_of_a_resumed_step_and_only_finished_segments(tmp_path):
    run_dir = tmp_path / "run"
    fake_run(run_dir)
    rec = records.collect(run_dir)
    assert list(rec.train) == [1, 2, 3, 4]  # step 5 belongs to the unfinished segment 2
    assert rec.train[3]["loss"] == 13.0  # the resumed run's record wins
    assert rec.evals == {("main", 4): {"fid": 3.0, "kid": 0.1}, ("g2", 4): {"fid": 2.0, "kid": 0.1}}
    assert list(rec.grids) == [("main", 4)]  # the g2 folder has no manifest yet
    assert rec.snapshots == {4: "ab" * 32}
    # A snapshot's held-out loss (metrics/val_loss) joins the main series at its step, under the columns' names.
    (run_dir / "metrics" / "val_loss").mkdir()
    (run_dir / "metrics" / "val_loss" / "step_0000004.json").write_text(json.dumps(
        {"val_loss": 0.5, "val_loss_low": 0.9, "val_loss_middle": 0.4, "val_loss_high": float("nan"), "finished": 7.0}))
    rec = records.collect(run_dir)
    assert rec.evals[("main", 4)] == {"fid": 3.0, "kid": 0.1, "val_loss": 0.5, "val_loss_low": 0.9,
                                      "val_loss_middle": 0.4}
    assert rec.rejected[("main", 4)][1] == {"val_loss_high": pytest.approx(float("nan"), nan_ok=True)}


class Recorder:
    def __init__(self, fail=()):
        self.sent, self.fail = [], set(fail)

    def __call__(self, name):
        def send(cfg, ident, batch, where):
            if name in self.fail:
                raise ConnectionError("api.example: unreachable\nsecond line")
            self.sent.append((name, ident, batch))
        return send


def test_publishing_twice_sends_nothing_the_second_time(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, {"wandb": {}, "mlflow": {}})
    fake_run(config.run_dir(cfg))
    rec = Recorder()
    monkeypatch.setattr(publish, "sink", rec)
    warnings = []
    first = publish.publish(cfg, "cmd", warnings.append)
    assert [n for n, _, _ in rec.sent] == ["wandb", "mlflow"] and not warnings
    assert first["wandb"]["sent"] == {"train_steps": 4, "scores": 2, "grids": 1, "config": True}
    rec.sent.clear()
    again = publish.publish(cfg, "cmd", warnings.append)
    assert rec.sent == [] and again["wandb"]["pending"] == 0 and again["mlflow"]["sent"] is not None
    # A new score arrives: only it is sent.
    (config.run_dir(cfg) / "metrics" / "fid" / "step_0000004_g3.json").write_text('{"fid": 1.0}')
    publish.publish(cfg, "cmd", warnings.append)
    assert [list(b["evals"]) for _, _, b in rec.sent] == [[("g3", 4)]] * 2
    assert all(not b["train"] and b["config"] is None for _, _, b in rec.sent)


def test_a_failing_tracker_warns_once_keeps_its_backlog_and_the_next_job_sends_it(tmp_path, monkeypatch, capfd):
    cfg = make_config(tmp_path, {"wandb": {}, "mlflow": {}})
    fake_run(config.run_dir(cfg))
    monkeypatch.setattr(publish, "sink", Recorder(fail={"wandb"}))
    out = tmp_path / "step.json"
    args = [*(["--config", str(tmp_path / "c.yaml")]), "--step", "4", "--out", str(out), "--final"]
    from diffrelay import cli

    assert cli.main(["track", *args]) == 0
    err = capfd.readouterr().err.splitlines()
    warns = [line for line in err if line.startswith("diffrelay: warning: wandb")]
    assert len(warns) == 1 and "8 records not sent (ConnectionError: api.example: unreachable)" in warns[0]
    assert "diffrelay track --config" in warns[0]
    record = json.loads(out.read_text())
    assert record["trackers"]["wandb"]["pending"] == 8 and record["trackers"]["mlflow"]["pending"] == 0
    assert "diffrelay track --config" in record["send_with"]
    assert any("8 tracker records are still pending" in line for line in err)
    ledger = ledgers.load(config.run_dir(cfg) / "track" / "ledger.json")
    assert "wandb" not in ledger and ledger["mlflow"]["train"] == [1, 2, 3, 4]
    rec = Recorder()
    monkeypatch.setattr(publish, "sink", rec)
    assert cli.main(["track", *args]) == 0
    assert [(n, ledgers.count(b)) for n, _, b in rec.sent] == [("wandb", 8)]


def test_no_tracker_configured_imports_neither_tracker(tmp_path):
    make_config(tmp_path, {})
    code = ("import sys; from diffrelay import cli; assert cli.main(['track', '--config', sys.argv[1]]) == 0; "
            "assert not {'wandb', 'mlflow'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.yaml")], check=True, capture_output=True)


def test_the_step_metrics_put_training_at_its_step_and_scores_and_grids_at_the_checkpoints():
    calls = []

    class Run:
        def define_metric(self, name, step_metric=None):
            calls.append((name, step_metric))

    wandb_sink.define_metrics(Run())
    assert ("train/*", "train/step") in calls and ("eval/*", "eval/step") in calls
    assert ("samples/*", "eval/step") in calls and ("train/step", None) in calls and ("eval/step", None) in calls


def test_nothing_sent_or_written_holds_the_run_name_a_path_or_the_api_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cfg = make_config(tmp_path, {"wandb": {"tags": ["t1"]}})
    run_dir = config.run_dir(cfg)
    fake_run(run_dir)
    sent = []
    real = publish.sink

    def spy(name):
        def send(c, ident, batch, where):
            sent.append((ident, batch))
            return real(name)(c, ident, batch, where)
        return send

    monkeypatch.setattr(publish, "sink", spy)
    result = publish.publish(cfg, "cmd", pytest.fail)
    assert result["wandb"]["error"] is None
    ident, batch = sent[0]
    text = json.dumps({"ident": ident, "config": batch["config"], "train": batch["train"],
                       "evals": {str(k): v for k, v in batch["evals"].items()}})
    assert "secret-run-name" not in text and str(tmp_path) not in text and "results" not in batch["config"]["config"]
    assert ident["name"] == f"diffrelay-{ident['id'][:8]}"
    assert batch["config"]["trajectory"] == config.trajectory_hash(cfg)
    assert batch["config"]["snapshots_sha256"] == {"4": "ab" * 32} and "diffrelay" in batch["config"]["versions"]
    wandb_file = glob.glob(str(run_dir / "track" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(wandb_file) == 1
    blob = open(wandb_file[0], "rb").read()
    assert b"secret-run-name" not in blob and str(tmp_path).encode() not in blob
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
    rows = wandb_history(run_dir)
    assert [r["train/step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert {(r["eval/step"], r.get("eval/g2/fid")) for r in rows if "eval/g2/fid" in r} == {(4, 2.0)}

    named = settings.run_config({**cfg.to_dict(), "track": {"send_names": True}}, "t", {})
    assert named["config"]["run"]["name"] == "secret-run-name" and named["config"]["run"]["results"]


def test_an_online_wandb_run_without_credentials_is_refused_at_parse_time(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = make_config(tmp_path, {"wandb": {"mode": "online"}})
    with pytest.raises(UserError) as e:
        preflight.check(cfg, "c.yaml")
    msg = str(e.value)
    assert msg.startswith("c.yaml: track.wandb.mode=online: no W&B credentials") and "wandb login" in msg
    assert "\n" not in msg
    (tmp_path / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {SECRET}\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert settings.check_config(cfg.to_dict()) == []
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    assert settings.check_config(cfg.to_dict()) == []
    assert settings.check_config(make_config(tmp_path, {"wandb": {}}).to_dict()) == []  # offline needs none


def test_a_second_track_job_waits_for_the_lock_and_leaves_its_records_pending_when_it_cannot_have_it(
        tmp_path, monkeypatch):
    import fcntl

    cfg = make_config(tmp_path, {"mlflow": {}})
    fake_run(config.run_dir(cfg))
    rec = Recorder()
    monkeypatch.setattr(publish, "sink", rec)
    track = config.run_dir(cfg) / "track"
    track.mkdir()
    with open(track / ".lock", "a") as held:  # another job's publish
        fcntl.flock(held, fcntl.LOCK_EX)
        warnings = []
        result = publish.publish(cfg, "cmd", warnings.append, wait_s=0.3)
    assert rec.sent == [] and result["mlflow"]["pending"] == 8 and len(warnings) == 1 and "held" in warnings[0]
    assert not (track / "ledger.json").exists()
    assert publish.publish(cfg, "cmd", pytest.fail)["mlflow"]["sent"]["train_steps"] == 4


# --- review fixes (issue 41) -------------------------------------------------------------------------------------

def _rule(text: str, name: str) -> str:
    start = text.index(f"rule {name}:")
    end = text.find("\nrule ", start + 1)
    return text[start:end if end > 0 else None]


def test_training_numbers_have_their_own_track_job_ahead_of_the_next_segment_and_every_track_job_sees_the_section():
    from conftest import REPO

    track = (REPO / "workflow" / "rules" / "track.smk").read_text()
    train = _rule(track, "track_train")
    inputs = train[train.index("input:"):train.index("output:")]
    assert inputs.split() == ["input:", "trained=rules.train_segment.output.trained,"]  # no evaluation
    priority = int(re.search(r"priority: (\d+)", train).group(1))
    segment = (REPO / "workflow" / "rules" / "train.smk").read_text()
    assert priority > int(re.search(r"priority: (\d+)", segment).group(1))
    assert "track_train," in track[:track.index("rule ")]  # a local rule
    for name in ("track_train", "track_segment", "track_report"):
        assert "trackers=TRACK_DIGEST" in _rule(track, name), name  # a changed track section reruns it
    assert "get_track_train_records" in _rule(track, "track_report")
    d = {"track": {"wandb": {}}}
    assert settings.section_digest(d) != settings.section_digest({"track": {"wandb": {"project": "q"}}})


def test_the_track_command_never_fails_its_job(tmp_path, capfd):
    from diffrelay import cli

    out = tmp_path / "rec.json"
    assert cli.main(["track", "--config", str(tmp_path / "missing.yaml"), "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert len([line for line in err.splitlines() if "warning: nothing published" in line]) == 1
    record = json.loads(out.read_text())
    assert record["pending"] is None and "missing.yaml" in record["error"] and record["send_with"]


def test_the_run_folder_is_read_under_the_lock(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, {"mlflow": {}})
    fake_run(config.run_dir(cfg))
    monkeypatch.setattr(publish, "sink", Recorder())
    order, real_lock, real_collect = [], publish.lock, records.collect
    monkeypatch.setattr(publish, "lock", lambda *a: order.append("lock") or real_lock(*a))
    monkeypatch.setattr(records, "collect", lambda *a: order.append("collect") or real_collect(*a))
    publish.publish(cfg, "cmd", pytest.fail)
    assert order == ["lock", "collect"]


def test_trackers_are_imported_with_telemetry_off_and_bounded_requests(monkeypatch):
    for key in publish.TRACKER_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")  # the user's own setting wins
    publish.sink("mlflow")
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true" and os.environ["WANDB_ERROR_REPORTING"] == "false"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5" and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
    wandb = pytest.importorskip("wandb")
    s = wandb_sink.settings(wandb)
    assert s.init_timeout <= 60 and s.finish_timeout > 0 and s.finish_timeout_raises


def test_a_password_in_a_url_never_reaches_a_warning_or_the_record(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, {"mlflow": {}})
    fake_run(config.run_dir(cfg))

    def sink(name):
        def send(*a):
            raise ConnectionError("POST https://alice:s3cret@mlflow.example/api failed; also postgresql://bob:pw@db/x")
        return send

    monkeypatch.setattr(publish, "sink", sink)
    warnings = []
    result = publish.publish(cfg, "cmd", warnings.append)
    text = json.dumps(result) + "\n".join(warnings)
    assert "s3cret" not in text and "bob:pw" not in text and "https://***@mlflow.example/api" in text
    assert "postgresql://***@db/x" in text


def test_a_new_destination_gets_the_whole_backlog(tmp_path, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(publish, "sink", rec)
    cfg = make_config(tmp_path, {"mlflow": {"experiment": "a"}})
    fake_run(config.run_dir(cfg))
    assert publish.publish(cfg, "cmd", pytest.fail)["mlflow"]["sent"]["train_steps"] == 4
    assert publish.publish(cfg, "cmd", pytest.fail)["mlflow"]["sent"]["train_steps"] == 0
    cfg = make_config(tmp_path, {"mlflow": {"experiment": "b"}})
    assert publish.publish(cfg, "cmd", pytest.fail)["mlflow"]["sent"] == {"train_steps": 4, "scores": 2, "grids": 1,
                                                                          "config": True}
    entry = ledgers.load(config.run_dir(cfg) / "track" / "ledger.json")["mlflow"]
    assert entry["run_id"] == rec.sent[-1][1]["id"] and entry["destination"] == settings.destination(
        "mlflow", {"experiment": "b"})


def test_a_new_run_folder_is_a_new_tracker_run(tmp_path, monkeypatch):
    import shutil

    rec = Recorder()
    monkeypatch.setattr(publish, "sink", rec)
    cfg = make_config(tmp_path, {"wandb": {}})
    run_dir = config.run_dir(cfg)
    ids = []
    for created in (1000.5, 2000.25):
        fake_run(run_dir)
        (run_dir / "run.json").write_text(json.dumps({"created": created}))
        for _ in range(2):
            publish.publish(cfg, "cmd", pytest.fail)
        ids.append([ident["id"] for _, ident, _ in rec.sent])
        rec.sent.clear()
        shutil.rmtree(run_dir)
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]  # the new folder sent its whole backlog again


def test_an_unreadable_grid_is_named_skipped_and_kept_pending(tmp_path, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(publish, "sink", rec)
    cfg = make_config(tmp_path, {"wandb": {}, "mlflow": {}})
    run_dir = config.run_dir(cfg)
    fake_run(run_dir)
    grid = run_dir / "samples" / "step_0000004" / "grid.png"
    grid.write_bytes(b"\x89PNG broken")
    warnings = []
    result = publish.publish(cfg, "cmd", warnings.append)
    assert len(warnings) == 1 and str(grid) in warnings[0]  # once, not once per tracker
    assert [b["grids"] for _, _, b in rec.sent] == [{}, {}] and all(b["train"] for _, _, b in rec.sent)
    assert result["mlflow"]["pending"] == 1 and result["mlflow"]["sent"]["train_steps"] == 4
    assert ledgers.load(run_dir / "track" / "ledger.json")["mlflow"]["grids"] == []


def test_mlflow_metrics_carry_the_time_of_their_record_so_a_resend_is_an_exact_duplicate(tmp_path, monkeypatch):
    import types

    run_dir = tmp_path / "run"
    fake_run(run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()[:-1]]
    (run_dir / "metrics" / "train.jsonl").write_text("".join(json.dumps({**r, "time": 100.0 + r["step"]}) + "\n"
                                                             for r in lines))
    score = run_dir / "metrics" / "fid" / "step_0000004.json"
    score.write_text(json.dumps({**json.loads(score.read_text()), "finished": 500.5}))
    rec = records.collect(run_dir)
    batch = ledgers.pending(ledgers.empty(), rec, {})
    batch["grids"], batch["config"] = {}, None
    logged = []

    class Client:
        def __init__(self, tracking_uri):
            pass

        def log_batch(self, run_id, metrics, synchronous):
            logged.extend(metrics)

    monkeypatch.setitem(sys.modules, "mlflow.entities", types.SimpleNamespace(Metric=lambda *a: a))
    monkeypatch.setitem(sys.modules, "mlflow.tracking", types.SimpleNamespace(MlflowClient=Client))
    from diffrelay.tracking import mlflow_sink

    monkeypatch.setattr(mlflow_sink, "find_run", lambda *a: "r")
    for _ in range(2):
        mlflow_sink.send({}, {"id": "x", "trajectory": "t"}, batch, tmp_path)
    first, second = logged[:len(logged) // 2], logged[len(logged) // 2:]
    assert first == second  # identical rows: MLflow's SQL store skips them
    assert ("train/loss", 13.0, 103000, 3) in first and ("eval/main/fid", 3.0, 500500, 4) in first


def test_the_credentials_check_runs_only_where_asked_and_reads_the_wandb_host_from_its_settings(tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "NETRC", "WANDB_BASE_URL", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = make_config(tmp_path, {"wandb": {"mode": "online"}})
    preflight.check(cfg, "c.yaml", credentials=False)  # a job's parse on a compute node
    (tmp_path / ".config" / "wandb").mkdir(parents=True)
    (tmp_path / ".config" / "wandb" / "settings").write_text("[default]\nbase_url = https://wandb.corp.example\n")
    assert settings.wandb_host() == "wandb.corp.example"
    with pytest.raises(UserError, match="wandb.corp.example"):
        preflight.check(cfg, "c.yaml")
    (tmp_path / ".netrc").write_text(f"machine wandb.corp.example\n  login user\n  password {SECRET}\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert settings.check_config(cfg.to_dict()) == []


def test_the_track_command_never_replaces_a_file_it_did_not_write(tmp_path, monkeypatch):
    import argparse

    pub = publish

    mine, log = tmp_path / "mine.json", tmp_path / "notes.txt"
    mine.write_text('{"a user": "file"}')
    log.write_text("a user's notes\n")
    monkeypatch.setattr(pub, "publish", lambda *a, **k: {})
    monkeypatch.setattr(pub.config, "load", lambda paths: None)
    args = argparse.Namespace(config=["c.yaml"], step=4, out=str(mine), log=None, final=False, wait_minutes=0)
    assert pub.main(args) == 0
    assert mine.read_text() == '{"a user": "file"}'  # refused with a warning, the job still succeeds
    ours = tmp_path / "record.json"
    assert pub.main(argparse.Namespace(**{**vars(args), "out": str(ours)})) == 0
    assert pub.main(argparse.Namespace(**{**vars(args), "out": str(ours)})) == 0  # its own record: replaced
    assert json.loads(ours.read_text())["pending"] == 0
    code = ("import argparse, sys; from diffrelay.tracking import publish as p; p.publish = lambda *a, **k: {}; "
            "p.config.load = lambda c: None; sys.exit(p.main(argparse.Namespace(config=['c.yaml'], step=None, "
            f"out=None, log={str(log)!r}, final=False, wait_minutes=0)))")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert log.read_text().startswith("a user's notes\n") and "diffrelay track" in log.read_text()


# --- issue 53: every score of metrics.csv reaches every tracker ---------------------------------------------------

def scored_file(fid=3.0, clip=31.5, **more) -> dict:
    """A score file as `diffrelay fid` writes it for a text run scored with fid.metrics and two extractors: each
    extractor's entry (the primary's repeated at the top level) and the file's CLIP score, a dict."""
    scores = [{"metric": "FID-8", "fid": fid, "kid": 0.1, "precision": 0.5, "recall": 0.25, "sfid": 4.5, "is": 7.0,
               "num_ref": 60, "reference": "reference_inception-2015-12-05.npz", **more},
              {"metric": "FD_DINOv2-8", "fid": 30.0, "kid": 0.2, "precision": 0.4, "recall": 0.3, "num_ref": 60,
               "reference": "reference_dinov2-vitl14.npz"}]
    return {**scores[0], "scores": scores, "num_images": 8, "mode": "clean", "seconds": 2.0, "finished": 500.0,
            "clip_score": {"clip_score": clip, "count": 8, "model": "clip-vit", "model_sha256": "ab" * 32}}


def test_every_score_of_metrics_csv_reaches_both_trackers_under_its_column_name_and_a_non_number_is_named(
        tmp_path, monkeypatch):
    """Issue 53, defect 3: the CLIP score (a dict in the score file) never reached W&B or MLflow. Every score column
    of metrics.csv must, under its name, read as the report reads it; a value no tracker takes is one warning."""
    import io
    import types

    import pandas as pd

    from diffrelay.evaluation import columns, report

    pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    cfg = make_config(tmp_path, {"wandb": {}, "mlflow": {}})
    run_dir = config.run_dir(cfg)
    fake_run(run_dir)
    (run_dir / "metrics" / "fid" / "step_0000004_g2.json").unlink()  # its samples are still being written
    (run_dir / "metrics" / "fid" / "step_0000004.json").write_text(json.dumps(scored_file()))
    (run_dir / "samples" / "step_0000004" / "manifest.json").write_text(json.dumps(
        {"snapshot_sha256": "ab" * 32, "num_images": 8, "seconds": 1.0}))

    # metrics.csv's rows and columns, as `diffrelay report` writes them
    table = report.build_table(report.read_fid(run_dir), *report.read_train(run_dir), run_dir)
    csv = pd.read_csv(io.StringIO(table[report.csv_columns(table)].to_csv(index=False)))
    assert set(csv.columns) <= set(columns.TRACKED) | set(columns.NOT_SCORES), "a new column: score it or say why not"
    expected = {}
    for (_, row), ref in zip(csv.iterrows(), table.reference):
        tag = "" if row["metric"] == "FID-8" else "_" + ref.removesuffix(".npz")
        expected.update({f"eval/main/{k}{tag}": row[k] for k in columns.TRACKED if k in csv and pd.notna(row[k])})
    assert "eval/main/clip_score" in expected and "eval/main/fid_reference_dinov2-vitl14" in expected
    assert len(expected) == 7 + 4  # the primary's six scores and the CLIP score; DINOv2's fid, kid, precision, recall

    logged = []

    class Client:  # MLflow's client as mlflow_sink uses it (test_mlflow_metrics_carry_the_time_of_their_record...)
        def __init__(self, tracking_uri):
            pass

        def log_batch(self, run_id, metrics, synchronous):
            logged.extend(metrics)

        def log_dict(self, *a):
            pass

        def set_tag(self, *a):
            pass

        def log_image(self, *a, **k):
            pass

    monkeypatch.setitem(sys.modules, "mlflow.entities", types.SimpleNamespace(Metric=lambda *a: a))
    monkeypatch.setitem(sys.modules, "mlflow.tracking", types.SimpleNamespace(MlflowClient=Client))
    from diffrelay.tracking import mlflow_sink

    monkeypatch.setattr(mlflow_sink, "find_run", lambda *a: "r")
    result = publish.publish(cfg, "cmd", pytest.fail)  # no warning: every value is a number
    assert result["wandb"]["error"] is None and result["mlflow"]["error"] is None
    [wandb_row] = [r for r in wandb_history(run_dir) if "eval/main/fid" in r]
    mlflow_row = {name: value for name, value, _, step in logged if name.startswith("eval/") and step == 4}
    for got in ({k: v for k, v in wandb_row.items() if k.startswith("eval/main/")}, mlflow_row):
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=1e-5)  # metrics.csv keeps 6 digits

    # Not a finite number (a NaN FID of broken samples, a string): one warning naming the file and the metric,
    # once however many trackers; the file's other scores are sent.
    bad = run_dir / "metrics" / "fid" / "step_0000004_g3.json"
    bad.write_text(json.dumps(scored_file(fid=float("nan"), clip="n/a")))
    rec = Recorder()
    monkeypatch.setattr(publish, "sink", rec)
    warnings = []
    publish.publish(cfg, "cmd", warnings.append)
    assert sorted(warnings) == [f"diffrelay: warning: {bad}: clip_score='n/a': not a finite number, which no tracker "
                                "can take; not sent (the file's other scores are)",
                                f"diffrelay: warning: {bad}: fid=nan: not a finite number, which no tracker can take; "
                                "not sent (the file's other scores are)"]
    for _, _, batch in rec.sent:
        assert "fid" not in batch["evals"][("g3", 4)] and batch["evals"][("g3", 4)]["kid"] == 0.1
    publish.publish(cfg, "cmd", pytest.fail)  # sent: not named again

