# reconstruct_phema: post-hoc EMA (train.phema, sample.phema). Once the last segment has trained, one
# snapshot per sample.phema width, combined from the stored profiles in phema/ by `diffrelay phema`.
# These snapshots hold ema weights only; they are sampled and scored as the evaluations
# step_<last>_ema<width>... (common.smk, get_snapshot). Output under snapshots/phema/, which
# training never writes, so no pattern here reaches the files training makes.
rule reconstruct_phema:
    input:
        trained=f"{RUN_DIR}/trained/step_{STEP}.json",
    output:
        snapshot=f"{RUN_DIR}/snapshots/phema/step_{STEP}_ema{{sigma}}.safetensors",
    log:
        "logs/{run}/reconstruct_phema/step_{step}_ema{sigma}.log",
    wildcard_constraints:
        sigma=r"[0-9.e-]+",
    conda:
        "../../envs/diffrelay.yaml"
    params:
        run_dir=lambda wildcards, input: str(Path(input.trained).parent.parent),
        until=lambda wildcards: int(wildcards.step),
    message:
        "Reconstructing the post-hoc EMA of width {wildcards.sigma} at step {wildcards.step} of {wildcards.run}"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "diffrelay phema --run-dir {params.run_dir:q} --sigma-rel {wildcards.sigma:q} "
        "--until-step {params.until} --out {output.snapshot:q}"
