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


def _only_checkpoint_files(folder: Path) -> bool:
    from diffrelay.training.checkpoint import FILES

    return all(name in FILES or is_shard(name) for name in os.listdir(folder))


def save(path, tensors: dict, rest: dict, meta: dict, fmt: str) -> Path:
    """Every process calls it with its own shards in `tensors` (DTensors and plain tensors; DCP writes a plain tensor
    once); rank 0's `rest` (plain containers) and `meta` are written. Returns the published folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    path = Path(path)
    tmp = _tmp_path(path)
    if distributed.is_main():
        io.check_replaceable(path, _only_checkpoint_files, "a checkpoint folder", "choose another path or move it aside")
        if tmp.is_dir() and _only_checkpoint_files(tmp):  # a save killed half-way: ours, and never published
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
        io.replace_dir(tmp, path, _only_checkpoint_files)
    distributed.barrier()
    return path


def check_no_strays(path: Path, manifest: dict) -> None:
    """DCP reads every shard file in the folder: one that the manifest does not list (another checkpoint's, copied
    in) would be read as part of this one."""
    for name in sorted(os.listdir(path)):
        if is_shard(name) and name not in manifest["files"]:
            raise UserError(f"{path / name}: a shard this checkpoint's manifest.json does not list (another "
                            f"checkpoint's?); move it out of {path}")


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
