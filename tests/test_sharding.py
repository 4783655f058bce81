"""train.sharding: fsdp2 on the CPU (gloo, 2 processes): K segments equal one run bit for bit, fsdp2 equals ddp
within rounding, a checkpoint of 2 processes resumes on 1, and a sharded checkpoint that lost, gained or swapped a
shard, or was written with the other sharding, is refused in one line; a failed write of a sharded save (a full disk,
no inodes) is one line on every rank and keeps the last checkpoint, a shard's own header ties it to its run, step and
save, and what killed saves left is removed."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

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


# ---- Faults of a sharded save and load: one line each, the last good checkpoint kept -----------------------------


@pytest.fixture
def group():
    """A process group of one in this process, as plain `python` trains: a sharded save and load without torchrun."""
    from diffrelay.runtime import distributed

    distributed.init(torch.device("cpu"))
    yield
    distributed.teardown()


def small(path, step=1, trajectory="t", value=1.0):
    return sharded_checkpoint.save(path, {"w": torch.full((2, 3), value), "b": torch.arange(2.0)}, {"n": step},
                                   {"step": step, "trajectory": trajectory}, checkpoint.CHECKPOINT_FORMAT,
                                   checkpoint.is_checkpoint_folder)


def no_space(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("stage", ["folder", "shard", "state.pt", "meta.json", "manifest.json", "rename"])
def test_every_write_of_a_sharded_save_that_fails_is_one_line_and_keeps_the_last_checkpoint(group, tmp_path,
                                                                                              monkeypatch, stage):
    """A full disk (or no inodes left) wherever the save writes: one line naming the file, the earlier checkpoint
    byte for byte as it was, nothing left of the failed save; with space again, the save is whole."""
    import builtins

    good = small(tmp_path / "step_0000001")
    before = {f.name: f.read_bytes() for f in good.iterdir()}
    real_open, real_path_open, real_mkdir, real_replace = builtins.open, Path.open, Path.mkdir, os.replace
    hit = (lambda name: sharded_checkpoint.is_shard(name)) if stage == "shard" else (lambda name: name == stage)

    def half_written(opener):  # the file is made and part written, then the disk is full
        def fake(file, mode="r", *a, **k):
            f = opener(file, mode, *a, **k)
            if "w" in mode and hit(Path(file).name):
                f.write(b"half")
                f.close()
                raise no_space(file)
            return f
        return fake

    def mkdir(self, *a, **k):
        if stage == "folder" and self.name.endswith(".sharded.tmp"):
            raise no_space(self)
        return real_mkdir(self, *a, **k)

    def replace(src, dst):
        if stage == "rename" and str(src).endswith(".sharded.tmp"):
            raise no_space(src)
        return real_replace(src, dst)

    monkeypatch.setattr(builtins, "open", half_written(real_open))
    monkeypatch.setattr(Path, "open", half_written(real_path_open))
    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(os, "replace", replace)
    msg = one_line(lambda: small(tmp_path / "step_0000002", step=2, value=2.0))
    assert "No space left on device" in msg and "step_0000002" in msg, msg
    assert "the previous checkpoint, if any, is unchanged" in msg and "Frame" not in msg, msg
    where = {"folder": ".step_0000002.sharded.tmp", "shard": ".sharded.tmp/shard-00001-model-00001-of-00001",
             "rename": ".step_0000002.sharded.tmp"}.get(stage, f".step_0000002.sharded.tmp/{stage}")
    assert where in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["step_0000001"]  # the failed save's folder is gone
    assert {f.name: f.read_bytes() for f in good.iterdir()} == before
    checkpoint.verify_checkpoint(good)
    monkeypatch.undo()  # space again
    again = small(tmp_path / "step_0000002", step=2, value=2.0)
    assert checkpoint.load_checkpoint(again) == ({"n": 2}, {"step": 2, "trajectory": "t"})
    assert torch.equal(sharded_checkpoint.read_whole(again)["w"], torch.full((2, 3), 2.0))


def rehash(folder, name):
    """Write a changed file's sha256 into the manifest, as someone hiding the change would."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = io.sha256_file(folder / name)
    io.write_json(folder / "manifest.json", manifest)


SHARD1, SHARD2 = (f"shard-0000{i}-model-00001-of-00001.safetensors" for i in (1, 2))


