"""Where the start-up time goes: each `diffrelay` command against `import torch`, and each workflow job's
time before its first and after its last useful work.

  python benchmarks/bench_startup.py [--repeat 3] [--no-importtime] [--no-launcher] [--out PATH]

Set-up, not timed: a tiny run in a temporary folder (shapes, 16 px, 96 images, an 8-channel UNet, the
random-feature FD extractor from `diffrelay fetch-extractor --extractor random`): prepare, a 3-step
train segment, sampling 16 images (2 batches of 8) from its snapshot, and the dataset's reference
statistics (fid-ref).

1. Commands. Each started as `python -m diffrelay ...` (sys.executable, no console script), the list run
   --repeat times in turn so a busy machine slows all alike; the median wall time from launch to exit:
     import torch   `python -c "import torch"`, the floor any command that uses torch pays
     --version      `diffrelay --version`
     validate       `validate --config C`
     prepare        `prepare --config C`, the dataset already up to date
     sample         `sample ...` into the complete sample folder: up to date, it returns early
     fid            `fid ...`: a real scoring of the 16 samples against the reference (its clean child included)
     train          `train --until-step last+1`: exactly one step from the last checkpoint, which it loads,
                    then a snapshot and a checkpoint written (checked: the step's record and checkpoint exist)
   overhead = wall - wall(import torch); goal <= 1 s per command.
2. Imports (--importtime, on by default): each command once more under `python -X importtime`, with
   PYTHONPROFILEIMPORTTIME=1 so a child process (fid's scorer) is profiled too (split per process at its
   header line). Listed: the modules that `import torch` alone does not import, grouped by top-level package
   (torch's own sub-packages as torch.<name>; torch's core and diffrelay left out of the top 15), with the
   cumulative microseconds of each group's outermost imports; torch._dynamo, torch._inductor and sympy
   are always listed (0 when absent): lazy parts of torch a command may pull in without needing them.
3. Workflow jobs, from the jobs' own records (wall clock, `time.time()` on both sides):
     train   a 5-step segment (log_every 1) by `python -m diffrelay train`, and (unless --no-launcher) by
             `diffrelay launch --standalone --nproc-per-node 1 -m diffrelay train` as the workflow starts it.
             From metrics/train.jsonl: start-up = first step record - launch - one step (the median interval
             between step records); shut-down = exit - last step record (snapshot, checkpoint, exit), split by
             the segment_start / segment_end records. Goal: total - steps x step time <= 3 s.
     sample  16 images into a fresh folder. Its manifest.json holds `started` (sample.run() entered) and
             `finished` (manifest written); no record times the first or last batch, so the useful work is
             the batches x one batch (network passes and PNG encoding) measured warm in this process.
     fid     the timed `fid` runs: the result's `started`/`finished` (the child's score_all), against the
             same scoring called warm in this process (extractor load included).
Writes benchmarks/results/startup.json and prints markdown tables.

  python benchmarks/bench_startup.py --pipeline [--repeat 3] [--out PATH]

4. A pipeline run instead (issue 65): a LoRA of the tests' tiny FLUX.1 pipeline (tests/pipelines.py, built from
   configs, nothing downloaded), the run a FLUX.1 newcomer starts with. Timed, median of --repeat: `import torch`;
   `validate` and `snakemake -n` with an empty `<resources>/validate/` (cold: the network built once, diffusers,
   transformers and peft imported) and with it filled by the run before (warm: what every later `validate`, every
   Snakemake parse and so every workflow job pays); `prepare` up to date; and one `train` step from the last
   checkpoint (a job that builds the pipeline's network and so imports diffusers). Writes
   benchmarks/results/startup_pipeline.json.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
PY = sys.executable
BIN = Path(PY).parent

TINY = {
    "run": {"name": "tiny", "seed": 0, "device": "cpu"},
    "data": {"kind": "shapes", "resolution": 16, "count": 96, "seed": 0},
    "model": {"channels": 8, "channel_mult": [1, 2], "num_blocks": 1, "class_conditional": True},
    "train": {"total_steps": 1000, "segment_steps": 3, "batch_size": 8, "lr": 0.002, "warmup_steps": 2,
              "log_every": 1, "threads": 1},
    "sample": {"num_images": 16, "steps": 3, "batch_size": 8, "threads": 1},
    "fid": {"extractor": "random", "batch_size": 16, "threads": 1},
}
SAMPLE_FLAGS = ["--num-images", 16, "--steps", 3, "--batch-size", 8, "--threads", 1]
SETUP_STEPS = 3  # the set-up segment; timed train runs go one step past the last checkpoint
JOB_STEPS = 5  # steps of the per-job training segments
LAZY = ("torch._dynamo", "torch._inductor", "sympy")
TOP = 15


def cli(*args) -> list[str]:
    return [PY, "-m", "diffrelay", *map(str, args)]


def environment() -> dict:
    """This environment with the venv first on PATH and no profiling or process-group variables."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPROFILEIMPORTTIME" and not k.startswith(("TORCHELASTIC_", "SLURM_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


class Runner:
    def __init__(self, cwd: Path):
        self.cwd, self.env = cwd, environment()

    def __call__(self, cmd, env_extra=None) -> dict:
        """Run cmd to its end; wall seconds (perf_counter) and launch/exit epoch seconds (time.time)."""
        env = self.env | (env_extra or {})
        launch, t0 = time.time(), time.perf_counter()
        p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=self.cwd)
        wall, end = time.perf_counter() - t0, time.time()
        if p.returncode:
            sys.exit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return {"wall": wall, "launch": launch, "exit": end, "stdout": p.stdout, "stderr": p.stderr}


# ---------------------------------------------------------------------------------------------- imports

def parse_importtime(stderr: str) -> list[list[tuple[int, int, int, str]]]:
    """Per process (split at each `import time: self [us]` header): (depth, self_us, cumulative_us, name),
    in the order printed (children before their parent)."""
    procs, cur = [], None
    for line in stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        if "self [us]" in line:
            cur = []
            procs.append(cur)
            continue
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)", line)
        if m and cur is not None:
            cur.append((len(m.group(3)) // 2, int(m.group(1)), int(m.group(2)), m.group(4)))
    return procs


def group(name: str) -> str:
    """Top-level package; torch.<sub> for torch's sub-packages (torch.utils.<sub> for torch.utils's)."""
    parts = name.split(".")
    if parts[0] != "torch" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:3] if parts[1] == "utils" and len(parts) > 2 else parts[:2])


