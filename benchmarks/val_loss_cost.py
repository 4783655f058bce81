"""What `val_loss` costs a checkpoint against the FID job, at the same image count, through the workflow.

  python benchmarks/val_loss_cost.py [--images 256] [--out benchmarks/results/val_loss_cost.json] [--work DIR]

The text-shapes recipe (config/examples/text-shapes.yaml, the demo encoder) shrunk to 2 one-step segments, with
`data.val_fraction` holding out `--images` images and `sample.num_images` the same count (a text run without prompt
files samples one image per held-out caption), `fid.metrics: [fid, val_loss]`. Snakemake's own per-job benchmark
files (logs/<run>/benchmarks/<rule>/*.tsv: wall seconds of the whole job, process start-up and imports included)
give compute_fid's and compute_val_loss's times per checkpoint. The FID job uses the random-feature extractor (the
cheapest there is), or with --extractor inception-sized torchvision's Inception v3 with random weights (clean-fid's
Inception cannot be fetched offline; the network's compute is the FID job's cost). The goal (issue 58): val_loss at
most 0.3 x the FID job's time.
"""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def inception_sized(path: Path) -> Path:
    """torchvision's Inception v3 (random weights) to its pool features, as a custom TorchScript extractor (clean-fid's
    convention: float images in [0, 255], (B, 3, 299, 299) -> (B, 2048))."""
    import torch
    import torchvision

    class Features(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False).eval()
            self.net.fc = torch.nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net((x / 127.5) - 1)

    torch.manual_seed(0)
    with torch.no_grad():  # traced: torchvision's forward returns a named tuple TorchScript cannot type
        torch.jit.trace(Features().eval(), torch.zeros(2, 3, 299, 299)).save(str(path))
    return path


def job_seconds(folder: Path) -> list[float]:
    return [float(next(csv.DictReader(p.open(), delimiter="\t"))["s"]) for p in sorted(folder.glob("*.tsv"))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=256, help="held-out images = sampled images per checkpoint")
    ap.add_argument("--out", help="result JSON [default: benchmarks/results/val_loss_cost_<extractor>.json]")
    ap.add_argument("--work", help="work folder (default: a temporary one)")
    ap.add_argument("--extractor", choices=["random", "inception-sized"], default="random",
                    help="the FID job's extractor: diffrelay's random features (the cheapest), or torchvision's "
                    "Inception v3 with random weights up to its 2048 pool features (clean-fid's Inception's compute; "
                    "its weights cannot be fetched here)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="val-loss-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PATH": f"{BIN}:{os.environ['PATH']}"}
    subprocess.run([BIN / "diffrelay", "demo-encoder", "--out", work / "enc"], check=True, env=env)
    over = {"run": {"name": "cost", "results": str(work / "results"), "resources": str(work / "resources"),
                    "device": "cpu"},
            "data": {"count": args.images * 10, "resolution": 32, "val_fraction": 0.1,
                     "text_encoders": [{"path": str(work / "enc")}]},
            "train": {"total_steps": 2, "segment_steps": 1, "warmup_steps": 1, "log_every": 1},
            "sample": {"prompts": None, "num_images": args.images, "guidance": [1], "steps": 2},
            "fid": {"metrics": ["fid", "val_loss"], "ref_images": 0,
                    "extractor": "random" if args.extractor == "random" else str(inception_sized(work / "incv3.pt"))}}
    (work / "over.yaml").write_text(yaml.safe_dump(over))
    files = [REPO / "config" / "config.yaml", REPO / "config" / "examples" / "text-shapes.yaml", work / "over.yaml"]
    t0 = time.time()
    subprocess.run([BIN / "snakemake", "--snakefile", REPO / "Snakefile", "--directory", work, "--cores", "2",
                    "--configfile", *files], check=True, env=env, cwd=work)
    logs = work / "logs" / "cost" / "benchmarks"
    fid, val = job_seconds(logs / "compute_fid"), job_seconds(logs / "compute_val_loss")
    held = json.loads((work / "results" / "cost" / "metrics" / "val_loss" / "step_0000001.json").read_text())
    # The same computation in this process, once to import and once warm: what start-up costs, and what the images do.
    from diffrelay import config
    from diffrelay.sampling import val_loss

    cfg = config.load(files)
    snap, data = work / "results" / "cost" / "snapshots" / "step_0000001.safetensors", work / "results" / "cost" / "dataset"
    times = []
    for _ in range(2):
        t = time.perf_counter()
        val_loss.compute(cfg, snap, data, batch_size=cfg.sample.batch_size, threads=1)
        times.append(round(time.perf_counter() - t, 2))
    result = {"images": args.images, "val_loss_in_process_cold_s": times[0], "val_loss_in_process_warm_s": times[1], "held_out": held["count"], "fid_job_s": fid, "val_loss_job_s": val,
              "val_loss_compute_s": held["seconds"], "ratio": sum(val) / sum(fid), "goal": 0.3,
              "workflow_s": round(time.time() - t0, 1), "extractor": args.extractor, "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count()}
    out = Path(args.out or REPO / "benchmarks" / "results" / f"val_loss_cost_{args.extractor}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["ratio"] <= result["goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
