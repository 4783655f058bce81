"""Parameter count and CPU seconds per training step of the recipe networks (config/examples/*).

  python benchmarks/bench_nets.py [--batch 16] [--steps 3] [--threads 2]

Each recipe's network is built from its YAML exactly as `diffrelay train` builds it (edm.build), then
timed for a few EDM-loss + Adam steps on random 32x32 images at a small batch (a CPU cannot run the
recipes' GPU batch sizes in useful time; seconds per image scale the figure to any batch). The first
step is left out as warm-up. Writes benchmarks/results/nets.json.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECIPES = ["config/examples/unet-cifar10.yaml", "config/examples/pixel-dit-s2.yaml", "config/config.yaml"]


def measure(recipe: str, args) -> dict:
    from diffrelay import config
    from diffrelay.objectives import edm
    from diffrelay.nets import registry

    files = [REPO / "config/config.yaml"] + ([REPO / recipe] if recipe != "config/config.yaml" else [])
    cfg = config.load(files).to_dict()
    res, classes = cfg["data"]["resolution"], 10 if cfg["model"]["class_conditional"] else 0
    torch.manual_seed(0)
    net = edm.build(cfg["model"], res, classes)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    x = torch.randn(args.batch, 3, res, res).clamp(-1, 1)
    labels = torch.randint(0, max(classes, 1), (args.batch,)) if classes else None
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        loss = edm.loss(net, x, labels, torch.randn(args.batch), torch.randn_like(x), -1.2, 1.2, 0.5)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    sec = sum(times[1:]) / args.steps
    return {"recipe": recipe, "arch": cfg["model"]["arch"], "kwargs": cfg["model"]["kwargs"],
            "resolution": res, "classes": classes, "params": registry.num_params(net.net),
            "batch": args.batch, "seconds_per_step": round(sec, 3), "seconds_per_image": round(sec / args.batch, 4)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for recipe in RECIPES:
        row = measure(recipe, args)
        print(f"{row['recipe']:38s} {row['arch']:5s} {row['params'] / 1e6:7.2f} M params | batch {row['batch']} | "
              f"{row['seconds_per_step']:.3f} s/step | {row['seconds_per_image']:.4f} s/image", flush=True)
        rows.append(row)
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
           "torch": torch.__version__, "python": sys.version.split()[0], "rows": rows}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "nets.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
