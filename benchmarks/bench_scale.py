"""Host work per training step at dataset sizes up to ImageNet's, and a training process's memory.

  python benchmarks/bench_scale.py [--quick] [--resolution 8] [--threads 1] [--sizes 2000 50000 1281167] [--no-rss]
  python benchmarks/bench_scale.py --latents [--sizes 2000 50000 200000]   # -> results/scale_latents.json
  python benchmarks/bench_scale.py --buckets [--resolution 8] [--bucket-step 1]   # -> results/scale_buckets.json

host_ms_per_step[<dataset size>][<images per process>]: the host work of one training step with the
network taken out, on one process: the data order (DataOrder.next_batch), reading the rows from the
memory-mapped images, converting them to float NCHW and the noise draws (loader.BatchMaker.make),
all run in turn on the calling thread. (In training a background thread does all but the first
while the step runs, so this is the work to hide, not the time the loop waits.) The cached epoch
permutation is rebuilt once per epoch: `epoch_rebuild_ms` is that cost, `amortized` spreads it
over the epoch's steps. `before_ms_per_step` is the same work done the previous way (the whole
permutation rebuilt every step, one SeedSequence and torch.Generator per image).

rss: resident memory (MiB) of a `diffrelay train` process (tiny network, 256 images a step) at the
end of its segment, and of a loader-only process after reading one whole epoch, at 100k and 1.28M
images; `imports_only` is a process that has only imported torch and diffrelay. RssAnon is the
process's own memory; RssFile is the memory-mapped images in the page cache, shared and
reclaimable by the kernel. Writes benchmarks/results/scale.json.

--latents: the same host work for a latent dataset (data.encoder sd-vae at 256 px, so 4 x 32 x 32 latents with
data.xflip 0.5): reading each row's mean and std (a flipped row from latents_xflip.npy), the objective's noise and
this step's draw of every latent, (mean + std * eps) * scale + bias. Random values, written in full (64 KiB an
image with the mirrors: 200,000 images are 13 GB, so ImageNet's 1.28 M are not written here). No rss runs.

--buckets: the same host work for a pixel dataset prepared with data.buckets (data/bucketed.py's layout, written by
synthetic.write_bucketed_dataset): buckets.sizes(resolution, --bucket-step, 2.0) (8 px, step 1: 6x10, 7x9, 8x8, 9x7,
10x6, the shapes of 1024 px in 128-pixel steps) filled by synthetic.PHOTO_MIX (landscape first: about 39 % 10x6,
22 % 8x8, 17 % 6x10, 14 % 9x7, 8 % 7x9), the rows of each bucket scattered over the dataset's order. A step is
BucketOrder.next_batch and BatchMaker.make(step, indices, bucket) (the read from one bucket's array through
rows.npy); `sizes_ms_per_step` is what a text run adds on top (BatchMaker._sizes: SDXL's add_time_ids rows from
sizes.npy). `epoch_rebuild_ms`: BucketOrder's epoch (each bucket's permutation cut into batches, the batches'
permutation), the median of 3 epochs; `members_ms`: the rows of each bucket, found once when a segment starts.
Prepare's merge rule (min_images = one global batch) is applied per batch size, so the 2000-image set has fewer
buckets at 256 and 1024 images a step (`buckets` records which). The same work without buckets (DataOrder, the
square images.npy at the same resolution) is measured in the same run, alternately: `unbucketed_ms_per_step`
(1200 steps each, in 6 alternate passes of 200). No rss runs. Other processes may share the CPUs:
`machine.load_average` is read at the start and the end.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from synthetic import write_dataset  # noqa: E402

SIZES = (2000, 50000, 1281167)
PER_PROCESS = (64, 256, 1024)
RSS_SIZES = (100000, 1281167)
SEED = 0


def host_step_ms(data, per_process: int, steps: int) -> list[float]:
    from diffrelay.data.loader import BatchMaker
    from diffrelay.data.order import DataOrder

    order = DataOrder(SEED, data.count, per_process)
    maker = BatchMaker(data, SEED, per_process, rank=0, world=1, grad_accum=1, device="cpu",
                       xflip=0.5 if data.latent else 0.0)
    times = []
    for step in range(steps + 3):  # the first steps pay the first permutation and warm caches
        t0 = time.perf_counter()
        maker.make(step, order.next_batch()[0])
        times.append((time.perf_counter() - t0) * 1e3)
    return times[3:]


def before_step_ms(data, per_process: int, steps: int) -> list[float]:
    """The previous code's host work: permutation rebuilt every step, a generator per image."""
    from diffrelay.data.loader import read_rows, to_float
    from diffrelay.data.order import derive_seed, global_indices

    shape = (3, data.resolution, data.resolution)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        start = step * per_process
        idx = global_indices(SEED, data.count, start, per_process)
        images = to_float(read_rows(data, idx)[0])
        rnd, noise = torch.empty(per_process), torch.empty(per_process, *shape)
        for i, pos in enumerate(range(start, start + per_process)):
            g = torch.Generator().manual_seed(derive_seed(SEED, 0x401E, pos))
            rnd[i] = torch.randn((), generator=g)
            noise[i] = torch.randn(shape, generator=g)
        times.append((time.perf_counter() - t0) * 1e3)
        del images
    return times


