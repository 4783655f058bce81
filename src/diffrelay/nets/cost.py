"""What a network costs: FLOPs of one forward pass and of one training step per image, counted by torch's
FlopCounterMode (on the meta device: no memory, no weights), and the GPU hours these imply.

What is counted. FlopCounterMode counts matrix multiplications and convolutions (attention included) at 2 FLOPs
per multiply-add; elementwise ops (activations, normalisation, additions, the objectives' preconditioning) are
not counted. The papers count multiply-adds: DiT's "Gflops" (118.6 for DiT-XL/2 at 32x32x4) are multiply-adds
(= our FLOPs / 2, see macs), and edm2's count_flops.py counts a matmul as out x in, also multiply-adds, plus
elementwise ops. So compare a paper's number with macs(), not with the FLOPs here.

The training step is measured, not assumed to be 3x the forward pass: forward and backward of the network on
one image, under the same counter (the first layer needs no input gradient, and activation checkpointing
recomputes the forward, so the ratio is not exactly 3).

Imports the base modules only (errors).
"""

import contextlib
import itertools
import sys

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from diffrelay.errors import UserError

# H100 SXM, dense BF16: the NVIDIA H100 datasheet gives 1,979 TFLOPS "with sparsity", half of it dense; the
# Hopper architecture whitepaper's table gives the dense figure, 989.4 TFLOP/s.
H100_BF16_PEAK = 989.4e12
# Model FLOPs utilisation: the fraction of the peak a training run turns into counted FLOPs. 0.40 is an assumption
# near what large transformer training reports (PaLM 540B: 46.2 %, Chowdhery et al. 2022); small UNets reach less.
DEFAULT_MFU = 0.40
# A network that does not run on the meta device is measured on the CPU only below this many parameters, so
# that `diffrelay validate` never spends minutes or gigabytes on it.
CPU_MAX_PARAMS = 50_000_000


def macs(flops: float) -> float:
    """Multiply-adds, the unit of DiT's and edm2's "Gflops": FlopCounterMode counts 2 FLOPs per multiply-add."""
    return flops / 2


@contextlib.contextmanager
def _dispatch_without_dynamo():
    """torch wraps a dispatch mode's __torch_dispatch__ in torch._disable_dynamo, whose first call imports
    torch._dynamo (about 1 s here, most of `diffrelay validate`'s start-up) only to keep torch.compile out of
    the mode. Nothing is compiled while FLOPs are counted, so for that time the wrapper finds its cached
    result already set (the function itself) and calls it directly; torch's own wrapper returns afterwards.
    Where torch lays this out otherwise, nothing is changed and the import simply happens."""
    raw = getattr(getattr(flop_counter, "_FlopCounterMode", None), "__torch_dispatch__", None)
    raw = getattr(raw, "__wrapped__", None)
    if raw is None or "torch._dynamo" in sys.modules or hasattr(raw, "__dynamo_disable"):
        yield
        return
    setattr(raw, "__dynamo_disable", raw)
    try:
        yield
    finally:
        delattr(raw, "__dynamo_disable")


@contextlib.contextmanager
def _counting():
    # Attention through the math backend, two counted matmuls: FlopCounterMode has no formula for the CPU's fused
    # kernel (_scaled_dot_product_flash_attention_for_cpu), which it would count as 0.
    with _dispatch_without_dynamo(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        yield counter


def _inputs(net: nn.Module, x_shape: tuple, num_classes: int, text: dict | None = None):
    """One image of zeros, time 1 (EDM's sigma = 1, so its log is finite) and class 0, on the net's device; a text
    run's network also gets a Text of its dims (carrying the class), where the labels travel."""
    first = next(itertools.chain(net.parameters(), net.buffers()), None)
    device = first.device if first is not None else torch.get_default_device()
    x = torch.zeros((1, *x_shape[1:]), device=device)
    labels = torch.zeros(1, dtype=torch.long, device=device) if num_classes else None
    if text:
        from diffrelay.nets.registry import random_text

        cond = random_text(text, 1, device)
        cond.labels = labels
        labels = cond
    return x, torch.ones(1, device=device), labels


def forward_flops(net: nn.Module, x_shape: tuple, num_classes: int = 0, text: dict | None = None) -> int:
    """FLOPs (2 per multiply-add; matmuls and convolutions only) of net(x, time, labels) on one image of
    x_shape (its batch size is ignored); labels are given when num_classes > 0."""
    x, t, labels = _inputs(net, x_shape, num_classes, text)
    with torch.no_grad(), _counting() as counter:
        net(x, t, labels)
    return counter.get_total_flops()


def training_flops_per_image(net: nn.Module, x_shape: tuple, num_classes: int = 0,
                             text: dict | None = None) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of one training image, both measured: the forward pass and the
    backward pass of a scalar loss of its output through every parameter that requires a gradient (the optimizer's
    update and the loss's elementwise ops are not counted)."""
    x, t, labels = _inputs(net, x_shape, num_classes, text)
    with torch.enable_grad(), _counting() as counter:
        out = net(x, t, labels)
        forward = counter.get_total_flops()
        if not out.requires_grad:
            raise UserError("its output does not depend on any parameter that requires a gradient")
        out.float().square().mean().backward()
    return forward, counter.get_total_flops()


def measure(build, x_shape: tuple, num_classes: int = 0, train: bool = False, cpu: str | None = None,
            cpu_first: bool = False, text: dict | None = None) -> dict:
    """Build the network with build() on the meta device and count it (forward_flops, or with train also
    training_flops_per_image); when that fails, on the CPU unless `cpu` says why not (a large network).
    `cpu_first`: a small network, counted on the CPU first (the same count; no meta references to import).
    Returns {"forward", "train" (None unless train), "device"}; raises UserError with one line."""
    from diffrelay.nets.registry import on_device

    errors = []
    for device in ("meta",) if cpu else ("cpu", "meta") if cpu_first else ("meta", "cpu"):
        try:
            with on_device(device):
                net = build()
            if train:
                forward, total = training_flops_per_image(net, x_shape, num_classes, text)
            else:
                forward, total = forward_flops(net, x_shape, num_classes, text), None
            return {"forward": forward, "train": total, "device": device}
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- any failure (often user code): no count
            errors.append(f"on {device}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    if cpu:
        errors.append(f"not tried on the CPU: {cpu}")
    raise UserError("; ".join(errors))


def nfe(solver: str, steps: int) -> int:
    """Network evaluations per image of one sampling run: Heun (EDM's and flow's) corrects every step but the
    last (2 steps - 1, EDM's Table 1 counts the same); euler, flow's sde, ddpm and ddim call it once a step."""
    return 2 * steps - 1 if solver == "heun" else steps


def sampling_flops(forward: float, images: int, evaluations: int, guided: bool) -> float:
    """FLOPs of drawing `images` images: evaluations x forward each, twice when guided (the guided and the
    unguided pass both run; an upper bound under sample.guidance_interval or a smaller autoguidance guide)."""
    return images * evaluations * forward * (2 if guided else 1)


def gpu_hours(flops_per_image: float, images: float, mfu: float = DEFAULT_MFU, peak: float = H100_BF16_PEAK) -> float:
    """Hours of one GPU of `peak` FLOP/s running at `mfu` of it, for `images` images of flops_per_image each."""
    return flops_per_image * images / (mfu * peak) / 3600
