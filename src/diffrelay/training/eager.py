"""An optimizer that does not import torch._dynamo, for a training process that compiles nothing.

torch 2.14's optimizers import torch._dynamo on their first use (1.35 s of every training job here,
docs/benchmarks.md#start-up) only to keep torch.compile out of them:
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
"""

import functools
import types

import torch
from torch import _compile
from torch.optim import optimizer as torch_optimizer

_DISABLED = _compile._disable_dynamo(lambda: None).__code__  # the code of every such wrapper
_USE_GRAD = torch_optimizer._use_grad_for_differentiable(lambda self: None).__code__


def settle(*classes: type) -> None:
    """Let the methods of `classes` (an optimizer's, its LR scheduler's) and of their bases run without
    importing torch._dynamo. Before the optimizer is built: its constructor calls `add_param_group`."""
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
    if not getattr(hooked, "hooked", False) or getattr(use_grad, "__code__", None) is not _USE_GRAD \
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
