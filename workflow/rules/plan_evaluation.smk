# The evaluation plan: extractors and references, which snapshots each segment evaluates, the second
# pass of the best ones, sampling settings and post-hoc EMA reconstructions.
# The extractors in config order (the first picks the best checkpoint), each under a file-name key.
EXTRACTOR_NAMES = protocol.extractor_names(CFG.to_dict()["fid"])
EXTRACTOR_KEYS = [protocol.extractor_key(n, CFG.run.seed) for n in EXTRACTOR_NAMES]
EXTRACTOR_FILES = {
    key: protocol.extractor_file(name, CFG.run.seed, RESOURCES)
    for name, key in zip(EXTRACTOR_NAMES, EXTRACTOR_KEYS)
}  # custom files are checked by preflight.check_inputs
FOREIGN_REFERENCES = {
    key: protocol.reference_file(CFG.to_dict()["fid"], name)
    for name, key in zip(EXTRACTOR_NAMES, EXTRACTOR_KEYS)
}


def get_extractor(wildcards):
    """The extractor file of one reference job ({extractor} is its key)."""
    return EXTRACTOR_FILES[wildcards.extractor]


def get_extractors(wildcards):
    return list(EXTRACTOR_FILES.values())


def get_references(wildcards):
    """Per extractor: fid.reference (statistics made elsewhere), or the dataset's own (compute_reference)."""
    return [
        FOREIGN_REFERENCES[key]
        or expand(rules.compute_reference.output.ref, run=wildcards.run, extractor=key)[
            0
        ]
        for key in EXTRACTOR_KEYS
    ]


def get_score_args(wildcards, input):
    """--extractor E --ref R per extractor, in config order (the first is the primary score); with
    fid.metrics, --metrics and the cache of ADM batches' features too (unset, the text is what it was,
    so no finished score is redone)."""
    pairs = [
        f"--extractor {shlex.quote(e)} --ref {shlex.quote(r)}"
        for e, r in zip(input.extractors, input.refs)
    ]
    # clip_score is not the extractors': the scorer computes it with --clip-model (a text run).
    metrics = [
        m
        for m in CFG.to_dict()["fid"].get("metrics") or []
        if m not in ("clip_score", "val_loss")  # val_loss: compute_val_loss's
    ]
    if metrics:
        cache = shlex.quote(f"{CFG.run.resources}/fid-ref")
        pairs.append(f"--metrics {','.join(metrics)} --cache-dir {cache}")
    if CFG.fid.clip_model:
        pairs.append(f"--clip-model {shlex.quote(CFG.fid.clip_model)}")
    # pick_score and class_accuracy: per-file scores too, only when set (other runs keep their command)
    if CFG.fid.pick_model:
        pairs.append(f"--pick-model {shlex.quote(CFG.fid.pick_model)}")
    if CFG.fid.classifier:
        pairs.append(f"--classifier {shlex.quote(CFG.fid.classifier)}")
        # A text run's prompt file holds class_accuracy's labels; held-out captions have none (whole words).
        prompts = protocol.prompt_files(CFG.to_dict()["sample"])
        k = protocol.variant_prompts(wildcards.variant)
        if prompts and k != protocol.HELD_OUT:
            pairs.append(f"--prompts {shlex.quote(prompts[k])}")
    return " ".join(pairs)


# --- evaluation ------------------------------------------------------------------------------
def get_snapshot_checkpoint(wildcards):
    """The checkpoint of the segment that wrote this snapshot (done before its snapshots count); none
    for sample.snapshot, which no training writes."""
    if EVALUATED:
        return []
    step = int(wildcards.step)
    end = next((e for e in SEGMENT_ENDS if e >= step), None)
    if end is None:
        raise WorkflowError(
            f"step {step} is past train.total_steps={CFG.train.total_steps}"
        )
    return expand(
        rules.train_segment.output.trained, run=wildcards.run, step=step_name(end)
    )


def segment_snapshots(run, end):
    """Snapshot steps that training actually wrote in (previous end, end]. Only the steps the
    current config asks for count: a file left by an earlier snapshot_every is not evaluated.
    """
    if EVALUATED:
        return [EVALUATED_STEP]
    start = previous_end(end)
    wanted = set(drconfig.snapshot_steps(CFG, start, int(end)))
    folder = Path(CFG.run.results) / run / "snapshots"
    steps = sorted(
        int(m.group(1))
        for p in folder.glob("step_*.safetensors")
        if (m := re.fullmatch(r"step_(\d{7})\.safetensors", p.name))
    )
    return [s for s in steps if s in wanted]


def get_segment_scores(wildcards):
    """FID of every snapshot of this segment. Asks for this segment's checkpoint only, so the
    evaluation of segment k runs while segment k+1 trains."""
    if not EVALUATED:
        checkpoints.train_segment.get(run=wildcards.run, step=wildcards.step)
    steps = segment_snapshots(wildcards.run, wildcards.step)
    if not steps:
        raise WorkflowError(
            f"{RUN_DIR_NAME}/snapshots: no snapshot in steps ({previous_end(wildcards.step)}, "
            f"{int(wildcards.step)}]; the train stage should have written one; rerun it with "
            f"--forcerun train_segment"
        )
    return expand(
        rules.compute_fid.output.score,
        run=wildcards.run,
        step=[step_name(s) for s in steps],
        variant=FIRST_PASS,
    )


