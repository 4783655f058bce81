"""runtime/slurm.py: which tool watches SLURM jobs, decided without a cluster (the real probe is in
test_slurm.py::test_a_cluster_without_accounting_is_watched_with_squeue_not_a_silent_hang)."""

import pytest

from diffrelay.runtime import slurm

DISABLED = "Slurm accounting storage is disabled"


@pytest.mark.parametrize("current, disabled, age, want, words", [
    ("squeue", DISABLED, 10, "squeue", None),  # the profile already chose squeue: no probe result matters
    ("sacct", None, 10, "sacct", None),  # accounting works
    ("sacct", DISABLED, 3600, "squeue", ["keeps no SLURM accounting", "MinJobAge=3600 s", "slurm-status-command"]),
    ("sacct", DISABLED, 60, None, ["slurm-status-command: sacct cannot watch", "MinJobAge=60 s", "180 s"]),
    ("sacct", DISABLED, None, None, ["MinJobAge (unknown", "slurm-status-command: squeue"]),
])
def test_status_command_follows_the_probe(monkeypatch, current, disabled, age, want, words):
    monkeypatch.setattr(slurm, "accounting_disabled", lambda: disabled)
    monkeypatch.setattr(slurm, "min_job_age", lambda: age)
    command, line = slurm.choose_status_command(current)
    assert command == want
    if words is None:
        assert line is None
    else:
        assert line and "\n" not in line and all(w in line for w in words), line


def test_probe_reads_sacct_and_scontrol(monkeypatch, tmp_path):
    """Fake sacct/scontrol on PATH, as a cluster without accounting answers."""
    for name, body in (("sacct", f"echo '{DISABLED}' >&2; exit 1"),
                       ("scontrol", "printf 'MaxJobCount = 10000\\nMinJobAge = 300 sec\\n'")):
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert slurm.accounting_disabled() == DISABLED and slurm.min_job_age() == 300
    (tmp_path / "sacct").write_text("#!/bin/sh\nexit 0\n")
    assert slurm.accounting_disabled() is None
