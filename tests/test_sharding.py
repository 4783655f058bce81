"""train.sharding: fsdp2 on the CPU (gloo, 2 processes): K segments equal one run bit for bit, fsdp2 equals ddp
within rounding, a checkpoint of 2 processes resumes on 1, and a sharded checkpoint that lost, gained or swapped a
shard, or was written with the other sharding, is refused in one line."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli
from diffrelay import config, io
from diffrelay.errors import UserError
from diffrelay.training import checkpoint, sharded_checkpoint, sharding

BASE = {
    "run": {"name": "r", "device": "cpu", "seed": 0},
    "data": {"kind": "shapes", "resolution": 16, "count": 20, "seed": 0},
    "model": {"arch": "dit", "class_conditional": True,
              "kwargs": {"patch": 4, "hidden_size": 32, "depth": 2, "num_heads": 2}},
    "train": {"total_steps": 4, "segment_steps": 2, "batch_size": 8, "nproc_per_node": 2, "lr": 0.002,
              "warmup_steps": 2, "log_every": 1, "ema_decays": [0.9, 0.99], "sharding": "fsdp2",
              "phema": {"every": 2, "profiles": [0.05, 0.1]}},
}
STEP = "checkpoints/step_{:07d}"


def write(root, name, **train):
    d = json.loads(json.dumps(BASE))
    d["run"].update(results=str(root / name), resources=str(root / "resources"))
    d["train"].update(train)
    io.write_json(root / f"{name}.yaml", d)
    return root / f"{name}.yaml", root / name / "r"


def train(root, name, nproc, until, init=None, check=True):
    args = ["--config", root / f"{name}.yaml", "--until-step", until, "--dataset", root / "dataset"]
    args += ["--init", init] if init else []
    if nproc == 1:
        return run_cli("train", *args, check=check)
    return run_cli("torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "diffrelay", "train", *args,
                   check=check)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fsdp2 on 2 processes in one segment and in two; ddp on 2 in one; the two-segment run's step-2 checkpoint
    resumed on 1 process, through the leftovers of a save killed half-way."""
    root = tmp_path_factory.mktemp("sharding")
    cfg, _ = write(root, "one")
    run_cli("prepare", "--config", cfg, "--out", root / "dataset")
    write(root, "two")
    write(root, "ddp", sharding="ddp")
    write(root, "re1", nproc_per_node=1)
    train(root, "one", 2, 4)
    train(root, "two", 2, 2)
    train(root, "two", 2, 4, init=root / "two/r" / STEP.format(2))
    train(root, "ddp", 2, 4)
    stale = root / "re1/r/checkpoints/.step_0000004.sharded.tmp"  # what a rank killed mid-save leaves
    stale.mkdir(parents=True)
    (stale / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"half")
    train(root, "re1", 1, 4, init=root / "two/r" / STEP.format(2))
    return root


def test_two_fsdp2_segments_equal_one_run_bit_for_bit_and_the_ranks_wrote_their_shards(runs):
    one, two = (runs / f"{n}/r" / STEP.format(4) for n in ("one", "two"))
    assert sorted(p.name for p in one.glob("shard-*")) == [f"shard-0000{i}-model-00001-of-00001.safetensors"
                                                           for i in (1, 2)]
    checkpoint.verify_checkpoint(one)
    a, b = sharded_checkpoint.read_whole(one), sharded_checkpoint.read_whole(two)
    assert a.keys() == b.keys() and {k.split(".")[0] for k in a} == {"net", "ema0", "ema1", "phema0", "phema1",
                                                                     "optimizer"}
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    rest_a, rest_b = (torch.load(p / "state.pt", weights_only=True) for p in (one, two))
    assert rest_a == rest_b and rest_a["sharding"] == {"kind": "fsdp2", "world": 2}
    for f in ("snapshots/step_0000004.safetensors", "phema/step_0000004.safetensors"):
        x, y = load_file(runs / "one/r" / f), load_file(runs / "two/r" / f)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f


