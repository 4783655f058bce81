"""Wall time of `diffrelay fid` (as the workflow runs it) against calling clean-fid directly, on the same data.

  python benchmarks/bench_fid.py [--images 500] [--ref-images 1000] [--repeats 3] [--threads 2]

Same folder (16x16 shapes), same reference statistics, same random extractor, same batch and thread
count, in one run of this script, alternating:
  diffrelay    `diffrelay fid` end to end: CLI process, checks, fresh clean child, scoring, JSON
  direct-new   the minimal clean-fid script in a fresh python process: get_folder_features,
               frechet_distance, kernel_distance against the same reference arrays
  direct-warm  the same clean-fid calls inside this (already warm) process: no imports at all
The gap diffrelay - direct-new is our overhead (parent CLI process + checks); direct-new - direct-warm
is the price of any fresh process (imports). Writes benchmarks/results/fid.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent

# The minimal direct clean-fid path; argv: folder, ref.npz, extractor, threads, batch.
DIRECT = """
import sys, numpy as np, torch
from cleanfid.fid import get_folder_features, frechet_distance, kernel_distance
folder, ref, ext, threads, batch = sys.argv[1:6]
torch.set_num_threads(int(threads))
model = torch.jit.load(ext).eval()
feats = get_folder_features(folder, model, num_workers=0, batch_size=int(batch), device=torch.device("cpu"),
                            mode="clean", verbose=False)
z = np.load(ref)
np.random.seed(0)
print(frechet_distance(feats.mean(0), np.cov(feats, rowvar=False), z["mu"], z["sigma"]),
      kernel_distance(z["features"], feats))
"""


def shapes(n, seed, size=16):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    for _ in range(n):
        img = np.empty((size, size, 3), np.uint8)
        img[:] = rng.integers(0, 80, 3)
        cx, cy = rng.integers(3, size - 3, 2)
        r = rng.integers(2, 6)
        mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r if rng.random() < 0.5 else (abs(xx - cx) <= r) & (abs(yy - cy) <= r)
        img[mask] = rng.integers(120, 256, 3)
        yield img


def write_pngs(folder: Path, imgs) -> Path:
    folder.mkdir(parents=True)
    for i, img in enumerate(imgs):
        Image.fromarray(img).save(folder / f"{i:06d}.png")
    return folder


def write_dataset(folder: Path, imgs) -> Path:
    """A prepared dataset folder (images.npy, labels.npy, dataset.json), as `diffrelay prepare` writes one."""
    from diffrelay import io

    images = np.stack(list(imgs))
    folder.mkdir(parents=True)
    np.save(folder / "images.npy", images)
    np.save(folder / "labels.npy", np.zeros(len(images), np.int64))
    io.write_json(folder / "dataset.json", {"format": "diffrelay-dataset/1", "fingerprint": "0" * 64,
                                            "count": len(images), "resolution": images.shape[1], "num_classes": 0,
                                            "class_names": []})
    return folder


def timed(cmd) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--ref-images", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()

    import torch
    from cleanfid.fid import frechet_distance, get_folder_features, kernel_distance

    from diffrelay import io
    from diffrelay.evaluation import extractor, fid

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_fid.") as tmp:
        tmp = Path(tmp)
        data = tmp / "dataset"
        write_dataset(data, shapes(args.ref_images, seed=0))
        images = write_pngs(tmp / "images", shapes(args.images, seed=1))
        ext = extractor.build_random(tmp / "random-seed0.pt", seed=0)
        t0 = time.perf_counter()
        ref = fid.make_ref(data, ext, batch_size=args.batch, out=tmp / "reference.npz")
        ref_seconds = time.perf_counter() - t0

        def run_diffrelay():
            out = tmp / "fid.json"
            s, _ = timed([BIN / "diffrelay", "fid", "--images", images, "--ref", ref, "--extractor", ext, "--out", out,
                          "--threads", args.threads, "--batch-size", args.batch])
            r = json.loads(out.read_text())
            return s, r["fid"], r["kid"]

        def run_direct_new():
            s, out = timed([sys.executable, "-c", DIRECT, images, ref, ext, args.threads, args.batch])
            fd, kid = map(float, out.split()[-2:])
            return s, fd, kid

        def run_direct_warm():
            t0 = time.perf_counter()
            model = torch.jit.load(str(ext)).eval()
            feats = get_folder_features(str(images), model, num_workers=0, batch_size=args.batch,
                                        device=torch.device("cpu"), mode="clean", verbose=False)
            z = np.load(ref)
            np.random.seed(0)
            fd = frechet_distance(feats.mean(0), np.cov(feats, rowvar=False), z["mu"], z["sigma"])
            kid = kernel_distance(z["features"], feats)
            return time.perf_counter() - t0, float(fd), float(kid)

        runs = {"diffrelay": run_diffrelay, "direct-new": run_direct_new, "direct-warm": run_direct_warm}
        results = {k: [] for k in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                results[name].append(fn())

        imports = {}
        for name, code in (("parent_cli", "import diffrelay.evaluation.fid"), ("child", "import torch, cleanfid.fid")):
            imports[name] = statistics.median(timed([sys.executable, "-c", code])[0] for _ in range(2))

    med = {k: statistics.median(r[0] for r in v) for k, v in results.items()}
    scores = {k: {"fid": v[0][1], "kid": v[0][2]} for k, v in results.items()}
    report = {
        "images": args.images, "ref_images": args.ref_images, "resolution": 16, "extractor": "random (128 features)",
        "mode": "clean", "threads": args.threads, "batch_size": args.batch, "repeats": args.repeats,
        "seconds": {k: [round(r[0], 3) for r in v] for k, v in results.items()},
        "median_seconds": {k: round(v, 3) for k, v in med.items()},
        "ratio_diffrelay_to_direct_new": round(med["diffrelay"] / med["direct-new"], 3),
        "ratio_diffrelay_to_direct_warm": round(med["diffrelay"] / med["direct-warm"], 3),
        "overhead_vs_direct_new_seconds": round(med["diffrelay"] - med["direct-new"], 3),
        "fresh_process_cost_seconds": round(med["direct-new"] - med["direct-warm"], 3),
        "import_seconds": {k: round(v, 3) for k, v in imports.items()},
        "fid_ref_seconds": round(ref_seconds, 3),
        "scores": scores,
        "same_scores": all(abs(s["fid"] - scores["direct-warm"]["fid"]) <= 1e-6 * max(1, abs(s["fid"]))
                           for s in scores.values()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "clean_fid": _version("clean-fid"),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
    }
    print(f"{'path':<12} {'median s':>9}  runs (s)")
    for k in runs:
        print(f"{k:<12} {med[k]:>9.2f}  {', '.join(f'{r[0]:.2f}' for r in results[k])}")
    print(f"diffrelay / direct-new = {report['ratio_diffrelay_to_direct_new']:.2f}, "
          f"diffrelay / direct-warm = {report['ratio_diffrelay_to_direct_warm']:.2f}; "
          f"imports: parent CLI {imports['parent_cli']:.2f}s, child {imports['child']:.2f}s; "
          f"same scores: {report['same_scores']}; load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    out = HERE / "results" / "fid.json"
    io.write_json(out, report)
    print(f"wrote {out}")


def _version(dist):
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
