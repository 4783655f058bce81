# prepare_dataset: build the dataset folder (images.npy, labels.npy, dataset.json; a latent run's
# latents too, encoded on the GPUs training uses, see get_prepare_args). Training and the FID
# reference both read the arrays. Atomic: the folder appears only when complete.
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
    # data.workers decoding processes (0 = every core the job may use; see get_prepare_args).
    threads: max(1, CFG.data.workers)
    resources:
        **(gpu_resources("train", ENCODERS) if LATENT or TEXT else {}),
    params:
        # The config files, --workers {threads} and a latent run's --relaunch; derived from threads, so
        # not a rerun trigger (nor is the shell text below, which stays as it was before latents).
        config=get_prepare_args,
        # A change of a data.* setting that changes the bytes rebuilds the dataset (and so retrains).
        data=drconfig.data_hash(CFG),
        # An edited image or caption, or other encoder weights, in the source: a digest of its file names, sizes
        # and mtimes (no file read). prepare then says what changed; training refuses to continue on it. A
        # function: computed for this job only, not at every parse (a stat a file: about 8 us each here).
        source=get_source_listing,
    message:
        "Preparing the {wildcards.run} dataset"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "diffrelay prepare {params.config} --out {output.dataset:q}"
