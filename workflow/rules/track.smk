# track_train, track_segment and track_report: publish the run to the experiment trackers of `track` (W&B,
# MLflow) from the files its jobs wrote (tracking/publish.py): when a segment has trained (its training numbers,
# at a priority above train_segment's, so they do not wait behind the next segment), after the segment's
# first-pass evaluations (their scores and grids), and once after the report (the second pass and post-hoc EMA
# scores, and the count of what is still pending). Each sends everything new, whichever job it is. Nothing runs
# inside training, sampling or scoring. Local jobs: under SLURM they run on the submit host, where the network
# usually is. Each takes the run's lock, so a tracker run never has two writers, and sends everything not yet
# sent (track/ledger.json); a failing tracker warns and the job still succeeds. Only a config with a tracker
# asks for these jobs: a run without `track` plans exactly the jobs it did before. Their `trackers` param is a
# digest of the track section, so changing it reruns them (the ledger sends only what is new to a tracker).
localrules:
    track_train,
    track_segment,
    track_report,


rule track_train:
    input:
        trained=rules.train_segment.output.trained,
    output:
        record=f"{RUN_DIR}/track/train_{STEP}.json",
    log:
        "logs/{run}/track/train_{step}.log",
    wildcard_constraints:
        step="|".join(step_name(s) for s in SEGMENT_ENDS),
    # Above train_segment's 10: on one GPU the next segment would otherwise start first, every time.
    priority: 20
    conda:
        "../../envs/track.yaml"
    params:
        config=get_config_args,
        trackers=TRACK_DIGEST,
    message:
        "Publishing the training of {wildcards.run} up to step {wildcards.step} to the trackers"
    shell:
        "diffrelay track {params.config} --step {wildcards.step} --out {output.record:q} --log {log:q}"


rule track_segment:
    input:
        unpack(get_track_inputs),
    output:
        record=f"{RUN_DIR}/track/step_{STEP}.json",
    log:
        "logs/{run}/track/step_{step}.log",
    wildcard_constraints:
        step="|".join(step_name(s) for s in SEGMENT_ENDS),
    conda:
        "../../envs/track.yaml"
    params:
        config=get_config_args,
        trackers=TRACK_DIGEST,
    message:
        "Publishing the {wildcards.run} segment ending at step {wildcards.step} to the trackers"
    shell:
        "diffrelay track {params.config} --step {wildcards.step} --out {output.record:q} --log {log:q}"


rule track_report:
    input:
        report=rules.build_report.output.best,
        segments=lambda wildcards: expand(
            rules.track_segment.output.record,
            run=wildcards.run,
            step=[step_name(s) for s in SEGMENT_ENDS],
        ),
        train=get_track_train_records,
    output:
        record=f"{RUN_DIR}/track/report.json",
    log:
        "logs/{run}/track/report.log",
    conda:
        "../../envs/track.yaml"
    params:
        config=get_config_args,
        trackers=TRACK_DIGEST,
    message:
        "Publishing the rest of {wildcards.run} to the trackers"
    shell:
        "diffrelay track {params.config} --final --out {output.record:q} --log {log:q}"
