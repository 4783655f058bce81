"""A reference with no more images than its extractor has features: its covariance (sigma) has rank at most
images - 1, so it is singular and the Fréchet distance against it is unreliable. `fid-ref` logs it, scores.md
prints it under the table (from each score entry's num_ref and feature_dim), and `diffrelay validate` prints it
when the config (and the disk) says how many images the reference will hold (`config_notes`).

Plain Python (no torch): the feature counts of the built-in extractors are restated here (tests check them
against extractor.py and dinov2.py); a file of your own has its count only once loaded, so validate skips it, as
it skips an extractor whose fid.reference is a file made elsewhere.
"""

import math
from pathlib import Path

from diffrelay import io
from diffrelay.errors import UserError
from diffrelay.evaluation import protocol

FEATURE_DIMS = {"inception": 2048, "random": 128, "dinov2": 1024, "dinov2-vits14": 384, "dinov2-vitb14": 768,
                "dinov2-vitl14": 1024, "dinov2-vitg14": 1536}
FIX = ("hold out at least {need} images (data.val_fraction, data.val_path), or use at least {need} reference images "
       "(fid.ref_images, 0 = all)")


def singular(images, dim) -> bool:
    return images is not None and dim is not None and images <= dim


def note(images: int, dim: int, name: str, fix: str | None = None) -> str:
    """The line that says it, with the number of images needed."""
    return (f"the reference of {name} has {images} image{'s' * (images != 1)} for its {dim} features (it needs at "
            f"least {dim + 1}): its covariance is singular and {name} is unreliable; "
            f"{fix or FIX.format(need=dim + 1)}")


def held_out_count(n: int, fraction: float) -> int:
    """How many of n images data.val_fraction holds out (data/captions.held_out's rule)."""
    return min(n - 1, max(1, math.floor(fraction * n + 0.5))) if fraction > 0 and n >= 2 else 0


def _prepared_count(dataset: Path, held: bool) -> int | None:
    """The reference's pool in a prepared dataset (its held-out split's in a text run), None before prepare."""
    try:
        count = io.read_json(dataset / ("val" if held else "") / "dataset.json")["count"]
    except (UserError, KeyError, TypeError):
        return None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def reference_pool(d: dict, count_images, dataset: Path, enough: int) -> tuple[int, bool, int] | None:
    """(images fid-ref can draw from, whether they are a held-out split, the dataset's images or 0 when not
    counted); counts stop at `enough` (more says no more). None when the disk cannot say yet."""
    data = d["data"]
    held = data.get("captions", "none") != "none" and bool(data.get("val_fraction") or data.get("val_path"))
    pool = _prepared_count(dataset, held)
    if pool is not None:
        return pool, held, 0
    fraction = data.get("val_fraction") or 0.0
    if held and data.get("val_path"):
        return count_images(Path(data["val_path"]).expanduser(), enough), True, 0
    upto = math.ceil(enough / fraction) + 2 if held else enough
    try:
        total = data["count"] if data["kind"] == "shapes" else count_images(Path(data["path"]).expanduser(), upto)
    except OSError:
        return None
    return (held_out_count(total, fraction) if held else total), held, total


def config_notes(d: dict, count_images, dataset) -> list[str]:
    """The notes of the extractors whose reference (fid-ref of the dataset: its held-out split in a text run,
    fid.ref_images of it) will hold no more images than the extractor's features. count_images(root, enough):
    images under root, counted up to enough (config/preflight.count_images); dataset: the run's dataset folder."""
    f = d["fid"]
    dims = {name: FEATURE_DIMS[name] for name in protocol.extractor_names(f)
            if name in FEATURE_DIMS and protocol.reference_file(f, name) is None}
    if not dims:
        return []
    need = max(dims.values()) + 1
    found = reference_pool(d, count_images, Path(dataset), need)
    if found is None:
        return []
    pool, held, total = found
    ref_images = f.get("ref_images") or 0
    images = min(ref_images, pool) if ref_images else pool  # fid-ref takes all held-out images past their count
    out = []
    for name, dim in dims.items():
        if not singular(images, dim):
            continue
        if ref_images and ref_images < pool and pool > dim:
            fix = f"set fid.ref_images to at least {dim + 1} (0 = all)"
        elif held and d["data"].get("val_path"):
            fix = f"put at least {dim + 1} images in data.val_path"
        elif held:
            of = f" of {total}" if total else ""
            fix = (f"hold out at least {dim + 1} images: raise data.val_fraction (it holds out {pool}{of}), or give "
                   "data.val_path")
        else:
            fix = f"use a dataset of at least {dim + 1} images, or an extractor with fewer features"
        out.append(note(images, dim, name, fix))
    return out
