"""train.fused_backward: each parameter steps as soon as its gradient is accumulated, and its gradient is freed
then, so no whole set of gradients is ever held (PyTorch's "optimizer step in backward" recipe:
Tensor.register_post_accumulate_grad_hook with one optimizer a parameter; sd-scripts' --fused_backward_pass,
diffusion-pipe's gradient_release).

PerParameter is what the rest of training sees as the optimizer: one param group (train.lr's schedule moves its lr,
which each parameter's optimizer takes before it steps), a `step` that does nothing (the hooks stepped), and a state
dict in the very format of one optimizer over all the parameters, so a checkpoint resumes with or without the switch.
Each parameter's optimizer is train.optimizer's own (optim.build_optimizer over [p]); per-parameter arithmetic is
what the unfused loop does (torch's foreach=False, bitsandbytes', torchao's and Adafactor's updates are each a
parameter's alone), so the weights are the same bits (tests/test_optimizers.py). What needs every gradient first is
refused when the config is read (optimizers.check_fused_backward): accumulation, clipping by the global norm, fp16's
loss scale, more than one process (DDP reduces gradients after these hooks run), sharding, compile, and the
optimizers that couple parameters (Prodigy's step-size estimate, schedule-free's evaluation weights).
"""

import torch


class PerParameter(torch.optim.Optimizer):
    def __init__(self, params, make):
        """`make([p])`: the optimizer of one parameter. Hooks are registered on each parameter here."""
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = [make([p]) for p in self.params]
        defaults = {k: v for k, v in self.optimizers[0].param_groups[0].items() if k != "params"}
        super().__init__(self.params, defaults)
        self.norms = {}  # {parameter index: its gradient's norm} of this step, for clip_grad_norm_'s total (the log)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i, opt)) for i, (p, opt) in
                        enumerate(zip(self.params, self.optimizers, strict=True))]

    def _hook(self, i: int, opt):
        def step(p):
            self.norms[i] = torch.linalg.vector_norm(p.grad.detach())
            _set_lr(opt.param_groups[0], self.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def grad_norm(self) -> torch.Tensor:
        """The norm of this step's gradients, as torch.nn.utils.clip_grad_norm_ computes it (a norm of norms)."""
        norms, self.norms = self.norms, {}
        if not norms:
            return torch.zeros((), device=self.params[0].device)
        # in the parameters' order, as clip_grad_norm_ stacks them (the hooks ran in the backward pass's order)
        return torch.linalg.vector_norm(torch.stack([norms[i] for i in sorted(norms)]))

    def step(self, closure=None):  # every parameter stepped in the backward pass
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        """One optimizer's state dict over all the parameters: state i is parameter i's, one group."""
        for opt in self.optimizers:
            _set_lr(opt.param_groups[0], self.param_groups[0]["lr"])
        states = [opt.state_dict() for opt in self.optimizers]
        group = dict(states[0]["param_groups"][0], params=list(range(len(states))))
        group.update({k: v for k, v in self.param_groups[0].items() if k in ("lr", "initial_lr")})
        if isinstance(states[0]["param_groups"][0]["lr"], torch.Tensor):  # torchao keeps it as a tensor
            group["lr"] = torch.tensor(float(group["lr"]))
        return {"state": {i: sd["state"][0] for i, sd in enumerate(states) if 0 in sd["state"]},
                "param_groups": [group]}

    def load_state_dict(self, state: dict) -> None:
        from diffrelay.training import optim

        (group,) = state["param_groups"]
        if len(group["params"]) != len(self.optimizers):
            raise ValueError(f"optimizer state of {len(group['params'])} parameters, this run trains "
                             f"{len(self.optimizers)}")
        self.param_groups[0].update({k: float(v) if isinstance(v, torch.Tensor) else v for k, v in group.items()
                                     if k in ("lr", "initial_lr")})
        for i, opt in enumerate(self.optimizers):
            one = {"state": {0: state["state"][i]} if i in state["state"] else {},
                   "param_groups": [dict(group, params=[0])]}
            optim.load_optimizer_state(opt, one)


def _set_lr(group: dict, lr) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(float(lr))
    else:
        group["lr"] = float(lr)
