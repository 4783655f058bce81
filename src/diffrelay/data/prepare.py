"""`diffrelay prepare`: build the dataset folder once; rerunning with the same inputs does nothing.

Example:
  diffrelay prepare --config config/config.yaml            # -> results/<run>/dataset/
  diffrelay launch --standalone --nproc-per-node 8 -m diffrelay prepare --config latent.yaml   # 8 GPUs encode

A pixel dataset is made by one process (rank 0 under torchrun) with data.workers decoding processes. A latent
dataset is encoded by every rank, each its own chunks, resumable after a kill (data/encoding.py).
"""

import os
import shlex
import time
from pathlib import Path

from diffrelay import config, io, logs, preflight
from diffrelay.data import datasets, encoders, encoding
from diffrelay.errors import UserError
from diffrelay.runtime import distributed, parallel

WORK, CURRENT, FAILED = 2, 1, -1  # rank 0's verdict after planning, sent to every rank
RELAUNCHED = "DIFFRELAY_PREPARE_RELAUNCHED"


def main(args) -> int:
    log = logs.setup()
    cfg = config.load(args.config)
    if args.relaunch and encoders.is_latent(cfg.data.encoder) and not os.environ.get(RELAUNCHED):
        relaunch(args)  # does not return
    out = Path(args.out) if args.out else config.run_dir(cfg) / "dataset"
    if not encoders.is_latent(cfg.data.encoder):
        return prepare_pixels(args, cfg, out) if distributed.env_rank() == 0 else 0
    device = distributed.pick_device(cfg.run.device)  # cuda:LOCAL_RANK when there is a GPU
    if distributed.env_world() > 1:
        distributed.init(device, timeout_minutes=encoding.GROUP_MINUTES)
    try:
        return prepare_latents(args, cfg, out, device, log)
    finally:
        distributed.teardown()


def relaunch(args) -> None:
    """Become `<launcher> prepare <the same arguments>`: the workflow's way to encode on several ranks (the
    process is replaced, so nothing is left behind it)."""
    argv = shlex.split(args.relaunch) + ["prepare"] + [a for c in args.config for a in ("--config", c)]
    argv += (["--out", args.out] if args.out else []) + (["--workers", str(args.workers)] if args.workers is not None
                                                          else [])
    logs.get().info(f"prepare: encoding under {args.relaunch}")
    os.execvpe(argv[0], argv, os.environ | {RELAUNCHED: "1"})


def checks(args, cfg, out: Path) -> None:
    """Before any work: a wrong --out must fail at once, not after an hour of decoding, and delete nothing."""
    preflight.check_run_folder(cfg, ", ".join(args.config))
    io.check_replaceable(out, datasets.is_dataset_folder, f"a dataset folder (no {datasets.FORMAT} dataset.json)",
                         "give --out a new or empty folder, or a dataset folder made by `diffrelay prepare`")


def prepare_pixels(args, cfg, out: Path) -> int:
    log, t0 = logs.get(), time.time()
    checks(args, cfg, out)
    # Fingerprint first (cheap checks, then hashing a folder's files): an unchanged source means no work.
    plan = datasets.plan(cfg.data)
    if datasets.is_current(out, plan):
        log.info(f"prepare: {out} is up to date (fingerprint {plan.fingerprint[:12]})")
        return 0
    # No "building..." line here: a bad file found while building must stay the only line on stderr.
    # atomic_dir: a killed prepare leaves only a hidden temp folder, never a dataset that looks complete.
    with io.atomic_dir(out, owned=datasets.is_dataset_folder) as tmp:
        info = datasets.build(plan, tmp, workers=workers(args, cfg))
    done(cfg, out, plan, info, t0)
    return 0


def prepare_latents(args, cfg, out: Path, device, log) -> int:
    rank, world, t0 = distributed.rank(), distributed.world(), time.time()
    work = encoding.work_dir(out)
    verdict, error = WORK, None
    if rank == 0:  # plans alone (fetching the weights, hashing the files); the others wait at from_main
        try:
            checks(args, cfg, out)
            preflight.net_geometry(cfg, ", ".join(args.config))  # the factor must divide the resolution
            plan = datasets.plan(cfg.data, encoders.resolve(cfg.data, cfg.run.resources))
            if datasets.is_current(out, plan):
                log.info(f"prepare: {out} is up to date (fingerprint {plan.fingerprint[:12]})")
                encoding.remove_work(work)  # a kill after the dataset was renamed into place left it
                verdict = CURRENT
            else:
                encoding.write_plan(work, plan, device.type)
        except UserError as e:
            verdict, error = FAILED, e
    verdict = distributed.from_main(verdict, "planning the dataset")
    if verdict == FAILED:
        if error is not None:
            raise error
        return 0  # rank 0 prints the one line and fails the launch
    if verdict == CURRENT:
        return 0
    plan = encoding.read_plan(work)
    latent = plan.latent
    enc = encoders.load(latent["encoder"], None if latent["path"] is None else Path(latent["path"]),
                        latent["norm"] or "dit", device)
    local = max(1, distributed.env_local_world())
    encoding.encode_chunks(plan, work, max(1, workers(args, cfg) // local), enc, device, rank, world)
    distributed.barrier()  # every chunk is written
    if rank != 0:
        return 0
    with io.atomic_dir(out, owned=datasets.is_dataset_folder) as tmp:
        labels, rels, skipped = encoding.join(plan, work, tmp)
        info = datasets.finish(plan, tmp, labels, rels, skipped, {"encoded_on": encoded_on(device, world)})
    encoding.remove_work(work)
    done(cfg, out, plan, info, t0)
    return 0


def encoded_on(device, processes: int) -> dict:
    """Where the latents were computed: a GPU's and a CPU's differ in rounding (not part of the fingerprint)."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": device.type, "name": name, "processes": processes, "torch": torch.__version__}


def done(cfg, out: Path, plan, info: dict, t0: float) -> None:
    if out.resolve().parent == config.run_dir(cfg).resolve():
        preflight.write_run_record(cfg)
    logs.get().info(f"prepare: wrote {info['count']} images from {plan.source}, {info['num_classes']} classes, "
                    f"{len(info['skipped'])} skipped, in {logs.fmt_duration(time.time() - t0)} -> {out}")


def workers(args, cfg) -> int:
    """Decoding processes: --workers, else data.workers; 0 means one per core this job may use. Under torchrun
    the ranks of a node share them."""
    n = args.workers if args.workers is not None else cfg.data.workers
    return n or parallel.cores()