def test_fsdp2_equals_ddp_within_rounding_in_every_file_sampling_reads(runs):
    """The snapshot (raw weights and both EMAs) and the post-hoc EMA file: the same tensors, as ddp's within float
    rounding (the gradients are reduce-scattered instead of all-reduced)."""
    for f in ("snapshots/step_0000004.safetensors", "phema/step_0000004.safetensors"):
        x, y = load_file(runs / "one/r" / f), load_file(runs / "ddp/r" / f)
        assert x.keys() == y.keys(), f
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=1e-5, atol=1e-6, msg=f"{f}: {k}")
    ddp = torch.load(runs / "ddp/r" / STEP.format(4) / "state.pt", weights_only=True)
    whole = sharded_checkpoint.read_whole(runs / "one/r" / STEP.format(4))
    for k, v in ddp["net"].items():
        torch.testing.assert_close(whole[f"net.{k}"], v, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_two_processes_resumes_on_one_through_a_killed_save(runs):
    """Resharded on load (2 -> 1): the step-2 state read whole, then 2 more steps within rounding of the 2-process
    run. The leftover folder of a save killed half-way was never a checkpoint and is replaced by the new save."""
    re1 = runs / "re1/r" / STEP.format(4)
    checkpoint.verify_checkpoint(re1)
    assert [p.name for p in re1.glob("shard-*")] == ["shard-00001-model-00001-of-00001.safetensors"]
    assert not (re1.parent / ".step_0000004.sharded.tmp").exists()
    a, b = sharded_checkpoint.read_whole(runs / "one/r" / STEP.format(4)), sharded_checkpoint.read_whole(re1)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    log = (runs / "re1/r/metrics/train.jsonl").read_text()
    assert '"world": 1' in log


def one_line(fn) -> str:
    with pytest.raises(UserError) as e:
        fn()
    assert "\n" not in str(e.value), e.value
    return str(e.value)


def test_a_lost_swapped_or_stray_shard_is_refused_in_one_line(runs, tmp_path):
    good = runs / "two/r" / STEP.format(4)
    lost = shutil.copytree(good, tmp_path / "lost")
    (lost / "shard-00002-model-00001-of-00001.safetensors").unlink()
    assert "shard-00002-model-00001-of-00001.safetensors: missing from checkpoint" in one_line(
        lambda: checkpoint.load_checkpoint(lost))
    swapped = shutil.copytree(good, tmp_path / "swapped")  # another checkpoint's shard under the same name
    shutil.copy(runs / "two/r" / STEP.format(2) / "shard-00002-model-00001-of-00001.safetensors", swapped)
    assert "sha256 does not match manifest.json" in one_line(lambda: checkpoint.load_checkpoint(swapped))
    stray = shutil.copytree(good, tmp_path / "stray")  # a shard of a 4-process save, read as part of this one
    shutil.copy(good / "shard-00002-model-00001-of-00001.safetensors",
                stray / "shard-00003-model-00001-of-00001.safetensors")
    msg = one_line(lambda: checkpoint.load_checkpoint(stray))
    assert "shard-00003-model-00001-of-00001.safetensors: a shard this checkpoint's manifest.json does not list" in msg


def test_a_resume_with_the_other_sharding_is_refused_in_one_line_both_ways(runs):
    write(runs, "ddp1", sharding="ddp", nproc_per_node=1)
    p = train(runs, "ddp1", 1, 4, init=runs / "two/r" / STEP.format(2), check=False)
    assert p.returncode != 0
    assert "written with train.sharding: fsdp2; this run has ddp; resume it with train.sharding: fsdp2" in p.stderr
    write(runs, "back", nproc_per_node=1, total_steps=6, segment_steps=2)  # on from the ddp run's last checkpoint
    p = train(runs, "back", 1, 6, init=runs / "ddp/r" / STEP.format(4), check=False)
    assert p.returncode != 0 and "written with train.sharding: ddp; this run has fsdp2" in p.stderr
    # Not part of the trajectory: the same run, so the checkpoint is found and the refusal is said, not skipped.
    a, b = (config.Config(config.validate(json.loads((runs / f"{n}.yaml").read_text()))) for n in ("one", "ddp"))
    assert config.trajectory_hash(a) == config.trajectory_hash(b)


@pytest.mark.parametrize("keys, says", [
    ({"train": {"precision": "fp16"}}, "set train.precision: bf16"),
    ({"model": {"arch": "edm2", "kwargs": {}}}, "train model.arch edm2 with train.sharding: ddp"),
    ({"train": {"channels_last": True}}, "set train.channels_last: false"),
])
def test_what_fully_shard_cannot_train_is_refused_when_the_config_is_read(keys, says):
    d = json.loads(json.dumps(BASE))
    for section, values in keys.items():
        d[section].update(values)
    with pytest.raises(UserError, match=says):
        config.validate(d)


def test_the_units_are_each_networks_blocks_deepest_first_or_the_ones_it_names():
    from torch import nn

    from diffrelay.nets.dit import DiT

    net = DiT(16, 3, 0, patch=4, depth=3, hidden_size=32, num_heads=2)
    assert sharding.units(net) == list(net.blocks)[::-1]

    class Inner(nn.Module):  # a unit inside a unit: the inner one is sharded first
        def __init__(self):
            super().__init__()
            self.transformer_blocks = nn.ModuleList([nn.Linear(2, 2)])

    class Own(nn.Module):
        def __init__(self):
            super().__init__()
            self.down_blocks = nn.ModuleList([Inner(), nn.ModuleList([nn.Linear(2, 2)])])
            self.head = nn.Linear(2, 2)

    own = Own()
    units = sharding.units(own)
    inner = own.down_blocks[0]
    assert units.index(inner.transformer_blocks[0]) < units.index(inner) and own.down_blocks[1][0] in units
    own.shard_units = lambda: [own.head]
    assert sharding.units(own) == [own.head]


def test_validate_counts_a_share_of_the_state_and_two_gathered_blocks_a_process_under_fsdp2():
    from diffrelay.config import memory
    from diffrelay.nets.dit import DiT

    state = {"weights": 1000, "gradients": 1000, "optimizer": 2000, "ema": 1001}

    def build():
        return DiT(16, 3, 0, patch=4, depth=3, hidden_size=32, num_heads=2)

    block = sum(p.numel() for p in build().blocks[0].parameters())
    share, gathered = memory.sharded_state(state, 4, build, "fp32")
    assert share == {"weights": 250, "gradients": 250, "optimizer": 500, "ema": 251, "gathered": 2 * block * 4}
    assert memory.sharded_state(state, 4, build, "bf16")[1] == 2 * block * 2  # gathered in the computing dtype
    assert memory.sharded_state(state, 1, build, "fp32")[1] == 0


def test_a_lost_post_hoc_ema_file_is_stored_again_from_the_sharded_checkpoint(runs, tmp_path):
    from diffrelay.training import phema

    run = shutil.copytree(runs / "one/r", tmp_path / "r", ignore=shutil.ignore_patterns("dataset"))
    lost = run / "phema/step_0000004.safetensors"
    want = load_file(lost)
    lost.unlink()
    assert phema.restore(run, 4) == lost
    got = load_file(lost)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_signalled_fsdp2_run_saves_its_shards_and_the_retry_resumes_bit_for_bit(runs):
    """SLURM's requeue path: SIGTERM to the launch agent, every rank writes its shards of a recovery checkpoint, exit 75;
    the retry resumes from it and ends where an uninterrupted run ends, bit for bit."""
    import os
    import signal
    import time

    from conftest import BIN
    from test_faults import start, wait_for_step

    long = {"total_steps": 60, "segment_steps": 60, "phema": {"every": 0}, "log_every": 1}
    for name in ("sig", "straight"):
        write(runs, name, **long)
    train(runs, "straight", 2, 60)
    launch = [BIN / "diffrelay", "launch", "--standalone", "--nproc-per-node", "2", "-m", "diffrelay", "train",
              "--config", runs / "sig.yaml", "--dataset", runs / "dataset"]
    job = start(launch, runs / "sig.log")
    wait_for_step(runs / "sig/r", 5, job)
    os.kill(job.pid, signal.SIGTERM)
    t0 = time.time()
    assert job.wait(timeout=120) == 75, (runs / "sig.log").read_text()[-2000:]
    assert time.time() - t0 < 60
    saved = checkpoint.list_checkpoints(runs / "sig/r/recovery")
    assert saved and 5 <= saved[-1][0] < 60, (runs / "sig.log").read_text()[-2000:]
    checkpoint.verify_checkpoint(saved[-1][1])
    assert len(list(saved[-1][1].glob("shard-*.safetensors"))) == 2
    p = run_cli(*launch[1:])
    assert f"resumed from {saved[-1][1]}" in p.stderr
    a, b = (sharded_checkpoint.read_whole(runs / f"{n}/r" / STEP.format(60)) for n in ("sig", "straight"))
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
