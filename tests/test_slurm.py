"""Workflows on a real one-node SLURM cluster (tests/slurm/cluster.sh): every job goes through sbatch.

Each test checks the cluster's own records (squeue keeps finished jobs for MinJobAge=3600 s), not
only Snakemake's word, so a silent fallback to local execution fails the test.
"""

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, TINY, deep_merge, run_cli

ENABLE = ("needs the local SLURM cluster; enable with: sudo bash tests/slurm/cluster.sh install && "
          "sudo bash tests/slurm/cluster.sh start && DIFFRELAY_SLURM_TEST=1 make test")
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(os.environ.get("DIFFRELAY_SLURM_TEST") != "1", reason=ENABLE)]

PROFILE = REPO / "tests" / "slurm" / "profile"
TIMEOUT = 480  # seconds per workflow (about 3 min on a busy 2-core machine); a stuck queue fails, not hangs


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """DIFFRELAY_SLURM_TEST=1 promises a running cluster: fail, do not skip, when there is none."""
    p = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    states = p.stdout.split()
    if p.returncode or not {"idle", "mix", "alloc"} & set(states):
        pytest.fail(f"DIFFRELAY_SLURM_TEST=1 but no SLURM node takes jobs (sinfo: {states or p.stderr.strip()}); "
                    "run: sudo bash tests/slurm/cluster.sh start")


def snakemake(workdir: Path, *args) -> subprocess.CompletedProcess:
    # The venv's bin folder is on PATH (conftest) and sbatch exports the environment (--export=ALL),
    # so each job's `python -m snakemake` and `diffrelay` come from this venv.
    return run_cli("snakemake", "--directory", workdir, "--workflow-profile", PROFILE, *args,
                   cwd=workdir, timeout=TIMEOUT)


def slurm_jobs(workdir: Path, rule: str) -> dict[str, dict]:
    """SLURM's record of every job the plugin submitted for `rule`, keyed by job id.

    The plugin names each job's log `.snakemake/slurm_logs/rule_<rule>/[<wildcards>/]<jobid>.log`.
    """
    ids = sorted(p.stem for p in (workdir / ".snakemake" / "slurm_logs" / f"rule_{rule}").rglob("*.log"))
    assert ids, f"no SLURM log for rule {rule}: its jobs did not go through sbatch"
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%Z|%k"],
                         capture_output=True, text=True, check=True).stdout
    jobs = {}
    for line in out.splitlines():
        job_id, state, cwd, comment = line.split("|", 3)
        jobs[job_id] = {"state": state, "workdir": Path(cwd), "comment": comment}
    assert sorted(jobs) == ids, f"squeue does not know all of {ids}: {out}"
    return jobs


def assert_completed_here(jobs: dict, workdir: Path, rule: str) -> None:
    for job_id, job in jobs.items():
        assert job["state"] == "COMPLETED", (job_id, job)
        assert job["workdir"] == workdir, (job_id, job)
        assert job["comment"].startswith(f"rule_{rule}"), (job_id, job)


TWO_RULES = """
rule all:
    input: "out/b.txt"

# ${SLURM_JOB_ID:?} fails the job when it does not run inside a SLURM allocation.
rule make_a:
    output: "out/a.txt"
    shell: "echo ${{SLURM_JOB_ID:?not a SLURM job}} > {output}"

rule make_b:
    input: "out/a.txt"
    output: "out/b.txt"
    shell: "cat {input} > {output}; echo ${{SLURM_JOB_ID:?not a SLURM job}} >> {output}"
"""


def test_two_rule_workflow_runs_each_job_through_sbatch(tmp_path):
    (tmp_path / "Snakefile").write_text(TWO_RULES)
    snakemake(tmp_path)

    id_a, id_b = (tmp_path / "out" / "b.txt").read_text().split()
    assert id_a != id_b  # one allocation per job
    for rule, job_id in (("make_a", id_a), ("make_b", id_b)):
        jobs = slurm_jobs(tmp_path, rule)
        assert list(jobs) == [job_id]
        assert_completed_here(jobs, tmp_path, rule)


