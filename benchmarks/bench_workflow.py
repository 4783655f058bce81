"""The demo end to end: diffrelay's workflow against the in-loop design, on the same work.

  python benchmarks/bench_workflow.py [--config config/config.yaml] [--cores 2]

(a) `snakemake --cores N` on the demo config: wall time, and how much of it training jobs ran.
(b) One process that trains each segment, then samples and scores its checkpoint, in sequence,
    with all N cores (the in-loop design, minus its hangs). Same data, model, steps, images, FD.
Writes benchmarks/results/workflow.json.
"""

import argparse
import csv
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent


def workflow_run(cfg_path: Path, tmp: Path, cores: int) -> dict:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    t0 = time.time()
    subprocess.run([str(BIN / "snakemake"), "--cores", str(cores), "--configfile", str(cfg_path),
                    "--directory", str(tmp), "--snakefile", str(REPO / "Snakefile"), "--quiet", "all"],
                   check=True, env=env, cwd=tmp, capture_output=True)
    wall = time.time() - t0
    run = yaml.safe_load(cfg_path.read_text())["run"]["name"]
    train_s = 0.0
    for tsv in (tmp / "logs" / run / "benchmarks" / "train_segment").glob("*.tsv"):
        with open(tsv) as f:
            train_s += float(next(csv.DictReader(f, delimiter="\t"))["s"])
    return {"wall_s": round(wall, 1), "train_jobs_s": round(train_s, 1),
            "training_busy_fraction": round(train_s / wall, 3)}


def in_loop_run(cfg: dict, tmp: Path, cores: int) -> dict:
    """Train a segment, then sample and score it, in this one process; repeat."""
    from diffrelay import config
    from diffrelay.evaluation import extractor, fid
    from diffrelay.sampling import sample
    from diffrelay.training import train

    cfg = {**cfg, "run": {**cfg["run"], "results": str(tmp / "results"), "resources": str(tmp / "resources")}}
    for section in ("train", "sample", "fid"):
        cfg[section] = {**cfg.get(section, {}), "threads": cores}  # one process: give it every core
    c = config.Config(config.validate(cfg))
    rd = config.run_dir(c)
    t0 = time.time()
    _prepare(c)
    ext = Path(c.run.resources) / "extractors" / f"random-seed{c.run.seed}.pt"
    extractor.build_random(ext, seed=c.run.seed)
    ref = rd / "fid" / "reference.npz"
    fid.make_ref(rd / "dataset", ext, ref, mode=c.fid.mode, num=c.fid.ref_images, batch_size=c.fid.batch_size,
                 cache_dir=None, workers=c.fid.threads)
    train_s, scores = 0.0, []
    settings = sample.default_settings(**{k: v for k, v in c.to_dict()["sample"].items() if k != "nproc"})
    for end in config.segment_ends(c):
        t = time.time()
        train.run(c, until_step=end)
        train_s += time.time() - t
        snap = rd / "snapshots" / f"step_{end:07d}.safetensors"
        out = rd / "samples" / f"step_{end:07d}"
        sample.run(snap, out, settings)
        scores.append(fid.score(out, ref, ext, c.fid.mode, c.fid.batch_size, workers=c.fid.threads)["fid"])
    wall = time.time() - t0
    return {"wall_s": round(wall, 1), "train_s": round(train_s, 1),
            "training_busy_fraction": round(train_s / wall, 3), "scores": [round(s, 4) for s in scores]}


def _prepare(c):
    from diffrelay import config, io
    from diffrelay.data import datasets

    with io.atomic_dir(config.run_dir(c) / "dataset") as tmp:
        datasets.build(datasets.plan(c.data), tmp, workers=c.fid.threads)  # every core, as fid above


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "config" / "config.yaml"))
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "workflow.json"))
    args = ap.parse_args()
    base = yaml.safe_load(Path(args.config).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "wf").mkdir()
        cfg = {**base, "run": {**base["run"], "results": str(tmp / "wf" / "results"),
                               "resources": str(tmp / "wf" / "resources")}}
        cfg_path = tmp / "wf" / "bench.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        ours = workflow_run(cfg_path, tmp / "wf", args.cores)
        (tmp / "loop").mkdir()
        loop = in_loop_run(base, tmp / "loop", args.cores)
        shutil.rmtree(tmp / "wf", ignore_errors=True)
    result = {
        "diffrelay_workflow": ours,
        "in_loop_one_process": loop,
        "wall_ratio_in_loop_over_workflow": round(loop["wall_s"] / ours["wall_s"], 3),
        "settings": {"config": args.config, "cores": args.cores},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average": [round(x, 2) for x in os.getloadavg()]},
    }
    print(f"workflow : {ours['wall_s']:7.1f} s wall, training jobs {ours['train_jobs_s']:.1f} s "
          f"({ours['training_busy_fraction']:.0%} of wall)")
    print(f"in-loop  : {loop['wall_s']:7.1f} s wall, training {loop['train_s']:.1f} s "
          f"({loop['training_busy_fraction']:.0%} of wall)")
    print(f"ratio in-loop / workflow wall time: {result['wall_ratio_in_loop_over_workflow']:.2f}")
    from diffrelay import io

    io.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
