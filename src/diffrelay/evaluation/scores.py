"""The scores fid.metrics asks for, and ADM's protocol against an ADM reference batch.

With fid.metrics unset, `diffrelay fid` gives what it always gave (fid.py: each extractor's distance, KID
and precision/recall where the reference allows). With it set, each result holds exactly those metrics:
  fid / fd_dinov2   the distance of each extractor (fid for Inception, random or your own; fd_dinov2 for DINOv2)
  sfid, is          ADM's sFID and Inception Score, from the same Inception pass as FID (inception.Heads)
  kid, precision, recall   against the reference's features
An ADM reference batch (guided-diffusion's VIRTUAL_imagenet256_labeled.npz and kin: arr_0 images and/or mu,
sigma, mu_s, sigma_s) is scored as evaluator.py scores it: FID and sFID from the file's statistics with its
sqrtm handling, precision/recall with its k = 3 manifold estimator against arr_0's pool features. Those
features cost one pass over arr_0; they are cached beside the dataset statistics (--cache-dir).
"""

import hashlib
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
from scipy.linalg import LinAlgWarning

from diffrelay import io, logs
from diffrelay.errors import UserError
from diffrelay.evaluation import adm, features, metrics, npz

# Names as the papers' tables print them (DiT Table 4, edm2 Table 2); the count is appended: FID-50k.
LABELS = {"fid": "FID", "sfid": "sFID", "is": "IS", "kid": "KID", "precision": "Precision", "recall": "Recall",
          "fd_dinov2": "FD_DINOv2"}
NEED_REFERENCE_FEATURES = {"kid", "precision", "recall"}
log = logs.get()


def distance_key(ext) -> str:
    """The fid.metrics name of an extractor's distance."""
    return "fd_dinov2" if ext.kind == "dinov2" else "fid"


def is_adm(path) -> bool:
    """An ADM reference batch: an .npz with arr_0 or mu_s (a diffrelay fid-ref file has a digest instead)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False
    return "digest.npy" not in names and bool({"arr_0.npy", "mu_s.npy"} & names)


def _image_side(path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.height, im.width


def check_adm_file(path, wanted: set, side: tuple[int, int], what: str = "the samples") -> dict:
    """read_reference's checks, arr_0's image size against `side` (H, W), and what the metrics need."""
    path = Path(path)
    r = adm.read_reference(path)
    shape = r["images_shape"]
    if shape is not None and tuple(shape[1:3]) != tuple(side):
        raise UserError(f"{path}: arr_0 holds {shape[1]}x{shape[2]} images and {what} are {side[0]}x{side[1]}; "
                        "use the reference batch of the samples' resolution")
    asked = sorted(wanted & NEED_REFERENCE_FEATURES)
    if asked:
        adm.require(r, ["arr_0"], path, f"{', '.join(asked)} need its images; use a batch that has them or drop "
                    f"{', '.join(asked)} from fid.metrics")
    if "sfid" in wanted and "mu_s" not in r and ("mu" in r or shape is None):
        adm.require(r, ["mu_s", "sigma_s"], path, "sfid needs them: use a reference that has them "
                    "(VIRTUAL_imagenet256_labeled.npz does) or drop sfid from fid.metrics")
    # arr_0's images as the metrics use them, counted from its header: a pass over the samples is not paid for a
    # reference that cannot score (statistics need 2 rows, precision/recall more than their k = 3 neighbours).
    uses = [(4, m) for m in asked if m in ("precision", "recall")] + [(2, m) for m in asked if m == "kid"]
    uses += [(2, "fid from its images (no mu/sigma)")] * ("mu" not in r)
    uses += [(2, "sfid from its images (no mu_s/sigma_s)")] * ("sfid" in wanted and "mu_s" not in r)
    if shape is not None and uses and shape[0] < max(n for n, _ in uses):
        need = max(n for n, _ in uses)
        raise UserError(f"{path}: arr_0 holds {shape[0]} image{'s' * (shape[0] != 1)}; {', '.join(m for n, m in uses if n == need)} need "
                        f"at least {need}; use a reference batch with more images")
    return r


def adm_reference(path, files, wanted: set) -> dict:
    """An ADM batch checked against the samples and the metrics asked for, before any network runs."""
    path = Path(path)
    r = check_adm_file(path, wanted, _image_side(files[0]), f"the samples ({files[0].name})")
    shape, asked = r["images_shape"], sorted(wanted & NEED_REFERENCE_FEATURES)
    images = r["members"].get("arr_0")
    if (asked or "mu" not in r) and images is not None and images.compressed:  # inflated whole, before any pass
        npz.check_memory(path, "arr_0 (compressed)", images.nbytes, "store it uncompressed (np.savez: it is then "
                         "memory-mapped) or give the job more memory")
    settings = {"adm": True, "foreign": True, "num_images": None if shape is None else int(shape[0]),
                "source": path.name}
    return {**{k: r.get(k) for k in adm.STAT_KEYS}, "features": None, "images_shape": shape, "settings": settings,
            # What must come from arr_0's features: ADM computes mu/sigma (and mu_s/sigma_s) from them when the
            # file has no mu, as Evaluator.read_statistics does.
            "need_pool": bool(asked) or "mu" not in r, "need_spatial": "sfid" in wanted and "mu_s" not in r}


def check_adm_extractor(ext, ref_path) -> None:
    """An ADM batch is Inception's (its statistics, and the features its images are scored with), whatever
    fid.metrics says: another extractor's distance to it would be a number of no meaning."""
    if ext.kind != "inception":
        raise UserError(f"{ref_path}: an ADM reference batch holds Inception statistics, but its extractor "
                        f"{ext.path.name} is not clean-fid's Inception; give it only for inception")


