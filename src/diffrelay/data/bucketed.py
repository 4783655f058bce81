"""A bucketed dataset folder (data.buckets; the sizes and the cut: data/buckets.py): what prepare writes beside
the usual arrays, and how training opens it.

  images.<W>x<H>.npy         uint8 (n_b, H, W, 3): a pixel dataset's images of bucket W x H, in dataset-row order
  latents.<W>x<H>.npy        float32 (n_b, 2C, H/f, W/f): a latent dataset's, as latents.npy (data/latents.py)
  latents_xflip.<W>x<H>.npy  the mirrored images' (data.xflip > 0)
  rows.npy                   int64 (N, 2): each dataset row's bucket and its row in that bucket's arrays
  sizes.npy                  int64 (N, 4): each row's original height and width (after its EXIF rotation) and
                             the crop's top and left in the resized image (SDXL's original_size, crop_top_left)

images.npy stays the centred squares at data.resolution: the FID reference, like for like with the square
samples; labels.npy and captions.json keep the rows in file order. dataset.json's "buckets" holds the settings,
the sizes, each bucket's count and the merged buckets. A memory-mapped read takes a batch's rows of one bucket:
O(batch) per step at any dataset size.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diffrelay import io
from diffrelay.data import buckets
from diffrelay.data.buckets import file_name
from diffrelay.errors import UserError

ROWS, SIZES = "rows.npy", "sizes.npy"
FIX = "rerun `diffrelay prepare --config <your config>`"


@dataclass(frozen=True)
class Buckets:
    sizes: tuple  # (width, height) in pixels of each bucket
    rows: np.ndarray  # int64 (N, 2): bucket, row in its arrays
    meta: np.ndarray  # int64 (N, 4): original height, width, crop top, left
    arrays: tuple  # per bucket: uint8 images (pixel datasets) or float32 latents
    flipped: tuple  # per bucket: the mirrored images' latents, or None
    settings: dict

    def members(self) -> list[np.ndarray]:
        """The dataset rows of each bucket, ascending (one pass over rows.npy)."""
        b = np.asarray(self.rows[:, 0])
        order = np.argsort(b, kind="stable")
        return np.split(order, np.cumsum(np.bincount(b, minlength=len(self.sizes)))[:-1])


class Writer:
    """A pixel dataset's bucket arrays, filled image by image in source order (datasets.build)."""

    def __init__(self, p, out: Path):
        self.out, self.sizes = Path(out), p.buckets
        counts = np.bincount([b for b in p.bucket_of if b >= 0], minlength=len(p.buckets))
        self.arrays = [np.lib.format.open_memmap(self.out / file_name("images", s), mode="w+", dtype=np.uint8,
                                                 shape=(int(n), s[1], s[0], 3)) for s, n in zip(p.buckets, counts)]
        self.filled, self.rows, self.meta = [0] * len(p.buckets), [], []

    def add(self, bucket: int, image: np.ndarray, sizes: tuple) -> None:
        self.arrays[bucket][self.filled[bucket]] = image
        self.rows.append((bucket, self.filled[bucket]))
        self.meta.append(sizes)
        self.filled[bucket] += 1

    def close(self) -> None:
        for s, a, n in zip(self.sizes, self.arrays, self.filled):
            a.flush()
            if n < len(a):  # files skipped while decoding: keep the rows filled
                path = self.out / file_name("images", s)
                np.save(path.with_suffix(".kept.npy"), np.load(path, mmap_mode="r")[:n])
                path.with_suffix(".kept.npy").replace(path)
        self.arrays = []
        write_index(self.out, self.rows, self.meta)


def write_index(out: Path, rows, meta) -> None:
    np.save(Path(out) / ROWS, np.asarray(rows, dtype=np.int64).reshape(-1, 2))
    np.save(Path(out) / SIZES, np.asarray(meta, dtype=np.int64).reshape(-1, 4))


def record(p, out: Path) -> dict:
    """dataset.json's "buckets": settings, sizes, counts."""
    rows = np.load(Path(out) / ROWS)
    counts = np.bincount(rows[:, 0], minlength=len(p.buckets)) if len(rows) else np.zeros(len(p.buckets), int)
    return {"settings": p.bucket_settings, "sizes": [list(s) for s in p.buckets], "counts": counts.tolist()}


def _load(path: Path, shape: tuple, dtype) -> np.ndarray:
    if path.exists():
        io.check_regular_file(path, 1 << 44, "dataset array", FIX)
    try:
        a = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: missing or unreadable ({e}); {FIX}") from e
    if a.shape != shape or a.dtype != dtype:
        raise UserError(f"{path}: shape {a.shape} {a.dtype} does not match dataset.json ({shape}, {np.dtype(dtype)}); "
                        f"{FIX}")
    return a


def open_arrays(path, info: dict, count: int) -> Buckets:
    """A bucketed dataset's arrays, memory-mapped and checked against dataset.json."""
    path, rec = Path(path), info["buckets"]
    try:
        sizes = tuple((int(w), int(h)) for w, h in rec["sizes"])
        counts, settings = [int(n) for n in rec["counts"]], dict(rec["settings"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path / 'dataset.json'}: its \"buckets\" entry is incomplete ({e}); {FIX}") from e
    rows, meta = _load(path / ROWS, (count, 2), np.int64), _load(path / SIZES, (count, 4), np.int64)
    latent = info.get("latent")
    arrays, flipped = [], []
    for (w, h), n in zip(sizes, counts):
        if latent is None:
            arrays.append(_load(path / file_name("images", (w, h)), (n, h, w, 3), np.uint8))
            flipped.append(None)
            continue
        c, f = latent["channels"], latent["factor"]
        shape = (n, 2 * c, h // f, w // f)
        arrays.append(_load(path / file_name("latents", (w, h)), shape, np.float32))
        flipped.append(_load(path / file_name("latents_xflip", (w, h)), shape, np.float32) if latent.get("xflip")
                       else None)
    return Buckets(sizes, rows, meta, tuple(arrays), tuple(flipped), settings)


def describe(rec: dict) -> list[str]:
    """`validate`'s lines: each bucket, its count and its crop, then what was merged (buckets.lines)."""
    return buckets.lines(rec["settings"], rec["sizes"], rec["counts"])


def check_batches(data, global_batch: int, source: str) -> None:
    """Every bucket fills at least one global batch: a smaller one's images would never be trained."""
    b = data.buckets
    counts = np.bincount(np.asarray(b.rows[:, 0]), minlength=len(b.sizes)) if data.count else []
    for (w, h), n in zip(b.sizes, counts):
        if 0 < n < global_batch:
            raise UserError(f"{data.path}: bucket {w}x{h} holds {n} image(s), fewer than one global batch "
                            f"(train.batch_size={global_batch}), so they would never be trained; {source}: set "
                            f"data.buckets.min_images null (merges it at prepare) or at least {global_batch}, or "
                            "lower train.batch_size (files skipped while decoding, if any: dataset.json's skipped)")
