"""`diffrelay launch`: torchrun with the exit status and the console a workflow needs.

  diffrelay launch --standalone --nproc-per-node 2 -m diffrelay train --config config/config.yaml --until-step 400

It takes torchrun's own options and runs torchrun's agent in this process, with three changes:
- the agent also handles SIGUSR1 (SLURM's warning before a time limit), which would otherwise kill it
  while the workers save; it forwards every handled signal to the workers;
- a run stopped by SIGTERM, SIGINT (Ctrl-C) or SIGUSR1, or whose workers all exited 75 after saving,
  exits 75 ("stopped, resumable": a rerun resumes from the newest checkpoint) where torchrun says 1;
- failures are one line naming the ranks and their exit codes, not torchrun's traceback (the failed
  worker's own message is already in the log above it).
"""

import signal
import sys

from diffrelay.errors import UserError

EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_SECONDS = 600  # how long the agent waits for workers to save after a signal; > the longest save


def torchrun_args(argv: list[str]) -> list[str]:
    """torchrun's arguments with our defaults for the options the caller did not set."""
    given = {a.split("=", 1)[0].replace("_", "-") for a in argv if a.startswith("--")}
    extra = []
    if "--signals-to-handle" not in given:
        extra += ["--signals-to-handle", SIGNALS]
    if "--shutdown-timeout" not in given:
        extra += ["--shutdown-timeout", str(SHUTDOWN_SECONDS)]
    return extra + argv


def exit_status(failures: dict) -> int:
    """75 when every failed worker exited 75 (it saved and stopped), else 1."""
    codes = {f.exitcode for f in failures.values()}
    return EXIT_STOPPED if codes == {EXIT_STOPPED} else 1


def main(args) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = list(args.torchrun)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UserError("launch: give torchrun's options and the program, e.g. "
                        "diffrelay launch --standalone --nproc-per-node 2 -m diffrelay train --config c.yaml")
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
