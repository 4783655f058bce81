"""The Python packages a lent GPU machine lacks, packed to travel with the tree (make gpu-bundle).

  python tools/gpu_bundle.py [--out build/gpu-bundle.tar.xz] [--python-version 3.12] [--torchvision 0.26.0]
  python tools/gpu_bundle.py --from-site --out DIR     # this interpreter's own installed files (the tests)
  python tools/gpu_bundle.py --with-lora               # build/gpu-bundle-lora.tar.xz: also peft, transformers, torchao

That machine has Python 3.12 and torch, no network, and only 64 MiB of files reach it. The bundle is the
installed dependency tree of diffrelay's runtime (pyproject.toml), minus torch and what torch brings, minus
what the GPU checks never import (snakemake, pandas, matplotlib, transformers, pyarrow, peft), stripped of tests and byte-code: about
46 MiB as tar.xz; plain wheels would be 74 MiB. torchvision is in it, pinned to the machine's torch
(torchvision 0.26 requires torch 2.11 exactly); benchmarks/gpu_smoke.py uses the machine's own torchvision
where one is installed and checks the pin otherwise.

Default: `pip install --target` of cp312 manylinux wheels under constraints.txt (the package registry is
needed here, never there). --from-site copies the distributions from this interpreter's site-packages
instead: same Python, no network.

--with-lora (opt-in; benchmarks/gpu_flux_lora.py) also packs peft, transformers (peft imports it), accelerate (peft
imports it), torchao (of pyproject's `quantize` extra; not its bitsandbytes) and their requirements (tokenizers,
regex, psutil, ...); peft and accelerate without their torch requirement (pip would fetch torch): about 57.5 MiB as
tar.xz. Without it, the bundle is the one described above.
"""

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "build" / "gpu-bundle.tar.xz"
# torch and its own requirements are the machine's; the others are never imported by the GPU checks.
# Text runs (transformers and its sentencepiece and protobuf, Parquet captions) and LoRA (peft) are not among the
# GPU checks; peft must stay out as well: diffusers imports it whenever it is installed, and peft imports transformers.
LEFT_OUT = {"torch", "snakemake", "snakemake-executor-plugin-slurm", "pandas", "matplotlib",
            "transformers", "sentencepiece", "protobuf", "pyarrow", "peft"}
NO_DEPS = {"clean-fid", "torchvision"}  # both require torch, which pip would fetch (2.5 GB)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
STRIP_DIRS = {"tests", "__pycache__"}
HUB = "1.33.0"  # huggingface_hub: see pip_install
# --with-lora: taken back out of LEFT_OUT; NO_DEPS_LORA require torch, installed without their requirements (named in
# LORA_EXTRA: accelerate's and peft's besides torch and transformers), torchao from pyproject's `quantize` extra
# (its bitsandbytes, nf4, left out: it requires torch, and its CUDA builds alone would fill the 64 MiB), and the
# `optimizers` extra's prodigyopt and schedulefree (train.optimizer; bitsandbytes left out for the same reason).
LORA = {"peft", "transformers"}
NO_DEPS_LORA = {"peft", "accelerate", "prodigyopt", "schedulefree"}
LORA_EXTRA = ["accelerate", "psutil"]
DEFAULT_LORA_OUT = ROOT / "build" / "gpu-bundle-lora.tar.xz"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(lora: bool = False) -> list[str]:
    """pyproject.toml's runtime requirements, less LEFT_OUT, as pip arguments (their ranges kept); `lora`: less
    LEFT_OUT - LORA, plus LORA_EXTRA and the `quantize` extra's torchao."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"]
    if not lora:
        return [d for d in deps if norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) not in LEFT_OUT]
    out = [d for d in deps if norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) not in LEFT_OUT - LORA]
    extras = project["optional-dependencies"]
    return out + LORA_EXTRA + [r for r in extras["quantize"] if name_of(r) == "torchao"] + \
        [r for r in extras["optimizers"] if name_of(r) in ("prodigyopt", "schedulefree")]  # pure Python, tiny


def name_of(req: str) -> str:
    return norm(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0])


def pip_install(site: Path, python_version: str, torchvision: str, lora: bool = False) -> None:
    base = [sys.executable, "-m", "pip", "install", "-q", "--target", str(site), "--python-version", python_version,
            "--implementation", "cp", "--only-binary=:all:", "--no-compile", *sum((["--platform", p] for p in
                                                                                  PLATFORMS), [])]
    reqs = requirements(lora)
    plain = [r for r in reqs if name_of(r) not in NO_DEPS and not (lora and name_of(r) in NO_DEPS_LORA)]
    pinned = [r if name_of(r) != "torchvision" else f"torchvision=={torchvision}" for r in reqs
              if name_of(r) in NO_DEPS]
    # huggingface_hub as the machine's (1.33): its transformers (5.17), which diffusers imports through peft
    # when present, refuses hub 2.x; diffusers 0.42 takes either.
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if not line.lower().startswith("huggingface_hub==")] + [f"huggingface_hub=={HUB}"]
    constraints = site.parent / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    subprocess.run([*base, "-c", str(constraints), *plain], check=True)
    # torchvision is pinned to the machine's torch, not to constraints.txt's (this machine's torch).
    subprocess.run([*base, "--no-deps", *pinned], check=True)
    if lora:  # peft and accelerate require torch: their other requirements are in `plain`
        subprocess.run([*base, "-c", str(constraints), "--no-deps", *[r for r in reqs if name_of(r) in NO_DEPS_LORA]],
                       check=True)


def closure(names, left_out=frozenset(LEFT_OUT)) -> set[str]:
    """The installed distributions `names` need, recursively, less torch's own (present on the machine)."""
    torch_side = {norm(r.split(";")[0].split(" ")[0].split("<")[0].split(">")[0].split("=")[0])
                  for r in md.requires("torch") or [] if "extra ==" not in r}
    seen, todo = set(), [norm(n) for n in names]
    while todo:
        n = todo.pop()
        if n in seen or n in left_out or (n in torch_side and n not in {norm(x) for x in names}):
            continue
        try:
            reqs = md.requires(n) or []
        except md.PackageNotFoundError:
            continue
        seen.add(n)
        if n in NO_DEPS:  # its other needs are listed in pyproject.toml anyway
            continue
        todo += [name_of(r) for r in reqs if "extra ==" not in r]
    return seen


