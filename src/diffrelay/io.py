"""Atomic file writes: a temp file in the same folder, fsync, then rename."""

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from diffrelay.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    # The rename is only durable once the folder entry itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path, mode="wb", parents: bool = True):
    """Yield a file object; on success it replaces `path` in one rename, on error nothing changes.
    parents=False for a folder another process may rename away: the write then fails instead of making it anew."""
    path = Path(path)
    try:
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results should be readable like any file
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror}); check the folder's permissions and free space") from e
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise UserError(f"{path}: write failed ({e.strerror}); the previous file, if any, is unchanged") from e
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path, data: bytes, parents: bool = True) -> None:
    with atomic_write(path, "wb", parents) as f:
        f.write(data)


def write_text(path, text: str, parents: bool = True) -> None:
    with atomic_write(path, "w", parents) as f:
        f.write(text)


def write_json(path, obj, parents: bool = True) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", parents)


def advice(e: OSError) -> str:
    """What to do about an OSError when reading a path the user named: the fix depends on the cause."""
    if e.errno == errno.ELOOP:
        return "it is a symlink loop; point the link at a real file or remove it"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "fix its permissions"
    return "check the path and the file system"


def shown(path) -> str:
    """A path as a message writes it: as it is, or quoted as Python's repr quotes it (escapes, not the characters)
    when it holds one that would break the message's one line or hide in it: a newline, a tab, another control or
    invisible character, an undecodable byte, a space at either end."""
    s = str(path)
    return s if s.isprintable() and s == s.strip() else repr(s)


def check_regular_file(path, max_bytes: int, what: str = "file", missing: str = "check the path") -> int:
    """Size of `path` if it is a regular file (symlinks followed) of at most max_bytes; else UserError.

    Reading a FIFO, a socket or a device such as /dev/zero blocks or never ends, so every file a user
    names is checked with this before it is opened."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        if path.is_symlink():
            raise UserError(f"{shown(path)}: cannot open {what} (dangling symlink); {missing}") from e
        raise UserError(f"{shown(path)}: {what} not found; {missing}") from e
    except OSError as e:
        raise UserError(f"{shown(path)}: cannot read {what} ({e.strerror}); {advice(e)}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe, socket or device)"
        raise UserError(f"{shown(path)}: {what} is {kind}; {missing}")
    if st.st_size > max_bytes:
        raise UserError(f"{shown(path)}: {what} is {st.st_size} bytes, more than the {max_bytes} allowed; "
                        f"check the path")
    return st.st_size


def is_empty_dir(path) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except NotADirectoryError:
        return False


def check_replaceable(path, owned, what: str, fix: str) -> None:
    """Refuse to replace `path` unless it is absent, an empty folder, or `owned(path)` says this stage made it.

    Replacing a folder deletes it, and nothing may delete a folder it did not create: one wrong --out
    would otherwise wipe a run's checkpoints."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        raise UserError(f"{path}: exists and is not a folder; nothing was changed; {fix}")
    if not is_empty_dir(path) and not owned(path):
        raise UserError(f"{path}: exists and is not {what}; nothing was deleted; {fix}")


