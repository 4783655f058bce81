"""diffrelay.data.edm_augment against NVlabs/edm's training/augment.py (AugmentPipe), fed the same random draws.

  python benchmarks/checks/check_augment_equivalence.py --edm-src /tmp/off/edm

--edm-src is a checkout of github.com/NVlabs/edm; its training/augment.py (and the torch_utils and dnnlib it
imports) is imported from there at run time, and nothing of it enters the package.

How both get the same random numbers: ours draws a (B, NDRAWS) float32 array with numpy (edm_augment.draw).
AugmentPipe draws from torch's global generator with torch.rand / torch.randn / torch.randint; for each
call the module makes, the script hands it the matching column(s) of that same array instead. It does so by
replacing the name `torch` inside the official module (and only there) with a stand-in that forwards every
attribute to torch except those three, which pop the next entry of a script built below from the draws
(randint(n) gets floor(n u), the value edm_augment derives from the uniform u). Each entry names the function
and shape the official code must ask for at that point; a call out of order or of another shape stops the
script, and every entry must be used. The official code runs otherwise unchanged, on the CPU.

Cases, on a seeded random batch (default 16 x 3 x 32 x 32, values in [-1, 1]), 16 steps' draws each:
  <transform>          each of the 8 geometric transforms alone, p=1 (multiplier 1)
  all_p1               all 8 together, p=1
  recipe               EDM's CIFAR-10 pipe: train.py's --augment=0.12 and augment_kwargs (EDM_CIFAR10)
  recipe_p1            the recipe's transforms at p=1
  recipe*_world2       ours on the rows 0::2 and 1::2 (padding from the global batch, as edm_augment.draw
                       gives it), reassembled, against the official pipe on the whole batch
  recipe_p1_nonsquare  recipe_p1 on a 16 x 3 x 24 x 40 batch (H != W)
Reported: max abs difference of the images and of the labels, whether they are bit for bit equal, and how far
the official pipe moved the images (so a transform that did nothing would show). Also for information:
  edm_split_effect_recipe_p1  how much the official pipe's own images change (recipe at p=1) when it gets
                              the two halves of the batch separately: its padding follows the batch, which
                              is why edm_augment pads for the global batch
  edm_p0_change               how far the official pipe at p=0 (recipe settings) moves the images; ours
                              returns them as they are
Writes benchmarks/results/augment_equivalence.json. Not a test: CI has no EDM checkout.
"""

import argparse
import hashlib
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from official import RESULTS, write_results

from diffrelay.data import edm_augment as ea

ALONE = ("xflip", "yflip", "rotate_int", "translate_int", "scale", "rotate_frac", "aniso", "translate_frac")


def official(src: Path):
    sys.path.insert(0, str(src.resolve()))
    from training import augment  # noqa: PLC0415 -- EDM's training/augment.py, from --edm-src

    return augment


class ScriptedTorch:
    """`torch` as the official module sees it: rand, randn and randint return the scripted tensors in order."""

    def __init__(self, script):
        self.script = list(script)

    def __getattr__(self, name):
        return getattr(torch, name)

    def _next(self, name, shape, device):
        if not self.script:
            raise AssertionError(f"official code called torch.{name}{list(shape)} beyond the script")
        want, value = self.script.pop(0)
        if want != name or list(value.shape) != list(shape):
            raise AssertionError(f"official code called torch.{name}{list(shape)}, script has {want}"
                                 f"{list(value.shape)}")
        return value.to(device)

    def rand(self, shape, device=None):
        return self._next("rand", shape, device)

    def randn(self, shape, device=None):
        return self._next("randn", shape, device)

    def randint(self, high, shape, device=None):
        return self._next(f"randint{high}", shape, device)


def script(rows: np.ndarray, pipe: ea.Pipe) -> list:
    """The official pipe's random calls in order (aug.py:162-226) with the values of our draw columns."""
    n = len(rows)
    col = lambda k: torch.from_numpy(rows[:, k].copy())  # noqa: E731
    img = lambda *ks: torch.stack([col(k) for k in ks]).reshape(len(ks), n, 1, 1, 1)  # noqa: E731
    out = []
    if pipe.xflip > 0:
        out += [("randint2", (col(ea.XFLIP) * 2).floor().long().reshape(n, 1, 1, 1)),
                ("rand", col(ea.XFLIP_ON).reshape(n, 1, 1, 1))]
    if pipe.yflip > 0:
        out += [("randint2", (col(ea.YFLIP) * 2).floor().long().reshape(n, 1, 1, 1)),
                ("rand", col(ea.YFLIP_ON).reshape(n, 1, 1, 1))]
    if pipe.rotate_int > 0:
        out += [("randint4", (col(ea.ROT90) * 4).floor().long().reshape(n, 1, 1, 1)),
                ("rand", col(ea.ROT90_ON).reshape(n, 1, 1, 1))]
    if pipe.translate_int > 0:
        out += [("rand", img(ea.SHIFT_X, ea.SHIFT_Y)), ("rand", img(ea.SHIFT_ON))]
    if pipe.scale > 0:
        out += [("randn", col(ea.SCALE)), ("rand", col(ea.SCALE_ON))]
    if pipe.rotate_frac > 0:
        out += [("rand", col(ea.ROTATE)), ("rand", col(ea.ROTATE_ON))]
    if pipe.aniso > 0:
        out += [("randn", col(ea.ANISO)), ("rand", col(ea.ANISO_ANGLE)), ("rand", col(ea.ANISO_ON)),
                ("rand", col(ea.ANISO_AXIS_ON))]
    if pipe.translate_frac > 0:
        out += [("randn", torch.stack([col(ea.TRANSLATE_X), col(ea.TRANSLATE_Y)])),
                ("rand", col(ea.TRANSLATE_ON).reshape(1, n))]
    return out


