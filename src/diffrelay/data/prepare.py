"""`diffrelay prepare`: build the dataset folder once; rerunning with the same inputs does nothing.

Example:
  diffrelay prepare --config config/config.yaml            # -> results/<run>/dataset/
"""

import time
from pathlib import Path

from diffrelay import config, io, logs, preflight
from diffrelay.data import datasets, encoders
from diffrelay.runtime import distributed, parallel


def main(args) -> int:
    log = logs.setup()
    cfg = config.load(args.config)
    preflight.check_run_folder(cfg, ", ".join(args.config))
    out = Path(args.out) if args.out else config.run_dir(cfg) / "dataset"
    # Before any work: a wrong --out must fail at once, not after an hour of decoding, and delete nothing.
    io.check_replaceable(out, datasets.is_dataset_folder, f"a dataset folder (no {datasets.FORMAT} dataset.json)",
                         "give --out a new or empty folder, or a dataset folder made by `diffrelay prepare`")
    t0 = time.time()

    # Fingerprint first (cheap checks, then hashing a folder's files): an unchanged source means no work.
    preflight.net_geometry(cfg, ", ".join(args.config))  # a latent run's factor must divide the resolution
    latent = encoders.resolve(cfg.data, cfg.run.resources)  # latent runs: the weights, fetched once, and hashed
    plan = datasets.plan(cfg.data, latent)
    if datasets.is_current(out, plan):
        log.info(f"prepare: {out} is up to date (fingerprint {plan.fingerprint[:12]})")
        return 0

    # No "building..." line here: a bad file found while building must stay the only line on stderr.
    # atomic_dir: a killed prepare leaves only a hidden temp folder, never a dataset that looks complete.
    with io.atomic_dir(out, owned=datasets.is_dataset_folder) as tmp:
        device = distributed.pick_device(cfg.run.device) if latent else "cpu"  # the encoder runs on a GPU if there is one
        info = datasets.build(plan, tmp, workers=workers(args, cfg), device=device)
    if out.resolve().parent == config.run_dir(cfg).resolve():
        preflight.write_run_record(cfg)
    log.info(f"prepare: wrote {info['count']} images from {plan.source}, {info['num_classes']} classes, "
             f"{len(info['skipped'])} skipped, in {logs.fmt_duration(time.time() - t0)} -> {out}")
    return 0


def workers(args, cfg) -> int:
    """Decoding processes: --workers, else data.workers; 0 means one per core this job may use."""
    n = args.workers if args.workers is not None else cfg.data.workers
    return n or parallel.cores()
