"""Shared test helpers: tiny configs written to a temp folder, the venv's executables on PATH."""

import collections
import json
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


def benchmark(name: str):
    """benchmarks/checks/<name>.py (a check against the papers' code) or else benchmarks/<name>.py, imported as a
    module (its folder first on sys.path, for its own imports: official.py, another check)."""
    import importlib.util

    folder = REPO / "benchmarks" / "checks"
    folder = folder if (folder / f"{name}.py").exists() else REPO / "benchmarks"
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(*args, env=None, check=True, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    """Run `diffrelay ...` (or any command when args[0] is an executable name) and capture its output."""
    cmd = list(map(str, args))
    if cmd[0] not in ("torchrun", "snakemake", "python", sys.executable):
        cmd = [str(BIN / "diffrelay"), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def small_inception(path: Path, seed: int = 0) -> Path:
    """A TorchScript file laid out as clean-fid's inception-2015-12-05.pt (the tests' small extractor): a
    `layers` trunk with conv ... mixed_6 (whose `conv` branch ADM's sFID reads at 17 x 17) ... pool2 giving
    2048 pool features, an `output` classifier of 1008 classes, and forward(img, return_features,
    use_fp16, no_output_bias) that first resizes like TF1 (source pixel j * in / 299, edges clamped)."""
    import warnings
    from collections import OrderedDict

    import torch
    from torch import nn
    from torch.nn import functional as F

    def conv(cin, cout, k=3, stride=2):
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride), nn.ReLU())

    class Mixed(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = conv(c, 8, 1, 1)
            self.tower = nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.ReLU())

        def forward(self, x):
            return torch.cat([self.conv(x), self.tower(x)], 1)

    class SmallInception(nn.Module):
        def __init__(self):
            super().__init__()
            # 299 -> 149 -> 74 -> 36 -> 17: four valid 3x3 convolutions of stride 2
            self.layers = nn.Sequential(OrderedDict(
                conv=conv(3, 8), conv_1=conv(8, 8), conv_2=conv(8, 16), conv_3=conv(16, 16), mixed_6=Mixed(16),
                mixed_7=conv(16, 2048, 1, 1), pool2=nn.AdaptiveAvgPool2d(1)))
            self.output = nn.Linear(2048, 1008)

        def forward(self, img, return_features: bool = False, use_fp16: bool = False, no_output_bias: bool = False):
            b, c, h, w = img.shape
            x = img.to(torch.float16 if use_fp16 else torch.float32)
            theta = torch.eye(2, 3, device=x.device)
            theta[0, 2] += theta[0, 0] / w - theta[0, 0] / 299
            theta[1, 2] += theta[1, 1] / h - theta[1, 1] / 299
            grid = F.affine_grid(theta.to(x.dtype).unsqueeze(0).repeat(b, 1, 1), [b, c, 299, 299], False)
            x = F.grid_sample(x, grid, "bilinear", "border", False)
            feats = self.layers((x - 128) / 128).reshape(-1, 2048)
            if return_features:
                return feats
            logits = F.linear(feats, self.output.weight) if no_output_bias else self.output(feats)
            return torch.softmax(logits, 1)

    torch.manual_seed(seed)
    net = SmallInception().eval()
    with torch.no_grad():
        for m in net.modules():  # He's initialisation keeps the features apart through the ReLU layers
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.uniform_(m.bias, -0.1, 0.1)
        net.output.weight.mul_(10)  # so that the class probabilities are far from uniform
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(net), str(path))
    return path


DURATIONS = json.loads((REPO / "tests" / "durations.json").read_text())  # tools/test_durations.py writes it
SLOW_SECONDS = 4  # a test that took this long (in make test's 2-worker run) is `slow`: not in make test-fast
NEW_SLOW_SECONDS = 60  # a test marked slow by hand but not yet in durations.json: scheduled as this long, not last


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers added here
def pytest_collection_modifyitems(config, items):
    """Scheduling for `make test`'s two pytest-xdist workers (--dist loadgroup), and `slow` for test-fast.

    - The longest tests (tests/durations.json) are handed out first, so that no long one is left to run alone
      at the end while the other worker idles; the SLURM tests go before all of them.
    - The tests of a module that share one of its module-scoped fixtures (a trained run, a scored folder) run on
      one worker, which builds the fixture once, as a serial run does.
    - The fault tests that time a stalled or signalled job run one at a time: their deadlines assume the other
      worker's load, not a second 2-process job of their own. So do the SLURM tests (one cluster)."""
    sharing = {}  # a module's own module-scoped fixture -> the tests that use it
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for fixturedefs in defs.values():
            for d in fixturedefs:
                if d.scope in ("module", "session") and d.baseid.endswith(".py"):
                    sharing.setdefault((d.baseid, d.argname), []).append(item)
    slow = {item for item in items if DURATIONS.get(item.nodeid, 0) >= SLOW_SECONDS}
    for users in sharing.values():  # the first user pays the fixture's set-up: the others would, without it
        if slow.intersection(users):
            slow.update(users)
    for item in slow:
        if not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    shared = {item for users in sharing.values() for item in users}
    group = {}
    for item in items:
        module = item.module.__name__ if item.module else ""
        if item.get_closest_marker("slurm"):
            group[item] = "slurm"
        elif module == "test_faults" or item in shared:
            group[item] = module
        if item in group:
            item.add_marker(pytest.mark.xdist_group(group[item]))
    # A group's tests stay together, in their own order (its module's fixtures are built once, with or without
    # xdist); groups and single tests go longest first (a group by its total).
    total = collections.Counter()
    for item in items:
        guess = NEW_SLOW_SECONDS if item.get_closest_marker("slow") else 0
        total[group.get(item, item.nodeid)] += DURATIONS.get(item.nodeid, guess)
    place = {item: k for k, item in enumerate(items)}
    items.sort(key=lambda item: (group.get(item) != "slurm", -total[group.get(item, item.nodeid)],
                                 group.get(item, item.nodeid), place[item]))
