"""`diffrelay with-gpus`: disjoint GPU ids for concurrent local jobs, freed by the kernel when a holder
dies, a full pool waits; and a workflow whose evaluation runs beside training on other ids."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, TINY, deep_merge, run_cli
from diffrelay import config
from diffrelay.runtime import gpus
from diffrelay.errors import UserError

# Each wrapped command records which ids it got and when it held them.
RECORD = ("import json, os, sys, time\n"
          "t0 = time.time()\n"
          "time.sleep(float(sys.argv[2]))\n"
          "line = json.dumps([os.environ['CUDA_VISIBLE_DEVICES'], t0, time.time()])\n"
          "open(sys.argv[1], 'a').write(line + '\\n')\n")


def wrapped(lock_dir, pool, count, *cmd):
    return subprocess.Popen([str(BIN / "diffrelay"), "with-gpus", "--pool", pool, "--count", str(count),
                             "--lock-dir", str(lock_dir), "--", *map(str, cmd)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def record_cmd(out, seconds):
    return ["python", "-c", RECORD, str(out), str(seconds)]


def read_records(path):
    return [(set(ids.split(",")), t0, t1) for ids, t0, t1 in map(json.loads, path.read_text().splitlines())]


def test_concurrent_commands_never_share_an_id(tmp_path):
    out = tmp_path / "held.jsonl"
    procs = [wrapped(tmp_path / "locks", "0,1,2", 1 + i % 2, *record_cmd(out, 0.6)) for i in range(6)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    records = read_records(out)
    assert len(records) == 6
    assert sorted(len(ids) for ids, _, _ in records) == [1, 1, 1, 2, 2, 2]
    for i, (a, s1, e1) in enumerate(records):
        for b, s2, e2 in records[i + 1:]:
            if s1 < e2 and s2 < e1:  # held at the same time
                assert not a & b, records
    assert all(ids <= {"0", "1", "2"} for ids, _, _ in records)


def holds_ids(proc, timeout=60):
    """Wait until `proc` (a with-gpus wrapper) has locked its ids and exec'd its command (which then
    sees CUDA_VISIBLE_DEVICES): the ids are held from here on, whatever the machine's load."""
    deadline = time.time() + timeout
    while "CUDA_VISIBLE_DEVICES" not in Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace"):
        assert proc.poll() is None and time.time() < deadline, "the wrapped command never started"
        time.sleep(0.05)


def wait_for_text(path, text, proc, timeout=60):
    deadline = time.time() + timeout
    while not (path.exists() and text in path.read_text()):
        assert proc.poll() is None and time.time() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.05)


def test_a_full_pool_waits_then_runs(tmp_path):
    """Ordered by events, not by sleeps: the first command holds both ids until it is told to go, and
    it is told only once the second has said that it waits."""
    out, go = tmp_path / "held.jsonl", tmp_path / "go"
    hold = ("import json, os, pathlib, sys, time\n"
            "t0 = time.time()\n"
            "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.02)\n"
            "line = json.dumps([os.environ['CUDA_VISIBLE_DEVICES'], t0, time.time()])\n"
            "open(sys.argv[1], 'a').write(line + '\\n')\n")
    first = wrapped(tmp_path / "locks", "0,1", 2, "python", "-c", hold, out, go)
    holds_ids(first)
    err = tmp_path / "second.err"
    with open(err, "w") as f:
        second = subprocess.Popen([str(BIN / "diffrelay"), "with-gpus", "--pool", "0,1", "--count", "1",
                                   "--lock-dir", str(tmp_path / "locks"), "--", *record_cmd(out, 0)],
                                  stdout=subprocess.DEVNULL, stderr=f, text=True)
    wait_for_text(err, "waiting for 1 free GPU id(s) of pool 0,1", second)
    go.touch()
    assert second.wait(timeout=60) == 0 and first.wait(timeout=60) == 0
    (ids1, _, end1), (ids2, start2, _) = read_records(out)
    assert ids1 == {"0", "1"} and ids2 <= {"0", "1"} and start2 >= end1
    assert "CUDA_VISIBLE_DEVICES=" in err.read_text()


def test_a_sigkilled_holder_frees_its_ids(tmp_path):
    holder = wrapped(tmp_path / "locks", "3,5", 2, "sleep", "60")
    holds_ids(holder)  # exec'd into sleep with the ids set
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out = tmp_path / "held.jsonl"
    t0 = time.time()
    p = wrapped(tmp_path / "locks", "3,5", 2, *record_cmd(out, 0))
    assert p.wait(timeout=30) == 0
    assert read_records(out)[0][0] == {"3", "5"} and time.time() - t0 < 20
    assert "waiting" not in p.stderr.read()


