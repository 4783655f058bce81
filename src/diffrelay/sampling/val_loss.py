"""val_loss: the training objective's loss on the held-out split, from a snapshot, in a process of its own.

kohya's sd-scripts (docs/validation.md) and SimpleTuner (documentation/evaluation/EVAL_LOSS.md) compute a held-out
loss inside their training loops, with the validation noise and timesteps fixed so that the curve compares
checkpoints, not draws. Here the same idea runs as a workflow job per snapshot (`diffrelay val-loss`), outside any
process group, on an evaluation GPU:

- images: the held-out split of the prepared dataset (data.val_fraction or data.val_path: `val/`), each with its
  first caption; a latent run encodes them with the run's encoder (the snapshot's recorded one, checked by sha256)
  and draws each latent from its posterior with the image's own generator, as the loader draws training latents;
- draws: image i's noise (and latent draw) come from a generator seeded by (run.seed, i), so every checkpoint
  sees the same noise; the time is not drawn: evaluation j takes image j mod N at the fixed quantile
  u_k = (k + 1/2) / LEVELS, k = j mod LEVELS, of the objective's own time distribution (rnd = Phi^-1(u_k), the
  standard normal every objective maps to its sigma or t, monotonically), for j < max(N, LEVELS): one forward an
  image, as a training step gives it, and every level at least once; a stratified estimate of the expectation the
  training loss samples;
- buckets: low, middle and high noise are the levels in each third of that distribution (SimpleTuner reports its
  eval loss per timestep range likewise); `val_loss` is the mean over all levels;
- the network: the snapshot's sampled weights (sample.weights, the first EMA), in eval mode, fp32, no dropout of
  labels or captions, no augmentation, no offset noise.
The same snapshot and batch size give the same value; a trained step changes it.

A sampling module: it runs a snapshot's network as sampling does (training.checkpoint, objectives, the text
source); its config rule is evaluation/protocol.py's, and the report and trackers read its files by name.
Imports torch, the objectives and the data readers when run.
"""

import math
import time
from pathlib import Path

from diffrelay import io, logs
from diffrelay.errors import UserError

LEVELS = 6  # two quantiles in each third (low, middle, high noise); N images share them round-robin
BUCKETS = ("low", "middle", "high")
SEED_TAG = 0x7A15  # the held-out draws' stream, apart from training's (data/order.py derive_seed)
COLUMNS = ("val_loss", *(f"val_loss_{b}" for b in BUCKETS))
FIX = ("hold images out with data.val_fraction (or data.val_path) and rerun `diffrelay prepare`, or drop val_loss "
       "from fid.metrics")


def levels(count: int = LEVELS) -> list[float]:
    """The standard normal quantiles Phi^-1((k + 1/2) / count), k = 0 .. count - 1, lowest noise first."""
    from statistics import NormalDist

    return [NormalDist().inv_cdf((k + 0.5) / count) for k in range(count)]


