"""Our bucket sizes and assignment (diffrelay.data.buckets) against kohya's sd-scripts, on the same inputs.

Usage (a checkout of github.com/kohya-ss/sd-scripts; only two of its files are read):
  python benchmarks/checks/check_kohya_buckets.py --sd-scripts /tmp/sd-scripts

The reference is sd-scripts' own code, cut out of its files at run time and executed as written (its modules
import accelerate, transformers and more at the top, so they are not imported whole): make_bucket_resolutions
from library/model_util.py and the BucketManager class from library/train_util.py, with numpy, math and random in
their globals.

Cases:
  sizes      for R in 256 ... 1024, step 32 and 64, max_aspect 1.5, 2 and 4: our buckets against
             make_bucket_resolutions((R, R), min_size=step, max_size=R * R // step, divisible=step), kept where
             max(w, h) / min(w, h) <= max_aspect (sd-scripts bounds the sides, diffrelay the ratio: with the side
             bounds out of the way the two must be the same sets). Also recorded, not gated: how sd-scripts'
             defaults (min 256, max 1024 at 512 px) differ from ours at max_aspect 4 (its height clamp).
  assignment 3000 image sizes drawn at random (sides 64-4096 px): BucketManager(no_upscale=False) with our sizes as
             its predefined resolutions picks a bucket and a resized size; ours must pick the same, exactly.
  crop       our crop's top-left (torchvision's round((H - h) / 2), diffusers' SDXL script) against sd-scripts'
             trim ((H - h) // 2): at most 1 pixel apart.
  no_upscale 3000 image sizes (short side 16-4096 px, ratio 1/3-3) and 7000 just above 1024² pixels with a side just
             short of a bucket's, at 1024 px, step 64, max_aspect 2, with data.buckets.upscale false, against
             BucketManager(no_upscale=True): no image of ours is enlarged (0 of 10000); where the nearest of our
             buckets would enlarge an image (ours then takes a bucket of its own) and both the image's and sd-scripts'
             bucket ratios are within max_aspect, our bucket is sd-scripts' exactly (0 differ); and our cut loses no
             more of such an image than sd-scripts' (which crops at the image's own scale; at most 0.005 more: the resize's rounding). Also
             recorded: how many took their own bucket, and how many sd-scripts could not bucket (a zero side).
Exit status 1 with one line per figure outside its bound. Writes benchmarks/results/kohya_buckets_check.json.
"""

import argparse
import ast
import math
import random
from pathlib import Path

import numpy as np
from official import RESULTS, Gate, write_results

from diffrelay.data import buckets


def cut_out(path: Path, name: str) -> str:
    """The source of the top-level function or class `name` in `path`, as written."""
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return ast.get_source_segment(text, node)
    raise SystemExit(f"{path}: no {name} (is --sd-scripts an sd-scripts checkout?)")


def reference(root: Path) -> dict:
    """sd-scripts' make_bucket_resolutions and BucketManager, executed from their source."""
    scope = {"math": math, "np": np, "random": random, "Tuple": tuple, "Optional": object, "List": list,
             "logger": None}
    exec(cut_out(root / "library" / "model_util.py", "make_bucket_resolutions"), scope)
    scope["model_util"] = type("model_util", (), {"make_bucket_resolutions": staticmethod(
        scope["make_bucket_resolutions"])})
    exec(cut_out(root / "library" / "train_util.py", "BucketManager"), scope)
    return scope


