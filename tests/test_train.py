"""Training segments: K segments equal one run, resume on another process count, refuse bad checkpoints."""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import run_cli
from diffrelay import io
from diffrelay.errors import UserError
from diffrelay.training import checkpoint

TRAIN = ["-m", "diffrelay", "train"]


def torchrun(nproc, *args):
    return run_cli("torchrun", "--standalone", f"--nproc-per-node={nproc}", *TRAIN, *args)


def fresh_copy(run, tmp_path, **train):
    """The run's config with results in tmp_path (dataset copied over), train keys overridden."""
    cfg, rd = run
    d = json.loads(cfg.read_text())
    d["run"]["results"] = str(tmp_path)
    d["train"].update(train)
    new = tmp_path / "config.yaml"
    io.write_json(new, d)
    shutil.copytree(rd / "dataset", tmp_path / "r" / "dataset")
    return new


def load_state(ckpt):
    return torch.load(ckpt / "state.pt", weights_only=True)


def assert_tensors_equal(a, b, path="state"):
    """Walk two nested state dicts and compare every tensor bit for bit."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_tensors_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tensors_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a} != {b}"


def assert_two_segments_equal_one_run(tmp_path, base: dict) -> list[float]:
    """Train `base` (4 steps, a config dict without results paths) in one segment and in two, compare every
    tensor of the step-4 checkpoints bit for bit, and return the one-segment run's training losses."""
    states = {}
    for name in ("one", "two"):
        d = json.loads(json.dumps(base))
        d["run"].update(results=str(tmp_path / name), resources=str(tmp_path / "resources"))
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(json.dumps(d))
        run_cli("prepare", "--config", cfg)
        rd = tmp_path / name / d["run"]["name"]
        if name == "one":
            torchrun(1, "--config", cfg, "--until-step", 4)
        else:
            torchrun(1, "--config", cfg, "--until-step", 2)
            torchrun(1, "--config", cfg, "--until-step", 4, "--init", rd / "checkpoints/step_0000002")
        states[name] = load_state(rd / "checkpoints/step_0000004")
    for key in ("net", "ema", "optimizer", "order", "step"):
        assert_tensors_equal(states["one"][key], states["two"][key], key)
    log = tmp_path / "one" / base["run"]["name"] / "metrics/train.jsonl"
    return [json.loads(x)["loss"] for x in log.read_text().splitlines() if '"loss"' in x]


