"""data.random_crop: each folder image is also kept resized to cover the square, its short side data.resolution and
its long side in proportion, so that each step cuts its square at a random place along the long side (kohya
sd-scripts' random_crop; docs/data.md, "Random crop"). The centred square (images.npy) stays what FID's reference
and the held-out split read.

Stored ragged beside images.npy: FILE, every image's uint8 (h, w, 3) pixels one after another, and INDEX, int64
(N, 3) of each row's offset, height and width. Both are memory-mapped: a step reads its rows' bytes alone.
A row's place is two draws u in [0, 1) from (seed, step, position) (augment.CROP, CROP + 1), the window's top
floor(u x (H - h + 1)) and left likewise: the same for any process count and on resume. With data.buckets the
image is kept resized to cover its bucket (buckets.cover) and its bucket's window is cut, and SDXL's crop_top_left
of the row is that step's. Latents are encoded once, so a latent run cannot crop at random (refused, as kohya
refuses random_crop with cache_latents).
"""

import os
from pathlib import Path

import numpy as np
from PIL import Image

from diffrelay import io
from diffrelay.data import buckets
from diffrelay.errors import UserError

FILE, INDEX = "wide.u8", "wide_index.npy"


def wanted(data) -> bool:
    """Whether the run, or one of its subsets, crops at random (a config section or its dict)."""
    data = data.to_dict() if hasattr(data, "to_dict") else data
    return bool(data.get("random_crop") or any(s.get("random_crop") for s in data.get("subsets") or []))


def check_config(d: dict) -> list[tuple[str, str]]:
    data = d["data"]
    if not wanted(data):
        return []
    key = "data.random_crop=true" if data.get("random_crop") else "data.subsets[].random_crop=true"
    if data["kind"] != "folder":
        return [(key, "cuts folder images; shapes are drawn at data.resolution: drop it")]
    if data.get("encoder", "none") != "none":
        return [(key, f"needs the pixels at each step, and data.encoder={data['encoder']} trains on latents encoded "
                 "once (kohya refuses random_crop with cache_latents too); set data.encoder: none, or drop it")]
    if data.get("crop") != "center":
        return [(key, f"replaces the centre crop; data.crop={data.get('crop')} is a fixed protocol: set data.crop: "
                 "center, or drop random_crop")]
    return []


def resized(img: Image.Image, resolution: int, bucket: tuple | None = None) -> np.ndarray:
    """uint8 (h, w, 3): the whole image resized, Lanczos, to cover the square (its short side at `resolution`) or
    the bucket (w, h), as buckets.cover sizes it before the centred cut."""
    w, h = img.size
    if bucket is not None:
        size = buckets.cover(w, h, bucket)[0]
    else:
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

    def crops(self, rows: np.ndarray, u_top: np.ndarray, u_left: np.ndarray, width: int,
              height: int) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 (len(rows), height, width, 3), int64 (len(rows), 2)): each row's window at its draws, and its
        top and left in the resized image (SDXL's crop_top_left of a bucketed row)."""
        out = np.empty((len(rows), height, width, 3), dtype=np.uint8)
        where = np.zeros((len(rows), 2), dtype=np.int64)
        for k, (row, ut, ul) in enumerate(zip(rows, u_top, u_left)):
            off, h, w = (int(v) for v in self.index[row])
            a = self.flat[off:off + h * w * 3].reshape(h, w, 3)
            top, left = int(ut * (h - height + 1)), int(ul * (w - width + 1))
            out[k], where[k] = a[top:top + height, left:left + width], (top, left)
        return out, where


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
    if index.shape != (n, 3) or index.dtype != np.int64 or (len(index) and int(ends[-1]) != flat.size):
        raise UserError(f"{path / FILE}: does not match {INDEX} and dataset.json (count={n}); {fix}")
    return Wide(flat, index, r)