def test_a_shard_of_another_step_or_save_is_refused_even_with_its_sha256_in_the_manifest(runs, tmp_path):
    """Each shard's header names the trajectory, step and save it was written for; the manifest can be edited, the
    shard's own header not without making it another file."""
    good = runs / "two/r" / STEP.format(4)
    step2 = shutil.copytree(good, tmp_path / "step2")
    shutil.copy(runs / "two/r" / STEP.format(2) / SHARD2, step2)
    rehash(step2, SHARD2)
    msg = one_line(lambda: checkpoint.load_checkpoint(step2))
    assert f"{step2 / SHARD2}: a shard of another run or step" in msg and "step 2" in msg, msg
    other = shutil.copytree(good, tmp_path / "other")  # the same run and step, saved by another process count
    shutil.copy(runs / "re1/r" / STEP.format(4) / SHARD1, other)
    rehash(other, SHARD1)
    assert f"{other / SHARD1}: a shard of another save of step 4" in one_line(lambda: checkpoint.load_checkpoint(other))


def test_a_shard_of_another_run_without_its_record_or_with_a_broken_header_is_refused_in_one_line(group, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    a, b = small(tmp_path / "a", trajectory="aaaa"), small(tmp_path / "b", trajectory="bbbb")
    shutil.copy(b / SHARD1, a)
    rehash(a, SHARD1)
    msg = one_line(lambda: checkpoint.load_checkpoint(a))
    assert f"{a / SHARD1}: a shard of another run or step" in msg and "trajectory bbbb" in msg, msg
    bare = small(tmp_path / "bare")  # as written before shards carried a record
    with safe_open(str(bare / SHARD1), framework="pt") as f:
        tensors, extra = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, bare / SHARD1, metadata={k: v for k, v in extra.items() if k != sharded_checkpoint.RECORD})
    rehash(bare, SHARD1)
    assert f"{bare / SHARD1}: its header holds no record" in one_line(lambda: checkpoint.load_checkpoint(bare))
    manifest = json.loads((bare / "manifest.json").read_text())  # a checkpoint saved before records existed
    del manifest["sharding"]["save"]
    io.write_json(bare / "manifest.json", manifest)
    checkpoint.verify_checkpoint(bare)  # still resumes, by its sha256 alone
    broken = small(tmp_path / "broken")
    data = bytearray((broken / SHARD1).read_bytes())
    data[8:12] = b"XXXX"
    (broken / SHARD1).write_bytes(bytes(data))
    rehash(broken, SHARD1)
    msg = one_line(lambda: checkpoint.load_checkpoint(broken))
    assert f"{broken / SHARD1}: not a readable shard (SafetensorError: " in msg and "invalid JSON" in msg, msg


def test_an_invalid_shard_header_is_skipped_by_the_resume_search_and_dcp_says_it_in_one_line(runs, tmp_path, group,
                                                                                            capfd):
    """As a ddp checkpoint that fails its sha256: the resume search warns and takes the earlier checkpoint. Loaded
    anyway, DCP's own failure is one line in its own words: no repr of stack frames, no traceback logged."""
    from diffrelay.training import train as train_module

    run = tmp_path / "r"
    shutil.copytree(runs / "two/r/checkpoints", run / "checkpoints")
    bad = run / STEP.format(4)
    data = bytearray((bad / SHARD2).read_bytes())
    data[8:12] = b"XXXX"
    (bad / SHARD2).write_bytes(bytes(data))
    rehash(bad, SHARD2)
    warned = []

    class Log:
        warning = warned.append

    traj = json.loads((bad / "meta.json").read_text())["trajectory"]
    step, path, _, _ = train_module._find_start(run, 4, None, traj, Log)
    assert (step, path) == (2, run / STEP.format(2))
    assert len(warned) == 1 and f"{bad / SHARD2}: not a readable shard" in warned[0], warned
    template = {k: torch.zeros_like(v) for k, v in sharded_checkpoint.read_whole(runs / "two/r" / STEP.format(4)).items()}
    capfd.readouterr()
    msg = one_line(lambda: sharded_checkpoint.load(bad, template))
    assert "invalid JSON in header" in msg and "Frame" not in msg and "Traceback" not in msg, msg
    assert "Traceback" not in capfd.readouterr().err