def read_trace(prefix, world):
    """Rebuild each step's global batch from the per-rank traces (rank r took positions r::world)."""
    per_rank = [[json.loads(line) for line in open(f"{prefix}.rank{r}")] for r in range(world)]
    steps = []
    for records in zip(*per_rank):
        total = sum(len(r["indices"]) for r in records)
        batch = [None] * total
        for r, rec in enumerate(records):
            batch[r::world] = rec["indices"]
        steps.append((records[0]["step"], batch))
    return steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted 2-process run of 6 steps, and the same run as two 2-process segments of 3."""
    root = tmp_path_factory.mktemp("train")
    base = {
        "run": {"name": "r", "device": "cpu"},
        "data": {"kind": "shapes", "resolution": 16, "count": 20, "seed": 0},  # 20 images: epochs end mid-batch
        "model": {"channels": 8, "channel_mult": [1, 2], "num_blocks": 1, "class_conditional": True},
        "train": {"total_steps": 6, "segment_steps": 3, "batch_size": 8, "nproc_per_node": 2, "lr": 0.002,
                  "warmup_steps": 2, "log_every": 1, "ema_decays": [0.9, 0.99]},
    }
    out = {}
    for name in ("one", "two"):
        d = json.loads(json.dumps(base))
        d["run"].update(results=str(root / name), resources=str(root / "resources"))
        cfg = root / f"{name}.yaml"
        io.write_json(cfg, d)  # JSON is valid YAML
        run_cli("prepare", "--config", cfg)
        out[name] = (cfg, root / name / "r")
    cfg, rd = out["one"]
    torchrun(2, "--config", cfg, "--until-step", 6, "--trace", root / "one.trace")
    cfg, rd = out["two"]
    torchrun(2, "--config", cfg, "--until-step", 3, "--trace", root / "two.trace")
    torchrun(2, "--config", cfg, "--until-step", 6, "--init", rd / "checkpoints/step_0000003",
             "--trace", root / "two.trace")
    return root, out


def test_two_segments_match_one_run_bitwise(runs):
    root, out = runs
    one = load_state(out["one"][1] / "checkpoints/step_0000006")
    two = load_state(out["two"][1] / "checkpoints/step_0000006")
    for key in ("net", "ema", "optimizer", "schedule", "scaler", "order", "step"):
        assert_tensors_equal(one[key], two[key], key)
    assert read_trace(root / "one.trace", 2) == read_trace(root / "two.trace", 2)


def test_resume_on_fewer_processes_keeps_global_order(runs, tmp_path):
    root, out = runs
    cfg, rd = out["two"]
    d = json.loads(cfg.read_text())
    d["run"]["results"] = str(tmp_path)
    d["train"]["nproc_per_node"] = 1
    cfg1 = tmp_path / "one-proc.yaml"
    io.write_json(cfg1, d)
    shutil.copytree(rd / "dataset", tmp_path / "r" / "dataset")
    run_cli(sys.executable, *TRAIN, "--config", cfg1, "--until-step", 6,
            "--init", rd / "checkpoints/step_0000003", "--trace", tmp_path / "mixed.trace")
    mixed = read_trace(tmp_path / "mixed.trace", 1)
    straight = read_trace(root / "one.trace", 2)
    assert mixed == straight[3:]
    a = load_state(out["one"][1] / "checkpoints/step_0000006")
    b = load_state(tmp_path / "r" / "checkpoints/step_0000006")
    for k in a["net"]:
        torch.testing.assert_close(a["net"][k], b["net"][k], rtol=1e-4, atol=1e-5)
    assert a["order"] == b["order"]


@pytest.mark.parametrize("boundary", [1, 3])
def test_boundary_at_step_one_and_mid_epoch_resume_exactly(runs, tmp_path, boundary):
    # 20 images, batch 8: step 3 starts in the middle of the second epoch.
    root, out = runs
    cfg, rd = out["one"]
    d = json.loads(cfg.read_text())
    d["run"]["results"] = str(tmp_path)
    d["train"].update(nproc_per_node=1, segment_steps=boundary)
    d["model"]["dropout"] = 0.2  # dropout draws must resume exactly too
    c = tmp_path / "c.yaml"
    io.write_json(c, d)
    shutil.copytree(rd / "dataset", tmp_path / "r" / "dataset")
    run_cli(sys.executable, *TRAIN, "--config", c, "--until-step", boundary)
    run_cli(sys.executable, *TRAIN, "--config", c, "--until-step", 5)
    d["run"]["results"] = str(tmp_path / "straight")
    io.write_json(c, d)
    shutil.copytree(rd / "dataset", tmp_path / "straight" / "r" / "dataset")
    run_cli(sys.executable, *TRAIN, "--config", c, "--until-step", 5)
    assert_tensors_equal(load_state(tmp_path / "r/checkpoints/step_0000005"),
                         load_state(tmp_path / "straight/r/checkpoints/step_0000005"))


def test_a_snapshot_holds_every_ema_and_each_samples_its_own_weights(runs, tmp_path):
    """train.ema_decays [0.9, 0.99]: the snapshot keeps both (ema. and ema1.), equal to the checkpoint's; a
    decay picks its EMA, and one the run did not train is one line naming the ones it did."""
    _, out = runs
    rd = out["one"][1]
    state = load_state(rd / "checkpoints/step_0000006")
    snap = rd / "snapshots/step_0000006.safetensors"
    tensors, _ = checkpoint.read_snapshot(snap)
    assert {k.split(".")[0] for k in tensors} == {"ema", "ema1", "raw"}
    for i, decay in enumerate((None, 0.9, 0.99)):
        net, _ = checkpoint.load_snapshot(snap, decay=decay)
        assert_tensors_equal(net.state_dict(), state["ema"][max(i - 1, 0)], f"decay {decay}")
    with pytest.raises(UserError, match=r"sample.ema_decay=0.999 \(--ema-decay\): .* train.ema_decays=\[0.9, 0.99\]"):
        checkpoint.load_snapshot(snap, decay=0.999)
    # One decay: the file holds what it held before every EMA was kept (ema. and raw. only, the same record).
    ema, raw = state["ema"][0], state["net"]
    meta = checkpoint.read_snapshot(snap)[1]
    alone = checkpoint.save_snapshot(tmp_path / "one.safetensors", ema, raw, meta, [])
    tensors, got = checkpoint.read_snapshot(alone)
    assert {k.split(".")[0] for k in tensors} == {"ema", "raw"} and got == meta
    assert_tensors_equal(tensors, {f"ema.{k}": v for k, v in ema.items()} | {f"raw.{k}": v for k, v in raw.items()})
    with pytest.raises(UserError, match="holds only the EMA of the first of train.ema_decays"):
        checkpoint.load_snapshot(alone, decay=0.99)  # a file written before: one line, not a wrong network


def test_snapshot_loads_and_runs_in_a_fresh_process_without_dataset(runs, tmp_path):
    _, out = runs
    snap = tmp_path / "s.safetensors"
    shutil.copy(out["two"][1] / "snapshots/step_0000003.safetensors", snap)
    code = (
        "import sys, torch; from diffrelay.training import checkpoint\n"
        "net, meta = checkpoint.load_snapshot(sys.argv[1])\n"
        "c, h, w = meta['image_shape']\n"
        "y = net(torch.randn(2, c, h, w), torch.ones(2), torch.zeros(2, dtype=torch.long))\n"
        "assert y.shape == (2, c, h, w) and torch.isfinite(y).all(); print(meta['step'])\n")
    p = subprocess.run([sys.executable, "-c", code, str(snap)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "3"


def test_changed_checkpoint_byte_is_refused(runs, tmp_path):
    _, out = runs
    _, rd = out["two"]
    cfg = fresh_copy(out["two"], tmp_path)
    bad = tmp_path / "step_0000003"
    shutil.copytree(rd / "checkpoints/step_0000003", bad)
    blob = bytearray((bad / "state.pt").read_bytes())
    blob[len(blob) // 2] ^= 0x01
    (bad / "state.pt").write_bytes(bytes(blob))
    with pytest.raises(Exception, match="state.pt: sha256 does not match"):
        checkpoint.load_checkpoint(bad)
    p = run_cli("train", "--config", cfg, "--until-step", 6, "--init", bad, check=False)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "state.pt: sha256 does not match" in p.stderr


class _RunsCode:
    def __reduce__(self):
        return (print, ("pwned",))


def test_checkpoint_with_code_running_pickle_is_refused(tmp_path):
    ck = tmp_path / "step_0000001"
    ck.mkdir()
    (ck / "state.pt").write_bytes(pickle.dumps({"net": _RunsCode()}))
    io.write_json(ck / "meta.json", {"step": 1})
    files = {n: io.sha256_file(ck / n) for n in ("state.pt", "meta.json")}
    io.write_json(ck / "manifest.json", {"format": checkpoint.CHECKPOINT_FORMAT, "step": 1, "files": files})
    with pytest.raises(Exception, match="refused by the weights-only loader"):
        checkpoint.load_checkpoint(ck)


def test_half_written_checkpoint_is_not_taken_as_complete(tmp_path):
    ck = tmp_path / "checkpoints" / "step_0000002"
    ck.mkdir(parents=True)
    (ck / "state.pt").write_bytes(b"partial")
    assert not checkpoint.is_complete(ck)
    assert checkpoint.list_checkpoints(tmp_path / "checkpoints") == []


def test_non_finite_steps_save_and_stop_with_an_error(write_config, tmp_path):
    cfg = write_config({"train": {"p_mean": 800.0, "max_skipped_steps": 2, "total_steps": 6}})
    run_cli("prepare", "--config", cfg)
    p = run_cli("train", "--config", cfg, "--until-step", 3, check=False)
    assert p.returncode == 2, p.stderr
    assert "2 consecutive non-finite steps up to step 2" in p.stderr
    assert checkpoint.is_complete(tmp_path / "results/tiny/recovery/step_0000002")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_resumes_its_grad_scaler(write_config, tmp_path, precision):
    cfg = write_config({"train": {"precision": precision, "total_steps": 4, "segment_steps": 2}})
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg, "--until-step", 2)
    p = run_cli("train", "--config", cfg, "--until-step", 4)
    assert "| fp32" not in p.stderr and f"| {precision}" in p.stderr
    state = load_state(tmp_path / "results/tiny/checkpoints/step_0000004")
    assert state["step"] == 4
    # fp16 keeps a live loss scale in the checkpoint; bf16 needs none
    assert bool(state["scaler"]) == (precision == "fp16")


def test_resume_mid_epoch_on_more_processes_with_other_accumulation_keeps_order_and_draws(runs, tmp_path):
    # Steps 0-3 on 1 process with 2 accumulation rounds, steps 3-6 on 2 processes with 1: the same
    # global indices and draws as the uninterrupted 2-process run; only reduction order differs.
    root, out = runs
    cfg = fresh_copy(out["one"], tmp_path, nproc_per_node=1, grad_accum=2)
    run_cli(sys.executable, *TRAIN, "--config", cfg, "--until-step", 3, "--trace", tmp_path / "a.trace")
    d = json.loads(cfg.read_text())
    d["train"].update(nproc_per_node=2, grad_accum=1)
    io.write_json(cfg, d)
    rd = tmp_path / "r"
    torchrun(2, "--config", cfg, "--until-step", 6, "--init", rd / "checkpoints/step_0000003",
             "--trace", tmp_path / "b.trace")
    straight = read_trace(root / "one.trace", 2)
    assert read_trace(tmp_path / "a.trace", 1) + read_trace(tmp_path / "b.trace", 2) == straight
    a = load_state(out["one"][1] / "checkpoints/step_0000006")
    b = load_state(rd / "checkpoints/step_0000006")
    assert a["order"] == b["order"] == {"seed": 0, "consumed": 48}
    for k in a["net"]:
        torch.testing.assert_close(a["net"][k], b["net"][k], rtol=1e-4, atol=1e-5)


HOST_READS = """
import json, sys
from collections import Counter
import torch
from diffrelay import config
from diffrelay.training import train

