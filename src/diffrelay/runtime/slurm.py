"""Which SLURM tool can watch the workflow's jobs: one `sacct` probe when a SLURM run starts.

snakemake-executor-plugin-slurm reads job states from `sacct` by default. On a cluster without accounting
storage (AccountingStorageType=accounting_storage/none, common on small clusters) every `sacct` call fails
with "Slurm accounting storage is disabled", and the plugin keeps waiting for states that never come:
the run hangs without a word. `squeue` answers there, but only for MinJobAge seconds after a job ends,
so it is used only when MinJobAge outlasts the plugin's longest pause between checks.
"""

import re
import subprocess

# The plugin's longest pause between two status checks (snakemake_executor_plugin_slurm: max_sleep_time).
PLUGIN_MAX_POLL_S = 180


def _run(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def accounting_disabled() -> str | None:
    """sacct's own message when the cluster keeps no job accounting; None when sacct answers (or is absent,
    which the plugin handles itself by using squeue)."""
    p = _run(["sacct", "-X", "-n", "-S", "now", "--format=JobID"])
    if p is None or p.returncode == 0:
        return None
    text = " ".join((p.stdout + p.stderr).split())
    return text if "accounting storage is disabled" in text.lower() else None


def min_job_age() -> int | None:
    """MinJobAge from `scontrol show config`: seconds squeue keeps a finished job; None if unknown."""
    p = _run(["scontrol", "show", "config"])
    m = re.search(r"^MinJobAge\s*=\s*(\d+)", p.stdout if p else "", re.M)
    return int(m.group(1)) if m else None


def choose_status_command(current: str | None) -> tuple[str | None, str | None]:
    """(status command to use, line to print) for a SLURM run whose profile set `current`.

    (current, None) when nothing needs saying; ("squeue", notice) to switch; (None, error) to stop."""
    if current != "sacct":
        return current, None
    disabled = accounting_disabled()
    if disabled is None:
        return current, None
    age = min_job_age()
    where = "set slurm-status-command: squeue in your SLURM profile (profiles/<yours>/config.yaml)"
    if age is not None and age > PLUGIN_MAX_POLL_S:
        return "squeue", (f"diffrelay: this cluster keeps no SLURM accounting (sacct: {disabled}), so jobs are "
                          f"watched with squeue, which keeps finished jobs for MinJobAge={age} s; {where} to skip "
                          "this check")
    known = f"MinJobAge={age} s" if age is not None else "MinJobAge (unknown: scontrol show config failed)"
    return None, (f"slurm-status-command: sacct cannot watch jobs on this cluster (sacct: {disabled}), and squeue "
                  f"forgets a finished job after {known}, not more than the {PLUGIN_MAX_POLL_S} s between status "
                  f"checks; ask the admins for accounting storage or a MinJobAge above {PLUGIN_MAX_POLL_S} s, then "
                  f"{where}")