def check_file_target(path, owned, what: str, fix: str = "choose another --out or move the file aside") -> None:
    """Refuse to overwrite `path` unless it is absent or `owned(path)` says it is a file of the kind this
    command writes. A command's --out must never replace a user's file, a checkpoint or a training
    snapshot: only its own earlier result."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_file():
        raise UserError(f"{path}: exists and is not a regular file; nothing was changed; {fix}")
    if not owned(path):
        raise UserError(f"{path}: exists and is not {what}; nothing was overwritten; {fix}")


def is_json_object(path, keys, exact: bool = False) -> bool:
    """A JSON object holding `keys` (exactly these with exact=True): how a command recognises its own result."""
    try:
        d = read_json(path, max_bytes=1 << 26)
    except UserError:
        return False
    return isinstance(d, dict) and (set(d) == set(keys) if exact else set(keys) <= set(d))


@contextlib.contextmanager
def atomic_dir(path, owned):
    """Yield a temp folder beside `path`; on success it is renamed to `path`.

    An existing `path` is replaced only if check_replaceable(path, owned) allows it, checked before the
    work and again just before the rename."""
    path = Path(path)
    check_replaceable(path, owned, "a folder this stage wrote", "choose another path or move it aside")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the result should look like any other folder
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror}); check the folder's permissions and free space") from e
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        replace_dir(tmp, path, owned)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{path}: write failed ({e.strerror}); the previous copy, if any, is unchanged") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src, dst, owned) -> None:
    """Rename folder src to dst. An existing dst (which check_replaceable must allow) is moved aside
    first, so a reader sees the old or the new folder and never neither; then the old one is deleted."""
    src, dst = Path(src), Path(dst)
    check_replaceable(dst, owned, "a folder this stage wrote", "choose another path or move it aside")
    if dst.exists():
        old = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".old"))
        os.replace(dst, old / "x")
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(dst.parent)


def download(url: str, f, out: Path, place_at: Path) -> None:
    """Copy `url` into the open file `f`; failing (offline), one line naming the URL and where a copy fetched
    elsewhere goes (`place_at`)."""
    import shutil
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            shutil.copyfileobj(response, f, 1 << 20)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise UserError(f"{out}: cannot download {url} ({reason}); offline? fetch that URL elsewhere "
                        f"and place the file at {Path(place_at).resolve()}") from e


def sha256_fileobj(f, chunk=1 << 20) -> str:
    """sha256 of an open binary file from its start (e.g. a download before it is renamed)."""
    f.seek(0)
    h = hashlib.sha256()
    while block := f.read(chunk):
        h.update(block)
    return h.hexdigest()


def sha256_file(path) -> str:
    with open(path, "rb") as f:
        return sha256_fileobj(f)


def read_json(path, max_bytes: int = 1 << 28):
    path = Path(path)
    check_regular_file(path, max_bytes, "JSON file", "regenerate it")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise UserError(f"{path}: not found") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable or not valid JSON ({e}); regenerate it") from e


SNAPSHOT_FORMAT = "diffrelay-snapshot/1"  # the format of checkpoint.save_snapshot's files


def signed_header(path, what: str, fix: str) -> tuple[dict, dict]:
    """(stored metadata, meta) from the header of a .safetensors file written by checkpoint.write_signed,
    without reading the tensors (nor importing torch: the Snakefile checks sample.snapshot with it)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {what} not found; {fix}")
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(header_len, 100_000_000)))
        stored = header["__metadata__"]
        meta = json.loads(stored["meta"])
        stored["sha256"], meta["format"]  # noqa: B018 -- a KeyError here means "not ours"
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: unreadable {what} ({type(e).__name__}); it is truncated or not a "
                        f"diffrelay {what}; {fix}") from e
    return stored, meta


# Bytes per element of the dtypes a .safetensors header may name (the format's spec: huggingface/safetensors).
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                      "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_SAFETENSORS_HEADER = 100_000_000  # the format's own limit on the header's length


def safetensors_problem(path) -> str | None:
    """Why a .safetensors file cannot be loaded, from its header and size alone (no tensor is read, no torch): not
    readable (a symlink loop, a folder), empty, a header cut off or not JSON, a tensor whose dtype, shape and byte
    range disagree, or data the file does not cover (truncated) or leaves over. None when it is whole."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little")
            if len(head) < 8:
                return f"{size} bytes: empty or cut off before its header"
            if n > min(MAX_SAFETENSORS_HEADER, size - 8):
                return f"its header says {n} bytes, but the file has {size}: truncated or not a safetensors file"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not valid JSON: damaged or not a safetensors file"
    if not isinstance(header, dict):
        return "its header is not a mapping of tensors: damaged or not a safetensors file"
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            width, (start, stop) = SAFETENSORS_DTYPES[t["dtype"]], t["data_offsets"]
            count = 1
            for d in t["shape"]:
                count *= int(d)
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r}: its dtype, shape or data_offsets are missing or unknown: damaged file"
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop) or stop - start != count * width:
            return f"tensor {name!r}: {t['dtype']} of shape {t['shape']} does not fill bytes {start} to {stop}"
        end = max(end, stop)
    if end != size - 8 - n:
        return (f"its tensors need {end} bytes of data, the file holds {size - 8 - n}: "
                + ("truncated" if end > size - 8 - n else "bytes left over, damaged"))
    return None


def shards_problem(folder) -> str | None:
    """Why a sharded save_pretrained folder cannot load: its *.safetensors.index.json unreadable, or naming a shard
    that is not there (a copy cut short); None when every shard it names is present."""
    for index in sorted(Path(folder).glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{index}: not a readable shard index ({type(e).__name__})"
        missing = sorted(s for s in shards if not (Path(folder) / s).is_file())
        if missing:
            return f"{index}: names the shard {missing[0]}, which is not in {folder}"
    return None


def remove_owned(folder, files) -> None:
    """Delete `files` (a stage's own, in `folder`), then `folder` if nothing else is left in it: what anyone else
    put there stays, and so does the folder then."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for f in files:
        Path(f).unlink(missing_ok=True)
    if not any(folder.iterdir()):
        folder.rmdir()