reads = Counter()

def spy(name):
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if caller.co_filename == train.__file__:
            reads[f"{caller.co_name}:{name}"] += 1
        return original(self, *args, **kwargs)
    setattr(torch.Tensor, name, wrapper)

for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"):
    spy(name)
assert train.run(config.load(sys.argv[1])) == 0
print(json.dumps(reads))
"""


def test_the_loop_reads_device_values_once_a_step_and_the_grad_norm_only_when_logging(write_config):
    # On CUDA each read of a tensor's value waits for the GPU: one per step carries loss, non-finite
    # flag and stop request; the gradient norm waits on the device until a logging step.
    cfg = write_config({"train": {"total_steps": 6, "segment_steps": 6, "log_every": 3}})
    run_cli("prepare", "--config", cfg)
    p = run_cli(sys.executable, "-c", HOST_READS, cfg)
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"_reduce_step:tolist": 6, "_report:__float__": 2}


SYNCS = """
import json, sys, threading
from collections import Counter
import torch
from diffrelay import config
from diffrelay.data import augment
from diffrelay.training import train

seen = Counter()
real_item, real_to_device = torch.Tensor.item, augment.to_device

def item(self, *a, **k):  # .item() in the training thread, torch's own included (GradScaler.step)
    caller = sys._getframe(1).f_code
    if threading.current_thread() is threading.main_thread() and caller.co_filename.endswith(
            ("grad_scaler.py", "train.py", "state.py")):
        seen["item:" + caller.co_name] += 1
    return real_item(self, *a, **k)

