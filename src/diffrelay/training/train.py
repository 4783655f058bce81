"""`diffrelay train`: one training segment. Resume, train to a target step, write one checkpoint, exit.
  python -m diffrelay train --config config/config.yaml --until-step 400
  torchrun --standalone --nproc-per-node 2 -m diffrelay train --config config/config.yaml --until-step 800 \\
      --init results/demo/checkpoints/step_0000400

Evaluation never runs here: the segment writes snapshots and a checkpoint, and sampling and FID
are separate processes that read those files.
"""

import contextlib
import dataclasses
import inspect
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from diffrelay import config, io, logs, nets, objectives
from diffrelay.config import preflight
from diffrelay.data import augment, datasets, latents, loader, sources as data_sources, subsets, tags as data_tags
from diffrelay.data.order import PairedOrder, step_seed
from diffrelay.text import source as text_source
from diffrelay.runtime import distributed, speed
from diffrelay.training import checkpoint, phema, sharding
from diffrelay.training.state import TrainState
from diffrelay.training.stop import StopRequest
from diffrelay.errors import UserError

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after saving; a retry resumes from the recovery checkpoint


def _find_start(run_dir: Path, until: int, init, traj: str, log):
    """Checkpoint to resume from: --init, or a newer recovery/segment checkpoint of the same trajectory.

    Returns (step, path, state, meta); (0, None, None, None) to start from scratch. A corrupt checkpoint named
    by --init is an error; a corrupt one found by search is skipped with a warning (the previous one stays)."""
    floor, found = -1, []
    if init:
        init = Path(init)
        if not checkpoint.is_complete(init):
            raise UserError(f"{init}: not a complete checkpoint (no manifest.json); rerun the segment that makes it")
        floor = int(json.loads((init / "manifest.json").read_text())["step"])
        if floor >= until:
            raise UserError(f"--init {init}: that checkpoint is at step {floor}, not before --until-step {until}; "
                            f"give a later --until-step or an earlier checkpoint")
    for folder in ("checkpoints", "recovery"):
        for step, path in checkpoint.list_checkpoints(run_dir / folder):
            try:
                same = config.is_same_run(json.loads((path / "meta.json").read_text()), traj)
            except (OSError, ValueError):
                same = False
            if same and floor < step <= until:
                found.append((step, path))
    for step, path in sorted(set(found), reverse=True):
        try:
            state, meta = checkpoint.load_checkpoint(path)
        except UserError as e:
            log.warning(f"skipping unusable checkpoint: {e}")
            continue
        if meta.get("diverged"):
            # The guard's verdict outlives the job: a retry or the next segment must not train on.
            raise UserError(f"{path}: the run diverged ({meta['diverged']}); lower train.lr, raise train.grad_clip or "
                            "use train.precision=fp32, and start a new run.name (optionally --init an earlier checkpoint)")
        return step, path, state, meta
    if init:
        return (floor, init, *checkpoint.load_checkpoint(init))
    return 0, None, None, None


def _check_resume(cfg, path, meta, data, traj: str) -> None:
    """One line instead of a silent wrong run or a state-dict traceback (a UNet key in a DiT run is no reason)."""
    model, made = config.applicable_model(cfg.to_dict()["model"]), config.applicable_model(meta.get("model") or {})
    config.check_same_files(made, model, str(path), "the checkpoint")  # a LoRA run's base pipeline, by its files
    key = config.first_difference(made, model)
    if key:
        raise UserError(f"{path}: made with model.{key}={config.lookup(made, key)!r}; this config "
                        f"has model.{key}={config.lookup(model, key)!r}; use the same model settings to resume from it")
    text_source.check_resume(path, meta, data.text)  # the same text encoders, by sha256 and settings: said first
    if config.is_same_run(meta, traj):  # the dataset it was trained on; what changed, where the run's record knows
        data_sources.check_trained_on(path, meta.get("dataset_fingerprint"), data, config.run_dir(cfg))


def _check_writable(run_dir: Path) -> None:
    """Fail at once, on every rank alike, when the run folder cannot take checkpoints."""
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir / "checkpoints"):
            pass
    except OSError as e:
        raise UserError(f"{run_dir}: cannot write checkpoints there ({e.strerror}); fix the folder's permissions "
                        "or set run.results to a writable folder") from e


