"""GPU figures on whatever CUDA devices this machine has: training against a bare loop, sampling, FID, MFU,
and the scaling of training from 1 to N GPUs.

  python benchmarks/bench_gpu.py [--steps 200] [--batch 256] [--fid-images 10000] [--extractor random]
      [--cases unet,dit,eval,ditxl,ditxl-sample,ditxl-compile,scaling] [--device cuda]

Without a CUDA device it prints one line and exits with status 2, writing nothing (run_all.py does not
call it); --device cpu is a dry run of the same code at whatever sizes are given (no MFU). Imports only
the standard library and torch at the top: benchmarks/gpu_smoke.py runs it on a bare machine, with its
bundle on PYTHONPATH, and every stage as `python -m diffrelay`. Cases, bf16 autocast:
  - unet: a CIFAR-sized UNet (128 channels, 3 levels, 2 blocks, attention at 16x16), 32x32 synthetic data
    (benchmarks/synthetic.py);
  - dit:  DiT-S/2 (model.arch: dit, kwargs {size: S, patch: 2}), the same data;
  - ditxl: DiT-XL/2 as config/examples/dit-xl2-imagenet256.yaml (ddpm objective, learned sigma), on 256 px
    latents (4 x 32 x 32) that `diffrelay prepare` encodes with a small random AutoencoderKL (factor 8), with
    --ditxl-batch images a step;
  - ditxl-sample: `diffrelay sample` of a random DiT-XL/2 made a snapshot by `diffrelay import` (no training, no
    checkpoint to write first), 250 DDPM steps and CFG 1.5, TF32 on and off (sample.tf32);
  - ditxl-compile: the ditxl training again with train.compile on, the bare loop compiled as well.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s, no sparsity), matched by name.
# First match wins, so the more specific names come first.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
             ("A100", 312e12)]
UNET = {"channels": 128, "channel_mult": [1, 2, 2], "num_blocks": 2, "attn_resolutions": [16], "dropout": 0.0,
        "class_conditional": True}
DIT = {"arch": "dit", "kwargs": {"size": "S", "patch": 2}, "class_conditional": True}
# config/examples/dit-xl2-imagenet256.yaml's network and objective.
DITXL = {"arch": "dit", "kwargs": {"size": "XL", "patch": 2, "out_channels": 8, "time_scale": 1},
         "class_conditional": True, "objective": "ddpm"}
FAST = {"tf32": True, "channels_last": True, "fused_optimizer": "auto"}
DEVICE = "cuda"  # --device


def peak_flops(name: str):
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def run(*cmd, **kw):
    # `python -m diffrelay`: the console script exists only in a pip-installed environment.
    p = subprocess.run([sys.executable, "-m", "diffrelay", *map(str, cmd)], capture_output=True, text=True, **kw)
    if p.returncode:
        sys.exit(f"diffrelay {' '.join(map(str, cmd))} failed:\n{p.stderr[-3000:]}")
    return p


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def step_flops(cfg, net, x, labels) -> int:
    """FLOPs of one training step's forward and backward (the optimizer's are negligible)."""
    from torch.utils.flop_counter import FlopCounterMode

    from diffrelay import objectives

    with FlopCounterMode(display=False) as counter, torch.autocast(DEVICE, dtype=torch.bfloat16):
        objectives.loss(cfg, net, x, labels, torch.randn(len(x), device=DEVICE), torch.randn_like(x)).backward()
    net.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def bare_loop(cfg_dict, data_dir, args) -> tuple[float, int]:
    """(steady steps/s, FLOPs per step) of the plainest loop doing the same work on the device: the same
    network, objective, batch, optimizer, clipping and EMA; its batches are random tensors of the dataset's
    shape already on the device (no loader, no DDP, no logging, no checkpoint)."""
    from diffrelay import config, objectives
    from diffrelay.runtime import speed
    from diffrelay.training import optim

    cfg = config.Config(config.validate(cfg_dict))
    t, device = cfg.train, torch.device(DEVICE)
    speed.set_backends(device, t.tf32)
    torch.set_num_threads(t.threads)  # as `diffrelay train` does: the same host threads on both sides
    torch.manual_seed(0)
    info = json.loads((Path(data_dir) / "dataset.json").read_text())
    latent, res, classes = info.get("latent"), info["resolution"], info["num_classes"]
    shape = (3, res, res) if latent is None else (latent["channels"], res // latent["factor"], res // latent["factor"])
    net = objectives.build(cfg.to_dict()["model"], shape[1], classes, shape[0]).to(device)
    net = speed.to_memory_format(net, t.channels_last)
    batch = t.batch_size
    x = torch.randn(batch, *shape, device=device)
    labels = torch.randint(0, classes, (batch,), device=device) if classes else None
    flops = step_flops(cfg, net, x, labels)
    model = speed.compile_model(net, t.compile, cfg.run.resources, t.threads)  # the same cache as the run's
    ema = optim.EMA(net, t.ema_decays)
    opt = optim.build_optimizer(net.parameters(), t, fused=DEVICE == "cuda")
    warm = args.steps // 4
    for step in range(args.steps):
        if step == warm:
            sync()
            t0 = time.perf_counter()
        rnd, noise = torch.randn(batch, device=device), torch.randn_like(x)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = objectives.loss(cfg, model, x, labels, rnd, noise)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema.update(net, step)
    sync()
    return (args.steps - warm) / (time.perf_counter() - t0), flops


def write_config(tmp: Path, name: str, cfg: dict) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # YAML is a superset of JSON: no yaml import on a bare machine
    return path


def run_config(name, model_cfg, tmp: Path, args, data=None, train=None, batch=None) -> dict:
    sample = {"solver": "ddpm", "steps": args.ditxl_steps} if model_cfg.get("objective") == "ddpm" else {}
    return {"sample": sample, "run": {"name": name, "results": str(tmp), "resources": str(tmp / "resources"), "device": DEVICE},
            "data": data or {"kind": "shapes", "resolution": 32, "count": args.images}, "model": model_cfg,
            "train": {"total_steps": args.steps, "segment_steps": args.steps, "batch_size": batch or args.batch,
                      "precision": "bf16", "log_every": args.steps // 4, "warmup_steps": 0, **FAST, **(train or {})}}


def train_case(name, model_cfg, tmp: Path, data_dir, args, peak, data=None, train=None, batch=None) -> dict:
    from diffrelay import logs

    cfg = run_config(name, model_cfg, tmp, args, data, train, batch)
    bare, flops = bare_loop(cfg, data_dir, args)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()  # the bare loop's cached blocks would leave `diffrelay train` short (DiT-XL/2)
    cfg_path = write_config(tmp, name, cfg)
    run("train", "--config", cfg_path, "--until-step", args.steps, "--dataset", data_dir)
    records = [r for r in logs.read_jsonl(tmp / name / "metrics" / "train.jsonl") if "steps_per_s" in r]
    ours = sum(r["steps_per_s"] for r in records[1:]) / len(records[1:])  # the first window holds the warm-up
    images = cfg["train"]["batch_size"]
    row = {"bare_steps_per_s": round(bare, 3), "diffrelay_steps_per_s": round(ours, 3), "ratio": round(ours / bare, 3),
           "batch": images, "images_per_s": round(ours * images, 1), "flops_per_step": flops,
           "mfu_diffrelay": round(flops * ours / peak, 4) if peak else None,
           "mfu_bare": round(flops * bare / peak, 4) if peak else None,
           "snapshot": str(tmp / name / "snapshots" / f"step_{args.steps:07d}.safetensors"), "config": str(cfg_path)}
    print(f"{name}: bare {bare:.2f} step/s | diffrelay {ours:.2f} step/s ({ours / bare:.3f}x) | "
          f"{flops / 1e9:.1f} GFLOP/step | MFU {row['mfu_diffrelay'] if peak else 'n/a (unknown peak)'}", flush=True)
    return row


def tiny_vae(folder: Path) -> Path:
    """A random diffusers AutoencoderKL with SD's layout at small width: 4 latent channels, factor 8."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32), layers_per_block=1,
                  latent_channels=4, norm_num_groups=8, sample_size=256).save_pretrained(folder)
    return folder