def to_device(*a, **k):  # where the augmentation masks cross to the device
    seen["masks:" + threading.current_thread().name] += 1
    return real_to_device(*a, **k)

torch.Tensor.item, augment.to_device = item, to_device
assert train.run(config.load(sys.argv[1])) == 0
print(json.dumps(seen))
"""


def test_fp16_with_augmentation_pays_no_hidden_host_synchronisation(write_config):
    """README promises one synchronisation a step. GradScaler.step reads its found-inf flag with .item()
    (fp16, unfused), and masks copied from pageable memory wait for the device: the masks are made by the
    loader thread instead, and the step is taken without GradScaler.step."""
    cfg = write_config({"train": {"total_steps": 4, "segment_steps": 4, "log_every": 2, "precision": "fp16",
                                  "fused_optimizer": False, "label_dropout": 0.3, "grad_accum": 2},
                        "data": {"xflip": 0.5}})
    run_cli("prepare", "--config", cfg)
    p = run_cli(sys.executable, "-c", SYNCS, cfg)
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    # Only the checkpoint's scaler state reads the scale (once, at the save); no read in any step.
    assert {k for k in seen if k.startswith("item:")} <= {"item:get_scale", "item:_get_growth_tracker"}, seen
    assert seen.get("item:get_scale", 0) <= 1, seen
    assert seen["masks:diffrelay-batches"] == 4 * 2 * 2, seen  # 4 steps x 2 rounds x (drop, flip)
    assert not any(k.startswith("masks:") and k != "masks:diffrelay-batches" for k in seen), seen


def test_deterministic_switch_sets_the_kernels_and_the_cublas_workspace(monkeypatch):
    from diffrelay.runtime import speed

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        speed.set_determinism(torch.device("cuda", 0), True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        speed.set_determinism(torch.device("cuda", 0), False)  # off: cuDNN autotunes the static shapes
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
    finally:
        speed.set_determinism(torch.device("cpu"), False)
    assert not torch.backends.cudnn.benchmark


DDP_OPTIONS = """
import json, os, sys
from diffrelay import config
from diffrelay.training import train
seen = {}
real = train.DDP
def ddp(module, **kwargs):
    seen.update({k: v for k, v in kwargs.items() if k != "device_ids"})
    return real(module, **kwargs)
