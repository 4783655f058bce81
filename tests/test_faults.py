"""Faults: killed jobs, preemption signals, dead or stalled ranks, failed writes, concurrent runs.

Every case must end in a correct result or a clear error: never a hang, never lost work.
"""

import errno
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import BIN, run_cli
from diffrelay import io, logs
from diffrelay.training import checkpoint
from diffrelay.errors import UserError

LONG = {"train": {"total_steps": 400, "segment_steps": 400, "log_every": 1, "warmup_steps": 5}}


def start(cmd, log_path):
    """Start a job in its own process group (so a test can signal the whole tree), logging to a file."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_step(run_dir: Path, step: int, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        recs = logs.read_jsonl(run_dir / "metrics" / "train.jsonl")
        if any(r.get("step", 0) >= step and "loss" in r for r in recs):
            return
        assert proc.poll() is None, "job ended before the fault could be injected"
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout}s")


def final_state(run_dir, step=400):
    return torch.load(run_dir / "checkpoints" / checkpoint.step_name(step) / "state.pt", weights_only=True)


def worker_pids(parent_pid):
    """torchrun's worker processes, by RANK read from their environment."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = (p / "environ").read_bytes().split(b"\0")
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent_pid:
            for kv in env:
                if kv.startswith(b"RANK="):
                    out[int(kv[5:])] = int(p.name)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted single-process run of 400 steps, and its dataset for the other runs."""
    import yaml

    from conftest import TINY, deep_merge

    root = tmp_path_factory.mktemp("ref")
    d = deep_merge(TINY, {"run": {"results": str(root), "resources": str(root / "res")}, **LONG})
    cfg = root / "c.yaml"
    cfg.write_text(yaml.safe_dump(d))
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg)
    return root / "tiny"


def copy_dataset(reference, tmp_path):
    import shutil

    shutil.copytree(reference / "dataset", tmp_path / "results" / "tiny" / "dataset")
    return tmp_path / "results" / "tiny"


def test_sigkill_mid_segment_resumes_from_recovery_checkpoint_bitwise(reference, write_config, tmp_path):
    cfg = write_config({**LONG, "train": {**LONG["train"], "recovery_every": 50, "keep_recovery": 2}})
    rd = copy_dataset(reference, tmp_path)
    job = start([BIN / "diffrelay", "train", "--config", cfg], tmp_path / "1.log")
    wait_for_step(rd, 170, job)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    kept = checkpoint.list_checkpoints(rd / "recovery")
    assert [s for s, _ in kept] and len(kept) <= 2 and kept[-1][0] >= 150
    assert not (rd / "checkpoints" / "step_0000400").exists()
    # What a kill during a checkpoint write leaves behind: a temp folder and a folder with no manifest.
    (rd / "checkpoints" / ".step_0000400.abcd.tmp").mkdir(parents=True)
    (rd / "recovery" / "step_0000390").mkdir()
    (rd / "recovery" / "step_0000390" / "state.pt").write_bytes(b"torn")
    p = run_cli("train", "--config", cfg)
    assert f"resumed from {kept[-1][1]}" in p.stderr
    a, b = final_state(reference), final_state(rd)
    for k in a["net"]:
        assert torch.equal(a["net"][k], b["net"][k]), k
    for ea, eb in zip(a["ema"], b["ema"]):
        assert all(torch.equal(ea[k], eb[k]) for k in ea)
    assert a["order"] == b["order"]


def test_sigterm_under_torchrun_saves_recovery_and_exits_nonzero_then_retry_resumes(reference, write_config,
                                                                                    tmp_path):
    cfg = write_config({**LONG, "train": {**LONG["train"], "nproc_per_node": 2}})
    rd = copy_dataset(reference, tmp_path)
    cmd = [BIN / "torchrun", "--standalone", "--nproc-per-node=2", "-m", "diffrelay", "train", "--config", cfg]
    job = start(cmd, tmp_path / "1.log")
    wait_for_step(rd, 40, job)
    t0 = time.time()
    os.kill(job.pid, signal.SIGTERM)  # what SLURM/Snakemake send to the job's main process
    assert job.wait(timeout=60) != 0
    assert time.time() - t0 < 60
    log = (tmp_path / "1.log").read_text()
    assert "stop requested (signal); saved recovery checkpoint" in log
    saved = checkpoint.list_checkpoints(rd / "recovery")
    assert saved and 40 <= saved[-1][0] < 400
    p = run_cli("torchrun", "--standalone", "--nproc-per-node=2", "-m", "diffrelay", "train", "--config", cfg)
    assert f"resumed from {saved[-1][1]}" in p.stderr
    assert final_state(reference)["order"] == final_state(rd)["order"]  # the same global stream was consumed
    # Against an uninterrupted run on the same 2 processes: bit for bit. (Against the 1-process reference
    # only the reduction order differs, and 400 Adam steps let that rounding drift chaotically.)
    straight = tmp_path / "straight"
    shutil.copytree(rd / "dataset", straight / "tiny" / "dataset")
    cfg2 = write_config({**LONG, "run": {"results": str(straight)}, "train": {**LONG["train"], "nproc_per_node": 2}},
                        name="straight.yaml")
    run_cli("torchrun", "--standalone", "--nproc-per-node=2", "-m", "diffrelay", "train", "--config", cfg2)
    a, b = final_state(straight / "tiny"), final_state(rd)
    for k in a["net"]:
        assert torch.equal(a["net"][k], b["net"][k]), k


@pytest.mark.parametrize("fault", ["stall", "die"])
def test_a_stalled_or_dead_rank_ends_the_job_with_an_error_not_a_hang(reference, write_config, tmp_path, fault):
    cfg = write_config({**LONG, "train": {**LONG["train"], "nproc_per_node": 2, "timeout_minutes": 0.15}})
    rd = copy_dataset(reference, tmp_path)
    cmd = [BIN / "torchrun", "--standalone", "--nproc-per-node=2", "-m", "diffrelay", "train", "--config", cfg]
    job = start(cmd, tmp_path / "1.log")
    wait_for_step(rd, 10, job)
    victim = worker_pids(job.pid)[1]
    os.kill(victim, signal.SIGSTOP if fault == "stall" else signal.SIGKILL)
    try:
        code = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    log = (tmp_path / "1.log").read_text()
    assert code != 0
    assert "diffrelay: error: rank 0 of 2:" in log and "another rank died or stalled" in log, log[-3000:]
    if fault == "die":
        assert "rank" in log and ("-9" in log or "SIGKILL" in log)


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    good = checkpoint.save_checkpoint(tmp_path / "step_0000001", {"w": torch.ones(3)}, {"step": 1})
    before = {f.name: f.read_bytes() for f in good.iterdir()}

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_bytes", no_space)  # where the checkpoint's bytes reach the disk
    with pytest.raises(UserError, match="No space left on device"):
        checkpoint.save_checkpoint(tmp_path / "step_0000001", {"w": torch.zeros(3)}, {"step": 1})
    assert {f.name: f.read_bytes() for f in good.iterdir()} == before
    checkpoint.verify_checkpoint(good)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001"]  # no temp leftovers


def test_failed_rename_keeps_the_previous_json(tmp_path, monkeypatch):
    target = tmp_path / "best.json"
    io.write_json(target, {"v": 1})

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "replace", denied)
    with pytest.raises(UserError, match="Permission denied"):
        io.write_json(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tiny tmpfs")
def test_full_disk_during_training_reports_and_keeps_last_checkpoint(reference, write_config, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2000k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        import shutil

        cfg = write_config({"run": {"results": str(mnt)}, **LONG,
                            "train": {**LONG["train"], "total_steps": 40, "segment_steps": 10}})
        (mnt / "tiny" / "dataset").mkdir(parents=True)
        for name in ("images.npy", "labels.npy", "dataset.json"):
            shutil.copy(reference / "dataset" / name, mnt / "tiny" / "dataset" / name)
        ok, steps = [], [10, 20, 30, 40]
        for s in steps:
            p = run_cli("train", "--config", cfg, "--until-step", s, check=False)
            if p.returncode:
                break
            ok.append(s)
        assert p.returncode == 2, "expected the small disk to fill up"
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("diffrelay: error: ") and "No space left on device" in last
        assert ok, "the first segment should fit"
        checkpoint.verify_checkpoint(mnt / "tiny" / "checkpoints" / checkpoint.step_name(ok[-1]))
        assert logs.read_jsonl(mnt / "tiny" / "metrics" / "train.jsonl")
    finally:
        subprocess.run(["umount", str(mnt)])


def test_two_training_jobs_at_once_do_not_collide(reference, write_config, tmp_path):
    jobs = []
    for name in ("a", "b"):
        cfg = write_config({"run": {"name": name}, "train": {"nproc_per_node": 2, "total_steps": 20,
                                                               "segment_steps": 20}}, name=f"{name}.yaml")
        import shutil

        shutil.copytree(reference / "dataset", tmp_path / "results" / name / "dataset")
        cmd = [BIN / "torchrun", "--standalone", "--nproc-per-node=2", "-m", "diffrelay", "train", "--config", cfg]
        jobs.append(start(cmd, tmp_path / f"{name}.log"))
    codes = [j.wait(timeout=300) for j in jobs]
    assert codes == [0, 0], [(tmp_path / f"{n}.log").read_text()[-2000:] for n in "ab"]
    for name in ("a", "b"):
        checkpoint.verify_checkpoint(tmp_path / "results" / name / "checkpoints" / "step_0000020")


def test_ctrl_c_in_training_saves_a_recovery_checkpoint_like_sigterm(reference, write_config, tmp_path):
    cfg = write_config(LONG)
    copy_dataset(reference, tmp_path)
    run_dir = tmp_path / "results" / "tiny"
    proc = start([sys.executable, "-m", "diffrelay", "train", "--config", str(cfg)], tmp_path / "train.log")
    wait_for_step(run_dir, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    assert proc.wait(timeout=120) == 75
    log = (tmp_path / "train.log").read_text()
    assert "saved recovery checkpoint" in log and "Traceback" not in log, log
    assert checkpoint.list_checkpoints(run_dir / "recovery")


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_diffrelay_launch_keeps_status_75_when_every_process_of_the_job_gets_the_signal(reference, write_config,
                                                                                         tmp_path, sig):
    # As SLURM's `--signal` and `scancel --signal` do: the agent and both workers are signalled at once.
    cfg = write_config({**LONG, "train": {**LONG["train"], "nproc_per_node": 2, "recovery_every": 0}})
    rd = copy_dataset(reference, tmp_path)
    launch = [BIN / "diffrelay", "launch", "--standalone", "--nproc-per-node", "2", "-m", "diffrelay", "train",
              "--config", cfg]
    job = start(launch, tmp_path / "1.log")
    wait_for_step(rd, 20, job)
    os.killpg(job.pid, sig)
    assert job.wait(timeout=120) == 75
    log = (tmp_path / "1.log").read_text()
    assert "saved recovery checkpoint" in log and "exit 75" in log and "Traceback" not in log, log
    saved = checkpoint.list_checkpoints(rd / "recovery")
    assert saved and 20 <= saved[-1][0] < 400
    p = run_cli(*map(str, launch[1:]))
    assert f"resumed from {saved[-1][1]}" in p.stderr
    assert final_state(reference)["order"] == final_state(rd)["order"]


def test_diffrelay_launch_reports_a_failed_rank_in_one_line(write_config, tmp_path):
    cfg = write_config({"data": {"kind": "folder", "path": str(tmp_path / "none")}})  # train fails at once
    p = run_cli("launch", "--standalone", "--nproc-per-node", "2", "-m", "diffrelay", "train", "--config", cfg,
                check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    # Both ranks fail with status 2; the one that fails second may first be stopped by torchrun (-15).
    m = re.search(r"diffrelay launch: worker\(s\) failed \(rank 0 exit (2|-15), rank 1 exit (2|-15)\)", p.stderr)
    assert m and "2" in m.groups(), p.stderr


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("when", ["training", "start-up"])
def test_workers_die_with_a_sigkilled_launch_agent_and_write_nothing_after(reference, write_config, tmp_path, when):
    """`kill -9` of `diffrelay launch` (a job killed hard): its workers go within seconds, mid-training or
    still importing, so no checkpoint, snapshot or record appears after the job is gone."""
    cfg = write_config({**LONG, "train": {**LONG["train"], "nproc_per_node": 2}})
    rd = copy_dataset(reference, tmp_path)
    record = tmp_path / "trained.json"
    job = start([BIN / "diffrelay", "launch", "--standalone", "--nproc-per-node", "2", "-m", "diffrelay", "train",
                 "--config", cfg, "--record", record], tmp_path / "1.log")
    deadline = time.time() + 120
    while len(workers := worker_pids(job.pid)) < 2:
        assert job.poll() is None and time.time() < deadline, "no workers"
        time.sleep(0.02)
    if when == "training":
        wait_for_step(rd, 5, job)
    job.send_signal(signal.SIGKILL)
    job.wait()
    deadline = time.time() + 10
    while any(alive(p) for p in workers.values()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in workers.values()), "a worker outlived its agent"
    written = sorted(p for p in rd.rglob("*") if p.is_file())
    time.sleep(2)
    assert sorted(p for p in rd.rglob("*") if p.is_file()) == written and not record.exists()
    assert not (rd / "checkpoints").exists() or not checkpoint.list_checkpoints(rd / "checkpoints")


def test_a_stop_signal_that_no_step_answers_ends_the_rank_with_one_line_after_the_grace(capfd):
    """A rank blocked in a collective whose peer died never reaches the next step's stop check (NCCL waits
    10 minutes, then dumps C++ stacks). The watcher learns of the signal from the wake-up fd and ends the
    rank after the grace time; a step that answers the request in time cancels it."""
    from diffrelay.training.stop import StopRequest

    exits = []
    stop = StopRequest(grace_floor=0.5, exit=exits.append)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.05)
        assert exits == [1] and stop.signum == signal.SIGUSR1
        assert "no step finished within 0 s of the stop signal: another rank died" in capfd.readouterr().err
    finally:
        stop.close()
    exits.clear()
    stop = StopRequest(grace_floor=1.0, exit=exits.append)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        stop.acknowledged = True  # the loop reached the step's reduction and will save
        time.sleep(1.5)
        assert exits == []
    finally:
        stop.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_dead_rank_ends_a_launch_within_a_minute_in_one_line(reference, write_config, tmp_path):
    """kill -9 of one rank under `diffrelay launch`: the job ends within a minute, and its last line names the
    rank and its exit (gloo here; NCCL's survivors are ended by the stop watcher, see the test above)."""
    cfg = write_config({**LONG, "train": {**LONG["train"], "nproc_per_node": 2}})
    rd = copy_dataset(reference, tmp_path)
    job = start([BIN / "diffrelay", "launch", "--standalone", "--nproc-per-node", "2", "-m", "diffrelay", "train",
                 "--config", cfg], tmp_path / "1.log")
    wait_for_step(rd, 5, job)
    os.kill(worker_pids(job.pid)[1], signal.SIGKILL)
    t0 = time.time()
    try:
        code = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert time.time() - t0 < 60 and code == 1
    last = (tmp_path / "1.log").read_text().strip().splitlines()[-1]
    assert re.match(r"diffrelay launch: worker\(s\) failed \(.*rank 1 exit -9", last), last
