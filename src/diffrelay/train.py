"""`diffrelay train`: one training segment. Resume, train to a target step, write one checkpoint, exit.

  python -m diffrelay train --config config/config.yaml --until-step 400
  torchrun --standalone --nproc-per-node 2 -m diffrelay train --config config/config.yaml --until-step 800 \\
      --init results/demo/checkpoints/step_0000400

Evaluation never runs here: the segment writes snapshots and a checkpoint, and sampling and FID
are separate processes that read those files.
"""

import contextlib
import json
import math
import signal
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from diffrelay import augment, checkpoint, config, datasets, distributed, edm, logs, optim
from diffrelay.errors import UserError
from diffrelay.sampler import DataOrder, rank_slice, sample_seed, step_seed

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after saving; a retry resumes from the recovery checkpoint


class StopRequest:
    """Remembers SIGTERM/SIGUSR1 (SLURM's warning before the time limit) until the loop can act on it."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum


def _batch(data, idx: np.ndarray, device):
    """uint8 NHWC rows -> float NCHW in [-1, 1], and labels."""
    order = np.argsort(idx, kind="stable")  # sorted reads are kinder to a memory-mapped file
    x = np.empty((len(idx), *data.images.shape[1:]), dtype=np.uint8)
    x[order] = data.images[idx[order]]
    images = torch.from_numpy(x).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1
    return images, torch.from_numpy(data.labels[idx]).to(device)


def _find_start(run_dir: Path, until: int, init, traj: str, log):
    """Checkpoint to resume from: --init, or a newer recovery/segment checkpoint of the same trajectory.

    Returns (step, path, state, meta); (0, None, None, None) to start from scratch. A corrupt
    checkpoint named by --init is an error; a corrupt one found by search is skipped with a warning,
    so the previous good checkpoint stays usable.
    """
    floor, found = -1, []
    if init:
        init = Path(init)
        if not checkpoint.is_complete(init):
            raise UserError(f"{init}: not a complete checkpoint (no manifest.json); rerun the segment that makes it")
        floor = int(json.loads((init / "manifest.json").read_text())["step"])
    for folder in ("checkpoints", "recovery"):
        for step, path in checkpoint.list_checkpoints(run_dir / folder):
            try:
                same = json.loads((path / "meta.json").read_text()).get("trajectory") == traj
            except (OSError, ValueError):
                same = False
            if same and floor < step <= until:
                found.append((step, path))
    for step, path in sorted(set(found), reverse=True):
        try:
            return (step, path, *checkpoint.load_checkpoint(path))
        except UserError as e:
            log.warning(f"skipping unusable checkpoint: {e}")
    if init:
        return (floor, init, *checkpoint.load_checkpoint(init))
    return 0, None, None, None


def _meta(cfg, step, data, traj) -> dict:
    return {"step": step, "trajectory": traj, "config": cfg.to_dict(), "model": cfg.to_dict()["model"],
            "image_shape": [3, data.resolution, data.resolution], "num_classes": data.num_classes,
            "class_names": list(data.class_names), "dataset_fingerprint": data.fingerprint}


def _prune_recovery(folder: Path, keep: int) -> None:
    import shutil

    for _, path in checkpoint.list_checkpoints(folder)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def run(cfg, until_step=None, init=None, dataset_dir=None, trace=None) -> int:
    t, run_dir = cfg.train, config.run_dir(cfg)
    until = t.total_steps if until_step is None else until_step
    if not 0 < until <= t.total_steps:
        raise UserError(f"--until-step {until}: must be between 1 and train.total_steps={t.total_steps}")
    traj = config.trajectory_hash(cfg)

    # ---- Set-up: device, process group, logging, data, model, optimizer --------------------------
    device = distributed.pick_device(cfg.run.device)
    torch.set_num_threads(t.threads)
    torch.backends.cudnn.benchmark = False
    distributed.init(device, t.timeout_minutes)
    rank, world = distributed.rank(), distributed.world()
    log = logs.setup(main=distributed.is_main())
    if t.batch_size % (world * t.grad_accum):
        raise UserError(f"train.batch_size={t.batch_size}: not divisible by {world} processes x "
                        f"train.grad_accum={t.grad_accum}; change the batch or the process count")
    micro = t.batch_size // (world * t.grad_accum)
    data = datasets.open_prepared(dataset_dir or run_dir / "dataset")
    if cfg.model.class_conditional and not data.num_classes:
        raise UserError(f"model.class_conditional=true but the dataset {data.path} has no classes; set it to false")
    final_ckpt = run_dir / "checkpoints" / checkpoint.step_name(until)
    if checkpoint.is_complete(final_ckpt):
        log.info(f"{final_ckpt} already exists; nothing to do")
        distributed.teardown()
        return 0

    torch.manual_seed(cfg.run.seed)  # initial weights depend on the seed only, never on the rank
    net = edm.build(cfg.to_dict()["model"], data.resolution, data.num_classes).to(device)
    ema = optim.EMA(net, t.ema_decays)
    opt = optim.build_optimizer(net.parameters(), t)
    sched = optim.build_schedule(opt, t)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    order = DataOrder(cfg.run.seed, data.count, t.batch_size)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)

    # ---- Resume ---------------------------------------------------------------------------------
    step, start_path, state, meta = _find_start(run_dir, until, init, traj, log)
    if start_path is not None:
        if meta.get("trajectory") != traj:
            log.warning(f"{start_path}: made with different training settings; continuing from it as asked")
        net.load_state_dict(state["net"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        scaler.load_state_dict(state["scaler"])
        order.load_state_dict(state["order"])
        skipped_total = int(state["skipped"])
        log.info(f"resumed from {start_path} at step {step}")
    else:
        skipped_total = 0
        log.info("starting from scratch")
    ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)  # forward/backward only

    def save(path, at_step):
        state = {"net": net.state_dict(), "ema": ema.state_dict(), "optimizer": opt.state_dict(),
                 "schedule": sched.state_dict(), "scaler": scaler.state_dict(), "order": order.state_dict(),
                 "skipped": skipped_total, "step": at_step}
        checkpoint.save_checkpoint(path, state, _meta(cfg, at_step, data, traj))

    # ---- Where this call stops, and what it writes on the way -----------------------------------
    segment_start = step
    snapshots = set(config.snapshot_steps(cfg, segment_start, until))
    metrics_path = run_dir / "metrics" / "train.jsonl"
    trace_file = open(f"{trace}.rank{rank}", "a") if trace else None
    stop = StopRequest()
    # Every rank checks, so a missing package stops all of them, not rank 0 alone.
    board = _tensorboard(run_dir, distributed.is_main()) if t.tensorboard else None
    if distributed.is_main():
        logs.append_jsonl(metrics_path, {"event": "segment_start", "step": step, "until": until, "world": world})
    log.info(f"segment: steps {step} -> {until} of {t.total_steps} | {world} process(es) x {micro} images"
             f" x {t.grad_accum} accumulation = batch {t.batch_size} | {device.type} | {t.precision}")

    # ---- Loop -----------------------------------------------------------------------------------
    consecutive = 0
    window = {"loss": 0.0, "n": 0, "gnorm": 0.0, "t0": time.perf_counter(), "steps": 0}
    seg_t0 = time.perf_counter()
    while step < until:
        torch.manual_seed(step_seed(cfg.run.seed, step, rank))  # dropout draws from the global generator
        indices, positions = order.next_batch()
        mine, my_positions = rank_slice(indices, rank, world), rank_slice(positions, rank, world)
        drops, flips = augment.masks(cfg.run.seed, step, t.batch_size, rank, world, t.label_dropout, cfg.data.xflip)
        if trace_file:
            trace_file.write(json.dumps({"step": step, "indices": mine.tolist()}) + "\n")
        net.train()
        loss_sum = torch.zeros((), device=device)
        for k, (chunk, pos, drop, flip) in enumerate(zip(*(np.split(a, t.grad_accum)
                                                             for a in (mine, my_positions, drops, flips)))):
            images, labels = _batch(data, chunk, device)
            images, labels = augment.apply(images, labels, drop, flip, null=data.num_classes)
            rnd, noise = (x.to(device) for x in edm.draw_noise([sample_seed(cfg.run.seed, p) for p in pos],
                                                               images.shape[1:]))
            sync = contextlib.nullcontext() if k == t.grad_accum - 1 else ddp.no_sync()
            with sync, distributed.peers("gradient all-reduce"), \
                    torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = edm.loss(ddp, images, labels if data.num_classes else None, rnd, noise,
                                t.p_mean, t.p_std, cfg.model.sigma_data)
                scaler.scale(loss / t.grad_accum).backward()
            loss_sum += loss.detach() / t.grad_accum
        scaler.unscale_(opt)
        gnorm = torch.nn.utils.clip_grad_norm_(net.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        # One reduction a step carries the loss, the non-finite flag and any stop request to every rank.
        bad = ~torch.isfinite(loss_sum) | ~torch.isfinite(gnorm)
        flags = distributed.all_reduce_sum(torch.stack([
            torch.nan_to_num(loss_sum, nan=0.0, posinf=0.0), bad.float(),
            torch.tensor(float(stop.signum is not None), device=device)]).float())
        mean_loss, any_bad, any_stop = flags[0].item() / world, flags[1].item() > 0, flags[2].item() > 0
        if any_bad:
            scaler.update()  # fp16: lowers the scale; the update itself is skipped
            skipped_total, consecutive = skipped_total + 1, consecutive + 1
            log.warning(f"step {step}: non-finite loss or gradient; update skipped ({consecutive} in a row)")
        else:
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(net, step)
            consecutive = 0
            window["loss"] += mean_loss
            window["gnorm"] += gnorm.item()
            window["n"] += 1
        opt.zero_grad(set_to_none=True)
        step += 1
        window["steps"] += 1

        if distributed.is_main() and (step % t.log_every == 0 or step == until):
            record = _report(log, metrics_path, step, until, t, window, sched, skipped_total, seg_t0, segment_start)
            if board:
                for key in ("loss", "lr", "grad_norm", "images_per_s"):
                    board.add_scalar(f"train/{key}", record[key], step)
                board.flush()
            window = {"loss": 0.0, "n": 0, "gnorm": 0.0, "t0": time.perf_counter(), "steps": 0}
        if consecutive >= t.max_skipped_steps:
            path = run_dir / "recovery" / checkpoint.step_name(step)
            if distributed.is_main():
                save(path, step)
            distributed.barrier()
            raise UserError(f"{consecutive} consecutive non-finite steps up to step {step} (saved {path}); "
                            "lower train.lr, raise train.grad_clip or use train.precision=fp32")
        if distributed.is_main() and step in snapshots:
            _snapshot(run_dir, step, net, ema, cfg, data, traj)
        recover = t.recovery_every and step % t.recovery_every == 0 and step < until
        if distributed.is_main() and (recover or (any_stop and step < until)):
            save(run_dir / "recovery" / checkpoint.step_name(step), step)
            _prune_recovery(run_dir / "recovery", t.keep_recovery)
        if any_stop and step < until:
            distributed.barrier()
            log.warning(f"stop requested (signal); saved recovery checkpoint at step {step}; exiting for a retry")
            distributed.teardown()
            return EXIT_STOPPED

    # ---- Final checkpoint (the snapshot for `until` was written above) ---------------------------
    if distributed.is_main():
        t_save = time.perf_counter()
        save(final_ckpt, step)
        logs.append_jsonl(metrics_path, {"event": "segment_end", "step": step, "world": world,
                                         "seconds": round(time.perf_counter() - seg_t0, 3),
                                         "save_seconds": round(time.perf_counter() - t_save, 3)})
        log.info(f"wrote {final_ckpt}")
    if trace_file:
        trace_file.close()
    if board:
        board.close()
    distributed.barrier()
    distributed.teardown()
    return 0


def _snapshot(run_dir, step, net, ema, cfg, data, traj) -> None:
    path = run_dir / "snapshots" / f"{checkpoint.step_name(step)}.safetensors"
    checkpoint.save_snapshot(path, ema.nets[0].state_dict(), net.state_dict(), _meta(cfg, step, data, traj))


def _report(log, metrics_path, step, until, t, window, sched, skipped, seg_t0, segment_start) -> dict:
    dt = max(time.perf_counter() - window["t0"], 1e-9)
    rate = window["steps"] / dt
    loss = window["loss"] / max(window["n"], 1)
    eta = (until - step) / max((step - segment_start) / (time.perf_counter() - seg_t0), 1e-9)
    log.info(f"step {step:>7d}/{t.total_steps} | loss {loss:.4f} | {rate:5.2f} step/s | "
             f"{rate * t.batch_size:7.1f} img/s | skipped {skipped} | segment eta {logs.fmt_duration(eta)}")
    record = {"step": step, "loss": round(loss, 6), "lr": sched.get_last_lr()[0],
              "grad_norm": round(window["gnorm"] / max(window["n"], 1), 6), "skipped": skipped,
              "steps_per_s": round(rate, 4), "images_per_s": round(rate * t.batch_size, 2),
              "elapsed": round(time.perf_counter() - seg_t0, 3)}
    logs.append_jsonl(metrics_path, record)
    return record


def _tensorboard(run_dir, main: bool):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise UserError("train.tensorboard=true but the tensorboard package is not installed; "
                        "pip install tensorboard, or set train.tensorboard: false") from e
    return SummaryWriter(log_dir=str(run_dir / "tensorboard")) if main else None


def main(args) -> int:
    cfg = config.load(args.config)
    try:
        return run(cfg, until_step=args.until_step, init=args.init, dataset_dir=args.dataset, trace=args.trace)
    finally:
        distributed.teardown()
