"""Images per second of `diffrelay prepare` on a folder of JPEGs, with 1 and 2 decoding processes.

  python benchmarks/bench_prepare.py [--images 3000] [--size 256] [--resolution 64] [--workers 1 2]

Generates a folder of --images JPEG files (--size x --size, quality 90, about 20-30 kB: smooth shapes
and gradients with a little noise, near a photo's compressed size), then for each worker count runs
`diffrelay prepare --workers N` end to end in a fresh process (start-up, hashing every file for the
fingerprint, decoding, crop and Lanczos resize to --resolution, writing the arrays), timing
  total    the whole command, as a user waits for it
  hash     the fingerprint: reading and hashing every file (one process; the same for every worker count)
  decode   decoding, resizing and writing the rows (the part the workers share)
from the command's own log lines. Checks that every worker count wrote the same bytes. The 1.28 M-image
figures are extrapolated from the measured rates, not measured. Writes benchmarks/results/prepare.json.
"""

import argparse
import hashlib
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw, ImageFilter

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
IMAGENET = 1_281_167


def photo_like(i: int, size: int) -> Image.Image:
    """A gradient, a few soft shapes and mild noise: compresses like a photo, not like pure noise."""
    rng = np.random.default_rng(i)
    t = np.linspace(0, 1, size)[None, :, None]
    c1, c2 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    base = (c1 + (c2 - c1) * t).repeat(size, axis=0)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = rng.integers(0, size, 2)
        w, h = rng.integers(size // 8, size // 2, 2)
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x0 + w, y0 + h], fill=fill)
    img = img.filter(ImageFilter.GaussianBlur(1.5))
    noisy = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, (size, size, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def make_folder(root: Path, n: int, size: int) -> int:
    """n JPEGs in 10 class folders; returns the total bytes."""
    total = 0
    for i in range(n):
        path = root / f"class{i % 10}" / f"{i:07d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        photo_like(i, size).save(path, quality=90)
        total += path.stat().st_size
    return total


def clock(stamp: str) -> float:
    h, m, s = map(int, stamp.split(":"))
    return h * 3600 + m * 60 + s


def cpu_seconds() -> float:
    """CPU time of this process's finished children (prepare and, rolled up into it, its workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_prepare(cfg: Path, out: Path, workers: int) -> dict:
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    p = subprocess.run([str(BIN / "diffrelay"), "prepare", "--config", str(cfg), "--out", str(out),
                        "--workers", str(workers)], capture_output=True, text=True)
    total, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    if p.returncode:
        sys.exit(f"prepare failed:\n{p.stderr}")
    # "[hh:mm:ss] prepare: N/N images | R img/s | decoded in Xs": the rate of the decoding loop alone.
    rate = float(re.search(r"\| (\d+) img/s \| decoded in", p.stderr).group(1))
    return {"total_seconds": round(total, 2), "cpu_seconds": round(cpu, 2), "decode_images_per_second": rate,
            "log": p.stderr.strip().splitlines()}


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in ("images.npy", "labels.npy", "dataset.json"):
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()

    from diffrelay import config, io
    from diffrelay.data import datasets

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_prepare.") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        nbytes = make_folder(tmp / "imgs", args.images, args.size)
        print(f"generated {args.images} JPEGs of {args.size}x{args.size} ({nbytes / args.images / 1e3:.1f} kB each) "
              f"in {time.perf_counter() - t0:.1f}s")
        cfg = tmp / "config.yaml"
        cfg.write_text(yaml.safe_dump({"run": {"name": "bench", "results": str(tmp / "results")},
                                       "data": {"kind": "folder", "path": str(tmp / "imgs"),
                                                "resolution": args.resolution}}))
        # The fingerprint alone (hashing every file), in this process, as prepare does it before decoding.
        t0 = time.perf_counter()
        datasets.plan(config.load([cfg]).data)
        hash_seconds = time.perf_counter() - t0
        # A second pass would find the files in the page cache; so does the first, since they were just written.
        runs, digests = {}, {}
        for w in args.workers:
            out = tmp / f"out-w{w}"
            runs[w] = run_prepare(cfg, out, w)
            digests[w] = digest(out)
            print("\n".join(runs[w]["log"]))
            print(f"workers {w}: {runs[w]['total_seconds']:.1f}s total ({runs[w]['cpu_seconds']:.1f} CPU-s), "
                  f"{args.images / runs[w]['total_seconds']:.0f} img/s end to end, "
                  f"decoding {runs[w]['decode_images_per_second']:.0f} img/s")

    hash_rate = args.images / hash_seconds
    report = {
        "images": args.images, "source_size": args.size, "resolution": args.resolution, "format": "JPEG q90",
        "mean_file_kB": round(nbytes / args.images / 1e3, 1),
        "hash_seconds": round(hash_seconds, 2), "hash_images_per_second": round(hash_rate),
        "runs": {str(w): {k: v for k, v in r.items() if k != "log"} | {
            "cpu_ms_per_image": round(1000 * r["cpu_seconds"] / args.images, 2),
            "end_to_end_images_per_second": round(args.images / r["total_seconds"]),
            "extrapolated_hours_for_1281167_images": {
                "decode_only": round(IMAGENET / r["decode_images_per_second"] / 3600, 2),
                "hash_plus_decode": round((IMAGENET / hash_rate + IMAGENET / r["decode_images_per_second"]) / 3600, 2),
            }} for w, r in runs.items()},
        "identical_bytes_for_all_worker_counts": len(set(digests.values())) == 1,
        "note": "hours for 1281167 images are extrapolated from the measured rates, not measured",
        "machine": {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
    }
    print(f"hashing: {hash_rate:.0f} img/s; identical bytes: {report['identical_bytes_for_all_worker_counts']}")
    for w, r in report["runs"].items():
        x = r["extrapolated_hours_for_1281167_images"]
        print(f"workers {w}: extrapolated to 1,281,167 images: decode {x['decode_only']} h, "
              f"hash + decode {x['hash_plus_decode']} h")
    out = HERE / "results" / "prepare.json"
    io.write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
