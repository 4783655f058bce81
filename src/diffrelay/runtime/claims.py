"""Which work folder a live process is using: a stage holds a `flock` on a file (or the folder) of its work folder
for as long as it runs, so another run can tell a folder in use from one a killed run left behind.

Only an unclaimed folder may be moved aside, emptied or deleted by a run with other settings: a second
`diffrelay sample` into the same --out used to delete a running sampler's images. The kernel drops the lock
when its process ends, even on SIGKILL, so a killed run's folder is free at once. No lock waits: a claim that
cannot be had is refused at once and the caller says so in one line.
"""

import fcntl
import os

_HELD: dict[str, int] = {}  # this process's claims: name -> locked fd


def claim(path, shared: bool = True, name=None) -> bool:
    """Lock `path` (a file or a folder) until release(name) or this process ends; False when another process
    holds it (exclusively, or at all for an exclusive claim) or it is gone. `name` (default `path`) keys the
    claim: a folder made under a temp name and renamed into place keeps its lock under its final name.

    An earlier claim of this process under the same name is dropped first: in one process, a new run of a stage
    supersedes its last one (a run that failed in-process leaves its claim until then)."""
    key = os.path.abspath(name if name is not None else path)
    release(key)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # gone (renamed or deleted), or unreadable: not ours to take
        return False
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.stat(path)):  # still the file at `path`, not one moved away
            _HELD[key] = fd
            return True
    except OSError:  # BlockingIOError: held; FileNotFoundError: moved away meanwhile
        pass
    os.close(fd)
    return False


def release(name) -> None:
    """Drop this process's claim under `name`, if any."""
    fd = _HELD.pop(os.path.abspath(name), None)
    if fd is not None:
        os.close(fd)
