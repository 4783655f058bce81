"""Atomic file writes: a temp file in the same folder, fsync, then rename."""

import contextlib
import hashlib
import json
import os
import shutil
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
def atomic_write(path, mode="wb"):
    """Yield a file object; on success it replaces `path` in one rename, on error nothing changes."""
    path = Path(path)
    try:
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


def write_bytes(path, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def write_text(path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def write_json(path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_dir(path):
    """Yield a temp folder beside `path`; on success it is renamed to `path` (replacing an old one)."""
    path = Path(path)
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
        replace_dir(tmp, path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{path}: write failed ({e.strerror}); the previous copy, if any, is unchanged") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src, dst) -> None:
    """Rename folder src to dst. An existing dst is moved aside first, so a reader sees the old or
    the new folder and never neither; then the old one is deleted."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        old = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".old"))
        os.replace(dst, old / "x")
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(dst.parent)


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


def read_json(path):
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise UserError(f"{path}: not found") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable or not valid JSON ({e}); regenerate it") from e
