"""Aspect-ratio buckets (data.buckets): which sizes exist, which one each image gets, how it is cut to it.

Sizes: kohya's sd-scripts make_bucket_resolutions (library/model_util.py), restated: about data.resolution²
pixels, both sides multiples of `step`: the square floor(R / step) x step, and for every width w = step, 2 step,
... the height floor(R² / w / step) x step, with its transpose. sd-scripts bounds the sides (min_bucket_reso 256,
max_bucket_reso 1024, clamping a height to the maximum, which shrinks the area of the longest buckets); diffrelay
bounds the aspect ratio instead (max(w, h) / min(w, h) <= max_aspect), so every bucket keeps about the area, and
the widths stop at R sqrt(max_aspect), where the ratio passes the bound (w h <= R² and w / h <= A give w <= R sqrt A).
benchmarks/checks/check_kohya_buckets.py compares both on the same inputs with the sd-scripts checkout.

Assignment: BucketManager.select_bucket without no_upscale: the bucket whose w / h is nearest the image's (the first
of the sorted sizes on a tie; an image exactly a bucket's size takes that one), resized to cover it (the scale of
the side that binds, each side int(x scale + 0.5)), then the centred crop. The crop's top-left corner is
torchvision's CenterCrop rounding, int(round((H - h) / 2)), which diffusers' train_text_to_image_sdxl.py records
as crop_top_left for SDXL's size conditioning (sd-scripts trims (H - h) // 2 and records its own crop_ltrb).

Small buckets (below `min_images`, by default one global batch: a bucket smaller than that can never fill a batch)
are merged at prepare, the smallest first, into the remaining bucket nearest in aspect ratio, until none is small
(SimpleTuner's rule is the same minimum, batch x processes x accumulation, but it drops the images; merging keeps
them, cut to a nearby shape). An image smaller than every bucket on both sides would be enlarged whatever its
bucket: refused in one line unless data.buckets.upscale is true.
"""

import math

import numpy as np

from diffrelay.errors import UserError


