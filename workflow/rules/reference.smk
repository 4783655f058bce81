# compute_reference: feature statistics of the dataset for one extractor, the reference its
# scores are measured against (not run for an extractor with a file in fid.reference). Cached
# under resources/fid-ref/ by (dataset fingerprint, extractor, mode, count).
rule compute_reference:
    input:
        dataset=rules.prepare_dataset.output.dataset,
        extractor=get_extractor,
    output:
        ref=f"{RUN_DIR}/fid/reference_{{extractor}}.npz",
    log:
        "logs/{run}/compute_reference/{extractor}.log",
    benchmark:
        "logs/{run}/benchmarks/compute_reference/{extractor}.tsv"
    wildcard_constraints:
        extractor="|".join(map(re.escape, EXTRACTOR_KEYS)),
    conda:
        "../../envs/diffrelay.yaml"
    threads: CFG.fid.threads
    resources:
        **gpu_resources("eval", 1),
    params:
        launcher=get_eval_launcher,
        device=CFG.run.device,
        mode=CFG.fid.mode,
        num=CFG.fid.ref_images,
        batch_size=CFG.fid.batch_size,
        cache_dir=f"{CFG.run.resources}/fid-ref",
    message:
        "Computing {wildcards.extractor} reference statistics of the {wildcards.run} dataset"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "{params.launcher} fid-ref --dataset {input.dataset:q} --extractor {input.extractor:q} "
        "--mode {params.mode:q} --num {params.num:q} --batch-size {params.batch_size:q} "
        "--threads {threads} --cache-dir {params.cache_dir:q} --device {params.device:q} --out {output.ref:q}"