def parents(entries) -> list[int | None]:
    """Index of each entry's parent (None at depth 0): printing is post-order, a parent follows its children."""
    parent = [None] * len(entries)
    open_ = []  # indices waiting for their parent
    for i, (depth, *_) in enumerate(entries):
        while open_ and entries[open_[-1]][0] > depth:
            parent[open_.pop()] = i
        open_.append(i)
    return parent


def importer(entries, parent, i) -> str:
    """Who pulled entry i in: its innermost diffrelay ancestor, else "outermost ... direct parent"; an import
    that ran in a function after start-up has no ancestor ("run time")."""
    chain = []
    while parent[i] is not None:
        i = parent[i]
        chain.append(entries[i][3])
    if not chain:
        return "run time"
    return next((n for n in chain if n.startswith("diffrelay")),
                chain[0] if len(chain) == 1 else f"{chain[-1]} ... {chain[0]}")


def import_summary(entries, baseline: set[str]) -> dict:
    """What this process imports beyond `import torch`'s modules, grouped (see the module docstring)."""
    total = sum(cum for depth, _, cum, _ in entries if depth == 0)
    extra = [e for e in entries if e[3] not in baseline]
    groups: dict[str, int] = {}
    via: dict[str, tuple[int, str]] = {}  # group: (largest outermost import, who imported it)
    up = parents(entries)
    for i, (depth, self_us, cum, name) in enumerate(entries):
        g, p = group(name), None if up[i] is None else entries[up[i]][3]
        if name in baseline:
            continue  # `import torch` imports it as well
        if p is not None and p not in baseline and group(p) == g:
            continue  # counted in the outermost new import of its group
        groups[g] = groups.get(g, 0) + cum
        if cum > via.get(g, (-1, ""))[0]:
            via[g] = (cum, importer(entries, up, i))
    diffrelay_self = sum(s for _, s, _, n in extra if group(n) == "diffrelay")
    top = sorted(((g, us) for g, us in groups.items() if g not in ("torch", "diffrelay")), key=lambda x: -x[1])
    return {"modules": len(entries), "total_import_s": round(total / 1e6, 3),
            "modules_beyond_import_torch": len(extra),
            "self_s_beyond_import_torch": round(sum(s for _, s, _, _ in extra) / 1e6, 3),
            "diffrelay_self_s": round(diffrelay_self / 1e6, 3),
            "top": [{"group": g, "cumulative_s": round(us / 1e6, 3), "via": via[g][1]} for g, us in top[:TOP]],
            "lazy_torch": {g: round(groups.get(g, 0) / 1e6, 3) for g in LAZY},
            "lazy_torch_via": {g: via[g][1] for g in LAZY if g in via},
            "imports_torch": any(n == "torch" for *_, n in entries)}