train.DDP = ddp
assert train.run(config.load(sys.argv[1])) == 0
os.write(1, (json.dumps(seen) + "\\n").encode())  # one write: the two ranks' lines never interleave
"""


def test_deterministic_training_on_the_cpu_is_the_same_run_and_ddp_has_no_extra_copies(write_config, tmp_path):
    """train.deterministic is not part of the run's identity and changes no bit on a CPU; the segment log
    names torch and the device; DDP keeps gradients in its buckets and broadcasts no buffers; one process
    without train.compile builds no DDP wrapper (nothing to all-reduce; its constructor imports torch._dynamo)."""
    base = {"train": {"total_steps": 3, "segment_steps": 3}}
    a = write_config(base, name="a.yaml")
    run_cli("prepare", "--config", a)
    p = run_cli("train", "--config", a)
    assert f"torch {torch.__version__} | device cpu" in p.stderr
    b = write_config({**base, "run": {"name": "det"}, "train": {**base["train"], "deterministic": True}},
                     name="b.yaml")
    run_cli("prepare", "--config", b)
    out = run_cli(sys.executable, "-c", DDP_OPTIONS, b)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}
    assert_tensors_equal(load_state(tmp_path / "results/tiny/checkpoints/step_0000003"),
                         load_state(tmp_path / "results/det/checkpoints/step_0000003"))
    c = write_config({**base, "run": {"name": "two"}}, name="c.yaml")
    run_cli("prepare", "--config", c)
    (tmp_path / "ddp_options.py").write_text(DDP_OPTIONS)
    out = run_cli("torchrun", "--standalone", "--nproc-per-node", 2, tmp_path / "ddp_options.py", c)
    ranks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2 and ranks[0] == ranks[1], out.stdout
    options = ranks[0]
    assert options.pop("gradient_as_bucket_view") is True
    assert options in ({"forward_sync_buffers": False}, {"broadcast_buffers": False})  # torch 2.14 renamed it
    assert "Warning" not in out.stderr
