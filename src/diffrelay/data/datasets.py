"""Datasets: the generated `shapes` set and user image folders, both written as one prepared folder."""

import contextlib
import dataclasses
import functools
import hashlib
import io as bytes_io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from diffrelay import io, logs
from diffrelay.logs import Progress  # noqa: F401 (re-exported: encoding.py)
from diffrelay.runtime import parallel
from diffrelay.data import buckets, bucketed, captions, crop, encoders, latents, subsets, wide
from diffrelay.data.files import (EXTENSIONS, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, ImageTooLarge,  # noqa: F401
                                  folder_labels, hash_files, image_size, list_images, open_image, to_rgb,
                                  unopenable)
from diffrelay.data.shapes import SHAPE_NAMES, SHAPES_VERSION, draw_shape, shape_row  # noqa: F401 (re-exported)
from diffrelay.errors import UserError

FORMAT = "diffrelay-dataset/1"
FOLDER_VERSION = 1  # bump when loading/cropping/resizing changes the pixels


@dataclass(frozen=True)
class Plan:
    """What `build` will write, known before any pixel is decoded; `fingerprint` names the result."""

    kind: str
    resolution: int
    labels: str  # "auto" | "none"
    fingerprint: str
    source: str
    seed: int = 0
    count: int = 0
    root: Path | None = None
    files: tuple = ()  # folder: (relative posix path, sha256 or None if unreadable), sorted; shapes: (index,) or ()
    on_corrupt: str = "error"
    crop: str = "center"  # data.crop (data/crop.py)
    latent: dict | None = None  # encoders.record of data.encoder, None for pixels (data/latents.py)
    xflip: bool = False  # latents: also encode the mirrored images
    keep_images: bool = True
    texts: tuple = ()  # captions (data/captions.py): unique texts, "" first; () = uncaptioned
    caption_rows: tuple = ()  # the text ids of each source image trained
    val_files: tuple = ()  # the held-out images (val/), as `files`; their texts and text ids:
    val_texts: tuple = ()
    val_caption_rows: tuple = ()
    val_root: str | None = None  # data.val_path; None: the held-out images are in `root`
    caption_source: str = ""
    text: tuple = ()  # the text encoders' records (prepare)
    buckets: tuple = ()  # data.buckets: (width, height) of each bucket (data/buckets.py); () = squares
    bucket_of: tuple = ()  # each file's bucket index; -1: unreadable, skipped
    bucket_settings: dict | None = None
    max_pixels: int = MAX_IMAGE_PIXELS  # data.max_image_pixels: a larger image is refused (or skipped) unread
    subsets: tuple = ()  # data.subsets: each subset's folder relative to root (data/subsets.py); () = none
    subset_settings: tuple = ()  # their config entries (captions: prefix, suffix, class_tokens)
    too_small: tuple = ()  # data.min_size: the images left out for it (relative paths)
    random_crop: bool = False  # data.random_crop: each image also kept resized to cover the square (data/wide.py)

    def __post_init__(self):  # a plan read back from JSON (encoding.read_plan) holds lists
        for name in ("files", "caption_rows", "val_files", "val_caption_rows", "texts", "val_texts", "text",
                     "buckets", "bucket_of", "subsets", "subset_settings", "too_small"):
            v = getattr(self, name)
            flat = "text" in name or name in ("bucket_of", "subsets", "subset_settings", "too_small")
            object.__setattr__(self, name, tuple(v) if flat else tuple(map(tuple, v)))

    @property
    def total(self) -> int:
        """Source images, skipped ones included."""
        return self.count if self.kind == "shapes" and not self.files else len(self.files)


