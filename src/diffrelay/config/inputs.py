"""The dataset's folders and image counts against what the later stages need, before any job (preflight.check).

data.path and data.val_path must be folders of images. Each count a later stage refuses is checked here, naming
the key that sets it: the reference statistics of the dataset (fid-ref: at least 2 images, 4 with precision or
recall, which need more than their k = 3 neighbours), the samples each evaluation scores (the same), and a text
run's held-out split (data.val_fraction, data.val_path), which is that reference, gives the captions sampled
without a prompt file and is what val_loss scores (at least 1). Found after a segment has trained, each of these
costs the segment; here, one line.
"""

import math
import os
from pathlib import Path

from diffrelay import io
from diffrelay.errors import UserError
from diffrelay.evaluation import protocol, refsize

PR_NEED = 4  # precision/recall: more than their k = 3 nearest neighbours on each side (evaluation/metrics.py)


def count_images(root: Path, enough: int) -> int:
    """Images under `root` (the extensions prepare reads), counted up to `enough`: stays cheap on 1 M files."""
    from diffrelay.data.files import EXTENSIONS

    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        n += sum(1 for f in filenames if not f.startswith(".") and f.lower().endswith(EXTENSIONS))
        if n >= enough:
            break
    return n


def _folder(value: str, key: str, source: str, what: str) -> Path:
    root = Path(value).expanduser()
    if not root.is_dir():
        why = "is not a folder" if root.exists() else "folder not found"
        raise UserError(f"{source}: {key}={value}: {why}; set {key} to an existing {what}")
    return root


def scored_need(d: dict) -> tuple[int, str]:
    """(images, note) each side of a score needs, a reference's statistics and a sample folder's features: 2, or
    4 with precision or recall (the note says why)."""
    if {"precision", "recall"} & set(d["fid"].get("metrics") or ()):
        return PR_NEED, " (precision/recall: more than their k = 3 neighbours)"
    return 2, ""


def held_out_needs(d: dict) -> list[tuple[int, str]]:
    """(images, what needs them) of a text run's held-out split, the first that needs most first."""
    f, s = d["fid"], d["sample"]
    n, note = scored_need(d)
    needs = []
    if any(protocol.reference_file(f, name) is None for name in protocol.extractor_names(f)):
        needs.append((n, f"the held-out images' reference statistics (fid-ref) need at least {n}{note}"))
    if not protocol.prompt_files(s) or s.get("held_out_captions"):
        needs.append((n, f"the held-out captions sampled and scored need at least {n}{note}"))
    if "val_loss" in (f.get("metrics") or ()):
        needs.append((1, "val_loss needs at least 1"))
    return sorted(needs, key=lambda x: -x[0])


def check_held_out(cfg, source: str) -> None:
    """A text run's held-out split holds as many images as its users need (held_out_needs)."""
    d, data = cfg.to_dict(), cfg.data
    needs = held_out_needs(d)
    if not needs:
        return
    need, why = needs[0]
    if data.val_path:
        have = count_images(Path(data.val_path).expanduser(), need)
        if have < need:
            raise UserError(f"{source}: data.val_path={data.val_path}: {have} image{'s' * (have != 1)}, and {why}; "
                            f"put at least {need} images in data.val_path")
        return
    fraction = data.val_fraction
    total = data.count if data.kind == "shapes" else count_images(Path(data.path).expanduser(),
                                                                  math.ceil(need / fraction) + 2)
    have = refsize.held_out_count(total, fraction)
    if have >= need:
        return
    key = "data.count" if data.kind == "shapes" else "data.path"
    least = math.ceil((need - 0.5) / total * 100) / 100 if total > need else 1.0  # the least whole percent
    while refsize.held_out_count(total, least) < need and least <= 0.5:
        least = round(least + 0.01, 2)
    other = f"raise {key}" if data.kind == "shapes" else f"give data.val_path a folder of {need} or more images"
    if least > 0.5:  # data.val_fraction's maximum; one image at least stays to train on
        fix = f"add images to {key}, or {other}" if data.kind != "shapes" else other
    else:
        fix = f"raise data.val_fraction to {least:g} or more, or {other}"
    raise UserError(f"{source}: data.val_fraction={fraction}: holds out {have} of the {total} images of {key}, and "
                    f"{why}; {fix}")


