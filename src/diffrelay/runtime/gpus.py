"""`diffrelay with-gpus`: GPU slots on one machine. Take free GPU ids from a pool, run a command on them.

  diffrelay with-gpus --pool 0,1,2,3 --count 2 --lock-dir resources/gpu-locks -- torchrun ... -m diffrelay train ...

Snakemake assigns no GPU ids to local jobs, so without this every GPU job would use the first GPUs.
Each id of the pool is one lock file (`gpu-<id>.lock`); a job holds `flock` on the files of the ids it
uses. The command replaces this process (exec) and inherits the locked files, so the ids are held
exactly as long as the command and its children run, and the kernel frees them when the last of them
ends, even on SIGKILL. No daemon, no state to clean up.
"""

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from diffrelay import logs
from diffrelay.errors import UserError

POLL_SECONDS = 0.5
WAIT_LOG_SECONDS = 60


# CUDA_VISIBLE_DEVICES entries are ordinals (0, 1), or GPU/MIG UUIDs (GPU-8f3c..., MIG-4b1a... or the older
# MIG-GPU-<uuid>/<gi>/<ci>), as SLURM and Kubernetes often set them.
UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9/-]+\Z")


def visible_ids() -> list:
    """GPU ids this machine offers this process: the entries of CUDA_VISIBLE_DEVICES if set (ordinals as
    ints, UUID and MIG entries as they are), else the ordinals nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        entries = [x.strip() for x in env.split(",") if x.strip()]
        ids = [int(x) if x.isdigit() else x for x in entries if x.isdigit() or UUID.match(x)]
        # One GPU named twice would be locked twice by with-gpus: the second lock never comes (a hang).
        twice = next((g for i, g in enumerate(ids) if g in ids[:i]), None)
        if twice is not None:
            raise UserError(f"CUDA_VISIBLE_DEVICES={env} names GPU {twice} twice; list each GPU once "
                            f"(CUDA_VISIBLE_DEVICES={','.join(map(str, dict.fromkeys(ids)))})")
        return ids
    return nvidia_smi_ids()


def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it; None without it."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[0] if out else None


def nvidia_smi_ids() -> list[int]:
    """The GPU ordinals the driver lists (nvidia-smi), whatever this process's torch can use; [] without it."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(x) for x in out.split() if x.isdigit()]


def check_inherited(pool: list, source: str) -> None:
    """Explicit ids must lie inside the GPUs this job was given: with CUDA_VISIBLE_DEVICES=2,3 inherited (a
    SLURM allocation, say), `--pool 0,1` would set CUDA_VISIBLE_DEVICES=0 and escape onto another job's GPU."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return
    inherited = [x.strip() for x in env.split(",") if x.strip()]
    outside = [str(g) for g in pool if str(g) not in inherited]
    if outside:
        raise UserError(f"{source}: id(s) {','.join(outside)} are not among the GPUs this job was given "
                        f"(CUDA_VISIBLE_DEVICES={env}); use ids from it, or auto")


def gpu_pools(d: dict, visible=None) -> tuple[list[int], list[int]]:
    """(training ids, evaluation ids) of run.gpus; the same list twice when evaluation shares training's."""
    r, t = d["run"], d["train"]
    pool = r["gpus"]
    if pool == "auto":
        pool = visible_ids() if visible is None else visible
    if not pool:
        return [], []
    keep = r["eval_gpus"] if r["eval_gpus"] is not None else max(0, len(pool) - t["nproc_per_node"])
    if keep == 0:
        return list(pool), list(pool)
    return list(pool[:len(pool) - keep]), list(pool[len(pool) - keep:])


def check_pool(d: dict) -> list[tuple[str, str]]:
    """Config rules of run.gpus (called by config.validate): (key, message) pairs."""
    r, t, s = d["run"], d["train"], d["sample"]
    if r["gpus"] is None:
        return []
    if t["nnodes"] > 1:
        return [("run.gpus", "is for one machine; with train.nnodes > 1 (SLURM) set it to null")]
    pool = r["gpus"] if isinstance(r["gpus"], list) else None
    if pool is None:
        return []  # auto: the workflow checks it again with the machine's ids (check_gpu_pool)
    if r["eval_gpus"] and r["eval_gpus"] >= len(pool):
        return [(f"run.eval_gpus={r['eval_gpus']}", f"leaves none of the {len(pool)} ids of run.gpus for training; "
                 f"use at most {len(pool) - 1} (0 = evaluation shares training's ids)")]
    train_ids, eval_ids = gpu_pools(d)
    if t["nproc_per_node"] > len(train_ids):
        return [(f"train.nproc_per_node={t['nproc_per_node']}",
                 f"needs more GPUs than run.gpus leaves for training ({len(train_ids)}); "
                 f"lower it or run.eval_gpus, or add ids to run.gpus")]
    if s["nproc"] > len(eval_ids):
        return [(f"sample.nproc={s['nproc']}",
                 f"needs more GPUs than run.gpus keeps for evaluation ({len(eval_ids)}); lower it or raise run.eval_gpus")]
    return []