def ditxl_data(tmp: Path, args) -> tuple[dict, dict]:
    """(data config, its record) of the DiT cases: a random VAE and --ditxl-images images encoded by `diffrelay
    prepare`, once for every case that needs them."""
    data = {"kind": "shapes", "resolution": args.ditxl_res, "count": args.ditxl_images, "encoder": "sd-vae",
            "encoder_path": str(tmp / "vae"), "latent_norm": "dit"}
    if (tmp / "ditxl_dataset" / "dataset.json").exists():
        return data, {}
    tiny_vae(tmp / "vae")
    prep = write_config(tmp, "ditxl_data", run_config("ditxl_data", DITXL, tmp, args, data))
    t0 = time.perf_counter()
    run("prepare", "--config", prep, "--out", tmp / "ditxl_dataset")
    return data, {"encode_images": args.ditxl_images, "prepare_seconds": round(time.perf_counter() - t0, 2)}


def ditxl_model(args) -> dict:
    return {**DITXL, "kwargs": {**DITXL["kwargs"], "size": args.ditxl_size}}


def ditxl_sampling(config, snapshot, tmp: Path, args) -> dict:
    """`diffrelay sample` of a DiT-XL/2 snapshot: --ditxl-steps DDPM steps with CFG 1.5, TF32 on and off."""
    row = {}
    for tf32 in (True, False):
        out = tmp / f"samples_tf32_{tf32}"
        run("sample", "--config", config, "--snapshot", snapshot, "--out", out, "--num-images",
            args.ditxl_samples, "--batch-size", args.ditxl_samples, "--steps", args.ditxl_steps, "--solver", "ddpm",
            "--guidance", 1.5, "--ddpm-guided-channels", 3, "--tf32" if tf32 else "--no-tf32")
        m = json.loads((out / "manifest.json").read_text())
        row[f"sample_images_per_s_tf32_{'on' if tf32 else 'off'}"] = m["images_per_s"]
        print(f"ditxl sampling ({args.ditxl_steps} DDPM steps, CFG 1.5, tf32 {tf32}): {m['images_per_s']:.3f} img/s",
              flush=True)
    return row | {"sample": {"images": args.ditxl_samples, "steps": args.ditxl_steps, "guidance": 1.5,
                             "precision": "fp32"}}


