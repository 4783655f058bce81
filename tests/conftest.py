"""Shared test helpers: tiny configs written to a temp folder, the venv's executables on PATH."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Stages run as subprocesses (`diffrelay`, `torchrun`, `snakemake`) must come from the same venv.
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"

TINY = {
    "run": {"name": "tiny", "seed": 0, "device": "cpu"},
    "data": {"kind": "shapes", "resolution": 16, "count": 96, "seed": 0},
    "model": {"channels": 8, "channel_mult": [1, 2], "num_blocks": 1, "class_conditional": True},
    "train": {"total_steps": 6, "segment_steps": 3, "batch_size": 8, "lr": 0.002, "warmup_steps": 2,
              "log_every": 1},
    "sample": {"num_images": 8, "steps": 3, "batch_size": 8},
    "fid": {"extractor": "random", "batch_size": 16},
}


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
def write_config(tmp_path):
    """write_config({...overrides}) -> path of a tiny config whose results/resources live in tmp_path."""

    def write(overrides: dict | None = None, name: str = "config.yaml") -> Path:
        d = deep_merge(TINY, {"run": {"results": str(tmp_path / "results"), "resources": str(tmp_path / "resources")}})
        d = deep_merge(d, overrides or {})
        path = tmp_path / name
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        return path

    return write


def run_cli(*args, env=None, check=True, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    """Run `diffrelay ...` (or any command when args[0] is an executable name) and capture its output."""
    cmd = list(map(str, args))
    if cmd[0] not in ("torchrun", "snakemake", "python", sys.executable):
        cmd = [str(BIN / "diffrelay"), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p
