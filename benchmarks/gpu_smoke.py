"""GPU smoke checks (run by benchmarks/gpu_smoke.sh): what the CPU tests cannot show, measured once.

  1. 2-GPU training, 20 + 20 steps against a straight 40, with train.deterministic on and off: max abs
     weight difference (0 expected with it on, on one GPU model);
  2. sampling on 2 GPUs against 1: PNGs byte-identical?
  3. FID against a foreign (mu, sigma) reference on the GPU: runs, and equals the score against our own file;
  4. a train.channels_last switch between fused segments: max abs difference against no switch;
  5. kill -9 of one rank: seconds until the job ends, and its last line;
  6. with-gpus with the machine's real ids: two concurrent jobs get different GPUs;
  7. a latent dataset (a tiny random AutoencoderKL): encoded by 2 GPU ranks against 1 (same bytes?), against the
     CPU's encode (max abs difference), and the GPU's encode rate;
  8. benchmarks/bench_gpu.py, shortened.
Each check is recorded as passed/failed with its numbers; one failing does not stop the others.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import yaml

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
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


def sh(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return p


def diffrelay(*args, **kw):
    return sh(BIN / "diffrelay", *args, **kw)


def config_file(tmp: Path, name: str, over: dict) -> Path:
    d = merge(merge(TINY, {"run": {"name": name, "results": str(tmp / "results"),
                                   "resources": str(tmp / "resources")}}), over)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
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
    for det in (True, False):
        tag = "det" if det else "nondet"
        over = {"train": {"deterministic": det}}
        train(tmp, f"split_{tag}", over, 20, nproc=nproc, dataset=dataset)
        train(tmp, f"split_{tag}", over, 40, nproc=nproc, dataset=dataset)
        train(tmp, f"straight_{tag}", over, 40, nproc=nproc, dataset=dataset)
        d = max_diff(state(tmp, f"split_{tag}", 40)["net"], state(tmp, f"straight_{tag}", 40)["net"])
        out[tag] = {"max_abs_weight_difference": d, "bitwise": d == 0.0}
    out["passed"] = out["det"]["bitwise"]
    return out


def check_sampling(tmp: Path, nproc: int) -> dict:
    """One process against nproc (on one GPU: batch 16 against batch 8, the same process count)."""
    snap = tmp / "results" / "split_det" / "snapshots" / "step_0000040.safetensors"
    one, two = tmp / "s1", tmp / "s2"
    diffrelay("sample", "--snapshot", snap, "--out", one, "--num-images", 64, "--steps", 8, "--batch-size", 16)
    diffrelay("launch", "--standalone", "--nproc-per-node", nproc, "-m", "diffrelay", "sample", "--snapshot", snap,
              "--out", two, "--num-images", 64, "--steps", 8, "--batch-size", 8)
    names = sorted(p.name for p in one.glob("0*.png"))
    same = sum((one / n).read_bytes() == (two / n).read_bytes() for n in names)
    return {"processes": nproc, "images": len(names), "byte_identical": same, "passed": same == len(names) == 64}


def check_fid_foreign(tmp: Path, dataset) -> dict:
    ext, ref = tmp / "ext.pt", tmp / "ref.npz"
    diffrelay("fetch-extractor", "--extractor", "random", "--out", ext)
    diffrelay("fid-ref", "--dataset", dataset, "--extractor", ext, "--out", ref)
    with np.load(ref, allow_pickle=False) as z:
        np.savez(tmp / "foreign.npz", mu=z["mu"], sigma=z["sigma"])
    scores = {}
    for name, r in (("own", ref), ("foreign", tmp / "foreign.npz")):
        diffrelay("fid", "--images", tmp / "s1", "--ref", r, "--extractor", ext, "--device", "cuda",
                  "--out", tmp / f"fid_{name}.json")
        scores[name] = json.loads((tmp / f"fid_{name}.json").read_text())["fid"]
    return {**scores, "passed": abs(scores["own"] - scores["foreign"]) < 1e-6}


def check_channels_last(tmp: Path, dataset) -> dict:
    fused = {"train": {"fused_optimizer": True}}
    train(tmp, "cl_straight", fused, 40, nproc=1, dataset=dataset)
    train(tmp, "cl_switch", fused, 20, nproc=1, dataset=dataset)
    train(tmp, "cl_switch", merge(fused, {"train": {"channels_last": True}}), 40, nproc=1, dataset=dataset)
    d = max_diff(state(tmp, "cl_straight", 40)["net"], state(tmp, "cl_switch", 40)["net"])
    return {"max_abs_weight_difference": d, "passed": d < 1e-3}


def check_dead_rank(tmp: Path, dataset) -> dict:
    cfg = config_file(tmp, "dead", {"train": {"nproc_per_node": 2, "total_steps": 4000, "segment_steps": 4000,
                                              "log_every": 1}})
    log = open(tmp / "dead.log", "w")
    job = subprocess.Popen([BIN / "diffrelay", "launch", "--standalone", "--nproc-per-node", "2", "-m", "diffrelay",
                            "train", "--config", cfg, "--dataset", dataset], stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    metrics = tmp / "results" / "dead" / "metrics" / "train.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count("loss") >= 5):
        if job.poll() is not None or time.time() > deadline:
            raise RuntimeError("the job never reached step 5: " + (tmp / "dead.log").read_text()[-2000:])
        time.sleep(0.5)
    victim = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and
                  _ppid(p) == job.pid and b"RANK=1\0" in _environ(p))
    t0 = time.time()
    os.kill(victim, signal.SIGKILL)
    try:
        code = job.wait(timeout=900)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    seconds = time.time() - t0
    last = (tmp / "dead.log").read_text().strip().splitlines()[-1]
    return {"seconds_to_end": round(seconds, 1), "exit": code, "last_line": last, "passed": seconds < 90}


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
    jobs = [subprocess.Popen([BIN / "diffrelay", "with-gpus", "--pool", "auto", "--count", "1", "--lock-dir",
                              tmp / "locks", "--", sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    ids = [j.communicate(timeout=120)[0].strip() for j in jobs]
    return {"ids": ids, "passed": len(set(ids)) == 2 and all(ids)}


def check_latent_encode(tmp: Path, nproc: int) -> dict:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 32), layers_per_block=1,
                  latent_channels=4, norm_num_groups=8, sample_size=32).save_pretrained(tmp / "vae")
    over = {"run": {"name": "lat"}, "data": {"count": 2000, "encoder": "sd-vae", "encoder_path": str(tmp / "vae"),
                                             "xflip": 0.5}}
    cfg, out = config_file(tmp, "lat", over), {}
    t0 = time.time()
    diffrelay("prepare", "--config", cfg, "--out", tmp / "lat1")
    out["one_rank_seconds"] = round(time.time() - t0, 1)
    diffrelay("launch", "--standalone", "--nproc-per-node", nproc, "-m", "diffrelay", "prepare", "--config", cfg,
              "--out", tmp / "latn")
    cpu = config_file(tmp, "latcpu", merge(over, {"run": {"device": "cpu"}}))
    diffrelay("prepare", "--config", cpu, "--out", tmp / "latcpu")
    a, b, c = (np.load(tmp / d / "latents.npy") for d in ("lat1", "latn", "latcpu"))
    out.update(processes=nproc, same_bytes=bool(np.array_equal(a, b)),
               max_abs_difference_to_cpu=float(np.abs(a - c).max()),
               encoded_on=json.loads((tmp / "latn" / "dataset.json").read_text())["encoded_on"])
    out["passed"] = out["same_bytes"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_smoke.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here (torch.cuda.is_available() is False); nothing measured, "
              "nothing written. Run it on a GPU machine.", file=sys.stderr)
        return 2
    smi = sh("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", check=False).stdout.strip()
    report = {"command": "bash benchmarks/gpu_smoke.sh", "device": torch.cuda.get_device_name(0),
              "gpus": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "nvidia_smi": smi, "checks": {}}
    two = torch.cuda.device_count() >= 2
    nproc = 2 if two else 1  # one GPU still checks segments, batch sizes, a foreign reference
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = config_file(tmp, "data", {})
        diffrelay("prepare", "--config", cfg)
        dataset = tmp / "results" / "data" / "dataset"
        checks = [("segments", lambda: check_segments(tmp, dataset, nproc), True),
                  ("sampling", lambda: check_sampling(tmp, nproc), True),
                  ("fid_foreign_reference", lambda: check_fid_foreign(tmp, dataset), True),
                  ("channels_last_switch", lambda: check_channels_last(tmp, dataset), True),
                  ("kill_one_rank", lambda: check_dead_rank(tmp, dataset), two),
                  ("with_gpus_real_ids", lambda: check_with_gpus(tmp), two),
                  ("latent_encode", lambda: check_latent_encode(tmp, nproc), True)]
        for name, run, possible in checks:
            t0 = time.time()
            if not possible:
                report["checks"][name] = {"passed": None, "note": "not run: needs 2 GPUs"}
                continue
            try:
                report["checks"][name] = run()
            except Exception as e:  # a smoke run records every failure and goes on with the other checks
                report["checks"][name] = {"passed": False, "error": f"{type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc()[-3000:]}
            report["checks"][name]["seconds"] = round(time.time() - t0, 1)
            print(f"gpu_smoke: {name}: {report['checks'][name]}", flush=True)
    bench = Path(args.out).with_name("gpu_bench_smoke.json")
    p = sh(sys.executable, HERE / "bench_gpu.py", "--steps", 40, "--batch", 128, "--images", 5000,
           "--fid-images", 2000, "--out", bench, check=False)
    report["checks"]["bench_gpu"] = {"passed": p.returncode == 0, "output": p.stdout[-3000:] + p.stderr[-2000:],
                                     "result": json.loads(bench.read_text()) if bench.exists() else None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    failed = [k for k, v in report["checks"].items() if v.get("passed") is False]
    print(f"gpu_smoke: wrote {out}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
