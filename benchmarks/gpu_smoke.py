"""GPU smoke checks: what the CPU tests cannot show, measured once, on a bare lent machine.

  make gpu-bundle        # here: build/gpu-bundle.tar.xz, the packages that machine lacks (tools/gpu_bundle.py)
  python3 benchmarks/gpu_smoke.py --out-dir $OUT [--budget 480]      # there, with build/ carried

That machine has Python 3.12 and torch, no network, and gets only what travels with the tree. So this file
imports the standard library and torch alone at the top; it unpacks the bundle, puts it and src/ on
PYTHONPATH, uses the machine's torchvision where there is one (else checks the bundle's pin against the
machine's torch), and starts every stage as `python -m diffrelay`. Each check runs in its own try and is
written to --out-dir/gpu_smoke.json as soon as it ends; none starts past --budget seconds. --device cpu runs
the same sequence on the CPU (tests/test_gpu_smoke.py). The checks:

  0. the environment: versions, nvidia-smi where present, and every package a stage imports;
  1. 2-GPU training, 20 + 20 steps against a straight 40, with train.deterministic on and off: max abs
     weight difference (0 expected with it on, on one GPU model);
  2. sampling on 2 GPUs against 1: PNGs byte-identical?
  3. FID against a foreign (mu, sigma) reference on the GPU: runs, and equals the score against our own file;
  4. a train.channels_last switch between fused segments: max abs difference against no switch;
  5. kill -9 of one rank: seconds until the job ends, and its last line;
  6. with-gpus with the machine's real ids: two concurrent jobs get different GPUs;
  7. a latent dataset (a tiny random AutoencoderKL): encoded by 2 GPU ranks against 1 (same bytes?), against the
     CPU's encode (max abs difference), and the GPU's encode rate;
  8. benchmarks/bench_gpu.py, shortened (--bench), into --out-dir/gpu_bench_smoke.json.
Each check is recorded as passed/failed with its numbers; one failing does not stop the others.
"""

import argparse
import compileall
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import torch  # the machine's own; everything else comes from the bundle (tools/gpu_bundle.py)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEVICE = "cuda"  # --device cpu: the same sequence on the CPU (tests/test_gpu_smoke.py)
DEADLINE = float("inf")  # --budget: no check starts, and no command runs, past it
ENV = dict(os.environ)  # the children's environment: the bundle and src/ on PYTHONPATH
SMALL = False  # --small
HALF, IMAGES, LATENTS = 20, 64, 2000  # steps of one segment, images sampled, images encoded (--small: fewer)
TINY = {"run": {"name": "smoke", "device": "cuda", "seed": 0},
        "data": {"kind": "shapes", "resolution": 32, "count": 512},
        "model": {"channels": 32, "channel_mult": [1, 2], "num_blocks": 1, "attn_resolutions": [16],
                  "class_conditional": True},
        "train": {"total_steps": 40, "segment_steps": 20, "batch_size": 32, "log_every": 10, "warmup_steps": 5,
                  "ema_decays": [0.99]},
        "sample": {"num_images": 64, "steps": 8, "batch_size": 16},
        "fid": {"extractor": "random", "batch_size": 64}}


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def left() -> float:
    return DEADLINE - time.time()


def sh(*cmd, check=True, cap=None, **kw) -> subprocess.CompletedProcess:
    """Run a command in the bundle's environment, within the budget (and `cap` seconds)."""
    limit = max(1.0, min(left(), cap or float("inf")))
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=ENV,
                       timeout=None if limit == float("inf") else limit, **kw)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return p


def diffrelay(*args, **kw):
    # `python -m diffrelay`: the console script `diffrelay` exists only in a pip-installed environment.
    return sh(sys.executable, "-m", "diffrelay", *args, **kw)


def config_file(tmp: Path, name: str, over: dict) -> Path:
    d = merge(merge(TINY, {"run": {"name": name, "results": str(tmp / "results"), "device": DEVICE,
                                   "resources": str(tmp / "resources")}}), over)
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(d))  # YAML is a superset of JSON: no yaml import here
    return path


def train(tmp: Path, name: str, over: dict, until: int, nproc: int = 2, dataset=None):
    cfg = config_file(tmp, name, merge(over, {"train": {"nproc_per_node": nproc}}))
    extra = ["--dataset", dataset] if dataset else []
    diffrelay("launch", "--standalone", "--nproc-per-node", nproc, "-m", "diffrelay", "train", "--config", cfg,
              "--until-step", until, *extra)
    return cfg


