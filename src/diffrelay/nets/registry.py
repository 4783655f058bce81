"""Build and check the network named by `model.arch` under the contract written in diffrelay.nets.

A user's network is user code: it is imported, built and run through `_run_user`, which gives it a
neutral sys.argv, keeps its prints off stdout and turns whatever it raises (or a sys.exit) into one line
naming its own file and line, so Snakemake and `diffrelay validate` never see a traceback or an exit.
"""

import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import sys
import sysconfig
import traceback

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import diffrelay
from diffrelay.errors import UserError
from diffrelay import families
from diffrelay.nets import BUILTIN, TEXT_ARCHS, arch_kwargs, check_kwargs, dit, edm, edm2, is_builtin, memory, unet
from diffrelay.text.condition import Text

BUILDERS = {"ddpmpp": edm.build_ddpmpp, "ncsnpp": edm.build_ncsnpp, "adm": edm.build_adm, "edm2": edm2.build,
            "dit": dit.build, "sit": dit.build_sit, "unet": unet.build}
BUILDERS |= {arch: families.of_network(arch).build for arch in families.ARCHS}  # build_network asks of_network
# Frames in these folders are never the user's: diffrelay, torch, the standard library, installed packages.
LIBRARY_DIRS = tuple({os.path.dirname(diffrelay.__file__), os.path.dirname(torch.__file__),
                      *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))})


# Random fills of a tensor. On the meta device they have no kernel: torch runs its Python reference, whose
# first call imports torch._dynamo (about 1 s here), for values a meta tensor does not hold.
_RANDOM_FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.exponential_,
                 torch.Tensor.bernoulli_, torch.Tensor.cauchy_, torch.Tensor.geometric_, torch.Tensor.log_normal_}

# A built-in network of at most this many parameters x pixels of one image (a bound on a convolutional
# network's multiply-adds per image) is checked on the CPU with real tensors: its forward pass there costs
# less than the import of torch._dynamo that meta's Python references need, and it bounds-checks indices.
CPU_CHECK_MAX_PARAM_PIXELS = 1_000_000_000


class _SkipInitOnMeta(TorchFunctionMode):
    """Initialisation (torch.nn.init, Tensor.normal_ and the other fills) of a meta tensor does nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        in_place_init = getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_")
        if isinstance(target, torch.Tensor) and target.is_meta and (func in _RANDOM_FILLS or in_place_init):
            return target
        return func(*args, **kwargs)


def on_device(device: str | None):
    """torch's default device set to `device` (nothing when None); on meta, initialisation skipped."""
    if not device:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device(device))
    if torch.device(device).type == "meta":
        stack.enter_context(_SkipInitOnMeta())
    return stack


class CodeError(UserError):
    """The user's network code raised or exited; the message names its file and line (`where`) and what
    it raised or did (`did`)."""

    def __init__(self, message: str, where: str = "", did: str = ""):
        super().__init__(message)
        self.where, self.did = where, did


