"""Build and check the network named by `model.arch` under the contract written in diffrelay.nets."""

import importlib
import os
import sys

import torch
from torch import nn

from diffrelay.errors import UserError
from diffrelay.nets import arch_kwargs, dit, is_builtin, unet

BUILDERS = {"unet": unet.build, "dit": dit.build}


def _import(arch: str):
    """The callable named "package.module:callable", or a UserError naming the module and the fix."""
    module_name, _, attr = arch.partition(":")
    if not module_name or not attr:
        raise UserError(f"model.arch={arch!r}: use unet, dit or 'package.module:callable'")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)  # after PYTHONPATH and site-packages, so it never shadows them
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"model.arch={arch!r}: cannot import module {module_name!r} ({e}); put its folder on "
                        f"PYTHONPATH (export PYTHONPATH=/path/to/folder:$PYTHONPATH) or in the working directory") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"model.arch={arch!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def build_network(arch: str, kwargs: dict, resolution: int, in_channels: int, num_classes: int) -> nn.Module:
    """Call the network named by `arch` under the contract above; bad kwargs become one-line errors."""
    fn = BUILDERS[arch] if is_builtin(arch) else _import(arch)
    try:
        net = fn(resolution=resolution, in_channels=in_channels, num_classes=num_classes, **kwargs)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"model.arch={arch}, model.kwargs={kwargs}: the network refused them "
                        f"({type(e).__name__}: {e}); fix model.kwargs") from e
    if not isinstance(net, nn.Module):
        raise UserError(f"model.arch={arch}: returned {type(net).__name__}, not a torch.nn.Module; "
                        "return the network itself")
    return net


def num_params(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def check(model_cfg: dict, resolution: int, in_channels: int, num_classes: int) -> int:
    """Build the configured network on the meta device (no memory, no weights), run one forward pass on a
    batch of 2 and check the output shape. Returns the parameter count; raises UserError with one line."""
    arch, kwargs = arch_kwargs(model_cfg)
    with torch.device("meta"):
        net = build_network(arch, kwargs, resolution, in_channels, num_classes)
        x = torch.zeros(2, in_channels, resolution, resolution)
        c_noise = torch.zeros(2)
        labels = torch.full((2,), num_classes, dtype=torch.long) if num_classes else None
    try:
        out = net(x, c_noise, labels)
    except (NotImplementedError, RuntimeError) as e:
        # Some operations have no meta kernel; a real (CPU) pass answers the same question.
        try:
            net = build_network(arch, kwargs, resolution, in_channels, num_classes)
            out = net(torch.zeros(2, in_channels, resolution, resolution), torch.zeros(2),
                      None if labels is None else labels.to("cpu"))
        except Exception as e2:  # noqa: BLE001 -- any failure of user code is reported as one line
            raise UserError(f"model.arch={arch}: one forward pass on a (2, {in_channels}, {resolution}, "
                            f"{resolution}) batch failed ({type(e2).__name__}: {e2}); fix the network") from e
    except Exception as e:  # noqa: BLE001
        raise UserError(f"model.arch={arch}: one forward pass on a (2, {in_channels}, {resolution}, {resolution}) "
                        f"batch failed ({type(e).__name__}: {e}); fix the network") from e
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"model.arch={arch}: the network returned {got} for input {tuple(x.shape)}; "
                        "it must return a tensor shaped like its input")
    return num_params(net)
