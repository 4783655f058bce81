# Config loading and validation, wildcard constraints, and every input function (get_*).
# The rule files only build paths; all decisions about the run are made here, once, at parse time.
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
from diffrelay import preflight  # noqa: E402
from diffrelay.errors import UserError  # noqa: E402

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
        preflight.check(cfg, source)
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
    """Steps of the complete segment checkpoints this run already has (same trajectory)."""
    folder = Path(RUN_DIR_NAME) / "checkpoints"
    want, steps = drconfig.trajectory_hash(CFG), []
    for p in folder.glob("step_*") if folder.is_dir() else []:
        m = re.fullmatch(r"step_(\d{7})", p.name)
        try:
            complete = (p / "manifest.json").is_file()
            same = json.loads((p / "meta.json").read_text()).get("trajectory") == want
        except (OSError, ValueError):
            continue
        if m and complete and same:
            steps.append(int(m.group(1)))
    return steps


SEGMENT_ENDS = drconfig.segment_ends(CFG, done=trained_steps())
STEP = "{step}"
# Every evaluation of a snapshot is named by the step and a variant suffix (protocol.py): a post-hoc
# EMA width (_ema0.08), the second pass's image count (_n50000), the guidance scale (_g1.5) and the seed
# set (_s2), each absent for the default, so a run with none of them keeps the plain step_XXXXXXX names.
VARIANT = "{variant}"
GUIDANCE_SCALES = protocol.guidance_scales(CFG.to_dict()["sample"])
SEED_SETS = range(CFG.sample.seed_sets)
FIRST_PASS = [protocol.variant(None, g, s) for g in GUIDANCE_SCALES for s in SEED_SETS]
FINAL = CFG.fid.final


def final_variants(guidance):
    return [protocol.variant(FINAL.num_images, guidance, s) for s in SEED_SETS]


# auto and cuda ask the scheduler for GPUs; set run.device: cpu for a CPU-only run.
USE_GPU = CFG.run.device in ("auto", "cuda")
MULTI_NODE = CFG.train.nnodes > 1


# --- GPU slots on one machine (run.gpus) ------------------------------------------------------
# Snakemake gives local jobs no GPU ids, so each GPU job runs under `diffrelay with-gpus`, which takes
# free ids from a pool with flock and sets CUDA_VISIBLE_DEVICES. Training and evaluation draw from
# their own parts of the pool; the resources below keep Snakemake from starting more jobs than ids.
def resolve_gpu_pools():
    if CFG.run.gpus is None:
        return [], []
    from diffrelay.runtime.gpus import check_inherited, gpu_pools, visible_ids

    d = CFG.to_dict()
    source = ", ".join(map(str, CONFIG_FILES))
    if CFG.run.gpus == "auto":
        # Ordinals, or GPU-/MIG- UUIDs as CUDA_VISIBLE_DEVICES lists them.
        ids = visible_ids()
        if not ids:
            fail(
                "run.gpus=auto: no GPU is visible on this machine; give the ids (run.gpus: [0, 1]) or use null"
            )
        # The schema checks counts on integers; the pool keeps the ids as the machine names them.
        d["run"]["gpus"] = list(range(len(ids)))
        try:
            drconfig.validate(d, source=source)
        except UserError as e:
            fail(f"{e} (run.gpus=auto found ids {ids})")
        train, evaluation = gpu_pools(d)
        return [ids[i] for i in train], [ids[i] for i in evaluation]
    try:
        check_inherited(CFG.run.gpus, f"{source}: run.gpus={CFG.run.gpus}")
    except UserError as e:
        fail(str(e))
    return gpu_pools(d)