def state(tmp: Path, name: str, step: int) -> dict:
    return torch.load(tmp / "results" / name / "checkpoints" / f"step_{step:07d}" / "state.pt",
                      map_location="cpu", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point()),
               default=0.0)


def check_segments(tmp: Path, dataset, nproc: int) -> dict:
    out = {"processes": nproc}
    for det in (True,) if SMALL else (True, False):  # --small (the CPU test): the CPU's kernels are deterministic
        tag = "det" if det else "nondet"
        over = {"train": {"deterministic": det}}
        train(tmp, f"split_{tag}", over, HALF, nproc=nproc, dataset=dataset)
        train(tmp, f"split_{tag}", over, 2 * HALF, nproc=nproc, dataset=dataset)
        train(tmp, f"straight_{tag}", over, 2 * HALF, nproc=nproc, dataset=dataset)
        d = max_diff(state(tmp, f"split_{tag}", 2 * HALF)["net"], state(tmp, f"straight_{tag}", 2 * HALF)["net"])
        out[tag] = {"max_abs_weight_difference": d, "bitwise": d == 0.0}
    out["passed"] = out["det"]["bitwise"]
    return out


def check_sampling(tmp: Path, nproc: int) -> dict:
    """One process against nproc (on one GPU: batch 16 against batch 8, the same process count)."""
    snap = tmp / "results" / "split_det" / "snapshots" / f"step_{2 * HALF:07d}.safetensors"
    out = {"processes": nproc}
    # Deterministic Heun, then EDM's churn: a stochastic sampler asks for each step's noise one step ahead into
    # pinned memory and copies it without blocking, which only a CUDA device can get wrong.
    for tag, extra in (("heun", []), ("churn", ["--s-churn", 40, "--s-min", 0.05, "--s-max", 50])):
        one, two = tmp / f"s1_{tag}", tmp / f"s2_{tag}"
        diffrelay("sample", "--snapshot", snap, "--out", one, "--num-images", IMAGES, "--steps", 8, "--batch-size",
                  16, "--config", tmp / "split_det.yaml", *extra)
        diffrelay("launch", "--standalone", "--nproc-per-node", nproc, "-m", "diffrelay", "sample", "--snapshot",
                  snap, "--out", two, "--num-images", IMAGES, "--steps", 8, "--batch-size", 8, "--config",
                  tmp / "split_det.yaml", *extra)
        names = sorted(p.name for p in one.glob("0*.png"))
        same = sum((one / n).read_bytes() == (two / n).read_bytes() for n in names)
        out[tag] = {"images": len(names), "byte_identical": same, "passed": same == len(names) == IMAGES}
    return out | {"passed": all(v["passed"] for k, v in out.items() if k != "processes")}


def check_fid_foreign(tmp: Path, dataset) -> dict:
    import numpy as np

    ext, ref = tmp / "ext.pt", tmp / "ref.npz"
    diffrelay("fetch-extractor", "--extractor", "random", "--out", ext)
    diffrelay("fid-ref", "--dataset", dataset, "--extractor", ext, "--out", ref)
    with np.load(ref, allow_pickle=False) as z:
        np.savez(tmp / "foreign.npz", mu=z["mu"], sigma=z["sigma"])
    scores = {}
    for name, r in (("own", ref), ("foreign", tmp / "foreign.npz")):
        diffrelay("fid", "--images", tmp / "s1_heun", "--ref", r, "--extractor", ext, "--device", DEVICE,
                  "--out", tmp / f"fid_{name}.json")
        scores[name] = json.loads((tmp / f"fid_{name}.json").read_text())["fid"]
    return {**scores, "passed": abs(scores["own"] - scores["foreign"]) < 1e-6}


def check_channels_last(tmp: Path, dataset) -> dict:
    fused = {"train": {"fused_optimizer": True}}
    train(tmp, "cl_straight", fused, 2 * HALF, nproc=1, dataset=dataset)
    train(tmp, "cl_switch", fused, HALF, nproc=1, dataset=dataset)
    train(tmp, "cl_switch", merge(fused, {"train": {"channels_last": True}}), 2 * HALF, nproc=1, dataset=dataset)
    d = max_diff(state(tmp, "cl_straight", 2 * HALF)["net"], state(tmp, "cl_switch", 2 * HALF)["net"])
    return {"max_abs_weight_difference": d, "passed": d < 1e-3}


