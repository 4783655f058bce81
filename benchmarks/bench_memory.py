"""Peak CPU memory and seconds of one DiT-B/2 training step with and without activation checkpointing.

  python benchmarks/bench_memory.py [--size B] [--batch 32] [--threads 2]

Each setting runs in its own fresh process (peak RSS is a high-water mark, so two settings in one
process would hide the second). The process builds DiT-<size>/2 for 32x32x4 latents with 1000 classes
as `diffrelay train` builds it (edm.build, the EDM preconditioning around it), notes its peak RSS, then
runs one forward+backward of the EDM loss; "extra" is the peak during that step above the peak before it:
the activations kept for the backward pass plus the gradients (the same with and without). A second step
is timed. Writes benchmarks/results/memory.json.
"""

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def step(args) -> dict:
    from diffrelay.nets import memory
    from diffrelay.objectives import edm

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = {"arch": "dit", "kwargs": {"size": args.size, "patch": 2}, "class_conditional": True, "sigma_data": 0.5}
    net = edm.build(model, 32, 1000, in_channels=4).train()
    if args.checkpointing:
        memory.enable(net)
    x, labels = torch.randn(args.batch, 4, 32, 32), torch.randint(0, 1000, (args.batch,))

    def one():
        rnd, noise = torch.randn(args.batch), torch.randn_like(x)
        edm.loss(net, x, labels, rnd, noise, -1.2, 1.2, 0.5).backward()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    one()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    one()  # timed: the gradients exist now, as in every later step
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in net.parameters())
    return {"peak_rss_mib": round(peak / 1024), "extra_mib": round(max(peak - before, 0) / 1024),
            "seconds_per_step": round(seconds, 2), "parameters": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="B")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpointing", type=int, default=None, help=argparse.SUPPRESS)  # the child's setting
    args = ap.parse_args()
    if args.checkpointing is not None:
        print(json.dumps(step(args)))
        return
    results = {}
    for on in (0, 1):
        out = subprocess.run([sys.executable, __file__, "--size", args.size, "--batch", str(args.batch),
                              "--threads", str(args.threads), "--checkpointing", str(on)],
                             check=True, capture_output=True, text=True).stdout
        results["with" if on else "without"] = json.loads(out.strip().splitlines()[-1])
        print(("with   " if on else "without"), results["with" if on else "without"])
    saved = 1 - results["with"]["extra_mib"] / max(results["without"]["extra_mib"], 1)
    doc = {"what": f"DiT-{args.size}/2 (32x32x4, 1000 classes) one training step on the CPU, batch {args.batch}, "
                   "fresh process per setting; extra = peak RSS during the first step above the peak before it",
           "torch": torch.__version__, "machine": platform.machine(), "threads": args.threads,
           "time": time.strftime("%Y-%m-%d"), "results": results, "extra_saved_fraction": round(saved, 3)}
    (HERE / "results" / "memory.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"activation checkpointing keeps {saved:.0%} less during the step")


if __name__ == "__main__":
    main()
