# Config loading and validation, the run's names and wildcard constraints: what every other rule file
# uses. The input functions live with what they serve (plan_training, plan_evaluation, resources,
# targets); the rule files only build paths. Every decision about the run is made at parse time.
import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import update_config

# One schema and one validator for the Snakefile and the CLI: the package's own config module.
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from diffrelay import config as drconfig  # noqa: E402
from diffrelay.evaluation import protocol  # noqa: E402
from diffrelay.data import sources as drsources  # noqa: E402
from diffrelay.config import preflight  # noqa: E402
from diffrelay import nets as drnets  # noqa: E402
from diffrelay import logs as drlogs  # noqa: E402
from diffrelay import io as drio  # noqa: E402
from diffrelay.errors import UserError  # noqa: E402

# tracking.settings imports neither wandb nor mlflow
from diffrelay.tracking import settings as drtracking  # noqa: E402

# envs/diffrelay.yaml installs this checkout into the conda env through this variable.
os.environ.setdefault("DIFFRELAY_HOME", str(workflow.basedir))

# SLURM's warning before the time limit (SIGUSR1, profiles/slurm) goes to every process of the job's
# steps at once, this Snakemake job wrapper included, and Python dies of SIGUSR1 by default: the job
# would end before training has saved. Inside a job the wrapper only waits for the rule's shell, which
# inherits the ignore; torchrun (--signals-to-handle) and `diffrelay train` install their own handlers.
if workflow.remote_exec:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

# Every SLURM job's log (.snakemake/slurm_logs/rule_<rule>/.../<jobid>.log) says where it ran. Outside
# SLURM it prints nothing. Before `set -u`, so unset variables are empty, not errors.
shell.prefix(
    '[ -z "$SLURM_JOB_ID" ] || echo "diffrelay: SLURM job $SLURM_JOB_ID on nodes '
    '$(squeue -h -j "$SLURM_JOB_ID" -o %N), CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" >&2; '
    "set -euo pipefail; "
)


def fail(message):
    """Stop before any job starts, with one line (the same shape as the CLI's errors, exit 2)."""
    print(f"diffrelay: error: {message}", file=sys.stderr)
    sys.exit(2)


def get_config_files():
    """The YAML files in the order Snakemake merged them: the `configfile:` default, then --configfile."""
    cli = [Path(p).absolute() for p in workflow.config_settings.configfiles]
    default = [Path(p).absolute() for p in workflow.configfiles]
    if workflow.config_settings.replace_workflow_config:
        default = []
    files = [p for p in default if p not in cli] + cli
    return list(dict.fromkeys(files))


def same_value(ours, theirs):
    """Our YAML reader reads `1e-3` as a number where Snakemake's (YAML 1.1) reads a string."""
    if isinstance(ours, float) and isinstance(theirs, str):
        try:
            return float(theirs) == ours
        except ValueError:
            return False
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(
            same_value(ours[k], theirs[k]) for k in ours
        )
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(map(same_value, ours, theirs))
    return ours == theirs


def load_run_config():
    """Validate the merged config files; refuse settings the stages would never see."""
    files = get_config_files()
    source = ", ".join(map(str, files)) or "config"
    merged = {}
    try:
        for f in files:
            update_config(merged, drconfig.read_yaml(f))
        # Validate what the stages will read first: a bad value in a file is blamed on the file.
        cfg = drconfig.Config(drconfig.validate(merged, source=source))
    except UserError as e:
        fail(str(e))
    # The stages read the config files, not Snakemake's `config` dict, so a --config key=value
    # (or a profile's `config:`) would change the DAG but not what training does.
    for key in sorted(set(config) | set(merged)):
        if not same_value(merged.get(key), config.get(key)):
            inner = drconfig.first_difference(
                {key: merged.get(key)}, {key: config.get(key)}
            )
            fail(
                f"{inner or key}: set on the command line (--config) or in a profile; the diffrelay stages "
                f"read only the config files, so put the change in a YAML file and pass it with --configfile"
            )
    try:
        # The trackers' credentials only where the track jobs run (local jobs: the main process).
        preflight.check(cfg, source, credentials=workflow.is_main_process)
    except UserError as e:
        fail(str(e))
    return files, cfg


def check_profile_placeholders():
    """profiles/slurm ships `<partition>` and `<account>` for the user to fill in; without this check a
    dry run looks fine and the real run fails at the first sbatch (or, on a machine without SLURM,
    somewhere inside the plugin)."""
    given = workflow.resource_settings.default_resources
    args = given.args if given is not None else []
    holes = [a for a in args if re.fullmatch(r"[\w]+=<[^<>]*>", a)]
    if holes:
        fail(
            f"default-resources {', '.join(holes)}: placeholders of the SLURM profile; fill them in a copy of "
            f"profiles/slurm (cp -r profiles/slurm profiles/mycluster; see profiles/README.md) and run with "
            f"--workflow-profile profiles/mycluster (sinfo -s lists partitions; delete slurm_account on "
            f"clusters without accounts)"
        )


check_profile_placeholders()
CONFIG_FILES, CFG = load_run_config()
CONFIG_ARGS = " ".join(f"--config {shlex.quote(str(f))}" for f in CONFIG_FILES)
if workflow.is_main_process:
    # stderr, so `--dag | dot` stays clean. The stages get exactly these files, in this order.
    print(
        f"diffrelay: config files (later win): {', '.join(map(str, CONFIG_FILES))}; "
        f"see the merged config with: diffrelay validate {CONFIG_ARGS}",
        file=sys.stderr,
    )

