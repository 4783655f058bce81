"""What each private torch or Python name that diffrelay uses saves: the same work with and without it, each in a
fresh process (the savings are all first-use imports and process teardown, which a warm process cannot show).

  python benchmarks/bench_internals.py [--repeat 5] [--out PATH]

1. optimizer (training/eager.py, in a process that compiles nothing): torch.optim.AdamW built by
   optim.build_optimizer with its LambdaLR schedule, one backward and step, zero_grad, state_dict and
   load_state_dict (what a training segment calls), timed inside the child from before the optimizer is built:
     both       eager.settle (torch._compile._disable_dynamo's cached result) and eager.eager_step (a step without
                torch.optim.optimizer._use_grad_for_differentiable's graph breaks), as training runs
     settle     eager.settle only: the step imports torch._dynamo
     eager_step eager.eager_step only: add_param_group (in the constructor) imports torch._dynamo
     neither    torch's own optimizer, as a run with train.compile
   and whether torch._dynamo was imported.
2. exit (cli.entry): a process with the modules of a training job loaded (diffrelay.training.train, torch), whose
   stage returned, ends by
     entry      cli.entry: threading._shutdown() and atexit._run_exitfuncs() (what shutdown does that matters),
                streams flushed, os._exit: the module teardown skipped
     bare_exit  the same without threading._shutdown and atexit._run_exitfuncs (streams flushed, os._exit): what
                the two internals themselves cost
     shutdown   sys.exit: Python's own shutdown (module teardown included)
   timed from the launch to the exit of the child, by the parent.
Variants run alternately --repeat times, so load slows all alike; savings are medians of the paired differences
(each repetition runs every variant), in wall and in the child's CPU seconds. Writes benchmarks/results/internals.json.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

OPTIMIZER = r"""
import sys, time
import torch
from diffrelay import config
from diffrelay.training import eager, optim

variant = sys.argv[1]
if variant in ("eager_step", "neither"):
    eager.settle = lambda *classes: None
if variant in ("settle", "neither"):
    eager.eager_step = lambda opt: False
torch.set_num_threads(1)
t = config.Config(config.validate({})).train
net = torch.nn.Linear(64, 64)
t0 = time.perf_counter()
opt = optim.build_optimizer(net.parameters(), t)
sched = optim.build_schedule(opt, t)
net(torch.randn(8, 64)).square().mean().backward()
opt.step()
sched.step()
opt.zero_grad(set_to_none=True)
opt.load_state_dict(opt.state_dict())
print(time.perf_counter() - t0, "torch._dynamo" in sys.modules)
"""

EXIT = r"""
import sys
import diffrelay.training.train  # noqa: F401 -- the modules a training job has loaded when it ends
from diffrelay import cli

variant = sys.argv[1]
if variant == "shutdown":
    sys.exit(0)
if variant == "bare_exit":
    import atexit, threading
    threading._shutdown = lambda: None
    atexit._run_exitfuncs = lambda: None