def test_bad_pools_and_counts_are_one_line(tmp_path):
    for pool, count, expect in [("0,0", 1, "distinct GPU ids"), ("a,b", 1, "comma-separated"),
                                ("0,1", 3, "between 1 and the pool size 2")]:
        p = run_cli("with-gpus", "--pool", pool, "--count", count, "--lock-dir", tmp_path, "--", "true", check=False)
        assert p.returncode == 2 and expect in p.stderr, p.stderr
    p = run_cli("with-gpus", "--pool", "0", "--count", 1, "--lock-dir", tmp_path, "--", "no-such-cmd", check=False)
    assert p.returncode == 2 and "no-such-cmd: command not found" in p.stderr


@pytest.mark.parametrize("run, train, expect", [
    ({"gpus": [0, 1], "eval_gpus": 2}, {}, "run.eval_gpus=2: leaves none of the 2 ids"),
    ({"gpus": [0, 1, 2]}, {"nproc_per_node": 4, "batch_size": 8}, "train.nproc_per_node=4: needs more GPUs"),
    ({"gpus": [0, 1]}, {"nnodes": 2}, "run.gpus: is for one machine"),
    ({"gpus": "all"}, {}, "run.gpus=\"all\": not one of the allowed forms"),
])
def test_pool_settings_that_cannot_work_are_refused(run, train, expect):
    with pytest.raises(UserError, match=re.escape(expect)):
        config.validate({"run": run, "train": train})


def test_pools_split_training_and_evaluation():
    def pools(**run):
        return gpus.gpu_pools(config.validate({"run": run, "train": {"nproc_per_node": 2, "batch_size": 8}}))

    assert pools(gpus=[0, 1, 2, 3]) == ([0, 1], [2, 3])
    assert pools(gpus=[4, 5, 6, 7], eval_gpus=1) == ([4, 5, 6], [7])
    assert pools(gpus=[0, 1], eval_gpus=0) == ([0, 1], [0, 1])
    assert pools(gpus=[0, 1]) == ([0, 1], [0, 1])  # nothing left over: evaluation shares
    assert pools() == ([], [])


# A `diffrelay` in front of the real one on PATH. The training job of segment (40, 80] and the
# sampling job of checkpoint 40 each leave a mark, then wait for the other's before they start: both
# get past this only if Snakemake ran them at the same time, each holding its GPU ids. Every other
# command passes straight through.
MEET = """#!/bin/sh
case " $* " in
  *" launch "*" --until-step 80 "*) me=train; other=sample ;;
  *" sample "*" --out "*"/samples/step_0000040 "*) me=sample; other=train ;;
  *) exec "$REAL_DIFFRELAY" "$@" ;;
esac
touch "$MEET_DIR/$me"
i=0
while [ ! -e "$MEET_DIR/$other" ]; do
  i=$((i + 1))
  if [ $i -gt 6000 ]; then echo "meet: $me waited 10 min for $other" >&2; exit 1; fi
  sleep 0.1
done
exec "$REAL_DIFFRELAY" "$@"
"""


@pytest.mark.slow
def test_workflow_with_a_pool_evaluates_beside_training_on_other_ids(tmp_path):
    d = deep_merge(TINY, {"run": {"results": str(tmp_path / "results"), "resources": str(tmp_path / "resources"),
                                  "gpus": [0, 1, 2]},
                          "train": {"total_steps": 80, "segment_steps": 40, "batch_size": 16, "log_every": 10},
                          # MEET makes sampling and training meet, however short: few images, few steps.
                          "sample": {"num_images": 32, "steps": 4, "batch_size": 16}})
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(d, sort_keys=False))
    shim, meet = tmp_path / "shim", tmp_path / "meet"
    shim.mkdir()
    meet.mkdir()
    (shim / "diffrelay").write_text(MEET)
    (shim / "diffrelay").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "MEET_DIR": str(meet),
           "REAL_DIFFRELAY": str(BIN / "diffrelay")}
    run_cli("snakemake", "--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--cores", 2,
            "--configfile", cfg, timeout=1500, env=env)
    logs = tmp_path / "logs" / "tiny"

    def ids(log):
        return set(re.search(r"with-gpus: CUDA_VISIBLE_DEVICES=([\d,]+)", log.read_text()).group(1).split(","))

    for log in (logs / "train_segment").glob("*.log"):
        assert ids(log) == {"0"}, log
    for rule in ("sample_snapshot", "compute_fid", "compute_reference"):
        for log in (logs / rule).glob("*.log"):
            assert len(ids(log)) == 1 and ids(log) <= {"1", "2"}, log
    # Sampling of checkpoint 40 and segment (40, 80] met: each waited for the other to start (MEET),
    # so they ran at the same time, on other ids.
    assert sorted(p.name for p in meet.iterdir()) == ["sample", "train"]