def check(ext, ref: dict, ref_path, wanted: set) -> None:
    """The metrics asked for must be possible with this extractor and reference (one line otherwise)."""
    key = distance_key(ext)
    if key not in wanted:
        raise UserError(f"--metrics={','.join(sorted(wanted))}: no {key} for the extractor {ext.path.name}; add "
                        f"{key} to fid.metrics or drop the extractor from fid.extractors")
    if ref["settings"].get("adm"):
        check_adm_extractor(ext, ref_path)
        if ref["need_spatial"] and ext.heads is None:
            raise UserError(f"{ref_path}: sfid from arr_0 needs clean-fid's Inception as this reference's extractor")
        return
    asked = sorted(wanted & NEED_REFERENCE_FEATURES)
    if asked and ref["features"] is None:
        raise UserError(f"{ref_path}: holds mu and sigma only, so no {', '.join(asked)}; use the dataset's own "
                        f"statistics or an ADM batch with arr_0 as fid.reference, or drop {', '.join(asked)} "
                        "from fid.metrics")
    if "sfid" in wanted and ext.heads is not None:
        raise UserError(f"{ref_path}: sfid needs ADM's spatial statistics (mu_s, sigma_s); give an ADM reference "
                        "batch as fid.reference for inception (e.g. VIRTUAL_imagenet256_labeled.npz), or drop sfid "
                        "from fid.metrics")


# ---------------------------------------------------------------------------- arr_0's features, cached

def _digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _read_cache(path: Path) -> dict | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        log.warning(f"{path}: unreadable cached reference features ({type(e).__name__}); computing them again")
        return None
    digest = arrays.pop("digest", None)
    if digest is None or str(digest) != _digest(arrays):
        log.warning(f"{path}: cached reference features fail their digest; computing them again")
        return None
    return arrays


