"""Logging for every stage: progress lines on stderr from rank 0, JSON lines in the run folder."""

import json
import logging
import os
import sys
import time
from pathlib import Path

LOGGER = "diffrelay"


def setup(main: bool = True, level=logging.INFO) -> logging.Logger:
    """Rank 0 logs to stderr; other ranks get a null handler, so call sites need no rank checks."""
    log = logging.getLogger(LOGGER)
    log.handlers.clear()
    log.propagate = False
    if main:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        log.addHandler(h)
    else:
        log.addHandler(logging.NullHandler())
    log.setLevel(level)
    return log


def get() -> logging.Logger:
    return logging.getLogger(LOGGER)


def append_jsonl(path, record: dict) -> None:
    """Append one record and flush it to disk. A single short write, so a crash cannot interleave lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"time": round(time.time(), 3), **record}, sort_keys=True) + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        from diffrelay.errors import UserError

        raise UserError(f"{path}: cannot append ({e.strerror}); earlier records are kept; free space or fix "
                        "permissions and rerun") from e


def read_jsonl(path) -> list[dict]:
    """Records of a JSON-lines file; a torn last line (killed writer) is ignored."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def workflow_end(run: str, run_dir: str, ok: bool, scheduler=None) -> str:
    """The last line the Snakefile prints (onsuccess/onerror). Snakemake calls onerror also when it was told
    to stop (SIGTERM: it lets the running jobs finish, then returns False), so the scheduler is asked
    whether a signal ended the run and whether any job failed; "report in" only when the report exists."""
    if ok:
        report = os.path.join(run_dir, "report", "metrics.csv")
        where = f"; report in {run_dir}/report" if os.path.exists(report) else f"; results in {run_dir}"
        return f"diffrelay: run {run} done{where}"
    # Snakemake's scheduler records a stop signal in _user_kill and failed jobs in `failed` (snakemake 9).
    stopped = getattr(scheduler, "_user_kill", None)
    failed = len(getattr(scheduler, "failed", ()) or ())
    if stopped:
        jobs = (f"{failed} job(s) were stopped mid-way (training keeps a recovery checkpoint)" if failed
                else "no job failed")
        return f"diffrelay: run {run} stopped by a signal; {jobs}; rerun the same command to go on, finished work is kept"
    return f"diffrelay: run {run} failed; see the failed job's log above (logs/{run}/)"


PROGRESS_SECONDS = 10  # between progress lines


class Progress:
    """`prepare: 12000/1281167 images | 850 img/s | eta 24m53s`, at most every PROGRESS_SECONDS."""

    def __init__(self, total: int, what: str = "prepare:", verb: str = "decoded"):
        self.total, self.done, self.what, self.verb = total, 0, what, verb
        self.t0 = self.last = time.monotonic()

    def update(self, done: int) -> None:
        self.done = done
        if time.monotonic() - self.last >= PROGRESS_SECONDS:
            self.last = time.monotonic()
            get().info(self.line())

    def line(self, final: bool = False) -> str:
        elapsed = time.monotonic() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        head = f"{self.what} {self.done}/{self.total} images | {rate:.0f} img/s | "
        if final:
            return head + f"{self.verb} in {fmt_duration(elapsed)}"
        return head + (f"eta {fmt_duration((self.total - self.done) / rate)}" if rate else "eta ?")