def ditxl_case(tmp: Path, args, peak) -> dict:
    """DiT-XL/2 on 256 px latents: training against the bare loop (its sampling is the ditxl-sample case)."""
    data, prepared = ditxl_data(tmp, args)
    model = ditxl_model(args)
    row = train_case("ditxl", model, tmp, tmp / "ditxl_dataset", args, peak, data,
                     {"label_dropout": 0.1, "grad_clip": 0.0, "channels_last": False}, args.ditxl_batch)
    row.pop("snapshot"), row.pop("config")
    return row | {"model": model, **prepared}


def ditxl_sample_case(tmp: Path, args) -> dict:
    """Sampling alone: a randomly initialised DiT-XL/2 made a snapshot by `diffrelay import` (no training, no
    10.8 GB checkpoint), then --ditxl-steps DDPM steps with CFG 1.5, TF32 on and off. Nothing is encoded."""
    from diffrelay import config
    from diffrelay.config import preflight
    from diffrelay.nets import registry
    from safetensors.torch import save_file

    data = {"kind": "shapes", "resolution": args.ditxl_res, "count": args.ditxl_images, "encoder": "sd-vae",
            "encoder_path": str(tmp / "vae"), "latent_norm": "dit"}
    if not (tmp / "vae").exists():
        tiny_vae(tmp / "vae")
    model = ditxl_model(args)
    cfg_dict = run_config("ditxl_sample", model, tmp, args, data, {"label_dropout": 0.1})  # CFG needs it
    path = write_config(tmp, "ditxl_sample", cfg_dict)
    cfg = config.Config(config.validate(cfg_dict))
    channels, side = preflight.net_geometry(cfg)
    torch.manual_seed(0)
    net = registry.build_network("dit", model["kwargs"], side, channels, preflight.num_classes(cfg))
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp / "ditxl_random.safetensors")
    del net
    snapshot = tmp / "ditxl_sample.safetensors"
    run("import", "--config", path, "--checkpoint", tmp / "ditxl_random.safetensors", "--out", snapshot,
        "--layout", "diffrelay")
    return {"model": model, "weights": "random (torch.manual_seed(0))"} | ditxl_sampling(path, snapshot, tmp, args)


def ditxl_compile_case(tmp: Path, args, peak) -> dict:
    """The ditxl case's training with train.compile on (the bare loop compiled too), on the same latents."""
    data, prepared = ditxl_data(tmp, args)
    model = ditxl_model(args)
    row = train_case("ditxl_compile", model, tmp, tmp / "ditxl_dataset", args, peak, data,
                     {"label_dropout": 0.1, "grad_clip": 0.0, "channels_last": False, "compile": True,
                      "threads": args.compile_threads}, args.ditxl_batch)
    row.pop("snapshot"), row.pop("config")
    return row | {"model": model, "compile": True, **prepared}