@dataclass(frozen=True)
class Prepared:
    """A prepared dataset folder opened for training; `images` is memory-mapped."""

    path: Path
    images: np.ndarray | None  # uint8 (N, H, W, 3); None in a latent dataset made without data.keep_images
    labels: np.ndarray  # int64 (N,)
    num_classes: int
    class_names: tuple
    resolution: int
    count: int
    fingerprint: str
    latent: dict | None = None  # encoders.record (+ xflip, keep_images) of a latent dataset
    latents: np.ndarray | None = None  # float32 (N, 2C, h, w): mean and std (data/latents.py)
    latents_xflip: np.ndarray | None = None
    captions: "captions.Captions | None" = None  # a captioned dataset's (captions.json)
    text: object = None  # a text run's text.source.TextSource, set by training (train._set_up)
    buckets: "bucketed.Buckets | None" = None  # data.buckets: each bucket's arrays (data/bucketed.py)
    subsets: np.ndarray | None = None  # data.subsets: int16 (N,), each row's subset (data/subsets.py)
    subset_names: tuple = ()  # their folders, relative to data.path
    wide: "wide.Wide | None" = None  # data.random_crop's resized images (data/wide.py)

    @property
    def shape(self) -> tuple:
        """(C, H, W) of what the network sees: the images, or their latents."""
        if self.latent is None:
            return 3, self.resolution, self.resolution
        side = self.resolution // self.latent["factor"]
        return self.latent["channels"], side, side

    def shape_of(self, bucket: int | None) -> tuple:
        """(C, H, W) of what the network sees of a bucket's images (None: the squares)."""
        if bucket is None or self.buckets is None:
            return self.shape
        w, h = self.buckets.sizes[bucket]
        f = 1 if self.latent is None else self.latent["factor"]
        return self.shape[0], h // f, w // f


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_image(data: bytes, resolution: int, mode: str = "center", path="image", max_pixels=MAX_IMAGE_PIXELS):
    """Decode, convert to RGB, then make a resolution x resolution square as data.crop `mode` says: center =
    centre square resized with Lanczos, dhariwal = ADM's box halvings, bicubic and centre crop (data/crop.py)."""
    return crop.square(decode(data, path, max_pixels), resolution, mode)