def _meta(cfg, step, data, traj) -> dict:
    return {"step": step, "trajectory": traj, "config": cfg.to_dict(), "model": cfg.to_dict()["model"],
            "image_shape": list(data.shape), "num_classes": data.num_classes,
            "class_names": list(data.class_names), "dataset_fingerprint": data.fingerprint,
            "draws": loader.DRAWS_VERSION} | ({"dit_layout": nets.DIT_LAYOUT} if cfg.model.arch in ("dit", "sit") else {}) \
        | ({"latent": latents.snapshot_record(data)} if data.latent else {}) \
        | ({"text": text_source.record(data.text)} if data.text else {})  # the encoders a text run samples with


def _prune_recovery(folder: Path, keep: int) -> None:
    for _, path in checkpoint.list_checkpoints(folder)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _write_record(record_path, final_ckpt: Path, step: int, traj: str) -> None:
    """The workflow's output for a segment: a file naming the checkpoint, which Snakemake may delete and remake."""
    if record_path:
        io.write_json(record_path, {"checkpoint": str(final_ckpt), "step": step, "trajectory": traj})


def run(cfg, until_step=None, init=None, dataset_dir=None, trace=None, record_path=None) -> int:
    with contextlib.ExitStack() as cleanup:  # stops the batch thread however the segment ends
        return _segment(cleanup, cfg, until_step, init, dataset_dir, trace, record_path)


