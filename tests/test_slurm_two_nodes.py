"""Multi-node training on a real two-node SLURM cluster (tests/slurm/two-nodes.sh): two slurmd in their
own network namespaces with their own hostnames, so `sbatch -N 2` runs one launch agent per node and
they meet over c10d at a node name, as on a real cluster."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, deep_merge, run_cli

from diffrelay.training import checkpoint

ENABLE = ("needs the local two-node SLURM cluster; enable with: sudo bash tests/slurm/cluster.sh install && "
          "sudo bash tests/slurm/cluster.sh start && sudo bash tests/slurm/two-nodes.sh start && "
          "DIFFRELAY_SLURM_TWO_NODES=1 make test")
pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(os.environ.get("DIFFRELAY_SLURM_TWO_NODES") != "1", reason=ENABLE)]

TWO_NODES = REPO / "tests" / "slurm" / "two-nodes.sh"
PROFILE = REPO / "tests" / "slurm" / "profile"
TIMEOUT = 480


def client(*cmd) -> list[str]:
    """A command run in the cluster's controller namespace against its slurm.conf."""
    return ["bash", str(TWO_NODES), "exec", *map(str, cmd)]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    p = subprocess.run(["bash", str(TWO_NODES), "status"], capture_output=True, text=True)
    if p.returncode:
        pytest.fail(f"DIFFRELAY_SLURM_TWO_NODES=1 but the two-node cluster is not up:\n{p.stdout}{p.stderr}"
                    "run: sudo bash tests/slurm/two-nodes.sh start")


def assert_same_state(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics" / "train.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def train_both_ways(tmp_path, write_config, train: dict, final: str) -> None:
    """The run `train` names to `final` twice, at the same world size: on two nodes x one process, every job through
    sbatch on the two-node cluster (results/two_nodes), and on one machine x two processes, locally
    (results/one_node)."""
    base = {"run": {"results": str(tmp_path / "results")}, "train": train}
    two = write_config(deep_merge(base, {"run": {"name": "two_nodes"}, "train": {"nnodes": 2, "nproc_per_node": 1}}),
                       name="two.yaml")
    one = write_config(deep_merge(base, {"run": {"name": "one_node"}, "train": {"nnodes": 1, "nproc_per_node": 2}}),
                       name="one.yaml")
    (tmp_path / "two").mkdir()
    p = subprocess.run(client("snakemake", tmp_path / "results" / "two_nodes" / final,
                              "--snakefile", REPO / "Snakefile", "--directory", tmp_path / "two",
                              "--workflow-profile", PROFILE, "--configfile", two),
                       capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path / "two")
    assert p.returncode == 0, p.stdout + p.stderr
    (tmp_path / "one").mkdir()
    run_cli("snakemake", tmp_path / "results" / "one_node" / final, "--snakefile", REPO / "Snakefile",
            "--directory", tmp_path / "one", "--cores", "2", "--configfile", one, cwd=tmp_path / "one", timeout=TIMEOUT)


def test_two_nodes_train_like_one_node_with_the_same_world_size(tmp_path, write_config):
    steps = {"total_steps": 3, "segment_steps": 3, "log_every": 1}  # one segment: each job costs ~30 s here
    final = "trained/step_0000003.json"
    train_both_ways(tmp_path, write_config, steps, final)

    # Each segment was one SLURM job on both nodes, with one launch agent per node.
    logs = sorted((tmp_path / "two" / ".snakemake" / "slurm_logs" / "rule_train_segment").rglob("*.log"))
    assert len(logs) == 1, logs
    ids = ",".join(p.stem for p in logs)
    out = subprocess.run(client("squeue", "-h", "-t", "all", "-j", ids, "-o", "%i|%T|%N|%D"),
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        job, state, nodes, count = line.split("|")
        assert (state, nodes, count) == ("COMPLETED", "n[1-2]", "2"), line
    for seg in ("step_0000003",):
        text = (tmp_path / "two" / "logs" / "two_nodes" / "train_segment" / f"{seg}.log").read_text()
        assert "on node n1 (n1)" in text and "on node n2 (n2)" in text, text
    for log in logs:
        assert f"diffrelay: SLURM job {log.stem} on nodes n[1-2]" in log.read_text(), log

    # Bit-identical: every tensor of the final checkpoint, and every logged loss.
    results = tmp_path / "results"
    state_two, _ = checkpoint.load_checkpoint(results / "two_nodes" / "checkpoints" / "step_0000003")
    state_one, _ = checkpoint.load_checkpoint(results / "one_node" / "checkpoints" / "step_0000003")
    assert_same_state(state_two, state_one)
    assert losses(results / "two_nodes") == losses(results / "one_node")
    assert len(losses(results / "one_node")) == 3


def test_fsdp2_on_two_nodes_writes_the_shards_one_node_writes(tmp_path, write_config):
    """train.sharding: fsdp2 through the same profile: one SLURM job on both nodes, each node's process writing its
    own shard of the checkpoint into the shared run folder; every tensor as one node with 2 processes has it."""
    from diffrelay.training import sharded_checkpoint

    train = {"total_steps": 2, "segment_steps": 2, "log_every": 1, "sharding": "fsdp2"}
    train_both_ways(tmp_path, write_config, train, "trained/step_0000002.json")
    text = (tmp_path / "two" / "logs" / "two_nodes" / "train_segment" / "step_0000002.log").read_text()
    assert "on node n1 (n1)" in text and "on node n2 (n2)" in text, text
    ckpts = [tmp_path / "results" / r / "checkpoints" / "step_0000002" for r in ("two_nodes", "one_node")]
    for c in ckpts:
        checkpoint.verify_checkpoint(c)
        assert len(list(c.glob("shard-*.safetensors"))) == 2
    a, b = (sharded_checkpoint.read_whole(c) for c in ckpts)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "results" / "two_nodes") == losses(tmp_path / "results" / "one_node")