def eval_case(snapshot, data_dir, tmp: Path, args) -> dict:
    """`diffrelay sample` of --fid-images images, then `diffrelay fid` on them, each timed."""
    out = tmp / "samples"
    run("sample", "--snapshot", snapshot, "--out", out, "--num-images", args.fid_images, "--batch-size", 500,
        "--precision", "bf16", "--tf32")
    sampled = json.loads((out / "manifest.json").read_text())
    # fid-ref reads the prepared images.npy itself: no PNG of the training set is needed.
    extractor, ref = tmp / "extractor.pt", tmp / "ref.npz"
    run("fetch-extractor", "--extractor", args.extractor, "--out", extractor)
    run("fid-ref", "--dataset", data_dir, "--extractor", extractor, "--num", args.fid_images, "--out", ref)
    t0 = time.perf_counter()
    run("fid", "--images", out, "--ref", ref, "--extractor", extractor, "--batch-size", 500, "--threads", 8,
        "--device", DEVICE, "--out", tmp / "fid.json")
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
        path = write_config(tmp, name, run_config(name, UNET, tmp, args, train={"nproc_per_node": n},
                                                  batch=per_gpu * n))
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
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps per measurement (a multiple of 4)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--images", type=int, default=50000, help="synthetic training images")
    ap.add_argument("--fid-images", type=int, default=10000)
    ap.add_argument("--extractor", default="random", help="random (offline) or inception (downloads once)")
    ap.add_argument("--cases", default="unet,dit,eval,ditxl,ditxl-sample,scaling", help="which measurements, comma-separated")
    ap.add_argument("--ditxl-size", default="XL", help="DiT size of the ditxl case (S for a dry run)")
    ap.add_argument("--ditxl-batch", type=int, default=128)
    ap.add_argument("--ditxl-res", type=int, default=256, help="pixels; latents are a factor 8 smaller")
    ap.add_argument("--ditxl-images", type=int, default=1024, help="images encoded for the ditxl case")
    ap.add_argument("--ditxl-samples", type=int, default=32, help="images sampled, TF32 on and off")
    ap.add_argument("--ditxl-steps", type=int, default=250)
    ap.add_argument("--compile-threads", type=int, default=8, help="inductor's compile workers (ditxl-compile)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the code")
    ap.add_argument("--out", default=str(HERE / "results" / "gpu.json"), help="where the JSON goes")
    args = ap.parse_args()
    DEVICE, cases = args.device, set(args.cases.split(","))
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False); nothing measured, "
              "nothing written. Run it on a GPU machine.", file=sys.stderr)
        sys.exit(2)
    from synthetic import write_dataset

    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    peak = peak_flops(device) if DEVICE == "cuda" else None
    result = {"command": "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:]), "device": device,
              "peak_bf16_flops": peak, "torch": torch.__version__, "cuda": torch.version.cuda, "batch": args.batch,
              "resolution": 32, "switches": FAST | {"precision": "bf16"}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every case: a run cut short keeps what it measured
        out.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_dir = write_dataset(tmp / "data", args.images, 32) if cases & {"unet", "dit", "eval"} else None
        snapshot = None
        for case in args.cases.split(","):  # in the order given: the first ones are measured even if cut short
            if case in ("unet", "dit"):
                model = UNET if case == "unet" else DIT
                result[case] = train_case(case, model, tmp, data_dir, args, peak) | {"model": model}
                snapshot = result[case].pop("snapshot") if case == "unet" else snapshot
                result[case].pop("config"), result[case].pop("snapshot", None)
            elif case == "eval" and snapshot:
                result["eval"] = eval_case(snapshot, data_dir, tmp, args)
            elif case == "ditxl":
                result["ditxl"] = ditxl_case(tmp, args, peak)
            elif case == "ditxl-sample":
                result["ditxl_sample"] = ditxl_sample_case(tmp, args)
            elif case == "ditxl-compile":
                result["ditxl_compile"] = ditxl_compile_case(tmp, args, peak)
            save()
        if "scaling" in cases:
            result["scaling"] = (scaling_case(tmp, data_dir, args) if DEVICE == "cuda" and
                                 torch.cuda.device_count() > 1 else "not measured: one GPU")
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
