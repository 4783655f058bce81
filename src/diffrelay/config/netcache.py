"""What `validate` and the Snakefile learn by building a run's network (its parameter count, forward cost and memory
lines), kept per input in `<run.resources>/validate/`, so that only the first check of a network pays for building
it. A diffusers network costs the import of diffusers, transformers and peft (12-20 s on this project's 2-core CPU,
issue 65), which every Snakemake parse and every `validate` paid again for the same answer.

The key is everything the answer depends on: the whole config (after its defaults), the size and mtime of every
file in the folders it names for the network (model.pretrained, data.encoder, data.text_encoders), the size and
mtime of diffrelay's own source files, and the versions of the libraries that build the network. A change to any of
them is a miss and is measured again. A user's own network (model.arch module:Class) is never cached: its code lives
outside these folders. An entry that cannot be read is a miss; one that cannot be written is skipped: the cache only
saves time, and never changes an answer."""

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from diffrelay import io
from diffrelay.errors import UserError

PACKAGE = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "diffusers", "transformers", "peft", "torchao", "bitsandbytes", "numpy")
MAX_FILES = 10_000  # files stat'ed in one named folder; past it (not a model folder) the folder is not cached


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _files(root: Path) -> list | None:
    """[(relative path, size, mtime_ns)] of every file under `root` (a file: itself); None past MAX_FILES."""
    if root.is_file():
        s = root.stat()
        return [(root.name, s.st_size, s.st_mtime_ns)]
    out = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            p = Path(folder, name)
            try:
                s = p.stat()
            except OSError:
                continue
            out.append((str(p.relative_to(root)), s.st_size, s.st_mtime_ns))
            if len(out) > MAX_FILES:
                return None
    return out


def _paths(value) -> list[str]:
    """Every string in a config value (nested lists and dicts) that names an existing file or folder."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _paths(v)]
    return [value] if isinstance(value, str) and value and os.path.exists(value) else []


_SOURCE: list | None = None


def _source() -> list:
    global _SOURCE
    if _SOURCE is None:  # once a process: the package does not change under a running command
        _SOURCE = [f for f in _files(PACKAGE) or [] if f[0].endswith((".py", ".yaml"))]  # not __pycache__
    return _SOURCE


def key(cfg, part: str, extra=None) -> str | None:
    """The cache key of `part` ("check", "report") of this config's network; None when it is not cacheable."""
    from diffrelay import nets

    d = cfg.to_dict()
    if not nets.is_builtin(d["model"]["arch"]):
        return None
    named = _paths(d["model"]) + _paths(d["data"]["encoder"]) + _paths(d["data"]["text_encoders"])
    folders = {p: _files(Path(p).resolve()) for p in sorted(set(named))}
    if any(v is None for v in folders.values()):
        return None
    blob = json.dumps([part, d, folders, _source(), {n: _version(n) for n in LIBRARIES}, extra], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _path(cfg, k: str) -> Path:
    return Path(cfg.run.resources) / "validate" / f"{k}.json"


def read(cfg, k: str | None):
    """The stored answer for key `k`, or None (no key, no entry, or an entry that cannot be read)."""
    if k is None:
        return None
    try:
        entry = io.read_json(_path(cfg, k), max_bytes=1 << 20)
    except (UserError, OSError, ValueError):
        return None
    return entry.get("value") if isinstance(entry, dict) and entry.get("key") == k else None


def write(cfg, k: str | None, value) -> None:
    if k is None:
        return
    try:
        io.write_json(_path(cfg, k), {"key": k, "value": value})
    except (UserError, OSError):  # a read-only resources folder: the answer is right, only not kept
        pass