def memory_status() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)  # kB -> MiB
    return fields


TRAIN = """
import json, sys
from diffrelay import config
from diffrelay.data import loader
from diffrelay.training import train
sys.path.insert(0, sys.argv[3])
from bench_scale import memory_status
seen, close = [], loader.Prefetcher.close
def measured_close(self):  # the segment's end, while the images are still mapped
    seen.append(memory_status())
    close(self)
loader.Prefetcher.close = measured_close
assert train.run(config.load(sys.argv[1]), dataset_dir=sys.argv[2]) == 0
print(json.dumps(seen[0]))
"""

EPOCH = """
import json, sys
import torch
from diffrelay.data import datasets, loader
from diffrelay.data.order import DataOrder
sys.path.insert(0, sys.argv[3])
from bench_scale import memory_status
torch.set_num_threads(1)
data = datasets.open_prepared(sys.argv[1])
batch = int(sys.argv[2])
order = DataOrder(0, data.count, batch)
maker = loader.BatchMaker(data, 0, batch, rank=0, world=1, grad_accum=1, device="cpu")
steps = -(-data.count // batch)
with loader.Prefetcher(maker, order, 0, steps) as batches:
    for _ in range(steps):
        batches.next()
print(json.dumps({**memory_status(), "steps": steps}))
"""

IMPORTS = """
import json, sys
import torch
from diffrelay.data import datasets, loader
from diffrelay.training import train
sys.path.insert(0, sys.argv[1])
from bench_scale import memory_status
print(json.dumps(memory_status()))
"""


