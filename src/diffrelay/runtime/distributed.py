"""The only module that knows about ranks: init, rank/world queries, reductions, teardown, and the launcher
(`diffrelay launch`, torchrun with status 75 for a stopped run).

A process group always exists during training (a world of one under plain `python`), so callers
never branch on the world size, and no collective ever sits behind a rank check.
"""

import contextlib
import datetime
import os
import signal
import sys

# torch is imported inside the functions that need it: the environment helpers (clean_env, env_rank)
# are used by processes that never touch a GPU or a group, such as the parent of the FID subprocess,
# and importing torch costs them seconds.

# Variables torchrun and torch.distributed read; removed before starting a child that must not join.
GROUP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
GROUP_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
# `diffrelay launch` puts its own pid here for its workers (see die_with_agent).
AGENT_PID = "DIFFRELAY_AGENT_PID"


def env_rank() -> int:
    return int(os.environ.get("RANK", 0))


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def env_local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def pick_device(want: str = "auto"):
    """cuda:LOCAL_RANK when a GPU is wanted and present, else cpu."""
    import torch

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    if want == "auto" and not torch.cuda.is_available() and not hidden:
        # A torch without CUDA (a conda env solved on a login node gets the CPU build) would train on the
        # CPU beside idle GPUs, silently: with the variable unset, and as much when SLURM or with-gpus handed
        # this job GPU ids. Only an empty CUDA_VISIBLE_DEVICES (or -1) hides the GPUs on purpose.
        from diffrelay.runtime.gpus import nvidia_smi_ids

        if listed := nvidia_smi_ids():
            from diffrelay.errors import UserError

            raise UserError(f"run.device=auto: nvidia-smi lists {len(listed)} GPU(s) but this torch {torch.__version__} "
                            f"(CUDA {torch.version.cuda or 'none: a CPU build'}) cannot use them; install a CUDA "
                            "build of torch, or set run.device: cpu to train on the CPU on purpose")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from diffrelay.errors import UserError

            raise UserError("run.device=cuda: no CUDA device is visible; use run.device=auto or cpu")
        local, count = env_local_rank(), torch.cuda.device_count()
        if local >= count:  # else CUDA's own "invalid device ordinal", with no hint of the cause
            from diffrelay.errors import UserError

            raise UserError(f"process LOCAL_RANK={local} needs GPU {local}, but this process sees {count} GPU(s) "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run at most "
                            f"{count} process(es) per node (train.nproc_per_node, sample.nproc)")
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def die_with_agent() -> None:
    """In a worker of `diffrelay launch`: the kernel kills this process when the agent dies, SIGKILL included.

    torchrun starts each worker in a session of its own with no parent-death signal, so a killed agent (a
    job's `kill -9`, a SLURM step cancelled hard) left workers training on, writing checkpoints and
    Snakemake records after the job was gone, and holding GPUs that `with-gpus` had already freed. If the
    agent died before this line ran, nothing would ever signal the worker: it stops here instead."""
    agent = os.environ.get(AGENT_PID)
    if not agent:
        return
    from diffrelay.runtime.parallel import die_with_parent

    die_with_parent()
    if os.getppid() != int(agent):
        print(f"diffrelay: the launch agent (pid {agent}) is gone; this worker stops", file=sys.stderr)
        os._exit(1)


_OWN_WORLD: dict = {}  # the group variables init set itself (a world of one under plain python)


def init(device, timeout_minutes: float = 10) -> None:
    """Join (or, under plain python, create) the process group. The backend follows the device."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ or _OWN_WORLD:
        # Plain `python`: a world of one on a free local port; a new one for each group this process makes (a port
        # of an earlier group may still be held), and none left for children to inherit (teardown).
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _OWN_WORLD.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.update(_OWN_WORLD)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes),
                            **({"device_id": device} if device.type == "cuda" else {}))


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else env_rank()


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else env_world()


def is_main() -> bool:
    return rank() == 0


def _is_group_error(e: BaseException) -> bool:
    import torch.distributed as dist

    # DDP's gradient all-reduce surfaces backend failures as plain RuntimeErrors from inside backward().
    text = str(e)
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "NCCL", "Timed out", "Connection"))


@contextlib.contextmanager
def peers(what: str):
    """Turn a failed or timed-out collective into one line that says which rank saw it."""
    import torch.distributed as dist

    try:
        yield
    except (dist.DistError, RuntimeError) as e:
        if not _is_group_error(e):
            raise
        from diffrelay.errors import GroupFailure

        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise GroupFailure(f"rank {rank()} of {world()}: {what} failed ({first}); another rank died or stalled "
                           "(see its lines in the job log); rerun to resume from the last checkpoint") from e


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with peers("barrier"):
            dist.barrier()


def agree(value: int, what: str) -> None:
    """Every rank must pass the same value (e.g. the step it resumes from); one line if they do not.
    Every rank must call it. Each rank reads the run folder itself, and a shared file system's caches can
    show nodes different folders: training then hangs or mixes states."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    with peers("all-reduce"):
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[0].item(), -both[1].item()
    if high != low:
        from diffrelay.errors import UserError

        raise UserError(f"ranks disagree on {what}: {low} on some, {high} on others (rank {rank()} has {value}); "
                        "the run folder looks different from different nodes (a shared file system's cache?); "
                        "check that every node sees the same run folder, then rerun")


