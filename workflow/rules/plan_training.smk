# The training plan: the chain of segments, where each resumes from, and how it is launched
# (one machine, or srun over several nodes).
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


def get_source_listing(wildcards):
    """prepare_dataset's param: the source's file names, sizes and mtimes, digested (data/sources.py)."""
    return drsources.listing(CFG.to_dict()["data"])


def get_prepare_args(wildcards, threads):
    # Decoding processes: data.workers, or with 0 `prepare` takes every core the job may use (its
    # affinity mask: the allocation on a cluster). Snakemake's threads then count 1: prepare runs
    # before training needs any core, and on a cluster a thread count read from --cores would not
    # match the allocation.
    args = f"{CONFIG_ARGS} --workers {threads if CFG.data.workers else 0}"
    if not LATENT and not (TEXT and CFG.data.text_cache):
        return args
    # A latent run encodes on ENCODERS ranks, on free GPU ids of a pool: `diffrelay prepare` starts
    # itself again under this launcher. Passed as an argument, so that the rule's shell text (a rerun
    # trigger for every finished run) is what it was before latents.
    gpus = with_gpus("train", ENCODERS) if USE_GPU else ""
    launch = f"diffrelay launch --standalone --nproc-per-node {ENCODERS} -m diffrelay"
    launcher = gpus + (launch if ENCODERS > 1 else "diffrelay")
    return args + (
        f" --relaunch {shlex.quote(launcher)}" if launcher != "diffrelay" else ""
    )


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
