"""Checkpoints of a train.sharding: fsdp2 run: every process writes its own shards in parallel, with
torch.distributed.checkpoint (DCP) through its safetensors storage (HuggingFaceStorageWriter, save_distributed):
one `shard-0000k-....safetensors` file a process, each carrying its pieces' offsets in the file's JSON metadata.
DCP's default storage keeps its index as a pickle (.metadata); this one keeps none, so nothing here unpickles.

The folder is the one checkpoint.py describes (state.pt, meta.json, manifest.json written last with the sha256 of
every file), plus the shard files; state.pt then holds what is not a sharded tensor (the optimizer's groups, the
schedule, the data order, counters). It is written aside under a name every process knows, then renamed into place
by rank 0 once every process has written, so a process killed mid-save leaves the last good checkpoint as it was.

Resharding: DCP reads, for each process's shard of each tensor, the pieces of the files that hold it, whatever the
process count that wrote them, so a checkpoint of N processes resumes on M (tests/test_sharding.py: 2 to 1).
"""

import os
import re
import shutil
import warnings
from io import BytesIO
from pathlib import Path

import torch

from diffrelay import io
from diffrelay.errors import UserError
from diffrelay.runtime import distributed

SHARD = re.compile(r"^shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors\Z")


def is_shard(name: str) -> bool:
    return bool(SHARD.match(name))


def _tmp_path(path: Path) -> Path:
    return path.parent / f".{path.name}.sharded.tmp"


def save(path, tensors: dict, rest: dict, meta: dict, fmt: str, owned) -> Path:
    """Every process calls it with its own shards in `tensors` (DTensors and plain tensors; DCP writes a plain tensor
    once); rank 0's `rest` (plain containers) and `meta` are written. `owned(folder)`: whether a folder holds only
    checkpoint files (checkpoint.is_checkpoint_folder), so replacing it loses nothing. Returns the published folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    path = Path(path)
    tmp = _tmp_path(path)
    if distributed.is_main():
        io.check_replaceable(path, owned, "a checkpoint folder", "choose another path or move it aside")
        if tmp.is_dir() and owned(tmp):  # a save killed half-way: ours, and never published
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    distributed.barrier()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with distributed.peers("checkpoint save"):
            dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    except CheckpointException as e:  # a rank's write failed (ENOSPC, permissions): DCP gathers it to every rank
        causes = [f for f in getattr(e, "failures", {}).values()]
        first = (str(causes[0] if causes else e).strip().splitlines() or ["write failed"])[0][:200]
        raise UserError(f"{path}: write failed ({first}); the previous checkpoint, if any, is unchanged") from None
    distributed.barrier()  # every shard is written (and fsynced by DCP's writer) before rank 0 publishes
    if distributed.is_main():
        buf = BytesIO()
        torch.save(rest, buf)
        (tmp / "state.pt").write_bytes(buf.getbuffer())
        io.write_json(tmp / "meta.json", meta)
        files = {name: io.sha256_file(tmp / name) for name in sorted(os.listdir(tmp))}
        io.write_json(tmp / "manifest.json", {"format": fmt, "step": meta["step"], "files": files,
                                              "sharding": {"kind": "fsdp2", "world": distributed.world()}})
        io.replace_dir(tmp, path, owned)
    distributed.barrier()
    return path


def check_no_strays(path: Path, manifest: dict) -> None:
    """DCP reads every shard file in the folder: one that the manifest does not list (another checkpoint's, copied
    in) would be read as part of this one."""
    for name in sorted(os.listdir(path)):
        if is_shard(name) and name not in manifest["files"]:
            raise UserError(f"{path / name}: a shard this checkpoint's manifest.json does not list (another "
                            f"checkpoint's?); move it out of {path}")


def optimizer_state(net, opt) -> tuple[dict, list]:
    """({"optimizer.<parameter name>.<moment>": this process's shard}, the optimizer's param_groups): its state keyed by
    parameter name (torch.distributed.checkpoint.state_dict), so it reshards with the parameters. The tensors are the
    live ones; a fresh optimizer's state is made by a step at lr 0 (torch's _init_optim_state), which moves nothing."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(net, opt)
    moments = {f"optimizer.{name}.{k}": v for name, per in osd["state"].items() for k, v in per.items()
               if isinstance(v, torch.Tensor)}
    return moments, osd["param_groups"]


def load_optimizer(net, opt, tensors: dict, groups: list) -> None:
    """The optimizer's state from `tensors` (as optimizer_state names them, loaded) and the checkpoint's `groups`,
    keeping this run's implementation flags (fused, foreach), as optim.load_optimizer_state does."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    osd = get_optimizer_state_dict(net, opt)
    for name, per in osd["state"].items():
        per.update({k: tensors[f"optimizer.{name}.{k}"] for k in per if isinstance(per[k], torch.Tensor)})
    flags = [{k: g[k] for k in ("fused", "foreach", "capturable")} for g in opt.param_groups]
    set_optimizer_state_dict(net, opt, {"state": osd["state"], "param_groups": groups})
    for group, kept in zip(opt.param_groups, flags, strict=True):
        group.update(kept)


def load(path, template: dict) -> None:
    """Read the checkpoint's tensors into `template`'s (in place: a parameter's shard is written where it lives).
    Every process calls it; each reads the pieces of its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with distributed.peers("checkpoint load"):
            dcp.load(template, storage_reader=HuggingFaceStorageReader(str(path)))
    except CheckpointException as e:  # every rank's failures, gathered by DCP; a BaseException
        causes = [f for f in getattr(e, "failures", {}).values()]
        first = (str(causes[0] if causes else e).strip().splitlines() or ["unreadable"])[0][:200]
        raise UserError(f"{path}: its shards do not hold this run's tensors ({first}); resume it with the model "
                        "and train settings it was written with") from None


def read_whole(path) -> dict:
    """Every tensor of a sharded checkpoint whole, in this process alone (no process group): what a checkpoint of
    any process count holds, for comparing two runs or making a snapshot from it. Its shapes and dtypes come from the
    shard files' headers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(path))
    template = {k: torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in reader.read_metadata().state_dict_metadata.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    return template
