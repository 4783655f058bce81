# The run's targets: what `rule all` asks for, including the evaluations of segments already trained.
# --- targets ---------------------------------------------------------------------------------
def get_final_output():
    """The report, plus the samples and scores of segments already trained: Snakemake does not
    remake a deleted intermediate file by itself, only a missing target."""
    done = [
        end
        for end in SEGMENT_ENDS
        if EVALUATED
        or (
            Path(RUN_DIR_NAME) / "checkpoints" / f"step_{step_name(end)}/manifest.json"
        ).is_file()
    ]
    steps = [step_name(s) for end in done for s in segment_snapshots(RUN, end)]
    return (
        expand(rules.build_report.output, run=RUN)
        + expand(
            rules.sample_snapshot.output.samples,
            run=RUN,
            step=steps,
            variant=FIRST_PASS,
        )
        + expand(
            rules.compute_fid.output.score,
            run=RUN,
            step=steps,
            variant=FIRST_PASS,
        )
    )


def get_second_pass_targets(wildcards):
    """The second pass's samples and scores as targets too (see get_final_output). A separate input
    of the all rule, since they are unknown until select_best has run and the rest of the DAG must not wait.
    """
    return [
        expand(out, run=RUN, step=s, variant=v)[0]
        for s, v in final_evaluations(RUN)
        for out in (
            rules.sample_snapshot.output.samples,
            rules.compute_fid.output.score,
        )
    ]


def get_segment_outputs(wildcards):
    """One aggregate per training segment: the report waits for all of them."""
    return expand(
        rules.collect_segment.output.segment,
        run=wildcards.run,
        step=[step_name(s) for s in SEGMENT_ENDS],
    )


# --- experiment trackers (track.smk) ----------------------------------------------------------
TRACKERS = [t for t in ("wandb", "mlflow") if CFG.to_dict()["track"][t] is not None]
TRACK_DIGEST = drtracking.section_digest(CFG.to_dict())


def get_track_inputs(wildcards):
    """This segment's record (when trained in this run) and every first-pass evaluation of its snapshots:
    score files and sample folders (their grids). Waits for this segment's checkpoint only.
    """
    scores = get_segment_scores(wildcards)
    steps = [step_name(s) for s in segment_snapshots(wildcards.run, wildcards.step)]
    trained = expand(
        rules.train_segment.output.trained, run=wildcards.run, step=wildcards.step
    )
    return {
        "trained": [] if EVALUATED else trained,
        "scores": scores,
        "samples": expand(
            rules.sample_snapshot.output.samples,
            run=wildcards.run,
            step=steps,
            variant=FIRST_PASS,
        ),
    }


def get_track_train_records(wildcards):
    """Every segment's training publish (none when the run trains nothing: sample.snapshot)."""
    if EVALUATED:
        return []
    return expand(
        rules.track_train.output.record,
        run=wildcards.run,
        step=[step_name(s) for s in SEGMENT_ENDS],
    )


def get_track_targets():
    """The track records of every segment (training and evaluations) and the final one, when a tracker is
    configured."""
    if not TRACKERS:
        return []
    steps = [step_name(s) for s in SEGMENT_ENDS]
    return (
        expand(rules.track_report.output.record, run=RUN)
        + expand(rules.track_segment.output.record, run=RUN, step=steps)
        + (
            []
            if EVALUATED
            else expand(rules.track_train.output.record, run=RUN, step=steps)
        )
    )
