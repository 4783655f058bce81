"""Batch loading: draws independent of the split, read-ahead that never counts untrained batches, clean stops."""

import json
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from conftest import BIN, run_cli
from test_train import assert_tensors_equal
from diffrelay import io, logs
from diffrelay.data import datasets, loader
from diffrelay.training import checkpoint
from diffrelay.errors import UserError
from diffrelay.data.loader import DEPTH, BatchMaker, Prefetcher
from diffrelay.data.order import DataOrder


def write_prepared(folder, n, res=4, classes=3):
    """A prepared dataset folder in open_prepared's format, with random pixels."""
    folder.mkdir(parents=True)
    images = np.lib.format.open_memmap(folder / "images.npy", mode="w+", dtype=np.uint8, shape=(n, res, res, 3))
    images[:] = np.random.default_rng(0).integers(0, 256, images.shape, dtype=np.uint8)
    images.flush()
    del images
    np.save(folder / "labels.npy", np.arange(n, dtype=np.int64) % classes)
    io.write_json(folder / "dataset.json", {"format": datasets.FORMAT, "count": n, "resolution": res,
                                            "num_classes": classes, "class_names": [str(c) for c in range(classes)],
                                            "fingerprint": "test"})
    return datasets.open_prepared(folder)


def global_rows(data, world, accum, steps=4, batch=8, seed=0):
    """Each step's (images, labels, rnd, noise) as the global batch, rebuilt from every rank's rounds."""
    order = DataOrder(seed, data.count, batch)
    makers = [BatchMaker(data, seed, batch, rank=r, world=world, grad_accum=accum, device="cpu")
              for r in range(world)]
    out = []
    for step in range(steps):
        indices = order.next_batch()[0]
        per_rank = [m.make(step, indices) for m in makers]
        assert all(len(b.rounds) == accum for b in per_rank)
        rebuilt = []
        for field in range(4):
            parts = [torch.cat([rnd[field] for rnd in b.rounds]) for b in per_rank]
            whole = torch.empty((batch, *parts[0].shape[1:]), dtype=parts[0].dtype)
            for r, p in enumerate(parts):
                whole[r::world] = p
            rebuilt.append(whole)
        out.append((indices, rebuilt))
    return out


def test_draws_and_rows_do_not_depend_on_process_count_or_accumulation(tmp_path):
    data = write_prepared(tmp_path / "d", n=20)  # 20 images, batch 8: step 2 crosses an epoch boundary
    reference = global_rows(data, world=1, accum=1)
    for world, accum in ((2, 1), (1, 2), (2, 2), (4, 2)):
        for (idx_a, a), (idx_b, b) in zip(reference, global_rows(data, world, accum)):
            assert np.array_equal(idx_a, idx_b)
            for x, y in zip(a, b):
                assert torch.equal(x, y), (world, accum)
    for indices, (images, labels, rnd, noise) in reference:
        expected = torch.from_numpy(data.images[indices]).permute(0, 3, 1, 2).float() / 127.5 - 1
        assert torch.equal(images, expected) and torch.equal(labels, torch.from_numpy(data.labels[indices]))
        assert rnd.shape == (8,) and noise.shape == (8, 3, 4, 4)
    assert not torch.equal(reference[0][1][3], reference[1][1][3])  # a new draw every step


class Counting:
    """A BatchMaker that records which steps it was asked for."""

    def __init__(self, maker):
        self.maker, self.device, self.made = maker, maker.device, []

    def make(self, step, indices):
        self.made.append(step)
        return self.maker.make(step, indices)


