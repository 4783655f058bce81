"""Seconds of `diffrelay fid` for 10,000 images, with 1 and 2 threads decoding and resizing ahead of the extractor.

  python benchmarks/bench_fid_scale.py [--images 10000] [--ref-images 2000] [--threads 1 2] [--size 32]

Offline, so the extractor is diffrelay's seeded random one (128 features, mode clean: every image is
resized to 299x299 by clean-fid's PIL bicubic resize, the part that dominates on a CPU). Each run is the
command the workflow runs, end to end: parent CLI, fresh clean child with a timeout, scoring, JSON.
Also times `diffrelay fid-ref` of the --ref-images dataset (read from images.npy, no PNG copy) with the
largest thread count. Checks that every thread count gives the same FD and KID. Writes
benchmarks/results/fid_scale.json.
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_fid import shapes, write_dataset, write_pngs

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def cpu_seconds() -> float:
    """CPU time of this process's finished children (diffrelay fid and, rolled up into it, its scoring child)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=True)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--ref-images", type=int, default=2000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()

    from diffrelay import io
    from diffrelay.evaluation import extractor

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_fid_scale.") as tmp:
        tmp = Path(tmp)
        data = write_dataset(tmp / "dataset", shapes(args.ref_images, seed=0, size=args.size))
        images = write_pngs(tmp / "images", shapes(args.images, seed=1, size=args.size))
        ext = extractor.build_random(tmp / "random-seed0.pt", seed=0)
        ref = tmp / "reference.npz"
        ref_seconds = timed([BIN / "diffrelay", "fid-ref", "--dataset", data, "--extractor", ext, "--out", ref,
                             "--threads", max(args.threads), "--batch-size", args.batch])
        print(f"fid-ref of {args.ref_images} images from images.npy, {max(args.threads)} threads: {ref_seconds:.1f}s",
              flush=True)
        runs = {}
        for t in args.threads:
            out = tmp / f"fid-{t}.json"
            cpu0 = cpu_seconds()
            seconds = timed([BIN / "diffrelay", "fid", "--images", images, "--ref", ref, "--extractor", ext,
                             "--out", out, "--threads", t, "--batch-size", args.batch])
            r = json.loads(out.read_text())
            cpu = cpu_seconds() - cpu0
            runs[t] = {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
                       "cpu_ms_per_image": round(1000 * cpu / args.images, 2), "scoring_seconds_in_child": r["seconds"],
                       "images_per_second": round(args.images / seconds, 1), "fd": r["fid"], "kid": r["kid"]}
            print(f"threads {t}: {seconds:.1f}s end to end ({r['seconds']:.1f}s scoring in the child, {cpu:.0f} CPU-s), "
                  f"{args.images / seconds:.0f} img/s, FD {r['fid']:.6f}, KID {r['kid']:.6f}")

    first = runs[args.threads[0]]
    report = {
        "images": args.images, "ref_images": args.ref_images, "resolution": args.size, "batch_size": args.batch,
        "extractor": "random (128 features), diffrelay fetch-extractor --extractor random", "mode": "clean",
        "fid_ref_seconds": round(ref_seconds, 2), "fid_ref_threads": max(args.threads),
        "runs": {str(t): r for t, r in runs.items()},
        "same_scores": all(r["fd"] == first["fd"] and r["kid"] == first["kid"] for r in runs.values()),
        "machine": {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
    }
    print(f"same scores for every thread count: {report['same_scores']}; "
          f"load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    out = HERE / "results" / "fid_scale.json"
    io.write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
