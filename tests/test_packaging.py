"""The conda env for `--sdm conda` mirrors pyproject.toml's dependency ranges."""

import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# conda-forge names of the pip packages that are spelled differently there
CONDA_NAME = {"torch": "pytorch", "matplotlib": "matplotlib-base"}
# Snakemake and its plugin run outside the job env; clean-fid comes through pip
NOT_IN_ENV = {"snakemake", "snakemake-executor-plugin-slurm"}


def split(req: str) -> tuple[str, str]:
    name, spec = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(.*)$", req.split("#")[0]).groups()
    return name.lower(), spec.replace(" ", "")


@pytest.mark.parametrize("env_file, extras", [("diffrelay.yaml", ("quantize",)), ("track.yaml", ("wandb", "mlflow"))])
def test_conda_env_mirrors_pyproject_ranges(env_file, extras):
    """Every dependency, at pyproject's range; the track env (pip -e installs diffrelay's declared dependencies
    there too) also holds its extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]
    env = yaml.safe_load((REPO / "envs" / env_file).read_text())["dependencies"]
    conda = dict(split(d) for d in env if isinstance(d, str) and d != "pip")
    pip = dict(split(d) for d in next(d["pip"] for d in env if isinstance(d, dict)) if not d.startswith("-e"))
    for name, spec in map(split, deps):
        if name in NOT_IN_ENV:
            continue
        have = conda.get(CONDA_NAME.get(name, name), pip.get(name))
        assert have == spec, f"{name}: pyproject {spec!r}, envs/{env_file} {have!r}"


def test_the_torch_range_admits_only_versions_with_the_apis_diffrelay_uses():
    """runtime/speed.py sets torch.backends.*.fp32_precision, which exists from torch 2.9 on: a range that
    allowed older versions would install a torch that fails at the first training step."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = dict(split(d) for d in deps)["torch"]
    low = re.search(r">=(\d+)\.(\d+)", spec).groups()
    assert tuple(map(int, low)) >= (2, 9), spec
    import torch

    assert hasattr(torch.backends.cudnn.conv, "fp32_precision") and hasattr(torch.backends.cuda.matmul,
                                                                            "fp32_precision")
