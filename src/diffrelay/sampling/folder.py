"""The sample output folder: who may replace it, the work folder the processes of a job share, done
markers, and the manifest's per-file record that says whether a finished folder is still intact.

A job works in `<parent>/.<out>.partial/`; a killed job's restart continues there. `out` itself is only
ever replaced when its manifest shows `diffrelay sample` made it.
"""

import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from diffrelay import io
from diffrelay.errors import UserError
from diffrelay.runtime import claims

MANIFEST_FORMAT = "diffrelay-samples/2"  # /2 added per-file sizes and hashes
OLD_FORMATS = ("diffrelay-samples/1",)
PNG_NAME = re.compile(r"^\d{6}\.png\Z")
PROMPT_NAME = re.compile(r"^\d{6}\.txt\Z")  # a text run's prompt beside each image (sampling/prompted.py)
NPZ_NAME = "samples.npz"  # sample.npz: the images as one array (export.py)
WAIT_SECONDS = 600  # how long a non-zero rank waits for rank 0 to set up the work folder


def png_name(i: int) -> str:
    return f"{i:06d}.png"


def image_files(folder) -> list[Path]:
    """The numbered sample PNGs of a folder (not grid.png), in index order."""
    return sorted(p for p in Path(folder).iterdir() if PNG_NAME.match(p.name))


def work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def read_json_or_none(path: Path):
    """A JSON file's content, or None when it is missing or unreadable (the markers, settings and manifests here)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def up_to_date(out: Path, key: dict) -> dict | None:
    """The manifest of `out` when it was made with the same pixel settings and snapshot bytes (no file check)."""
    m = read_json_or_none(out / "manifest.json")
    if isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT and {k: m.get(k) for k in key} == key:
        return m
    return None


def file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": io.sha256_file(path)}


def damaged_files(folder: Path, manifest: dict) -> list[str]:
    """Files of a finished folder whose size or sha256 differ from its manifest (missing ones too).

    The size is compared first, so a truncated file costs no hashing; the rest is one read of each file."""
    bad = []
    for name, want in manifest["files"].items():
        path = folder / name
        try:
            if path.stat().st_size != want["bytes"] or io.sha256_file(path) != want["sha256"]:
                bad.append(name)
        except OSError:
            bad.append(name)
    return bad


def is_sample_folder(path) -> bool:
    """`path` is a finished sample folder (its manifest.json names our format): safe to replace."""
    m = read_json_or_none(Path(path) / "manifest.json")
    return isinstance(m, dict) and m.get("format") in (MANIFEST_FORMAT, *OLD_FORMATS)


def _is_work_folder(path) -> bool:
    """Only names this stage writes in a work folder: images, markers, settings, grid, npz, temp files."""
    names = ("settings.json", "grid.png", "manifest.json", NPZ_NAME)
    return all(PNG_NAME.match(n) or PROMPT_NAME.match(n) or n.startswith(("done-", ".")) or n in names
               for n in os.listdir(path))


def check_out(out: Path) -> None:
    """Refuse an --out that is not ours to replace, before any work: nothing of the user's is deleted."""
    here = Path.cwd().resolve()
    resolved = out.resolve()
    if out.name in ("", ".", "..") or resolved == here or resolved in here.parents:
        raise UserError(f"--out {out}: is the current folder or one of its parents; give a new folder such as "
                        f"samples/step_0000400")
    fix = "give --out a new or empty folder, or a sample folder made by `diffrelay sample`"
    io.check_replaceable(out, is_sample_folder, f"a sample folder (no {MANIFEST_FORMAT} manifest.json)", fix)
    io.check_replaceable(work_dir(out), _is_work_folder, "a sample work folder", f"move it aside; {fix}")