def copy_site(site: Path, lora: bool = False) -> None:
    """--from-site: each distribution's installed files (RECORD), copied into `site`."""
    names = closure(name_of(r) for r in requirements()) if not lora else \
        closure([name_of(r) for r in requirements(lora)], frozenset(LEFT_OUT - LORA))
    for name in sorted(names):
        dist = md.distribution(name)
        for f in dist.files or []:
            src = Path(dist.locate_file(f))
            if f.parts[0] == ".." or not src.is_file():  # scripts in bin/ and the like
                continue
            dst = site / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def strip(site: Path) -> None:
    for d in sorted(site.rglob("*"), key=lambda p: -len(p.parts)):
        if d.is_dir() and d.name in STRIP_DIRS:
            shutil.rmtree(d)
    shutil.rmtree(site / "bin", ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None,
                    help="a .tar.xz file, or a folder (no packing); default build/gpu-bundle.tar.xz (--with-lora: "
                    "build/gpu-bundle-lora.tar.xz)")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    ap.add_argument("--torchvision", default="0.26.0", help="the torchvision that fits the GPU machine's torch "
                    "(2.11 there: 0.26.0)")
    ap.add_argument("--from-site", action="store_true", help="copy this interpreter's installed packages")
    ap.add_argument("--with-lora", action="store_true", help="also peft, transformers, accelerate and torchao "
                    "(benchmarks/gpu_flux_lora.py)")
    args = ap.parse_args()
    own = DEFAULT_LORA_OUT if args.with_lora else DEFAULT_OUT
    out = Path(args.out) if args.out is not None else own
    if out.exists() and out.resolve() != own.resolve():  # only this tool's own default file is replaced
        sys.exit(f"gpu_bundle: {out} exists and this tool did not make it there; give a new path")
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        if args.with_lora:
            copy_site(site, lora=True) if args.from_site else pip_install(site, args.python_version, args.torchvision,
                                                                          lora=True)
        else:
            copy_site(site) if args.from_site else pip_install(site, args.python_version, args.torchvision)
        strip(site)
        if out.suffix == ".xz":
            out.parent.mkdir(parents=True, exist_ok=True)
            part = out.with_name(out.name + ".part")
            with tarfile.open(part, "w:xz", preset=6) as tar:
                tar.add(site, arcname="site")
            part.replace(out)  # atomic: a half-written bundle never carries the final name
        else:
            shutil.move(site, out)
    size = out.stat().st_size if out.is_file() else sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"gpu_bundle: wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