VAL_LOSS = "val_loss" in (CFG.to_dict()["fid"].get("metrics") or [])


def get_segment_val_losses(wildcards):
    """fid.metrics val_loss: the held-out loss of every snapshot of this segment (none without it)."""
    if not VAL_LOSS:
        return []
    if not EVALUATED:
        checkpoints.train_segment.get(run=wildcards.run, step=wildcards.step)
    return expand(
        rules.compute_val_loss.output.score,
        run=wildcards.run,
        step=[step_name(s) for s in segment_snapshots(wildcards.run, wildcards.step)],
    )


def get_val_snapshot(wildcards):
    """The snapshot compute_val_loss reads: the step's, or sample.snapshot's file."""
    if EVALUATED:
        return [EVALUATED]
    return expand(
        f"{RUN_DIR}/snapshots/step_{STEP}.safetensors",
        run=wildcards.run,
        step=wildcards.step,
    )


def final_evaluations(run):
    """(step, variant) of the second pass (fid.final.best > 0): every seed set of the best first-pass
    evaluations, with fid.final.num_images images. Known once select_best has ranked all first-pass
    scores (asking for them before makes Snakemake run it first)."""
    if not FINAL.best:
        return []
    with open(checkpoints.select_best.get(run=run).output.selected) as f:
        selected = json.load(f)["selected"]
    return [
        (step_name(pick["step"]), v)
        for pick in selected
        for v in final_variants(pick["guidance"], pick.get("decay"))
    ]


def get_final_scores(wildcards):
    return [
        expand(rules.compute_fid.output.score, run=wildcards.run, step=s, variant=v)[0]
        for s, v in final_evaluations(wildcards.run)
    ]


def get_sample_launcher(wildcards, threads):
    n = CFG.sample.nproc
    if n == 1:
        return with_gpus("eval", 1) + "diffrelay"
    return (
        with_gpus("eval", n)
        + f"diffrelay launch --standalone --nproc-per-node {n} -m diffrelay"
    )


def get_eval_launcher(wildcards, threads):
    """`diffrelay` for one-GPU evaluation jobs (reference statistics, FID), on a free id of the pool."""
    return with_gpus("eval", 1) + "diffrelay"


# sample.edm, sample.flow and sample.ddpm values off the schema's defaults, as `diffrelay sample` flags.
SAMPLER_FLAGS = {
    (
        f"--{k.lower().replace('_', '-')}"
        if part == "edm"
        else f"--{part}-{k.replace('_', '-')}"
    ): v
    for part in ("edm", "flow", "ddpm")
    for k, v in CFG.to_dict()["sample"][part].items()
    if v != drconfig.validate({})["sample"][part][k]
}


def get_sample_settings(wildcards):
    """--num-images, --first-seed, --guidance (and --size) of one evaluation, from its variant suffix."""
    count, guidance, seed_set = protocol.parse_variant(wildcards.variant)
    decay = protocol.variant_decay(wildcards.variant)
    count = count or CFG.sample.num_images
    first = protocol.first_seed(CFG.sample.first_seed, count, seed_set)
    # sampler values off the defaults: flags, so that changing one resamples (a params change)
    # while runs that keep the defaults keep the command they had.
    edm_flags = "".join(f" {flag} {v!r}" for flag, v in SAMPLER_FLAGS.items())
    interval = CFG.to_dict()["sample"]["guidance_interval"]
    if interval is not None and guidance != 1:
        edm_flags += f" --guidance-interval {interval[0]!r} {interval[1]!r}"
    guide = get_guide(wildcards)
    if guide:
        edm_flags += f" --guide {shlex.quote(guide[0])}"
    if decay is not None:
        edm_flags += f" --ema-decay {decay!r}"
    # sample.sizes: the folder's image size (none for the square: its command as it was)
    size = protocol.variant_size(wildcards.variant)
    if size is not None:
        edm_flags += f" --size {protocol.size_name(size)}"
    # sample.quantize_base and FLUX.1's sample.true_cfg_scale, only when set (other runs keep their command):
    # changing either resamples
    if CFG.sample.quantize_base is not None:
        edm_flags += f" --quantize-base {CFG.sample.quantize_base}"
    if CFG.sample.true_cfg_scale != 1:
        edm_flags += f" --true-cfg-scale {CFG.sample.true_cfg_scale!r}"
    # sample.scheduler, only when set (other runs keep their command): changing it resamples
    scheduler = CFG.to_dict()["sample"].get("scheduler")
    if scheduler:
        edm_flags += f" --scheduler {shlex.quote(scheduler)}"
        kwargs = json.dumps(CFG.to_dict()["sample"]["scheduler_kwargs"], sort_keys=True)
        if kwargs != "{}":
            edm_flags += f" --scheduler-kwargs {shlex.quote(kwargs)}"
    # A text run's prompt file: the variant's of sample.prompts (_p<k>).
    prompts = protocol.prompt_files(CFG.to_dict()["sample"])
    k = protocol.variant_prompts(wildcards.variant)
    if k == protocol.HELD_OUT:  # sample.held_out_captions: the held-out FID's images
        edm_flags += " --held-out-captions"
    elif prompts:
        # Its sha256 too: an edited prompt file changes this param, so Snakemake samples (and scores) again.
        sha = drio.sha256_file(prompts[k])
        edm_flags += f" --prompts {shlex.quote(prompts[k])} --prompts-sha256 {sha}"
    return (
        f"--num-images {count} --first-seed {first} --guidance {guidance:g}{edm_flags}"
    )