TRAIN_GPUS, EVAL_GPUS = resolve_gpu_pools()
GPU_POOL = bool(TRAIN_GPUS)
SHARED_POOL = GPU_POOL and TRAIN_GPUS == EVAL_GPUS
GPU_LOCKS = f"{CFG.run.resources}/gpu-locks"
if GPU_POOL:
    for name, ids in {"gpu_train": TRAIN_GPUS, "gpu_eval": EVAL_GPUS}.items():
        workflow.register_resource("gpu_pool" if SHARED_POOL else name, len(ids))


def gpu_resources(kind, count):
    """Resources of a GPU job: ids of its part of the pool, or plain `gpu` (SLURM, one-at-a-time)."""
    if GPU_POOL:
        return {"gpu_pool" if SHARED_POOL else f"gpu_{kind}": count, "gpu": 0}
    return {"gpu": count if USE_GPU else 0}


def with_gpus(kind, count):
    """Command prefix that runs a job on `count` free ids of its pool; empty without a pool."""
    if not GPU_POOL:
        return ""
    if workflow.executor_plugin and workflow.executor_plugin.name in (
        "slurm",
        "slurm-jobstep",
    ):
        fail(
            f"{', '.join(map(str, CONFIG_FILES))}: run.gpus is for one machine; on SLURM the scheduler "
            f"assigns GPUs, so set run.gpus: null"
        )
    ids = TRAIN_GPUS if kind == "train" else EVAL_GPUS
    return (
        f"diffrelay with-gpus --pool {','.join(map(str, ids))} --count {count} "
        f"--lock-dir {shlex.quote(GPU_LOCKS)} -- "
    )


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
# module, kwargs or output shape stops the run before any job (built-in archs are checked by the schema).
if CFG.model.arch not in ("unet", "dit"):
    from diffrelay.validate import check_network

    try:
        check_network(CFG)
    except UserError as e:
        fail(f"{', '.join(map(str, CONFIG_FILES))}: {e}")

# The extractors in config order (the first picks the best checkpoint), each under a file-name key.
EXTRACTOR_NAMES = protocol.extractor_names(CFG.to_dict()["fid"])
EXTRACTOR_KEYS = [protocol.extractor_key(n, CFG.run.seed) for n in EXTRACTOR_NAMES]
EXTRACTOR_FILES = {
    key: protocol.extractor_file(name, CFG.run.seed, RESOURCES)
    for name, key in zip(EXTRACTOR_NAMES, EXTRACTOR_KEYS)
}  # custom files are checked by preflight.check_inputs
FOREIGN_REFERENCES = {
    key: protocol.reference_file(CFG.to_dict()["fid"], name)
    for name, key in zip(EXTRACTOR_NAMES, EXTRACTOR_KEYS)
}


def get_extractor(wildcards):
    """The extractor file of one reference job ({extractor} is its key)."""
    return EXTRACTOR_FILES[wildcards.extractor]


def get_extractors(wildcards):
    return list(EXTRACTOR_FILES.values())


def get_references(wildcards):
    """Per extractor: fid.reference (statistics made elsewhere), or the dataset's own (compute_reference)."""
    return [
        FOREIGN_REFERENCES[key]
        or expand(rules.compute_reference.output.ref, run=wildcards.run, extractor=key)[
            0
        ]
        for key in EXTRACTOR_KEYS
    ]


def get_score_args(wildcards, input):
    """--extractor E --ref R per extractor, in config order (the first is the primary score)."""
    return " ".join(
        f"--extractor {shlex.quote(e)} --ref {shlex.quote(r)}"
        for e, r in zip(input.extractors, input.refs)
    )


# --- targets ---------------------------------------------------------------------------------
def get_final_output():
    """The report, plus the samples and scores of segments already trained: Snakemake does not
    remake a deleted intermediate file by itself, only a missing target."""
    done = [
        end
        for end in SEGMENT_ENDS
        if (
            Path(RUN_DIR_NAME) / "checkpoints" / f"step_{step_name(end)}/manifest.json"
        ).is_file()
    ]
    steps = [step_name(s) for end in done for s in segment_snapshots(RUN, end)]
    return (
        expand(rules.build_report.output, run=RUN)
        + expand(
            rules.sample_snapshot.output.samples,
            run=RUN,
            step=steps,
            variant=FIRST_PASS,
        )
        + expand(
            rules.compute_fid.output.score,
            run=RUN,
            step=steps,
            variant=FIRST_PASS,
        )
    )


