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
