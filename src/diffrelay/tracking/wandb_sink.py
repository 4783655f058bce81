"""Sending a batch to W&B: one W&B run per diffrelay run (a derived id, resume="allow"), reopened by each
`track` job and finished before the job ends; the caller holds the run's lock, so there is never a second
writer. Training values go against train/step, scores against eval/step (the checkpoint's step: a score that
arrives after training went on still lands at its checkpoint) and grids against eval/step too.

Offline (the default) W&B writes a run folder under results/<run>/track/wandb/ per job and touches no network;
`wandb sync` uploads them (docs/runs.md). Nothing about this machine is recorded: no system metadata, no
console capture, no code, git state or requirements, so no path and no host name leave it.
"""

# Bounds on the network waits of an online run, so an unreachable server holds the run's lock for minutes, not
# for ever: wandb.init gives up after INIT_TIMEOUT_S, each request after REQUEST_TIMEOUT_S, and run.finish raises
# after FINISH_TIMEOUT_S of uploading (the batch then stays pending; the run's files stay on disk).
INIT_TIMEOUT_S, REQUEST_TIMEOUT_S, FINISH_TIMEOUT_S = 60.0, 30.0, 300.0
STEP_METRICS = {"train/*": "train/step", "eval/*": "eval/step", "samples/*": "eval/step"}


def settings(wandb):
    return wandb.Settings(x_disable_meta=True, x_disable_machine_info=True, x_disable_stats=True, console="off",
                          x_save_requirements=False, disable_git=True, save_code=False, disable_code=True,
                          silent=True, host="diffrelay", program="diffrelay track", init_timeout=INIT_TIMEOUT_S,
                          x_graphql_timeout_seconds=REQUEST_TIMEOUT_S, x_file_transfer_timeout_seconds=REQUEST_TIMEOUT_S,
                          finish_timeout=FINISH_TIMEOUT_S, finish_timeout_raises=True)


def define_metrics(run) -> None:
    for axis in sorted(set(STEP_METRICS.values())):
        run.define_metric(axis)
    for pattern, axis in STEP_METRICS.items():
        run.define_metric(pattern, step_metric=axis)


def send(cfg: dict, ident: dict, batch: dict, where) -> None:
    """Log `batch` (ledger.pending's shape) to the run `ident` names; any failure raises."""
    import wandb

    where.mkdir(parents=True, exist_ok=True)
    run = wandb.init(id=ident["id"], resume="allow", mode=cfg.get("mode") or "offline", dir=str(where),
                     project=cfg.get("project") or "diffrelay", entity=cfg.get("entity"), group=cfg.get("group"),
                     tags=list(cfg.get("tags") or []) or None, name=ident["name"], settings=settings(wandb))
    try:
        define_metrics(run)
        if batch["config"] is not None:
            run.config.update(batch["config"], allow_val_change=True)
        for step, values in sorted(batch["train"].items()):
            run.log({"train/step": step, **{f"train/{k}": v for k, v in values.items()}})
        for (series, step), values in sorted(batch["evals"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if values:  # a score file of rejected values only (records.py) is no row
                run.log({"eval/step": step, **{f"eval/{series}/{k}": v for k, v in values.items()}})
        for (series, step), path in sorted(batch["grids"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
            run.log({"eval/step": step, f"samples/{series}": wandb.Image(path, caption=f"step {step} {series}")})
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()
