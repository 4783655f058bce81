"""Segment start-up with train.compile: cold cache (segment 1), warm cache (segment 2), against eager.

  python benchmarks/bench_compile.py [--config config/config.yaml] [--threads 1]

Runs the demo config's `diffrelay train` as separate processes, exactly as the workflow does, one
step per segment: eager 0->1 and 1->2, then compiled 0->1 (empty cache in a temporary resources/
folder: cold) and 1->2 (the cache segment 1 left: warm). For each it reports the process wall time
(start-up + first step + checkpoint: what a segment pays before training at full speed) and the first
step alone (metrics/train.jsonl `elapsed` at the segment's first step). Writes benchmarks/results/compile.json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent


def config_args(configs):
    return [a for c in configs for a in ("--config", str(c))]  # later files override earlier ones


def segment(configs, until):
    """Wall seconds of one `diffrelay train` segment process."""
    cmd = [str(BIN / "diffrelay"), "train", *config_args(configs), "--until-step", str(until)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return wall


def first_step(metrics: Path, step: int) -> float:
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("step") == step and "elapsed" in rec:
            return rec["elapsed"]
    raise RuntimeError(f"{metrics}: no record for step {step}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "config/config.yaml"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for mode in ("eager", "compile"):
            over = tmp / f"{mode}.yaml"
            over.write_text(yaml.safe_dump({
                "run": {"name": mode, "results": str(tmp / "results"), "resources": str(tmp / "resources"),
                        "device": "cpu"},
                "train": {"compile": mode == "compile", "threads": args.threads, "log_every": 1}}))
            configs = [args.config, over]
            subprocess.run([str(BIN / "diffrelay"), "prepare", *config_args(configs)], check=True, capture_output=True)
            metrics = tmp / "results" / mode / "metrics" / "train.jsonl"
            for seg, until in (("segment1", 1), ("segment2", 2)):
                wall = segment(configs, until)
                rows[f"{mode}_{seg}"] = {"process_seconds": round(wall, 2),
                                         "first_step_seconds": round(first_step(metrics, until), 3)}
                print(f"{mode:8s} {seg}: process {wall:6.2f} s | first step {rows[f'{mode}_{seg}']['first_step_seconds']:7.3f} s",
                      flush=True)
    eager = rows["eager_segment2"]["process_seconds"]
    result = {
        "command": "python benchmarks/bench_compile.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), CPU",
        "config": os.path.relpath(args.config, REPO), "threads": args.threads, **rows,
        "cold_over_eager": round(rows["compile_segment1"]["process_seconds"] / eager, 2),
        "warm_over_eager": round(rows["compile_segment2"]["process_seconds"] / eager, 2),
        "goal_warm_over_eager": 1.2,
    }
    print(f"segment start-up, compiled / eager: cold {result['cold_over_eager']}x, warm {result['warm_over_eager']}x "
          f"(goal <= 1.2x warm)")
    out = HERE / "results" / "compile.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
