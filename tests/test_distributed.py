"""distributed.py: a world of one under plain python, clean child environments, readable group failures."""

import subprocess
import sys

import pytest

from diffrelay.runtime import distributed
from diffrelay.errors import GroupFailure


def test_clean_env_removes_every_process_group_variable():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
           "MASTER_ADDR": "x", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "0",
           "PATH": "/bin", "HOME": "/root"}
    assert distributed.clean_env(env) == {"PATH": "/bin", "HOME": "/root"}


def test_plain_python_is_a_world_of_one_with_working_collectives():
    code = ("import torch; from diffrelay.runtime import distributed as d\n"
            "d.init(d.pick_device('cpu'))\n"
            "print(d.rank(), d.world(), d.is_main(), d.all_reduce_sum(torch.tensor(3.0)).item()); d.barrier()\n"
            "d.teardown()")
    env = distributed.clean_env()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "1", "True", "3.0"]


def test_backend_errors_become_one_line_naming_the_rank_but_bugs_keep_their_type():
    with pytest.raises(GroupFailure, match=r"rank 0 of 1: gradient all-reduce failed .*Timed out"):
        with distributed.peers("gradient all-reduce"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Timed out waiting 9000ms for recv")
    with pytest.raises(RuntimeError, match="size mismatch") as info:
        with distributed.peers("gradient all-reduce"):
            raise RuntimeError("size mismatch, m1: [4 x 3], m2: [5 x 2]")
    assert not isinstance(info.value, GroupFailure)


def test_ranks_that_disagree_on_where_they_resume_stop_with_one_line(tmp_path):
    """Each rank picks its start from the run folder it sees; a shared file system's cache can show nodes
    different folders. Two ranks of one launch: the same value passes, different values stop both."""
    script = tmp_path / "agree.py"
    script.write_text("import os, sys\n"
                      "from diffrelay.runtime import distributed as d\n"
                      "from diffrelay.errors import UserError\n"
                      "d.init(d.pick_device('cpu'))\n"
                      "d.agree(40, 'the step to resume from')\n"
                      "try:\n"
                      "    d.agree(40 if d.rank() == 0 else 20, 'the step to resume from')\n"
                      "except UserError as e:\n"
                      # one file a rank: two ranks printing to one pipe can interleave their lines
                      "    open(sys.argv[1] + f'/rank{d.rank()}.txt', 'w').write(str(e))\n"
                      "d.teardown()\n")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        script, tmp_path], capture_output=True, text=True, env=distributed.clean_env(), timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1) if (tmp_path / f"rank{r}.txt").exists()]
    assert len(lines) == 2 and all("ranks disagree on the step to resume from: 20 on some, 40 on others" in line
                                   and "\n" not in line for line in lines), (lines, p.stdout, p.stderr)


def test_launch_passes_only_the_torchrun_options_this_torch_has(monkeypatch, capsys):
    """torch 2.11's torchrun has no --shutdown-timeout (seen on the first GPU machine: every `diffrelay launch`
    stopped at torchrun's usage line); launch then leaves it out and says what that costs."""
    assert {"--signals-to-handle", "--standalone"} <= distributed.torchrun_options()
    monkeypatch.setattr(distributed, "torchrun_options", lambda: {"--standalone", "--signals-to-handle"})
    args = distributed.torchrun_args(["--standalone", "-m", "diffrelay", "train"])
    assert "--shutdown-timeout" not in args and args[:2] == ["--signals-to-handle", distributed.SIGNALS]
    assert "no --shutdown-timeout" in capsys.readouterr().err
    monkeypatch.setattr(distributed, "torchrun_options", lambda: {"--shutdown-timeout", "--signals-to-handle"})
    assert distributed.torchrun_args(["-m", "x"])[2:4] == ["--shutdown-timeout", str(distributed.SHUTDOWN_SECONDS)]
    assert distributed.torchrun_args(["--shutdown-timeout=5", "-m", "x"]).count("--shutdown-timeout") == 0