def child(code: str, *args) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def train_rss(tmp: Path, dataset: Path, steps: int) -> dict:
    import yaml

    cfg = {"run": {"name": f"rss-{dataset.name}", "results": str(tmp), "device": "cpu"},
           "data": {"kind": "shapes", "resolution": 8, "count": 2000},
           "model": {"channels": 8, "channel_mult": [1], "num_blocks": 1, "attn_resolutions": [],
                     "class_conditional": True},
           "train": {"total_steps": steps, "segment_steps": steps, "batch_size": 256, "log_every": steps,
                     "warmup_steps": 0, "threads": 1}}
    path = tmp / f"rss-{dataset.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return child(TRAIN, path, dataset, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (under 5 minutes here)")
    ap.add_argument("--resolution", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="dataset sizes for host_ms_per_step")
    ap.add_argument("--no-rss", action="store_true", help="leave out the resident-memory runs")
    ap.add_argument("--latents", action="store_true", help="a latent dataset of 4 x 32 x 32 latents (see above)")
    ap.add_argument("--out", default=None, help="[default: results/scale.json, or scale_latents.json]")
    ap.add_argument("--buckets", action="store_true", help="a bucketed pixel dataset (data.buckets, see above)")
    ap.add_argument("--bucket-step", type=int, default=None, help="--buckets: bucket sides in multiples of this "
                    "[default: resolution // 8]")
    args = ap.parse_args()
    if args.latents:
        return latent_main(args)
    if args.buckets:
        return bucket_main(args)
    args.out = args.out or str(HERE / "results" / "scale.json")
    torch.set_num_threads(args.threads)
    steps, before_steps, train_steps = (40, 3, 30) if args.quick else (300, 10, 100)
    from diffrelay.data import datasets
    from diffrelay.data.order import epoch_permutation

    result = {"settings": {**vars(args), "steps": steps, "before_steps": before_steps},
              "host_ms_per_step": {}, "host_ms_per_step_median": {}, "before_ms_per_step": {},
              "epoch_rebuild_ms": {}, "amortized_rebuild_ms_per_step": {}, "rss_mib": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rss_sizes = () if args.no_rss else RSS_SIZES
        for n in sorted(set(args.sizes) | set(rss_sizes)):
            t0 = time.perf_counter()
            write_dataset(tmp / f"d{n}", n, args.resolution)
            print(f"wrote {n} images of {args.resolution}x{args.resolution} in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        for n in args.sizes:
            data = datasets.open_prepared(tmp / f"d{n}")
            t0 = time.perf_counter()
            epoch_permutation(SEED, 1, n)
            rebuild = (time.perf_counter() - t0) * 1e3
            result["epoch_rebuild_ms"][n] = round(rebuild, 2)
            for key in ("host_ms_per_step", "host_ms_per_step_median", "before_ms_per_step",
                        "amortized_rebuild_ms_per_step"):
                result[key][n] = {}
            for b in PER_PROCESS:
                now, before = host_step_ms(data, b, steps), before_step_ms(data, b, before_steps)
                result["host_ms_per_step"][n][b] = round(statistics.mean(now), 3)
                result["host_ms_per_step_median"][n][b] = round(statistics.median(now), 3)
                result["before_ms_per_step"][n][b] = round(statistics.mean(before), 1)
                result["amortized_rebuild_ms_per_step"][n][b] = round(rebuild * b / n, 4)
                print(f"{n:>8d} images  {b:>5d}/process  host {statistics.mean(now):7.3f} ms/step "
                      f"(median {statistics.median(now):6.3f})   before {statistics.mean(before):8.1f} ms/step",
                      flush=True)
        if rss_sizes:
            result["rss_mib"]["imports_only"] = child(IMPORTS, HERE)
        for n in rss_sizes:
            result["rss_mib"][str(n)] = {"train": train_rss(tmp, tmp / f"d{n}", train_steps),
                                    "loader_one_epoch": child(EPOCH, tmp / f"d{n}", 256, HERE)}
            print(f"rss {n:>8d} images: train {result['rss_mib'][str(n)]['train']}   "
                  f"one epoch read {result['rss_mib'][str(n)]['loader_one_epoch']}", flush=True)
    result["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                         "numpy": np.__version__}
    from diffrelay import io

    io.write_json(args.out, result)
    print(f"wrote {args.out}")


def latent_main(args) -> None:
    from diffrelay import io
    from diffrelay.data import datasets
    from synthetic import write_latent_dataset

    torch.set_num_threads(args.threads)
    steps = 40 if args.quick else 300
    sizes = args.sizes if args.sizes != list(SIZES) else [2000, 50000, 200000]
    result = {"settings": {**vars(args), "sizes": sizes, "steps": steps, "latent_shape": [4, 32, 32],
                           "xflip": 0.5}, "host_ms_per_step": {}, "host_ms_per_step_median": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            t0 = time.perf_counter()
            data = datasets.open_prepared(write_latent_dataset(Path(tmp) / f"l{n}", n))
            os.sync()  # the write-back of gigabytes just written would compete with the reads measured
            print(f"wrote {n} latents (and their mirrors) in {time.perf_counter() - t0:.1f} s", flush=True)
            result["host_ms_per_step"][n], result["host_ms_per_step_median"][n] = {}, {}
            for b in PER_PROCESS:
                now = host_step_ms(data, b, steps)
                result["host_ms_per_step"][n][b] = round(statistics.mean(now), 3)
                result["host_ms_per_step_median"][n][b] = round(statistics.median(now), 3)
                print(f"{n:>8d} latents  {b:>5d}/process  host {statistics.mean(now):7.3f} ms/step "
                      f"(median {statistics.median(now):6.3f})", flush=True)
            del data
            shutil.rmtree(Path(tmp) / f"l{n}")  # the disk holds one size at a time
    result["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                         "numpy": np.__version__}
    out = args.out or str(HERE / "results" / "scale_latents.json")
    io.write_json(out, result)
    print(f"wrote {out}")


def bucket_step_ms(data, per_process: int, steps: int) -> tuple[list[float], list[float]]:
    """Host ms of each step of a bucketed dataset (BucketOrder + BatchMaker.make), and of its SDXL size rows."""
    from diffrelay.data.loader import BatchMaker
    from diffrelay.data.order import BucketOrder

    order = BucketOrder(SEED, data.buckets.members(), per_process)
    maker = BatchMaker(data, SEED, per_process, rank=0, world=1, grad_accum=1, device="cpu")
    times, sizes = [], []
    for step in range(steps + 3):  # the first steps pay the first epoch and warm caches
        t0 = time.perf_counter()
        idx = order.next_batch()[0]
        maker.make(step, idx, order.bucket)
        t1 = time.perf_counter()
        maker._sizes(idx, order.bucket)
        times.append((t1 - t0) * 1e3)
        sizes.append((time.perf_counter() - t1) * 1e3)
    return times[3:], sizes[3:]


def bucket_main(args) -> None:
    from diffrelay import io
    from diffrelay.data import buckets, datasets
    from diffrelay.data.order import BucketOrder
    from synthetic import bucket_counts, write_bucketed_dataset

    torch.set_num_threads(args.threads)
    steps, passes = (40, 2) if args.quick else (1200, 6)
    step = args.bucket_step or max(1, args.resolution // 8)
    sizes = buckets.sizes(args.resolution, step, 2.0)
    settings = {"step": step, "max_aspect": 2.0, "upscale": False}
    keys = ("host_ms_per_step", "host_ms_per_step_median", "unbucketed_ms_per_step", "unbucketed_ms_per_step_median",
            "sizes_ms_per_step", "epoch_rebuild_ms", "amortized_rebuild_ms_per_step", "members_ms", "buckets")
    result = {"settings": {**vars(args), "bucket_step": step, "max_aspect": 2.0, "steps": steps, "passes": passes,
                           "bucket_sizes": [list(s) for s in sizes]}, **{k: {} for k in keys},
              "unbucketed_epoch_rebuild_ms": {}}
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for n in args.sizes:
            t0 = time.perf_counter()
            plain = datasets.open_prepared(write_dataset(tmp / f"d{n}", n, args.resolution))
            made = {}
            for b in PER_PROCESS:
                used, counts, merged = bucket_counts(n, sizes, minimum=b)
                key = (tuple(used), tuple(counts))
                if key not in made:
                    made[key] = datasets.open_prepared(write_bucketed_dataset(
                        tmp / f"b{n}-{len(made)}", n, args.resolution, used, counts,
                        {**settings, "min_images": b, "merged": merged}))
            os.sync()  # the write-back of what was just written would compete with the reads measured
            print(f"wrote {n} images of {args.resolution}x{args.resolution}, squares and {len(made)} bucketed "
                  f"set(s), in {time.perf_counter() - t0:.1f} s", flush=True)
            t0 = time.perf_counter()
            from diffrelay.data.order import epoch_permutation
            epoch_permutation(SEED, 1, n)
            result["unbucketed_epoch_rebuild_ms"][n] = round((time.perf_counter() - t0) * 1e3, 2)
            for key in keys:
                result[key][n] = {}
            for b in PER_PROCESS:
                used, counts, _ = bucket_counts(n, sizes, minimum=b)
                data = made[(tuple(used), tuple(counts))]
                t0 = time.perf_counter()
                groups = data.buckets.members()
                members = (time.perf_counter() - t0) * 1e3
                order, rebuilds = BucketOrder(SEED, groups, b), []
                for epoch in (1, 2, 3):
                    t0 = time.perf_counter()
                    order._permutation(epoch)
                    rebuilds.append((time.perf_counter() - t0) * 1e3)
                rebuild = statistics.median(rebuilds)
                ours, plain_ms, extra = [], [], []
                for _ in range(passes):  # alternately, so a busy spell on the shared machine hits both
                    o, x = bucket_step_ms(data, b, steps // passes)
                    ours += o
                    extra += x
                    plain_ms += host_step_ms(plain, b, steps // passes)
                row = {"host_ms_per_step": statistics.mean(ours), "host_ms_per_step_median": statistics.median(ours),
                       "unbucketed_ms_per_step": statistics.mean(plain_ms),
                       "unbucketed_ms_per_step_median": statistics.median(plain_ms),
                       "sizes_ms_per_step": statistics.mean(extra), "epoch_rebuild_ms": rebuild,
                       "amortized_rebuild_ms_per_step": rebuild / order.per_epoch, "members_ms": members}
                for k, v in row.items():
                    result[k][n][b] = round(v, 4 if k.startswith("amortized") else 3)
                result["buckets"][n][b] = {f"{w}x{h}": c for (w, h), c in zip(used, counts)}
                print(f"{n:>8d} images  {b:>5d}/process  {len(used)} buckets  host {row['host_ms_per_step']:7.3f} "
                      f"ms/step (median {row['host_ms_per_step_median']:6.3f})  unbucketed "
                      f"{row['unbucketed_ms_per_step']:7.3f}  sizes +{row['sizes_ms_per_step']:.3f}  epoch "
                      f"{rebuild:7.2f} ms ({row['amortized_rebuild_ms_per_step']:.4f} ms/step)  members "
                      f"{members:.1f} ms", flush=True)
            del plain, made, data
            for path in tmp.iterdir():
                shutil.rmtree(path)  # the disk holds one size at a time
    load.append(os.getloadavg())
    result["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                         "numpy": np.__version__, "load_average": [[round(x, 2) for x in v] for v in load],
                         "note": "the 2 CPUs were shared with other processes during the run"}
    out = args.out or str(HERE / "results" / "scale_buckets.json")
    io.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