def run_official(augment, pipe: ea.Pipe, images, rows):
    kwargs = {f: getattr(pipe, f) for f in ea.Pipe.__dataclass_fields__}
    stand_in = ScriptedTorch(script(rows, pipe))
    augment.torch = stand_in
    try:
        out = augment.AugmentPipe(**kwargs)(images)
    finally:
        augment.torch = torch
    if stand_in.script:
        raise AssertionError(f"official code left {len(stand_in.script)} scripted draws unused")
    return out


def diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def case(augment, pipe, images, steps, world=1) -> dict:
    n, _, h, w = images.shape
    worst = {"images": 0.0, "labels": 0.0, "images_equal": True, "labels_equal": True, "moved": 0.0}
    for step in steps:
        parts = [ea.draw(0, step, n, r, world, pipe, h, w) for r in range(world)]
        ours_x, ours_l = torch.empty_like(images), torch.empty(n, pipe.label_dim)
        for r, d in enumerate(parts):
            ours_x[r::world], ours_l[r::world] = ea.apply(images[r::world], d, pipe)
        theirs_x, theirs_l = run_official(augment, pipe, images, ea.global_draws(0, step, n))
        worst["images"] = max(worst["images"], diff(ours_x, theirs_x))
        worst["labels"] = max(worst["labels"], diff(ours_l, theirs_l))
        worst["images_equal"] &= torch.equal(ours_x, theirs_x)
        worst["labels_equal"] &= torch.equal(ours_l, theirs_l)
        worst["moved"] = max(worst["moved"], diff(theirs_x, images))  # the transforms did act
    worst["label_dim"] = pipe.label_dim
    worst["steps"] = len(steps)
    return worst


def split_effect(augment, pipe, images, steps) -> float:
    """Max change of the official pipe's images when the two halves of the batch go through it apart."""
    n, worst = len(images), 0.0
    for step in steps:
        rows = ea.global_draws(0, step, n)
        whole = run_official(augment, pipe, images, rows)[0]
        for r in range(2):
            worst = max(worst, diff(run_official(augment, pipe, images[r::2], rows[r::2])[0], whole[r::2]))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edm-src", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--resolution", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16, help="draws of this many steps per case")
    ap.add_argument("--out", type=Path, default=RESULTS / "augment_equivalence.json")
    args = ap.parse_args()
    augment = official(args.edm_src)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    source = args.edm_src / "training" / "augment.py"
    try:
        commit = subprocess.run(["git", "-C", str(args.edm_src), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    g = torch.Generator().manual_seed(0)
    images = torch.rand(args.batch, 3, args.resolution, args.resolution, generator=g) * 2 - 1
    steps = range(args.steps)
    start = time.perf_counter()
    cases = {name: case(augment, ea.Pipe(**{name: 1}), images, steps) for name in ALONE}
    cases["all_p1"] = case(augment, ea.Pipe(**{name: 1 for name in ALONE}), images, steps)
    cases["recipe"] = case(augment, ea.EDM_CIFAR10, images, steps)
    recipe_p1 = replace(ea.EDM_CIFAR10, p=1.0)
    cases["recipe_p1"] = case(augment, recipe_p1, images, steps)
    cases["recipe_world2"] = case(augment, ea.EDM_CIFAR10, images, steps, world=2)
    cases["recipe_p1_world2"] = case(augment, recipe_p1, images, steps, world=2)
    wide = torch.rand(args.batch, 3, args.resolution * 3 // 4, args.resolution * 5 // 4, generator=g) * 2 - 1
    cases["recipe_p1_nonsquare"] = case(augment, recipe_p1, wide, steps)
    p0 = replace(ea.EDM_CIFAR10, p=0.0)
    info = {"edm_split_effect_recipe_p1": split_effect(augment, recipe_p1, images, steps),
            "edm_p0_change": diff(run_official(augment, p0, images, ea.global_draws(0, 0, len(images)))[0], images)}
    seconds = time.perf_counter() - start
    for name, r in cases.items():
        print(f"{name:20s} images {r['images']:.3g} labels {r['labels']:.3g}  (label_dim {r['label_dim']}, "
              f"bit-equal images {r['images_equal']}, labels {r['labels_equal']}; images moved {r['moved']:.3g})")
    for name, v in info.items():
        print(f"{name:28s} {v:.3g}")
    worst = {"images": max(r["images"] for r in cases.values()), "labels": max(r["labels"] for r in cases.values())}
    print(f"max abs differences: {worst}; {seconds:.1f} s")
    write_results(args.out, "diffrelay data.edm_augment vs NVlabs/edm training/augment.py AugmentPipe, the same "
                  "draws fed to both (the official module's torch.rand/randn/randint replaced by a script)",
                  edm_commit=commit, augment_py_sha256=hashlib.sha256(source.read_bytes()).hexdigest(),
                  batch=list(images.shape), device="cpu", threads=torch.get_num_threads(),
                  max_abs_diff=worst, cases=cases, info=info, seconds=round(seconds, 1))
    if worst["images"] > 1e-5 or worst["labels"] > 1e-6:
        sys.exit("not equal: see the table")


if __name__ == "__main__":
    main()
