# select_best: the second evaluation pass (fid.final.best > 0). Once every first-pass score of the
# run exists, it ranks the (step, guidance) evaluations by the primary extractor's score, averaged
# over seed sets, and keeps the best ones; the report then asks for their samples and scores with
# fid.final.num_images images (FID-50k), made by the sample_snapshot and compute_fid rules.
localrules:
    select_best,


checkpoint select_best:
    input:
        segments=get_segment_outputs,
    output:
        selected=f"{RUN_DIR}/metrics/final/selected.json",
    log:
        "logs/{run}/select_best/select_best.log",
    conda:
        "../../envs/diffrelay.yaml"
    params:
        best=FINAL.best,
    message:
        "Picking the {params.best} best evaluations of {wildcards.run} for the second pass"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "diffrelay select-best --best {params.best:q} --out {output.selected:q} {input.segments:q}"