def _segment(cleanup, cfg, until_step, init, dataset_dir, trace, record_path) -> int:
    """One segment, read top to bottom: set-up, resume, where it stops, the loop, the final checkpoint."""
    t, run_dir = cfg.train, config.run_dir(cfg)
    until = t.total_steps if until_step is None else until_step
    if not 0 < until <= t.total_steps:
        raise UserError(f"--until-step {until}: must be between 1 and train.total_steps={t.total_steps}")
    traj = config.trajectory_hash(cfg)
    # Before the slow set-up: SLURM's warning may come while a try starts; the first step then saves.
    stop = StopRequest()
    cleanup.callback(stop.close)

    # ---- Set-up: device, process group, logging, data; done already?; model and optimizer ---------
    device, log, data = _set_up(cfg, dataset_dir or run_dir / "dataset")
    rank, world = distributed.rank(), distributed.world()
    final_ckpt = run_dir / "checkpoints" / checkpoint.step_name(until)
    if _already_done(final_ckpt, cfg, traj, until, record_path, log, data):
        return 0
    _check_writable(run_dir)
    if distributed.is_main():
        preflight.write_run_record(cfg)
    st = TrainState.build(cfg, data, device)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)

    # ---- Resume ---------------------------------------------------------------------------------
    step, start_path, state, meta = _find_start(run_dir, until, init, traj, log)
    distributed.agree(step, "the step to resume from")  # each rank searched the run folder itself
    if start_path is not None:
        _check_resume(cfg, start_path, meta, data, traj)
        if not config.is_same_run(meta, traj):
            log.warning(f"{start_path}: made with different training settings; continuing from it as asked")
        st.load(state, meta, start_path)
        log.info(f"resumed from {start_path} at step {step}")
    else:
        log.info("starting from scratch")
    ddp = None if st.sharded else _wrap(st.net, device, world, t.compile)  # None: nothing for DDP to all-reduce
    model = speed.compile_model(ddp or st.net, t.compile, cfg.run.resources, t.threads)  # forward/backward

    def save(path, at_step, **extra_meta):  # every process: sharded, each writes its own shards
        st.save(path, at_step, _meta(cfg, at_step, data, traj) | extra_meta)

    def snapshot(at: int):  # an evaluation snapshot: a LoRA run's adapter only, and diffusers' file
        st.snapshot(run_dir / "snapshots" / f"{checkpoint.step_name(at)}.safetensors", _meta(cfg, at, data, traj), cfg)

    # ---- Where this call stops, and what it writes on the way -----------------------------------
    segment_start = step
    snapshots = set(config.snapshot_steps(cfg, segment_start, until))
    metrics_path = run_dir / "metrics" / "train.jsonl"
    trace_file = open(f"{trace}.rank{rank}", "a") if trace else None
    xflip, caption_dropout, cropped = subsets.probabilities(cfg.to_dict()["data"], data.subsets)  # a subset's own
    maker = loader.BatchMaker(data, cfg.run.seed, t.batch_size, rank=rank, world=world, grad_accum=t.grad_accum,
                              device=device, label_dropout=t.label_dropout, xflip=xflip, augment=t.augment,
                              text=data.text, caption_dropout=caption_dropout, random_crop=cropped,
                              noise_offset=objectives.noise_offset(cfg),
                              prior_weight=t.prior_loss_weight if isinstance(st.order, PairedOrder) else None,
                              caption_tags=cfg.data if data_tags.on(cfg.to_dict()["data"]) else None)
    batches = cleanup.enter_context(loader.Prefetcher(maker, st.order, step, until))
    # Every rank checks, so a missing package stops all of them, not rank 0 alone.
    board = _tensorboard(run_dir, distributed.is_main()) if t.tensorboard else None
    if distributed.is_main():
        logs.append_jsonl(metrics_path, {"event": "segment_start", "step": step, "until": until, "world": world})
    log.info(speed.versions(device))  # after every check: a refused start stays one line
    log.info(f"segment: steps {step} -> {until} of {t.total_steps} | {world} process(es) x "
             f"{t.batch_size // (world * t.grad_accum)} images x {t.grad_accum} accumulation = batch {t.batch_size}"
             f" | {device.type} | {t.precision}")
    if step in snapshots:  # sample.baseline: step 0, the network before any update (config/segments.py)
        snapshot(step)

    # ---- Loop -----------------------------------------------------------------------------------
    window, seg_t0 = _new_window(), time.perf_counter()
    while step < until:
        step_t0 = time.perf_counter()
        torch.manual_seed(step_seed(cfg.run.seed, step, rank))  # dropout draws from the global generator
        batch = batches.next()  # made in the background; advances `order` by one global batch
        if trace_file:
            trace_file.write(json.dumps({"step": step, "indices": batch.indices.tolist()}) + "\n")
        loss_sum, gnorm = _forward_backward(model, ddp, st, batch, step, cfg, data, device, amp_dtype)
        mean_loss, any_bad, any_stop = _reduce_step(loss_sum, gnorm, stop, device)
        stop.acknowledged = any_stop  # every rank got past the step's reduction: no watcher needed
        stop.longest_step = max(stop.longest_step, time.perf_counter() - step_t0)
        _apply_update(st, step, mean_loss, any_bad, gnorm, window, log)
        subsets.tally(window, batch.bucket, batch.subsets, data)
        step += 1
        window["steps"] += 1

        if distributed.is_main() and (step % t.log_every == 0 or step == until):
            _log_window(log, board, metrics_path, step, until, t, window, st, seg_t0, segment_start)
            window = _new_window()
        if st.consecutive >= t.max_skipped_steps:
            _stop_diverged(run_dir, step, st, save, metrics_path)
        if step in snapshots:  # every process (a sharded run gathers the weights); rank 0 writes
            snapshot(step)
        if st.pema and (step % t.phema.every == 0 or step == t.total_steps):
            # The run's last step always, so the workflow can reconstruct there whatever the length.
            st.pema.save(phema.file_path(run_dir, step), _meta(cfg, step, data, traj), st.sharded)
        recover = t.recovery_every and step % t.recovery_every == 0 and step < until
        if recover or (any_stop and step < until):  # every rank knows both (any_stop is reduced)
            save(run_dir / "recovery" / checkpoint.step_name(step), step)
            if distributed.is_main():
                _prune_recovery(run_dir / "recovery", t.keep_recovery)
        if any_stop and step < until:
            distributed.barrier()
            log.warning(f"stop requested (signal); saved recovery checkpoint at step {step}; exiting for a retry")
            distributed.teardown()
            return EXIT_STOPPED

    # ---- Final checkpoint (the snapshot for `until` was written above) ---------------------------
    t_save = time.perf_counter()
    save(final_ckpt, step)
    if distributed.is_main():
        logs.append_jsonl(metrics_path, {"event": "segment_end", "step": step, "world": world,
                                         "seconds": round(time.perf_counter() - seg_t0, 3),
                                         "save_seconds": round(time.perf_counter() - t_save, 3)})
        log.info(f"wrote {final_ckpt}")
        _write_record(record_path, final_ckpt, step, traj)
    if trace_file:
        trace_file.close()
    if board:
        board.close()
    distributed.barrier()
    distributed.teardown()
    return 0


# ---------------------------------------------------------------------------------------------
# The segment's pieces, in the order it calls them

# torch 2.14 renames broadcast_buffers (now deprecated, with a warning) to forward_sync_buffers.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else {"broadcast_buffers": False})


def _wrap(net, device, world: int, compiled: bool):
    """DDP (gradients in its buckets: no second copy; no buffer broadcast: they are constants), or None for one
    process without train.compile: nothing to all-reduce, and DDP's constructor imports torch._dynamo (1-2 s)."""
    if world > 1 or compiled:  # compiled: the compile cache holds the wrapper's graph
        return DDP(net, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
                   **_NO_BUFFER_SYNC)


