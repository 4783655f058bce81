"""GPU figures on whatever CUDA devices this machine has: training against a bare loop, sampling, FID, MFU,
and the scaling of training from 1 to N GPUs.

  python benchmarks/bench_gpu.py [--steps 200] [--batch 256] [--fid-images 10000] [--extractor random]

Without a CUDA device it prints one line and exits with status 2, writing nothing (run_all.py does not
call it). Cases, all at 32x32 on synthetic data (benchmarks/synthetic.py), bf16 autocast:
  - unet: a CIFAR-sized UNet (128 channels, 3 levels, 2 blocks, attention at 16x16);
  - dit:  DiT-S/2 (model.arch: dit, kwargs {size: S, patch: 2}).
For each case: `diffrelay train` (one segment, the train.* speed switches given by --fast) against a bare
loop with the same network, batch, optimizer, clipping and EMA (no DDP, no logging, no checkpoint);
model FLOP utilisation = FLOPs of one training step, counted by torch.utils.flop_counter.FlopCounterMode,
times steps/s, over the device's dense bf16 peak from PEAK_BF16 (unknown device: MFU not reported).
Then, for the unet: `diffrelay sample` images/s and `diffrelay fid` seconds for --fid-images images.
Scaling (with 2 or more GPUs): `diffrelay launch --nproc-per-node N` training of the unet at a fixed batch per
GPU (--batch / 1 ... / N ...) for N = 1, 2, 4, ... up to the GPU count; efficiency = images/s at N over N times
images/s at 1. Writes benchmarks/results/gpu.json.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE))
from synthetic import write_dataset  # noqa: E402

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s, no sparsity), matched by name.
# First match wins, so the more specific names come first.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
             ("A100", 312e12)]
UNET = {"channels": 128, "channel_mult": [1, 2, 2], "num_blocks": 2, "attn_resolutions": [16], "dropout": 0.0,
        "class_conditional": True}
DIT = {"arch": "dit", "kwargs": {"size": "S", "patch": 2}, "class_conditional": True}
FAST = {"tf32": True, "channels_last": True, "fused_optimizer": "auto"}


def peak_flops(name: str):
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def run(*cmd, **kw):
    p = subprocess.run([str(BIN / "diffrelay"), *map(str, cmd)], capture_output=True, text=True, **kw)
    if p.returncode:
        sys.exit(f"diffrelay {' '.join(map(str, cmd))} failed:\n{p.stderr[-3000:]}")
    return p


def step_flops(net, batch, res, classes) -> int:
    """FLOPs of one training step's forward and backward (the optimizer's are negligible)."""
    from torch.utils.flop_counter import FlopCounterMode

    from diffrelay.objectives import edm

    x = torch.randn(batch, 3, res, res, device="cuda")
    labels = torch.randint(0, classes, (batch,), device="cuda")
    with FlopCounterMode(display=False) as counter, torch.autocast("cuda", dtype=torch.bfloat16):
        edm.loss(net, x, labels, torch.randn(batch, device="cuda"), torch.randn_like(x), -1.2, 1.2, 0.5).backward()
    net.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def bare_loop(model_cfg, data_dir, args) -> tuple[float, int]:
    """(steady steps/s, FLOPs per step) of the plainest loop doing the same work on the GPU."""
    import numpy as np

    from diffrelay import config
    from diffrelay.data import datasets
    from diffrelay.objectives import edm
    from diffrelay.runtime import speed
    from diffrelay.training import optim

    t = config.Config(config.validate({"train": {"batch_size": args.batch, "precision": "bf16", **FAST}})).train
    speed.set_backends(torch.device("cuda"), t.tf32)
    torch.set_num_threads(t.threads)  # as `diffrelay train` does: the same host threads on both sides
    torch.manual_seed(0)
    data = datasets.open_prepared(data_dir)
    images = (torch.from_numpy(np.asarray(data.images)).permute(0, 3, 1, 2).float() / 127.5 - 1).cuda()
    labels = torch.from_numpy(np.asarray(data.labels)).cuda()
    full = config.validate({"model": model_cfg})["model"]
    net = speed.to_memory_format(edm.build(full, data.resolution, data.num_classes).cuda(), t.channels_last)
    flops = step_flops(net, args.batch, data.resolution, data.num_classes)
    ema = optim.EMA(net, t.ema_decays)
    opt = optim.build_optimizer(net.parameters(), t, fused=True)
    warm = args.steps // 4
    for step in range(args.steps):
        if step == warm:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        idx = torch.randint(0, len(images), (args.batch,), device="cuda")
        rnd, noise = torch.randn(args.batch, device="cuda"), torch.randn_like(images[idx])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = edm.loss(net, images[idx], labels[idx], rnd, noise, t.p_mean, t.p_std, 0.5)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema.update(net, step)
    torch.cuda.synchronize()
    return (args.steps - warm) / (time.perf_counter() - t0), flops


def train_case(name, model_cfg, tmp: Path, data_dir, args, peak) -> dict:
    from diffrelay import logs

    bare, flops = bare_loop(model_cfg, data_dir, args)
    cfg = {"run": {"name": name, "results": str(tmp), "resources": str(tmp / "resources"), "device": "cuda"},
           "data": {"kind": "shapes", "resolution": 32, "count": args.images}, "model": model_cfg,
           "train": {"total_steps": args.steps, "segment_steps": args.steps, "batch_size": args.batch,
                     "precision": "bf16", "log_every": args.steps // 4, "warmup_steps": 0, **FAST}}
    cfg_path = tmp / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run("train", "--config", cfg_path, "--until-step", args.steps, "--dataset", data_dir)
    records = [r for r in logs.read_jsonl(tmp / name / "metrics" / "train.jsonl") if "steps_per_s" in r]
    ours = sum(r["steps_per_s"] for r in records[1:]) / len(records[1:])  # the first window holds the warm-up
    row = {"bare_steps_per_s": round(bare, 3), "diffrelay_steps_per_s": round(ours, 3), "ratio": round(ours / bare, 3),
           "images_per_s": round(ours * args.batch, 1), "flops_per_step": flops,
           "mfu_diffrelay": round(flops * ours / peak, 4) if peak else None,
           "mfu_bare": round(flops * bare / peak, 4) if peak else None,
           "snapshot": str(tmp / name / "snapshots" / f"step_{args.steps:07d}.safetensors")}
    print(f"{name}: bare {bare:.2f} step/s | diffrelay {ours:.2f} step/s ({ours / bare:.3f}x) | "
          f"{flops / 1e9:.1f} GFLOP/step | MFU {row['mfu_diffrelay'] if peak else 'n/a (unknown peak)'}", flush=True)
    return row


def eval_case(snapshot, data_dir, tmp: Path, args) -> dict:
    """`diffrelay sample` of --fid-images images, then `diffrelay fid` on them, each timed."""
    out = tmp / "samples"
    run("sample", "--snapshot", snapshot, "--out", out, "--num-images", args.fid_images, "--batch-size", 500,
        "--precision", "bf16")
    sampled = json.loads((out / "manifest.json").read_text())
    # fid-ref reads the prepared images.npy itself: no PNG of the training set is needed.
    extractor, ref = tmp / "extractor.pt", tmp / "ref.npz"
    run("fetch-extractor", "--extractor", args.extractor, "--out", extractor)
    run("fid-ref", "--dataset", data_dir, "--extractor", extractor, "--num", args.fid_images, "--out", ref)
    t0 = time.perf_counter()
    run("fid", "--images", out, "--ref", ref, "--extractor", extractor, "--batch-size", 500, "--threads", 8,
        "--out", tmp / "fid.json")
    fid_s = time.perf_counter() - t0
    print(f"sampling {sampled['images_per_s']:.1f} img/s | fid of {args.fid_images} images {fid_s:.1f} s", flush=True)
    return {"sample_images_per_s": sampled["images_per_s"], "sample_steps": sampled["steps"],
            "fid_images": args.fid_images, "fid_seconds": round(fid_s, 2), "extractor": args.extractor}


def scaling_case(tmp: Path, data_dir, args) -> dict:
    """Training steps/s of the unet under `diffrelay launch --nproc-per-node N`, batch per GPU fixed."""
    from diffrelay import logs

    per_gpu = max(1, args.batch // torch.cuda.device_count())
    rows, counts = {}, [n for n in (1, 2, 4, 8, 16) if n <= torch.cuda.device_count()]
    for n in counts:
        name = f"scale{n}"
        cfg = {"run": {"name": name, "results": str(tmp), "resources": str(tmp / "resources"), "device": "cuda"},
               "data": {"kind": "shapes", "resolution": 32, "count": args.images}, "model": UNET,
               "train": {"total_steps": args.steps, "segment_steps": args.steps, "batch_size": per_gpu * n,
                         "nproc_per_node": n, "precision": "bf16", "log_every": args.steps // 4, "warmup_steps": 0,
                         **FAST}}
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        run("launch", "--standalone", "--nproc-per-node", n, "-m", "diffrelay", "train", "--config", path,
            "--until-step", args.steps, "--dataset", data_dir)
        records = [r for r in logs.read_jsonl(tmp / name / "metrics" / "train.jsonl") if "steps_per_s" in r]
        steps = sum(r["steps_per_s"] for r in records[1:]) / len(records[1:])
        rows[n] = {"steps_per_s": round(steps, 3), "images_per_s": round(steps * per_gpu * n, 1)}
    for n, row in rows.items():
        row["efficiency"] = round(row["images_per_s"] / (n * rows[1]["images_per_s"]), 3)
        print(f"scaling: {n} GPU(s) {row['images_per_s']:.0f} img/s, efficiency {row['efficiency']:.2f}", flush=True)
    return {"batch_per_gpu": per_gpu, "by_gpus": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps per measurement (a multiple of 4)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--images", type=int, default=50000, help="synthetic training images")
    ap.add_argument("--fid-images", type=int, default=10000)
    ap.add_argument("--extractor", default="random", help="random (offline) or inception (downloads once)")
    ap.add_argument("--out", default=str(HERE / "results" / "gpu.json"), help="where the JSON goes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False); nothing measured, "
              "nothing written. Run it on a GPU machine.", file=sys.stderr)
        sys.exit(2)
    device = torch.cuda.get_device_name(0)
    peak = peak_flops(device)
    result = {"command": "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:]), "device": device,
              "peak_bf16_flops": peak, "torch": torch.__version__, "batch": args.batch, "resolution": 32,
              "switches": FAST | {"precision": "bf16"}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_dir = write_dataset(tmp / "data", args.images, 32)
        result["unet"] = train_case("unet", UNET, tmp, data_dir, args, peak) | {"model": UNET}
        result["dit"] = train_case("dit", DIT, tmp, data_dir, args, peak) | {"model": DIT}
        result["dit"].pop("snapshot")
        result["eval"] = eval_case(result["unet"].pop("snapshot"), data_dir, tmp, args)
        result["scaling"] = (scaling_case(tmp, data_dir, args) if torch.cuda.device_count() > 1
                             else "not measured: one GPU")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