def bucket_of(k: int, count: int = LEVELS) -> str:
    return BUCKETS[min(3 * k // count, 2)]


def _held_out(dataset: Path):
    from diffrelay.data import datasets

    val = datasets.open_val(dataset)
    if val is None or val.images is None or not val.count:
        raise UserError(f"{dataset}: no held-out images (val/); {FIX}")
    return val


def _batch(rows, val, enc, text, captions, meta, shape, classes, seed: int, device):
    """(x, labels, noise) of held-out images `rows`. Image i's generator, seeded by (seed, i), draws its noise
    first, then (a latent run) its latent's posterior sample, so both are the same at every checkpoint and level.
    x: pixels in [-1, 1], or that latent draw scaled as the loader scales training latents; labels: the classes
    and/or the Text of each image's first caption."""
    import numpy as np
    import torch

    from diffrelay.data import encoders, order

    gens = [torch.Generator().manual_seed(order.derive_seed(seed, SEED_TAG, i)) for i in rows]
    noise = torch.stack([torch.randn(shape, generator=g) for g in gens]).to(device)
    pixels = torch.from_numpy(np.array(val.images[rows])).permute(0, 3, 1, 2)  # a copy: the array is read-only
    if enc is None:
        x = pixels.to(device, torch.float32) / 127.5 - 1
    else:
        mean, std = encoders.encode(enc, pixels.to(device), meta["latent"]["encoder"])
        eps = torch.stack([torch.randn(shape, generator=g) for g in gens]).to(device)
        scale, bias = (torch.tensor(meta["latent"][k], device=device).view(1, -1, 1, 1) for k in ("scale", "bias"))
        x = (mean + std * eps) * scale + bias
    labels = torch.from_numpy(np.asarray(val.labels[rows])).to(device) if classes else None
    if text is None:
        return x, labels, noise
    cond = text.encode([captions[i] for i in rows], device)
    cond.labels = labels
    return x, cond, noise


def compute(cfg, snapshot, dataset, device="cpu", batch_size: int = 16, threads: int = 1) -> dict:
    """The held-out loss of `snapshot` (cfg: the run's Config) over `dataset`'s val/ split: the result record."""
    import torch

    from diffrelay import objectives
    from diffrelay.data import latents
    from diffrelay.sampling import prompted
    from diffrelay.text import source as text_source
    from diffrelay.training import checkpoint

    started = time.time()
    torch.set_num_threads(threads)
    device, snapshot, dataset = torch.device(device), Path(snapshot), Path(dataset)
    val = _held_out(dataset)
    run = cfg.to_dict()
    net, meta = checkpoint.load_snapshot(snapshot, cfg.sample.weights, device, run["model"])
    enc = latents.load_decoder(meta, snapshot, run["data"], cfg.run.resources, device)
    text = text_source.for_sampling(meta, run["data"], snapshot)
    captions = [it.prompt for it in prompted.held_out(dataset, 0)] if text is not None else None
    shape = tuple(meta["image_shape"])
    classes = meta.get("num_classes", 0) if run["model"].get("class_conditional") else 0
    normals = levels()
    sums, counts = [0.0] * len(normals), [0] * len(normals)
    # Evaluation j uses image j mod N at level j mod LEVELS, for j < max(N, LEVELS): each image once (one forward,
    # as a training step gives it) and every level at least once; taken a level at a time, so a batch has one level.
    plan = [(j % val.count, j % len(normals)) for j in range(max(val.count, len(normals)))]
    with torch.no_grad():
        for k, r in enumerate(normals):
            mine = [i for i, level in plan if level == k]
            for start in range(0, len(mine), batch_size):
                rows = mine[start:start + batch_size]
                x, labels, noise = _batch(rows, val, enc, text, captions, meta, shape, classes, cfg.run.seed, device)
                loss = objectives.loss(cfg, net, x, labels, torch.full((len(rows),), r, device=device), noise)
                if not torch.isfinite(loss):
                    raise UserError(f"{snapshot}: the held-out loss is not finite (images {rows} of {dataset / 'val'});"
                                    " the weights are broken (check the training loss)")
                sums[k] += float(loss) * len(rows)
                counts[k] += len(rows)
    per_level = [t / n for t, n in zip(sums, counts)]
    out = {"val_loss": sum(per_level) / len(per_level)}
    for b in BUCKETS:
        part = [v for k, v in enumerate(per_level) if bucket_of(k) == b]
        out[f"val_loss_{b}"] = sum(part) / len(part)
    return out | {"levels": per_level, "normals": normals, "count": val.count, "step": meta["step"],
                  "snapshot": str(snapshot), "snapshot_sha256": io.sha256_file(snapshot),
                  "objective": objectives.objective(meta["model"]), "weights": cfg.sample.weights,
                  "batch_size": batch_size, "device": str(device), "seed": cfg.run.seed,
                  "seconds": round(time.time() - started, 3), "finished": time.time()}


def main(args) -> int:
    from diffrelay import config
    from diffrelay.runtime import distributed

    log = logs.setup()
    # Only its own earlier result is replaced: never a user's file, a score or a snapshot.
    io.check_file_target(args.out, lambda p: io.is_json_object(p, ("val_loss", "levels", "snapshot_sha256")),
                         "a result written by `diffrelay val-loss`")
    cfg = config.load(args.config)  # its rules refuse val_loss without a held-out split (evaluation/protocol.py)
    dataset = Path(args.dataset) if args.dataset else config.run_dir(cfg) / "dataset"
    batch = args.batch_size or cfg.sample.batch_size
    rec = compute(cfg, args.snapshot, dataset, distributed.pick_device(args.device or cfg.run.device), batch,
                  args.threads or cfg.sample.threads)
    io.write_json(args.out, rec)
    log.info(f"{args.snapshot}: val_loss {rec['val_loss']:.6g} (low {rec['val_loss_low']:.4g}, middle "
             f"{rec['val_loss_middle']:.4g}, high {rec['val_loss_high']:.4g}) over {rec['count']} held-out images, "
             f"{len(rec['levels'])} noise levels each, {rec['seconds']:.1f} s -> {args.out}")
    return 0 if math.isfinite(rec["val_loss"]) else 1