def open_work(work: Path, out: Path, key: dict, rank: int, seen: dict | None = None) -> bool:
    """Rank 0 makes the folder (clearing one of other settings that no live process holds); the others wait until it
    matches. Every process then claims it until it ends (_hold).

    False when `out` turned up to date meanwhile (another process finalized with markers of an earlier launch).
    seen: the manifest of the finished folder this launch remakes (damaged files, samples.npz to add or remove):
    it is up to date by its key, so only another manifest means finished meanwhile.
    """
    settings_file = work / "settings.json"
    if rank == 0:
        if work.exists() and read_json_or_none(settings_file) != key:
            io.check_replaceable(work, _is_work_folder, "a sample work folder", "move it aside and rerun")
            _clear(work, out)
        if not work.exists():
            # Made whole, settings inside, in one rename: a second run into the same --out never sees it
            # half-made (and so never clears it as a folder of other settings). Claimed before it is seen.
            work.parent.mkdir(parents=True, exist_ok=True)
            fresh = Path(tempfile.mkdtemp(dir=work.parent, prefix=f"{work.name}.", suffix=".new"))
            io.write_json(fresh / "settings.json", key)
            claims.claim(fresh / "settings.json", name=settings_file)
            try:
                os.rename(fresh, work)
                return True
            except OSError:  # another process made it first
                claims.release(settings_file)
                shutil.rmtree(fresh, ignore_errors=True)
                if read_json_or_none(settings_file) != key:
                    raise _busy(out) from None
        return _hold(work, out, key, seen)
    deadline = time.monotonic() + WAIT_SECONDS
    while read_json_or_none(settings_file) != key:
        if up_to_date(out, key) not in (None, seen):
            return False
        if time.monotonic() > deadline:
            raise UserError(f"{work}: process 0 did not set up the work folder in {WAIT_SECONDS} s; "
                            "check its log, delete the folder and rerun")
        time.sleep(0.05)
    return _hold(work, out, key, seen)


def _busy(out: Path) -> UserError:
    return UserError(f"{out}: another run is sampling into it with other settings; wait for it to finish or give "
                     "another --out")


def _hold(work: Path, out: Path, key: dict, seen: dict | None) -> bool:
    """Claim the work folder (its settings.json, shared) for the rest of this process: every sampler holds one
    while it runs, so a run with other settings never clears a folder in use. False when `out` turned up to date
    meanwhile (finalized by another run of these settings)."""
    settings_file = work / "settings.json"
    if claims.claim(settings_file):
        if read_json_or_none(settings_file) == key:  # not replaced between reading it and claiming it
            return True
        claims.release(settings_file)
    if up_to_date(out, key) not in (None, seen):
        return False
    raise _busy(out)


def _clear(work: Path, out: Path) -> None:
    """Move aside and delete a work folder of other settings, only when no live process uses it: a sampler holds
    its settings.json from before the folder appears until it ends (_hold), and a finalizer the folder (lock)."""
    settings_file = work / "settings.json"
    if os.path.lexists(settings_file) and not claims.claim(settings_file, shared=False):
        raise _busy(out)
    fd = lock(work)
    try:
        if fd is None:
            if os.path.lexists(work):
                raise _busy(out)
            return
        stale = Path(tempfile.mkdtemp(dir=work.parent, prefix=f"{work.name}.", suffix=".stale"))
        os.replace(work, stale / "x")
        shutil.rmtree(stale, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)
        claims.release(settings_file)


def reuse_intact(out: Path, work: Path, mine, damaged: set) -> None:
    """Hard-link this process's intact images of a damaged finished folder into the work folder, so only
    the damaged ones are made again. A later atomic write replaces a link, never the file it shares."""
    for i in mine:
        name = png_name(i)
        prompt = Path(name).with_suffix(".txt")  # a text run's prompt: linked first, as sample.py writes it first
        if name not in damaged and prompt.name not in damaged and not (work / name).exists():
            try:
                if (out / prompt).exists() and not (work / prompt).exists():
                    os.link(out / prompt, work / prompt)
                os.link(out / name, work / name)
            except OSError:
                return  # another file system, or gone: those images are simply made again


def marker(work: Path, rank: int, world: int) -> Path:
    # A marker says "all of this rank's images are in the folder"; that stays true, so a marker left by an
    # earlier launch with the same process count counts too. Other process counts split differently.
    return work / f"done-{rank}-of-{world}.json"


def lock(work: Path):
    """An exclusive non-blocking lock on the work folder itself, or None if another process holds it or
    has already renamed it. The lock dies with its process, so a killed finalizer blocks nobody."""
    try:
        fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.stat(work)):
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None
