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
    """Evaluation snapshots written by the segment that trains (start, end], and step 0 by the first segment when
    sample.baseline is on: the network before any update (for model.pretrained, the pipeline as it came)."""
    every = cfg.train.snapshot_every
    steps = set(range(start + every, end, every)) if every else set()
    return sorted(steps | {end} | ({0} if start == 0 and baseline(cfg) else set()))


def baseline(cfg) -> bool:
    """sample.baseline of a Config: null is on for model.pretrained runs (a fine-tune's first question: did it beat
    the base model?), off for networks trained from scratch (whose step 0 is noise)."""
    on = getattr(cfg.sample, "baseline", None)
    return getattr(cfg.model, "pretrained", None) is not None if on is None else on