def sizes(resolution: int, step: int, max_aspect: float) -> list[tuple[int, int]]:
    """(width, height) of every bucket, sorted (sd-scripts' make_bucket_resolutions sorts them so too)."""
    area = resolution * resolution
    side = int(math.sqrt(area) // step) * step
    found = {(side, side)} if side >= step else set()
    w = step
    while w <= resolution * math.sqrt(max_aspect):
        h = int((area // w) // step) * step
        if h >= step and max(w, h) / min(w, h) <= max_aspect:
            found |= {(w, h), (h, w)}
        w += step
    return sorted(found)


def nearest(width: int, height: int, buckets: list) -> int:
    """Index of the bucket an image of this size goes to: its own size if a bucket has it, else the nearest
    aspect ratio w / h (the first on a tie), as select_bucket picks it."""
    if (width, height) in buckets:
        return buckets.index((width, height))
    ratios = np.array([w / h for w, h in buckets])
    return int(np.abs(ratios - width / height).argmin())


def cover(width: int, height: int, bucket: tuple) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized width, height), (crop top, left)) of an image cut to `bucket` = (w, h)."""
    bw, bh = bucket
    scale = bh / height if width / height > bw / bh else bw / width
    rw, rh = max(bw, int(width * scale + 0.5)), max(bh, int(height * scale + 0.5))
    return (rw, rh), (int(round((rh - bh) / 2.0)), int(round((rw - bw) / 2.0)))


def too_small(width: int, height: int, buckets: list) -> bool:
    """Both sides smaller than every bucket's: enlarged on both axes whatever bucket it gets."""
    return all(width < w and height < h for w, h in buckets)


def merge(counts: dict, buckets: list, minimum: int) -> dict:
    """{bucket index: the index its images go to}: while a bucket with images has fewer than `minimum`, the
    smallest (the first on a tie) goes to the nearest other bucket with images by aspect ratio (the larger on a
    tie, then the first). One bucket left keeps everything, whatever its count."""
    target = {b: b for b in counts}
    live = {b: n for b, n in counts.items() if n > 0}
    while len(live) > 1:
        small = [b for b in sorted(live) if live[b] < minimum]
        if not small:
            break
        b = min(small, key=lambda k: (live[k], k))
        ratio = buckets[b][0] / buckets[b][1]
        into = min((k for k in live if k != b), key=lambda k: (abs(math.log(buckets[k][0] / buckets[k][1] / ratio)),
                                                                -live[k], k))
        live[into] += live.pop(b)
        for k, t in target.items():
            if t == b:
                target[k] = into
    return target


def check_settings(settings: dict, resolution: int, key: str = "data.buckets") -> None:
    """The settings give at least one bucket; one line otherwise."""
    if not sizes(resolution, settings["step"], settings["max_aspect"]):
        raise UserError(f"{key}.step={settings['step']}: larger than data.resolution={resolution}, so no bucket "
                        f"fits; use a step of at most {resolution}")


def settings_of(data, minimum: int | None) -> dict:
    """data.buckets as the plan records it: min_images resolved (null: `minimum`, one global batch)."""
    b = data.buckets
    return {"step": int(b.step), "max_aspect": float(b.max_aspect), "upscale": bool(b.upscale),
            "min_images": int(b.min_images or minimum or 1)}


def image_size(path) -> tuple[int, int]:
    """(width, height) of an image as it will be decoded: from its header, turned by its EXIF orientation (5-8
    swap the sides), without decoding the pixels."""
    from PIL import Image

    with Image.open(path) as img:
        w, h = img.size
        # A PNG's getexif() decodes the whole image when no eXIf chunk comes before the pixels (Pillow): read it only
        # when the header has one (one after the pixels is then missed: the cut still covers the bucket).
        exif = img.getexif() if img.format != "PNG" or "exif" in img.info else {}
        turned = exif.get(0x0112, 1) in (5, 6, 7, 8)
    return (h, w) if turned else (w, h)


def cut(img, bucket: tuple) -> tuple[np.ndarray, tuple]:
    """uint8 (h, w, 3) of an RGB PIL image cut to `bucket` = (w, h) (resized with Lanczos to cover it, then the
    centred crop), and (original height, width, crop top, left): SDXL's original_size and crop_top_left."""
    from PIL import Image

    (rw, rh), (top, left) = cover(*img.size, bucket)
    out = img.resize((rw, rh), Image.Resampling.LANCZOS).crop((left, top, left + bucket[0], top + bucket[1]))
    return np.asarray(out, dtype=np.uint8), (img.size[1], img.size[0], top, left)


def attach(p, data, minimum: int | None):
    """The plan `p` with its buckets: each training file's size read from its header, its bucket chosen, small
    buckets merged. The settings and every file's bucket join the fingerprint; a file that cannot be read keeps
    -1 (skipped, with data.on_corrupt: skip)."""
    import collections
    import dataclasses
    import hashlib
    import json

    from PIL import Image

    if p.kind != "folder":
        raise UserError("data.buckets: the generated shapes set is square; set data.kind folder, or data.buckets null")
    if p.crop != "center":
        raise UserError(f"data.buckets with data.crop={p.crop}: that crop makes ADM's squares; set data.crop center, "
                        "or data.buckets null")
    s = settings_of(data, minimum)
    check_settings(s, p.resolution)
    found = sizes(p.resolution, s["step"], s["max_aspect"])
    chosen = []
    for rel, sha in p.files:
        path = p.root / rel
        try:
            w, h = image_size(path) if sha is not None else (0, 0)
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
            if p.on_corrupt != "skip":
                raise UserError(f"{path}: corrupt or unsupported image ({e}); fix or remove the file, or set "
                                "data.on_corrupt: skip") from e
            sha = None
        if sha is None:
            chosen.append(-1)
            continue
        if not s["upscale"] and too_small(w, h, found):
            least = min(found, key=lambda b: (min(b), b))
            raise UserError(f"{path}: {w}x{h} pixels, smaller on both sides than every bucket of data.resolution="
                            f"{p.resolution} (e.g. {least[0]}x{least[1]}); remove it, lower data.resolution, or set "
                            "data.buckets.upscale: true to enlarge it")
        chosen.append(nearest(w, h, found))
    counts = collections.Counter(b for b in chosen if b >= 0)
    into = merge(counts, found, s["min_images"])
    name = [f"{w}x{h}" for w, h in found]
    s["merged"] = {name[b]: [counts[b], name[t]] for b, t in sorted(into.items()) if t != b}
    used = sorted({into[b] for b in counts})
    index = {b: i for i, b in enumerate(used)}
    bucket_of = tuple(index[into[b]] if b >= 0 else -1 for b in chosen)
    buckets = tuple(found[b] for b in used)
    # The merge's outcome, not its minimum: a batch size that merges nothing more keeps the dataset.
    kept = {k: v for k, v in s.items() if k not in ("min_images", "merged")}
    fp = hashlib.sha256(json.dumps({"dataset": p.fingerprint, "buckets": kept, "sizes": buckets, "of": bucket_of},
                                   sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return dataclasses.replace(p, buckets=buckets, bucket_of=bucket_of, bucket_settings=s, fingerprint=fp)


def file_name(stem: str, bucket) -> str:
    """A bucket's array file: images.832x1216.npy (width x height in pixels)."""
    return f"{stem}.{bucket[0]}x{bucket[1]}.npy"
