"""Training memory, said before it is spent (`diffrelay validate`): what one training process holds on its GPU.

The training state, from the network's own tensors, in the dtypes diffrelay's training keeps them
(training/state.py, optim.py, phema.py): the network is built and trained in fp32 (bf16/fp16 are autocast, which
casts per op and keeps fp32 master weights), so
- weights: every parameter and buffer, fp32 (4 bytes a parameter);
- gradients: one per trainable parameter, in its dtype (fp32, 4 bytes);
- optimizer: Adam and AdamW keep two moments (exp_avg, exp_avg_sq) per trainable parameter, zeros_like the
  parameter (fp32, 8 bytes), and a scalar step; the other train.optimizer choices what training.optimizers.state_bytes
  says (8-bit moments with block scales, factored ones);
- EMA: each EMA of train.ema_decays (or the one of ema_halflife_kimg) and each post-hoc EMA profile
  (train.phema, when on) is a deep copy of the network's trainable parameters and buffers (fp32); the frozen
  parameters are shared with the network (training.optim.EMA).
So a network of N fp32 parameters, all trained, needs 16 N bytes before EMAs and activations (the issue's 42 GB of
full-SDXL fine-tuning: 2.6e9 x 16), plus 4 N per EMA. `trainable` takes a smaller count (a LoRA adapter's).

The activations: the bytes of the tensors autograd saves for the backward pass in one forward of the training
loss (saved_tensors_hooks; each storage counted once, the network's own parameters and buffers not, as they are
counted above), measured, not assumed. The network is built on the meta device and moved to fake CPU tensors
(torch's FakeTensorMode: shapes, dtypes and storages, no memory, no arithmetic), so torch.autocast("cpu") applies
its casts as on real tensors (the meta device has no autocast) and attention takes the CPU's fused kernel, which
saves what the GPU's flash kernel saves (no L x L matrix). Measured at batch 1 and 2 and extrapolated linearly
to the per-process micro-batch: under autocast the bf16 copies of the weights are saved once whatever the batch,
so scaling one measurement would multiply them too. A network that does not run on fake tensors is measured on
the real CPU when small, else its activations are "not measured".

Not counted: the CUDA context and the caching allocator's slack (often 1-2 GiB), the backward pass's temporary
tensors, text encoders kept for data.text_cache: false. CUDA's autocast keeps a few more ops in fp32 than the
CPU's (normalisation, softmax, exp: torch.amp's op lists), so a bf16 figure can be somewhat low for a network
full of them. Imports the base modules only (errors); nets.registry builds on a device.
"""

from dataclasses import dataclass

import torch
from torch import nn


GIB = 2**30
# A network that does not run on fake tensors is measured on the real CPU only below this many parameters
# (as nets.cost does for FLOPs), so that `diffrelay validate` never spends minutes or gigabytes on it.
CPU_MAX_PARAMS = 50_000_000


def state_bytes(params: int, trainable: int | None = None, optimizer_bytes: int | None = None, emas: int = 1,
                bytes_per_param: int = 4, buffer_bytes: int = 0) -> dict[str, int]:
    """Bytes of the training state of a network of `params` parameters (`bytes_per_param` each, fp32: 4) and
    `buffer_bytes` of buffers, of which `trainable` (default: all) get a gradient and the optimizer's state
    (`optimizer_bytes`, training.optimizers.state_bytes; default Adam's two moments in the parameters' dtype), with
    `emas` EMA copies of the trainable parameters and the buffers (a copy shares the frozen ones: training.optim.EMA)."""
    trainable = params if trainable is None else trainable
    weights = params * bytes_per_param + buffer_bytes
    return {"weights": weights, "gradients": trainable * bytes_per_param,
            "optimizer": 2 * trainable * bytes_per_param if optimizer_bytes is None else optimizer_bytes,
            "ema": emas * (trainable * bytes_per_param + buffer_bytes)}


def counts(net: nn.Module) -> dict[str, int]:
    """{"params", "trainable", "bytes_per_param", "buffer_bytes"} of a built network (meta works: no data read).
    nn.Module.parameters() yields a tied parameter once, as the optimizer and the EMA's deep copy hold it."""
    params = list(net.parameters())
    return {"params": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "bytes_per_param": max((p.element_size() for p in params), default=4),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in net.buffers()),
            # Adafactor's factored second moment (torch.optim.Adafactor): a matrix's rows and columns (its last two
            # dimensions), a vector whole
            "factored": sum(p.numel() // p.shape[-1] + p.numel() // p.shape[-2] if p.dim() >= 2 else p.numel()
                            for p in params if p.requires_grad),
            # trainable elements in tensors below 4096 elements, whose moments the 8-bit and 4-bit optimizers keep
            # at full width (bitsandbytes' min_8bit_size, torchao's minimum: training.optimizers.state_bytes)
            "small": sum(p.numel() for p in params if p.requires_grad and p.numel() < 4096),
            # the one gradient train.fused_backward holds at a time (it frees each once it stepped)
            "largest": max((p.numel() for p in params if p.requires_grad), default=0)}


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata  # the StorageImpl: one per storage, shared by its views


def saved_bytes(net: nn.Module, run) -> int:
    """Bytes of the storages autograd saves for the backward pass while run() computes a loss, each storage once,
    the network's own parameters and buffers not. The saved tensors stay alive until the count is taken, so no
    storage is freed and reused in between."""
    own = {_storage_key(t) for t in (*net.parameters(), *net.buffers())}
    saved = {}

    def pack(t):
        key = _storage_key(t)
        if key not in own:
            saved[key] = t.untyped_storage()  # kept: its key cannot be reused while the count runs
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(net)
    total = sum(s.nbytes() for s in saved.values())
    del loss  # the graph, and with it every saved tensor, lived until the count was taken
    return total