def test_a_cluster_without_accounting_is_watched_with_squeue_not_a_silent_hang(tmp_path, write_config):
    """This cluster has no accounting storage (cluster.sh): with the shipped profile's sacct the plugin would
    wait forever. The workflow's one sacct probe at start switches to squeue (MinJobAge=3600 s here)."""
    profile = tmp_path / "profile"
    profile.mkdir()
    text = (PROFILE / "config.yaml").read_text()
    assert "slurm-status-command: squeue" in text
    (profile / "config.yaml").write_text(text.replace("slurm-status-command: squeue", "slurm-status-command: sacct"))
    cfg = write_config()
    target = tmp_path / "results" / "tiny" / "dataset"  # one short SLURM job (and the local extractor fetch)
    p = run_cli("snakemake", "--directory", tmp_path, "--workflow-profile", profile, "--snakefile",
                REPO / "Snakefile", target, "--configfile", cfg, cwd=tmp_path, timeout=300)
    assert "this cluster keeps no SLURM accounting (sacct: Slurm accounting storage is disabled)" in p.stdout, p.stdout
    assert "watched with squeue" in p.stdout and (target / "images.npy").is_file()
    assert_completed_here(slurm_jobs(tmp_path, "prepare_dataset"), tmp_path, "prepare_dataset")


def read_losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics" / "train.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def segment_starts(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics" / "train.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r.get("event") == "segment_start"]


def running_job(rule: str, seen: set, timeout: float, proc, workdir: Path) -> str:
    """Id of a running SLURM job of `rule` started from `workdir` that is not in `seen`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i|%Z|%k"], capture_output=True,
                             text=True).stdout
        ids = [i for i, where, k in (line.split("|", 2) for line in out.splitlines())
               if k.startswith(f"rule_{rule}") and Path(where) == workdir and i not in seen]
        if ids:
            return ids[0]
        assert proc.poll() is None, "snakemake ended early"
        time.sleep(0.5)
    raise AssertionError(f"no new running SLURM job for rule {rule} after {timeout} s")


def wait_for_steps(run: Path, starts: int, steps: int, timeout: float, proc) -> None:
    """Until the run's `starts`-th try has logged `steps` losses past its starting step."""
    t0 = time.monotonic()
    while True:
        metrics = run / "metrics" / "train.jsonl"
        if metrics.is_file():
            s = segment_starts(run)
            if len(s) >= starts and sum(k > s[starts - 1] for k in read_losses(run)) >= steps:
                return
        assert time.monotonic() - t0 < timeout and proc.poll() is None, "training did not get going"
        time.sleep(0.2)


