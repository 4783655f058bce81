"""Whether a memory-mapped array's file still holds all of it, checked before each read.

Reading a page past the end of a file that was truncated under the mapping is a SIGBUS: the process dies with
"Bus error" (exit 135) and no word of which file. One fstat before each batch or chunk turns that into one line
naming the file. (A truncation in the microseconds between the check and the read still kills the process.)
"""

import mmap
import os

from diffrelay.errors import UserError


def check_intact(array, during: str, fix: str) -> None:
    """UserError naming the file when `array` (a np.memmap, or an array with no file: nothing to check) lies past
    its file's end. `during` says what was going on ("training ran"); `fix` what to do."""
    name = getattr(array, "filename", None)
    if name is None:
        return
    mapping = getattr(array, "_mmap", None)
    try:
        # The mapped file itself (fstat of the mapping's own descriptor), not whatever now lies at its path; the
        # whole mapping (np.memmap maps from the page of `offset`), which a view of some rows shares.
        if mapping is not None:
            want = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY + len(mapping)
            size = mapping.size()
        else:
            want, size = array.offset + array.nbytes, os.stat(name).st_size
    except (OSError, ValueError) as e:
        raise UserError(f"{name}: gone while {during} ({e}); {fix}") from e
    if size < want:
        raise UserError(f"{name}: {size} bytes, {want} expected: the file was truncated or replaced while {during}; "
                        f"{fix}")