def get_second_pass_targets(wildcards):
    """The second pass's samples and scores as targets too (see get_final_output). A separate input
    of the all rule, since they are unknown until select_best has run and the rest of the DAG must not wait.
    """
    return [
        expand(out, run=RUN, step=s, variant=v)[0]
        for s, v in final_evaluations(RUN)
        for out in (
            rules.sample_snapshot.output.samples,
            rules.compute_fid.output.score,
        )
    ]


def get_segment_outputs(wildcards):
    """One aggregate per training segment: the report waits for all of them."""
    return expand(
        rules.collect_segment.output.segment,
        run=wildcards.run,
        step=[step_name(s) for s in SEGMENT_ENDS],
    )


# --- training --------------------------------------------------------------------------------
def previous_end(step):
    i = SEGMENT_ENDS.index(int(step))
    return SEGMENT_ENDS[i - 1] if i else 0


def check_executor():
    """Several nodes need SLURM. The executor is known only once the DAG is built, not at parse time,
    and not at all for --dag, --rulegraph or --report: an input function that raised there would make
    Snakemake leave the training jobs out of the graph without a word."""
    plugin = workflow.executor_plugin
    name = plugin.name if plugin is not None else None
    # Inside a SLURM allocation the plugin runs a multi-node (`mpi`) job with Snakemake's local
    # executor; remote_exec says so (it is false for a plain `snakemake --cores` run).
    if (
        MULTI_NODE
        and not workflow.remote_exec
        and name not in (None, "slurm", "slurm-jobstep", "dryrun")
    ):
        fail(
            f"{', '.join(map(str, CONFIG_FILES))}: train.nnodes={CFG.train.nnodes}: several nodes need the SLURM profile "
            f"(snakemake --workflow-profile profiles/slurm ...); use train.nnodes: 1 on one machine"
        )


def get_previous_checkpoint(wildcards):
    """Segment k starts from the checkpoint of segment k-1 (its record file); the first from scratch."""
    check_executor()
    prev = previous_end(wildcards.step)
    if not prev:
        return []
    return expand(
        rules.train_segment.output.trained, run=wildcards.run, step=step_name(prev)
    )


def checkpoint_of(trained):
    """The checkpoint folder a training record (trained/step_X.json) stands for."""
    trained = Path(trained)
    return str(trained.parent.parent / "checkpoints" / trained.stem)


def get_init_arg(wildcards, input):
    paths = [input.init] if isinstance(input.init, str) else list(input.init)
    return " ".join(f"--init {shlex.quote(checkpoint_of(p))}" for p in paths)


# Params functions that take `threads` or `input` count as derived for Snakemake, so they are not
# rerun triggers: process counts, thread counts and config file names do not change the
# weights or the pixels, and adding a --configfile must not retrain.
def get_config_args(wildcards, threads):
    return CONFIG_ARGS


def get_prepare_args(wildcards, threads):
    # Decoding processes: data.workers, or with 0 `prepare` takes every core the job may use (its
    # affinity mask: the allocation on a cluster). Snakemake's threads then count 1: prepare runs
    # before training needs any core, and on a cluster a thread count read from --cores would not
    # match the allocation.
    return f"{CONFIG_ARGS} --workers {threads if CFG.data.workers else 0}"