def _set_up(cfg, dataset_dir):
    """(device, logger, dataset): the process group joined, backends set, batch arithmetic checked."""
    t = cfg.train
    device = distributed.pick_device(cfg.run.device)
    speed.set_determinism(device, t.deterministic)  # before the first cuBLAS call
    torch.set_num_threads(t.threads)
    speed.set_backends(device, t.tf32)
    distributed.init(device, t.timeout_minutes)
    world = distributed.world()
    log = logs.setup(main=distributed.is_main())
    if t.batch_size % (world * t.grad_accum):
        raise UserError(f"train.batch_size={t.batch_size}: not divisible by {world} processes x "
                        f"train.grad_accum={t.grad_accum}; change the batch or the process count")
    data = datasets.open_prepared(dataset_dir)
    latents.check_kind(data, cfg.data, cfg.run.resources)  # latents of this encoder for a latent run, else pixels
    if data.latent is not None:  # a hand-run train meets the workflow's check of the network against the latents
        preflight.latent_model(cfg, data.shape[1], "config")
    preflight.dataset_buckets(cfg, data, "config")  # each bucket fills a global batch; the network takes its size
    if cfg.model.class_conditional and not data.num_classes:
        raise UserError(f"model.class_conditional=true but the dataset {data.path} has no classes; set it to false")
    return device, log, dataclasses.replace(data, text=text_source.for_training(cfg.data, data, device))


def _already_done(final_ckpt: Path, cfg, traj: str, until: int, record_path, log, data) -> bool:
    """A complete checkpoint of this trajectory and dataset at `until` means nothing to do (the record is rewritten);
    after its images, captions or text encoders changed the finished run refuses, as a resumed one does."""
    if not checkpoint.is_complete(final_ckpt):
        return False
    checkpoint.verify_checkpoint(final_ckpt)
    made = io.read_json(final_ckpt / "meta.json")
    if not config.is_same_run(made, traj):
        config.check_same_files(config.trajectory(made["config"]), config.trajectory(cfg), str(final_ckpt), "it")
        key = config.first_difference(config.trajectory(made["config"]), config.trajectory(cfg)) or "train"
        raise UserError(f"{final_ckpt}: exists but was made with other settings ({key} differs); "
                        "use a new run.name for these settings (nothing was deleted)")
    _check_resume(cfg, final_ckpt, made, data, traj)
    log.info(f"{final_ckpt} already exists; nothing to do")
    if distributed.is_main():
        _write_record(record_path, final_ckpt, until, traj)
    distributed.teardown()
    return True


def _forward_backward(model, ddp, st, batch, step, cfg, data, device, amp_dtype):
    """Every accumulation round's forward and backward; gradients all-reduced in the last one.
    Returns (mean loss over the rounds, gradient norm after clipping), both still on the device."""
    t = cfg.train
    st.net.train()
    loss_sum = torch.zeros((), device=device)
    for k, ((images, labels, rnd, noise), (drop, flip)) in enumerate(zip(batch.rounds, batch.masks, strict=True)):
        images, labels = augment.apply(images, labels, drop, flip, null=data.num_classes)
        images, augment_labels = batch.augmented(k, images)  # EDM: the pipe on the clean images, before the noise
        sync = sharding.gradient_sync(st.net, st.sharded, ddp, last=k == t.grad_accum - 1)
        with sync, distributed.peers("gradient all-reduce"), speed.offloaded(t.activation_checkpointing, device), \
                torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = objectives.loss(cfg, model, images, labels if data.num_classes or data.text else None, rnd, noise,
                                   augment_labels, batch.weights[k] if batch.weights else None)
            with speed.backward_errors(model):
                st.scaler.scale(loss / t.grad_accum).backward()
        loss_sum += loss.detach() / t.grad_accum
    return loss_sum, sharding.grad_norm(st.unscaled_grad_norm(t.grad_clip))


def _reduce_step(loss_sum, gnorm, stop, device):
    """One reduction a step carries the loss, the non-finite flag and any stop request to every rank.
    Returns (mean loss, any rank non-finite, any rank asked to stop)."""
    bad = ~torch.isfinite(loss_sum) | ~torch.isfinite(gnorm)
    flags = distributed.all_reduce_sum(torch.stack([
        torch.nan_to_num(loss_sum, nan=0.0, posinf=0.0), bad.float(),
        torch.full((), float(stop.signum is not None), device=device)]).float())
    total_loss, n_bad, n_stop = flags.tolist()  # the step's one host synchronisation
    return total_loss / distributed.world(), n_bad > 0, n_stop > 0


