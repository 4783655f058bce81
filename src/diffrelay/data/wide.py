"""data.random_crop: each folder image is also kept resized to cover the square, its short side data.resolution and
its long side in proportion, so that each step cuts its square at a random place along the long side (kohya
sd-scripts' random_crop; docs/data.md, "Random crop"). The centred square (images.npy) stays what FID's reference
and the held-out split read.

Stored ragged beside images.npy: FILE, every image's uint8 (h, w, 3) pixels one after another, and INDEX, int64
(N, 3) of each row's offset, height and width. Both are memory-mapped: a step reads its rows' bytes alone.
A row's place is u in [0, 1) drawn from (seed, step, position) (augment.CROP), the window's start floor(u x (L - r
+ 1)) along the long side L: the same for any process count and on resume. Latents are encoded once, so a latent
run cannot crop at random (refused, as kohya refuses random_crop with cache_latents).
"""

import os
from pathlib import Path

import numpy as np
from PIL import Image

from diffrelay import io
from diffrelay.errors import UserError

FILE, INDEX = "wide.u8", "wide_index.npy"


def check_config(d: dict) -> list[tuple[str, str]]:
    data = d["data"]
    if not data.get("random_crop"):
        return []
    key = "data.random_crop=true"
    if data["kind"] != "folder":
        return [(key, "cuts folder images; shapes are drawn at data.resolution: drop it")]
    if data.get("encoder", "none") != "none":
        return [(key, f"needs the pixels at each step, and data.encoder={data['encoder']} trains on latents encoded "
                 "once (kohya refuses random_crop with cache_latents too); set data.encoder: none, or drop it")]
    if data.get("buckets") is not None:
        return [(key, "inside a bucket is not built yet; set data.buckets: null, or drop it")]
    if data.get("crop") != "center":
        return [(key, f"replaces the centre crop; data.crop={data.get('crop')} is a fixed protocol: set data.crop: "
                 "center, or drop random_crop")]
    return []


def resized(img: Image.Image, resolution: int) -> np.ndarray:
    """uint8 (h, w, 3): the whole image with its short side at `resolution`, Lanczos (as crop.center's square)."""
    w, h = img.size
    size = (resolution, max(resolution, round(h * resolution / w))) if w <= h else \
        (max(resolution, round(w * resolution / h)), resolution)
    return np.asarray(img.resize(size, Image.Resampling.LANCZOS), dtype=np.uint8)


class Writer:
    """Appends each kept row's resized image, in row order (datasets.build)."""

    def __init__(self, out: Path):
        self.out, self.index = Path(out), []
        self.file = open(self.out / FILE, "wb")  # inside prepare's temporary folder: renamed whole, or removed
        self.offset = 0

    def add(self, a: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(a, dtype=np.uint8).tobytes())
        self.index.append((self.offset, a.shape[0], a.shape[1]))
        self.offset += a.size

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        np.save(self.out / INDEX, np.asarray(self.index, dtype=np.int64).reshape(-1, 3))


class Wide:
    """The resized images of a prepared dataset, cut at a random place."""

    def __init__(self, flat: np.ndarray, index: np.ndarray, resolution: int):
        self.flat, self.index, self.resolution = flat, index, resolution

    def crops(self, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
        """uint8 (len(rows), r, r, 3): each row's square at its draw u."""
        r = self.resolution
        out = np.empty((len(rows), r, r, 3), dtype=np.uint8)
        for k, (row, x) in enumerate(zip(rows, u)):
            off, h, w = (int(v) for v in self.index[row])
            a = self.flat[off:off + h * w * 3].reshape(h, w, 3)
            start = int(x * (max(h, w) - r + 1))
            out[k] = a[:, start:start + r] if w > h else a[start:start + r, :]
        return out


def open_store(path: Path, info: dict, n: int, fix: str) -> Wide | None:
    """The store of a dataset prepared with data.random_crop (None without it), checked against dataset.json."""
    if not info.get("random_crop"):
        return None
    try:
        io.check_regular_file(path / INDEX, 1 << 40, "dataset array", fix)
        io.check_regular_file(path / FILE, 1 << 50, "dataset array", fix)
        index = np.load(path / INDEX)
        flat = np.memmap(path / FILE, dtype=np.uint8, mode="r") if (path / FILE).stat().st_size else \
            np.zeros(0, dtype=np.uint8)
    except (OSError, ValueError) as e:
        raise UserError(f"{path / INDEX}: missing or unreadable ({e}); {fix}") from e
    r = info["resolution"]
    ends = index[:, 0] + index[:, 1] * index[:, 2] * 3 if len(index) else np.zeros(0, dtype=np.int64)
    if index.shape != (n, 3) or index.dtype != np.int64 or (len(index) and (int(ends[-1]) != flat.size or
                                                                              index[:, 1:].min() < r)):
        raise UserError(f"{path / FILE}: does not match {INDEX} and dataset.json (count={n}, each side at least "
                        f"{r}); {fix}")
    return Wide(flat, index, r)
