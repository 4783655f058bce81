"""Sampling throughput of `diffrelay sample` against a bare loop of network forward passes.

  python benchmarks/bench_sample.py [--images 128] [--steps 8] [--batch 64] [--threads 1] [--resolutions 16 32]

Per resolution, one snapshot (channels 32, channel_mult [1, 2, 2], 4 classes, seeded weights), the same
images, steps, batch and thread count for:
  (a) sample.run() called in-process (snapshot load and check, seeding, ODE, PNG writes, grid, manifest),
      and the `diffrelay sample` CLI timed from launch to exit (adds Python and torch start-up);
  (b) a bare loop doing the same number of network evaluations at the same batch size, nothing else.
ratio = bare seconds / in-process seconds (1.0 = no overhead), wall clock; "cpu ratio" is the same with
process CPU time, which a busy shared machine disturbs less; "net share" is the part of the in-process run
spent inside network forwards, timed in the same run, so load cannot skew it (1 - share = our overhead).
Best of --repeats, run alternately, so load slows both alike; the load average is recorded.
Writes benchmarks/results/sample.json.
"""

import argparse
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
NUM_CLASSES = 4


def make_snapshot(path, resolution):
    from diffrelay import config
    from diffrelay.objectives import edm
    from diffrelay.training import checkpoint

    model = config.validate({"model": {"channels": 32, "channel_mult": [1, 2, 2], "class_conditional": True}})["model"]
    net = edm.build(model, resolution, NUM_CLASSES)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():  # the zero-initialised output layers would make a trivially flat model
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    meta = {"step": 1000, "model": model, "image_shape": [3, resolution, resolution], "num_classes": NUM_CLASSES,
            "class_names": [f"class{i}" for i in range(NUM_CLASSES)]}
    checkpoint.save_snapshot(path, net.state_dict(), net.state_dict(), meta)


def bare_seconds(snapshot, s) -> tuple[float, float]:
    """Same forward passes (count, rows, dtype, labels) with no seeding, ODE bookkeeping or files."""
    from diffrelay.sampling import sample
    from diffrelay.training import checkpoint

    net, meta = checkpoint.load_snapshot(snapshot)
    rows, batches = sample.forward_rows(s), math.ceil(s.num_images / s.batch_size)
    evals = 2 * s.steps - 1 if s.solver == "heun" else s.steps
    x = torch.randn(rows, *meta["image_shape"])
    labels = torch.arange(rows) % NUM_CLASSES
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for _ in range(batches * evals):
            net(x, torch.full((rows,), 1.0), labels)
    return time.perf_counter() - t0, time.process_time() - c0


def inprocess_seconds(snapshot, out, s) -> tuple[float, float, float]:
    """Wall and CPU seconds of sample.run(), and the wall seconds spent inside network forwards during it."""
    from diffrelay.objectives import edm
    from diffrelay.sampling import sample

    forward, inside = edm.Denoiser.forward, [0.0]

    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return forward(self, *a, **k)
        finally:
            inside[0] += time.perf_counter() - t

    shutil.rmtree(out, ignore_errors=True)
    edm.Denoiser.forward = timed
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        sample.run(snapshot, out, s)
        return time.perf_counter() - t0, time.process_time() - c0, inside[0]
    finally:
        edm.Denoiser.forward = forward


def cli_seconds(snapshot, out, s) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(BIN / "diffrelay"), "sample", "--snapshot", str(snapshot), "--out", str(out),
           "--num-images", str(s.num_images), "--steps", str(s.steps), "--batch-size", str(s.batch_size),
           "--threads", str(s.threads)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr)
    return time.perf_counter() - t0


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--resolutions", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--out", default=str(HERE / "results" / "sample.json"))
    args = ap.parse_args()

    from diffrelay import io
    from diffrelay.sampling import sample

    facts = machine()
    torch.set_num_threads(args.threads)
    s = sample.default_settings(num_images=args.images, steps=args.steps, batch_size=args.batch, threads=args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for res in args.resolutions:
            snap = tmp / f"r{res}.safetensors"
            make_snapshot(snap, res)
            bare_seconds(snap, sample.default_settings(num_images=16, steps=2, batch_size=16))  # warm-up
            bare, ours = [], []
            for _ in range(args.repeats):
                bare.append(bare_seconds(snap, s))
                ours.append(inprocess_seconds(snap, tmp / "out", s))
            cli = cli_seconds(snap, tmp / "cli", s)
            b, o = min(w for w, _ in bare), min(w for w, *_ in ours)
            bc, oc = min(c for _, c in bare), min(c for _, c, _ in ours)
            share = max(f / w for w, _, f in ours)
            rows.append({"resolution": res, "bare_s": round(b, 3), "inprocess_s": round(o, 3), "cli_s": round(cli, 3),
                         "bare_images_per_s": round(args.images / b, 2),
                         "inprocess_images_per_s": round(args.images / o, 2),
                         "cli_images_per_s": round(args.images / cli, 2),
                         "ratio_inprocess": round(b / o, 3), "ratio_cpu_time": round(bc / oc, 3),
                         "network_share_inprocess": round(share, 3),
                         "cli_fixed_cost_s": round(cli - o, 3),
                         "all_bare_s": [round(w, 3) for w, _ in bare],
                         "all_inprocess_s": [round(w, 3) for w, *_ in ours],
                         "all_bare_cpu_s": [round(c, 3) for _, c in bare],
                         "all_inprocess_cpu_s": [round(c, 3) for _, c, _ in ours],
                         "all_inprocess_forward_s": [round(f, 3) for *_, f in ours]})

    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"diffrelay sample: {args.images} images, {args.steps} heun steps, batch {args.batch}, "
          f"{args.threads} thread(s), model channels 32 x [1, 2, 2]")
    print(f"{'res':>4} {'bare img/s':>11} {'in-proc img/s':>14} {'ratio':>6} {'cpu ratio':>10} {'net share':>10} "
          f"{'CLI img/s':>10} {'CLI fixed s':>12}")
    for r in rows:
        print(f"{r['resolution']:>4} {r['bare_images_per_s']:>11.2f} {r['inprocess_images_per_s']:>14.2f} "
              f"{r['ratio_inprocess']:>6.3f} {r['ratio_cpu_time']:>10.3f} {r['network_share_inprocess']:>10.3f} "
              f"{r['cli_images_per_s']:>10.2f} {r['cli_fixed_cost_s']:>12.2f}")
    print(f"goal: ratio >= 0.95; load average {facts['load_average_at_start']} -> {facts['load_average_at_end']}")
    io.write_json(args.out, {"benchmark": "sample", "settings": vars(args), "goal_ratio": 0.95, "results": rows,
                             "machine": facts, "finished": time.time()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
