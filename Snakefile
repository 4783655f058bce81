# diffrelay: train a diffusion model in resumable torchrun segments, sample and score every
# checkpoint outside the training process group, and write a report.
#   snakemake --cores 2                                   # the demo run (config/config.yaml)
#   snakemake --cores 8 --configfile config/examples/real-data.yaml
#   snakemake --workflow-profile profiles/slurm --configfile config/examples/slurm-multinode.yaml
# Stages get the config FILES, so change settings in YAML, not with --config (see common.smk).
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/resources.smk"
include: "workflow/rules/plan_training.smk"
include: "workflow/rules/plan_evaluation.smk"
include: "workflow/rules/targets.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/extractor.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/sample.smk"
include: "workflow/rules/fid.smk"
include: "workflow/rules/final.smk"
include: "workflow/rules/phema.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/track.smk"


rule all:
    default_target: True
    input:
        get_final_output(),
        second_pass=get_second_pass_targets,
        phema=get_phema_targets(),
        # The experiment trackers' jobs (track.smk): none without `track`.
        track=get_track_targets(),


onstart:
    print(f"diffrelay: run {RUN} -> {RUN_DIR_NAME}; {CONFIG_ARGS}")
    watch_slurm_jobs()


onsuccess:
    print(drlogs.workflow_end(RUN, RUN_DIR_NAME, True))


onerror:
    print(
        drlogs.workflow_end(
            RUN, RUN_DIR_NAME, False, getattr(workflow, "scheduler", None)
        )
    )