def test_read_ahead_never_counts_untrained_batches_and_resumes_exactly(tmp_path):
    data = write_prepared(tmp_path / "d", n=20)
    maker = BatchMaker(data, 0, 8, rank=0, world=1, grad_accum=1, device="cpu")
    plain = DataOrder(0, 20, 8)
    straight = [maker.make(s, plain.next_batch()[0]) for s in range(10)]

    order, counting = DataOrder(0, 20, 8), Counting(maker)
    with Prefetcher(counting, order, 0, 10) as batches:
        taken = [batches.next() for _ in range(3)]
        deadline = time.time() + 30
        while len(counting.made) < 3 + DEPTH and time.time() < deadline:
            time.sleep(0.01)
        assert len(counting.made) >= 3 + DEPTH  # the thread is ahead of the loop...
        assert order.state_dict() == {"seed": 0, "consumed": 24}  # ...and the state counts only 3 batches
    assert "diffrelay-batches" not in [t.name for t in threading.enumerate()]

    resumed = DataOrder(0, 20, 8)
    resumed.load_state_dict(order.state_dict())  # mid-epoch: position 24 of 20-image epochs
    with Prefetcher(maker, resumed, 3, 10) as batches:
        taken += [batches.next() for _ in range(7)]
        with pytest.raises(RuntimeError, match="no batch after step 10"):
            batches.next()
    assert resumed.consumed == 80
    for a, b in zip(straight, taken):
        assert a.step == b.step and np.array_equal(a.indices, b.indices)
        for x, y in zip(a.rounds[0], b.rounds[0]):
            assert torch.equal(x, y)


def test_a_failed_read_reaches_the_loop_and_the_thread_ends(tmp_path, monkeypatch):
    data = write_prepared(tmp_path / "d", n=20)
    calls, read = [], loader.read_rows

    def failing_third_read(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return read(*args, **kw)

    monkeypatch.setattr(loader, "read_rows", failing_third_read)
    order = DataOrder(0, 20, 8)
    with pytest.raises(OSError, match="Input/output error"):
        with Prefetcher(BatchMaker(data, 0, 8, rank=0, world=1, grad_accum=1, device="cpu"), order, 0, 10) as b:
            for _ in range(10):
                b.next()
    assert order.consumed == 16  # two batches were handed over before the failure
    assert "diffrelay-batches" not in [t.name for t in threading.enumerate()]


# ---------------------------------------------------------------- whole segments

SPY = """
import json, os, sys, threading
from pathlib import Path
from diffrelay import config
from diffrelay.data import loader
from diffrelay.training import train
from diffrelay.errors import UserError

during, take = [], loader.Prefetcher.next
def spy(self):
    during.append(sorted(t.name for t in threading.enumerate()))
    return take(self)
loader.Prefetcher.next = spy
before = sorted(t.name for t in threading.enumerate())
try:
    code = train.run(config.load(sys.argv[1]), until_step=int(sys.argv[2]))
except UserError as e:
    code = str(e)
def ppid(p):
    try:
        return int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):  # another test's process ended while /proc was listed
        return None
children = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and ppid(p) == os.getpid()]
print(json.dumps({"code": code, "before": before, "during": during[0], "after": sorted(t.name for t in
                  threading.enumerate()), "children": children}))
"""


@pytest.mark.parametrize("end", ["segment end", "signal", "error"])
def test_no_thread_or_process_is_left_when_a_segment_ends_stops_or_fails(write_config, tmp_path, end):
    over = {"train": {"total_steps": 400, "segment_steps": 400, "log_every": 1}}
    if end == "error":
        over["train"].update(p_mean=800.0, max_skipped_steps=2)  # non-finite steps: a UserError at step 2
    cfg = write_config(over)
    run_cli("prepare", "--config", cfg)
    until = 3 if end == "segment end" else 400
    job = subprocess.Popen([sys.executable, "-c", SPY, str(cfg), str(until)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    if end == "signal":
        run_dir = tmp_path / "results" / "tiny"
        deadline = time.time() + 120
        while not any(r.get("step", 0) >= 2 for r in logs.read_jsonl(run_dir / "metrics" / "train.jsonl")):
            assert job.poll() is None and time.time() < deadline, "no step 2"
            time.sleep(0.1)
        job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    expected = {"segment end": 0, "signal": 75}.get(end, result["code"])
    assert result["code"] == expected
    if end == "error":
        assert "consecutive non-finite steps" in result["code"]
    assert "diffrelay-batches" in result["during"]  # the batch thread ran...
    assert result["after"] == result["before"] and result["children"] == []  # ...and nothing outlives the segment


def test_sigkill_while_reading_ahead_then_resume_is_bitwise_the_same(write_config, tmp_path):
    long = {"train": {"total_steps": 120, "segment_steps": 120, "log_every": 1, "recovery_every": 4,
                      "keep_recovery": 10}}
    cfg = write_config(long)
    run_cli("prepare", "--config", cfg)
    run_dir = tmp_path / "results" / "tiny"
    job = subprocess.Popen([BIN / "diffrelay", "train", "--config", cfg], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 14 for r in logs.read_jsonl(run_dir / "metrics" / "train.jsonl")):
        assert job.poll() is None and time.time() < deadline, "killed too late or never reached step 14"
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)  # the batch thread is always DEPTH batches ahead of the loop here
    job.wait()
    saved = checkpoint.list_checkpoints(run_dir / "recovery")
    assert saved and not checkpoint.is_complete(run_dir / "checkpoints" / "step_0000120")
    for step, path in saved:  # no recovery checkpoint counts a batch that was read ahead but not trained
        assert torch.load(path / "state.pt", weights_only=True)["order"]["consumed"] == step * 8
    run_cli("train", "--config", cfg)

    straight = write_config({**long, "run": {"name": "straight"}}, name="straight.yaml")
    run_cli("prepare", "--config", straight)
    run_cli("train", "--config", straight)
    a = torch.load(run_dir / "checkpoints/step_0000120/state.pt", weights_only=True)
    b = torch.load(tmp_path / "results/straight/checkpoints/step_0000120/state.pt", weights_only=True)
    assert_tensors_equal(a, b)  # weights, EMA, optimizer, schedule, order: bit for bit
    assert a["order"] == {"seed": 0, "consumed": 120 * 8}


def test_checkpoint_from_the_per_sample_draws_is_refused_with_one_line(write_config, tmp_path):
    cfg = write_config()
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg, "--until-step", 1)
    old = tmp_path / "results/tiny/checkpoints/step_0000001"
    meta = io.read_json(old / "meta.json")
    del meta["draws"]  # what every checkpoint written before the per-step draws looks like
    io.write_json(old / "meta.json", meta)
    manifest = io.read_json(old / "manifest.json")
    manifest["files"]["meta.json"] = io.sha256_file(old / "meta.json")
    io.write_json(old / "manifest.json", manifest)
    p = run_cli("train", "--config", cfg, "--until-step", 2, check=False)
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"diffrelay: error: {old}: ") and "draws version 1, this one 2" in line
    assert "start a new run" in line
    assert not (tmp_path / "results/tiny/checkpoints/step_0000002").exists()


