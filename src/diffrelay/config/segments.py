"""Where a run's training stops: the segment ends (one Snakemake job each) and the evaluation snapshots a segment
writes."""


def segment_ends(cfg, done=()) -> list[int]:
    """Steps at which a training segment stops and writes a checkpoint.

    `done`: steps of segment checkpoints this run already has. They stay segment ends, and
    train.segment_steps spaces only the segments still to train, so changing it retrains nothing."""
    t = cfg.train
    done = sorted(s for s in set(done) if 0 < s <= t.total_steps)
    last = done[-1] if done else 0
    if last == t.total_steps:
        return done
    return done + list(range(last + t.segment_steps, t.total_steps, t.segment_steps)) + [t.total_steps]


def snapshot_steps(cfg, start: int, end: int) -> list[int]:
    """Evaluation snapshots written by the segment that trains (start, end]."""
    every = cfg.train.snapshot_every
    steps = set(range(start + every, end, every)) if every else set()
    return sorted(steps | {end})


