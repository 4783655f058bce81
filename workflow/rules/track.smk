# track_segment and track_report: publish the run to the experiment trackers of `track` (W&B, MLflow) from
# the files its jobs wrote (tracking/publish.py): after each segment's first-pass evaluations, and once after
# the report (the second pass and post-hoc EMA scores, and the count of what is still pending). Nothing runs
# inside training, sampling or scoring. Local jobs: under SLURM they run on the submit host, where the network
# usually is. Each takes the run's lock, so a tracker run never has two writers, and sends everything not yet
# sent (track/ledger.json); a failing tracker warns and the job still succeeds. Only a config with a tracker
# asks for these jobs: a run without `track` plans exactly the jobs it did before.
localrules:
    track_segment,
    track_report,


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
        "../../envs/diffrelay.yaml"
    params:
        config=get_config_args,
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
    output:
        record=f"{RUN_DIR}/track/report.json",
    log:
        "logs/{run}/track/report.log",
    conda:
        "../../envs/diffrelay.yaml"
    params:
        config=get_config_args,
    message:
        "Publishing the rest of {wildcards.run} to the trackers"
    shell:
        "diffrelay track {params.config} --final --out {output.record:q} --log {log:q}"
