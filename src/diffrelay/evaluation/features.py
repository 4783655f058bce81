"""Features of images for FID and its relatives: each image decoded once, then shaped for every extractor.

An extractor wants either clean-fid's view of an image (its resize for the mode, 299x299 in clean mode,
then its tensor conversion: what clean-fid's own ResizeDataset makes) or the image at its native size
(DINOv2, whose module resizes on the device, as edm2 does). Images of any size and aspect ratio: clean-fid's
resize makes every one 299 x 299 (no crop: a 1216 x 832 image is squeezed), DINOv2's module 224 x 224 alike; a
batch of native views of several sizes (a prompt entry's own size) goes through the extractor in runs of one
size. Images come from numbered files of a folder
or from the rows of a prepared images.npy; a row is the uint8 array its PNG decodes to, so both give the
same numbers as clean-fid's folder pipeline.
"""

import contextlib
import itertools
import re
from pathlib import Path

import numpy as np

from diffrelay.runtime import mapped, parallel
from diffrelay.errors import UserError

# clean-fid's image extensions; only numbered files (000000.png) count, so a sample folder's grid.png is skipped.
NUMBERED = re.compile(r"^\d+\.(bmp|jpg|jpeg|pgm|png|ppm|tif|tiff|webp)\Z", re.IGNORECASE)
NATIVE = "native"


def image_files(folder) -> list[Path]:
    """The numbered images of a folder (000000.png ...), sorted; at least 2 or UserError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: image folder not found")
    files = sorted(p for p in folder.iterdir() if NUMBERED.match(p.name) and p.is_file())
    if len(files) < 2:
        raise UserError(f"{folder}: {len(files)} numbered images (000000.png ...); FID/KID need at least 2")
    return files


def decode(path) -> np.ndarray:
    """(H, W, 3) uint8 pixels of an image file, as clean-fid's ResizeDataset reads them (PIL, RGB)."""
    from PIL import Image

    with Image.open(path) as im:
        return np.array(im.convert("RGB"))


class CleanView:
    """clean-fid's view of an image for `mode`: its resize (cleanfid.resize.build_resizer, what its ResizeDataset
    applies) and then torchvision's ToTensor, restated. cleanfid.utils imports torchvision for ToTensor alone,
    and torchvision's import pulls in torch._dynamo: about 1 s of every scoring job (docs/benchmarks.md#start-up).
    tests/test_fid.py compares the tensors and the scores with clean-fid's own pipeline."""

    def __init__(self, mode: str):
        from cleanfid.resize import build_resizer

        self.resize = build_resizer(mode)

    def __call__(self, pixels: np.ndarray):
        import torch

        out = self.resize(pixels)
        # ToTensor: HWC -> CHW; uint8 becomes float32 / 255, anything else keeps its dtype and values. clean-fid
        # then multiplies uint8 input by 255 again (legacy_tensorflow resizes nothing); the same two roundings here.
        t = torch.from_numpy(out.transpose((2, 0, 1))).contiguous()
        return t.to(torch.float32).div(255) * 255 if out.dtype == np.uint8 else t


def native_view(pixels: np.ndarray):
    """The image as a float (3, H, W) tensor in [0, 255], not resized."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float()


def view_of(ext, mode: str) -> str:
    """Which view an extractor takes: NATIVE for DINOv2 (it resizes inside), else clean-fid's for the mode,
    even where that resizes nothing (legacy_tensorflow), so the tensors are exactly clean-fid's."""
    return NATIVE if ext.kind == "dinov2" else mode


class Images:
    """Item i = {view: tensor} for image i: decoded once by `read(i)`, then shaped once per view."""

    def __init__(self, read, count: int, views):
        self.read, self.count = read, count
        self.views = {v: native_view if v == NATIVE else CleanView(v) for v in dict.fromkeys(views)}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i) -> dict:
        pixels = self.read(i)
        return {v: make(pixels) for v, make in self.views.items()}


def file_images(files, views) -> Images:
    files = [Path(f) for f in files]
    return Images(lambda i: decode(files[i]), len(files), views)


def array_images(images, index, views) -> Images:
    """Rows `index` of an (N, H, W, 3) uint8 array (a memory-mapped images.npy, or an ADM batch's arr_0)."""

    def row(i):
        # One fstat a row (about a microsecond): a file truncated under the mapping is one line, not a SIGBUS.
        mapped.check_intact(images, "its images were read",
                            "make it again (`diffrelay prepare` for a dataset) or copy it again, and rerun")
        return np.array(images[index[i]])

    return Images(row, len(index), views)


def features(items: Images, exts, mode: str, batch_size: int, device, workers: int = 1) -> list[np.ndarray]:
    """(N, D) float32 features of every item for each extractor, in the order of `exts`; for an extractor with
    heads, a dict of them instead (pool, spatial, probs: inception.Heads).

    The same batches as clean-fid's get_files_features, so the same numbers, but the items (decode and
    resize, which dominate) are made by `workers` threads, a few batches ahead of the extractors. Threads,
    not DataLoader processes: PIL and torch release the GIL for this work, and a scorer killed at its
    timeout leaves no worker processes behind."""
    import torch

    views = [view_of(e, mode) for e in exts]
    feats, batch = [[] for _ in exts], []

    def run():
        for out, ext, view in zip(feats, exts, views):
            for x in _same_shape(item[view] for item in batch):
                if ext.heads is None:
                    with torch.no_grad():  # clean-fid's get_batch_features
                        out.append(ext.fn(x.to(device)).detach().cpu().numpy())
                else:
                    with torch.no_grad():
                        out.append({k: v.cpu().numpy() for k, v in ext.heads(x.to(device)).items()})

    window = 2 * max(workers, -(-batch_size // 8))  # chunks of 8: about two batches in flight
    with contextlib.closing(parallel.ordered_map(items.__getitem__, range(len(items)), workers, chunk=8,
                                                 window=window)) as stream:
        for item in stream:
            batch.append(item)
            if len(batch) == batch_size:
                run()
                batch = []
    if batch:
        run()
    return [{k: np.concatenate([d[k] for d in f]) for k in f[0]} if isinstance(f[0], dict) else np.concatenate(f)
            for f in feats]


def _same_shape(tensors):
    """The batch as stacked runs of consecutive tensors of one shape: one run when all have one (every resized view,
    and the native views of a folder of one size)."""
    import torch

    for _, run in itertools.groupby(tensors, key=lambda x: tuple(x.shape)):
        yield torch.stack(list(run))


def of_files(files, exts, mode: str, batch_size: int, device, workers: int = 1) -> list[np.ndarray]:
    """features() of image files; one that cannot be decoded is named in one line instead of a deep traceback."""
    views = [view_of(e, mode) for e in exts]
    try:
        return features(file_images(files, views), exts, mode, batch_size, device, workers)
    except (OSError, SyntaxError, ValueError) as e:  # PIL's ways of saying "truncated or not an image"
        for f in files:
            try:
                decode(f)
            except (OSError, SyntaxError, ValueError) as bad:
                raise UserError(f"{f}: damaged or not an image ({bad}); remake the folder "
                                "(`diffrelay sample` remakes damaged files) and score again") from e
        raise
