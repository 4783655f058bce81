"""train.optimizer: the field's optimizers, each from the library that publishes it, never rewritten here.

The table (CHOICES) is plain data, so a config is checked (check_config) without torch or any of the libraries;
`build` imports the chosen one. What diffrelay sets and what it leaves to the library:
- `train.lr`, `train.betas` (where the class takes betas) and `train.weight_decay` are passed as the class's own
  `lr`, `betas`, `weight_decay`; every other argument is the library's default unless `train.optimizer_args`
  names it (checked against the class's signature, ARGS, which tests/test_optimizers.py compares with the
  installed library). So `adamw8bit` decays by train.weight_decay (0), not by bitsandbytes' 0.01.
- `prodigy` (Mishchenko & Defazio, arXiv:2306.06101) estimates the step size itself: train.lr multiplies it and
  is 1.0 in its authors' README and in kohya's and SimpleTuner's LoRA presets.
- `schedulefree_adamw` (Defazio et al., arXiv:2405.15682) runs its own warm-up (train.warmup_steps is handed to
  it) and wants no schedule; its weights for evaluation, x, differ from the ones it trains, y. diffrelay keeps y in
  the checkpoint (so a resume continues the same sequence) and writes x into snapshots (eval_weights), which
  sampling, scoring and export read. x = lerp(y, z, 1 - 1/beta1) is what the library's own `eval()` computes, here
  into new tensors, so y is never touched and no train/eval round trip (which does not return the same bits)
  happens. x is itself the average of the iterates, so an EMA on top is refused (check_config).
- Optimizer state in a checkpoint is plain tensors: torchao keeps its low-bit moments as tensor subclasses, which
  `plain_state` flattens (their own __tensor_flatten__) and `load_state_dict` rebuilds, so no class of theirs
  is ever unpickled and a checkpoint reads without torchao installed.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    library: str  # the import path of the module that holds the class
    cls: str
    extra: str  # the pip extra that installs it ("" for torch)
    args: tuple  # the class's keyword arguments after params (its __init__'s), as the pinned version has them
    sharded: bool  # trained and resumed bit for bit under train.sharding: fsdp2 (tests/test_sharding.py)
    state: str  # what it keeps a trainable parameter, for `validate`

    def takes(self, name: str) -> bool:
        return name in self.args


_BNB8 = ("lr", "betas", "eps", "weight_decay", "amsgrad", "optim_bits", "args", "min_8bit_size", "is_paged")
_AO = ("lr", "betas", "eps", "weight_decay", "amsgrad", "block_size", "bf16_stochastic_round")
CHOICES = {
    "adam": Choice("torch.optim", "Adam", "", (), True, "2 moments in the parameter's dtype"),
    "adamw": Choice("torch.optim", "AdamW", "", (), True, "2 moments in the parameter's dtype"),
    "adamw8bit": Choice("bitsandbytes.optim", "AdamW8bit", "optimizers", _BNB8, False,
                        "2 moments of 8 bits, an fp32 scale a block of 256"),
    "paged_adamw8bit": Choice("bitsandbytes.optim", "PagedAdamW8bit", "optimizers", _BNB8[:-1], False,
                              "2 moments of 8 bits in paged memory (moved to the host when the GPU is full)"),
    "lion8bit": Choice("bitsandbytes.optim", "Lion8bit", "optimizers",
                       ("lr", "betas", "weight_decay", "args", "min_8bit_size", "is_paged"), False,
                       "1 moment of 8 bits, an fp32 scale a block of 256"),
    "ao_adamw8bit": Choice("torchao.optim", "AdamW8bit", "optimizers", _AO, False,
                           "2 moments of 8 bits, an fp32 scale a block of 256"),
    "ao_adamw4bit": Choice("torchao.optim", "AdamW4bit", "optimizers", _AO, False,
                           "2 moments of 4 bits, an fp32 scale a block of 128"),
    "ao_adamw_fp8": Choice("torchao.optim", "AdamWFp8", "optimizers", _AO, False,
                           "2 moments in fp8 (e4m3), an fp32 scale a block of 256"),
    "prodigy": Choice("prodigyopt", "Prodigy", "optimizers",
                      ("lr", "betas", "beta3", "eps", "weight_decay", "decouple", "use_bias_correction",
                       "safeguard_warmup", "d0", "d_coef", "growth_rate", "fsdp_in_use", "slice_p"), False,
                      "2 moments, the initial weights and the step-size sum s (these two 1/slice_p of them)"),
    # torch's own (2.5+), not transformers': no extra dependency, torch's checkpoint and foreach conventions, and
    # the same factored second moment (Shazeer & Stern, arXiv:1804.04235) with no first moment.
    "adafactor": Choice("torch.optim", "Adafactor", "", ("lr", "beta2_decay", "eps", "d", "weight_decay", "foreach",
                                                         "maximize"), False,
                        "a factored second moment: a row and a column vector a matrix, the whole for a vector"),
    "schedulefree_adamw": Choice("schedulefree", "AdamWScheduleFree", "optimizers",
                                 ("lr", "betas", "eps", "weight_decay", "warmup_steps", "r", "weight_lr_power",
                                  "foreach"), False, "the averaged sequence z and the second moment"),
}
TORCH_ADAM = ("adam", "adamw")  # torch's Adam(W): train.fused_optimizer's kernels, the default's bits
# Set by diffrelay from train.* (or by the run's sharding): not an optimizer_args key.
SET_HERE = {"lr": "train.lr", "betas": "train.betas", "weight_decay": "train.weight_decay",
            "warmup_steps": "train.warmup_steps", "fsdp_in_use": "train.sharding"}


def check_config(d: dict) -> list[tuple[str, str]]:
    """(key, message) pairs for train.optimizer and train.optimizer_args that cannot work (no torch)."""
    t, bad = d["train"], []
    name, args = t["optimizer"], t.get("optimizer_args") or {}
    choice = CHOICES[name]  # the schema's enum holds CHOICES' names (tests/test_optimizers.py)
    for key in args:
        if key in SET_HERE and (choice.takes(key) or name in TORCH_ADAM):
            bad.append((f"train.optimizer_args.{key}", f"is set from {SET_HERE[key]}; set that instead"))
        elif name in TORCH_ADAM:
            bad.append((f"train.optimizer_args.{key}", f"train.optimizer {name} takes no optimizer_args (its options "
                        "are train.lr, betas, weight_decay and fused_optimizer); drop the key"))
        elif not choice.takes(key):
            ok = ", ".join(a for a in choice.args if a not in SET_HERE)
            bad.append((f"train.optimizer_args.{key}", f"not an argument of {choice.library}.{choice.cls}; it "
                        f"takes {ok}"))
    if t["fused_optimizer"] is True and name not in TORCH_ADAM:
        bad.append(("train.fused_optimizer=true", f"fuses torch's Adam and AdamW only, and train.optimizer is {name}; "
                    "set train.fused_optimizer: auto"))
    if t["sharding"] == "fsdp2" and not choice.sharded:
        ok = ", ".join(n for n, c in CHOICES.items() if c.sharded)
        bad.append((f"train.optimizer={name}", f"is not verified to resume bit for bit under train.sharding: fsdp2 "
                    f"(its state is not sharded with the parameters); use {ok}, or train.sharding: ddp"))
    if name == "schedulefree_adamw":
        bad += _check_schedule_free(t)
    if t.get("fused_backward"):
        bad += _check_fused_backward(t)
    return bad


def _check_fused_backward(t: dict) -> list[tuple[str, str]]:
    """What needs every gradient before any parameter steps (fused_backward.py)."""
    why = "steps each parameter during the backward pass, before the other gradients exist"
    checks = [
        (t["grad_accum"] > 1, f"train.grad_accum={t['grad_accum']}", "set train.grad_accum: 1 (or fused_backward: false)"),
        (t["grad_clip"] > 0, f"train.grad_clip={t['grad_clip']}", "set train.grad_clip: 0: the global norm is not "
         "known yet (or fused_backward: false)"),
        (t["precision"] == "fp16", "train.precision=fp16", "set train.precision: bf16 (fp16's loss scale is checked "
         "over all gradients first)"),
        (t["nproc_per_node"] * t["nnodes"] > 1, f"train.nproc_per_node={t['nproc_per_node']}",
         "train on one process (DDP all-reduces gradients after the step would have run)"),
        (t["sharding"] != "ddp", f"train.sharding={t['sharding']}", "set train.sharding: ddp on one process"),
        (t["compile"], "train.compile=true", "set train.compile: false (not verified with the hooks)"),
        (t["optimizer"] in ("prodigy", "schedulefree_adamw"), f"train.optimizer={t['optimizer']}",
         "couples the parameters (one step size or average for all); pick another optimizer"),
    ]
    return [(key, f"with train.fused_backward, which {why}: {fix}") for bad, key, fix in checks if bad]


def _check_schedule_free(t: dict) -> list[tuple[str, str]]:
    why = "schedule-free AdamW's evaluation weights are already an average of its iterates (snapshots hold them)"
    bad = []
    if t["ema_decays"] or t["ema_halflife_kimg"] is not None:
        bad.append(("train.ema_decays", f"{why}; set train.ema_decays: [] and no ema_halflife_kimg"))
    if t["phema"]["every"]:
        bad.append(("train.phema.every", f"{why}; set train.phema.every: 0"))
    if t["lr_schedule"] != "constant" or t["warmup_kimg"] is not None:
        bad.append((f"train.lr_schedule={t['lr_schedule']}", "schedule-free AdamW replaces the schedule and warms up "
                    "over train.warmup_steps itself; set train.lr_schedule: constant and no warmup_kimg"))
    return bad


def kwargs(t, choice: Choice) -> dict:
    """The class's keyword arguments: train.lr, betas and weight_decay where it takes them, then optimizer_args."""
    out = {"lr": t.lr}
    if choice.cls in ("Adam", "AdamW"):  # as optim.build_optimizer builds them (its foreach=False: a fixed order)
        return out | {"betas": tuple(t.betas), "weight_decay": t.weight_decay, "foreach": False}
    if choice.takes("betas"):
        out["betas"] = tuple(t.betas)
    if choice.takes("weight_decay"):
        out["weight_decay"] = t.weight_decay
    if choice.takes("warmup_steps"):
        out["warmup_steps"] = t.warmup_steps
    if choice.cls == "Adafactor":
        out["foreach"] = False  # a fixed update order, as for Adam (optim.build_optimizer)
    args = getattr(t, "optimizer_args", None)  # a Config section (or a plain dict)
    return out | (args.to_dict() if hasattr(args, "to_dict") else dict(args or {}))


