"""Image folders: listing their images, hashing them, labels from subfolders, opening an image within a pixel bound
(data.max_image_pixels), and decoding any PIL mode to RGB. Messages write a file's name with io.shown: a newline in
a name is an escape, not a second line."""

import contextlib
import os
import re
import threading
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from diffrelay import io
from diffrelay.errors import UserError

EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
MAX_IMAGE_BYTES = 1 << 30  # one image file; a bigger one is a video, an archive or a wrong path
# data.max_image_pixels' default: Pillow's own bound (Image.MAX_IMAGE_PIXELS, about 0.25 GiB of RGB pixels), past
# which it warns of a decompression bomb naming no file; a 420 KB PNG can hold 12000 x 12000 pixels (1.7 GB decoded).
MAX_IMAGE_PIXELS = 89_478_485
_PILLOW_BOUND = threading.Lock()  # Image.MAX_IMAGE_PIXELS is one global: one open_image at a time changes it


class ImageTooLarge(UserError):
    """An image past data.max_image_pixels (skipped, not refused, with data.on_corrupt: skip)."""


def list_images(root, key: str = "data.path") -> list[tuple[str, Path]]:
    """(relative posix path, path) of every image under `root`, sorted by relative path.

    Recursive; extensions .png .jpg .jpeg .webp in any case. Names starting with "." (files or folders)
    are ignored: they are hidden files such as macOS "._x.jpg" resource forks, which are not images.
    Symlinked folders are not followed; symlinked files are, and a dangling one counts as unreadable.
    """
    root = Path(root)
    if not root.exists():
        raise UserError(f"{io.shown(root)}: {key}: folder not found; set {key} to an existing image folder")
    if not root.is_dir():
        raise UserError(f"{io.shown(root)}: {key}: is a file, not a folder; set {key} to the folder that holds the "
                        "images")

    def unreadable_folder(e: OSError):
        # os.walk would silently leave out a folder it cannot list; a dataset missing a class is worse.
        raise UserError(f"{io.shown(e.filename)}: cannot list folder ({e.strerror}); {io.advice(e)}") from e

    found = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable_folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.lower().endswith(EXTENSIONS):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise UserError(f"{io.shown(root)}: {key}: no images found (searched recursively for "
                        f"{', '.join(EXTENSIONS)}, any case); add images or point {key} at another folder")
    return sorted(found)


def unopenable(path: Path, e: OSError) -> str:
    why = "dangling symlink" if path.is_symlink() and not path.exists() else (e.strerror or str(e))
    return f"{io.shown(path)}: cannot open image file ({why}); fix or remove it, or set data.on_corrupt: skip"


def too_large(path, width: int, height: int, max_pixels: int) -> str:
    return (f"{io.shown(path)}: {width}x{height} = {width * height:,} pixels, more than data.max_image_pixels="
            f"{max_pixels:,} (at least {width * height * 3 / 2**30:.1f} GiB decoded); shrink the image, raise "
            "data.max_image_pixels, or set data.on_corrupt: skip")


@contextlib.contextmanager
def open_image(source, path, max_pixels: int = MAX_IMAGE_PIXELS):
    """The open PIL image of `source` (a path, or a file object of the bytes of the file at `path`), its size read
    from the header before any pixel is decoded: ImageTooLarge past `max_pixels`, naming the file, its size and
    the key. Pillow's own decompression-bomb bound gives way to it: raised to `max_pixels` (where that is higher)
    while the image is open, its warning, which names no file, silenced (past twice its bound it refuses inside
    Image.open: said here the same way)."""
    with _PILLOW_BOUND, warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        saved = Image.MAX_IMAGE_PIXELS
        if saved is not None:
            Image.MAX_IMAGE_PIXELS = max(saved, max_pixels)
        try:
            try:
                img = Image.open(source)
            except Image.DecompressionBombError as e:
                n = re.search(r"\((\d+) pixels\)", str(e))  # Pillow's message holds the count
                count = f"{int(n.group(1)):,}" if n else "too many"
                raise ImageTooLarge(f"{io.shown(path)}: {count} pixels, more than data.max_image_pixels="
                                    f"{max_pixels:,}; shrink the image, or set data.on_corrupt: skip") from e
            with img:
                if img.size[0] * img.size[1] > max_pixels:
                    raise ImageTooLarge(too_large(path, *img.size, max_pixels))
                yield img
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def unreadable(path: Path, max_pixels: int = MAX_IMAGE_PIXELS) -> str | None:
    """Why prepare would skip the image at `path` with data.on_corrupt skip (one line), None when it decodes: every
    byte is decoded as prepare decodes it, a JPEG at a fraction of its size (Pillow's draft: the same bytes read)."""
    try:
        io.check_regular_file(path, MAX_IMAGE_BYTES, "image file")
        with open_image(path, path, max_pixels) as img:
            img.draft("RGB", (64, 64))
            to_rgb(img)
    except UserError as e:
        return str(e).split("; ")[0]
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:  # as datasets._file_row
        why = "not an image format PIL recognises" if isinstance(e, UnidentifiedImageError) else str(e)
        return f"{io.shown(path)}: corrupt or unsupported image ({why})"
    return None


def hash_files(root, on_corrupt: str = "error", key: str = "data.path") -> tuple:
    """(relative path, sha256 of bytes) per image; sha is None for an unreadable file when skipping.

    Only regular files are opened: a FIFO or a link to a device named like an image would block forever."""
    out = []
    for rel, path in list_images(root, key):
        try:
            io.check_regular_file(path, MAX_IMAGE_BYTES, "image file",
                                  "fix or remove it, or set data.on_corrupt: skip")
            out.append((rel, io.sha256_file(path)))
        except UserError:
            if on_corrupt != "skip":
                raise
            out.append((rel, None))
        except OSError as e:
            if on_corrupt != "skip":
                raise UserError(unopenable(path, e)) from e
            out.append((rel, None))
    return tuple(out)


def folder_labels(rels) -> tuple[list[int], list[str]]:
    """Class labels of relative paths, from their first-level subfolder.

    Labelled only when every image sits inside a first-level subfolder (a/x.png, a/b/y.png: class "a") and
    there are at least 2 such subfolders; class index = position of the name in sorted order. Otherwise
    every label is 0 and there are no class names (an unlabelled dataset).
    """
    tops = [r.split("/")[0] if "/" in r else None for r in rels]
    if None in tops or len(set(tops)) < 2:
        return [0] * len(rels), []
    names = sorted(set(tops))
    index = {n: i for i, n in enumerate(names)}
    return [index[t] for t in tops], names


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB. Transparent pixels are composited over white: their stored colour is
    arbitrary (often black), and white is how image viewers and web pages usually show transparency."""
    img = ImageOps.exif_transpose(img)  # phone photos store rotation in EXIF
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit greyscale: scale to 8 bits; PIL's own convert() would clip everything above 255 to white.
        a = np.asarray(img, dtype=np.float64)
        img = Image.fromarray(np.clip(np.rint(a / 257.0), 0, 255).astype(np.uint8), "L")
    if (img.mode == "P" and "transparency" in img.info) or img.mode in ("PA", "LA", "La", "RGBa"):
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img).convert("RGB")
    return img.convert("RGB")


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) from the file's header (nothing decoded); (0, 0) when it cannot be read: too small."""
    try:
        with Image.open(path) as img:
            return img.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return 0, 0