# ---------------------------------------------------------------------------------------------- jobs

def step_records(metrics: Path, launch: float, end: float) -> tuple[list[dict], dict, dict]:
    from diffrelay import logs

    recs = [r for r in logs.read_jsonl(metrics) if launch <= r["time"] <= end]
    steps = [r for r in recs if "event" not in r]
    start = next(r for r in recs if r.get("event") == "segment_start")
    finish = next(r for r in recs if r.get("event") == "segment_end")
    return steps, start, finish


def train_job(run, cmd, metrics: Path, until: int, ckpt_dir: Path) -> dict:
    r = run(cmd)
    steps, start, finish = step_records(metrics, r["launch"], r["exit"])
    if not steps or steps[-1]["step"] != until or not (ckpt_dir / f"step_{until:07d}" / "manifest.json").is_file():
        sys.exit(f"{' '.join(map(str, cmd))}: no step record or checkpoint at step {until}:\n{r['stderr'][-2000:]}")
    times = [s["time"] for s in steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    step_s = statistics.median(gaps) if gaps else None
    out = {"wall_s": r["wall"], "steps": len(steps), "launch_to_segment_start_s": start["time"] - r["launch"],
           "first_step_record_after_launch_s": times[0] - r["launch"],
           "last_step_record_to_exit_s": r["exit"] - times[-1],
           "snapshot_write_s": finish["time"] - finish["save_seconds"] - times[-1],
           "checkpoint_save_s": finish["save_seconds"], "segment_end_to_exit_s": r["exit"] - finish["time"],
           "step_intervals_s": [round(g, 4) for g in gaps]}
    if step_s is not None:
        out |= {"median_step_s": step_s, "first_step_s": times[0] - start["time"],
                "startup_s": times[0] - r["launch"] - step_s,
                "segment_start_to_first_step_s": times[0] - start["time"] - step_s,
                "shutdown_s": r["exit"] - times[-1],
                "beyond_loop_s": r["wall"] - len(steps) * step_s}
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def warm_batch_seconds(snapshot: Path, repeats: int = 3) -> float:
    """One batch of 8 images (network passes, PNG encoding) in this warm process, median of `repeats`."""
    import torch

    from diffrelay.sampling import sample
    from diffrelay.training import checkpoint

    torch.set_num_threads(1)
    net, meta = checkpoint.load_snapshot(snapshot)
    s = sample.default_settings(num_images=16, steps=3, batch_size=8, threads=1)

    def once():
        t0 = time.perf_counter()
        for _, pixels in sample.generate(net, meta, range(8), s):
            sample.encode_png(pixels)
        return time.perf_counter() - t0

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def warm_fid_seconds(images, ref, ext, repeats: int = 2) -> float:
    """The `fid` child's score_all called in this warm process (extractor load included), median of `repeats`."""
    import logging

    import torch

    from diffrelay.evaluation import fid

    torch.set_num_threads(1)
    logging.getLogger("diffrelay").setLevel(logging.ERROR)  # 16 images for 128 features: a warning each call

    def once():
        t0 = time.perf_counter()
        fid.score_all(images, [(str(ext), str(ref))], "clean", 16, workers=1, device="cpu")
        return time.perf_counter() - t0

    once()
    return statistics.median(once() for _ in range(repeats))


# ---------------------------------------------------------------------------------------------- main

def machine() -> dict:
    from bench_sample import machine as described  # the same record as the other benchmarks (imports torch)

    return described()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each command, alternating [3]")
    ap.add_argument("--no-importtime", dest="importtime", action="store_false",
                    help="skip the `python -X importtime` pass")
    ap.add_argument("--no-launcher", dest="launcher", action="store_false",
                    help="skip the training job started through `diffrelay launch` (torchrun)")
    ap.add_argument("--keep", metavar="DIR", help="build in this new or empty folder and keep it "
                    "(default: a temporary one)")
    ap.add_argument("--pipeline", action="store_true", help="time a tiny FLUX.1 LoRA run's commands instead (4.)")
    ap.add_argument("--out", default=None, help="[results/startup.json; results/startup_pipeline.json]")
    args = ap.parse_args()
    if args.pipeline:
        return pipeline_startup(args)
    args.out = args.out or str(HERE / "results" / "startup.json")
    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        ap.error(f"--keep {args.keep}: not empty; give a new or empty folder")
    began = time.perf_counter()
    facts = machine()

    with tempfile.TemporaryDirectory(prefix="bench_startup.") as tmp:
        tmp = Path(args.keep or tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        run = Runner(tmp)
        cfg = tmp / "config.yaml"
        d = TINY | {"run": TINY["run"] | {"results": str(tmp / "results"), "resources": str(tmp / "resources")}}
        cfg.write_text(yaml.safe_dump(d, sort_keys=False))
        run_dir = tmp / "results" / "tiny"
        ext = tmp / "resources" / "extractors" / "random-seed0.pt"
        snap = run_dir / "snapshots" / f"step_{SETUP_STEPS:07d}.safetensors"
        samples = run_dir / "samples" / f"step_{SETUP_STEPS:07d}"
        ref = run_dir / "fid" / "reference_random-seed0.npz"
        metrics = run_dir / "metrics" / "train.jsonl"

        # ---- set-up (not timed) ----
        t0 = time.perf_counter()
        run(cli("fetch-extractor", "--extractor", "random", "--seed", 0, "--out", ext))
        run(cli("prepare", "--config", cfg))
        run(cli("train", "--config", cfg, "--until-step", SETUP_STEPS))
        run(cli("sample", "--config", cfg, "--snapshot", snap, "--out", samples, *SAMPLE_FLAGS))
        run(cli("fid-ref", "--dataset", run_dir / "dataset", "--extractor", ext, "--mode", "clean",
                "--batch-size", 16, "--threads", 1, "--device", "cpu", "--cache-dir", tmp / "resources" / "fid-ref",
                "--out", ref))
        setup_s = time.perf_counter() - t0
        print(f"set-up {setup_s:.1f} s in {tmp}", flush=True)

        last = [SETUP_STEPS]
        fid_out = tmp / "fid.json"

        def train_cmd():
            last[0] += 1
            return cli("train", "--config", cfg, "--until-step", last[0])

        commands = {
            "import torch": lambda: [PY, "-c", "import torch"],
            "--version": lambda: cli("--version"),
            "validate": lambda: cli("validate", "--config", cfg),
            "prepare": lambda: cli("prepare", "--config", cfg),
            "sample": lambda: cli("sample", "--config", cfg, "--snapshot", snap, "--out", samples, *SAMPLE_FLAGS),
            "fid": lambda: cli("fid", "--images", samples, "--extractor", ext, "--ref", ref, "--mode", "clean",
                               "--batch-size", 16, "--threads", 1, "--device", "cpu", "--out", fid_out),
            "train": train_cmd,
        }
        expect = {"prepare": "up to date", "sample": "up to date"}

        def run_command(name, env_extra=None):
            cmd = commands[name]()
            r = run(cmd, env_extra)
            if name in expect and expect[name] not in r["stderr"] + r["stdout"]:
                sys.exit(f"{name}: expected {expect[name]!r} in its output:\n{r['stderr'][-2000:]}")
            if name == "train":
                # It really trained one step: a step record and a checkpoint at the new step, from this launch.
                job = train_job(lambda _c: r, cmd, metrics, last[0], run_dir / "checkpoints")
                if job["steps"] != 1:
                    sys.exit(f"train --until-step {last[0]}: {job['steps']} step records, expected 1")
                r["job"] = job
            if name == "fid":
                r["job"] = {k: v for k, v in json.loads(fid_out.read_text()).items()
                            if k in ("started", "finished", "seconds", "fid", "num_images")}
            return r

        # ---- 1. commands, alternating ----
        walls = {k: [] for k in commands}
        train_runs, fid_runs = [], []
        for _ in range(args.repeat):
            for name in commands:
                r = run_command(name)
                walls[name].append(r["wall"])
                if name == "train":
                    train_runs.append(r["job"])
                if name == "fid":
                    fid_runs.append(r | {"stdout": "", "stderr": ""})
        med = {k: statistics.median(v) for k, v in walls.items()}
        base = med["import torch"]
        rows = [{"command": k, "median_s": round(med[k], 3), "overhead_s": round(med[k] - base, 3),
                 "runs_s": [round(w, 3) for w in walls[k]], "argv": [str(a) for a in commands[k]()[1:]]
                 if k != "train" else ["-m", "diffrelay", "train", "--config", str(cfg), "--until-step", "<last+1>"]}
                for k in commands]
        print(f"commands done ({time.perf_counter() - began:.0f} s)", flush=True)

        # ---- 2. imports ----
        imports = {}
        if args.importtime:
            for name in commands:
                cmd = commands[name]()
                r = run([cmd[0], "-X", "importtime", *cmd[1:]], {"PYTHONPROFILEIMPORTTIME": "1"})
                procs = parse_importtime(r["stderr"])
                if name == "import torch":
                    baseline = {n for *_, n in procs[0]}
                imports[name] = [import_summary(p, baseline if name != "import torch" else set()) for p in procs]
            print(f"imports done ({time.perf_counter() - began:.0f} s)", flush=True)

        # ---- 3. workflow jobs ----
        jobs = {}
        until = last[0] + JOB_STEPS
        jobs["train (python -m diffrelay train)"] = train_job(
            run, cli("train", "--config", cfg, "--until-step", until), metrics, until, run_dir / "checkpoints")
        last[0] = until
        if args.launcher:
            until = last[0] + JOB_STEPS
            jobs["train (diffrelay launch, as the workflow)"] = train_job(
                run, cli("launch", "--standalone", "--nproc-per-node", 1, "-m", "diffrelay", "train", "--config", cfg,
                         "--until-step", until), metrics, until, run_dir / "checkpoints")
            last[0] = until
        jobs["train (1 step, the timed runs: median)"] = {
            k: round(statistics.median(j[k] for j in train_runs), 3)
            for k in ("wall_s", "launch_to_segment_start_s", "first_step_record_after_launch_s",
                      "last_step_record_to_exit_s", "snapshot_write_s", "checkpoint_save_s", "segment_end_to_exit_s")}

        fresh = run_dir / "samples" / "job"
        r = run(cli("sample", "--config", cfg, "--snapshot", snap, "--out", fresh, *SAMPLE_FLAGS))
        manifest = json.loads((fresh / "manifest.json").read_text())
        batch_s = warm_batch_seconds(snap)
        batches = 2
        jobs["sample (16 images, 2 batches)"] = {k: round(v, 3) for k, v in {
            "wall_s": r["wall"], "warm_batch_s": batch_s, "work_s": batches * batch_s,
            "launch_to_run_started_s": manifest["started"] - r["launch"],
            "run_started_to_finished_s": manifest["finished"] - manifest["started"],
            "run_overhead_s": manifest["finished"] - manifest["started"] - batches * batch_s,
            "manifest_finished_to_exit_s": r["exit"] - manifest["finished"],
            "beyond_work_s": r["wall"] - batches * batch_s}.items()}
        jobs["sample (16 images, 2 batches)"]["note"] = (
            "no record times the first or last batch: start-up and shut-down are not separable inside "
            "run(); work = batches x one batch measured warm in the benchmark process")

        warm = warm_fid_seconds(samples, ref, ext)
        fr = [{"wall_s": f["wall"], "launch_to_started_s": f["job"]["started"] - f["launch"],
               "started_to_finished_s": f["job"]["finished"] - f["job"]["started"],
               "finished_to_exit_s": f["exit"] - f["job"]["finished"]} for f in fid_runs]
        jobs["fid (16 images, the timed runs: median)"] = {
            **{k: round(statistics.median(x[k] for x in fr), 3) for k in fr[0]},
            "warm_score_s": round(warm, 3),
            "beyond_work_s": round(statistics.median(x["wall_s"] for x in fr) - warm, 3),
            "note": "started/finished: the scoring child's score_all (extractor load, features, distances); "
                    "work = the same call in the warm benchmark process"}

    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    total_s = time.perf_counter() - began
    train_job_key = "train (python -m diffrelay train)"

    # ---- print ----
    print(f"\n## Commands (median of {args.repeat}, alternating; wall s from launch to exit)\n")
    print("| command | median s | overhead vs import torch s | runs s |")
    print("|---|---:|---:|---|")
    for row in rows:
        print(f"| {row['command']} | {row['median_s']:.2f} | {row['overhead_s']:+.2f} | "
              f"{', '.join(f'{w:.2f}' for w in row['runs_s'])} |")
    print("\ngoal: overhead <= 1 s per command")
    if imports:
        print("\n## Imports beyond `import torch` (python -X importtime; cumulative s of each group's outermost "
              "imports; one run)\n")
        print("| command | process | total import s | beyond import torch: modules, self s | diffrelay self s | "
              + " | ".join(LAZY) + " |")
        print("|---|---:|---:|---:|---:|" + "---:|" * len(LAZY))
        for name, procs in imports.items():
            for i, p in enumerate(procs):
                print(f"| {name} | {i} | {p['total_import_s']:.2f} | {p['modules_beyond_import_torch']}, "
                      f"{p['self_s_beyond_import_torch']:.2f} | {p['diffrelay_self_s']:.2f} | "
                      + " | ".join(f"{p['lazy_torch'][g]:.2f}" for g in LAZY) + " |")
        print(f"\nTop {TOP} groups beyond `import torch` per command and process (cumulative s, imported via):\n")
        for name, procs in imports.items():
            for i, p in enumerate(procs):
                tops = ", ".join(f"{t['group']} {t['cumulative_s']:.3f} ({t['via']})" for t in p["top"]) or "-"
                print(f"- {name} [{i}]: {tops}")
    print("\n## Workflow jobs (s)\n")
    print("| job | wall | start-up: launch to first useful work | shut-down: last useful work to exit | useful work | "
          "beyond work |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, j in jobs.items():
        if name.startswith("train (1 step"):
            print(f"| {name} | {j['wall_s']:.2f} | launch to segment_start {j['launch_to_segment_start_s']:.2f}; "
                  f"first step record {j['first_step_record_after_launch_s']:.2f} | "
                  f"{j['last_step_record_to_exit_s']:.2f} (snapshot {j['snapshot_write_s']:.2f}, "
                  f"checkpoint {j['checkpoint_save_s']:.2f}, exit {j['segment_end_to_exit_s']:.2f}) | 1 step | - |")
        elif name.startswith("train"):
            print(f"| {name} | {j['wall_s']:.2f} | {j['startup_s']:.2f} (to segment_start "
                  f"{j['launch_to_segment_start_s']:.2f}, then {j['segment_start_to_first_step_s']:.2f}; first step "
                  f"{j['first_step_s']:.2f} vs median {j['median_step_s']:.3f}) | {j['shutdown_s']:.2f} (snapshot "
                  f"{j['snapshot_write_s']:.2f}, checkpoint {j['checkpoint_save_s']:.2f}, exit "
                  f"{j['segment_end_to_exit_s']:.2f}) | {j['steps']} x {j['median_step_s']:.3f} | "
                  f"{j['beyond_loop_s']:.2f} |")
        elif name.startswith("sample"):
            print(f"| {name} | {j['wall_s']:.2f} | launch to run() {j['launch_to_run_started_s']:.2f}; inside run() "
                  f"beyond the batches {j['run_overhead_s']:.2f} (start and end not separable) | manifest to exit "
                  f"{j['manifest_finished_to_exit_s']:.2f} | 2 x {j['warm_batch_s']:.3f} (warm) | "
                  f"{j['beyond_work_s']:.2f} |")
        else:
            print(f"| {name} | {j['wall_s']:.2f} | launch to score_all {j['launch_to_started_s']:.2f} | "
                  f"score_all end to exit {j['finished_to_exit_s']:.2f} | {j['warm_score_s']:.2f} warm "
                  f"(score_all in the child {j['started_to_finished_s']:.2f}) | {j['beyond_work_s']:.2f} |")
    print(f"\ngoal: a training job <= 3 s beyond its loop ({train_job_key}: "
          f"{jobs[train_job_key]['beyond_loop_s']:.2f} s)")
    print(f"load average {facts['load_average_at_start']} -> {facts['load_average_at_end']}; "
          f"set-up {setup_s:.0f} s, whole script {total_s:.0f} s")

    from diffrelay import io

    io.write_json(args.out, {
        "benchmark": "startup", "settings": vars(args), "config": TINY, "goal_command_overhead_s": 1.0,
        "goal_train_beyond_loop_s": 3.0, "import_torch_s": round(base, 3), "commands": rows, "imports": imports,
        "jobs": jobs, "train_runs_1_step": train_runs, "setup_s": round(setup_s, 3), "total_s": round(total_s, 3),
        "machine": facts,
        "finished": time.time()})
    print(f"wrote {args.out}")


def pipeline_startup(args) -> None:
    """Section 4 of the docstring: a tiny FLUX.1 LoRA run's commands, cold and warm."""
    import shutil

    sys.path.insert(0, str(HERE.parent / "tests"))
    import pipelines  # the tests' tiny pipelines, written by diffusers' own save_pretrained

    began, facts = time.perf_counter(), machine()
    with tempfile.TemporaryDirectory(prefix="bench_startup_pipeline.") as tmp:
        tmp = Path(tmp)
        pipe = pipelines.flux(tmp / "flux")
        d = {"run": {"name": "flux-lora", "results": str(tmp / "results"), "resources": str(tmp / "resources"),
                     "device": "cpu"},
             "data": {"kind": "shapes", "count": 16, "resolution": 16, "captions": "auto", "val_fraction": 0.25},
             "model": {"pretrained": str(pipe)},
             "train": {"total_steps": 1000, "segment_steps": 2, "batch_size": 4, "log_every": 1, "warmup_steps": 1,
                       "lr": 0.01, "lora": {"rank": 2}, "threads": 1},
             "sample": {"steps": 2, "batch_size": 4}, "fid": {"extractor": "random", "batch_size": 16}}
        cfg = tmp / "flux-lora.yaml"
        cfg.write_text(yaml.safe_dump(d, sort_keys=False))
        run, cache = Runner(tmp), tmp / "resources" / "validate"
        run(cli("prepare", "--config", cfg))
        run(cli("train", "--config", cfg, "--until-step", 1))
        last = [1]

        def train_cmd():
            last[0] += 1
            return cli("train", "--config", cfg, "--until-step", last[0])

        snake = [str(BIN / "snakemake"), "-n", "-q", "--cores", "1", "-s", str(HERE.parent / "Snakefile"),
                 "-d", str(tmp), "--configfile", str(cfg)]
        commands = {"import torch": ([PY, "-c", "import torch"], False),
                    "validate, cold": (cli("validate", "--config", cfg), True),
                    "validate, warm": (cli("validate", "--config", cfg), False),
                    "snakemake -n, cold": (snake, True), "snakemake -n, warm": (snake, False),
                    "prepare (up to date)": (cli("prepare", "--config", cfg), False),
                    "train (1 step)": (None, False)}
        walls = {k: [] for k in commands}
        for _ in range(args.repeat):
            for name, (cmd, cold) in commands.items():
                if cold:
                    shutil.rmtree(cache, ignore_errors=True)
                walls[name].append(run(cmd or train_cmd())["wall"])
    base = statistics.median(walls["import torch"])
    rows = [{"command": k, "median_s": round(statistics.median(v), 3),
             "overhead_s": round(statistics.median(v) - base, 3), "runs_s": [round(w, 3) for w in v]}
            for k, v in walls.items()]
    print(f"\n## A tiny FLUX.1 LoRA run's commands (median of {args.repeat}, alternating; wall s)\n")
    print("| command | median s | overhead vs import torch s | runs s |")
    print("|---|---:|---:|---|")
    for row in rows:
        print(f"| {row['command']} | {row['median_s']:.2f} | {row['overhead_s']:+.2f} | "
              f"{', '.join(f'{w:.2f}' for w in row['runs_s'])} |")
    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = args.out or str(HERE / "results" / "startup_pipeline.json")
    from diffrelay import io

    io.write_json(out, {"benchmark": "startup_pipeline", "settings": vars(args), "config": d,
                        "goal_command_overhead_s": 1.0, "import_torch_s": round(base, 3), "commands": rows,
                        "machine": facts, "total_s": round(time.perf_counter() - began, 3), "finished": time.time()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