def reference_features(ref: dict, ref_path, ext, mode: str, batch_size: int, device, workers: int,
                       cache_dir=None) -> None:
    """Fill in what `ref` needs from arr_0: its pool features (and spatial ones for sFID when the file has no
    mu_s), and the statistics the file lacks. Cached by (file, extractor, mode, device type)."""
    if not (ref["need_pool"] or ref["need_spatial"]):
        return
    spatial = ref["need_spatial"]
    cached = None
    if cache_dir:
        name = f"adm-{adm.fingerprint(ref_path)[:16]}-{ext.sha256[:16]}-{mode}-{device.type}{'-spatial' * spatial}.npz"
        cached = Path(cache_dir) / name
    feats = _read_cache(cached) if cached is not None and cached.is_file() else None
    if feats is None:
        t0, images = time.time(), adm.images(ref_path)
        items = features.array_images(images, np.arange(len(images)), [features.view_of(ext, mode)])
        [out] = features.features(items, [ext], mode, batch_size, device, workers)
        feats = {"pool": out["pool"], **({"spatial": out["spatial"]} if spatial else {})} if isinstance(out, dict) \
            else {"pool": out}
        log.info(f"{ref_path}: features of its {len(images)} images in {time.time() - t0:.1f}s")
        if cached is not None:
            try:
                with io.atomic_write(cached) as f:
                    np.savez(f, digest=np.array(_digest(feats)), **feats)
            except (OSError, UserError) as e:  # the cache only saves time; the features in hand still score this job
                log.warning(f"arr_0's features not cached ({e}); the next job computes them again")
    else:
        log.info(f"{ref_path}: reused the cached features of its images ({cached})")
    ref["features"] = feats["pool"]
    if ref["mu"] is None:
        ref["mu"], ref["sigma"] = adm.statistics(feats["pool"])
    if spatial:
        ref["mu_s"], ref["sigma_s"] = adm.statistics(feats["spatial"])


# ---------------------------------------------------------------------------- one extractor's scores

def record(ext, label: str, feats, ref: dict, ref_path, wanted: set, device="cpu") -> dict:
    """The result entry of one extractor: its distance and every other asked-for metric it carries, each
    with its name and image count in "labels". ADM's precision/recall run on `device`, the scoring job's."""
    pool = feats["pool"] if isinstance(feats, dict) else feats
    n, on_adm = len(pool), bool(ref["settings"].get("adm"))
    if n <= pool.shape[1]:
        log.warning(f"{n} images for {pool.shape[1]} features: the covariance is rank-deficient, so {label} is "
                    "biased upward; compare only scores with equal image counts")
    values = {}
    with warnings.catch_warnings():
        # Fewer images than features make sigma singular: said once above, not by scipy at every sqrtm.
        warnings.simplefilter("ignore", LinAlgWarning)
        if on_adm:  # evaluator.py's arithmetic, as the papers' tables
            values["fid"] = adm.frechet_distance(*adm.statistics(pool), ref["mu"], ref["sigma"])
        else:
            values["fid"] = metrics.frechet(*metrics.statistics(pool), ref)
        if ext.heads is not None and "sfid" in wanted:
            values["sfid"] = adm.frechet_distance(*adm.statistics(feats["spatial"]), ref["mu_s"], ref["sigma_s"])
    if ext.heads is not None and "is" in wanted:
        values["is"] = adm.inception_score(feats["probs"])
    if "kid" in wanted:
        values["kid"] = metrics.kernel_distance(pool, ref)
    if wanted & {"precision", "recall"}:
        if on_adm:  # the distance blocks on the job's device (10k x 10k x 2048 each), not in host NumPy
            values["precision"], values["recall"] = adm.precision_recall(ref["features"], pool, device=device)
        else:
            values["precision"], values["recall"] = metrics.precision_recall(ref["features"], pool)
        for key in {"precision", "recall"} - wanted:
            values.pop(key)
    labels = {k: metrics.metric_name(label if k == "fid" else LABELS[k], n) for k in values}
    return {"metric": labels["fid"], "kid": None, **values, "labels": labels,
            "protocol": "adm" if on_adm else "clean-fid", "num_ref": ref["settings"]["num_images"],
            "feature_dim": int(pool.shape[1]),  # with num_ref: scores.md says when the reference is singular
            "reference": Path(ref_path).name, "ref": str(ref_path), "extractor": str(ext.path),
            "extractor_sha256": ext.sha256}
