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

data.buckets.upscale false (the default) never enlarges: an image its nearest bucket does not fit inside (the cover's
scale above 1) gets a bucket of its own size, as sd-scripts' select_bucket with no_upscale (bucket_no_upscale) makes
it (`own`): the image's size floored to multiples of `step` (an image above data.resolution² pixels is first shrunk
to that area at its ratio, sd-scripts' nearer of two roundings), its long side first cut to max_aspect x the short
(diffrelay's ratio bound, as for every bucket). Such buckets join the set; the cut is the same cover and centred
crop (a shrink of less than one step and a crop, where sd-scripts crops at the image's own scale: never more lost).
An image narrower than one step on a side has no such bucket: refused in one line. benchmarks/checks/
check_kohya_buckets.py compares these buckets with sd-scripts' too.

Small buckets (below `min_images`, by default one global batch: a bucket smaller than that can never fill a batch)
are merged at prepare, the smallest first, into the remaining bucket nearest in aspect ratio, until none is small
(SimpleTuner's rule is the same minimum, batch x processes x accumulation, but it drops the images; merging keeps
them, cut to a nearby shape). With upscale false a bucket merges only into one that fits inside each of its images
(a larger one would enlarge them); one that has none is refused in one line, as is a bucket left with fewer images
than one global batch (a min_images below it): such images would never be trained. `lines` says, for `validate` and
`prepare`, each bucket's images and how much of them the crop cuts away, and which images lose more than CROP_LIMIT.
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


def own(width: int, height: int, resolution: int, step: int, max_aspect: float) -> tuple[int, int]:
    """The bucket (width, height) of an image no bucket fits without enlarging it (data.buckets.upscale false):
    sd-scripts' select_bucket with no_upscale, restated, of the part a bucket of ratio <= max_aspect shows; a side
    of 0 where the image is narrower than one step."""
    w, h = min(width, max_aspect * height), min(height, max_aspect * width)  # the long side cut to the ratio bound
    area = resolution * resolution
    if w * h > area:  # shrunk to the area at its ratio: the side rounded to steps whose ratio is nearer the image's

        def steps(x):
            x = int(x + 0.5)
            return x - x % step

        ratio = w / h
        by_w = steps(math.sqrt(area * ratio))
        by_h = steps(area / math.sqrt(area * ratio))
        h_of_w, w_of_h = steps(by_w / ratio), steps(by_h * ratio)
        err_w = abs(by_w / h_of_w - ratio) if h_of_w else math.inf
        err_h = abs(w_of_h / by_h - ratio) if by_h else math.inf
        w, h = (by_w, int(by_w / ratio + 0.5)) if err_w < err_h else (int(by_h * ratio + 0.5), by_h)
    bw, bh = min(int(w), width), min(int(h), height)
    bw, bh = bw - bw % step, bh - bh % step
    if bw and bh and max(bw, bh) / min(bw, bh) > max_aspect:  # the floor passed the bound: cut the long side to it
        longest = int(max_aspect * min(bw, bh)) // step * step
        bw, bh = (longest, bh) if bw > bh else (bw, longest)
    return bw, bh


def assign(width: int, height: int, found: list, resolution: int, settings: dict) -> tuple[int, int]:
    """The bucket (width, height) of an image: the nearest of `found` (sizes()), or, with upscale false where that
    one would enlarge it, its own (`own`)."""
    b = found[nearest(width, height, found)]
    if settings["upscale"] or (width >= b[0] and height >= b[1]):
        return b
    return own(width, height, resolution, settings["step"], settings["max_aspect"])


def cropped(width: int, height: int, bucket: tuple) -> float:
    """The fraction of an image's pixels the cut to `bucket` crops away (after the cover's resize)."""
    (rw, rh), _ = cover(width, height, bucket)
    return 1.0 - bucket[0] * bucket[1] / (rw * rh)


def too_small(width: int, height: int, buckets: list) -> bool:
    """Both sides smaller than every bucket's: enlarged on both axes whatever bucket it gets."""
    return all(width < w and height < h for w, h in buckets)


def merge(counts: dict, buckets: list, minimum: int, least: dict | None = None) -> dict:
    """{bucket index: the index its images go to}: while a bucket with images has fewer than `minimum`, the
    smallest (the first on a tie) goes to the nearest other bucket with images by aspect ratio (the larger on a
    tie, then the first). One bucket left keeps everything, whatever its count. `least` (upscale false): {bucket:
    (the least width, the least height) of its images}; a bucket then goes only into one no larger than that on
    either side (one that fits inside every image), and one with none stays small (the caller refuses it)."""
    target = {b: b for b in counts}
    live = {b: n for b, n in counts.items() if n > 0}
    least = dict(least) if least is not None else None

    def fits(b, k):
        return least is None or (buckets[k][0] <= least[b][0] and buckets[k][1] <= least[b][1])

    while len(live) > 1:
        small = [b for b in sorted(live) if live[b] < minimum and any(fits(b, k) for k in live if k != b)]
        if not small:
            break
        b = min(small, key=lambda k: (live[k], k))
        ratio = buckets[b][0] / buckets[b][1]
        into = min((k for k in live if k != b and fits(b, k)),
                   key=lambda k: (abs(math.log(buckets[k][0] / buckets[k][1] / ratio)), -live[k], k))
        live[into] += live.pop(b)
        if least is not None:
            least[into] = tuple(map(min, least[into], least.pop(b)))
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


def image_size(path, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of an image as it will be decoded: from its header, turned by its EXIF orientation (5-8
    swap the sides), without decoding the pixels. Past `max_pixels` (data.max_image_pixels), files.ImageTooLarge
    naming the file, as prepare's decode says it (not Pillow's warning, which names none)."""
    from diffrelay.data import files

    with files.open_image(path, path, *(() if max_pixels is None else (max_pixels,))) as img:
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
    -1 (skipped, with data.on_corrupt: skip). `minimum`: the global batch, the least a bucket may hold."""
    import dataclasses
    import hashlib
    import json

    from PIL import Image

    from diffrelay.data import files

    if p.kind != "folder":
        raise UserError("data.buckets: the generated shapes set is square; set data.kind folder, or data.buckets null")
    if p.crop != "center":
        raise UserError(f"data.buckets with data.crop={p.crop}: that crop makes ADM's squares; set data.crop center, "
                        "or data.buckets null")
    s = settings_of(data, minimum)
    check_settings(s, p.resolution)
    grid = sizes(p.resolution, s["step"], s["max_aspect"])
    shapes, picked = [], []  # each file's (width, height) and its bucket's; None: unreadable
    for rel, sha in p.files:
        path = p.root / rel
        try:
            w, h = image_size(path, p.max_pixels) if sha is not None else (0, 0)
        except files.ImageTooLarge:
            if p.on_corrupt != "skip":
                raise
            sha = None
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
            if p.on_corrupt != "skip":
                raise UserError(f"{path}: corrupt or unsupported image ({e}); fix or remove the file, or set "
                                "data.on_corrupt: skip") from e
            sha = None
        b = None if sha is None else assign(w, h, grid, p.resolution, s)
        if b is not None and 0 in b:
            raise UserError(f"{path}: {w}x{h} pixels: every bucket of data.resolution={p.resolution} would enlarge it, "
                            f"and it is narrower than data.buckets.step={s['step']} on a side, so no bucket of its own "
                            "fits (data.buckets.upscale: false never enlarges); remove it, lower data.buckets.step, or "
                            "set data.buckets.upscale: true to enlarge it")
        shapes.append(None if b is None else (w, h))
        picked.append(b)
    found = sorted(set(grid) | {b for b in picked if b is not None})  # upscale false: the images' own buckets join
    at = {b: i for i, b in enumerate(found)}
    chosen = [-1 if b is None else at[b] for b in picked]
    into = merge(_counts(chosen), found, s["min_images"], None if s["upscale"] else _least(chosen, shapes))
    final = [into[b] if b >= 0 else -1 for b in chosen]
    name = [f"{w}x{h}" for w, h in found]
    _check_filled(p, final, shapes, found, s, minimum)
    counts = _counts(chosen)
    s["merged"] = {name[b]: [counts[b], name[t]] for b, t in sorted(into.items()) if t != b}
    used = sorted(set(final) - {-1})
    index = {b: i for i, b in enumerate(used)}
    bucket_of = tuple(index[b] if b >= 0 else -1 for b in final)
    buckets = tuple(found[b] for b in used)
    # The merge's outcome, not its minimum: a batch size that merges nothing more keeps the dataset. (The own
    # buckets and the crops are the outcome too: the sizes and each file's bucket hold them.)
    kept = {k: v for k, v in s.items() if k not in ("min_images", "merged")}
    fp = hashlib.sha256(json.dumps({"dataset": p.fingerprint, "buckets": kept, "sizes": buckets, "of": bucket_of},
                                   sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    s["own"] = [f"{w}x{h}" for w, h in buckets if (w, h) not in grid]
    s["crop"] = crop_summary(shapes, bucket_of, buckets, [rel for rel, _ in p.files])
    return dataclasses.replace(p, buckets=buckets, bucket_of=bucket_of, bucket_settings=s, fingerprint=fp)


def _counts(chosen) -> dict:
    import collections

    return collections.Counter(b for b in chosen if b >= 0)


def _least(chosen, shapes) -> dict:
    """{bucket: (the least width, the least height) of its images}."""
    least = {}
    for b, shape in zip(chosen, shapes):
        if b >= 0:
            least[b] = tuple(map(min, least.get(b, shape), shape))
    return least


def _check_filled(p, final, shapes, found, s, minimum) -> None:
    """Every bucket left after the merge fills min_images and one global batch (`minimum`), or one line: with
    upscale false, one that had nowhere to go without enlarging; else a min_images below the batch (train would
    refuse it, after the work: this is where the counts are known)."""
    counts = _counts(final)
    for b, n in sorted(counts.items()):
        stuck = len(counts) > 1 and n < s["min_images"]  # only merge(least=...) leaves one
        if not stuck and not (minimum and n < minimum):
            continue
        first = final.index(b)
        (w, h), (bw, bh) = shapes[first], found[b]
        path, more = p.root / p.files[first][0], f" (and {n - 1} more)" if n > 1 else ""
        if stuck:
            raise UserError(f"{path}{more}: {w}x{h} pixels: its bucket {bw}x{bh} holds {n} image(s), fewer than "
                            f"data.buckets.min_images={s['min_images']}, and every other bucket is larger than one of "
                            "its images on a side, so a merge would enlarge them (data.buckets.upscale: false never "
                            "enlarges); remove such images or add more of their size, or set data.buckets.upscale: true")
        else:
            fix = (f"data.buckets.min_images={s['min_images']} keeps it: set data.buckets.min_images null (merges it "
                   f"at prepare) or at least {minimum}, or lower train.batch_size" if len(counts) > 1 else
                   "the whole folder is one bucket: add images, or lower train.batch_size")
            raise UserError(f"{p.root}: bucket {bw}x{bh} holds {n} image(s) (e.g. {path.name}), fewer than one global "
                            f"batch (train.batch_size={minimum}), so they would never be trained; {fix}")


CROP_LIMIT = 0.2  # an image losing more than this fraction of its pixels to its bucket's crop is named


def crop_summary(shapes, bucket_of, buckets, rels) -> dict:
    """How much the cut to each bucket crops: per bucket [mean, max] fraction of the pixels, and the images that
    lose more than CROP_LIMIT (how many, the worst and its fraction)."""
    per, heavy, worst = [[] for _ in buckets], 0, None
    for shape, b, rel in zip(shapes, bucket_of, rels):
        if b < 0:
            continue
        f = cropped(*shape, buckets[b])
        per[b].append(f)
        heavy += f > CROP_LIMIT
        worst = [rel, f] if worst is None or f > worst[1] else worst
    return {"buckets": [[round(sum(f) / len(f), 4), round(max(f), 4)] if f else [0.0, 0.0] for f in per],
            "over": CROP_LIMIT, "heavy": heavy, "worst": None if worst is None else [worst[0], round(worst[1], 4)]}


def lines(settings: dict, sizes_: list, counts: list) -> list[str]:
    """`validate`'s and `prepare`'s lines: each bucket, its images and how much of them its crop cuts away; what
    was merged; the images that lose more than CROP_LIMIT to the crop."""
    crop, own = settings.get("crop") or {}, set(settings.get("own") or [])
    per = crop.get("buckets") or []
    out = []
    for i, ((w, h), n) in enumerate(zip(sizes_, counts)):
        line = f"  {w}x{h}: {n} images" + (" (their own size: data.buckets.upscale false never enlarges)"
                                           if f"{w}x{h}" in own else "")
        out.append(line + (f", crop mean {100 * per[i][0]:.0f} %, max {100 * per[i][1]:.0f} % of the pixels"
                           if i < len(per) else ""))
    for name, (n, into) in settings.get("merged", {}).items():
        out.append(f"  {name}: its {n} image(s) merged into {into} (fewer than min_images={settings['min_images']})")
    if crop.get("heavy"):
        rel, f = crop["worst"]
        out.append(f"  {crop['heavy']} image(s) lose more than {100 * crop['over']:.0f} % of their pixels to the crop "
                   f"(the worst: {rel}, {100 * f:.0f} %): data.buckets.max_aspect={settings['max_aspect']:g} bounds "
                   "the buckets' ratio; raise it, or cut those images to a nearer ratio, to keep more of them")
    return out


def report(p) -> list[str]:
    """`prepare`'s lines of a bucketed plan."""
    counts = np.bincount([b for b in p.bucket_of if b >= 0], minlength=len(p.buckets)).tolist()
    return [f"buckets: {len(p.buckets)} of {sum(counts)} images (data.buckets; width x height in pixels)",
            *lines(p.bucket_settings, p.buckets, counts)]


def file_name(stem: str, bucket) -> str:
    """A bucket's array file: images.832x1216.npy (width x height in pixels)."""
    return f"{stem}.{bucket[0]}x{bucket[1]}.npy"