def check_dead_rank(tmp: Path, dataset) -> dict:
    """2 GPUs or more: kill -9 of rank 1 in a running job; the job must end with one line within 120 s
    (train.timeout_minutes: 1 bounds the survivors' wait in a collective)."""
    cfg = config_file(tmp, "dead", {"train": {"nproc_per_node": 2, "total_steps": 4000, "segment_steps": 4000,
                                              "log_every": 1, "timeout_minutes": 1}})
    log = open(tmp / "dead.log", "w")
    job = subprocess.Popen([sys.executable, "-m", "diffrelay", "launch", "--standalone", "--nproc-per-node", "2",
                            "-m", "diffrelay", "train", "--config", cfg, "--dataset", dataset], stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True, env=ENV)
    metrics = tmp / "results" / "dead" / "metrics" / "train.jsonl"
    deadline = time.time() + min(120, left())
    while not (metrics.exists() and metrics.read_text().count("loss") >= 5):
        if job.poll() is not None or time.time() > deadline:
            raise RuntimeError("the job never reached step 5: " + (tmp / "dead.log").read_text()[-2000:])
        time.sleep(0.5)
    victim = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and
                  _ppid(p) == job.pid and b"RANK=1\0" in _environ(p))
    t0 = time.time()
    os.kill(victim, signal.SIGKILL)
    try:
        code = job.wait(timeout=max(1, min(120, left())))
    except subprocess.TimeoutExpired:
        code = None  # still running at the cap: failed
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    seconds = time.time() - t0
    last = (tmp / "dead.log").read_text().strip().splitlines()[-1]
    return {"seconds_to_end": round(seconds, 1), "exit": code, "last_line": last,
            "passed": code is not None and seconds < 90}


def _ppid(p: Path) -> int:
    try:
        return int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _environ(p: Path) -> bytes:
    try:
        return (p / "environ").read_bytes()
    except OSError:
        return b""


def check_with_gpus(tmp: Path) -> dict:
    code = "import os, time, torch; torch.ones(1, device='cuda'); print(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(3)"
    jobs = [subprocess.Popen([sys.executable, "-m", "diffrelay", "with-gpus", "--pool", "auto", "--count", "1",
                              "--lock-dir", tmp / "locks", "--", sys.executable, "-c", code], stdout=subprocess.PIPE,
                             text=True, env=ENV) for _ in range(2)]
    ids = [j.communicate(timeout=max(1, min(120, left())))[0].strip() for j in jobs]
    return {"ids": ids, "passed": len(set(ids)) == 2 and all(ids)}


def check_latent_encode(tmp: Path, nproc: int) -> dict:
    import numpy as np
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 32), layers_per_block=1,
                  latent_channels=4, norm_num_groups=8, sample_size=32).save_pretrained(tmp / "vae")
    over = {"run": {"name": "lat"}, "data": {"count": LATENTS, "encoder": "sd-vae", "encoder_path": str(tmp / "vae"),
                                             "xflip": 0.5}}
    cfg, out = config_file(tmp, "lat", over), {}
    t0 = time.time()
    diffrelay("prepare", "--config", cfg, "--out", tmp / "lat1")
    out["one_rank_seconds"] = round(time.time() - t0, 1)
    diffrelay("launch", "--standalone", "--nproc-per-node", nproc, "-m", "diffrelay", "prepare", "--config", cfg,
              "--out", tmp / "latn")
    if DEVICE != "cpu":  # on the CPU (the test's --device cpu) the first encode is already the CPU's
        cpu = config_file(tmp, "latcpu", merge(over, {"run": {"device": "cpu"}}))
        diffrelay("prepare", "--config", cpu, "--out", tmp / "latcpu")
    a, b, c = (np.load(tmp / d / "latents.npy") for d in ("lat1", "latn", "latcpu" if DEVICE != "cpu" else "lat1"))
    out.update(processes=nproc, same_bytes=bool(np.array_equal(a, b)),
               max_abs_difference_to_cpu=float(np.abs(a - c).max()),
               encoded_on=json.loads((tmp / "latn" / "dataset.json").read_text())["encoded_on"])
    out["passed"] = out["same_bytes"]
    return out