def check(cfg, source: str) -> None:
    """data.path and data.val_path are folders of images, and every count a later stage needs is there."""
    d, f, s = cfg.data, cfg.fid, cfg.sample
    full = cfg.to_dict()
    n, note = scored_need(full)
    why = f"FID needs at least {n} images{note}"
    held = d.captions != "none" and (d.val_fraction > 0 or d.val_path)
    if d.kind == "folder":
        root = _folder(d.path, "data.path", source, "image folder")
        if d.captions != "none" and d.val_path:
            val = _folder(d.val_path, "data.val_path", source, "folder of held-out images")
            if not count_images(val, 1):
                raise UserError(f"{source}: data.val_path={d.val_path}: no images found (searched recursively for "
                                ".png, .jpg, .jpeg, .webp, any case); put the held-out images there, or fix the path")
        # A text run's reference is its held-out split, which fid-ref takes whole when fid.ref_images (the base
        # config's 1000) asks for more: a 60-image fine-tune set is no reason to refuse.
        need = 2 if held else max(n, f.ref_images)
        have = count_images(root, need)
        if have < need:
            raise UserError(f"{source}: data.path={d.path}: {have} images, but FID needs "
                            f"{f'at least {need}{note}' if need == n else f'fid.ref_images={need}'}; add images or "
                            "lower fid.ref_images")
    elif f.ref_images > d.count:
        raise UserError(f"{source}: fid.ref_images={f.ref_images}: the dataset has data.count={d.count} images; "
                        "use at most that, or 0 for all")
    if 0 < f.ref_images < n:
        raise UserError(f"{source}: fid.ref_images={f.ref_images}: {why}; use 0 (all) or at least {n}")
    if not held and d.kind == "shapes" and d.count < n:
        raise UserError(f"{source}: data.count={d.count}: {why}; use at least {n}")
    if held:
        check_held_out(cfg, source)
    if s.num_images < n:
        raise UserError(f"{source}: sample.num_images={s.num_images}: {why}; use {n} or more")
    files = protocol.prompt_files(full["sample"]) if d.captions != "none" else []
    for path in files:
        from diffrelay.data import prompts

        try:
            total = sum(e.num_images for e in prompts.read(path))
        except UserError:
            continue  # said when it is sampled, naming its line
        if total < n:
            raise UserError(f"{path}: {total} image{'s' * (total != 1)} in all, and each evaluation scores them: "
                            f"{why}; add prompts or num_images (sample.prompts)")


def reference_counter(cfg):
    """(count, said) for `diffrelay validate`'s reference notes (refsize.config_notes). count(root, enough) is
    count_images, except with data.on_corrupt skip, where a folder of fewer than `enough` image files counts only
    those prepare will decode (each decoded as prepare does, files.unreadable), so the note's count is what the
    reference holds. said(notes) gives the warning lines of what was left out and why (none without). A text run's
    data.val_fraction split is counted by its files (which of them fail is known at prepare); its line says so."""
    d, met = cfg.data, []
    if d.on_corrupt != "skip" or d.kind != "folder":
        return count_images, lambda notes: []
    by_fraction = d.captions != "none" and d.val_fraction > 0 and not d.val_path

    def count(root: Path, enough: int) -> int:
        n = count_images(root, enough)
        if n >= enough or by_fraction:
            return n  # as many as asked for by name: no note comes of it
        from diffrelay.data import files

        bad = [why for p in _image_files(root) if (why := files.unreadable(p, d.max_image_pixels))]
        met.append((root, n, bad))
        return n - len(bad)

    def said(notes: list) -> list[str]:
        lines = [f"{io.shown(root)}: {len(bad)} of its {n} image files will be skipped (data.on_corrupt: skip), e.g. {bad[0]}; "
                 f"the counts above are of the {n - len(bad)} prepare can decode" for root, n, bad in met if bad]
        if by_fraction and notes:
            lines.append("data.on_corrupt: skip: the held-out images above are counted by file name; prepare says "
                         "how many of them it cannot decode and leaves out")
        return lines

    return count, said


def _image_files(root: Path):
    from diffrelay.data.files import EXTENSIONS

    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith(".") and f.lower().endswith(EXTENSIONS):
                yield Path(dirpath) / f
