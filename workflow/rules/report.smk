# build_report: metrics.csv, scores.md (the papers' table), FID and loss curves, and the best
# checkpoint, from the run folder.
# Flagged outputs go into `snakemake --report report.html`.
rule build_report:
    input:
        segments=get_segment_outputs,
        # Known before any checkpoint exists, so it is computed while the first segment trains.
        references=get_references,
        # The second pass (fid.final), once select_best has picked the checkpoints.
        final=get_final_scores,
        # Post-hoc EMA reconstructions at the last step (sample.phema).
        phema=get_phema_scores,
    output:
        metrics=report(
            f"{RUN_DIR}/report/metrics.csv",
            caption="../report/metrics.rst",
            category="Metrics",
        ),
        fid_plot=report(
            f"{RUN_DIR}/report/fid.png",
            caption="../report/fid.rst",
            category="Metrics",
        ),
        loss_plot=report(
            f"{RUN_DIR}/report/loss.png",
            caption="../report/loss.rst",
            category="Metrics",
        ),
        scores=f"{RUN_DIR}/report/scores.md",
        best=f"{RUN_DIR}/report/best.json",
        best_grid=report(
            f"{RUN_DIR}/report/best_grid.png",
            caption="../report/best_grid.rst",
            category="Samples",
        ),
    log:
        "logs/{run}/build_report/build_report.log",
    benchmark:
        "logs/{run}/benchmarks/build_report/build_report.tsv"
    conda:
        "../../envs/diffrelay.yaml"
    threads: 1
    params:
        run_dir=lambda wildcards: f"{CFG.run.results}/{wildcards.run}",
        out=lambda wildcards, output: str(Path(output.metrics).parent),
        # fid.best_by rides here when not the default: a param of its own (even empty) would rerun every
        # finished run's report once, and a new word in the shell text would too.
        evaluated=(f" --evaluated {shlex.quote(EVALUATED)}" if EVALUATED else "")
        + (f" --best-by {CFG.fid.best_by}" if CFG.fid.best_by != "fid" else "")
        # sample.sizes: the first size picks the best checkpoint (said only when it is not the square)
        + (f" --best-size {protocol.size_name(SIZES[0])}" if SIZES[0] else ""),
    message:
        "Writing the {wildcards.run} report"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "diffrelay report --run-dir {params.run_dir:q} --out {params.out:q}{params.evaluated}"
