"""Checkpoints of a train.sharding: fsdp2 run: every process writes its own shards in parallel, with
torch.distributed.checkpoint (DCP) through its safetensors storage (HuggingFaceStorageWriter, save_distributed):
one `shard-0000k-....safetensors` file a process, each carrying its pieces' offsets in the file's JSON metadata.
DCP's default storage keeps its index as a pickle (.metadata); this one keeps none, so nothing here unpickles.

The folder is the one checkpoint.py describes (state.pt, meta.json, manifest.json written last with the sha256 of
every file), plus the shard files; state.pt then holds what is not a sharded tensor (the optimizer's groups, the
schedule, the data order, counters). It is written aside under a name every process knows, then renamed into place
by rank 0 once every process has written, so a process killed mid-save leaves the last good checkpoint as it was.
A write that fails (a full disk, no inodes left) on any rank is one line on every rank: what rank 0 alone writes
(the folder, state.pt, meta.json, manifest.json, the rename) ends in a collective every rank reaches, whose outcome
each then raises alike, so none waits in a barrier for a rank that gave up; the folder written aside is removed.

Each shard's own header (its safetensors `__metadata__`, key `diffrelay`) records the trajectory and step it was saved
for (as meta.json holds them) and the save's random id (as manifest.json does): a shard of another run, step or save
is refused by verify, so also where its sha256 was written into the manifest, and the resume search skips it.

Resharding: DCP reads, for each process's shard of each tensor, the pieces of the files that hold it, whatever the
process count that wrote them, so a checkpoint of N processes resumes on M (tests/test_sharding.py: 2 to 1).
"""

import contextlib
import json
import logging
import os
import re
import secrets
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


RECORD = "diffrelay"  # the key of a shard's own record of its run, step and save, in its safetensors header


