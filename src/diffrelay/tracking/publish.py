"""`diffrelay track`: publish to the configured trackers what the run folder holds and they have not had yet.

The workflow runs it as a local job (on the submit host, where the network usually is) after each segment's
evaluations and once after the report; it can be run by hand at any time to send a backlog. Each run takes the
run's lock (results/<run>/track/.lock, exclusive) for the whole publish, so a tracker run never has two
writers. A tracker that fails (no network, full disk, missing package or key, a crash) costs one warning line:
its ledger entry stays as it was, the job still writes its record and exits 0, and the next job sends the
backlog. The record (--out) says per tracker what was sent and what is pending.
"""

import json
import os
import shlex
import sys
import time
from pathlib import Path

from diffrelay import config, io
from diffrelay.runtime import claims
from diffrelay.tracking import ledger as ledgers
from diffrelay.tracking import records, settings

LOCK_POLL_S = 0.5


def sink(name: str):
    """The tracker's send function (its module imports the tracker only when called)."""
    if name == "wandb":
        from diffrelay.tracking import wandb_sink as module
    else:
        from diffrelay.tracking import mlflow_sink as module
    return module.send


def lock(track_dir: Path, wait_s: float) -> bool:
    """Take the run's tracking lock, waiting up to wait_s for another track job to finish."""
    path = track_dir / ".lock"
    with open(path, "a"):
        pass
    deadline = time.monotonic() + wait_s
    while not claims.claim(path, shared=False):
        if time.monotonic() >= deadline:
            return False
        time.sleep(LOCK_POLL_S)
    return True


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _counts(batch: dict) -> dict:
    return {"train_steps": len(batch["train"]), "scores": len(batch["evals"]), "grids": len(batch["grids"]),
            "config": batch["config"] is not None}


def publish(cfg, command: str, warn, wait_s: float = 1800.0) -> dict:
    """Send every tracker its backlog; returns {tracker: {sent, pending, error, seconds}}. Never raises for a
    tracker's failure: `warn` gets one line per failed tracker."""
    d = cfg.to_dict()
    names = settings.trackers(d)
    if not names:
        return {}
    run_dir = config.run_dir(cfg)
    track_dir = run_dir / "track"
    track_dir.mkdir(parents=True, exist_ok=True)
    traj = config.trajectory_hash(cfg)
    rid = settings.run_id(d["run"]["name"], traj)
    ident = {"id": rid, "name": settings.display_name(d, rid), "trajectory": traj}
    rec = records.collect(run_dir)
    conf = settings.run_config(d, traj, rec.snapshots)
    out = {}
    if not lock(track_dir, wait_s):
        for name in names:
            batch = ledgers.pending(ledgers.entry(ledgers.load(track_dir / "ledger.json"), name), rec, conf)
            out[name] = {"sent": None, "pending": ledgers.count(batch), "error": "lock held", "seconds": 0.0}
            warn(f"diffrelay: warning: {name}: {ledgers.count(batch)} records not sent: another `diffrelay track` "
                 f"held {track_dir / '.lock'} for {wait_s:g} s; the next track job sends them, or run: {command}")
        return out
    try:
        ledger_path = track_dir / "ledger.json"
        ledger = ledgers.load(ledger_path)
        for name in names:
            entry = ledgers.entry(ledger, name)
            batch = ledgers.pending(entry, rec, conf)
            n, t0, error = ledgers.count(batch), time.perf_counter(), None
            if n:
                try:
                    sink(name)(d["track"][name], ident, batch, track_dir)
                except (Exception, SystemExit) as e:  # a tracker never fails the job (SystemExit: a library's exit)
                    error = _one_line(e)
                    warn(f"diffrelay: warning: {name}: {n} records not sent ({error}); the next track job sends "
                         f"them, or run: {command}")
                else:
                    ledger[name] = ledgers.advance(entry, batch)
                    ledgers.save(ledger_path, ledger)
            out[name] = {"sent": None if error else _counts(batch), "pending": n if error else 0, "error": error,
                         "seconds": round(time.perf_counter() - t0, 3)}
    finally:
        claims.release(track_dir / ".lock")
    return out


def _redirect(log: str):
    """Our output and the trackers' chatter to `log`; returns a stream to the original stderr for warnings."""
    console = os.fdopen(os.dup(2), "w", buffering=1)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return console


def main(args) -> int:
    command = "diffrelay track " + " ".join(f"--config {shlex.quote(c)}" for c in args.config)
    console = _redirect(args.log) if args.log else sys.stderr
    if args.log:
        print("+ " + shlex.join(["diffrelay", "track", *sys.argv[2:]]), file=sys.stderr, flush=True)

    def warn(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if console is not sys.stderr:
            print(line, file=console, flush=True)

    cfg = config.load(args.config)
    t0 = time.perf_counter()
    result = publish(cfg, command, warn, wait_s=args.wait_minutes * 60)
    pending = sum(r["pending"] for r in result.values())
    record = {"step": args.step, "trackers": result, "pending": pending, "seconds": round(time.perf_counter() - t0, 3)}
    if pending:
        record["send_with"] = command
    if args.final and pending:
        warn(f"diffrelay: warning: {pending} tracker records are still pending; send them with: {command}")
    print(json.dumps(record, sort_keys=True), file=sys.stderr, flush=True)
    if args.out:
        io.write_json(args.out, record)
    return 0
