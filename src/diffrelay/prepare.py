"""`diffrelay prepare`: build the dataset folder once; rerunning with the same inputs does nothing.

Example:
  diffrelay prepare --config config/config.yaml            # -> results/<run>/dataset/
"""

import time
from pathlib import Path

from diffrelay import config, datasets, io, logs


def main(args) -> int:
    log = logs.setup()
    cfg = config.load(args.config)
    out = Path(args.out) if args.out else config.run_dir(cfg) / "dataset"
    t0 = time.time()

    # Fingerprint first (cheap checks, then hashing a folder's files): an unchanged source means no work.
    plan = datasets.plan(cfg.data)
    if datasets.is_current(out, plan):
        log.info(f"prepare: {out} is up to date (fingerprint {plan.fingerprint[:12]})")
        return 0

    # No "building..." line here: a bad file found while building must stay the only line on stderr.
    # atomic_dir: a killed prepare leaves only a hidden temp folder, never a dataset that looks complete.
    with io.atomic_dir(out) as tmp:
        info = datasets.build(plan, tmp)
    log.info(f"prepare: wrote {info['count']} images from {plan.source}, {info['num_classes']} classes, "
             f"{len(info['skipped'])} skipped, in {logs.fmt_duration(time.time() - t0)} -> {out}")
    return 0