def optimizer_class(name: str):
    """The class of train.optimizer `name`, imported; one line naming the extra when its library is missing."""
    import importlib

    from diffrelay.errors import UserError

    choice = CHOICES[name]
    try:
        module = importlib.import_module(choice.library)
    except ImportError as e:
        raise UserError(f"train.optimizer={name}: needs {choice.library.split('.')[0]}, which is not installed "
                        f"({e}); pip install 'diffrelay[{choice.extra}]'") from None
    return getattr(module, choice.cls)


def build(params, t):
    """The optimizer of train.optimizer (not torch's Adam(W): optim.build_optimizer builds those)."""
    opt = optimizer_class(t.optimizer)(params, **kwargs(t, CHOICES[t.optimizer]))
    if t.optimizer == "schedulefree_adamw":
        opt.train()  # y in the parameters; step refuses to run in eval mode
    return opt


def schedule_is_the_optimizers(t) -> bool:
    """The LR schedule is the optimizer's own (schedule-free): diffrelay's warm-up then must not apply too."""
    return t.optimizer == "schedulefree_adamw"


def has_eval_weights(name: str) -> bool:
    """Snapshots of this optimizer's runs hold weights other than the trained ones (eval_weights)."""
    return name == "schedulefree_adamw"


def eval_weights(opt, named: dict) -> dict:
    """{name: tensor} of a state dict with the schedule-free optimizer's evaluation weights x in place of the
    trained y (its eval(), out of place); other optimizers' weights are the trained ones, returned as they are."""
    import torch

    if type(opt).__name__ != "AdamWScheduleFree":
        return named
    x = {}
    for group in opt.param_groups:
        beta1 = group["betas"][0]
        for p in group["params"]:
            z = opt.state.get(p, {}).get("z")
            if z is not None:  # before its first step z is y: x is y
                x[id(p)] = torch.lerp(p.detach(), z.to(p.device), 1 - 1 / beta1)
    return {k: x.get(id(v), v) for k, v in named.items()}