def get_train_launcher(wildcards, threads):
    t = CFG.train
    if not MULTI_NODE:
        # --standalone picks a free port per job, so jobs on one machine never collide.
        return (
            with_gpus("train", t.nproc_per_node)
            + f"diffrelay launch --standalone --nproc-per-node {t.nproc_per_node}"
        )
    # One srun task per node (geometry explicit: the job's SLURM_* variables are gone, see
    # get_train_setup), each a `diffrelay launch` agent; they meet at the allocation's first node. Each task
    # first logs where it runs.
    n = t.nnodes
    where = 'echo "diffrelay: srun task $SLURM_PROCID on node $SLURMD_NODENAME ($(hostname)), GPUs ${CUDA_VISIBLE_DEVICES:-none}"; exec "$@"'
    return (
        f"srun --kill-on-bad-exit=1 --nodes {n} --ntasks {n} --ntasks-per-node 1 "
        f"sh -c {shlex.quote(where)} sh "
        f"diffrelay launch --nnodes {n} --nproc-per-node {t.nproc_per_node} --rdzv-backend c10d "
        f'--rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID"'
    )


def get_train_setup(wildcards, threads):
    """Shell lines run before the traced command (multi-node only: find the rendezvous host). The
    SLURM jobstep plugin removes most SLURM_* variables (the node list among them) from a job's
    environment; SLURM_JOB_ID stays, and squeue knows the nodes."""
    if not MULTI_NODE:
        return ":"
    return (
        'head=$(scontrol show hostnames "$(squeue -h -j "$SLURM_JOB_ID" -o %N)" | head -n 1); '
        # 20000 ports apart from 29400 (torchrun's default) up: jobs sharing a head node collide only
        # if their ids differ by a multiple of 20000 (the old % 1000 collided for ids 1000 apart).
        "port=$((30000 + SLURM_JOB_ID % 20000))"
    )


def train_resources():
    t = CFG.train
    if not MULTI_NODE:
        return gpu_resources("train", t.nproc_per_node)
    # `mpi` makes the SLURM plugin run the job's shell directly (not under `srun -n1`), so the
    # rule's own srun can start one task per node; gres asks for GPUs per node, not per job.
    extra = {"gres": f"gpu:{t.nproc_per_node}", "tasks_per_gpu": 0} if USE_GPU else {}
    return {"nodes": t.nnodes, "tasks": t.nnodes, "mpi": "srun", **extra}


# --- evaluation ------------------------------------------------------------------------------
def get_snapshot_checkpoint(wildcards):
    """The checkpoint of the segment that wrote this snapshot (done before its snapshots count)."""
    step = int(wildcards.step)
    end = next((e for e in SEGMENT_ENDS if e >= step), None)
    if end is None:
        raise WorkflowError(
            f"step {step} is past train.total_steps={CFG.train.total_steps}"
        )
    return expand(
        rules.train_segment.output.trained, run=wildcards.run, step=step_name(end)
    )


def segment_snapshots(run, end):
    """Snapshot steps that training actually wrote in (previous end, end]. Only the steps the
    current config asks for count: a file left by an earlier snapshot_every is not evaluated.
    """
    start = previous_end(end)
    wanted = set(drconfig.snapshot_steps(CFG, start, int(end)))
    folder = Path(CFG.run.results) / run / "snapshots"
    steps = sorted(
        int(m.group(1))
        for p in folder.glob("step_*.safetensors")
        if (m := re.fullmatch(r"step_(\d{7})\.safetensors", p.name))
    )
    return [s for s in steps if s in wanted]


def get_segment_scores(wildcards):
    """FID of every snapshot of this segment. Asks for this segment's checkpoint only, so the
    evaluation of segment k runs while segment k+1 trains."""
    checkpoints.train_segment.get(run=wildcards.run, step=wildcards.step)
    steps = segment_snapshots(wildcards.run, wildcards.step)
    if not steps:
        raise WorkflowError(
            f"{RUN_DIR_NAME}/snapshots: no snapshot in steps ({previous_end(wildcards.step)}, "
            f"{int(wildcards.step)}]; the train stage should have written one; rerun it with "
            f"--forcerun train_segment"
        )
    return expand(
        rules.compute_fid.output.score,
        run=wildcards.run,
        step=[step_name(s) for s in steps],
        variant=FIRST_PASS,
    )