def get_guide(wildcards):
    """sample.guide (autoguidance) for a guided evaluation: an input, so the job waits for it and reruns
    when it changes; none for guidance 1. A step names this run's snapshot there: the job then waits for
    the segment that writes it (which may still be to train)."""
    _, guidance, _ = protocol.parse_variant(wildcards.variant)
    if CFG.sample.guide is None or guidance == 1:
        return []
    if not isinstance(CFG.sample.guide, int):
        return [CFG.sample.guide]
    end = next(e for e in SEGMENT_ENDS if e >= CFG.sample.guide)
    checkpoints.train_segment.get(run=wildcards.run, step=step_name(end))
    return expand(
        f"{RUN_DIR}/snapshots/step_{STEP}.safetensors",
        run=wildcards.run,
        step=step_name(CFG.sample.guide),
    )


def snapshot_steps_of_run():
    """Every step this run writes a snapshot at."""
    return sorted(
        {
            s
            for e in SEGMENT_ENDS
            for s in drconfig.snapshot_steps(CFG, previous_end(e), e)
        }
    )


if (
    isinstance(CFG.sample.guide, int)
    and CFG.sample.guide not in snapshot_steps_of_run()
):
    fail(
        f"{', '.join(map(str, CONFIG_FILES))}: sample.guide={CFG.sample.guide}: this run writes no snapshot at "
        f"that step; use one of {snapshot_steps_of_run()[:8]} (segment ends and train.snapshot_every), or a "
        f"snapshot file"
    )


def get_sample_threads(wildcards, threads):
    # Per process; Snakemake may lower `threads` to --cores, never the process count.
    return max(1, threads // CFG.sample.nproc)


def get_sample_config_args(wildcards, threads):
    """The config files, and --npz true with sample.npz (samples.npz). Derived (it takes threads), so
    not a rerun trigger: the npz changes no pixel, and a rerun would delete the folder and sample it
    again (Snakemake deletes a job's output first). Folders finished before a switch stay as they
    are; their logged command, run again by hand, adds or removes only the npz (it reads the config).
    """
    return CONFIG_ARGS + (" --npz true" if CFG.sample.npz else "")


# --- post-hoc EMA (phema.smk) -----------------------------------------------------------------
# Each width of sample.phema is reconstructed at the run's last step and evaluated like a snapshot,
# under the variant _ema<width> (every guidance scale and seed set of the first pass).
PHEMA_STEP = step_name(CFG.train.total_steps)
PHEMA_VARIANTS = [
    protocol.variant(None, g, s, ema, prompts=k, size=z)
    for ema in CFG.sample.phema
    for g in GUIDANCE_SCALES
    for s in SEED_SETS
    for k in PROMPT_FILES
    for z in SIZES
]


def get_snapshot(wildcards):
    """The weights one evaluation samples: the step's snapshot, or a post-hoc EMA reconstruction."""
    ema = protocol.variant_ema(wildcards.variant)
    if EVALUATED:
        return [EVALUATED]
    if ema is None:
        return expand(
            f"{RUN_DIR}/snapshots/step_{STEP}.safetensors",
            run=wildcards.run,
            step=wildcards.step,
        )
    return expand(
        rules.reconstruct_phema.output.snapshot,
        run=wildcards.run,
        step=wildcards.step,
        sigma=f"{ema:g}",
    )


def get_phema_scores(wildcards):
    """Scores of the post-hoc EMA reconstructions; the report waits for them (none when off)."""
    return expand(
        rules.compute_fid.output.score,
        run=wildcards.run,
        step=PHEMA_STEP,
        variant=PHEMA_VARIANTS,
    )


def get_phema_targets():
    """Their samples and scores as targets once the last segment is trained (see get_final_output)."""
    last = Path(RUN_DIR_NAME) / "checkpoints" / f"step_{PHEMA_STEP}/manifest.json"
    if not PHEMA_VARIANTS or not last.is_file():
        return []
    return [
        expand(out, run=RUN, step=PHEMA_STEP, variant=v)[0]
        for v in PHEMA_VARIANTS
        for out in (
            rules.sample_snapshot.output.samples,
            rules.compute_fid.output.score,
        )
    ]