def nvidia_smi() -> str:
    if not shutil.which("nvidia-smi"):
        return "not found"
    try:
        return sh("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", check=False,
                  cap=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"failed: {e}"


def machine_torchvision() -> Path | None:
    """The folder of the machine's own torchvision (found without the bundle on the path), or None."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('torchvision'); "
                        "print(s.submodule_search_locations[0] if s else '')"], capture_output=True, text=True, env=env)
    return Path(p.stdout.strip()) if p.returncode == 0 and p.stdout.strip() else None


def torchvision_pin(site: Path) -> str | None:
    """The torch version the bundle's torchvision requires (its METADATA's `Requires-Dist: torch==X`)."""
    for meta in site.glob("torchvision-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.replace(" ", "").startswith("Requires-Dist:torch=="):
                return line.split("==", 1)[1].split(";")[0].strip()
    return None


def use_bundle(bundle: Path | None, tmp: Path) -> dict:
    """Unpack the bundle (a .tar.xz from tools/gpu_bundle.py, or its unpacked folder), put it and src/ on the
    path of this process and its children, and choose the torchvision. Returns what it found."""
    info = {"bundle": str(bundle) if bundle else None}
    paths = [ROOT / "src"]
    if bundle is not None:
        if bundle.is_dir():
            site = bundle / "site" if (bundle / "site").is_dir() else bundle
        else:
            t0 = time.time()
            with tarfile.open(bundle) as tar:
                tar.extractall(tmp / "bundle", filter="data")
            site, info["unpack_seconds"] = tmp / "bundle" / "site", round(time.time() - t0, 1)
            # The bundle ships no bytecode (smaller), and a Python run with PYTHONDONTWRITEBYTECODE (this project's
            # CI machine) would compile it again in each of the smoke's ~30 processes: about 0.7 s each. Compiled
            # once here, into the folder this run made: 4 s on 2 cores.
            t0 = time.time()
            compileall.compile_dir(site, quiet=1, workers=0)
            info["compile_seconds"] = round(time.time() - t0, 1)
        own = machine_torchvision()
        if own is not None:  # the machine's build fits its torch; the bundle's is hidden behind it
            overlay = tmp / "overlay"
            overlay.mkdir()
            (overlay / "torchvision").symlink_to(own)
            for extra in own.parent.glob("torchvision[.-]*"):  # its .libs and dist-info
                (overlay / extra.name).symlink_to(extra)
            paths.append(overlay)
            info["torchvision"] = {"source": "machine", "path": str(own)}
        else:
            pin, have = torchvision_pin(site), torch.__version__.split("+")[0]
            info["torchvision"] = {"source": "bundle", "requires_torch": pin, "torch": have, "fits": pin in (None, have)}
            if pin not in (None, have):
                print(f"gpu_smoke: the bundle's torchvision requires torch=={pin}, this machine has {have}; rebuild "
                      f"it with `make gpu-bundle GPU_TORCHVISION=<the torchvision of torch {have}>`", flush=True)
        paths.append(site)
    ENV["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path[:0] = [str(p) for p in paths]
    return info


def main() -> int:
    global DEVICE, DEADLINE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(HERE / "results"), help="where gpu_smoke.json and gpu_bench_smoke.json "
                    "go ($OUT on a lent machine: benchmarks/results/ does not come back from it)")
    ap.add_argument("--bundle", help="tools/gpu_bundle.py's tar.xz (or folder); default build/gpu-bundle.tar.xz "
                    "where it exists, else this interpreter's own packages")
    ap.add_argument("--budget", type=float, default=480, help="seconds; checks that would start later are not run")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the same sequence on the CPU")
    ap.add_argument("--small", action="store_true", help="fewer steps, images and latents (the CPU test)")
    ap.add_argument("--skip", default="", help="checks not to run, comma-separated (the CPU test leaves out those "
                    "other CPU tests cover: channels_last_switch, fid_foreign_reference)")
    ap.add_argument("--bench", default="--steps 40 --batch 128 --images 5000 --fid-images 2000",
                    help="bench_gpu.py's arguments ('' = not run)")
    args = ap.parse_args()
    global HALF, IMAGES, LATENTS, SMALL
    started, DEVICE, SMALL = time.time(), args.device, args.small
    if args.small:
        HALF, IMAGES, LATENTS = 4, 16, 16
        TINY["data"]["count"], TINY["train"]["batch_size"], TINY["sample"]["num_images"] = 128, 8, IMAGES
        TINY["train"] |= {"total_steps": 2 * HALF, "segment_steps": HALF, "log_every": 2, "warmup_steps": 2}
    DEADLINE = started + args.budget
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here (torch.cuda.is_available() is False); nothing measured, "
              "nothing written. Run it on a GPU machine.", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else 1
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "gpu_smoke.json"
    default = ROOT / "build" / "gpu-bundle.tar.xz"
    bundle = Path(args.bundle) if args.bundle else default if default.exists() else None
    report = {"command": " ".join(["python3", "benchmarks/gpu_smoke.py", *sys.argv[1:]]),
              "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "gpus": gpus,
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
              "nvidia_smi": nvidia_smi() if DEVICE == "cuda" else None, "checks": {}}

    def save():  # after every check: a run cut short keeps what it measured
        report["seconds"] = round(time.time() - started, 1)
        part = out.with_name(out.name + ".part")
        part.write_text(json.dumps(report, indent=2) + "\n")
        part.replace(out)

    two = gpus >= 2
    nproc = 2 if two else 1  # one GPU still checks segments, batch sizes, a foreign reference
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dataset = tmp / "results" / "data" / "dataset"
        bench = out_dir / "gpu_bench_smoke.json"
        checks = [("environment", lambda: environment(bundle, tmp, report), True, 0),
                  ("dataset", lambda: {"passed": diffrelay("prepare", "--config", config_file(tmp, "data", {}))
                                       .returncode == 0}, True, 0),
                  ("segments", lambda: check_segments(tmp, dataset, nproc), True, 60),
                  ("sampling", lambda: check_sampling(tmp, nproc), True, 20),
                  ("fid_foreign_reference", lambda: check_fid_foreign(tmp, dataset), True, 20),
                  ("channels_last_switch", lambda: check_channels_last(tmp, dataset), True, 30),
                  ("kill_one_rank", lambda: check_dead_rank(tmp, dataset), two, 130),
                  ("with_gpus_real_ids", lambda: check_with_gpus(tmp), two, 20),
                  ("latent_encode", lambda: check_latent_encode(tmp, nproc), True, 30),
                  ("bench_gpu", lambda: bench_gpu(args.bench, bench), bool(args.bench), 60)]
        for name, run, possible, needs in checks:
            t0 = time.time()
            if not possible or name in args.skip.split(","):
                report["checks"][name] = {"passed": None, "note": "not run: needs 2 GPUs" if not possible and name in (
                    "kill_one_rank", "with_gpus_real_ids") else "not run: not asked for"}
                save()
                continue
            if left() < needs:
                report["checks"][name] = {"passed": None, "note": f"not run: {left():.0f} s of the budget left"}
                save()
                continue
            try:
                report["checks"][name] = run()
            except Exception as e:  # a smoke run records every failure and goes on with the other checks
                report["checks"][name] = {"passed": False, "error": f"{type(e).__name__}: {e}"[-3000:],
                                          "traceback": traceback.format_exc()[-3000:]}
            report["checks"][name]["seconds"] = round(time.time() - t0, 1)
            print(f"gpu_smoke: {name}: {json.dumps(report['checks'][name])[:1500]}", flush=True)
            save()
    failed = [k for k, v in report["checks"].items() if v.get("passed") is False]
    print(f"gpu_smoke: wrote {out}; failed: {', '.join(failed) or 'none'}; {report['seconds']} s")
    return 1 if failed else 0


def environment(bundle, tmp: Path, report: dict) -> dict:
    """The bundle on the path, and the packages every stage imports, importable in a child as the stages are."""
    info = use_bundle(bundle, tmp)
    probe = ("import json, numpy, yaml, jsonschema, scipy, safetensors, PIL, cleanfid, diffusers, torchvision, "
             "diffrelay; from diffusers import AutoencoderKL; print(json.dumps({m.__name__: getattr(m, '__version__', '?') for m in (numpy, scipy, "
             "torchvision, diffusers)}))")
    p = sh(sys.executable, "-c", probe, check=False, cap=120)
    info["imports"] = json.loads(p.stdout) if p.returncode == 0 else p.stderr[-2000:]
    tv = info.get("torchvision", {})
    return info | {"passed": p.returncode == 0 and tv.get("fits", True)}


def bench_gpu(arguments: str, out: Path) -> dict:
    """benchmarks/bench_gpu.py, shortened, within what is left of the budget."""
    p = sh(sys.executable, HERE / "bench_gpu.py", *arguments.split(), "--device", DEVICE, "--out", out, check=False)
    result = json.loads(out.read_text()) if out.exists() else None
    if p.returncode == 2 and result is None:
        return {"passed": None, "note": "not run: " + p.stderr.strip()[-500:]}
    return {"passed": p.returncode == 0, "output": p.stdout[-3000:] + p.stderr[-2000:], "result": result}


if __name__ == "__main__":
    sys.exit(main())