def _fake_cpu():
    """A context in which torch makes fake CPU tensors (storage sizes without memory) and the context's mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def activation_bytes(build, run, batch: int, amp_dtype=None, cpu: bool = True,
                     cpu_first: bool = False) -> tuple[int | None, str]:
    """(bytes the backward pass keeps for one micro-batch of `batch` images, how it was measured), or (None,
    why not). build() makes the network (on torch's default device; it is called under the meta device);
    run(net, n) computes the training loss of n images on torch's default device. Measured at batch 1 and 2 on
    fake CPU tensors under torch.autocast("cpu", amp_dtype) (None: fp32), then at fixed + per-image x batch;
    on the real CPU when the fake pass fails and `cpu` allows it (a small network). `cpu_first`: a network small
    enough that the real pass is the cheaper one: FakeTensorMode's constructor imports torch._dynamo (0.6 s of
    `diffrelay validate`), the CPU's pass of a small network takes milliseconds."""
    from diffrelay.nets.registry import on_device

    def measure(n, net):
        with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            return saved_bytes(net, lambda m: run(m, n))

    def on_fake():
        with on_device("meta"):
            net = build()
        with _fake_cpu():
            net = net.to("cpu").train()  # meta -> fake CPU: autocast and the CPU's kernels apply
            with torch.device("cpu"):
                return measure(1, net), measure(2, net)

    def on_cpu():
        with on_device("cpu"):
            net = build().train()
            return measure(1, net), measure(2, net)

    ways = [("fake tensors", on_fake)] + ([("the CPU", on_cpu)] if cpu or cpu_first else [])
    errors = []
    for how, way in reversed(ways) if cpu_first else ways:
        try:
            one, two = way()
            break
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- any failure (often user code): the other way
            errors.append(f"on {how}: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
    else:
        if not cpu:
            errors.append("too large for the CPU")
        return None, "not measured (" + "; ".join(errors) + ")"
    per_image = max(two - one, 0)
    return one + per_image * (batch - 1), f"measured on {how} at batch 1 and 2, scaled to {batch}"


def gpu_memory(device: str, gpus, override_gib: float | None = None) -> tuple[int | None, str]:
    """(bytes of the smallest GPU training would use, its description), or (None, why there is none): the
    --gpu-memory-gib override; none for run.device cpu; else the GPUs of run.gpus (a list of ids, or auto/None:
    every visible GPU) as torch.cuda reports them."""
    if override_gib is not None:
        return int(override_gib * GIB), f"the {override_gib:g} GiB given by --gpu-memory-gib"
    if device == "cpu":
        return None, "run.device is cpu: no GPU to compare with"
    if not torch.cuda.is_available():
        return None, "no GPU found to compare with (--gpu-memory-gib N compares with N GiB)"
    visible = range(torch.cuda.device_count())
    ids = [i for i in gpus if i in visible] if isinstance(gpus, list) else list(visible)
    if not ids:
        return None, f"run.gpus {gpus}: none of them is visible here ({len(visible)} GPU(s)): no GPU to compare with"
    props = min((torch.cuda.get_device_properties(i) for i in ids), key=lambda p: p.total_memory)
    return props.total_memory, f"the {props.total_memory / GIB:.1f} GiB of {props.name}"


@dataclass(frozen=True)
class Estimate:
    """One training process's memory: the training state's parts and the activations (None: not measured)."""

    state: dict
    activations: int | None
    how: str

    @property
    def total(self) -> int:
        return sum(self.state.values()) + (self.activations or 0)


def gib(n: int) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / 2**20:.3g} MiB"


def lines(est: Estimate, n: dict, emas: int, optimizer: str, setting: str, capacity: int | None,
          against: str, fixes: str = "lower train.batch_size or raise train.grad_accum",
          state_words: str | None = None) -> tuple[list[str], str | None]:
    """(the YAML comment lines of the estimate, the warning line or None). `n`: counts(); `setting`: the run's
    precision, micro-batch and checkpointing in words; capacity/against: gpu_memory(); `fixes`: what the warning
    suggests."""
    s, dtype = est.state, {4: "fp32", 2: "16-bit"}.get(n["bytes_per_param"], f"{n['bytes_per_param']}-byte")
    out = [f"# memory: training state {gib(sum(s.values()))} a process: weights {gib(s['weights'])} "
           f"({n['params']:,} parameters, {dtype}, and buffers), gradients {gib(s['gradients'])} "
           f"({n['trainable']:,} trainable, {dtype}), {optimizer} state {gib(s['optimizer'])} "
           f"({state_words or f'2 moments, {dtype}'}), EMA {gib(s['ema'])} ({emas} {dtype} cop{'y' if emas == 1 else 'ies'})",
           f"# memory: activations "
           f"{gib(est.activations) if est.activations is not None else 'not measured'} saved for the backward "
           f"pass, {setting}; {est.how}"]
    total = f"{gib(est.total)}{'' if est.activations is not None else ' without activations'}"
    if capacity is None:
        out.append(f"# memory: total {total} a process; {against}")
        return out, None
    fits = est.total <= capacity
    out.append(f"# memory: total {total} a process; {'fits' if fits else 'EXCEEDS'} {against}")
    if fits:
        return out, None
    return out, f"training needs about {total} a process, more than {against}; {fixes} (the # memory lines above)"
