# train_segment: one torchrun job per segment (prev, step]. It resumes from the previous segment's
# checkpoint (or newer recovery checkpoints), writes an evaluation snapshot for every snapshot
# step in the segment, then the checkpoint folder, and exits. A checkpoint, because which
# snapshots a segment wrote is known only after it ran (see get_segment_scores).
#
# The rule's output is a small record, trained/step_X.json, not the checkpoint folder: Snakemake
# deletes a job's outputs before it reruns it (after a workflow upgrade changes this rule's code, or
# when the dataset is rebuilt), and checkpoints are hours of GPU time. A rerun finds the complete
# checkpoint of the same trajectory, says "nothing to do" and writes the record again.
#
# GPUs: a job gets the GPUs it asks for (resources: gpu) from SLURM, which sets
# CUDA_VISIBLE_DEVICES per job, so jobs never share a GPU there. On one machine Snakemake assigns
# no GPU ids: every GPU job sees all GPUs and uses the first ones (rank r -> cuda:r), so GPU jobs
# must not run side by side; the default profile's `resources: gpu` limit (1) runs them one at a
# time. CPU runs (run.device: cpu) ask for no GPU and overlap freely.
# The process count comes from the config, never from resources: Snakemake may lower a resource.
checkpoint train_segment:
    input:
        dataset=rules.prepare_dataset.output.dataset,
        init=get_previous_checkpoint,
    output:
        trained=f"{RUN_DIR}/trained/step_{STEP}.json",
    log:
        "logs/{run}/train_segment/step_{step}.log",
    benchmark:
        "logs/{run}/benchmarks/train_segment/step_{step}.tsv"
    wildcard_constraints:
        step="|".join(step_name(s) for s in SEGMENT_ENDS),
    # Keep the chain of segments moving: start the next one before queued evaluation jobs.
    priority: 10
    conda:
        "../../envs/diffrelay.yaml"
    threads: CFG.train.nproc_per_node * CFG.train.threads
    resources:
        **train_resources(),
    params:
        config=get_config_args,
        launcher=get_train_launcher,
        setup=get_train_setup,
        init=get_init_arg,
        until=lambda wildcards: int(wildcards.step),
        # Everything that changes the weights (config.trajectory_hash): a change retrains.
        trajectory=drconfig.trajectory_hash(CFG),
    message:
        "Training {wildcards.run} up to step {params.until}"
    # Exit status 75 = stopped by a signal after saving, resumable (`diffrelay launch` keeps it).
    shell:
        "exec >{log:q} 2>&1; {params.setup}; PS4=; set -x; "
        "{params.launcher} -m diffrelay train {params.config} "
        "--until-step {params.until} --record {output.trained:q} {params.init}"
