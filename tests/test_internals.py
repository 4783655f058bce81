"""The private names of torch and Python that diffrelay uses to save start-up time, kept where
benchmarks/bench_internals.py (results/internals.json) shows what each saves. A torch or Python that renames one,
or changes what the code relies on, fails here with the name and where it is used: the code itself then quietly
takes the public path (slower, the same results), so without this test nobody would notice."""

import atexit
import subprocess
import sys
import threading

import torch
from torch import _compile
from torch.optim import optimizer as torch_optimizer

from conftest import REPO
from diffrelay.training import eager

# Where each is used, and what it saves (benchmarks/results/internals.json).
EAGER = "training/eager.py (an optimizer that does not import torch._dynamo: 1.8 s of CPU per training process)"
EXIT = "cli.py entry (the quick exit that skips the module teardown: 0.7 s of CPU per process)"


def test_torchs_disable_dynamo_wrapper_still_calls_the_result_eager_settle_caches():
    name = f"torch._compile._disable_dynamo (torch {torch.__version__})"
    wrap = getattr(_compile, "_disable_dynamo", None)
    assert callable(wrap), f"{name} is gone: {EAGER} and nets/cost.py's FLOP count now import torch._dynamo"
    calls = []

    def raw(x):
        calls.append(("raw", x))
        return x

    wrapper = wrap(raw)
    assert getattr(wrapper, "__wrapped__", None) is raw and wrapper.__code__ is eager._DISABLED, \
        f"{name} no longer returns a functools.wraps wrapper sharing one code object: {EAGER} matches nothing"
    setattr(raw, "__dynamo_disable", lambda x: calls.append(("cached", x)) or x)
    assert wrapper(3) == 3 and calls == [("cached", 3)], \
        f"{name}'s wrapper no longer calls the function's cached __dynamo_disable (it would import torch._dynamo): {EAGER}"
    # settle finds them on the optimizer: the methods its constructor, zero_grad and the checkpoint call.
    methods = {k for k, fn in vars(torch.optim.Optimizer).items() if getattr(fn, "__code__", None) is eager._DISABLED}
    assert {"add_param_group", "zero_grad", "state_dict", "load_state_dict"} <= methods, \
        f"torch.optim.Optimizer's methods are no longer wrapped in {name} as {EAGER} expects: {sorted(methods)}"


def test_torchs_use_grad_for_differentiable_still_wraps_the_optimizer_step_eager_step_replaces():
    name = f"torch.optim.optimizer._use_grad_for_differentiable (torch {torch.__version__})"
    assert callable(getattr(torch_optimizer, "_use_grad_for_differentiable", None)), f"{name} is gone: {EAGER}"
    assert eager._USE_GRAD is not None
    eager.settle(torch.optim.AdamW)  # as optim.build_optimizer does: its constructor imports no torch._dynamo
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), foreach=False)
    hooked = type(opt).step  # Optimizer.profile_hook_step(_use_grad_for_differentiable(step))
    assert getattr(hooked, "hooked", False) and getattr(hooked.__wrapped__, "__code__", None) is eager._USE_GRAD, \
        f"torch.optim.AdamW.step is no longer profile_hook_step({name}(step)): {EAGER} leaves torch's step"
    assert eager.eager_step(opt) and "step" in vars(opt), f"{EAGER}: eager_step matched nothing ({name})"


# A non-daemon thread, a concurrent.futures pool nobody shut down and an atexit handler: entry's quick exit
# finishes each, in Python's order, and keeps main()'s exit status.
QUICK_EXIT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from diffrelay import cli
threading.Thread(target=lambda: (time.sleep(0.1), print("thread joined", flush=True))).start()
ThreadPoolExecutor(1).submit(lambda: (time.sleep(0.2), print("pool finished", flush=True)))
atexit.register(lambda: print("atexit ran", flush=True))
cli.main = lambda argv=None: 3
cli.entry()
print("not reached")
"""


def test_pythons_shutdown_internals_still_do_what_cli_entry_runs_them_for():
    for module, attr in ((threading, "_shutdown"), (atexit, "_run_exitfuncs")):
        assert callable(getattr(module, attr, None)), \
            f"{module.__name__}.{attr} is gone in Python {sys.version.split()[0]}: {EXIT} now takes Python's own shutdown"
    p = subprocess.run([sys.executable, "-c", QUICK_EXIT], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 3 and p.stdout.splitlines() == ["thread joined", "pool finished", "atexit ran"], \
        f"threading._shutdown or atexit._run_exitfuncs (Python {sys.version.split()[0]}) no longer does what {EXIT} " \
        f"relies on:\n{p.stdout}{p.stderr}"