def _apply_update(st, step, mean_loss, any_bad, gnorm, window, log) -> None:
    """The optimizer step, or its skip on a non-finite step; EMAs; the logging window's sums."""
    if any_bad:
        st.skip_update(step, log)
    else:
        # Not scaler.step: unscale_ has run and our reduction already knows the step is finite, while
        # scaler.step would read its found-inf flag with .item() (a host sync a step, fp16 without fusing).
        st.opt.step()
        st.scaler.update()
        st.sched.step()
        st.ema.update(st.net, step)
        st.consecutive = 0
        window["loss"] += mean_loss
        window["gnorm"] += gnorm.detach()  # stays on the device until a logging step reads it
        window["n"] += 1
    if st.pema:
        # Skipped steps too: the profiles are functions of the step count, and the weights held still.
        st.pema.update(st.net, step)
    st.opt.zero_grad(set_to_none=True)


def _new_window() -> dict:
    return {"loss": 0.0, "n": 0, "gnorm": 0.0, "t0": time.perf_counter(), "steps": 0}


def _log_window(log, board, metrics_path, step, until, t, window, st, seg_t0, segment_start) -> None:
    record = _report(log, metrics_path, step, until, t, window, st.sched, st.skipped_total, seg_t0, segment_start)
    if board:
        for key in ("loss", "lr", "grad_norm", "images_per_s"):
            if record[key] is not None:
                board.add_scalar(f"train/{key}", record[key], step)
        board.flush()


def _stop_diverged(run_dir, step, st, save, metrics_path) -> None:
    """Too many non-finite steps in a row: a recovery checkpoint marked diverged, then one line."""
    path = run_dir / "recovery" / checkpoint.step_name(step)
    verdict = f"{st.consecutive} consecutive non-finite steps up to step {step}"
    save(path, step, diverged=verdict)  # marked, so retries and later segments refuse to go on (_find_start)
    if distributed.is_main():
        logs.append_jsonl(metrics_path, {"event": "diverged", "step": step, "skipped": st.skipped_total,
                                         "consecutive_skipped": st.consecutive})
    distributed.barrier()
    raise UserError(f"{verdict} (saved {path}, marked diverged); "
                    "lower train.lr, raise train.grad_clip or use train.precision=fp32, and use a new run.name")


def _report(log, metrics_path, step, until, t, window, sched, skipped, seg_t0, segment_start) -> dict:
    rate = window["steps"] / max(time.perf_counter() - window["t0"], 1e-9)
    # A window where every step was skipped has no loss: None in the record, never a made-up 0.
    n = window["n"]
    loss = round(window["loss"] / n, 6) if n else None
    gnorm = round(float(window["gnorm"]) / n, 6) if n else None  # the one read of the device-side sum
    eta = (until - step) / max((step - segment_start) / (time.perf_counter() - seg_t0), 1e-9)
    log.info(f"step {step:>7d}/{t.total_steps} | loss {'n/a' if loss is None else f'{loss:.4f}'} | "
             f"{rate:5.2f} step/s | {rate * t.batch_size:7.1f} img/s | skipped {skipped} ({window['steps'] - n} here) | "
             f"segment eta {logs.fmt_duration(eta)}")
    record = {"step": step, "loss": loss, "lr": float(sched.get_last_lr()[0]),  # torchao's is a tensor
              "grad_norm": gnorm, "skipped": skipped, "skipped_in_window": window["steps"] - n,
              "steps_per_s": round(rate, 4), "images_per_s": round(rate * t.batch_size, 2),
              "elapsed": round(time.perf_counter() - seg_t0, 3)}
    record |= {k: window[k] for k in ("buckets", "subsets") if k in window}  # absent without buckets or subsets
    logs.append_jsonl(metrics_path, record)
    return record


def _tensorboard(run_dir, main: bool):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise UserError("train.tensorboard=true but tensorboard is not installed; pip install it, or set it false") from e
    return SummaryWriter(log_dir=str(run_dir / "tensorboard")) if main else None


def main(args) -> int:
    cfg = config.load(args.config)
    if cfg.sample.snapshot is not None:
        raise UserError(f"{', '.join(args.config)}: sample.snapshot={cfg.sample.snapshot}: this run evaluates that "
                        "file and trains nothing; set sample.snapshot: null to train")
    preflight.check_run_folder(cfg, ", ".join(args.config))
    try:
        return run(cfg, until_step=args.until_step, init=args.init, dataset_dir=args.dataset, trace=args.trace,
                   record_path=args.record)
    finally:
        distributed.teardown()