RUN = CFG.run.name
RESULTS = CFG.run.results.replace("{", "{{").replace("}", "}}")
RESOURCES = CFG.run.resources.replace("{", "{{").replace("}", "}}")
RUN_DIR_NAME = f"{CFG.run.results}/{RUN}"
# Path patterns of one run; {run} is always the configured run name.
RUN_DIR = f"{RESULTS}/{{run}}"


def trained_steps():
    """Steps of the complete segment checkpoints this run already has (same trajectory); preflight's
    check of sample.guide plans with the same ones."""
    return preflight.trained_steps(CFG)


# sample.snapshot: a run that trains nothing and evaluates that file, as the one segment end, at its step.
EVALUATED = CFG.sample.snapshot and str(Path(CFG.sample.snapshot).expanduser())
if EVALUATED:
    EVALUATED_STEP = preflight.evaluated_snapshot_meta(CFG, "sample.snapshot")["step"]
SEGMENT_ENDS = (
    [EVALUATED_STEP] if EVALUATED else drconfig.segment_ends(CFG, done=trained_steps())
)
STEP = "{step}"
# Every evaluation of a snapshot is named by the step and a variant suffix (protocol.py): a post-hoc
# EMA width (_ema0.08), the second pass's image count (_n50000), the guidance scale (_g1.5) and the seed
# set (_s2), each absent for the default, so a run with none of them keeps the plain step_XXXXXXX names;
# a sampled EMA other than the first of train.ema_decays adds _decay<d>.
VARIANT = "{variant}"
GUIDANCE_SCALES = protocol.guidance_scales(CFG.to_dict()["sample"])
EMA_DECAYS = protocol.ema_decays(CFG.to_dict())
SEED_SETS = range(CFG.sample.seed_sets)
# A text run's prompt files (sample.prompts) are evaluated each on its own (_p<k> for k > 0).
PROMPT_FILES = list(range(max(1, len(protocol.prompt_files(CFG.to_dict()["sample"])))))
# sample.held_out_captions: the held-out captions too, evaluated as their own variant (_ph).
PROMPT_FILES += [protocol.HELD_OUT] if CFG.sample.held_out_captions else []
# sample.sizes: each image size its own evaluation (_<width>x<height>; none for the data.resolution square).
SIZES = protocol.sizes(CFG.to_dict())
FIRST_PASS = [
    protocol.variant(None, g, s, decay=d, prompts=k, size=z)
    for d in EMA_DECAYS
    for g in GUIDANCE_SCALES
    for s in SEED_SETS
    for k in PROMPT_FILES
    for z in SIZES
]
FINAL = CFG.fid.final


def final_variants(guidance, decay=None):
    """The second pass's evaluations: at the one size of sample.sizes (several are refused with fid.final)."""
    return [
        protocol.variant(FINAL.num_images, guidance, s, decay=decay, size=SIZES[0])
        for s in SEED_SETS
    ]


# auto and cuda ask the scheduler for GPUs; set run.device: cpu for a CPU-only run.
USE_GPU = CFG.run.device in ("auto", "cuda")
MULTI_NODE = CFG.train.nnodes > 1
# A latent run (data.encoder) encodes its dataset in prepare: one rank per GPU that training uses
# (data/encoding.py); on the CPU one process, whose decoding workers and torch threads take the cores.
LATENT = CFG.data.encoder != "none"
# A text run (data.captions) encodes its captions there too, on the same ranks (text/cache.py).
TEXT = CFG.data.captions != "none"
ENCODERS = CFG.train.nproc_per_node if (LATENT or TEXT) and USE_GPU else 1


def step_name(step):
    return f"{int(step):07d}"


wildcard_constraints:
    run=re.escape(RUN),
    # Steps are zero-padded to 7 digits; no output pattern reaches snapshots/, which training
    # writes without Snakemake knowing each file.
    step=r"\d{7}",
    variant=protocol.VARIANT,


# --- checks that need more than the schema -------------------------------------------------
# A network of the user's own is imported, built on the meta device and run once here, so a bad
# module, kwargs or output shape stops the run before any job (built-in archs are checked by the schema;
# the diffusers text networks take diffusers' config keys, so they are built here too).
if not drnets.is_builtin(CFG.model.arch) or CFG.model.arch in drnets.TEXT_ARCHS:
    from diffrelay.config.report import check_network

    try:
        check_network(CFG)
    except UserError as e:
        fail(f"{', '.join(map(str, CONFIG_FILES))}: {e}")


def watch_slurm_jobs():
    """At the start of a SLURM run (onstart: the executor is known by then), check that its status command
    can see job states: without accounting storage `sacct` never can and the run would hang silently
    (runtime/slurm.py). The plugin reads the setting at every check, so switching it here takes effect.
    """
    plugin = getattr(workflow, "executor_plugin", None)
    if getattr(plugin, "name", None) != "slurm":
        return
    from diffrelay.runtime import slurm

    settings = workflow.executor_settings
    command, line = slurm.choose_status_command(
        getattr(settings, "status_command", None)
    )
    if command is None:
        raise WorkflowError(line)
    if line:
        print(line)
        settings.status_command = command
