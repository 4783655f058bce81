"""An optimizer that does not import torch._dynamo, for a training process that compiles nothing.

torch 2.14's optimizers import torch._dynamo on their first use only to keep torch.compile out of them:
- `add_param_group`, `zero_grad`, `state_dict`, `load_state_dict` are wrapped in `torch._disable_dynamo`
  (torch/_compile.py), whose first call imports torch._dynamo and caches `torch._dynamo.disable(fn)` on the
  function as `__dynamo_disable`;
- `step` is wrapped in `_use_grad_for_differentiable` (torch/optim/optimizer.py), which imports torch._dynamo
  on every call to place graph breaks around the update, and sets grad mode to the `differentiable` default.
In a process that compiles nothing these do nothing but the import. `settle` gives each such wrapper its
cached result already (the function itself, as nets/cost.py does for FLOP counting); `eager_step` replaces the
instance's `step` with the same chain minus the graph breaks: torch's own `profile_hook_step` (hooks and the
profiler's label) around the same grad-mode switch. The update itself is torch's, so the weights are the same
bits. Where torch lays this out otherwise, nothing matches, nothing is changed and the import happens.

What it saves: benchmarks/bench_internals.py (results/internals.json) builds AdamW with its schedule, steps once,
and saves and loads its state, in a fresh process. With settle and eager_step that takes 0.008 s, without them
3.1 s, 1.8 s more CPU per process (median of 7 paired runs on a shared 2-core machine at load average 5-10, which
inflates the wall figures; 1.35 s of a training job on an idle one, docs/benchmarks.md#start-up). Each alone saves
0.4-0.6 s of it: the other's wrapper still imports torch._dynamo. tests/test_internals.py fails, naming the
attribute, where a torch renames `_disable_dynamo` or `_use_grad_for_differentiable` or changes what this relies on.
"""

import functools
import types

import torch
from torch import _compile
from torch.optim import optimizer as torch_optimizer

# torch's two wrappers and the code object all wrappers of each share; None in a torch without them (then nothing
# matches and nothing is changed; tests/test_internals.py fails).
_disable_dynamo = getattr(_compile, "_disable_dynamo", None)
_use_grad_for_differentiable = getattr(torch_optimizer, "_use_grad_for_differentiable", None)
_DISABLED = None if _disable_dynamo is None else _disable_dynamo(lambda: None).__code__
_USE_GRAD = None if _use_grad_for_differentiable is None else _use_grad_for_differentiable(lambda self: None).__code__


def settle(*classes: type) -> None:
    """Let the methods of `classes` (an optimizer's, its LR scheduler's) and of their bases run without
    importing torch._dynamo. Before the optimizer is built: its constructor calls `add_param_group`."""
    if _DISABLED is None:
        return
    for cls in classes:
        for klass in cls.__mro__:
            for fn in vars(klass).values():
                raw = getattr(fn, "__wrapped__", None)
                if getattr(fn, "__code__", None) is _DISABLED and raw is not None \
                        and not hasattr(raw, "__dynamo_disable"):
                    setattr(raw, "__dynamo_disable", raw)


def eager_step(opt: torch.optim.Optimizer) -> bool:
    """Give `opt` a `step` without the graph breaks (after it is built). True if it was replaced."""
    hooked = type(opt).step  # profile_hook_step(_use_grad(step)) once an instance exists
    use_grad = getattr(hooked, "__wrapped__", None)
    raw = getattr(use_grad, "__wrapped__", None)
    if _USE_GRAD is None or not getattr(hooked, "hooked", False) or getattr(use_grad, "__code__", None) is not _USE_GRAD \
            or raw is None:
        return False

    @functools.wraps(raw)
    def step(self, *args, **kwargs):
        before = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return raw(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(before)

    opt.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(step), opt)
    return True