# ---- checkpoint form: plain tensors only ---------------------------------------------------------------------
# torchao's low-bit states: the classes a checkpoint may name (their module and class), rebuilt by their own
# __tensor_unflatten__.
SUBCLASSES = {"torchao.optim.subclass_8bit.OptimState8bit", "torchao.optim.subclass_4bit.OptimState4bit",
              "torchao.optim.subclass_fp8.OptimStateFp8"}
_MARK = "__tensor_subclass__"


def plain_state(sd: dict) -> dict:
    """An optimizer state dict with every tensor subclass replaced by {_MARK: class, "tensors", "attrs", "shape",
    "stride"}: torch.load(weights_only=True) reads it with no class allowed."""
    def flat(v):
        if not hasattr(type(v), "__tensor_flatten__") or type(v).__name__ == "Tensor":
            return v
        names, attrs = v.__tensor_flatten__()
        return {_MARK: f"{type(v).__module__}.{type(v).__name__}", "tensors": {n: getattr(v, n) for n in names},
                "attrs": list(attrs), "shape": list(v.shape), "stride": list(v.stride())}

    return {**sd, "state": {k: {n: flat(v) for n, v in per.items()} for k, per in sd["state"].items()}}


def rebuilt_state(sd: dict) -> dict:
    """plain_state's inverse: each marked entry rebuilt as its class (one of SUBCLASSES)."""
    import importlib

    def rebuild(v):
        if not (isinstance(v, dict) and _MARK in v):
            return v
        if v[_MARK] not in SUBCLASSES:
            raise ValueError(f"optimizer state names {v[_MARK]}, not one of {sorted(SUBCLASSES)}")
        module, _, name = v[_MARK].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls.__tensor_unflatten__(v["tensors"], tuple(v["attrs"]), tuple(v["shape"]), tuple(v["stride"]))

    return {**sd, "state": {k: {n: rebuild(v) for n, v in per.items()} for k, per in sd["state"].items()}}


