"""A work folder a live process uses is never moved aside or emptied by another run (issue 38, item 1).

A second `diffrelay sample` with other settings into the same --out used to delete a running sampler's work
folder; a second `prepare` with other inputs would delete a running one's chunks. Each stage now claims its
work folder for its whole life (runtime/claims.py); only an unclaimed folder, one a killed run left, goes.
"""

import fcntl
import json
import logging
import os
import subprocess
import sys

import pytest
import yaml

from diffrelay import cli, logs
from diffrelay.errors import UserError
from diffrelay.sampling import folder, sample
from test_sample import make_snapshot, settings

BUSY = "another run is sampling into it with other settings"


@pytest.fixture(autouse=True)
def _quiet_logger():
    yield
    logging.getLogger(logs.LOGGER).handlers.clear()


def _lock(path, how=fcntl.LOCK_SH):
    """A lock as another live process holds it (its own open file: flock locks of two opens conflict)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, how | fcntl.LOCK_NB)
    return fd


def _work_of_a_live_sampler(out, key):
    work = folder.work_dir(out)
    work.mkdir(parents=True)
    (work / "settings.json").write_text(json.dumps(key))
    (work / "000000.png").write_bytes(b"an image the live run made")
    return work, _lock(work / "settings.json")


def test_a_sampler_claims_its_work_folder_for_as_long_as_it_runs(tmp_path):
    out = tmp_path / "out"
    work = folder.work_dir(out)
    assert folder.open_work(work, out, {"steps": 3}, 0)
    (work / "000000.png").write_bytes(b"image 0")
    # Another process (here another open of the file) cannot take it exclusively: a run with other settings is
    # refused, in another process as the issue saw it.
    fd = os.open(work / "settings.json", os.O_RDONLY)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    code = ("import sys; from pathlib import Path; from diffrelay.sampling import folder\n"
            "from diffrelay.errors import UserError\n"
            f"out = Path({str(out)!r})\n"
            "try:\n    folder.open_work(folder.work_dir(out), out, {'steps': 4}, 0)\n"
            "except UserError as e:\n    sys.exit(str(e))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and BUSY in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert (work / "000000.png").read_bytes() == b"image 0"
    assert json.loads((work / "settings.json").read_text()) == {"steps": 3}


def test_a_second_sample_with_other_settings_is_refused_and_deletes_nothing(tmp_path):
    snap = make_snapshot(tmp_path / "snap.safetensors")
    out = tmp_path / "out"
    work, fd = _work_of_a_live_sampler(out, {"steps": 99})
    try:
        with pytest.raises(UserError, match=f"{out}: {BUSY}; wait for it to finish or give another --out"):
            sample.run(snap, out, settings(num_images=2, steps=2))
        assert (work / "000000.png").read_bytes() == b"an image the live run made"
        assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial", "snap.safetensors"]
    finally:
        os.close(fd)
    # The run ended (its lock with it): its folder is now one a killed run left, and goes.
    m = sample.run(snap, out, settings(num_images=2, steps=2))
    assert m["num_images"] == 2 and not work.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "snap.safetensors"]


def test_a_folder_being_finalized_is_not_cleared(tmp_path):
    """A finalizer removes settings.json just before it renames the folder; it holds the folder itself then."""
    out = tmp_path / "out"
    work = folder.work_dir(out)
    work.mkdir()
    (work / "000000.png").write_bytes(b"image 0")
    fd = _lock(work, fcntl.LOCK_EX)
    try:
        with pytest.raises(UserError, match=BUSY):
            folder.open_work(work, out, {"steps": 4}, 0)
    finally:
        os.close(fd)
    assert (work / "000000.png").exists()


ENCODER = """
import torch


class Pool:
    channels, factor, scale, bias = 3, 2, [1.0] * 3, [0.0] * 3

    def __init__(self, path):
        pass

    def encode(self, images):
        x = torch.nn.functional.avg_pool2d(images.float() / 127.5 - 1, 2)
        return x, torch.full_like(x, 0.05)

    def decode(self, latents):
        return torch.zeros(len(latents), 3, 16, 16, dtype=torch.uint8)
"""


def test_a_second_prepare_is_refused_while_one_encodes_and_its_chunks_stay(tmp_path, monkeypatch, capsys):
    (tmp_path / "claims_pool.py").write_text(ENCODER)
    monkeypatch.syspath_prepend(str(tmp_path))
    d = {"run": {"name": "lat", "device": "cpu", "results": str(tmp_path / "results"),
                 "resources": str(tmp_path / "resources")},
         "data": {"kind": "shapes", "resolution": 16, "count": 8, "encoder": "claims_pool:Pool"},
         "model": {"channels": 8, "channel_mult": [1, 2], "num_blocks": 1}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(d))
    work = tmp_path / "results" / "lat" / ".dataset.encoding"
    work.mkdir(parents=True)
    (work / "plan.json").write_text("{}")  # another plan: write_plan would delete the chunk below
    (work / "chunk_000000.safetensors").write_bytes(b"a chunk the live prepare wrote")
    fd = _lock(work, fcntl.LOCK_EX)
    try:
        assert cli.main(["prepare", "--config", str(tmp_path / "cfg.yaml")]) == 2
    finally:
        os.close(fd)
    err = capsys.readouterr().err.strip()
    assert "another `diffrelay prepare` is making it" in err and str(work) in err and "\n" not in err, err
    assert (work / "chunk_000000.safetensors").read_bytes() == b"a chunk the live prepare wrote"
    assert not (tmp_path / "results" / "lat" / "dataset").exists()