class Background:
    """A workflow started now and waited for later: a test that mostly sleeps runs it beside itself."""

    def __init__(self, cmd: list, cwd: Path, log: Path):
        self.cmd, self.log = list(map(str, cmd)), log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)

    def finish(self, timeout: float = TIMEOUT) -> None:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        assert rc == 0, f"{' '.join(self.cmd)} failed ({rc}):\n{self.log.read_text()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def background():
    """background(cmd, cwd, log) -> a Background, stopped when the test ends however it ends."""
    started = []
    yield lambda *args: started.append(Background(*args)) or started[-1]
    for run in started:
        run.stop()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny run of every stage under SLURM, started once for the module and left to run in the background.

    The signal test below asks for it first: its training steps sleep, so this workflow's jobs use the CPU and
    the node's second slot meanwhile (about 80 s of a CI run's time otherwise spent waiting one after the other).
    """
    if not ((REPO / "Snakefile").is_file() and (REPO / "workflow" / "rules" / "train.smk").is_file()):
        pytest.skip("the diffrelay workflow (Snakefile, workflow/rules/) is not written yet")
    work = tmp_path_factory.mktemp("tiny_slurm")
    # One segment of 2 steps: the shortest chain of every stage (each job costs ~10-60 s here).
    over = {"run": {"results": str(work / "results"), "resources": str(work / "resources")},
            "train": {"total_steps": 2, "segment_steps": 2, "log_every": 1},
            "sample": {"num_images": 4, "steps": 2, "batch_size": 4}}
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(deep_merge(TINY, over), sort_keys=False))
    run = Background(["snakemake", "--directory", work, "--workflow-profile", PROFILE, "--snakefile",
                      REPO / "Snakefile", "--configfile", cfg], work, work / "snakemake.log")
    run.work, run.cfg = work, cfg
    yield run
    run.stop()


def test_signal_timer_and_requeue_stop_training_and_every_try_resumes_bit_identically(tmp_path, write_config,
                                                                                     background, tiny_run):
    """A training segment stopped three ways, the way SLURM does it, then finished and compared with
    an uninterrupted run:
    1. `scancel --signal=USR1 JOB`: USR1 to every process of the job's steps at once (the Snakemake job
       wrapper, the launch agent, the worker). All survive it but the worker, which saves and exits;
       the try ends with status 75 and Snakemake resubmits it.
    2. The profile's timer: the second try runs with `--time=1 --signal=USR1@20`; the same, on time
       (or SIGTERM at the time limit when SLURM's coarse timer fired before the step started).
    3. `scontrol requeue` of the third try: SLURM ends it and starts it again under the same id.
    """
    # Inside SLURM a step of this network sleeps 0.15 s while the workflow's folder holds `slow_steps`: each
    # stop lands mid-segment (the timer's try lasts at most about 60 s, under 400 steps), yet the steps cost no
    # CPU, and the local reference run, started beside them, is quick. After the last stop the file goes and the
    # rest of the steps run at full speed. The tiny run (the fixture) uses the CPU meanwhile. 800 steps: the timer's
    # try must outlast SLURM's enforcement of its 60 s limit, which slurmctld checks every 30 s (a CI run saw a try
    # of the 500 steps before, 74 s of sleeps, finish at 79 s unstopped).
    steps = 800
    train = {"total_steps": steps, "segment_steps": steps, "log_every": 1, "warmup_steps": 2}
    model = {"arch": "slow_net:slow_under_slurm", "kwargs": {"width": 8}}
    cfg = write_config({"run": {"name": "stopped"}, "train": train, "model": model}, name="stopped.yaml")
    ref = write_config({"run": {"name": "whole"}, "train": train, "model": model}, name="whole.yaml")
    results = tmp_path / "results"
    target = f"trained/step_{steps:07d}.json"

    work = tmp_path / "slurm"
    work.mkdir()
    (tmp_path / "local").mkdir()
    for where in (work, tmp_path / "local"):  # a network file beside each workflow, as a user keeps one
        shutil.copy(REPO / "tests" / "fixtures" / "diffrelay_test_net.py", where / "slow_net.py")
    (work / "slow_steps").touch()
    # Uninterrupted reference, run locally beside the SLURM run.
    whole = background(["snakemake", results / "whole" / target, "--snakefile", REPO / "Snakefile", "--directory",
                        tmp_path / "local", "--cores", "1", "--configfile", ref], tmp_path / "local",
                       tmp_path / "whole.log")
    cmd = ["snakemake", results / "stopped" / target, "--snakefile", REPO / "Snakefile", "--directory", work,
           "--workflow-profile", PROFILE, "--retries", "2", "--set-resources",
           "train_segment:runtime=1 if attempt == 2 else 10",
           "train_segment:slurm_extra='--signal=USR1@20' if attempt == 2 else ''",
           "--configfile", cfg]
    seen, t0 = set(), time.monotonic()
    with open(tmp_path / "snakemake.log", "w") as out:
        proc = subprocess.Popen(list(map(str, cmd)), cwd=work, stdout=out, stderr=subprocess.STDOUT)
        try:
            first = running_job("train_segment", seen, TIMEOUT / 2, proc, work)
            seen.add(first)
            wait_for_steps(results / "stopped", 1, 3, TIMEOUT / 2, proc)
            subprocess.run(["scancel", "--signal=USR1", first], check=True)
            second = running_job("train_segment", seen, TIMEOUT / 2, proc, work)  # the timer stops this one
            seen.add(second)
            third = running_job("train_segment", seen, TIMEOUT / 2, proc, work)
            seen.add(third)
            wait_for_steps(results / "stopped", 3, 3, TIMEOUT / 2, proc)
            subprocess.run(["scontrol", "requeue", third], check=True)
            (work / "slow_steps").unlink()
            # SLURM holds a requeued job for 120 s (EligibleTime); the test needs the requeue, not the wait.
            for _ in range(120):
                state = subprocess.run(["squeue", "-h", "-j", third, "-o", "%T"], capture_output=True, text=True).stdout
                if state.strip() == "PENDING":
                    subprocess.run(["scontrol", "update", f"JobId={third}", "StartTime=now"], check=True)
                    break
                time.sleep(0.5)
            rc = proc.wait(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    print(f"three stops and the finished segment took {time.monotonic() - t0:.0f} s")
    assert rc == 0, (tmp_path / "snakemake.log").read_text()

    jobs = slurm_jobs(work, "train_segment")
    assert sorted(jobs) == sorted(seen), (jobs, seen)
    # SLURM's timer may fire up to 60 s early, before the job's step exists, and the signal is then
    # lost: the time limit's SIGTERM stops the second try instead (TIMEOUT); training saves on it too.
    assert jobs[first]["state"] == "FAILED" and jobs[third]["state"] == "COMPLETED", jobs
    assert jobs[second]["state"] in ("FAILED", "TIMEOUT"), jobs
    for job in (first, second) if jobs[second]["state"] == "FAILED" else (first,):
        log = next((work / ".snakemake" / "slurm_logs" / "rule_train_segment").rglob(f"{job}.log")).read_text()
        # The wrapper lived to report the rule's status: 75.
        assert "exit status 75" in log, log
    print(f"second try: {jobs[second]['state']}")
    show = subprocess.run(["scontrol", "show", "job", third], capture_output=True, text=True, check=True).stdout
    assert "Restarts=1" in show, show
    second_limit = subprocess.run(["squeue", "-h", "-t", "all", "-j", second, "-o", "%l"],
                                  capture_output=True, text=True, check=True).stdout.strip()
    assert second_limit == "1:00", second_limit
    starts = segment_starts(results / "stopped")
    # 0, then after each of the three stops a resume past the start before it.
    assert len(starts) == 4 and starts[0] == 0 and starts[1] > 0 and starts[2] > starts[1], starts
    assert starts[2] <= starts[3] < steps, starts

    whole.finish()
    from diffrelay.training import checkpoint
    a, _ = checkpoint.load_checkpoint(results / "stopped" / "checkpoints" / f"step_{steps:07d}")
    b, _ = checkpoint.load_checkpoint(results / "whole" / "checkpoints" / f"step_{steps:07d}")
    flat_a, flat_b = flatten(a), flatten(b)
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        assert torch.equal(flat_a[k], flat_b[k]) if isinstance(flat_a[k], torch.Tensor) else flat_a[k] == flat_b[k], k
    assert read_losses(results / "stopped") == read_losses(results / "whole")


def test_tiny_diffrelay_run_trains_under_slurm_and_writes_the_report(tiny_run):
    tiny_run.finish()
    tmp_path, cfg = tiny_run.work, tiny_run.cfg

    run = Path(yaml.safe_load(cfg.read_text())["run"]["results"]) / "tiny"
    report = run / "report"
    for name in ("metrics.csv", "fid.png", "loss.png", "best.json", "best_grid.png"):
        assert (report / name).is_file(), name
    rows = (report / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["2"]

    for rule in ("train_segment", "sample_snapshot", "compute_fid", "build_report"):
        jobs = slurm_jobs(tmp_path, rule)
        assert len(jobs) == 1, (rule, jobs)
        assert_completed_here(jobs, tmp_path, rule)
    # Every job's SLURM log says where it ran.
    for log in (tmp_path / ".snakemake" / "slurm_logs").rglob("*.log"):
        assert f"diffrelay: SLURM job {log.stem} on nodes {socket.gethostname()}, CUDA_VISIBLE_DEVICES=" \
            in log.read_text(), log


def flatten(obj, prefix=""):
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in flatten(v, f"{prefix}.{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in flatten(v, f"{prefix}[{i}]").items()}
    return {prefix: obj}