def check_no_upscale(ref: dict, gate: Gate, rng) -> dict:
    """data.buckets.upscale false against sd-scripts' bucket_no_upscale (the docstring's no_upscale case)."""
    res, step, aspect = 1024, 64, 2.0
    settings = {"step": step, "max_aspect": aspect, "upscale": False}
    grid = buckets.sizes(res, step, aspect)
    manager = ref["BucketManager"](True, (res, res), None, None, step)
    enlarged = own = compared = differ = unbucketed = over_area = 0
    more_lost = 0.0
    for i in range(10000):
        if i < 3000:
            side, ratio = np.exp(rng.uniform(np.log(16), np.log(4096))), np.exp(rng.uniform(-np.log(3), np.log(3)))
            w, h = max(1, int(side * ratio)), int(side)
        else:  # above the area, a side just short of a bucket's: the nearest would enlarge it (sd-scripts shrinks it)
            bw, bh = grid[rng.integers(len(grid))]
            w = bw - int(rng.integers(1, step))
            h = res * res // w + int(rng.integers(1, 4 * step))
        ours = buckets.assign(w, h, grid, res, settings)
        if 0 in ours:
            continue  # refused by prepare, in one line (narrower than one step)
        (rw, rh), _ = buckets.cover(w, h, ours)
        enlarged += rw > w or rh > h
        if ours == grid[buckets.nearest(w, h, grid)]:
            continue  # the nearest bucket fits inside the image: the same as upscale true (the assignment case)
        own += 1
        try:
            reso, size, _ = manager.select_bucket(w, h)
        except ZeroDivisionError:  # its rounding gave a side of 0 (a very long image)
            unbucketed += 1
            continue
        if max(w, h) / min(w, h) > aspect or 0 in reso or max(reso) / min(reso) > aspect:
            continue  # ours cuts the long side to max_aspect first; sd-scripts has no ratio bound
        compared += 1
        over_area += w * h > res * res
        differ += tuple(reso) != ours
        theirs_lost = 1 - reso[0] * reso[1] / (size[0] * size[1])
        more_lost = max(more_lost, buckets.cropped(w, h, ours) - theirs_lost)
    gate.equal("no_upscale/enlarged images of 10000", enlarged, 0)
    gate.equal("no_upscale/own-bucket mismatches", differ, 0)
    gate.at_least("no_upscale/own buckets compared", compared, 500)
    gate.at_least("no_upscale/of them above 1024² pixels (sd-scripts' shrink)", over_area, 100)
    gate.at_most("no_upscale/fraction lost beyond sd-scripts'", more_lost, 0.005)  # the resize's rounding
    return {"own_buckets": own, "compared": compared, "above_area": over_area, "sd_scripts_zero_side": unbucketed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sd-scripts", type=Path, required=True, help="a checkout of kohya-ss/sd-scripts")
    ap.add_argument("--out", type=Path, default=RESULTS / "kohya_buckets_check.json")
    args = ap.parse_args()
    ref, gate = reference(args.sd_scripts), Gate()

    compared, defaults = 0, {}
    for res in (256, 384, 512, 768, 1024):
        for step in (32, 64):
            theirs_all = ref["make_bucket_resolutions"]((res, res), min_size=step, max_size=res * res // step,
                                                        divisible=step)
            for aspect in (1.5, 2.0, 4.0):
                ours = buckets.sizes(res, step, aspect)
                theirs = [r for r in theirs_all if max(r) / min(r) <= aspect]
                gate.equal(f"sizes/{res}/{step}/{aspect} (in one list only)", sorted(set(ours) ^ set(theirs)), [])
                gate.equal(f"sizes/{res}/{step}/{aspect} sorted alike", ours == sorted(ours), True)
                compared += 1
    kohya_default = ref["make_bucket_resolutions"]((512, 512))  # min 256, max 1024, divisible 64
    ours_default = buckets.sizes(512, 64, 4.0)
    defaults = {"only_sd_scripts": sorted(set(kohya_default) - set(ours_default)),
                "only_diffrelay": sorted(set(ours_default) - set(kohya_default))}

    rng = np.random.default_rng(0)
    sizes = buckets.sizes(1024, 64, 2.0)
    manager = ref["BucketManager"](False, (1024, 1024), None, None, 64)
    manager.set_predefined_resos(sizes)
    picked = resized = 0
    crop_gap = 0
    for _ in range(3000):
        w, h = (int(x) for x in np.exp(rng.uniform(np.log(64), np.log(4096), 2)))
        reso, size, _ = manager.select_bucket(w, h)
        b = sizes[buckets.nearest(w, h, sizes)]
        picked += b != tuple(reso)
        ours_size, (top, left) = buckets.cover(w, h, b)
        resized += ours_size != tuple(size)
        crop_gap = max(crop_gap, abs(top - (size[1] - reso[1]) // 2), abs(left - (size[0] - reso[0]) // 2))
    gate.equal("assignment/bucket mismatches of 3000", picked, 0)
    gate.equal("assignment/resized-size mismatches of 3000", resized, 0)
    gate.at_most("crop/top-left gap (pixels)", crop_gap, 1)
    gate.at_least("sizes/settings compared", compared, 30)
    no_upscale = check_no_upscale(ref, gate, rng)

    write_results(args.out, "kohya sd-scripts buckets", rows=gate.rows, sd_scripts_defaults_vs_ours=
                  {k: [list(r) for r in v] for k, v in defaults.items()}, no_upscale=no_upscale)
    for row in gate.rows:
        if not str(row["case"]).startswith("sizes/"):
            print(f"{row['case']}: {row['value']}")
    print(f"sizes: {compared} settings compared; at 512 px sd-scripts' defaults have {len(defaults['only_sd_scripts'])} "
          f"bucket(s) ours (max_aspect 4) lacks: {defaults['only_sd_scripts']}; ours only: {defaults['only_diffrelay']}")
    for line in gate.failures():
        print(line)
    return 1 if gate.failures() else 0


if __name__ == "__main__":
    raise SystemExit(main())
