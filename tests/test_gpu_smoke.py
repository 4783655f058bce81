"""benchmarks/gpu_smoke.py where it will run: a Python with torch and torchvision alone, plus the bundle
(tools/gpu_bundle.py). Here the whole sequence runs on the CPU, from such a venv, with a bundle copied from
this interpreter's packages (the real one is cp312 wheels for the lent machine; the same list of packages)."""

import importlib.metadata as md
import json
import re
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
import gpu_bundle  # noqa: E402
import gpu_smoke  # noqa: E402

# What bench_gpu runs inside the smoke: every case, at sizes the CPU does in seconds.
BENCH = ("--steps 4 --cases ditxl,ditxl-sample --ditxl-size S --ditxl-batch 4 --ditxl-res 32 --ditxl-images 8 --ditxl-samples 1 "
         "--ditxl-steps 2")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def bare_venv(folder: Path) -> Path:
    """A venv holding torch (with what torch itself requires) and torchvision, linked from this one."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = Path(subprocess.run([folder / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    names, todo = set(), ["torch", "torchvision"]
    while todo:
        n = norm(todo.pop())
        if n in names:
            continue
        names.add(n)
        if n != "torchvision":  # torchvision's numpy and pillow are the bundle's
            todo += [re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in md.requires(n) or [] if "extra ==" not in r]
    names |= {norm(d.metadata["Name"]) for d in md.distributions() if re.match(r"(nvidia|cuda)[-_]", d.metadata["Name"])}
    here = Path(sysconfig.get_path("purelib"))
    for n in names:
        try:
            dist = md.distribution(n)
        except md.PackageNotFoundError:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if (here / top).exists() and not (site / top).exists():
                (site / top).symlink_to(here / top)
    return folder / "bin" / "python"


def test_the_bundle_lists_the_runtime_less_torch_and_the_workflow():
    reqs = {gpu_bundle.name_of(r) for r in gpu_bundle.requirements()}
    assert {"numpy", "pyyaml", "jsonschema", "scipy", "clean-fid", "diffusers", "safetensors", "torchvision"} <= reqs
    assert not reqs & {"torch", "snakemake", "pandas", "matplotlib", "peft",  # peft: diffusers would import it
                       "transformers", "sentencepiece", "protobuf"}  # text runs only: not among the GPU checks


def test_the_bundle_tool_refuses_a_target_it_did_not_make(tmp_path):
    for target in (tmp_path / "mine.tar.xz", tmp_path / "folder"):
        target.mkdir() if target.suffix != ".xz" else target.write_bytes(b"someone's file")
        before = sorted(p.name for p in tmp_path.rglob("*"))
        p = subprocess.run([sys.executable, ROOT / "tools" / "gpu_bundle.py", "--from-site", "--out", target],
                           capture_output=True, text=True)
        assert p.returncode != 0 and "did not make it" in p.stderr and str(target) in p.stderr
        assert sorted(q.name for q in tmp_path.rglob("*")) == before
    assert (tmp_path / "mine.tar.xz").read_bytes() == b"someone's file"


def test_torchvision_pin_is_read_from_the_bundle(tmp_path):
    meta = tmp_path / "torchvision-0.26.0.dist-info" / "METADATA"
    meta.parent.mkdir()
    meta.write_text("Name: torchvision\nRequires-Dist: numpy\nRequires-Dist: torch==2.11.0\n")
    assert gpu_smoke.torchvision_pin(tmp_path) == "2.11.0"


@pytest.mark.slow
def test_smoke_sequence_runs_from_torch_torchvision_and_the_bundle(tmp_path):
    python = bare_venv(tmp_path / "venv")
    probe = subprocess.run([python, "-c", "import torch, torchvision; import numpy"], capture_output=True, text=True)
    assert "No module named 'numpy'" in probe.stderr  # the venv is bare: what the smoke needs comes from the bundle
    bundle = tmp_path / "bundle"
    subprocess.run([sys.executable, ROOT / "tools" / "gpu_bundle.py", "--from-site", "--out", bundle], check=True,
                   capture_output=True)
    assert (bundle / "numpy").is_dir() and (bundle / "cleanfid").is_dir() and not (bundle / "torch").exists()
    assert not list(bundle.rglob("__pycache__")) and not (bundle / "snakemake").exists()
    packed = tmp_path / "bundle.tar.xz"
    with tarfile.open(packed, "w") as tar:  # the smoke unpacks a tarball as it will there (uncompressed: faster)
        tar.add(bundle, arcname="site")
    out = tmp_path / "out"
    p = subprocess.run([python, ROOT / "benchmarks" / "gpu_smoke.py", "--device", "cpu", "--bundle", packed,
                        "--out-dir", out, "--bench", BENCH, "--budget", "900", "--small",
                        # covered on the CPU by test_speed.py (channels_last) and test_fid.py (a foreign reference)
                        "--skip", "channels_last_switch,fid_foreign_reference"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=1200)
    report = json.loads((out / "gpu_smoke.json").read_text())
    checks = report["checks"]
    failed = {k: v for k, v in checks.items() if v.get("passed") is False}
    assert p.returncode == 0 and not failed, (p.stdout[-3000:], p.stderr[-3000:], failed)
    assert checks["environment"]["torchvision"]["source"] == "machine"  # the venv's own, not the bundle's
    assert checks["segments"]["det"]["bitwise"] and checks["sampling"]["heun"]["byte_identical"] == 16
    assert checks["sampling"]["churn"]["byte_identical"] == 16  # the stochastic path (noise asked a step ahead)
    assert checks["latent_encode"]["same_bytes"]
    assert checks["kill_one_rank"]["passed"] is None  # needs 2 GPUs
    assert checks["channels_last_switch"]["note"] == "not run: not asked for"
    bench = checks["bench_gpu"]["result"]
    assert "ditxl" in bench and bench["ditxl"]["ratio"] > 0
    assert (out / "gpu_bench_smoke.json").is_file()
    # Sampling alone: a random network made a snapshot by `diffrelay import`, then sampled with TF32 on and off.
    assert min(bench["ditxl_sample"][f"sample_images_per_s_tf32_{s}"] for s in ("on", "off")) > 0
