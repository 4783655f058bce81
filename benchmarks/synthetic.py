"""A prepared dataset of random pixels written straight to disk: large sizes without `diffrelay prepare`."""

from pathlib import Path

import numpy as np


def write_dataset(folder, count: int, resolution: int = 8, classes: int = 10, chunk: int = 1 << 16) -> Path:
    """images.npy (memory-mapped, written a chunk at a time), labels.npy and dataset.json in
    datasets.open_prepared's format; the fingerprint names the synthetic content."""
    from diffrelay import io
    from diffrelay.data import datasets

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shape = (count, resolution, resolution, 3)
    images = np.lib.format.open_memmap(folder / "images.npy", mode="w+", dtype=np.uint8, shape=shape)
    rng = np.random.default_rng(count)
    for start in range(0, count, chunk):
        stop = min(start + chunk, count)
        images[start:stop] = rng.integers(0, 256, (stop - start, *shape[1:]), dtype=np.uint8)
    images.flush()
    del images
    np.save(folder / "labels.npy", np.arange(count, dtype=np.int64) % classes)
    io.write_json(folder / "dataset.json", {
        "format": datasets.FORMAT, "kind": "synthetic", "count": count, "resolution": resolution,
        "num_classes": classes, "class_names": [f"c{i}" for i in range(classes)], "labels": "auto",
        "fingerprint": f"synthetic-{count}-{resolution}-{classes}", "skipped": [], "source": "benchmarks/synthetic.py"})
    return folder


def write_latent_dataset(folder, count: int, channels: int = 4, side: int = 32, classes: int = 10,
                         chunk: int = 1 << 13) -> Path:
    """A latent dataset as `diffrelay prepare` writes one for data.encoder sd-vae with data.xflip (latents.npy and
    latents_xflip.npy: float32 (N, 2C, side, side), mean then std; no images.npy), of random values."""
    from diffrelay import io
    from diffrelay.data import datasets, latents

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shape = (count, 2 * channels, side, side)
    rng = np.random.default_rng(count)
    for name in (latents.ENCODED, latents.FLIPPED):
        array = np.lib.format.open_memmap(folder / name, mode="w+", dtype=np.float32, shape=shape)
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            part = rng.standard_normal((stop - start, *shape[1:]), dtype=np.float32)
            part[:, channels:] = np.abs(part[:, channels:]) * 0.1  # a std is positive
            array[start:stop] = part
        array.flush()
        del array
    np.save(folder / "labels.npy", np.arange(count, dtype=np.int64) % classes)
    latent = {"encoder": "sd-vae-ft-mse", "sha256": "synthetic", "path": None, "norm": "dit", "channels": channels,
              "factor": 8, "scale": [0.18215] * channels, "bias": [0.0] * channels, "xflip": True,
              "keep_images": False}
    io.write_json(folder / "dataset.json", {
        "format": datasets.FORMAT, "kind": "synthetic", "count": count, "resolution": side * 8,
        "num_classes": classes, "class_names": [f"c{i}" for i in range(classes)], "labels": "auto",
        "fingerprint": f"synthetic-latents-{count}-{side}-{classes}", "skipped": [], "latent": latent,
        "source": "benchmarks/synthetic.py"})
    return folder


# A photo set's mix of shapes, landscape first (3:2 and 4:3 cameras), then the square and the portraits; the
# widest and tallest buckets take the tails. Fractions by aspect ratio w / h, matched to the nearest bucket.
PHOTO_MIX = ((1.5, 0.34), (1.0, 0.22), (4 / 3, 0.14), (2 / 3, 0.12), (3 / 4, 0.08), (2.0, 0.05), (0.5, 0.05))


def bucket_counts(count: int, sizes: list, mix=PHOTO_MIX, minimum: int = 1) -> tuple[list, list, dict]:
    """(bucket sizes used, their counts, the merged buckets as dataset.json records them) of `count` images spread
    over `sizes` by `mix`, small buckets merged by buckets.merge at `minimum` (prepare's rule: min_images, by
    default one global batch)."""
    from diffrelay.data import buckets

    counts = {}
    for ratio, share in mix:
        b = buckets.nearest(int(ratio * 1000), 1000, sizes)
        counts[b] = counts.get(b, 0) + share
    total = sum(counts.values())
    counts = {b: int(count * share / total) for b, share in sorted(counts.items())}
    counts[max(counts, key=counts.get)] += count - sum(counts.values())
    into = buckets.merge(counts, sizes, minimum)
    merged = {}
    for b, n in counts.items():
        merged[into[b]] = merged.get(into[b], 0) + n
    used = sorted(b for b, n in merged.items() if n)
    name = [f"{w}x{h}" for w, h in sizes]
    gone = {name[b]: [counts[b], name[t]] for b, t in sorted(into.items()) if t != b}
    return [sizes[b] for b in used], [merged[b] for b in used], gone


def write_bucketed_dataset(folder, count: int, resolution: int, sizes: list, counts: list, settings: dict,
                           classes: int = 10, chunk: int = 1 << 16) -> Path:
    """A pixel dataset prepared with data.buckets (data/bucketed.py's layout): images.<W>x<H>.npy per bucket of
    random pixels, rows.npy (each row's bucket and its row there; the buckets' rows scattered over the dataset's
    order, as files of any shape come in any order), sizes.npy (original sizes and crops, made up) and
    dataset.json's "buckets" (`settings`: data.buckets as buckets.settings_of records it). images.npy, the FID
    squares, is a sparse file of zeros: training never reads it."""
    from diffrelay import io
    from diffrelay.data import bucketed, buckets, datasets

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(count)
    for (w, h), n in zip(sizes, counts):
        array = np.lib.format.open_memmap(folder / buckets.file_name("images", (w, h)), mode="w+", dtype=np.uint8,
                                          shape=(n, h, w, 3))
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            array[start:stop] = rng.integers(0, 256, (stop - start, h, w, 3), dtype=np.uint8)
        array.flush()
        del array
    squares = np.lib.format.open_memmap(folder / "images.npy", mode="w+", dtype=np.uint8,
                                        shape=(count, resolution, resolution, 3))
    del squares
    owner = rng.permutation(np.repeat(np.arange(len(sizes)), counts))
    rows = np.zeros(count, dtype=np.int64)
    for b in range(len(sizes)):
        mine = owner == b
        rows[mine] = np.arange(mine.sum())
    side = np.asarray(sizes, dtype=np.int64)[owner] * 3  # photos three times the bucket's size: no crop offsets
    meta = np.stack([side[:, 1], side[:, 0], np.zeros(count, np.int64), np.zeros(count, np.int64)], axis=1)
    bucketed.write_index(folder, np.stack([owner, rows], axis=1), meta)
    np.save(folder / "labels.npy", np.arange(count, dtype=np.int64) % classes)
    io.write_json(folder / "dataset.json", {
        "format": datasets.FORMAT, "kind": "synthetic", "count": count, "resolution": resolution,
        "num_classes": classes, "class_names": [f"c{i}" for i in range(classes)], "labels": "auto",
        "fingerprint": f"synthetic-buckets-{count}-{resolution}-{classes}-{sizes}-{counts}", "skipped": [],
        "source": "benchmarks/synthetic.py",
        "buckets": {"settings": settings,
                    "sizes": [list(s) for s in sizes], "counts": [int(n) for n in counts]}})
    return folder