def test_auto_keeps_uuid_and_mig_entries_and_explicit_ids_stay_inside_an_inherited_set(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3c2a10-aaaa,MIG-4b1a77e2-bbbb,3")
    assert gpus.visible_ids() == ["GPU-8f3c2a10-aaaa", "MIG-4b1a77e2-bbbb", 3]
    assert gpus.parse_pool("auto") == ["GPU-8f3c2a10-aaaa", "MIG-4b1a77e2-bbbb", 3]
    # Ids this job was not given are refused: with-gpus would otherwise hand out another job's GPU.
    with pytest.raises(UserError, match=r"--pool 0,3: id\(s\) 0 are not among the GPUs this job was given"):
        gpus.parse_pool("0,3")
    assert gpus.parse_pool("3") == [3]
    held = gpus.acquire(gpus.parse_pool("auto"), 2, tmp_path)
    assert list(held) == ["GPU-8f3c2a10-aaaa", "MIG-4b1a77e2-bbbb"]
    p = run_cli("with-gpus", "--pool", "auto", "--count", 1, "--lock-dir", tmp_path / "l", "--",
                "python", "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert p.stdout.strip() == "GPU-8f3c2a10-aaaa"
    assert "not set" not in p.stderr


def test_more_processes_than_visible_gpus_is_one_line_not_an_invalid_ordinal(monkeypatch):
    import torch

    from diffrelay.runtime import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UserError, match=r"LOCAL_RANK=2 needs GPU 2, but this process sees 2 GPU\(s\).*at most 2"):
        distributed.pick_device("cuda")


def test_auto_device_refuses_a_cpu_torch_beside_gpus_the_driver_lists(tmp_path, monkeypatch):
    """A conda env solved on a login node gets a CPU build of torch; `auto` must not then train on the CPU
    next to idle GPUs. A fake nvidia-smi lists two."""
    import torch

    from diffrelay.runtime import distributed

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"run.device=auto: nvidia-smi lists 2 GPU\(s\) but this torch .* cannot use"):
        distributed.pick_device("auto")
    assert distributed.pick_device("cpu") == torch.device("cpu")  # on purpose
    for handed in ("0,1", "GPU-5e1f0c3a-aaaa-bbbb-cccc-0123456789ab"):  # a SLURM allocation, with-gpus ids
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", handed)
        with pytest.raises(UserError, match="run.device=auto: nvidia-smi lists 2 GPU"):
            distributed.pick_device("auto")
    for hidden in ("", "-1"):  # GPUs hidden on purpose: the CPU is what was asked for
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert distributed.pick_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("case", ["file", "read-only", "lock-taken-by-a-folder"])
def test_an_unusable_lock_dir_is_one_line(tmp_path, case):
    # /proc takes no new folders, whoever asks (root ignores a folder's write permission bits).
    lock_dir = tmp_path / "locks" if case != "read-only" else Path("/proc/diffrelay-gpu-locks")
    if case == "file":
        lock_dir.write_text("not a folder")
    if case == "lock-taken-by-a-folder":  # pool.lock is usable; the id's own lock file cannot be made
        (lock_dir / "gpu-0.lock").mkdir(parents=True)
    p = run_cli("with-gpus", "--pool", "0", "--count", 1, "--lock-dir", lock_dir, "--", "true", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert f"--lock-dir {lock_dir}:" in p.stderr
    assert ("is not a folder" if case == "file" else "cannot be used") in p.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU machine the scripts run for real")
@pytest.mark.parametrize("cmd", [["bash", "benchmarks/gpu_smoke.sh"], [str(BIN / "python"), "benchmarks/bench_gpu.py"]])
def test_gpu_scripts_without_cuda_exit_2_with_one_line_and_write_nothing(cmd, tmp_path):
    before = set((REPO / "benchmarks" / "results").iterdir())
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no CUDA device here" in p.stderr, p.stderr
    assert set((REPO / "benchmarks" / "results").iterdir()) == before


@pytest.mark.parametrize("env", ["0,0", "GPU-8f3c2a10-aaaa,1,GPU-8f3c2a10-aaaa"], ids=["ordinal-twice", "uuid-twice"])
def test_auto_pool_of_a_gpu_named_twice_is_one_line_not_a_wait_forever(tmp_path, monkeypatch, env):
    # A second lock on an id this job holds already never comes: it waited past 10 minutes.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    with pytest.raises(UserError, match=r"--pool auto: CUDA_VISIBLE_DEVICES=.* names GPU .* twice"):
        gpus.parse_pool("auto")
    p = run_cli("with-gpus", "--pool", "auto", "--count", 2, "--lock-dir", tmp_path, "--", "true", check=False,
                timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "twice" in p.stderr and "CUDA_VISIBLE_DEVICES" in p.stderr
