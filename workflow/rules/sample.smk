# sample_snapshot: generate images from one snapshot in a standalone process (no process group;
# torchrun only when sample.nproc > 1). The settings that change the pixels are params, so
# changing them resamples (and rescores) without retraining; the image count, first seed and
# guidance come from the evaluation's variant (evaluation.py); batch size and thread counts do not
# change the pixels and come from the config file or from `threads`.
rule sample_snapshot:
    input:
        snapshot=get_snapshot,
        checkpoint=get_snapshot_checkpoint,
        guide=get_guide,
    output:
        samples=report(
            directory(f"{RUN_DIR}/samples/step_{STEP}{VARIANT}"),
            patterns=["{name,grid}.png"],
            caption="../report/grid.rst",
            category="Samples",
            labels={"step": "{step}", "variant": "{variant}"},
        ),
    log:
        "logs/{run}/sample_snapshot/step_{step}{variant}.log",
    benchmark:
        "logs/{run}/benchmarks/sample_snapshot/step_{step}{variant}.tsv"
    conda:
        "../../envs/diffrelay.yaml"
    threads: CFG.sample.nproc * CFG.sample.threads
    resources:
        **gpu_resources("eval", CFG.sample.nproc),
    params:
        config=get_sample_config_args,
        launcher=get_sample_launcher,
        threads=get_sample_threads,
        settings=get_sample_settings,
        steps=CFG.sample.steps,
        solver=CFG.sample.solver,
        weights=CFG.sample.weights,
        class_labels=CFG.sample.class_labels,
        precision=CFG.sample.precision,
    message:
        "Sampling the step {wildcards.step}{wildcards.variant} images of {wildcards.run}"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "{params.launcher} sample {params.config} --snapshot {input.snapshot:q} "
        "--out {output.samples:q} {params.settings} "
        "--steps {params.steps:q} --solver {params.solver:q} "
        "--weights {params.weights:q} --class-labels {params.class_labels:q} "
        "--precision {params.precision:q} --threads {params.threads}"
