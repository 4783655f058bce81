"""The Frechet distance between two Gaussians, as TTUR's fid.py computes it and both OpenAI's ADM evaluator
(FIDStatistics.frechet_distance) and clean-fid (fid.frechet_distance) copy it: one function for FID, sFID and
FD_DINOv2, kept apart from adm.py so metrics.py can use it without importing the evaluator's module.
"""

import warnings

import numpy as np
from scipy import linalg

from diffrelay.errors import UserError

IMAG_TOLERANCE = 1e-3  # FIDStatistics.frechet_distance: largest |imag| allowed on sqrtm's diagonal


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """|mu1 - mu2|^2 + tr(sigma1) + tr(sigma2) - 2 tr(sqrtm(sigma1 sigma2)), term for term as
    FIDStatistics.frechet_distance adds them (from TTUR's fid.py), with its two repairs of sqrtm:
      - a non-finite sqrtm is computed again from (sigma1 + eps I)(sigma2 + eps I); the traces stay those of
        the unshifted sigmas;
      - a complex sqrtm is accepted when every imaginary part on its diagonal is within 1e-3, and its real
        part is used; otherwise the evaluator raises, and so do we.
    One departure: where the evaluator would return NaN (sqrtm still not finite after the shift), we raise."""
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    if mu1.shape != mu2.shape or mu1.ndim != 1:
        raise UserError(f"frechet_distance: mean vectors of shapes {mu1.shape} and {mu2.shape}; both statistics "
                        "must come from the same features (2048 pool_3 for FID, 2023 spatial for sFID)")
    if not sigma1.shape == sigma2.shape == (len(mu1), len(mu1)):
        raise UserError(f"frechet_distance: covariances of shapes {sigma1.shape} and {sigma2.shape} for means of "
                        f"{len(mu1)} values; give D x D covariances of the same D features")
    for name, a in (("mu", mu1), ("sigma", sigma1), ("mu", mu2), ("sigma", sigma2)):
        if not np.isfinite(a).all():
            raise UserError(f"frechet_distance: {name} holds NaN or inf; recompute the statistics from finite features")
    diff = mu1 - mu2
    # scipy's `disp` only adds an error estimate to the return value; the square root itself is the same.
    covmean = linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        # evaluator.py: "product might be almost singular" -> shift both diagonals by eps and try once more
        warnings.warn(f"frechet_distance: sqrtm of the covariance product is not finite; adding {eps} to the "
                      "diagonal of both covariances", RuntimeWarning, stacklevel=2)
        shift = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + shift).dot(sigma2 + shift))
    if np.iscomplexobj(covmean):
        # np.allclose(diag.imag, 0, atol=1e-3) in the evaluator is |imag| <= 1e-3 entry by entry (NaN fails)
        if not np.all(np.abs(np.diagonal(covmean).imag) <= IMAG_TOLERANCE):
            worst = np.max(np.abs(covmean.imag))  # the evaluator reports the largest over the whole matrix
            raise UserError(f"frechet_distance: sqrtm of the covariance product has imaginary parts up to {worst:.3g} "
                            f"(more than {IMAG_TOLERANCE} on the diagonal); the covariances are not usable "
                            "together: use more images for the sample statistics")
        covmean = covmean.real
    value = diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean)
    if not np.isfinite(value):
        raise UserError("frechet_distance: sqrtm is not finite even with the eps shift (the evaluator would "
                        "print NaN); use more images so the covariances are not singular")
    return float(value)