def state_bytes(name: str, n: dict, args: dict | None = None) -> int:
    """Bytes the optimizer keeps for `n` (footprint.counts: trainable elements, their element size, the factored
    elements, those in tensors too small to quantize) besides the weights and gradients; block scales included,
    the scalars and the libraries' 256-entry code tables not. An upper bound for prodigy, which keeps a scalar for
    the initial weights of a tensor that starts at zero (a LoRA adapter's B). The low-bit optimizers keep a tensor of fewer than
    4096 elements at full width (bitsandbytes' min_8bit_size; torchao's _new_buffer, which also needs a multiple of
    its block size): a LoRA adapter's rank x width matrices often are that small."""
    args, trainable, size = args or {}, n["trainable"], n["bytes_per_param"]
    small = min(n.get("small", 0), trainable)
    big = trainable - small
    if name in ("adam", "adamw", "schedulefree_adamw"):
        return 2 * trainable * size
    if name in ("adamw8bit", "paged_adamw8bit", "ao_adamw8bit", "ao_adamw_fp8"):
        return int(2 * big * (1 + 4 / args.get("block_size", 256)) + 2 * small * size)
    if name == "lion8bit":
        return int(big * (1 + 4 / 256) + small * size)
    if name == "ao_adamw4bit":
        return int(2 * big * (0.5 + 4 / args.get("block_size", 128)) + 2 * small * size)
    if name == "prodigy":
        return int(trainable * size * (2 + 2 / args.get("slice_p", 1)))
    if name == "adafactor":
        return n["factored"] * size
    raise KeyError(name)
