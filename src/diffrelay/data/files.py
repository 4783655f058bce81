"""Image folders: listing their images, hashing them, labels from subfolders, and decoding any PIL mode to RGB."""

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from diffrelay import io
from diffrelay.errors import UserError

EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
MAX_IMAGE_BYTES = 1 << 30  # one image file; a bigger one is a video, an archive or a wrong path


def list_images(root, key: str = "data.path") -> list[tuple[str, Path]]:
    """(relative posix path, path) of every image under `root`, sorted by relative path.

    Recursive; extensions .png .jpg .jpeg .webp in any case. Names starting with "." (files or folders)
    are ignored: they are hidden files such as macOS "._x.jpg" resource forks, which are not images.
    Symlinked folders are not followed; symlinked files are, and a dangling one counts as unreadable.
    """
    root = Path(root)
    if not root.exists():
        raise UserError(f"{root}: {key}: folder not found; set {key} to an existing image folder")
    if not root.is_dir():
        raise UserError(f"{root}: {key}: is a file, not a folder; set {key} to the folder that holds the images")

    def unreadable_folder(e: OSError):
        # os.walk would silently leave out a folder it cannot list; a dataset missing a class is worse.
        raise UserError(f"{e.filename}: cannot list folder ({e.strerror}); {io.advice(e)}") from e

    found = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable_folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.lower().endswith(EXTENSIONS):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise UserError(f"{root}: {key}: no images found (searched recursively for "
                        f"{', '.join(EXTENSIONS)}, any case); add images or point {key} at another folder")
    return sorted(found)


def unopenable(path: Path, e: OSError) -> str:
    why = "dangling symlink" if path.is_symlink() and not path.exists() else (e.strerror or str(e))
    return f"{path}: cannot open image file ({why}); fix or remove it, or set data.on_corrupt: skip"


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
