"""Speed switches: torch.compile with a cache shared by segments, TF32, fused Adam(W), channels_last.

Each is a config key and off where it would change a guarantee (see docs/gpus.md, "Speed switches").
"""

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from diffrelay import logs
from diffrelay.errors import UserError

# Every segment and every sampling job is a new process. Inductor keeps its compiled kernels (FX graph
# cache), AOTAutograd keeps the backward graphs, and Triton keeps its GPU binaries in folders named by
# these variables; pointing them all at the workflow's resources/ folder lets segment k+1 reuse what
# segment k compiled. A folder rather than torch.compiler.save_cache_artifacts() in each checkpoint:
# it is shared by training and sampling and by every run, needs no change to the checkpoint format,
# is not tied to one trajectory, and inductor writes its entries atomically (temp file + rename), so
# concurrent jobs may share it. The folder is keyed by torch's own hashes (source, versions, device).
CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def use_compile_cache(resources) -> Path:
    """Point the compile caches at <resources>/compile-cache, before anything is compiled.

    Set, not defaulted: importing torch's DDP already fills TORCHINDUCTOR_CACHE_DIR with a /tmp default
    (torch._inductor.config reads it at import), and inductor looks the variable up again each time."""
    root = (Path(resources) / "compile-cache").resolve()
    for var, sub in CACHE_DIRS.items():
        os.environ[var] = str(root / sub)
        (root / sub).mkdir(parents=True, exist_ok=True)
    # On by default in current torch; set so an older default cannot silently turn reuse off.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return root


def compile_model(model, enabled: bool, resources, threads: int = 1):
    """torch.compile(model) with the shared cache, or the model itself when `enabled` is false.

    For training, `model` is the DDP wrapper, as PyTorch's DDP + compile recipe does it. The caller
    keeps the DDP object (no_sync) and the raw module (state_dict, EMA) and only calls the compiled
    one, so nothing is read through a wrapper.

    DDPOptimizer (dynamo's default for DDP) splits the graph at gradient buckets so the all-reduce
    overlaps the backward, but its graphs bypass the AOTAutograd cache ("fakify_first_call" in the
    log): every segment would trace forward and backward again, 20-40 s for the demo UNet here. Off,
    the graph is one piece, the whole compile comes from the cache, and gradients are all-reduced
    after the backward: nothing lost with one process, some overlap lost with several.
    """
    if not enabled:
        return model
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.config.optimize_ddp = False
    # Inductor's default is a pool of compile worker processes, one per core; the job was given
    # `threads` cores, and on a warm cache the pool only costs start-up.
    inductor_config.compile_threads = threads
    root = use_compile_cache(resources)
    logs.get().info("torch.compile on; compile cache %s (the first run compiles, later ones load)", root)
    return CompileErrors(torch.compile(model), root)


def _compile_error_types() -> tuple:
    import torch._dynamo.exc
    import torch._inductor.exc

    return tuple(t for t in (getattr(torch._inductor.exc, "InductorError", None),
                             getattr(torch._dynamo.exc, "BackendCompilerFailed", None)) if t is not None)


class CompileErrors(nn.Module):
    """Calls the compiled model; a failure of torch.compile itself becomes one line naming the cache folder.

    torch.compile compiles at the first call, and a damaged cache entry (a killed writer on a file system
    without atomic rename, a full disk, files copied between machines) fails there, the same way on every
    retry, in a long traceback that never names the folder. Which entry is bad cannot be told from outside,
    so the line says to delete the folder (every entry is rebuilt) and, if a fresh cache fails the same way,
    to turn compile off."""

    def __init__(self, compiled, cache: Path):
        super().__init__()
        self.compiled, self.cache = compiled, cache

    def forward(self, *args, **kwargs):
        with compile_errors(self.cache):
            return self.compiled(*args, **kwargs)


@contextlib.contextmanager
def compile_errors(cache: Path):
    """torch.compile's own failures inside the block become one line naming the cache folder."""
    try:
        yield
    except _compile_error_types() as e:
        cause = (str(e).strip().splitlines() or [""])[0][:200]  # torch adds paragraphs of advice below
        raise UserError(f"torch.compile failed ({type(e).__name__}: {cause}); the compile cache {cache} may "
                        "be damaged: delete that folder (it is rebuilt) and rerun; if it fails again, set "
                        "train.compile / sample.compile to false") from e


def backward_errors(model):
    """The same for a backward pass: inductor lowers the backward graph lazily, at the first backward, so
    a damaged cache entry of the backward fails there, outside the model's forward."""
    return compile_errors(model.cache) if isinstance(model, CompileErrors) else contextlib.nullcontext()


def set_backends(device: torch.device, tf32: bool, key: str = "train.tf32") -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA, or strict fp32 (PyTorch's own default turns it on
    for cuDNN convolutions, so "off" is set explicitly)."""
    mode = "tf32" if tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode
    if tf32 and device.type != "cuda":
        logs.get().info("%s=true has no effect on %s (TF32 is a CUDA tensor-core format)", key, device.type)


def set_determinism(device: torch.device, deterministic: bool) -> None:
    """train.deterministic: deterministic kernels, else cuDNN's autotuned ones (the shapes are static, so
    benchmark mode picks once per shape). cuBLAS reads CUBLAS_WORKSPACE_CONFIG at its first call, so this
    runs before any matmul on the device."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Off is torch's own state in a fresh process; the public setter would import torch._inductor (about 1 s of
    # every segment, torch 2.14) only to store the same False in inductor's config.
    if deterministic or torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic and device.type == "cuda"


def versions(device: torch.device) -> str:
    """torch, CUDA, driver and device, for the first lines of every segment's log."""
    if device.type != "cuda":
        return f"torch {torch.__version__} | device {device.type} ({torch.get_num_threads()} threads)"
    from diffrelay.runtime.gpus import driver_version

    return (f"torch {torch.__version__} | CUDA {torch.version.cuda} | driver {driver_version() or 'unknown'} | "
            f"device {torch.cuda.get_device_name(device)}")


def use_fused(setting, device: torch.device) -> bool:
    """train.fused_optimizer: auto = fused on CUDA only; true/false as given (PyTorch has CPU kernels too)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def to_memory_format(net: torch.nn.Module, channels_last: bool) -> torch.nn.Module:
    """channels_last (NHWC) weights: faster convolutions on tensor cores. Inputs stay NCHW; the first
    convolution produces channels_last activations from the weights' layout."""
    return net.to(memory_format=torch.channels_last) if channels_last else net


def offloaded(checkpointing, device: torch.device):
    """train.activation_checkpointing: offload: what autograd saves in the forward pass (with checkpointing, each
    block's input) is moved to host memory, pinned on CUDA for an asynchronous copy back, and returned to the device
    when the backward pass unpacks it (torch.autograd.graph.save_on_cpu); a block's recomputed activations stay on the
    device, one block at a time. The same values come back, so the weights are the same bits."""
    if checkpointing != "offload":
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
