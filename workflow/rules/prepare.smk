# prepare_dataset: build the dataset folder (images.npy, labels.npy, png/, dataset.json).
# Training reads the arrays, clean-fid reads png/. Atomic: the folder appears only when complete.
rule prepare_dataset:
    output:
        dataset=directory(f"{RUN_DIR}/dataset"),
    log:
        "logs/{run}/prepare_dataset/prepare_dataset.log",
    benchmark:
        # Per-job timings live beside the logs; the repo's top-level benchmarks/ holds scripts.
        "logs/{run}/benchmarks/prepare_dataset/prepare_dataset.tsv"
    conda:
        "../../envs/diffrelay.yaml"
    threads: 1
    params:
        config=get_config_args,
        # A change of any data.* setting rebuilds the dataset (and so retrains).
        data=drconfig.section_hash(CFG, "data"),
    message:
        "Preparing the {wildcards.run} dataset"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "diffrelay prepare {params.config} --out {output.dataset:q}"
