"""`diffrelay track`: publish to the configured trackers what the run folder holds and they have not had yet.

The workflow runs it as a local job (on the submit host, where the network usually is) when each segment has
trained, after its evaluations and once after the report; it can be run by hand at any time to send a backlog. Each run takes the
run's lock (results/<run>/track/.lock, exclusive) for the whole publish, so a tracker run never has two
writers. A tracker that fails (no network, full disk, missing package or key, a crash) costs one warning line:
its ledger entry stays as it was, the job still writes its record and exits 0, and the next job sends the
backlog. The record (--out) says per tracker what was sent and what is pending.
"""

import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

from diffrelay import config, io
from diffrelay.runtime import claims
from diffrelay.tracking import ledger as ledgers
from diffrelay.tracking import records, settings

LOCK_POLL_S = 0.5
# Set before a tracker is imported (the user's own setting wins). MLflow's import starts usage telemetry and
# wandb-core reports its errors to Sentry unless told not to: nothing leaves this machine but what we send.
# MLflow's HTTP requests are bounded (its default: 120 s, 7 retries with backoff), so an unreachable server
# holds the run's lock for about a minute per request, not for half an hour.
TRACKER_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "WANDB_ERROR_REPORTING": "false",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}
CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@]+@")


def sink(name: str):
    """The tracker's send function (its module imports the tracker only when called)."""
    for key, value in TRACKER_ENV.items():
        os.environ.setdefault(key, value)
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


def redact(text: str) -> str:
    """text without the user:password of URLs (a tracking URI may hold them): scheme://***@host."""
    return CREDENTIALS.sub(r"\1***@", text)


def _one_line(e: BaseException) -> str:
    text = redact(str(e)).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def readable_grids(batch: dict, bad: dict, warn) -> dict:
    """`batch` without the grids that cannot be read (each named once in a warning, per publish): they are not
    sent, so not marked sent, and the next job tries them again."""
    from PIL import Image

    keep = {}
    for key, path in batch["grids"].items():
        if path not in bad:
            try:
                with Image.open(path) as img:
                    img.load()
            except Exception as e:  # a damaged or vanished file must not hold back the rest
                bad[path] = _one_line(e)
                warn(f"diffrelay: warning: {path}: grid not readable ({bad[path]}); not sent, the next track job "
                     f"tries again")
        if path not in bad:
            keep[key] = path
    return {**batch, "grids": keep}


def name_rejected(rec, batch: dict, said: set, warn) -> None:
    """One warning per score of `batch` that no tracker can take (records.Records.rejected: not a finite number),
    naming the file and the metric, once per publish; the file's other scores are sent."""
    for key in batch["evals"]:
        path, bad = rec.rejected.get(key, ("", {}))
        for metric, value in bad.items():
            if (key, metric) not in said:
                said.add((key, metric))
                warn(f"diffrelay: warning: {path}: {metric}={repr(value)[:80]}: not a finite number, which no "
                     "tracker can take; not sent (the file's other scores are)")


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
    rid = settings.run_id(d["run"]["name"], traj, settings.created(run_dir))
    ident = {"id": rid, "name": settings.display_name(d, rid), "trajectory": traj}
    dests = {name: settings.destination(name, d["track"][name]) for name in names}
    out = {}
    if not lock(track_dir, wait_s):
        rec = records.collect(run_dir)  # only to count what stays pending
        conf = settings.run_config(d, traj, rec.snapshots)
        for name in names:
            entry = ledgers.entry(ledgers.load(track_dir / "ledger.json"), name, rid, dests[name])
            batch = ledgers.pending(entry, rec, conf)
            out[name] = {"sent": None, "pending": ledgers.count(batch), "error": "lock held", "seconds": 0.0}
            warn(f"diffrelay: warning: {name}: {ledgers.count(batch)} records not sent: another `diffrelay track` "
                 f"held {track_dir / '.lock'} for {wait_s:g} s; the next track job sends them, or run: {command}")
        return out
    try:
        # Read the run folder under the lock: what this job sends and marks sent is what it saw as the writer.
        rec = records.collect(run_dir)
        conf = settings.run_config(d, traj, rec.snapshots)
        ledger_path = track_dir / "ledger.json"
        ledger = ledgers.load(ledger_path)
        bad_grids, said = {}, set()
        for name in names:
            entry = ledgers.entry(ledger, name, rid, dests[name])
            full = ledgers.pending(entry, rec, conf)
            name_rejected(rec, full, said, warn)
            batch = readable_grids(full, bad_grids, warn)
            skipped = ledgers.count(full) - ledgers.count(batch)
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
            out[name] = {"sent": None if error else _counts(batch), "pending": (n if error else 0) + skipped,
                         "error": error or (f"{skipped} unreadable grids" if skipped else None),
                         "seconds": round(time.perf_counter() - t0, 3)}
    finally:
        claims.release(track_dir / ".lock")
    return out


def _redirect(log: str):
    """Our output and the trackers' chatter to `log`; returns a stream to the original stderr for warnings."""
    console = os.fdopen(os.dup(2), "w", buffering=1)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    # Appended, never truncated: a file given by hand keeps what it held (Snakemake removes a job's old log itself).
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return console


def main(args) -> int:
    """Publish, and never fail the job: anything that goes wrong (the config, a full disk, the lock file, the
    ledger, the record) is one warning line and exit 0; the next track job sends what is pending."""
    command = "diffrelay track " + " ".join(f"--config {shlex.quote(c)}" for c in args.config)
    console = sys.stderr
    try:
        if args.log:
            console = _redirect(args.log)
            print("+ " + shlex.join(["diffrelay", "track", *sys.argv[2:]]), file=sys.stderr, flush=True)
    except Exception as e:
        print(f"diffrelay: warning: --log {args.log}: {_one_line(e)}; writing to stderr", file=sys.stderr, flush=True)

    def warn(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if console is not sys.stderr:
            print(line, file=console, flush=True)

    t0 = time.perf_counter()
    record = {"step": args.step, "trackers": {}, "pending": None}
    try:
        result = publish(config.load(args.config), command, warn, wait_s=args.wait_minutes * 60)
        record["trackers"], record["pending"] = result, sum(r["pending"] for r in result.values())
    except (Exception, SystemExit) as e:  # the job succeeds; what was not sent is pending (None: not counted)
        record["error"] = _one_line(e)
        warn(f"diffrelay: warning: nothing published ({record['error']}); send the backlog with: {command}")
    record["seconds"] = round(time.perf_counter() - t0, 3)
    if record["pending"] != 0:
        record["send_with"] = command
    if args.final and record["pending"]:
        warn(f"diffrelay: warning: {record['pending']} tracker records are still pending; send them with: {command}")
    print(json.dumps(record, sort_keys=True), file=sys.stderr, flush=True)
    if args.out:
        try:  # only a record of ours is replaced (the project's check for every --out)
            io.check_file_target(args.out, lambda q: io.is_json_object(q, ("trackers", "pending")),
                                 "a record written by `diffrelay track`")
            io.write_json(args.out, record)
        except Exception as e:
            warn(f"diffrelay: warning: {args.out}: record not written ({_one_line(e)})")
    return 0