def test_images_truncated_under_the_mapping_are_one_line_not_a_bus_error(write_config, tmp_path):
    """Reading past the end of a truncated memory-mapped file is SIGBUS ("Bus error", no file named). Each
    batch checks the file first: the run stops with one line naming it."""
    data = write_prepared(tmp_path / "d", 64)
    loader.read_rows(data, np.arange(8))
    with open(tmp_path / "d" / "images.npy", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(UserError, match=r"images.npy: 1000 bytes, \d+ expected: the file was truncated"):
        loader.read_rows(data, np.arange(8))
    # In a training run: truncated after step 5, the segment ends with that line and status 2.
    cfg = write_config({"train": {"total_steps": 400, "segment_steps": 400, "log_every": 1}})
    run_cli("prepare", "--config", cfg)
    run_dir = tmp_path / "results" / "tiny"
    job = subprocess.Popen([BIN / "diffrelay", "train", "--config", cfg], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 5 for r in logs.read_jsonl(run_dir / "metrics" / "train.jsonl")):
        assert job.poll() is None and time.time() < deadline, "never reached step 5"
        time.sleep(0.05)
    with open(run_dir / "dataset" / "images.npy", "r+b") as f:
        f.truncate(4096)
    err = job.communicate(timeout=120)[1]
    assert job.returncode == 2, (job.returncode, err[-2000:])
    assert "images.npy: 4096 bytes" in err and "Traceback" not in err, err[-2000:]
