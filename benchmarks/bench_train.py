"""Training throughput of `diffrelay train` against a bare PyTorch loop, and the cost of a segment boundary.

  python benchmarks/bench_train.py [--case demo|scale|both|buckets] [--steps 120] [--resolution 16] [--batch 32]
                                   [--channels 24] [--threads 1] [--repeats 2]

Both loops train the same model on the same prepared data with the same batch and thread count,
in one run of this script. The bare loop does the same math (EDM loss, Adam, grad clipping, EMA)
with nothing else: no DDP wrapper, no per-sample seeding, no logging or all-reduce.

Case `demo`: the demo model at the --batch/--resolution given. Case `scale` (issue 10): a network
so small that the host work shows, as a GPU step would show it (8 channels, one level, 8x8
images), at batch 1024 on 100,000 images; its bare loop keeps the dataset as one float tensor,
draws with plain torch.randn and indexes a cached torch.randperm. Writes benchmarks/results/train.json
(the keys of the case run are replaced, the other case's are kept).

Case `buckets` (issue 57, only when asked: --case buckets, key "buckets"; --resolution 32 and --steps 60 unless
given): the demo model on a folder of 1024 drawn images of mixed shapes (BUCKET_SHAPES, in 4 class subfolders),
prepared twice: with data.buckets (step 8, the schema's least; at 32 px the buckets 24x40, 32x32 and 40x24, the
fewest pixels 960 of 1024) and without (the centred squares). Each against its bare loop: the bucketed bare loop
keeps each bucket's images as one float tensor, picks a bucket at random by its share of the images, then rows of
it with torch.randint. --repeats pairs, alternated (bucketed bare, bucketed diffrelay, square bare, square
diffrelay).
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

import torch
import yaml

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE))
from synthetic import write_dataset  # noqa: E402

SCALE = {"images": 100000, "resolution": 8, "batch": 1024, "steps": 48, "log_every": 12,
         "model": {"channels": 8, "channel_mult": [1], "num_blocks": 1, "attn_resolutions": [], "dropout": 0.0,
                   "class_conditional": True, "sigma_data": 0.5}}


def model_cfg(channels):
    return {"channels": channels, "channel_mult": [1, 2, 2], "num_blocks": 1, "attn_resolutions": [],
            "dropout": 0.0, "class_conditional": True, "sigma_data": 0.5}


def timed_steps(data, args, draw) -> float:
    """Steady steps/s of the plainest loop: `draw()` gives a step's (images, labels, rnd, noise); the network,
    loss, optimizer, clipping and EMA are the same in every case."""
    from diffrelay.objectives import edm
    from diffrelay.training import optim

    net = edm.build(model_cfg(args.channels), data.resolution, data.num_classes)
    ema = optim.EMA(net, [0.999])
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.99), foreach=False)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = edm.loss(net, *draw(), -1.2, 1.2, 0.5)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        ema.update(net, step)
        times.append(time.perf_counter() - t0)
    steady = times[args.steps // 4:]  # leave out warm-up
    return len(steady) / sum(steady)


def bare_loop(data_dir, args) -> float:
    """Steady steps/s of the plainest loop that does the same work."""
    import numpy as np

    from diffrelay.data import datasets

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = datasets.open_prepared(data_dir)
    images = torch.from_numpy(np.asarray(data.images)).permute(0, 3, 1, 2).float() / 127.5 - 1
    labels = torch.from_numpy(np.asarray(data.labels))

    def draw():
        idx = torch.randint(0, len(images), (args.batch,))
        return images[idx], labels[idx], torch.randn(args.batch), torch.randn(args.batch, *images.shape[1:])

    return timed_steps(data, args, draw)


def bare_bucket_loop(data_dir, args) -> float:
    """bare_loop over a bucketed dataset: each step a bucket drawn by its share of the images, rows of it at
    random."""
    import numpy as np

    from diffrelay.data import datasets

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = datasets.open_prepared(data_dir)
    b = data.buckets
    images = [torch.from_numpy(np.array(a)).permute(0, 3, 1, 2).float() / 127.5 - 1 for a in b.arrays]
    labels = [torch.from_numpy(np.asarray(data.labels)[rows]) for rows in b.members()]  # rows ascending: arrays' order
    share = torch.tensor([len(x) for x in images], dtype=torch.float64)

    def draw():
        k = int(torch.multinomial(share, 1))
        idx = torch.randint(0, len(images[k]), (args.batch,))
        return images[k][idx], labels[k][idx], torch.randn(args.batch), torch.randn(args.batch, *images[k].shape[1:])

    return timed_steps(data, args, draw)


# (width, height) of the buckets case's images, cycled: landscape, square, portrait, as a photo folder has them
BUCKET_SHAPES = ((48, 32), (40, 40), (32, 48), (64, 40), (36, 36), (40, 60), (45, 30), (50, 50))


def mixed_folder(path: Path, count: int = 1024, classes: int = 4) -> Path:
    """`count` drawn images (a disc and a bar on a coloured ground) of BUCKET_SHAPES in `classes` subfolders."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    for i in range(count):
        w, h = BUCKET_SHAPES[i % len(BUCKET_SHAPES)]
        img = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(0, 256, 3)))
        draw = ImageDraw.Draw(img)
        x, y, r = rng.integers(0, w), rng.integers(0, h), rng.integers(4, 12)
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        draw.rectangle((0, h // 3, w, h // 3 + 4), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        (path / f"c{i % classes}").mkdir(parents=True, exist_ok=True)
        img.save(path / f"c{i % classes}" / f"{i:05d}.png")
    return path


def bucket_case(tmp: Path, args) -> dict:
    """diffrelay against its bare loop on the same mixed folder, bucketed and squares (see the docstring)."""
    from diffrelay import logs

    folder = mixed_folder(tmp / "imgs")
    kinds = {"bucketed": {"step": 8, "max_aspect": 2.0}, "squares": None}
    cfgs = {}
    for kind, buckets in kinds.items():
        for i in range(args.repeats):
            cfg = {"run": {"name": f"{kind}{i}", "results": str(tmp), "device": "cpu"},
                   "data": {"kind": "folder", "path": str(folder), "resolution": args.resolution, "buckets": buckets},
                   "model": model_cfg(args.channels),
                   "train": {"total_steps": args.steps, "segment_steps": args.steps, "batch_size": args.batch,
                             "threads": args.threads, "log_every": max(1, args.steps // 4), "warmup_steps": 0}}
            cfgs[kind, i] = tmp / f"{kind}{i}.yaml"
            cfgs[kind, i].write_text(yaml.safe_dump(cfg))
        p = subprocess.run([str(BIN / "diffrelay"), "prepare", "--config", str(cfgs[kind, 0])], capture_output=True,
                           text=True)
        if p.returncode:
            sys.exit(p.stderr)
    data_dir = {kind: tmp / f"{kind}0" / "dataset" for kind in kinds}
    info = json.loads((data_dir["bucketed"] / "dataset.json").read_text())["buckets"]
    runs = {kind: [] for kind in kinds}
    for i in range(args.repeats):
        for kind in kinds:
            bare = (bare_bucket_loop if kind == "bucketed" else bare_loop)(data_dir[kind], args)
            diffrelay_run(cfgs[kind, i], args.steps, dataset=data_dir[kind])
            records = logs.read_jsonl(tmp / f"{kind}{i}" / "metrics" / "train.jsonl")
            steady = [r["steps_per_s"] for r in records if "steps_per_s" in r][1:]  # first interval has warm-up
            ours = sum(steady) / len(steady)
            runs[kind].append({"bare_steps_per_s": round(bare, 3), "diffrelay_steps_per_s": round(ours, 3),
                               "ratio": round(ours / bare, 3)})
            print(f"{kind:8s} run {i}: bare {bare:6.2f} steps/s  diffrelay {ours:6.2f} steps/s  ratio "
                  f"{ours / bare:.3f}", flush=True)
    result = {"settings": {"resolution": args.resolution, "batch": args.batch, "steps": args.steps,
                           "channels": args.channels, "threads": args.threads, "repeats": args.repeats,
                           "images": 1024, "shapes": [list(s) for s in BUCKET_SHAPES], "buckets": kinds["bucketed"]},
              "buckets": {f"{w}x{h}": n for (w, h), n in zip(info["sizes"], info["counts"])},
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                          "load_average": [round(x, 2) for x in os.getloadavg()],
                          "note": "the 2 CPUs were shared with other processes during the run"}}
    for kind, rs in runs.items():
        bare = sum(r["bare_steps_per_s"] for r in rs) / len(rs)
        ours = sum(r["diffrelay_steps_per_s"] for r in rs) / len(rs)
        result[kind] = {"runs": rs, "bare_steps_per_s": round(bare, 3), "diffrelay_steps_per_s": round(ours, 3),
                        "ratio": round(ours / bare, 3)}
    return result


def bare_scale_loop(data_dir, cfg_path, threads) -> float:
    """Steady steps/s of the scale case's bare loop: same network, loss, optimizer, clipping and EMA."""
    import numpy as np

    from diffrelay import config
    from diffrelay.data import datasets
    from diffrelay.objectives import edm
    from diffrelay.training import optim

    t = config.load(cfg_path).train
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    data = datasets.open_prepared(data_dir)
    images = torch.from_numpy(np.array(data.images)).permute(0, 3, 1, 2).float() / 127.5 - 1
    labels = torch.from_numpy(np.array(data.labels))
    net = edm.build(SCALE["model"], data.resolution, data.num_classes)
    ema = optim.EMA(net, t.ema_decays)
    opt = optim.build_optimizer(net.parameters(), t)
    b, perm, pos, times = SCALE["batch"], torch.randperm(len(images)), 0, []
    for step in range(SCALE["steps"]):
        t0 = time.perf_counter()
        if pos + b > len(perm):
            perm, pos = torch.randperm(len(images)), 0
        idx, pos = perm[pos:pos + b], pos + b
        rnd, noise = torch.randn(b), torch.randn(b, *images.shape[1:])
        loss = edm.loss(net, images[idx], labels[idx], rnd, noise, t.p_mean, t.p_std, 0.5)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), t.grad_clip)
        opt.step()
        ema.update(net, step)
        times.append(time.perf_counter() - t0)
    steady = times[SCALE["log_every"]:]  # the same warm-up diffrelay's first logging interval leaves out
    return len(steady) / sum(steady)


def scale_case(tmp: Path, threads: int, repeats: int) -> dict:
    from diffrelay import logs

    data_dir = write_dataset(tmp / "scale-data", SCALE["images"], SCALE["resolution"])
    runs = []
    for i in range(repeats):  # alternate, so a busy spell on the shared machine hits both sides
        cfg = {"run": {"name": f"scale{i}", "results": str(tmp), "device": "cpu"},
               "data": {"kind": "shapes", "resolution": SCALE["resolution"], "count": SCALE["images"]},
               "model": SCALE["model"],
               "train": {"total_steps": SCALE["steps"], "segment_steps": SCALE["steps"], "batch_size": SCALE["batch"],
                         "threads": threads, "log_every": SCALE["log_every"], "warmup_steps": 0}}
        cfg_path = tmp / f"scale{i}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        bare = bare_scale_loop(data_dir, cfg_path, threads)
        diffrelay_run(cfg_path, SCALE["steps"], dataset=data_dir)
        records = logs.read_jsonl(tmp / f"scale{i}" / "metrics" / "train.jsonl")
        steady = [r["steps_per_s"] for r in records if "steps_per_s" in r][1:]
        ours = sum(steady) / len(steady)
        runs.append({"bare_steps_per_s": round(bare, 3), "diffrelay_steps_per_s": round(ours, 3),
                     "ratio": round(ours / bare, 3)})
        print(f"scale run {i}: bare {bare:6.3f} steps/s  diffrelay {ours:6.3f} steps/s  ratio {ours / bare:.3f}",
              flush=True)
    bare = sum(r["bare_steps_per_s"] for r in runs) / repeats
    ours = sum(r["diffrelay_steps_per_s"] for r in runs) / repeats
    return {"settings": {k: v for k, v in SCALE.items()} | {"threads": threads, "repeats": repeats},
            "runs": runs, "bare_steps_per_s": round(bare, 3), "diffrelay_steps_per_s": round(ours, 3),
            "ratio": round(ours / bare, 3)}


def diffrelay_run(cfg_path, until, init=None, dataset=None):
    cmd = [str(BIN / "diffrelay"), "train", "--config", str(cfg_path), "--until-step", str(until)]
    if init:
        cmd += ["--init", str(init)]
    if dataset:
        cmd += ["--dataset", str(dataset)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr)
    return t0, time.time()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="[default: 120; the buckets case 60]")
    ap.add_argument("--resolution", type=int, default=None, help="[default: 16; the buckets case 32]")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--channels", type=int, default=24)  # the demo model
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--case", choices=["demo", "scale", "both", "buckets"], default="both",
                    help="both = demo and scale; buckets only when asked")
    ap.add_argument("--repeats", type=int, default=2, help="scale case: bare/diffrelay pairs to average")
    ap.add_argument("--out", default=str(HERE / "results" / "train.json"))
    args = ap.parse_args()
    args.steps = args.steps or (60 if args.case == "buckets" else 120)
    args.resolution = args.resolution or (32 if args.case == "buckets" else 16)

    from diffrelay import io

    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    if args.case == "buckets":
        with tempfile.TemporaryDirectory() as tmp:
            previous["buckets"] = found = bucket_case(Path(tmp), args)
        for kind in ("bucketed", "squares"):
            print(f"{kind:8s} diffrelay {found[kind]['diffrelay_steps_per_s']:.2f} vs bare "
                  f"{found[kind]['bare_steps_per_s']:.2f} steps/s: ratio {found[kind]['ratio']:.3f}")
        io.write_json(out, previous)
        print(f"wrote {out}")
        return
    result = {k: v for k, v in previous.items() if k != "scale"} if args.case == "scale" else demo_case(args)
    if args.case == "demo" and "scale" in previous:
        result["scale"] = previous["scale"]
    if args.case != "scale" and "buckets" in previous:
        result["buckets"] = previous["buckets"]
    if args.case != "demo":
        with tempfile.TemporaryDirectory() as tmp:
            result["scale"] = scale = scale_case(Path(tmp), args.threads, args.repeats)
        print(f"scale case     diffrelay {scale['diffrelay_steps_per_s']:.3f} vs bare {scale['bare_steps_per_s']:.3f}"
              f" steps/s: ratio {scale['ratio']:.3f} (goal >= 0.9)")
    io.write_json(out, result)
    print(f"wrote {out}")