def from_main(value: int, what: str) -> int:
    """Rank 0's `value` on every rank (the others pass anything). Every rank must call it."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    x = torch.tensor([value], dtype=torch.int64, device=device)
    with peers(what):
        dist.broadcast(x, src=0)
    return int(x.item())


def text_from_main(text: str, what: str) -> str:
    """Rank 0's `text` on every rank (the others pass anything): an outcome that every rank then acts on alike.
    Every rank must call it."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return text
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    raw = list(text.encode()) if rank() == 0 else []
    size = from_main(len(raw), what)  # every rank, rank 0 included
    buf = torch.tensor(raw, dtype=torch.uint8, device=device) if rank() == 0 else \
        torch.zeros(size, dtype=torch.uint8, device=device)
    if size:  # every rank knows it
        with peers(what):
            dist.broadcast(buf, src=0)
    return bytes(buf.tolist()).decode()


def all_reduce_sum(x):
    """Sum over ranks. Every rank must call it."""
    import torch.distributed as dist

    y = x.detach().clone()
    if dist.is_initialized():
        with peers("all-reduce"):
            dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in list(_OWN_WORLD.items()):  # the variables init set for a world of one
        if os.environ.get(key) == value:
            del os.environ[key]
    _OWN_WORLD.clear()


def clean_env(env: dict | None = None) -> dict:
    """A copy of the environment without torchrun / process-group variables."""
    env = dict(os.environ if env is None else env)
    for k in list(env):
        if k in GROUP_VARS or k == AGENT_PID or k.startswith(GROUP_PREFIXES):
            del env[k]
    return env


# ---------------------------------------------------------------------------------------------
# `diffrelay launch`: torchrun with the exit status and the console a workflow needs.
#
#   diffrelay launch --standalone --nproc-per-node 2 -m diffrelay train --config c.yaml --until-step 400
#
# It takes torchrun's own options and runs torchrun's agent in this process, with three changes:
# - the agent also handles SIGUSR1 (SLURM's warning before a time limit), which would otherwise kill it
#   while the workers save; it forwards every handled signal to the workers and waits for them;
# - a run stopped by SIGTERM, SIGINT (Ctrl-C) or SIGUSR1, or whose workers all exited 75 after saving,
#   exits 75 ("stopped, resumable": a rerun resumes from the newest checkpoint) where torchrun says 1;
# - failures are one line naming the ranks and their exit codes, not torchrun's traceback (the failed
#   worker's own message is already in the log above it).

EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_SECONDS = 600  # how long the agent waits for workers to save after a signal; > the longest save


def torchrun_options() -> set[str]:
    """The options this torch's torchrun takes (--shutdown-timeout is newer than torch 2.11, for one)."""
    from torch.distributed.run import get_args_parser

    return {o for action in get_args_parser()._actions for o in action.option_strings}


def torchrun_args(argv: list[str]) -> list[str]:
    """torchrun's arguments with our defaults for the options the caller did not set and this torch has."""
    given = {a.split("=", 1)[0].replace("_", "-") for a in argv if a.startswith("--")}
    known, extra = torchrun_options(), []
    if "--signals-to-handle" not in given and "--signals-to-handle" in known:
        extra += ["--signals-to-handle", SIGNALS]
    if "--shutdown-timeout" not in given:
        if "--shutdown-timeout" in known:
            extra += ["--shutdown-timeout", str(SHUTDOWN_SECONDS)]
        else:  # seen on torch 2.11: the agent then gives workers its own default time to save after a signal
            print("diffrelay launch: this torch's torchrun has no --shutdown-timeout; after a stop signal, workers get "
                  f"its default time to write their recovery checkpoint (newer torch: {SHUTDOWN_SECONDS} s)",
                  file=sys.stderr)
    return extra + argv


def exit_status(failures: dict) -> int:
    """75 when every failed worker exited 75 (it saved and stopped), else 1."""
    codes = {f.exitcode for f in failures.values()}
    return EXIT_STOPPED if codes == {EXIT_STOPPED} else 1


def main_launch(args) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from diffrelay.errors import UserError

    argv = list(args.torchrun)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UserError("launch: give torchrun's options and the program, e.g. "
                        "diffrelay launch --standalone --nproc-per-node 2 -m diffrelay train --config c.yaml")
    os.environ[AGENT_PID] = str(os.getpid())  # the workers bind their lives to this process (die_with_agent)
    try:
        run(parse_args(torchrun_args(argv)))
    except SignalException as e:
        stopped = e.sigval in STOP_SIGNALS
        print(f"diffrelay launch: got {signal.Signals(e.sigval).name}; workers were told to save and stop"
              + ("; exit 75: rerun to resume from the newest checkpoint" if stopped else ""), file=sys.stderr)
        return EXIT_STOPPED if stopped else 128 + e.sigval
    except ChildFailedError as e:
        code = exit_status(e.failures)
        ranks = ", ".join(f"rank {r} exit {f.exitcode}" for r, f in sorted(e.failures.items()))
        if code == EXIT_STOPPED:
            print(f"diffrelay launch: workers stopped after saving ({ranks}); exit 75: rerun to resume",
                  file=sys.stderr)
        else:
            print(f"diffrelay launch: worker(s) failed ({ranks}); see their messages above", file=sys.stderr)
        return code
    return 0
