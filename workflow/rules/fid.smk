# compute_fid: FID (or FD with random features, FD_DINOv2 ...) of one sample folder, with every
# extractor of the run against its reference statistics; the images are decoded once for all.
# `diffrelay fid` scores in a fresh subprocess with a clean environment, outside any process group.
rule compute_fid:
    input:
        images=rules.sample_snapshot.output.samples,
        refs=get_references,
        extractors=get_extractors,
    output:
        score=f"{RUN_DIR}/metrics/fid/step_{STEP}{VARIANT}.json",
    log:
        "logs/{run}/compute_fid/step_{step}{variant}.log",
    benchmark:
        "logs/{run}/benchmarks/compute_fid/step_{step}{variant}.tsv"
    conda:
        "../../envs/diffrelay.yaml"
    threads: CFG.fid.threads
    resources:
        **gpu_resources("eval", 1),
    params:
        launcher=get_eval_launcher,
        device=CFG.run.device,
        pairs=get_score_args,
        mode=CFG.fid.mode,
        batch_size=CFG.fid.batch_size,
        timeout=CFG.fid.timeout_minutes,
    message:
        "Scoring the step {wildcards.step}{wildcards.variant} samples of {wildcards.run}"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "{params.launcher} fid --images {input.images:q} {params.pairs} --mode {params.mode:q} "
        "--batch-size {params.batch_size:q} --threads {threads} "
        "--timeout-minutes {params.timeout:q} --device {params.device:q} --out {output.score:q}"


# compute_val_loss (fid.metrics val_loss): the objective's loss on the held-out split with fixed draws, from one
# snapshot, in a process of its own on an evaluation GPU (sampling/val_loss.py).
rule compute_val_loss:
    input:
        snapshot=get_val_snapshot,
        checkpoint=get_snapshot_checkpoint,
        dataset=rules.prepare_dataset.output.dataset,
    output:
        score=f"{RUN_DIR}/metrics/val_loss/step_{STEP}.json",
    log:
        "logs/{run}/compute_val_loss/step_{step}.log",
    benchmark:
        "logs/{run}/benchmarks/compute_val_loss/step_{step}.tsv"
    conda:
        "../../envs/diffrelay.yaml"
    threads: CFG.sample.threads
    resources:
        **gpu_resources("eval", 1),
    params:
        # Derived (takes threads), so no rerun trigger: adding, renaming or reordering config files changes
        # no held-out loss (train_segment and sample_snapshot pass them the same way).
        config=get_config_args,
        launcher=get_eval_launcher,
    message:
        "Held-out loss of the step {wildcards.step} snapshot of {wildcards.run}"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "{params.launcher} val-loss {params.config} --snapshot {input.snapshot:q} --dataset {input.dataset:q} "
        "--threads {threads} --out {output.score:q}"


# collect_segment: the FID files of one training segment. Its input function waits for this
# segment's checkpoint only, which keeps evaluation of segment k beside training of k+1.
localrules:
    collect_segment,


rule collect_segment:
    input:
        scores=get_segment_scores,
        # fid.metrics val_loss: the held-out loss of the segment's snapshots (the report reads them)
        val_loss=get_segment_val_losses,
    output:
        segment=f"{RUN_DIR}/metrics/segments/step_{STEP}.json",
    log:
        "logs/{run}/collect_segment/step_{step}.log",
    wildcard_constraints:
        step="|".join(step_name(s) for s in SEGMENT_ENDS),
    conda:
        "../../envs/diffrelay.yaml"
    message:
        "Collecting the scores of the {wildcards.run} segment ending at step {wildcards.step}"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "diffrelay collect --out {output.segment:q} {input.scores:q}"