def _one_line(text, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _package_root(module_name: str) -> str | None:
    """The folder of the module's top-level package, or the module's file: where the user's code lives."""
    try:
        spec = importlib.util.find_spec(module_name.partition(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.abspath(list(spec.submodule_search_locations)[0])
    return os.path.abspath(spec.origin) if spec.origin else None


def _is_user(filename: str, root: str | None) -> bool:
    path = os.path.abspath(filename)
    if root and (path == root or path.startswith(root + os.sep)):
        return True  # the user's package, even when it is installed in site-packages
    return not filename.startswith("<") and not any(path.startswith(d + os.sep) for d in LIBRARY_DIRS)


def _where(e: BaseException, root: str | None) -> str:
    """'file:line' of the user's code behind `e`: a SyntaxError's own position, else the innermost traceback
    frame that is the user's (not diffrelay, torch or the standard library); a bare assert adds its line."""
    if isinstance(e, SyntaxError) and e.filename and not e.filename.startswith("<"):
        return f"{e.filename}:{e.lineno}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_user(f.filename, root)]
    if not frames:
        return root or "(no file of yours in the traceback)"
    f = frames[-1]
    bare_assert = isinstance(e, AssertionError) and not str(e) and f.line
    return f"{f.filename}:{f.lineno}" + (f" ({f.line})" if bare_assert else "")


def _describe(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return f"{type(e).__name__}: {_one_line(e.msg)}"
    return f"{type(e).__name__}: {_one_line(e)}" if str(e) else type(e).__name__


def _run_user(fn, *args, arch: str, root: str | None, what: str, fix: str, at: str, **kwargs):
    """fn(*args, **kwargs) as user code. It sees sys.argv = [its module] (argparse then finds no options),
    its prints go to stderr once it returns (stdout carries `diffrelay validate`'s YAML and Snakemake's DAG),
    and a raise or a sys.exit becomes one CodeError line: model.arch, the user's file:line, what it did."""
    argv, held = sys.argv, io.StringIO()
    sys.argv = [arch.partition(":")[0]]  # argparse's prog: the module, never `snakemake` or `diffrelay`
    try:
        with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
            result = fn(*args, **kwargs)
    except SystemExit as e:  # argparse's errors and --help exit too; KeyboardInterrupt still stops us
        where, did = _where(e, root), f"called sys.exit({'' if e.code is None else repr(e.code)})"
        raise CodeError(f"model.arch={arch}: {where}: {did} {what}; a network module must not parse arguments "
                        f"or exit {at}", where, did) from e
    except Exception as e:  # noqa: BLE001 -- any failure of the user's code is reported as one line
        where, did = _where(e, root), _describe(e)
        raise CodeError(f"model.arch={arch}: {where}: {did} ({what}); {fix}", where, did) from e
    finally:
        sys.argv = argv
    sys.stderr.write(held.getvalue())
    return result


def _import(arch: str):
    """(the callable named "package.module:callable", the user's package root), or a one-line UserError."""
    module_name, _, attr = arch.partition(":")
    if not module_name or not attr:
        raise UserError(f"model.arch={arch!r}: use one of {', '.join(BUILTIN)} or 'package.module:callable'")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)  # after PYTHONPATH and site-packages, so it never shadows them
    root = _package_root(module_name)
    try:
        module = _run_user(importlib.import_module, module_name, arch=arch, root=root,
                           what="while being imported", fix="fix the module", at="at import")
    except CodeError as e:
        missing = e.__cause__
        if not (isinstance(missing, ModuleNotFoundError) and missing.name
                and (module_name == missing.name or module_name.startswith(missing.name + "."))):
            raise  # the module was found and failed itself: its own file and line say where
        raise UserError(f"model.arch={arch!r}: cannot import module {module_name!r} ({missing}); put its folder on "
                        f"PYTHONPATH (export PYTHONPATH=/path/to/folder:$PYTHONPATH) or in the working directory") \
            from missing
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"model.arch={arch!r}: module {module_name!r} has no callable {attr!r}")
    return fn, root


def _check_signature(arch: str, fn, kwargs: dict, contract: dict) -> None:
    """model.kwargs are to blame only when the callable's signature refuses them (or the contract's three)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to read (a C callable): the call itself will tell
    shown = sig.replace(return_annotation=inspect.Signature.empty)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}{shown}"
    try:
        sig.bind_partial(**contract)
    except TypeError as e:
        raise UserError(f"model.arch={arch}: {name} does not take the contract's keywords "
                        f"{', '.join(contract)} ({e}); see diffrelay.nets (docs/networks.md)") from e
    try:
        sig.bind(**contract, **kwargs)
    except TypeError as e:
        raise UserError(f"model.arch={arch}, model.kwargs={kwargs}: {name} refuses them (TypeError: {e}); "
                        "fix model.kwargs") from e


def build_network(arch: str, kwargs: dict, resolution: int, in_channels: int, num_classes: int,
                  device: str | None = None, text: dict | None = None) -> nn.Module:
    """Call the network named by `arch` under the contract above, on `device` (default: torch's default); bad
    kwargs and failures of the user's code become one-line errors (CodeError when the user's code raised).
    `text`: a text run's dims {"states": D, "length": L, "pooled": P or 0}, passed as text= (only then)."""
    bad = check_kwargs({"arch": arch, "kwargs": kwargs})
    if bad:
        raise UserError(f"{bad[0][0]}: {bad[0][1]}")
    if text is not None and is_builtin(arch) and arch not in TEXT_ARCHS:
        raise UserError(f"model.arch={arch}: takes no text; use one of {', '.join(TEXT_ARCHS)} for a captioned "
                        "dataset, or set data.captions: none")
    contract = {"resolution": resolution, "in_channels": in_channels, "num_classes": num_classes}
    if text is not None:
        contract["text"] = dict(text)
    # Imported outside the device context: a module-level tensor made on the meta device would stay there.
    family = families.of_network(arch, kwargs)
    fn, root = (family.build if family else BUILDERS[arch], None) if is_builtin(arch) else _import(arch)
    with on_device(device):
        if is_builtin(arch):
            try:
                net = fn(**contract, **kwargs)
            except (TypeError, ValueError, KeyError) as e:
                raise UserError(f"model.arch={arch}, model.kwargs={kwargs}: the network refused them "
                                f"({type(e).__name__}: {e}); fix model.kwargs") from e
        else:
            _check_signature(arch, fn, kwargs, contract)
            net = _run_user(fn, arch=arch, root=root, what=f"in {arch.partition(':')[2]}() building the network",
                            fix="fix the network", at="when called", **contract, **kwargs)
    if not isinstance(net, nn.Module):
        raise UserError(f"model.arch={arch}: returned {type(net).__name__}, not a torch.nn.Module; "
                        "return the network itself")
    return net


def num_params(net: nn.Module) -> int:
    """Parameters as the papers count them: DiT counts its fixed position table (a frozen parameter there)."""
    return sum(p.numel() for p in net.parameters()) + sum(getattr(m, "fixed_parameters", 0) for m in net.modules())


def random_text(dims: dict, batch: int, device) -> Text:
    """A Text of `dims` (text.source.TextSource.dims) for the network check: normal states and pooled, every
    token in row 0 and the first half in the others (padding masked); from its own generator, so the check
    draws nothing from torch's global one."""
    gen = torch.Generator().manual_seed(0)
    length = dims["length"]
    mask = torch.ones(batch, length, dtype=torch.int64, device="cpu")
    mask[1:, max(1, length // 2):] = 0
    states = torch.randn(batch, length, dims["states"], generator=gen, device="cpu")
    pooled = torch.randn(batch, dims["pooled"], generator=gen, device="cpu") if dims.get("pooled") else None
    return Text(states, mask, pooled).to(device)


def _forward(net, arch: str, root: str | None, shape: tuple, labels: list | None, grad: bool = False,
             text: dict | None = None):
    """One forward pass on zeros of `shape` (on torch's default device), recording the graph with `grad`; the
    output must have that shape. Returns it. A text run's network gets a random Text of the `text` dims."""
    x, c_noise = torch.zeros(shape), torch.zeros(shape[0])
    y = None if labels is None else torch.tensor(labels)
    extra = {} if text is None else {"text": random_text(text, shape[0], x.device)}
    with torch.set_grad_enabled(grad):
        if is_builtin(arch):
            try:
                out = net(x, c_noise, y, **extra)
            except Exception as e:  # noqa: BLE001 -- reported as one line, like the user's networks
                raise UserError(f"model.arch={arch}: one forward pass on a {shape} batch failed "
                                f"({type(e).__name__}: {_one_line(e)}); fix model.kwargs") from e
        else:
            what = f"in forward() on a {shape} batch with labels {labels}" + (f" and text {text}" if text else "")
            out = _run_user(net, x, c_noise, y, arch=arch, root=root, fix="fix the network", at="when called",
                            what=what, **extra)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"model.arch={arch}: the network returned {got} for input {shape}; "
                        "it must return a tensor shaped like its input")
    return out


def _unused(net: nn.Module, out: torch.Tensor) -> list[str] | None:
    """Names of the trainable parameters `out` does not depend on (their .grad would stay None after backward):
    DDP's first step stops on them with its 44-line "Expected to have finished reduction". None where the
    backward cannot run (an op without a meta kernel, the user's own backward raising): nothing to tell."""
    named = [(name, p) for name, p in net.named_parameters() if p.requires_grad]
    if not named:
        return []
    if not out.requires_grad:
        return [name for name, _ in named]
    try:
        with contextlib.redirect_stdout(sys.stderr):  # a custom backward's prints keep off validate's YAML
            grads = torch.autograd.grad(out.float().sum(), [p for _, p in named], allow_unused=True)
    except Exception:  # noqa: BLE001 -- training reports its own backward's failure; here it only means "unknown"
        return None
    return [name for (name, _), g in zip(named, grads) if g is None]


def _build_and_run(arch, kwargs, resolution, in_channels, num_classes, device, net=None, grads=False,
                   text=None) -> int:
    """Build on `device` (unless `net` is built there already) and run one forward pass on a batch of 2: class
    0 and the null class K; with `grads`, a backward too, which must reach every trainable parameter."""
    net = net or build_network(arch, kwargs, resolution, in_channels, num_classes, device, text)
    root = None if is_builtin(arch) else _package_root(arch.partition(":")[0])
    shape, k = (2, in_channels, resolution, resolution), num_classes
    with torch.device(device):
        try:
            out = _forward(net, arch, root, shape, [0, k] if k else None, grad=grads, text=text)
            unused = _unused(net, out) if grads else None
        except CodeError as e:
            if device == "meta" or not k:
                raise
            try:  # does it run without the null class? Then label K is what it refuses.
                _forward(net, arch, root, shape, [0, k - 1], text=text)
            except CodeError:
                raise e from None
            raise UserError(f"model.arch={arch}: {e.where}: the network fails on label {k} = num_classes, the "
                            f"null class ({e.did}); a conditional network must accept label num_classes as \"no "
                            f"class\" (label dropout trains it, guidance samples with it): give its class embedding "
                            f"num_classes + 1 rows, e.g. nn.Embedding(num_classes + 1, dim)") from e
    if unused:
        names = ", ".join(sorted(unused)[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise UserError(f"model.arch={arch}: {len(unused)} parameter(s) get no gradient from forward() ({names}): "
                        "forward never uses them, and DDP (training on several processes) stops at its first step; "
                        "use them in forward, delete them, or freeze them (.requires_grad_(False))")
    return num_params(net)


def enable_checkpointing(net: nn.Module, arch: str) -> None:
    """train.activation_checkpointing: on in every block of `net`, or one line when its code has none."""
    if not memory.enable(net):
        raise UserError(f"train.activation_checkpointing: model.arch={arch} has no module with a `checkpointing` "
                        "attribute; run its blocks through diffrelay.nets.memory.call (docs/networks.md) or set "
                        "train.activation_checkpointing: false")


def check(model_cfg: dict, resolution: int, in_channels: int, num_classes: int, checkpointing: bool = False,
          augment: bool = False, text: dict | None = None) -> int:
    """Build the configured network and run one forward pass on a batch of 2 (labels 0 and the null class
    K); check the output shape. Returns the parameter count; raises UserError with one line. A user's network
    gets a backward too, which must reach every trainable parameter (DDP's rule); not with `augment`
    (train.augment), whose labels only training passes, nor for the built-in ones: edm2's loss, not its
    forward, uses its logvar head, and their tests cover the rest.

    The meta device costs no memory and no weights, but it does not bounds-check indices (an embedding of K
    rows takes label K there) and cannot run data-dependent Python or ops without a meta kernel. So a
    user's conditional network, and any user network the meta pass fails on, is built and run on the CPU
    with real tensors. The built-in networks' null class is covered by tests, so they stay on meta, unless
    they are small enough (CPU_CHECK_MAX_PARAM_PIXELS) that a real pass is the cheaper one.

    A text run (`text`: its dims, text.source.TextSource.dims) builds the network with text= and runs it on a
    random Text of those dims. diffusers' text networks get the backward too (their unused parameters, e.g. of
    a config that builds a head it never calls, would stop DDP as a user's would)."""
    arch, kwargs = arch_kwargs(model_cfg)
    grads = (not is_builtin(arch) or arch in TEXT_ARCHS) and not augment
    if checkpointing:
        enable_checkpointing(build_network(arch, kwargs, resolution, in_channels, num_classes, "meta", text), arch)
    if is_builtin(arch) or not num_classes:
        try:
            net = build_network(arch, kwargs, resolution, in_channels, num_classes, "meta", text)
            if num_params(net) * resolution ** 2 > CPU_CHECK_MAX_PARAM_PIXELS:
                return _build_and_run(arch, kwargs, resolution, in_channels, num_classes, "meta", net, grads, text)
        except CodeError:
            pass  # a real pass answers the same question, and its error is the one to report
    return _build_and_run(arch, kwargs, resolution, in_channels, num_classes, "cpu", grads=grads, text=text)