def save(path, tensors: dict, rest: dict, meta: dict, fmt: str, owned) -> Path:
    """Every process calls it with its own shards in `tensors` (DTensors and plain tensors; DCP writes a plain tensor
    once); rank 0's `rest` (plain containers) and `meta` are written. `owned(folder)`: whether a folder holds only
    checkpoint files (checkpoint.is_checkpoint_folder), so replacing it loses nothing. Returns the published folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    tmp = _tmp_path(path)
    save_id = distributed.from_main(secrets.randbits(62), "checkpoint save")  # ties the shards to this save
    record = {"trajectory": meta.get("trajectory"), "step": meta["step"], "save": save_id}
    _on_main(path, tmp, lambda: _prepare(path, tmp, owned))
    try:
        with distributed.peers("checkpoint save"):
            dcp.save(tensors, storage_writer=_writer(tmp, json.dumps(record, sort_keys=True)))
    except CheckpointException as e:  # a rank's write failed (ENOSPC, permissions): DCP gathers it to every rank
        if distributed.is_main():  # every rank is past its writes: DCP gathered their outcomes
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{path}: write failed ({reason(e)}); the previous checkpoint, if any, is unchanged; free "
                        "space (or inodes) there and rerun: it resumes from the last checkpoint") from None
    distributed.barrier()  # every shard is written (and fsynced by DCP's writer) before rank 0 publishes
    manifest = {"format": fmt, "step": meta["step"],
                "sharding": {"kind": "fsdp2", "world": distributed.world(), "save": save_id}}
    _on_main(path, tmp, lambda: _publish(path, tmp, rest, meta, manifest, record, owned))
    return path


def _on_main(path: Path, tmp: Path, write) -> None:
    """`write()` on rank 0, then its outcome on every rank: a collective every rank reaches, after which all raise the
    same one line if it failed, so no rank waits in a barrier for a rank 0 that gave up."""
    message = ""
    if distributed.is_main():
        try:
            write()
        except UserError as e:
            message = str(e)
        except OSError as e:  # ENOSPC for a full disk and for no inodes left alike
            message = (f"{e.filename or tmp}: write failed ({e.strerror or type(e).__name__}); {path} was not saved "
                       "and the previous checkpoint, if any, is unchanged; free space (or inodes) there and rerun: it "
                       "resumes from the last checkpoint")
    message = distributed.text_from_main(message, "checkpoint save")
    if message:
        raise UserError(message)


def _prepare(path: Path, tmp: Path, owned) -> None:
    """Rank 0: the folder the shards are written into, under a name every process knows."""
    io.check_replaceable(path, owned, "a checkpoint folder", "choose another path or move it aside")
    if os.path.lexists(tmp):  # a save killed half-way: ours, and never published
        if tmp.is_symlink() or not tmp.is_dir() or not owned(tmp):
            raise UserError(f"{tmp}: exists and holds files that are not a checkpoint's, so it is not replaced; "
                            "nothing was deleted; move it aside and rerun")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def _publish(path: Path, tmp: Path, rest: dict, meta: dict, manifest: dict, record: dict, owned) -> None:
    """Rank 0, once every shard is written: state.pt, meta.json, then manifest.json (last, with every file's sha256),
    and the rename into place. Failing, the folder this save wrote aside is removed; the previous one is untouched."""
    try:
        buf = BytesIO()
        torch.save(rest, buf)  # in memory: torch's own file writer hides ENOSPC behind a RuntimeError
        _write(tmp / "state.pt", buf.getbuffer())
        _write(tmp / "meta.json", _json(meta))
        names = sorted(os.listdir(tmp))
        check_shards(tmp, names, record, "torch's writer did not keep it; report this")  # DCP kept our header
        manifest = manifest | {"files": {name: io.sha256_file(tmp / name) for name in names}}
        _write(tmp / "manifest.json", _json(manifest))
        io.replace_dir(tmp, path, owned)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # this save's own, never published
        raise
    remove_stale(path, owned)


# What a save writes aside: this module's `.step_N.sharded.tmp`, io.atomic_dir's `.step_N.<mkdtemp's 8>.tmp` (ddp's).
STALE = re.compile(r"^\.step_\d{7}\.(sharded|[a-z0-9_]{8})\.tmp\Z")
RUN_FOLDERS = ("checkpoints", "recovery")  # a run's checkpoint folders, both read by train.py's resume search


def remove_stale(path: Path, owned) -> None:
    """Rank 0, after publishing `path`: remove what saves killed half-way left beside it and in the run's other
    checkpoint folder, each a folder of a name a save writes aside holding only checkpoint files (`owned`). Such a
    folder is otherwise only replaced when its step is saved again, which may never come (recovery_every changed).
    No other save of this run is under way: a run's saves follow one another."""
    path = Path(path)
    parent = path.parent
    folders = [parent] + [parent.parent / f for f in RUN_FOLDERS if parent.name in RUN_FOLDERS and f != parent.name]
    for folder in folders:
        try:
            found = sorted(folder.iterdir())
        except OSError:  # no recovery folder yet
            continue
        for p in found:
            with contextlib.suppress(OSError):  # tidying: the new checkpoint is published already
                if STALE.match(p.name) and p.is_dir() and not p.is_symlink() and _files_only(p) and owned(p):
                    shutil.rmtree(p, ignore_errors=True)


def _files_only(folder: Path) -> bool:
    try:
        return all(e.is_file(follow_symlinks=False) for e in os.scandir(folder))
    except OSError:
        return False


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()  # as io.write_json writes


def _write(file: Path, data) -> None:
    """A file of the folder written aside, made in place and fsynced: no temp file of its own, so a save killed here
    leaves only checkpoint files there (checkpoint.is_checkpoint_folder), which the next save may remove."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _Stamped:
    """A shard file's stream: DCP's writer makes the whole safetensors file in memory and writes it at once; this
    writes it with `record` added to its header's `__metadata__` (the tensors' offsets count from the header's end,
    so nothing else changes). torch's HuggingFaceStorageWriter takes no metadata of ours."""

    def __init__(self, raw, record: str):
        self.raw, self.record, self.stamped = raw, record, False

    def write(self, data) -> int:
        if self.stamped:
            return self.raw.write(data)
        view = memoryview(data).cast("B")
        n = int.from_bytes(view[:8], "little")
        header = json.loads(bytes(view[8:8 + n]))
        header.setdefault("__metadata__", {})[RECORD] = self.record
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes, so the tensors stay aligned
        self.raw.write(len(text).to_bytes(8, "little") + text)
        self.raw.write(view[8 + n:])
        self.stamped = True
        return len(view)

    def __getattr__(self, name):  # tell, flush, fileno, close: the file's own
        return getattr(self.raw, name)