cli.main = lambda argv=None: 0  # the stage is done
cli.entry()
"""


def environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPROFILEIMPORTTIME"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def child(code: str, variant: str) -> tuple[float, float, str]:
    """Wall seconds from launch to exit (perf_counter in this process), the child's CPU seconds (user + system,
    which a busy machine disturbs less) and its stdout."""
    cpu, t0 = cpu_of_children(), time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, variant], capture_output=True, text=True, env=environment())
    wall, cpu = time.perf_counter() - t0, cpu_of_children() - cpu
    if p.returncode:
        sys.exit(f"{variant}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return wall, cpu, p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="runs of each variant, alternating [5]")
    ap.add_argument("--out", default=str(HERE / "results" / "internals.json"))
    args = ap.parse_args()
    import torch

    facts = {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
             "platform": platform.platform(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    began = time.perf_counter()

    opt_variants, opt_runs = ("both", "settle", "eager_step", "neither"), {}
    exit_variants, exit_runs = ("entry", "bare_exit", "shutdown"), {}
    for _ in range(args.repeat):
        for v in opt_variants:
            wall, cpu, out = child(OPTIMIZER, v)
            seconds, dynamo = out.split()
            opt_runs.setdefault(v, []).append({"optimizer_s": float(seconds), "wall_s": wall, "cpu_s": cpu,
                                               "imported_dynamo": dynamo == "True"})
        for v in exit_variants:
            wall, cpu, _ = child(EXIT, v)
            exit_runs.setdefault(v, []).append({"wall_s": wall, "cpu_s": cpu})

    def med(runs, key):
        return round(statistics.median(r[key] for r in runs), 3)

    def record(runs, keys):
        return {**{f"median_{k}": med(runs, k) for k in keys}, **{k: [round(x[k], 3) for x in runs] for k in keys}}

    def paired(runs, a, b, key):
        """Median over the repetitions of a's minus b's (each repetition ran both, one after the other)."""
        return round(statistics.median(x[key] - y[key] for x, y in zip(runs[a], runs[b])), 3)

    optimizer = {v: {**record(r, ("optimizer_s", "wall_s", "cpu_s")),
                     "imported_dynamo": sorted({x["imported_dynamo"] for x in r})} for v, r in opt_runs.items()}
    exits = {v: record(r, ("wall_s", "cpu_s")) for v, r in exit_runs.items()}
    saving = {  # paired medians: (without) - (with); positive = the internal saves that much
        "eager.py, settle and eager_step together: optimizer s": paired(opt_runs, "neither", "both", "optimizer_s"),
        "eager.py, settle and eager_step together: process CPU s": paired(opt_runs, "neither", "both", "cpu_s"),
        "eager.settle alone: optimizer s": paired(opt_runs, "neither", "settle", "optimizer_s"),
        "eager.eager_step alone: optimizer s": paired(opt_runs, "neither", "eager_step", "optimizer_s"),
        "cli.entry's exit against Python's shutdown: wall s": paired(exit_runs, "shutdown", "entry", "wall_s"),
        "cli.entry's exit against Python's shutdown: process CPU s": paired(exit_runs, "shutdown", "entry", "cpu_s"),
        "threading._shutdown and atexit._run_exitfuncs themselves (cost): wall s": paired(
            exit_runs, "entry", "bare_exit", "wall_s"),
        "threading._shutdown and atexit._run_exitfuncs themselves (cost): process CPU s": paired(
            exit_runs, "entry", "bare_exit", "cpu_s"),
    }
    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]

    print(f"\n## Optimizer in a fresh process (median of {args.repeat}; s)\n")
    print("| variant | optimizer s (in the child) | process wall s | process CPU s | imports torch._dynamo |")
    print("|---|---:|---:|---:|---|")
    for v, r in optimizer.items():
        print(f"| {v} | {r['median_optimizer_s']:.3f} | {r['median_wall_s']:.2f} | {r['median_cpu_s']:.2f} | "
              f"{r['imported_dynamo']} |")
    print(f"\n## Exit of a process with a training job's modules (median of {args.repeat}; wall s)\n")
    print("| variant | wall s | CPU s | wall s, each run |")
    print("|---|---:|---:|---|")
    for v, r in exits.items():
        print(f"| {v} | {r['median_wall_s']:.3f} | {r['median_cpu_s']:.3f} | "
              f"{', '.join(f'{x:.3f}' for x in r['wall_s'])} |")
    print("\n## Savings (s; median of the paired differences, without minus with)\n")
    for k, v in saving.items():
        print(f"- {k}: {v:+.3f}")
    print(f"\nload average {facts['load_average_at_start']} -> {facts['load_average_at_end']}; "
          f"{time.perf_counter() - began:.0f} s")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "benchmark": "internals", "settings": vars(args), "optimizer": optimizer, "exit": exits, "saving": saving,
        "machine": facts, "finished": time.time()}, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