def test_what_killed_saves_left_is_removed_by_the_next_save_and_nothing_else(group, tmp_path):
    """A killed save's folder written aside is replaced only when its step is saved again, which may never come
    (recovery_every changed): the run's next save removes those of both its checkpoint folders, if they hold only
    checkpoint files."""
    run = tmp_path / "r"
    stale = [run / "recovery/.step_0000030.sharded.tmp", run / "checkpoints/.step_0000010.sharded.tmp",
             run / "recovery/.step_0000005.ab_cd123.tmp"]  # the last: io.atomic_dir's, of a ddp save
    for folder in stale:
        folder.mkdir(parents=True)
        (folder / ("state.pt" if "ab_cd" in folder.name else SHARD1)).write_bytes(b"half")
    kept = [run / "recovery/.step_0000040.sharded.tmp", run / "checkpoints/.step_0000050.sharded.tmp", run / "mine"]
    for folder in kept:
        folder.mkdir(parents=True)
        (folder / "notes.txt").write_text("mine")
    small(run / "checkpoints/step_0000020", step=20)
    assert [f for f in stale if f.exists()] == [] and all((f / "notes.txt").exists() for f in kept)
    again = run / "checkpoints/.step_0000011.abcdefgh.tmp"
    again.mkdir()
    (again / "meta.json").write_text("{}")
    checkpoint.save_checkpoint(run / "checkpoints/step_0000021", {"w": torch.ones(1)}, {"step": 21})  # ddp's save
    assert not again.exists() and all((f / "notes.txt").exists() for f in kept)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tiny tmpfs")
def test_no_inode_left_for_rank_0s_state_pt_is_one_line_on_both_ranks_and_keeps_the_last_checkpoint(runs, tmp_path):
    """fsdp2 on 2 processes, the two-segment run's second segment on a tmpfs with inodes for everything up to the
    shards: rank 0 alone fails (state.pt), and both ranks say the same one line instead of a traceback and a rank
    waiting in a barrier. The step-2 checkpoint is untouched and nothing of the failed save is left."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=1000", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        run = shutil.copytree(runs / "two/r", mnt / "r")
        for f in (STEP.format(4), "snapshots/step_0000004.safetensors", "phema/step_0000004.safetensors"):
            shutil.rmtree(run / f) if (run / f).is_dir() else (run / f).unlink()
        before = {f.name: f.read_bytes() for f in (run / STEP.format(2)).iterdir()}
        d = json.loads((runs / "two.yaml").read_text())
        d["run"]["results"] = str(mnt)
        io.write_json(tmp_path / "full.yaml", d)
        stat = os.statvfs(mnt)
        # The segment's new files: its snapshot and post-hoc EMA file, the save's folder and its 2 shards; not state.pt.
        remount = ["mount", "-o", f"remount,nr_inodes={stat.f_files - stat.f_ffree + 5}", str(mnt)]
        assert subprocess.run(remount).returncode == 0
        launch = ["launch", "--standalone", "--nproc-per-node", "2", "-m", "diffrelay", "train", "--config",
                  tmp_path / "full.yaml", "--until-step", 4, "--dataset", runs / "dataset"]
        p = run_cli(*launch, check=False)
        errors = [line for line in p.stderr.splitlines() if line.startswith("diffrelay: error: ")]
        said = f"diffrelay: error: {run / 'checkpoints/.step_0000004.sharded.tmp/state.pt'}: write failed (No space " \
               f"left on device); {run / STEP.format(4)} was not saved and the previous checkpoint, if any, is unchanged"
        # Rank 1 says the same line, unless the agent's SIGTERM (sent once rank 0 has exited) comes first.
        assert p.returncode == 1 and "rank 0 exit 2" in p.stderr, p.stderr[-3000:]
        assert errors and all(e.startswith(said) for e in errors) and errors[0] == errors[-1], p.stderr[-3000:]
        assert "Traceback" not in p.stderr and "another rank died" not in p.stderr, p.stderr[-3000:]
        assert sorted(os.listdir(run / "checkpoints")) == ["step_0000002"]
        # What a rerun resumes from is the step-2 checkpoint as it was: the fixture's "two" run resumes from it to
        # step 4 and ends where "one" does, bit for bit (the first test); not rerun here, for CI's time.
        assert {f.name: f.read_bytes() for f in (run / STEP.format(2)).iterdir()} == before
        checkpoint.verify_checkpoint(run / STEP.format(2))
    finally:
        subprocess.run(["umount", str(mnt)])
