"""Reading a reference `.npz` made elsewhere without trusting it: its members' `.npy` headers first.

np.load trusts each member's header: a bare `.npy` named `.npz` comes back as one array, a header that
declares a huge shape allocates it before a byte is read, a compressed member inflates whole in memory. Here
every member's header is read through zipfile and numpy.lib.format (no data, nothing unpickled), its declared
size is held against the bytes the archive holds for it, and what is about to be loaded against the memory this
process may still take; each problem is one line of UserError before any array is loaded.
"""

import math
import resource
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diffrelay.errors import UserError


@dataclass(frozen=True)
class Member:
    """One array of an .npz, from its header: what loading it costs and whether it can be memory-mapped."""

    shape: tuple
    dtype: np.dtype
    nbytes: int
    compressed: bool


def size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def headers(path, fix: str) -> dict[str, Member]:
    """name (without .npy): Member of every array in the archive at `path`, from the headers alone."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            bare = f.read(6) == b"\x93NUMPY"
        raise UserError(f"{path}: not a readable .npz (BadZipFile: "
                        f"{'a bare .npy array (np.save), not a zip archive' if bare else 'not a zip archive'}); {fix}")
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                key = info.filename[:-4]
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version not in ((1, 0), (2, 0)):  # 3.0 only carries utf-8 field names: no array of ours
                        raise UserError(f"{path}: {key} is an .npy of format {version}; {fix}")
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(f)
                    start = f.tell()
                if dtype.hasobject:
                    raise UserError(f"{path}: {key} holds pickled Python objects, which diffrelay never loads; {fix}")
                nbytes, held = math.prod(shape) * dtype.itemsize, info.file_size - start
                if nbytes > held:
                    raise UserError(f"{path}: {key}'s header declares {tuple(shape)} {dtype} ({size(nbytes)}) but "
                                    f"the archive holds {size(max(held, 0))} of it; the file is damaged: copy or "
                                    "make it again")
                out[key] = Member(tuple(shape), dtype, nbytes, info.compress_type != zipfile.ZIP_STORED)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: not a readable .npz ({type(e).__name__}: {e}); {fix}") from e
    return out


def _number(path: str, key: str | None = None) -> int | None:
    """The integer in a cgroup file ("max" is None), or a /proc `key:  123 kB` line's value in bytes."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if key is None:
        return int(text) if text.strip().isdigit() else None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1]) * (1024 if parts[-1] == "kB" else 1)
    return None


def available_memory() -> int | None:
    """Bytes this process may still allocate (None when nothing says): the least of the machine's MemAvailable,
    its cgroup's limit less its use (a SLURM job's --mem), and the address-space limit (ulimit -v) less the
    address space in use."""
    free = [_number("/proc/meminfo", "MemAvailable:")]
    try:
        group = Path("/proc/self/cgroup").read_text().splitlines()[0].split(":", 2)[2]
        limit, used = _number(f"/sys/fs/cgroup{group}/memory.max"), _number(f"/sys/fs/cgroup{group}/memory.current")
        if limit is not None and used is not None:
            free.append(limit - used)
    except (OSError, IndexError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    used = _number("/proc/self/status", "VmSize:")
    if soft != resource.RLIM_INFINITY and used is not None:
        free.append(soft - used)
    free = [f for f in free if f is not None]
    return max(0, min(free)) if free else None


def check_memory(path, what: str, nbytes: int, fix: str) -> None:
    """One line when `nbytes` (what loading `what` of `path` allocates) exceed the memory available."""
    free = available_memory()
    if free is not None and nbytes > free:
        raise UserError(f"{path}: {what} needs {size(nbytes)} of memory to load and this process has {size(free)} "
                        f"available; {fix}")