def final_evaluations(run):
    """(step, variant) of the second pass (fid.final.best > 0): every seed set of the best first-pass
    evaluations, with fid.final.num_images images. Known once select_best has ranked all first-pass
    scores (asking for them before makes Snakemake run it first)."""
    if not FINAL.best:
        return []
    with open(checkpoints.select_best.get(run=run).output.selected) as f:
        selected = json.load(f)["selected"]
    return [
        (step_name(pick["step"]), v)
        for pick in selected
        for v in final_variants(pick["guidance"])
    ]


def get_final_scores(wildcards):
    return [
        expand(rules.compute_fid.output.score, run=wildcards.run, step=s, variant=v)[0]
        for s, v in final_evaluations(wildcards.run)
    ]


def get_sample_launcher(wildcards, threads):
    n = CFG.sample.nproc
    if n == 1:
        return with_gpus("eval", 1) + "diffrelay"
    return (
        with_gpus("eval", n)
        + f"diffrelay launch --standalone --nproc-per-node {n} -m diffrelay"
    )


def get_eval_launcher(wildcards, threads):
    """`diffrelay` for one-GPU evaluation jobs (reference statistics, FID), on a free id of the pool."""
    return with_gpus("eval", 1) + "diffrelay"


def get_sample_settings(wildcards):
    """--num-images, --first-seed and --guidance of one evaluation, from its variant suffix."""
    count, guidance, seed_set = protocol.parse_variant(wildcards.variant)
    count = count or CFG.sample.num_images
    first = protocol.first_seed(CFG.sample.first_seed, count, seed_set)
    return f"--num-images {count} --first-seed {first} --guidance {guidance:g}"


def get_sample_threads(wildcards, threads):
    # Per process; Snakemake may lower `threads` to --cores, never the process count.
    return max(1, threads // CFG.sample.nproc)


# --- post-hoc EMA (phema.smk) -----------------------------------------------------------------
# Each width of sample.phema is reconstructed at the run's last step and evaluated like a snapshot,
# under the variant _ema<width> (every guidance scale and seed set of the first pass).
PHEMA_STEP = step_name(CFG.train.total_steps)
PHEMA_VARIANTS = [
    protocol.variant(None, g, s, ema)
    for ema in CFG.sample.phema
    for g in GUIDANCE_SCALES
    for s in SEED_SETS
]


def get_snapshot(wildcards):
    """The weights one evaluation samples: the step's snapshot, or a post-hoc EMA reconstruction."""
    ema = protocol.variant_ema(wildcards.variant)
    if ema is None:
        return expand(
            f"{RUN_DIR}/snapshots/step_{STEP}.safetensors",
            run=wildcards.run,
            step=wildcards.step,
        )
    return expand(
        rules.reconstruct_phema.output.snapshot,
        run=wildcards.run,
        step=wildcards.step,
        sigma=f"{ema:g}",
    )


def get_phema_scores(wildcards):
    """Scores of the post-hoc EMA reconstructions; the report waits for them (none when off)."""
    return expand(
        rules.compute_fid.output.score,
        run=wildcards.run,
        step=PHEMA_STEP,
        variant=PHEMA_VARIANTS,
    )


def get_phema_targets():
    """Their samples and scores as targets once the last segment is trained (see get_final_output)."""
    last = Path(RUN_DIR_NAME) / "checkpoints" / f"step_{PHEMA_STEP}/manifest.json"
    if not PHEMA_VARIANTS or not last.is_file():
        return []
    return [
        expand(out, run=RUN, step=PHEMA_STEP, variant=v)[0]
        for v in PHEMA_VARIANTS
        for out in (
            rules.sample_snapshot.output.samples,
            rules.compute_fid.output.score,
        )
    ]