def parse_pool(text: str) -> list:
    """'0,1,2' -> [0, 1, 2]; 'auto' -> every visible GPU; UUID and MIG ids are kept as strings."""
    if text == "auto":
        try:
            ids = visible_ids()
        except UserError as e:
            raise UserError(f"--pool auto: {e}, or give the ids, e.g. --pool 0,1") from e
        if not ids:
            raise UserError("--pool auto: no GPU is visible (no usable CUDA_VISIBLE_DEVICES entry, no nvidia-smi); "
                            "give the ids, e.g. --pool 0,1")
        return ids
    entries = [x.strip() for x in text.split(",")]
    if not all(x.isdigit() or UUID.match(x) for x in entries):
        raise UserError(f"--pool {text}: give comma-separated GPU ids such as 0,1,2,3 (or GPU-/MIG- UUIDs), or auto")
    ids = [int(x) if x.isdigit() else x for x in entries]
    if len(set(ids)) != len(ids):
        raise UserError(f"--pool {text}: give distinct GPU ids of 0 or more, such as 0,1,2,3")
    check_inherited(ids, f"--pool {text}")
    return ids


def lock_name(gpu) -> str:
    return f"gpu-{str(gpu).replace('/', '_')}.lock"  # old-style MIG ids hold slashes


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def acquire(pool: list[int], count: int, lock_dir, log=None) -> dict[int, int]:
    """Block until `count` ids of `pool` are free; return {id: locked fd}. Ids are tried in pool order.

    The whole pick happens under one pool-wide lock, so two jobs never each hold part of what the other
    needs (no deadlock, no livelock); a job that finds too few releases what it took and waits."""
    if not 0 < count <= len(pool):
        raise UserError(f"--count {count}: must be between 1 and the pool size {len(pool)}")
    lock_dir = Path(lock_dir)
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        # Every lock file this job may take, made once now: a folder that cannot hold one (read-only, a
        # lock name taken by a folder) is one line here, not a traceback in the wait loop.
        for name in ["pool.lock"] + [lock_name(gpu) for gpu in pool]:
            os.close(os.open(lock_dir / name, os.O_RDWR | os.O_CREAT, 0o666))
    except OSError as e:
        what = "is not a folder" if lock_dir.exists() and not lock_dir.is_dir() else \
            f"cannot be used ({e.strerror}: {Path(e.filename).name if e.filename else lock_dir})"
        raise UserError(f"--lock-dir {lock_dir}: {what}; give a writable folder (the workflow uses "
                        "<run.resources>/gpu-locks)") from e
    started, last_log = time.monotonic(), None
    while True:
        guard = os.open(lock_dir / "pool.lock", os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(guard, fcntl.LOCK_EX)
        held: dict[int, int] = {}
        try:
            for gpu in pool:
                fd = _try_lock(lock_dir / lock_name(gpu))
                if fd is not None:
                    held[gpu] = fd
                    if len(held) == count:
                        return held
            for fd in held.values():
                os.close(fd)
        finally:
            os.close(guard)
        now = time.monotonic()
        if log and (last_log is None or now - last_log >= WAIT_LOG_SECONDS):
            log.info(f"with-gpus: waiting for {count} free GPU id(s) of pool {','.join(map(str, pool))} "
                     f"({len(held)} free now; waited {logs.fmt_duration(now - started)})")
            last_log = now
        time.sleep(POLL_SECONDS)


def main(args) -> int:
    log = logs.setup()
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UserError("with-gpus: no command; put it after --, e.g. diffrelay with-gpus --pool 0,1 --count 1 -- CMD")
    if not shutil.which(cmd[0]):
        raise UserError(f"with-gpus: {cmd[0]}: command not found on PATH")
    pool = parse_pool(args.pool)
    held = acquire(pool, args.count, args.lock_dir, log)
    ids = ",".join(map(str, held))
    # The job's log records where it ran (with the host and, under SLURM, the job id).
    log.info(f"with-gpus: CUDA_VISIBLE_DEVICES={ids} (pool {','.join(map(str, pool))}, host {os.uname().nodename})")
    sys.stderr.flush()
    for fd in held.values():
        os.set_inheritable(fd, True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ids
    os.execvp(cmd[0], cmd)  # the locks travel with the process; nothing after this line runs
