# sample_snapshot: generate images from one snapshot in a standalone process (no process group;
# torchrun only when sample.nproc > 1). The settings that change the pixels are params, so
# changing them resamples (and rescores) without retraining; batch size and thread counts do not
# change the pixels and come from the config file or from `threads`.
rule sample_snapshot:
    input:
        snapshot=f"{RUN_DIR}/snapshots/step_{STEP}.safetensors",
        checkpoint=get_snapshot_checkpoint,
    output:
        samples=report(
            directory(f"{RUN_DIR}/samples/step_{STEP}{GUIDANCE}"),
            patterns=["{name,grid}.png"],
            caption="../report/grid.rst",
            category="Samples",
            labels={"step": "{step}", "guidance": "{guidance}"},
        ),
    log:
        "logs/{run}/sample_snapshot/step_{step}{guidance}.log",
    benchmark:
        "logs/{run}/benchmarks/sample_snapshot/step_{step}{guidance}.tsv"
    conda:
        "../../envs/diffrelay.yaml"
    threads: CFG.sample.nproc * CFG.sample.threads
    resources:
        **gpu_resources("eval", CFG.sample.nproc),
    params:
        config=get_config_args,
        launcher=get_sample_launcher,
        threads=get_sample_threads,
        num_images=CFG.sample.num_images,
        first_seed=CFG.sample.first_seed,
        steps=CFG.sample.steps,
        solver=CFG.sample.solver,
        weights=CFG.sample.weights,
        class_labels=CFG.sample.class_labels,
        precision=CFG.sample.precision,
        guidance=get_guidance,
    message:
        "Sampling {params.num_images} images at step {wildcards.step} of {wildcards.run}, guidance {params.guidance}"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "{params.launcher} sample {params.config} --snapshot {input.snapshot:q} "
        "--out {output.samples:q} --num-images {params.num_images:q} "
        "--first-seed {params.first_seed:q} --steps {params.steps:q} --solver {params.solver:q} "
        "--weights {params.weights:q} --class-labels {params.class_labels:q} "
        "--precision {params.precision:q} --guidance {params.guidance:q} --threads {params.threads}"
