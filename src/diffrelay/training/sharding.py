"""train.sharding: fsdp2, PyTorch's own sharding (torch.distributed.fsdp.fully_shard), for networks whose weights,
gradients, optimizer state and EMAs do not fit one GPU. Each process holds 1/N of every parameter (a DTensor
sharded on dim 0); a block's full weights exist only while it runs, gathered by FSDP2 before its forward and
backward and freed after.

What shards as a unit: the blocks a network names (`units`), then the root for what is left (embeddings, heads),
as torchtitan applies it (torchtitan/models/llama3/infra/parallelize.py apply_fsdp). The EMA and post-hoc EMA
copies are sharded the same way, so an average's shard and the weight's shard are the same slice on the same
process and move towards each other with no communication (optim.Pairs). Checkpoints: sharded_checkpoint.py.

Under ddp (the default) nothing here runs.
"""

import warnings

import torch
from torch import nn

from diffrelay import families

# Containers whose children are the blocks: the built-in networks' (DiT/SiT `blocks`, the EDM/edm2 UNets' `enc` and
# `dec`, unet.py's `down`, `mid`, `up`) and diffusers' (`transformer_blocks` of PixArt, SD3, HunyuanDiT ("blocks"),
# FLUX.1's `single_transformer_blocks`, the UNets' `down_blocks` and `up_blocks`), and diffusers UNets' `mid_block`.
BLOCK_CONTAINERS = ("blocks", "enc", "dec", "down", "mid", "up", "transformer_blocks", "single_transformer_blocks",
                    "down_blocks", "up_blocks")
BLOCK_MODULES = ("mid_block",)
# Units that return views of one tensor, and whose callers read them out of place only (shard's note): the families'
# fsdp_views (FLUX.1's single-stream block returns its text and image halves; fully_shard names the class FSDP<name>).
VIEWS_OK = tuple(v for f in families.FAMILIES for v in f.fsdp_views)
HOOK = "shard_units"  # a network of one's own may name its units: a method returning a list of modules (docs/networks.md)


def units(net: nn.Module) -> list[nn.Module]:
    """The modules fully_shard wraps one by one before the root, deepest first (FSDP2 shards nested units
    bottom-up). A module defining `shard_units()` names them for its network; else the children of the containers
    named in BLOCK_CONTAINERS. A container's children that are containers themselves are looked into, since
    FSDP2 gathers a unit's weights in its forward hook, and a ModuleList is never called."""
    for m in net.modules():
        if callable(getattr(m, HOOK, None)):
            return _distinct([u for unit in getattr(m, HOOK)() for u in _callable(unit)])
    found = []
    for name, m in net.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in BLOCK_CONTAINERS and isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            found += [u for child in m.children() for u in _callable(child)]
        elif leaf in BLOCK_MODULES:
            found.append(m)
    return _distinct(found)[::-1]  # named_modules walks parents first


def _callable(m: nn.Module) -> list[nn.Module]:
    if isinstance(m, (nn.ModuleList, nn.ModuleDict)):  # no forward of their own: their children are called
        return [u for child in m.children() for u in _callable(child)]
    return [m]


def _distinct(modules) -> list[nn.Module]:
    seen, out = set(), []
    for m in modules:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def policy(precision: str):
    """MixedPrecisionPolicy for train.precision: bf16 computes in bf16 from fp32 master weights and reduces the
    gradients in fp32 (torchtitan's default: param_dtype bf16, reduce_dtype fp32); fp32 as is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(net: nn.Module, precision: str, device) -> nn.Module:
    """fully_shard on each unit, then the root, over every process of the group (one dimension: FSDP, no HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from diffrelay.runtime import distributed

    mesh = init_device_mesh(device.type, (distributed.world(),))
    mp = policy(precision)
    for unit in units(net):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
        if type(unit).__name__ in VIEWS_OK:
            # FSDP2 warns at each forward that the block returns views (an in-place op on one would skip its
            # gather). These blocks' outputs are only read out of place (FluxTransformer2DModel.forward: torch.cat in
            # the next block, norm_out; diffusers 0.42), and fsdp2 trains them as ddp does
            # (test_pretrained_families.py): this process's filter, for these classes' message alone.
            warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({type(unit).__name__}\) returned a "
                                    "view tensor", category=UserWarning)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    return net


def is_dtensor(t) -> bool:
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # nothing is sharded, and the import costs a ddp run time
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a view: writing it writes the parameter), or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def full(state: dict) -> dict:
    """Every tensor of a state dict whole, on the CPU, in rank 0 (the one that writes); {} elsewhere. A sharded one
    is gathered from every process: every process must call it, with the same keys (a collective per tensor, one at
    a time, so a process other than rank 0 holds one gathered tensor at most, and rank 0 the network once)."""
    from diffrelay.runtime import distributed

    main, out = distributed.is_main(), {}
    for k, v in state.items():
        whole = v.full_tensor() if is_dtensor(v) else v
        if main:
            out[k] = whole.detach().cpu()
        del whole
    return out


def grad_norm(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s total norm as a plain tensor: over DTensor gradients it is a DTensor reduced on read."""
    return norm.full_tensor() if is_dtensor(norm) else norm


def gradient_sync(net: nn.Module, sharded: bool, ddp, last: bool):
    """The context for one accumulation round: gradients reduced in the last round only. DDP's no_sync; FSDP2's
    set_requires_gradient_sync (the reduce-scatter deferred, gradients kept unsharded until the last round)."""
    import contextlib

    if sharded:
        net.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last or ddp is None else ddp.no_sync()
