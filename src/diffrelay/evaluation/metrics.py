"""Evaluation beyond FID/KID: metric names that carry the image count, precision and recall, and
reference statistics made elsewhere (EDM's, ADM's or clean-fid's `.npz` with `mu` and `sigma`).
"""

import warnings
import zipfile
from pathlib import Path

import numpy as np

from diffrelay.errors import UserError

PR_NEIGHBOURS = 3  # Kynkaenniemi et al. 2019 use k = 3
PR_CHUNK = 1024  # rows of a distance block: 1024 x 10k float64 is 80 MB


def count_label(n: int) -> str:
    """50000 -> '50k', 2500 -> '2.5k', 256 -> '256', 1000000 -> '1M'."""
    for unit, size in (("M", 1_000_000), ("k", 1000)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return str(n)


def metric_name(label: str, num_images: int) -> str:
    """The metric with the number of generated images: 'FID' -> 'FID-50k', 'FD (random features)' ->
    'FD-256 (random features)'. Scores over other counts are other metrics (FID is biased by the count)."""
    head, _, rest = label.partition(" ")
    return f"{head}-{count_label(num_images)}" + (f" {rest}" if rest else "")


# ---------------------------------------------------------------------------------------------
# Precision and recall (improved, k-nearest-neighbour manifolds)


def _kth_distances(x: np.ndarray, k: int) -> np.ndarray:
    """Distance from each row of x to its k-th nearest other row."""
    out = np.empty(len(x))
    for i in range(0, len(x), PR_CHUNK):
        d = _distances(x[i:i + PR_CHUNK], x)
        out[i:i + PR_CHUNK] = np.partition(d, k, axis=1)[:, k]  # column 0 of the sort is the row itself
    return out


def _distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    sq = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
    return np.sqrt(np.maximum(sq, 0))


def _coverage(points: np.ndarray, centres: np.ndarray, radii: np.ndarray) -> float:
    """Fraction of points inside at least one ball (centre, radius)."""
    inside = 0
    for i in range(0, len(points), PR_CHUNK):
        inside += int((_distances(points[i:i + PR_CHUNK], centres) <= radii[None, :]).any(1).sum())
    return inside / len(points)


def precision_recall(real: np.ndarray, fake: np.ndarray, k: int = PR_NEIGHBOURS) -> tuple[float, float]:
    """Precision: share of generated samples inside the real manifold (union of k-NN balls of real
    features); recall: share of real samples inside the generated manifold. Float64 throughout."""
    real, fake = np.asarray(real, np.float64), np.asarray(fake, np.float64)
    if min(len(real), len(fake)) <= k:
        raise UserError(f"precision/recall need more than k={k} images on each side "
                        f"({len(real)} reference, {len(fake)} generated)")
    precision = _coverage(fake, real, _kth_distances(real, k))
    recall = _coverage(real, fake, _kth_distances(fake, k))
    return precision, recall


# ---------------------------------------------------------------------------------------------
# Reference statistics made elsewhere


def check_statistics(mu: np.ndarray, sigma: np.ndarray, path, fix: str, names=("mu", "sigma")) -> None:
    """mu and sigma must be finite and sigma a covariance (symmetric, positive semi-definite): otherwise FID is
    NaN with exit 0, or scipy's sqrtm fails with a traceback, after the costly feature pass. The one check of
    every statistics file: ours, another tool's, and an ADM batch's (`names`: its mu_s, sigma_s too)."""
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        what = names[0] if not np.isfinite(mu).all() else names[1]
        raise UserError(f"{path}: {what} holds NaN or inf values; {fix}")
    scale = max(float(np.abs(sigma).max()), 1e-300)
    if np.abs(sigma - sigma.T).max() > 1e-6 * scale:
        raise UserError(f"{path}: {names[1]} is not symmetric, so it is no covariance matrix; {fix}")
    # PSD up to rounding: a Cholesky factor exists once a jitter far below any real variance is added (a
    # covariance of fewer images than features is singular but still PSD).
    jitter = 1e-6 * max(float(np.trace(sigma)) / len(sigma), 1e-300)
    try:
        np.linalg.cholesky(sigma + jitter * np.eye(len(sigma)))
    except np.linalg.LinAlgError as e:
        raise UserError(f"{path}: {names[1]} is not positive semi-definite, so it is no covariance matrix; "
                        f"{fix}") from e


def load_foreign_ref(path, want_dim: int | None = None) -> dict:
    """mu and sigma of a `.npz` made by another tool (EDM, ADM, clean-fid). Never unpickles.

    Returns the same shape of dict as fid.load_ref, with features None (so no KID or precision/recall)."""
    from diffrelay.evaluation import npz

    path = Path(path)
    fix = "give an .npz holding float arrays mu (D,) and sigma (D, D)"
    members = npz.headers(path, fix)  # no array is loaded before its header and size are checked
    if not {"mu", "sigma"} <= members.keys():
        raise UserError(f"{path}: no mu and sigma arrays (found {', '.join(sorted(members)) or 'none'}); {fix}")
    npz.check_memory(path, "mu/sigma", members["mu"].nbytes + members["sigma"].nbytes, "give it to a job with more "
                     "memory, or check that the file holds the statistics of one extractor's features")
    try:
        with np.load(path, allow_pickle=False) as z:
            mu, sigma = np.asarray(z["mu"], np.float64), np.asarray(z["sigma"], np.float64)
    except ValueError as e:  # numpy's answer to an object array when allow_pickle=False
        raise UserError(f"{path}: holds pickled Python objects, which diffrelay never loads; {fix}") from e
    except (OSError, EOFError, KeyError, MemoryError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: not a readable .npz ({type(e).__name__}); {fix}") from e
    if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
        raise UserError(f"{path}: mu {mu.shape} and sigma {sigma.shape} do not fit together; {fix}")
    check_statistics(mu, sigma, path, fix)
    if want_dim is not None and len(mu) != want_dim:
        raise UserError(f"{path}: statistics of {len(mu)} features, but the extractor gives {want_dim}; "
                        "use the extractor these statistics were made with")
    settings = {"source": path.name, "feature_dim": len(mu), "num_images": None, "foreign": True}
    return {"mu": mu, "sigma": sigma, "features": None, "settings": settings}


# ---------------------------------------------------------------------------------------------
# clean-fid's FID and KID


def statistics(feats: np.ndarray):
    """mu, sigma exactly as clean-fid computes them."""
    return np.mean(feats, axis=0), np.cov(feats, rowvar=False)


def distances(feats, ref: dict) -> tuple[float, float]:
    """(FD, KID) of features against reference statistics, with clean-fid's formulas."""
    mu, sigma = statistics(feats)
    if ref["features"] is None:  # statistics made elsewhere: mu and sigma only, so no KID
        return frechet(mu, sigma, ref), None
    return frechet(mu, sigma, ref), kernel_distance(feats, ref)


def frechet(mu, sigma, ref) -> float:
    """clean-fid's frechet_distance, which is TTUR's formula and repairs: frechet.frechet_distance states them term
    for term (imported from cleanfid.fid it would bring torchvision and torch._dynamo into every scoring job, about
    1 s). One difference: where clean-fid would return NaN, this says so in one line."""
    from scipy.linalg import LinAlgWarning

    from diffrelay.evaluation.frechet import frechet_distance

    with warnings.catch_warnings():
        # Too few images for the feature count make sigma singular; `score` logs that once, in plain words.
        warnings.simplefilter("ignore", LinAlgWarning)
        warnings.simplefilter("ignore", RuntimeWarning)  # the eps shift, which clean-fid makes silently
        return frechet_distance(mu, sigma, ref["mu"], ref["sigma"])


def kernel_distance(feats, ref, subsets: int = 100, max_subset: int = 1000) -> float:
    """KID as clean-fid's kernel_distance(ref features, feats) computes it (Binkowski et al. 2018, the unbiased
    MMD^2 of the cubic polynomial kernel k(x, y) = (x.y / d + 1)^3, averaged over random subsets), with the same
    draws: clean-fid takes them from numpy's global generator seeded 0 here, the caller's state put back."""
    refs = np.asarray(ref["features"])
    d = refs.shape[1]
    m = min(len(refs), len(feats), max_subset)
    state = np.random.get_state()
    np.random.seed(0)
    try:
        total = 0
        for _ in range(subsets):
            x = feats[np.random.choice(len(feats), m, replace=False)]  # clean-fid draws from its second argument first
            y = refs[np.random.choice(len(refs), m, replace=False)]
            within = (x @ x.T / d + 1) ** 3 + (y @ y.T / d + 1) ** 3
            across = (x @ y.T / d + 1) ** 3
            total += (within.sum() - np.diag(within).sum()) / (m - 1) - across.sum() * 2 / m
        return float(total / subsets / m)
    finally:
        np.random.set_state(state)
