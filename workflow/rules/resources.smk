# Resources: which GPUs a job may use (run.gpus pools and `diffrelay with-gpus`, or plain `gpu` counts for
# SLURM and one-at-a-time local runs) and the SLURM resources of a training job.
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
        try:
            ids = visible_ids()
        except UserError as e:
            fail(f"{source}: run.gpus=auto: {e}, or give the ids (run.gpus: [0, 1])")
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


def train_resources():
    t = CFG.train
    if not MULTI_NODE:
        return gpu_resources("train", t.nproc_per_node)
    # `mpi` makes the SLURM plugin run the job's shell directly (not under `srun -n1`), so the
    # rule's own srun can start one task per node; gres asks for GPUs per node, not per job.
    extra = {"gres": f"gpu:{t.nproc_per_node}", "tasks_per_gpu": 0} if USE_GPU else {}
    return {"nodes": t.nnodes, "tasks": t.nnodes, "mpi": "srun", **extra}