def demo_case(args) -> dict:
    from diffrelay import logs
    from diffrelay.training import checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = {"run": {"name": "bench", "results": str(tmp), "device": "cpu"},
               "data": {"kind": "shapes", "resolution": args.resolution, "count": 1024},
               "model": model_cfg(args.channels),
               "train": {"total_steps": args.steps + 1, "segment_steps": args.steps, "batch_size": args.batch,
                         "threads": args.threads, "log_every": max(1, args.steps // 4), "warmup_steps": 0}}
        cfg_path = tmp / "bench.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        subprocess.run([str(BIN / "diffrelay"), "prepare", "--config", str(cfg_path)], check=True,
                       capture_output=True)

        # (a) throughput, side by side
        bare = bare_loop(tmp / "bench" / "dataset", args)
        launched, _ = diffrelay_run(cfg_path, args.steps)
        records = logs.read_jsonl(tmp / "bench" / "metrics" / "train.jsonl")
        steady = [r["steps_per_s"] for r in records if "steps_per_s" in r][1:]  # first interval has warm-up
        ours = sum(steady) / len(steady)

        # (b) segment boundary: one more step from the checkpoint, timed from process launch
        ckpt = tmp / "bench" / "checkpoints" / checkpoint.step_name(args.steps)
        t_load = time.perf_counter()
        checkpoint.load_checkpoint(ckpt)
        load_s = time.perf_counter() - t_load
        launched2, finished2 = diffrelay_run(cfg_path, args.steps + 1, init=ckpt)
        events = logs.read_jsonl(tmp / "bench" / "metrics" / "train.jsonl")
        start_evt = [r for r in events if r.get("event") == "segment_start"][-1]
        end_evt = [r for r in events if r.get("event") == "segment_end"][-1]
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        snap = tmp / "bench" / "snapshots" / f"{checkpoint.step_name(args.steps)}.safetensors"
        result = {
            "settings": vars(args),
            "bare_steps_per_s": round(bare, 3),
            "diffrelay_steps_per_s": round(ours, 3),
            "ratio": round(ours / bare, 3),
            "boundary": {
                "launch_to_segment_start_s": round(start_evt["time"] - launched2, 2),
                "whole_one_step_segment_s": round(finished2 - launched2, 2),
                "checkpoint_save_s": end_evt.get("save_seconds"),
                "checkpoint_load_verify_s": round(load_s, 3),
                "checkpoint_bytes": size,
                "snapshot_bytes": snap.stat().st_size,
            },
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        }
    print(f"bare loop      {bare:7.2f} steps/s")
    print(f"diffrelay      {ours:7.2f} steps/s   ratio {ours / bare:.3f} (goal >= 0.95)")
    for k, v in result["boundary"].items():
        print(f"{k:28s} {v}")
    return result


if __name__ == "__main__":
    main()
