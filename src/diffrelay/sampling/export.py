"""samples.npz (sample.npz): a sample folder's images as one array, in the file OpenAI's ADM evaluator reads.

DiT's and SiT's sample_ddp.py and guided-diffusion's image_sample.py write `arr_0`, uint8 N x H x W x 3, and
image_sample.py the class labels as `arr_1` (int64, N); guided-diffusion's evaluations/evaluator.py reads
arr_0. The array is built from the finished PNG files, so it holds exactly their pixels (a one-channel image
is repeated into RGB, as the FID stage decodes it). Like every file of the folder, the manifest records its
size and sha256: a damaged or deleted npz is made again, from the intact PNGs.
"""

import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

from diffrelay import io
from diffrelay.sampling.folder import NPZ_NAME, damaged_files, png_name


def write_npz(folder: Path, num_images: int, labels: list[int] | None) -> Path:
    """folder/samples.npz from folder's PNGs 0..num_images-1 (and the labels, None for an unconditional model),
    written atomically. Streamed: one image in memory at a time (50,000 images of 512 px are 39 GB), into the
    .npy members of an uncompressed zip, which is what np.savez writes and np.load reads."""
    folder = Path(folder)
    path = folder / NPZ_NAME
    with io.atomic_write(path, parents=False) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        with z.open("arr_0.npy", "w", force_zip64=True) as member:
            for i in range(num_images):
                with Image.open(folder / png_name(i)) as im:
                    pixels = np.asarray(im.convert("RGB"), dtype=np.uint8)
                if i == 0:  # plain uint8: np.load reads it with allow_pickle=False
                    np.lib.format.write_array_header_2_0(member, {"descr": "|u1", "fortran_order": False,
                                                                  "shape": (num_images, *pixels.shape)})
                member.write(np.ascontiguousarray(pixels).tobytes())
        if labels is not None:
            with z.open("arr_1.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(labels, dtype=np.int64), allow_pickle=False)
    return path


def finish(work: Path, npz: bool, num_images: int, labels: list[int] | None) -> list[Path]:
    """The exports of a work folder about to be finalized, to record in its manifest: samples.npz when npz
    (written anew), else none (one a killed finalize left there is removed: the folder must match the setting)."""
    if npz:
        return [write_npz(work, num_images, labels)]
    (Path(work) / NPZ_NAME).unlink(missing_ok=True)
    return []


def check(out: Path, manifest: dict, npz: bool) -> tuple[list[str], list[str]]:
    """(damaged, changed) for a finished folder: files differing from its manifest (its samples.npz only when
    wanted), and [samples.npz] when sample.npz asks for it and the manifest has none, or the other way round."""
    recorded = NPZ_NAME in manifest["files"]
    if recorded and not npz:  # to be removed: not worth hashing
        manifest = {**manifest, "files": {k: v for k, v in manifest["files"].items() if k != NPZ_NAME}}
    return damaged_files(out, manifest), [NPZ_NAME] if recorded != npz else []