def _writer(tmp: Path, record: str):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Stamping(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield _Stamped(stream, record) if is_shard(Path(path).name) and "w" in mode else stream

    writer = HuggingFaceStorageWriter(str(tmp), save_distributed=True)
    writer.fs = Stamping()
    return writer


def shard_record(file: Path, fix: str, optional: bool = False) -> dict | None:
    """The record a shard's header holds of the run, step and save it was written for; one line naming the file
    where the header is unreadable or does not hold what DCP's reader needs (each tensor's offsets)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            extra, shapes = f.metadata() or {}, {k: f.get_slice(k).get_shape() for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{file}: not a readable shard ({reason(e)}); {fix}") from None
    try:
        offsets = json.loads(extra["DCP_SHARDING_INFO"])
        valid = all(len(offsets[k]["saved_offsets"]) == len(s) for k, s in shapes.items())
    except (KeyError, TypeError, ValueError):
        valid = False
    if not valid:
        raise UserError(f"{file}: its header does not give every tensor's offsets (not a shard of a diffrelay "
                        f"checkpoint, or altered); {fix}")
    if optional and RECORD not in extra:
        return None
    try:
        record = json.loads(extra[RECORD])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{file}: its header holds no record of the run and step it was saved for (written before "
                        f"shards carried one, or not by diffrelay); {fix}") from None
    return record if isinstance(record, dict) else {}


def check_shards(path: Path, names, want: dict, fix: str) -> None:
    """Every shard among `names` was written for `want` (trajectory, step and save id), by its own header."""
    for name in sorted(n for n in names if is_shard(n)):
        # A checkpoint saved before shards carried a record (its manifest names no save) still resumes, as its
        # sha256 checks allow; once the manifest names a save, every shard must carry that save's record.
        got = shard_record(path / name, fix, optional=want["save"] is None)
        if got is None:
            continue
        if (got.get("trajectory"), got.get("step")) != (want["trajectory"], want["step"]):
            raise UserError(f"{path / name}: a shard of another run or step (its header: trajectory "
                            f"{got.get('trajectory')}, step {got.get('step')}; the checkpoint's meta.json: trajectory "
                            f"{want['trajectory']}, step {want['step']}); {fix}")
        if got.get("save") != want["save"]:
            raise UserError(f"{path / name}: a shard of another save of step {want['step']} (its header names save "
                            f"{got.get('save')}, manifest.json save {want['save']}); {fix}")


def reason(e: BaseException) -> str:
    """A failure in its own words: the root cause's message (an OSError's strerror and file), never a repr. DCP wraps
    each rank's exception with its stack frames in a CheckpointException: the first rank's, an OSError first."""
    failures = getattr(e, "failures", None)
    where = ""
    if isinstance(failures, dict) and failures:
        rank, (e, _) = min(failures.items(), key=lambda kv: (not isinstance(kv[1][0], OSError), kv[0]))
        where = f" on rank {rank}" if distributed.world() > 1 else ""
    seen = {id(e)}
    while e.__cause__ is not None and id(e.__cause__) not in seen:
        e = e.__cause__
        seen.add(id(e))
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{': ' + str(e.filename) if e.filename else ''}{where}"
    first = (str(e).strip().splitlines() or [""])[0]
    first = first if len(first) <= 300 else first[:300] + "..."
    return f"{type(e).__name__}{': ' + first if first else ''}{where}"


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
    flags = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in opt.param_groups]
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
        with distributed.peers("checkpoint load"), _quiet():
            dcp.load(template, storage_reader=HuggingFaceStorageReader(str(path)))
    except CheckpointException as e:  # every rank's failures, gathered by DCP; a BaseException
        if any(isinstance(exc, OSError) for exc, _ in e.failures.values()):
            raise UserError(f"{path}: cannot read its shards ({reason(e)}); check the disk, or delete {path} to "
                            "resume from an earlier one") from None
        raise UserError(f"{path}: its shards do not hold this run's tensors ({reason(e)}); resume it with the model "
                        f"and train settings it was written with, or delete {path} to resume from an earlier one") \
            from None


@contextlib.contextmanager
def _quiet():
    """DCP's loader logs a traceback on the root logger where a shard's header is unreadable, then raises: the raise
    is said in one line (verify reads every header first, so this is for a file changed since)."""
    def drop(record) -> bool:
        return record.module != "state_dict_loader"

    root = logging.getLogger()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


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
        with _quiet():
            dcp.load(template, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    return template