def decode(data: bytes, path="image", max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """An image file's bytes (the file at `path`) as an 8-bit RGB image, turned by its EXIF orientation (to_rgb);
    ImageTooLarge, before any pixel is decoded, past `max_pixels` (files.open_image)."""
    with open_image(bytes_io.BytesIO(data), path, max_pixels) as img:
        img.load()
        return to_rgb(img)


def _file_row(root: Path, resolution: int, on_corrupt: str, mode: str, max_pixels: int, item: tuple,
              random_crop: bool = False):
    """The image of one (rel, sha) entry of a plan; None when it cannot be read and on_corrupt is skip. An entry
    (rel, sha, width, height) of a bucketed plan gives (square, bucket's image, its sizes: buckets.cut); with
    data.random_crop, (square, the image resized to cover it: wide.resized)."""
    rel, sha = item[:2]
    path = root / rel
    if sha is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        if on_corrupt != "skip":
            raise UserError(unopenable(path, e)) from e
        return None
    try:
        if len(item) > 2:
            img = decode(data, path, max_pixels)
            full = (wide.resized(img, resolution, item[2:]),) if random_crop else ()
            return (crop.square(img, resolution, mode), *buckets.cut(img, item[2:]), *full)
        if random_crop:
            img = decode(data, path, max_pixels)
            return crop.square(img, resolution, mode), wide.resized(img, resolution)
        return load_image(data, resolution, mode, path, max_pixels)
    except ImageTooLarge:
        if on_corrupt != "skip":
            raise
        return None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        # PIL reports broken files with several exception types (UnidentifiedImageError is an OSError).
        if on_corrupt != "skip":
            why = "not an image format PIL recognises" if isinstance(e, UnidentifiedImageError) else str(e)
            raise UserError(f"{io.shown(path)}: corrupt or unsupported image ({why}); fix or remove the file, "
                            f"or set data.on_corrupt: skip") from e
        return None


def source_rows(p: Plan, workers: int, indices=None, start: str = "fork"):
    """(image or None when skipped, label, rel) of every source image in order (or of those at `indices`),
    decoded by `workers` processes, started by `start` (parallel.ordered_map: "spawn" when this process
    may run other threads).

    Each worker gets a chunk of about 4 MB of output at a time and at most 2 chunks per worker are in
    flight, so memory stays bounded however large the dataset is."""
    chunk = max(1, min(256, (4 << 20) // (p.resolution * p.resolution * 3)))
    if p.kind == "shapes":
        items = [f[0] for f in p.files] if p.files else range(p.count)
        fn = functools.partial(shape_row, p.seed, p.resolution, p.labels)
    else:
        # Only the few fields a worker needs travel with each chunk, not the whole plan.
        fn, items = functools.partial(_file_row, p.root, p.resolution, p.on_corrupt, p.crop, p.max_pixels,
                                      random_crop=p.random_crop), p.files
        if p.buckets:  # the bucket's size travels with each file; a file found unreadable by its header is skipped
            items = [(rel, sha if b >= 0 else None, *p.buckets[b]) for (rel, sha), b in zip(items, p.bucket_of)]
    if indices is not None:
        items = [items[i] for i in indices]
    with contextlib.closing(parallel.ordered_map(fn, items, workers, chunk, processes=True, start=start)) as results:
        for result, item in zip(results, items):
            if p.kind == "shapes":
                yield (*result, None)
            else:
                yield result, 0, item[0]


# ---------------------------------------------------------------- plan, build, open

def plan(data, latent: dict | None = None, batch: int | None = None) -> Plan:
    """Check the `data` config section and fingerprint its source. Folder datasets hash every file. `latent`:
    the encoder's record (encoders.record) for a latent dataset; its sha256 and conventions join the fingerprint, as
    do the captions (read here, before any image is decoded: captions.attach) and the buckets (data.buckets: each
    image's size read from its header; `batch`, the global batch, is their default minimum: buckets.attach)."""
    p = captions.attach(_pixel_plan(data), data, hash_files, folder_labels)
    if getattr(data, "buckets", None) is not None:
        p = buckets.attach(p, data, batch)
    if latent is None:
        return p
    fp = _digest({"pixels": p.fingerprint, "latent": {k: latent[k] for k in encoders.RECORD_KEYS},
                  "xflip": data.xflip > 0, "keep_images": data.keep_images})
    return dataclasses.replace(p, fingerprint=fp, latent=latent, xflip=data.xflip > 0, keep_images=data.keep_images)


def _pixel_plan(data) -> Plan:
    if data.kind == "shapes":
        fp = _digest({"generator": f"shapes/{SHAPES_VERSION}", "seed": data.seed, "count": data.count,
                      "resolution": data.resolution, "labels": data.labels})
        return Plan("shapes", data.resolution, data.labels, fp, f"shapes seed={data.seed}", seed=data.seed,
                    count=data.count)
    root = Path(data.path).expanduser()
    files = hash_files(root, data.on_corrupt)
    part, subset_rels, settings, small = {}, (), (), ()
    if getattr(data, "min_size", 0):  # data.min_size: read from each header, the image is left out unread
        small = tuple(rel for rel, sha in files if sha is not None and min(image_size(root / rel)) < data.min_size)
        gone = set(small)
        files = tuple(f for f in files if f[0] not in gone)
        part["min_size"] = data.min_size
        if not files:
            raise UserError(f"{io.shown(root)}: data.min_size={data.min_size}: every image has a shorter side below it; "
                            "lower data.min_size, or add larger images")
    if getattr(data, "subsets", None) is not None:  # each image in one subset (data/subsets.py)
        as_dict = data.to_dict()
        subset_rels, settings = tuple(subsets.relative(as_dict)), tuple(as_dict["subsets"])
        subsets.check_files(root, files, list(subset_rels))
        part["subsets"] = list(subset_rels)
    part |= {"random_crop": True} if wide.wanted(data) else {}
    # Relative paths and contents only: the same files copied elsewhere or touched give the same fingerprint.
    # The crop joins only when it is not center, so datasets made before data.crop existed keep theirs.
    # So does data.max_image_pixels off its default where data.on_corrupt skip leaves out the images past it.
    mode, bound = getattr(data, "crop", "center"), getattr(data, "max_image_pixels", MAX_IMAGE_PIXELS)
    fp = _digest({"format": f"folder/{FOLDER_VERSION}", "resolution": data.resolution, "labels": data.labels,
                  "files": [list(f) for f in files]} | ({} if mode == "center" else {"crop": mode})
                 | ({"max_pixels": bound} if data.on_corrupt == "skip" and bound != MAX_IMAGE_PIXELS else {}) | part)
    return Plan("folder", data.resolution, data.labels, fp, str(root.resolve()), root=root, files=files,
                on_corrupt=data.on_corrupt, crop=mode, max_pixels=bound, subsets=subset_rels,
                subset_settings=settings, too_small=small, random_crop="random_crop" in part)



def build(p: Plan, out, workers: int = 1, start: str = "fork", class_names=None) -> dict:
    """Write a pixel dataset's images.npy, labels.npy and dataset.json into `out` (an empty temp folder); return
    the info. `workers` processes decode (started by `start`); the bytes written do not depend on how many. (A
    latent dataset is encoded in chunks first: data/encoding.py.) `class_names`: those of a held-out split's set."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    total = p.total
    # Written row by row straight to disk, in source order: memory holds the chunks in flight, not the dataset.
    images = np.lib.format.open_memmap(out / "images.npy", mode="w+", dtype=np.uint8,
                                       shape=(total, p.resolution, p.resolution, 3))
    labels, rels, skipped = [], [], []
    progress, cuts = Progress(total), bucketed.Writer(p, out) if p.buckets else None
    whole = wide.Writer(out) if p.random_crop else None
    with contextlib.closing(source_rows(p, workers, start=start)) as rows:
        for img, label, rel in rows:
            if img is None:
                skipped.append(rel)
            else:
                if whole is not None:  # (..., the resized image): data.random_crop
                    *img, full = img
                    img = img[0] if len(img) == 1 else tuple(img)
                    whole.add(full)
                if cuts is not None:  # (square, the bucket's image, its sizes); the square is the FID reference
                    img, cut, sizes = img
                    cuts.add(p.bucket_of[len(labels) + len(skipped)], cut, sizes)
                images[len(labels)] = img
                labels.append(label)
                rels.append(rel)
            progress.update(len(labels) + len(skipped))
    for writer in (cuts, whole):
        if writer is not None:
            writer.close()
    count = len(labels)
    images.flush()
    del images
    if count < total:  # some files were skipped: keep only the rows that were filled
        np.save(out / "kept.npy", np.load(out / "images.npy", mmap_mode="r")[:count])
        os.replace(out / "kept.npy", out / "images.npy")
    info = finish(p, out, labels, rels, skipped, workers=workers, class_names=class_names)
    logs.get().info(progress.line(final=True))
    return info


def finish(p: Plan, out: Path, labels: list, rels: list, skipped: list, extra: dict | None = None, workers: int = 1,
           class_names=None) -> dict:
    """labels.npy and dataset.json once the arrays are written (captioned: captions.json and val/); the info."""
    count, fixed = len(labels), class_names  # fixed: a held-out split's, the training set's classes
    class_names = list(SHAPE_NAMES) if p.kind == "shapes" and p.labels == "auto" else list(fixed or [])
    if p.kind == "folder":
        if not count:
            raise UserError(f"{io.shown(p.root)}: data.path: none of the {len(p.files)} images could be read "
                            f"(all skipped); fix the files or point data.path at another folder")
        if p.labels == "auto":
            labels, class_names = folder_labels(rels) if fixed is None else captions.label_of(rels, fixed, p.root)
    if p.too_small:
        logs.get().info(f"prepare: left out {len(p.too_small)} image(s) with a side below data.min_size, e.g. "
                        f"{io.shown(p.too_small[0])}; listed in dataset.json 'too_small'")
    if skipped:
        logs.get().warning(f"prepare: skipped {len(skipped)} unreadable image(s) (or of more than "
                           f"data.max_image_pixels={p.max_pixels:,} pixels), e.g. {io.shown(skipped[0])}; listed in "
                           "dataset.json 'skipped'")
    np.save(out / "labels.npy", np.asarray(labels, dtype=np.int64))
    info = {"format": FORMAT, "kind": p.kind, "count": count, "resolution": p.resolution,
            "num_classes": len(class_names), "class_names": class_names, "labels": p.labels,
            "fingerprint": p.fingerprint, "skipped": skipped, "source": p.source}
    if p.latent:
        info["latent"] = p.latent | {"xflip": p.xflip, "keep_images": p.keep_images}
    if p.buckets:
        info["buckets"] = bucketed.record(p, out)
    if p.subsets:  # each trained row's subset (data/subsets.py)
        np.save(out / subsets.FILE, subsets.of_rels(rels, list(p.subsets)))
        info["subsets"] = list(p.subsets)
    if p.too_small:
        info["too_small"] = list(p.too_small)
    if p.random_crop:
        info["random_crop"] = True
    if p.texts:
        info["captions"] = captions.write(p, out, rels, build, workers, class_names)
    info |= extra or {}
    io.write_json(out / "dataset.json", info)
    return info


def open_prepared(path) -> Prepared:
    """Open a folder made by `diffrelay prepare`; check that the arrays match dataset.json."""
    path = Path(path)
    if not (path / "dataset.json").is_file():
        raise UserError(f"{path}: no prepared dataset (dataset.json missing); "
                        "run `diffrelay prepare --config <your config>`")
    info, fix = io.read_json(path / "dataset.json"), captions.REBUILD
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise UserError(f"{path / 'dataset.json'}: not a {FORMAT} file; {fix}")
    keys = ("count", "resolution", "num_classes", "class_names", "fingerprint")
    if any(k not in info for k in keys):
        raise UserError(f"{path / 'dataset.json'}: incomplete (needs {', '.join(keys)}); {fix}")
    n, res = info["count"], info["resolution"]
    latent = info.get("latent")
    keep = latent is None or latent.get("keep_images", True)
    for name in ("images.npy", "labels.npy", latents.ENCODED, latents.FLIPPED):
        if (path / name).exists():  # a FIFO here would block np.load; a missing file is reported below
            io.check_regular_file(path / name, 1 << 44, "dataset array", fix)
    try:
        images = np.load(path / "images.npy", mmap_mode="r") if keep else None
        labels = np.load(path / "labels.npy", mmap_mode="r")  # like the images: memory does not grow with N
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: images.npy or labels.npy missing or unreadable ({e}); {fix}") from e
    if images is not None and (images.shape != (n, res, res, 3) or images.dtype != np.uint8):
        raise UserError(f"{path / 'images.npy'}: shape {images.shape} {images.dtype} does not match dataset.json "
                        f"(count={n}, resolution={res}, uint8); rerun `diffrelay prepare --config <your config>`")
    if labels.shape != (n,) or labels.dtype != np.int64:
        raise UserError(f"{path / 'labels.npy'}: shape {labels.shape} {labels.dtype} does not match dataset.json "
                        f"(count={n}, int64); rerun `diffrelay prepare --config <your config>`")
    encoded, flipped = latents.open_arrays(path, info, n) if latent and "buckets" not in info else (None, None)
    texts = captions.open_file(path / captions.FILE, n) if "captions" in info else None
    held = bucketed.open_arrays(path, info, n) if "buckets" in info else None
    of_row = None
    if "subsets" in info:
        try:
            io.check_regular_file(path / subsets.FILE, 1 << 40, "dataset array", fix)
            of_row = np.load(path / subsets.FILE)
        except (OSError, ValueError) as e:
            raise UserError(f"{path / subsets.FILE}: missing or unreadable ({e}); {fix}") from e
        if of_row.shape != (n,) or of_row.dtype != np.int16 or of_row.min(initial=0) < 0 or \
                of_row.max(initial=0) >= len(info["subsets"]):
            raise UserError(f"{path / subsets.FILE}: shape {of_row.shape} {of_row.dtype} does not match dataset.json "
                            f"(count={n}, int16 below {len(info['subsets'])}); {fix}")
    return Prepared(path, images, labels, info["num_classes"], tuple(info["class_names"]), res, n, info["fingerprint"],
                    latent, encoded, flipped, texts, buckets=held, subsets=of_row,
                    subset_names=tuple(info.get("subsets", ())), wide=wide.open_store(path, info, n, fix))


def open_val(path) -> Prepared | None:
    """The held-out split (val/) of the captioned dataset folder `path`, pixels only; None when it has none."""
    held = open_prepared(path).captions is not None and io.read_json(Path(path) / "dataset.json")["captions"]["val"]
    return open_prepared(Path(path) / captions.VAL) if held else None


def is_dataset_folder(path) -> bool:
    """`path` was written by `diffrelay prepare` (its dataset.json names our format), complete or not."""
    try:
        return json.loads((Path(path) / "dataset.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def is_current(path, p: Plan) -> bool:
    """True when `path` holds a complete dataset built from exactly this plan."""
    path = Path(path)
    try:  # (no dataset.json: open_prepared says so)
        prepared = open_prepared(path)
        info = io.read_json(path / "dataset.json")
        open_val(path)  # the held-out split is whole too
    except UserError:
        return False
    if prepared.fingerprint != p.fingerprint or (p.on_corrupt == "error" and info.get("skipped")):
        return False  # another plan, or built while skipping bad files (an "error" config must see them fail)
    # open_prepared checked that both arrays are whole (shape and size match dataset.json). A png/ folder left
    # there by older versions of prepare is no longer read; it may be deleted.
    return True
