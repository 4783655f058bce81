"""A real check of aspect-ratio buckets (data.buckets, issue 57), tried as a user would: a folder of mixed-shape
photos, `diffrelay validate`, `diffrelay prepare`, a LoRA fine-tune of a tiny SDXL pipeline through torchrun in two
segments, samples at two shapes, and a picture of the buckets for docs/data.md.

  python benchmarks/buckets_real_check.py OUT [--steps 8] [--picture docs/buckets.png] [--no-two-processes]

The photos: scikit-image's sample images (skimage.data: astronaut, coffee, chelsea, rocket, the Hubble deep field,
retina, immunohistochemistry, colorwheel, camera, coins, moon, page; `pip install scikit-image`, not a diffrelay
dependency), each cut to 4 aspect ratios between 1:2 and 2:1 (the largest centred box of that ratio) and saved at a
long side of 128-320 pixels as JPEG or PNG with a caption beside it (photo.txt), 48 in all, plus one JPEG stored
landscape with EXIF orientation 6 (shown portrait: it must go to a portrait bucket). Only two images are 3:4 or
4:5, so their bucket (56x72) has fewer than one global batch and prepare merges it.

What it runs, in OUT, with OUT/config.json (data.resolution 64: buckets 48x80, 56x72, 64x64, 72x56, 80x48 in steps
of 8; data.val_fraction 0.1; text_cache; a rank-4 LoRA, batch 4):
  1. a tiny image (40x30) in the folder: `diffrelay validate` must refuse it in one line; then it is removed
  2. `diffrelay validate`: its `# buckets:` lines
  3. `diffrelay prepare`: the buckets, counts and merges of dataset.json; each row's original size and crop
     (sizes.npy) against buckets.cover recomputed from the file
  4. `torchrun -m diffrelay train` to --steps / 2, then on from that checkpoint to --steps (--trace): the losses,
     the bucket of every step's batch (one bucket each), and (unless --no-two-processes) the first segment again on
     2 processes: the same global batches
  5. `diffrelay sample --size` at 80x48 and 48x80 (sample.sizes): the images' sizes
  6. the picture (--picture): each bucket to scale with its count, and some of its images resized to cover it, the
     part the centred crop keeps outlined, the rest dimmed
Writes benchmarks/results/buckets_real_check.json (--results), with "failed": what did not hold of the above (exit
status 1 then).
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent

# skimage.data name: (caption, the 4 aspect ratios w / h it is cut to)
SOURCES = {
    "astronaut": ("a photo of an astronaut holding a helmet", (1, 2 / 3, 3 / 2, 3 / 4)),
    "coffee": ("a photo of a cup of coffee on a saucer", (3 / 2, 16 / 9, 1, 4 / 3)),
    "chelsea": ("a photo of a ginger cat", (3 / 2, 4 / 3, 1, 2 / 3)),
    "rocket": ("a photo of a rocket on its launch pad", (2 / 3, 9 / 16, 3 / 2, 16 / 9)),
    "hubble_deep_field": ("a telescope image of distant galaxies", (1, 2, 4 / 3, 1 / 2)),
    "retina": ("a photo of a human retina", (1, 4 / 3, 2 / 3, 16 / 9)),
    "immunohistochemistry": ("a microscope image of stained tissue", (3 / 2, 1, 9 / 16, 4 / 3)),
    "colorwheel": ("a colour wheel", (1, 3 / 2, 2 / 3, 5 / 4)),
    "camera": ("a black and white photo of a cameraman", (1, 2 / 3, 3 / 2, 4 / 5)),
    "coins": ("a black and white photo of old coins", (4 / 3, 3 / 2, 1, 2 / 3)),
    "moon": ("a black and white photo of the moon's surface", (1, 16 / 9, 9 / 16, 4 / 3)),
    "page": ("a scanned page of printed text", (2, 16 / 9, 3 / 2, 4 / 3)),
}
LONG_SIDES = (128, 160, 200, 256, 320)
RESOLUTION, STEP, BATCH = 64, 8, 4
SAMPLE_SIZES = ([80, 48], [48, 80])
PROMPTS = ("- {prompt: a photo of a ginger cat, num_images: 2}\n"
           "- {prompt: a photo of a rocket on its launch pad, num_images: 2}\n")


def crop_to(a: np.ndarray, ratio: float) -> np.ndarray:
    """The largest centred box of `a` (H, W, ...) with width / height = ratio."""
    h, w = a.shape[:2]
    cw, ch = (w, round(w / ratio)) if w / h < ratio else (round(h * ratio), h)
    top, left = (h - ch) // 2, (w - cw) // 2
    return a[top:top + ch, left:left + cw]


def make_photos(folder: Path) -> dict:
    """The mixed folder (see the docstring); {file name: (width, height) as decoded}."""
    import skimage.data

    folder.mkdir(parents=True, exist_ok=True)
    made, k = {}, 0
    for name, (caption, ratios) in SOURCES.items():
        a = getattr(skimage.data, name)()
        for ratio in ratios:
            img = Image.fromarray(crop_to(a, ratio))  # grey (L) and RGBA (none here) sources stay as they are
            long = LONG_SIDES[k % len(LONG_SIDES)]
            size = (long, round(long / ratio)) if ratio >= 1 else (round(long * ratio), long)
            img = img.resize(size, Image.Resampling.LANCZOS)
            orient = "square" if ratio == 1 else "landscape" if ratio > 1 else "portrait"
            stem = f"{name}_{orient}_{k:02d}"
            path = folder / (f"{stem}.jpg" if k % 2 else f"{stem}.png")
            img.save(path, quality=92) if path.suffix == ".jpg" else img.save(path)
            (folder / f"{stem}.txt").write_text(f"{caption}, {orient}\n")
            made[path.name] = img.size
            k += 1
    # stored 240 x 160 (landscape) with EXIF orientation 6: viewers, and diffrelay, turn it to 160 x 240
    img = Image.fromarray(crop_to(skimage.data.rocket(), 2 / 3)).resize((160, 240), Image.Resampling.LANCZOS)
    exif = Image.Exif()
    exif[0x0112] = 6
    img.transpose(Image.Transpose.ROTATE_90).save(folder / "rocket_exif_rotated.jpg", quality=92, exif=exif)
    (folder / "rocket_exif_rotated.txt").write_text("a photo of a rocket on its launch pad, portrait\n")
    made["rocket_exif_rotated.jpg"] = (160, 240)
    return made


def config(out: Path, steps: int) -> Path:
    cfg = {"run": {"name": "photos", "seed": 0, "device": "cpu", "results": str(out / "results"),
                   "resources": str(out / "resources")},
           "data": {"kind": "folder", "path": str(out / "photos"), "resolution": RESOLUTION, "captions": "auto",
                    "text_cache": True, "val_fraction": 0.1, "buckets": {"step": STEP, "max_aspect": 2.0}},
           "model": {"pretrained": str(out / "sdxl"), "class_conditional": False},
           "train": {"total_steps": steps, "segment_steps": steps // 2, "batch_size": BATCH, "lr": 0.001,
                     "warmup_steps": 0, "log_every": 1, "lora": {"rank": 4}, "threads": 2},
           "sample": {"num_images": 4, "steps": 4, "batch_size": 4, "prompts": str(out / "prompts.yaml"),
                      "sizes": [list(s) for s in SAMPLE_SIZES]},
           "fid": {"extractor": "random", "batch_size": 16}}
    (out / "prompts.yaml").write_text(PROMPTS)
    path = out / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run(*cmd, check=True) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    took = time.perf_counter() - t0
    if check and p.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p, round(took, 1)


def train(cfg: Path, until: int, trace: Path, init: Path | None = None, nproc: int = 1):
    cmd = [BIN / "torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "diffrelay", "train", "--config", cfg,
           "--until-step", until, "--trace", trace]
    return run(*cmd, *(["--init", init] if init else []))


def read_trace(trace: Path, world: int) -> dict:
    """{step: the global batch's dataset rows}: rank r took rows r::world of it."""
    per = [[json.loads(line) for line in Path(f"{trace}.rank{r}").read_text().splitlines()] for r in range(world)]
    out = {}
    for records in zip(*per):
        rows = np.empty(sum(len(x["indices"]) for x in records), dtype=np.int64)
        for r, x in enumerate(records):
            rows[r::world] = x["indices"]
        out[records[0]["step"]] = rows.tolist()
    return out


def row_files(cfg: Path) -> list[str]:
    """The relative path of each dataset row: the plan's training files, in order (none is unreadable here)."""
    from diffrelay import config
    from diffrelay.data import datasets

    c = config.load([str(cfg)])
    return [rel for rel, _ in datasets.plan(c.data, batch=c.train.batch_size).files]


def picture(path: Path, data_dir: Path, photos: Path, info: dict, files: list, scale: int = 2) -> dict:
    """docs' picture (see the docstring): one column per bucket, drawn `scale` times its size, and 3 of its images
    (one merged in from a smaller bucket where there is one, then the most cut, from different photos), each resized
    to cover the bucket as prepare does, the part kept outlined, the rest faded. Returns what it drew."""
    from diffrelay.data import buckets
    from diffrelay.data.files import to_rgb

    rows, meta = np.load(data_dir / "rows.npy"), np.load(data_dir / "sizes.npy")
    rec = info["buckets"]
    every = buckets.sizes(RESOLUTION, STEP, 2.0)  # before merging
    font, small = ImageFont.load_default(size=13), ImageFont.load_default(size=10)
    col_w, pad, head, per = 200, 12, 56, 3
    drawn, columns = {}, []
    for b, ((bw, bh), count) in enumerate(zip(rec["sizes"], rec["counts"])):
        mine = [i for i in range(len(rows)) if rows[i, 0] == b]

        def lost(i):  # the share of the covering image the crop cuts off
            (rw, rh), _ = buckets.cover(int(meta[i, 1]), int(meta[i, 0]), (bw, bh))
            return 1 - bw * bh / (rw * rh)

        def origin(i):  # the bucket the image would have had before merging
            w, h = every[buckets.nearest(int(meta[i, 1]), int(meta[i, 0]), every)]
            return f"{w}x{h}"

        merged_in = [i for i in mine if origin(i) != f"{bw}x{bh}"]
        picks, sources = merged_in[:1], {files[i].split("_")[0] for i in merged_in[:1]}
        for i in sorted(mine, key=lambda i: (-lost(i), i)):
            if len(picks) < per and files[i].split("_")[0] not in sources:
                picks.append(i)
                sources.add(files[i].split("_")[0])
        tiles = []
        for i in picks:
            with Image.open(photos / files[i]) as img:
                img = to_rgb(img)
            (rw, rh), (top, left) = buckets.cover(*img.size, (bw * scale, bh * scale))
            big = img.resize((rw, rh), Image.Resampling.LANCZOS)
            tile = Image.blend(big, Image.new("RGB", big.size, (255, 255, 255)), 0.65)
            tile.paste(big.crop((left, top, left + bw * scale, top + bh * scale)), (left, top))
            ImageDraw.Draw(tile).rectangle((left, top, left + bw * scale - 1, top + bh * scale - 1),
                                           outline=(220, 30, 30), width=2)
            h, w, ct, cl = (int(v) for v in meta[i])
            note = f"{w}x{h}, crop top {ct} left {cl}" + (f" (from {origin(i)})" if i in merged_in else "")
            tiles.append((tile, note))
            drawn.setdefault(f"{bw}x{bh}", []).append({"file": files[i], "original_wh": [w, h],
                                                       "crop_top_left": [ct, cl], "merged_from": origin(i)
                                                       if i in merged_in else None})
        columns.append(((bw, bh), count, len(merged_in), tiles))
    tallest = max(bh for (_, bh), *_ in columns) * scale
    body = max(sum(t.height + 16 + pad for t, _ in tiles) for *_, tiles in columns)
    merged = rec["settings"].get("merged", {})
    height = head + tallest + pad + body + (22 if merged else 0)
    canvas = Image.new("RGB", (col_w * len(columns) + pad, height), "white")
    draw = ImageDraw.Draw(canvas)
    s = rec["settings"]
    draw.text((pad, 6), f"data.buckets of a mixed photo folder: {sum(rec['counts'])} training images, "
              f"data.resolution {RESOLUTION}, step {s['step']}, max_aspect {s['max_aspect']:g}; drawn {scale}x",
              fill="black", font=font)
    for c, ((bw, bh), count, n_in, tiles) in enumerate(columns):
        x0 = pad + c * col_w
        draw.text((x0, 26), f"{bw} x {bh}  (w/h {bw / bh:.2f})", fill="black", font=font)
        draw.rectangle((x0, head, x0 + bw * scale - 1, head + bh * scale - 1), fill=(70, 110, 200))
        draw.text((x0 + 5, head + 4), f"{count} images" + (f"\n({n_in} merged in)" if n_in else ""), fill="white",
                  font=font)
        y = head + tallest + pad
        for tile, note in tiles:
            canvas.paste(tile, (x0, y))
            draw.text((x0, y + tile.height + 2), note, fill=(70, 70, 70), font=small)
            y += tile.height + 16 + pad
    if merged:
        text = "; ".join(f"{name}: its {n} images merged into {into} (fewer than min_images={s['min_images']}, "
                         "one global batch)" for name, (n, into) in merged.items())
        draw.text((pad, height - 18), text + ". Red: what the centred crop keeps, faded: what it cuts off "
                  "(the offsets at the bucket's size).",
                  fill=(70, 70, 70), font=small)
    canvas = canvas.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, optimize=True)
    return {"path": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path), "bytes": path.stat().st_size,
            "size": list(canvas.size), "images": drawn}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="an empty (or new) folder for the photos, the pipeline and the run")
    ap.add_argument("--steps", type=int, default=8, help="training steps, in 2 segments")
    ap.add_argument("--picture", type=Path, default=REPO / "docs" / "buckets.png")
    ap.add_argument("--no-two-processes", action="store_true", help="skip the 2-process run of the first segment")
    ap.add_argument("--results", type=Path, default=HERE / "results" / "buckets_real_check.json")
    args = ap.parse_args()
    out = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        sys.exit(f"{out}: not empty; give a new folder")
    sys.path.insert(0, str(REPO / "tests"))
    import pipelines

    from diffrelay import io
    from diffrelay.data import buckets

    result = {"settings": {"resolution": RESOLUTION, "step": STEP, "max_aspect": 2.0, "batch": BATCH,
                           "steps": args.steps, "sample_sizes": SAMPLE_SIZES}, "timing_s": {}}
    t0 = time.perf_counter()
    made = make_photos(out / "photos")
    pipelines.sdxl(out / "sdxl")
    result["timing_s"]["make_photos_and_pipeline"] = round(time.perf_counter() - t0, 1)
    shapes = {}
    for name, (w, h) in made.items():
        shapes.setdefault(f"{w / h:.2f}", 0)
        shapes[f"{w / h:.2f}"] += 1
    result["photos"] = {"count": len(made), "aspect_ratios": dict(sorted(shapes.items()))}
    cfg = config(out, args.steps)

    # 1. a tiny image is refused in one line, by validate already
    Image.new("RGB", (40, 30), (200, 100, 50)).save(out / "photos" / "tiny.png")
    (out / "photos" / "tiny.txt").write_text("a small orange square\n")
    p, _ = run(BIN / "diffrelay", "validate", "--config", cfg, check=False)
    result["tiny_image_refused"] = {"exit": p.returncode, "stderr": p.stderr.strip().splitlines()[-1:]}
    for f in ("tiny.png", "tiny.txt"):
        (out / "photos" / f).unlink()

    # 2. validate's buckets
    p, took = run(BIN / "diffrelay", "validate", "--config", cfg)
    lines = p.stdout.splitlines()
    first = next((k for k, x in enumerate(lines) if x.startswith("# buckets:")), len(lines))
    result["validate"] = {"seconds": took, "bucket_lines": lines[first:first + 1] + [
        x for x in lines[first + 1:] if x.startswith("#  ")]}
    print("\n".join(result["validate"]["bucket_lines"]), flush=True)

    # 3. prepare
    p, result["timing_s"]["prepare"] = run(BIN / "diffrelay", "prepare", "--config", cfg)
    run_dir = out / "results" / "photos"
    data_dir = run_dir / "dataset"
    info = io.read_json(data_dir / "dataset.json")
    rec = info["buckets"]
    result["prepare"] = {"count": info["count"], "held_out": io.read_json(data_dir / "val" / "dataset.json")["count"]
                         if (data_dir / "val" / "dataset.json").exists() else 0,
                         "buckets": {f"{w}x{h}": n for (w, h), n in zip(rec["sizes"], rec["counts"])},
                         "merged": rec["settings"].get("merged", {}), "min_images": rec["settings"]["min_images"],
                         "files": sorted(p.name for p in data_dir.iterdir() if p.suffix == ".npy")}
    rows, meta = np.load(data_dir / "rows.npy"), np.load(data_dir / "sizes.npy")
    files = row_files(cfg)
    assert len(files) == len(rows) == info["count"], (len(files), len(rows), info["count"])
    checked, examples = 0, []
    for i, name in enumerate(files):
        w, h = made[name]
        bw, bh = rec["sizes"][rows[i, 0]]
        (_, _), (top, left) = buckets.cover(w, h, (bw, bh))
        assert meta[i].tolist() == [h, w, top, left], (name, meta[i].tolist(), [h, w, top, left])
        checked += 1
        if name == "rocket_exif_rotated.jpg" or len(examples) < 8:
            examples.append({"file": name, "bucket": f"{bw}x{bh}", "original_hw": [h, w], "crop_top_left":
                             [top, left]})
    result["prepare"]["sizes_checked_against_cover"] = checked
    result["prepare"]["examples"] = examples
    print(json.dumps(result["prepare"], indent=1), flush=True)

    # 4. train in two segments (and the first again on 2 processes)
    half = args.steps // 2
    _, result["timing_s"]["train_segment_1"] = train(cfg, half, out / "one.trace")
    ckpt = run_dir / "checkpoints" / f"step_{half:07d}"
    _, result["timing_s"]["train_segment_2"] = train(cfg, args.steps, out / "one.trace", init=ckpt)
    steps = read_trace(out / "one.trace", 1)
    records = [json.loads(x) for x in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    losses = {r["step"]: round(r["loss"], 4) for r in records if "loss" in r}
    per_step = {s: sorted({f"{rec['sizes'][rows[i, 0]][0]}x{rec['sizes'][rows[i, 0]][1]}" for i in idx})
                for s, idx in steps.items()}
    result["train"] = {"losses": losses, "bucket_of_each_step": {s: v[0] if len(v) == 1 else v
                                                                 for s, v in per_step.items()},
                       "one_bucket_a_batch": all(len(v) == 1 for v in per_step.values()),
                       "steps_per_s": [r["steps_per_s"] for r in records if "steps_per_s" in r]}
    if not args.no_two_processes:
        two = out / "two"
        two.mkdir()
        d = json.loads(cfg.read_text())
        d["run"]["results"] = str(two)
        (two / "config.json").write_text(json.dumps(d))
        shutil.copytree(data_dir, two / "photos" / "dataset")
        _, result["timing_s"]["train_segment_1_two_processes"] = train(two / "config.json", half, out / "two.trace",
                                                                       nproc=2)
        theirs = read_trace(out / "two.trace", 2)
        result["train"]["two_processes_same_batches"] = all(theirs[s] == steps[s] for s in theirs) and bool(theirs)
    print(json.dumps(result["train"], indent=1), flush=True)

    # 5. samples at two shapes
    snap = run_dir / "snapshots" / f"step_{args.steps:07d}.safetensors"
    result["sample"] = {}
    for w, h in SAMPLE_SIZES:
        folder = out / "samples" / f"step_{args.steps:07d}_{w}x{h}"
        p, took = run(BIN / "diffrelay", "sample", "--config", cfg, "--snapshot", snap, "--out", folder,
                      "--size", f"{w}x{h}", check=False)
        if p.returncode:
            result["sample"][f"{w}x{h}"] = {"exit": p.returncode, "stderr": p.stderr.strip().splitlines()[-3:]}
            continue
        pngs = sorted(folder.glob("[0-9]*.png"))
        sizes = sorted({Image.open(f).size for f in pngs})
        result["sample"][f"{w}x{h}"] = {"seconds": took, "images": len(pngs), "sizes": [list(s) for s in sizes]}
    print(json.dumps(result["sample"], indent=1), flush=True)

    # 6. the picture
    result["picture"] = picture(args.picture, data_dir, out / "photos", info, files)
    print(f"wrote {args.picture} ({result['picture']['bytes']} bytes)")
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_average": [round(x, 2) for x in os.getloadavg()],
                         "note": "the 2 CPUs were shared with other processes during the run"}
    want = {"the tiny image refused": result["tiny_image_refused"]["exit"] != 0,
            "every row's sizes equal the cut recomputed": checked == info["count"],
            "the EXIF-rotated photo in a portrait bucket": any(
                e["file"] == "rocket_exif_rotated.jpg" and e["original_hw"][0] > e["original_hw"][1]
                and int(e["bucket"].split("x")[0]) < int(e["bucket"].split("x")[1]) for e in examples),
            "every batch from one bucket": result["train"]["one_bucket_a_batch"],
            "2 processes took the same batches": result["train"].get("two_processes_same_batches", True),
            **{f"samples at {w}x{h}": result["sample"].get(f"{w}x{h}", {}).get("sizes") == [[w, h]]
               for w, h in SAMPLE_SIZES}}
    result["failed"] = [k for k, ok in want.items() if not ok]
    io.write_json(args.results, result)
    print(f"wrote {args.results}")
    for k in result["failed"]:
        print(f"FAIL {k}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
