"""diffrelay.evaluation.adm against short restatements of the ADM evaluator's math (guided-diffusion
evaluations/evaluator.py), written here in plain NumPy: FID through a symmetric eigendecomposition, the
Inception Score with explicit loops, precision/recall from full distance matrices sorted with np.sort.

Tolerances: FID and IS relative 1e-6 (float64 throughout). Precision and recall are fractions of points and
must be equal. Radii (float32 squared distances) agree to 1e-6 of the largest squared norm (absolute), the size
of the float32 rounding in |u|^2 - 2 u.v + |v|^2 (BLAS rounds a product differently for different block shapes);
in the float16 mode, two float16 steps at that norm (2 u.v one rounding step apart, from such a difference).
"""

import math
import os
import warnings
import zipfile

import numpy as np
import pytest
from scipy import linalg

from diffrelay.errors import UserError
from diffrelay.evaluation import adm

SFID_WHY = ("sfid needs them: use a reference that has them (VIRTUAL_imagenet256_labeled.npz does) or drop sfid "
            "from fid.metrics")


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


# ---------------------------------------------------------------------------- restatements

def psd_sqrt(s):
    w, v = np.linalg.eigh(s)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def fid_by_eigen(mu1, s1, mu2, s2, shift=0.0):
    """tr sqrt(S1 S2) = sum of sqrt(eigenvalues of S1^1/2 S2 S1^1/2), a symmetric PSD matrix; with `shift`, the
    evaluator's retry: both S shifted by shift * I inside the square root only."""
    a, b = s1 + shift * np.eye(len(s1)), s2 + shift * np.eye(len(s2))
    h = psd_sqrt(a)
    tr_sqrt = np.sum(np.sqrt(np.clip(np.linalg.eigvalsh(h @ b @ h), 0, None)))
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * tr_sqrt)


def is_by_loops(p, split):
    scores = []
    for start in range(0, len(p), split):
        rows = p[start:start + split]
        marginal = [sum(r[c] for r in rows) / len(rows) for c in range(p.shape[1])]
        kls = [sum(r[c] * (math.log(r[c]) - math.log(marginal[c])) for c in range(p.shape[1])) for r in rows]
        scores.append(math.exp(sum(kls) / len(kls)))
    return sum(scores) / len(scores)


def sq_dist_f32(u, v):
    u, v = u.astype(np.float32), v.astype(np.float32)
    return np.maximum((u * u).sum(1)[:, None] - 2 * (u @ v.T.copy()) + (v * v).sum(1)[None, :], 0)


def sq_dist_f16(u, v):
    """The evaluator's float16 graph in NumPy's float16 arithmetic (sum and matmul accumulated in float32)."""
    u, v = u.astype(np.float16), v.astype(np.float16)
    nu = np.square(u).sum(1, dtype=np.float32).astype(np.float16)[:, None]
    nv = np.square(v).sum(1, dtype=np.float32).astype(np.float16)[None, :]
    prod = (u.astype(np.float32) @ v.astype(np.float32).T).astype(np.float16)
    return np.maximum(nu - 2 * prod + nv, np.float16(0)).astype(np.float32)


def pr_brute(real, fake, k, dist):
    r_real = np.sort(dist(real, real), axis=1)[:, k]  # column 0 is the point itself
    r_fake = np.sort(dist(fake, fake), axis=1)[:, k]
    d = dist(real, fake)
    precision = np.mean([np.any(d[:, j] <= r_real) for j in range(len(fake))])
    recall = np.mean([np.any(d[i, :] <= r_fake) for i in range(len(real))])
    return precision, recall, r_real


def clouds(seed, n_real=400, n_fake=350, d=64, latent=8):
    """Points near an 8-dim plane, the fake ones shifted and wider: precision and recall strictly in (0, 1)."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((latent, d)) / np.sqrt(latent)
    real = rng.standard_normal((n_real, latent)) @ mix + 0.05 * rng.standard_normal((n_real, d)) + 0.5
    fake = (rng.standard_normal((n_fake, latent)) * 1.2 + 0.3) @ mix + 0.05 * rng.standard_normal((n_fake, d)) + 0.5
    return real.astype(np.float32), fake.astype(np.float32)


# ---------------------------------------------------------------------------- FID

def test_statistics_are_mean_and_unbiased_covariance():
    x = np.random.default_rng(0).standard_normal((50, 6))
    mu, sigma = adm.statistics(x)
    centred = x - x.mean(0)
    np.testing.assert_allclose(mu, x.sum(0) / 50, rtol=1e-12)
    np.testing.assert_allclose(sigma, centred.T @ centred / 49, rtol=1e-12)


def test_fid_matches_eigen_restatement():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((300, 64)) @ rng.standard_normal((64, 64)) * 0.3
    b = rng.standard_normal((400, 64)) @ rng.standard_normal((64, 64)) * 0.3 + 0.2
    (m1, s1), (m2, s2) = adm.statistics(a), adm.statistics(b)
    got = adm.frechet_distance(m1, s1, m2, s2)
    assert got == pytest.approx(fid_by_eigen(m1, s1, m2, s2), rel=1e-6)
    assert adm.frechet_distance(m1, s1, m1, s1) == pytest.approx(0, abs=1e-6 * np.trace(s1))


def test_fid_with_fewer_rows_than_dimensions():
    rng = np.random.default_rng(2)
    (m1, s1), (m2, s2) = adm.statistics(rng.standard_normal((40, 64))), adm.statistics(rng.random((30, 64)))
    assert adm.frechet_distance(m1, s1, m2, s2) == pytest.approx(fid_by_eigen(m1, s1, m2, s2), rel=1e-6)


def test_singular_product_takes_the_eps_shift_path():
    # 2 rows x 4 features: both covariances have rank 1, and scipy's sqrtm of their product is NaN
    (m1, s1), (m2, s2) = adm.statistics(np.array([[1.0, 2, 0, 0], [0, 1, 1, 0]])), adm.statistics(
        np.array([[1.0, 0, 2, 2], [1, 1, 0, 0]]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        assert not np.isfinite(linalg.sqrtm(s1 @ s2)).all(), "precondition: this scipy's sqrtm must fail here"
        with pytest.warns(RuntimeWarning, match="adding 1e-06 to the diagonal"):
            got = adm.frechet_distance(m1, s1, m2, s2)
        with pytest.warns(RuntimeWarning):
            bigger = adm.frechet_distance(m1, s1, m2, s2, eps=1e-2)
    assert got == pytest.approx(fid_by_eigen(m1, s1, m2, s2, shift=1e-6), rel=1e-6)
    assert bigger == pytest.approx(fid_by_eigen(m1, s1, m2, s2, shift=1e-2), rel=1e-6)
    assert got != pytest.approx(bigger, rel=1e-3)  # the shift is really applied (and only inside the root)


def test_fid_refuses_a_large_imaginary_diagonal_and_mismatched_shapes():
    eye = np.eye(2)
    with pytest.raises(UserError) as e:  # sqrtm(diag(-1, 1)) = diag(i, 1)
        adm.frechet_distance(np.zeros(2), eye, np.zeros(2), np.diag([-1.0, 1.0]))
    assert "imaginary" in one_line(e)
    with pytest.raises(UserError) as e:
        adm.frechet_distance(np.zeros(2), eye, np.zeros(3), np.eye(3))
    assert "(2,) and (3,)" in one_line(e)


# ---------------------------------------------------------------------------- Inception Score

def test_inception_score_matches_loops_with_a_short_last_split():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((23, 10)) * 2
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert adm.inception_score(p, split_size=5) == pytest.approx(is_by_loops(p, 5), rel=1e-6)  # 5, 5, 5, 5, 3
    assert adm.inception_score(p, split_size=100) == pytest.approx(is_by_loops(p, 100), rel=1e-6)
    # the short split is a full member of the mean: dropping it changes the score
    assert adm.inception_score(p, split_size=5) != pytest.approx(is_by_loops(p[:20], 5), rel=1e-6)


def test_inception_score_of_known_cases():
    assert adm.inception_score(np.full((8, 4), 0.25)) == pytest.approx(1.0)  # every row the marginal: KL 0
    onehot = np.full((8, 4), 1e-12) + np.eye(4)[np.arange(8) % 4]
    assert adm.inception_score(onehot) == pytest.approx(4.0, rel=1e-6)  # confident and uniform over 4 classes
    with pytest.raises(UserError) as e:
        adm.inception_score(np.eye(4))  # exact zeros: 0 * log 0 would make the score NaN
    assert "> 0" in one_line(e)


# ---------------------------------------------------------------------------- precision and recall

def test_radii_are_the_kth_neighbour_without_the_point_itself():
    x = np.array([[0.0], [1], [3], [6], [10]])
    np.testing.assert_array_equal(adm.manifold_radii(x, k=1, distances="float32"), [1, 1, 4, 9, 16])
    # 3: squared distances 0, 4, 9, 9, 49 -> 9 (the tie counts twice); 6: 0, 9, 16, 25, 36 -> 25
    np.testing.assert_array_equal(adm.manifold_radii(x, k=3, distances="float32"), [36, 25, 9, 25, 81])
    np.testing.assert_array_equal(adm.manifold_radii(x, k=3, row_batch_size=2, col_batch_size=3), [36, 25, 9, 25, 81])


@pytest.mark.parametrize("mode", ["float16", "float32"])
def test_a_point_on_the_sphere_counts_as_inside(mode):
    real, fake = np.array([[0.0], [2], [4], [6]]), np.array([[8.0], [10], [12], [14]])  # k=1 radii: all 2^2
    # only 6 and 8 are within each other's radius, and exactly on it
    assert adm.precision_recall(real, fake, k=1, distances=mode) == (0.25, 0.25)
    assert adm.precision_recall(real, fake + 0.5, k=1, distances=mode) == (0.0, 0.0)


@pytest.mark.parametrize("mode, dist", [("float32", sq_dist_f32), ("float16", sq_dist_f16)])
def test_precision_recall_match_brute_force(mode, dist):
    real, fake = clouds(4)
    want_p, want_r, want_radii = pr_brute(real, fake, 3, dist)
    assert 0.2 < want_p < 0.95 and 0.2 < want_r < 0.995
    top = float((real.astype(np.float64) ** 2).sum(1).max())
    # float16: u.v is rounded at the scale of the norms, and 2 u.v one step apart moves a distance by 2 steps
    tol = 2 * float(np.spacing(np.float16(top))) if mode == "float16" else 1e-6 * top
    for rows, cols in ((10000, 10000), (97, 130)):
        p, r = adm.precision_recall(real, fake, k=3, row_batch_size=rows, col_batch_size=cols, distances=mode)
        assert (p, r) == (want_p, want_r), (rows, cols)
        radii = adm.manifold_radii(real, k=3, row_batch_size=rows, col_batch_size=cols, distances=mode)
        assert np.all(np.abs(radii - want_radii) <= tol), (rows, cols)


def test_batching_changes_nothing():
    real, fake = clouds(5, n_real=300, n_fake=260)
    for mode in ("float16", "float32"):
        whole = adm.precision_recall(real, fake, distances=mode)
        assert adm.precision_recall(real, fake, row_batch_size=64, col_batch_size=50, distances=mode) == whole
        assert adm.precision_recall(real, fake, row_batch_size=7, col_batch_size=300, distances=mode) == whole


def test_float16_distances_are_coarser_and_fall_back_when_they_overflow():
    real, fake = clouds(6, n_real=200, n_fake=150)
    d16, d32 = adm.pairwise_distances(real, fake), adm.pairwise_distances(real, fake, "float32")
    np.testing.assert_array_equal(d16, sq_dist_f16(real, fake))
    assert 0 < np.abs(d16 - d32).max() < 0.01 * d32.max()
    big = real * 100  # |u|^2 far beyond 65504: every block is computed again in float32
    np.testing.assert_array_equal(adm.pairwise_distances(big, fake), adm.pairwise_distances(big, fake, "float32"))
    assert adm.precision_recall(big, fake * 100, row_batch_size=64) == adm.precision_recall(
        big, fake * 100, row_batch_size=64, distances="float32")


def numpy_path(real, fake, k, mode, rows, cols):
    """Radii, memberships and precision/recall from adm.pairwise_distances (NumPy) in the evaluator's blocks."""
    def radii(x):
        d = np.concatenate([np.concatenate([adm.pairwise_distances(x[r:r + rows], x[c:c + cols], mode)
                                            for c in range(0, len(x), cols)], 1) for r in range(0, len(x), rows)])
        return np.partition(d, k, axis=1)[:, k]
    r_real, r_fake = radii(real), radii(fake)
    d = adm.pairwise_distances(real, fake, mode)
    fake_in, real_in = np.any(d <= r_real[:, None], axis=0), np.any(d <= r_fake[None, :], axis=1)
    return r_real, r_fake, fake_in, real_in


@pytest.mark.parametrize("mode", ["float16", "float32"])
def test_torch_blocks_equal_the_numpy_path_where_ties_decide(mode):
    """Small integer features: every operation is exact in float16 and float32, whatever the summation order,
    so the torch blocks must give the NumPy path's values bit for bit. Duplicate points and equal distances
    make k-th neighbour ties and points exactly on a radius, split across blocks by the odd batch sizes."""
    rng = np.random.default_rng(11)
    real = rng.integers(0, 4, (90, 5)).astype(np.float32)
    fake = rng.integers(0, 4, (70, 5)).astype(np.float32) + np.float32(1)
    real[10:14] = real[3]  # four copies: radii of 0 at k = 3
    for rows, cols in ((10000, 10000), (7, 13)):
        r_real, r_fake, fake_in, real_in = numpy_path(real, fake, 3, mode, rows, cols)
        torch_radii = adm.manifold_radii(real, 3, rows, cols, mode, device="cpu")
        np.testing.assert_array_equal(torch_radii, r_real)
        assert torch_radii[3] == 0 and r_real.dtype == torch_radii.dtype == np.float32
        np.testing.assert_array_equal(adm.manifold_radii(fake, 3, rows, cols, mode, device="cpu"), r_fake)
        ins = adm.in_manifolds(real, r_real, fake, r_fake, rows, cols, mode, device="cpu")
        np.testing.assert_array_equal(ins[0], fake_in)
        np.testing.assert_array_equal(ins[1], real_in)
        d = adm.pairwise_distances(real, fake, mode)
        assert np.any(d == r_real[:, None]) and 0 < fake_in.mean() < 1 and 0 < real_in.mean() < 1  # ties decide
        assert adm.precision_recall(real, fake, 3, rows, cols, mode, device="cpu") == (fake_in.mean(), real_in.mean())


def test_torch_blocks_match_the_numpy_blocks_within_a_rounding_step():
    """Pool-sized features: the torch and NumPy (OpenBLAS) matmuls and row sums add in different orders. In
    float32 a distance moves by float32 rounding (1e-6 of the largest squared norm, as above); in float16 only
    where that crosses a float16 rounding boundary (under 0.1 % of the distances), by at most two float16 steps
    at the largest |u|^2 + |v|^2 (u.v one step apart moves 2 u.v by a step at that scale, and the sum after it may
    round the other way once); seen: one step."""
    import torch

    real, fake = clouds(12, n_real=300, n_fake=260, d=2048, latent=16)
    top = float((real.astype(np.float64) ** 2).sum(1).max() + (fake.astype(np.float64) ** 2).sum(1).max())
    for mode in ("float16", "float32"):
        ours = adm._block(torch.from_numpy(real), torch.from_numpy(fake), mode).numpy()
        ref = adm.pairwise_distances(real, fake, mode)
        assert ours.dtype == np.float32 and ours.shape == ref.shape
        tol = 2 * float(np.spacing(np.float16(top))) if mode == "float16" else 1e-6 * top
        assert np.abs(ours - ref).max() <= tol, mode
        if mode == "float16":
            assert np.mean(ours != ref) < 1e-3  # rare: the float32 difference must straddle a float16 boundary
        r_real, r_fake, fake_in, real_in = numpy_path(real, fake, 3, mode, 10000, 10000)
        assert adm.precision_recall(real, fake, distances=mode, device="cpu") == (fake_in.mean(), real_in.mean())


def test_a_block_with_a_float16_overflow_is_computed_again_in_float32_in_torch():
    import torch

    real, fake = clouds(13, n_real=40, n_fake=30)
    big = torch.from_numpy(real * 100)  # |u|^2 far beyond 65504
    np.testing.assert_array_equal(adm._block(big, torch.from_numpy(fake), "float16").numpy(),
                                  adm._block(big, torch.from_numpy(fake), "float32").numpy())
    assert not np.array_equal(adm._block(torch.from_numpy(real), torch.from_numpy(fake), "float16").numpy(),
                              adm._block(torch.from_numpy(real), torch.from_numpy(fake), "float32").numpy())


def test_precision_recall_refuses_bad_features():
    real, fake = clouds(7, n_real=20, n_fake=20)
    with pytest.raises(UserError) as e:
        adm.precision_recall(real, fake[:, :10])
    assert "64 values and fake 10" in one_line(e)
    with pytest.raises(UserError) as e:
        adm.precision_recall(real[:3], fake)
    assert "k = 3" in one_line(e)


# ---------------------------------------------------------------------------- reference batches

def write_ref(path, spatial=True, images=None):
    rng = np.random.default_rng(8)
    arrays = {"mu": rng.standard_normal(16), "sigma": np.eye(16)}
    if spatial:
        arrays.update(mu_s=rng.standard_normal(7), sigma_s=np.eye(7) * 2)
    if images is not None:
        arrays["arr_0"] = images
    np.savez(path, **arrays)
    return arrays


def test_read_reference_reads_what_is_there(tmp_path):
    images = np.random.default_rng(9).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    arrays = write_ref(tmp_path / "ref.npz", images=images)
    ref = adm.read_reference(tmp_path / "ref.npz")
    assert "arr_0" not in ref and ref["images_shape"] == (4, 8, 8, 3)
    for key in adm.STAT_KEYS:
        np.testing.assert_array_equal(ref[key], arrays[key])
    np.testing.assert_array_equal(adm.read_reference(tmp_path / "ref.npz", images=True)["arr_0"], images)
    adm.require(ref, ["mu", "sigma", "mu_s", "sigma_s", "arr_0"], tmp_path / "ref.npz", SFID_WHY)


def test_a_reference_without_spatial_statistics_fails_only_when_sfid_needs_them(tmp_path):
    path = tmp_path / "ref.npz"
    write_ref(path, spatial=False)
    ref = adm.read_reference(path)
    adm.require(ref, ["mu", "sigma"], path, "fid needs them")
    with pytest.raises(UserError) as e:
        adm.require(ref, ["mu_s", "sigma_s"], path, SFID_WHY)
    assert one_line(e) == f"{path}: an ADM reference batch without mu_s/sigma_s; {SFID_WHY}"
    with pytest.raises(UserError) as e:
        adm.require(ref, ["arr_0"], path, "precision needs the images")
    assert "without arr_0" in one_line(e)


@pytest.mark.parametrize("images, found", [(np.zeros((2, 8, 8, 3), np.float32), "float32 of shape (2, 8, 8, 3)"),
                                           (np.zeros((2, 8, 8), np.uint8), "uint8 of shape (2, 8, 8)"),
                                           (np.zeros((2, 8, 8, 4), np.uint8), "uint8 of shape (2, 8, 8, 4)")])
def test_images_of_the_wrong_dtype_or_shape_are_one_line(tmp_path, images, found):
    path = tmp_path / "ref.npz"
    write_ref(path, images=images)
    for load in (False, True):
        with pytest.raises(UserError) as e:
            adm.read_reference(path, images=load)
        msg = one_line(e)
        assert msg.startswith(f"{path}: arr_0 is {found};") and "uint8 images (N, H, W, 3)" in msg


def test_mismatched_statistics_are_one_line(tmp_path):
    path = tmp_path / "ref.npz"
    np.savez(path, mu=np.zeros(4), sigma=np.eye(3))
    with pytest.raises(UserError) as e:
        adm.read_reference(path)
    assert "mu of shape (4,) and sigma of shape (3, 3)" in one_line(e)
    np.savez(path, mu_s=np.zeros(4))
    with pytest.raises(UserError) as e:
        adm.read_reference(path)
    assert "mu_s without sigma_s" in one_line(e)


class Trap:
    """Pickles as a call to os.mkdir(path): if anything unpickled it, the folder would appear."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.mark.parametrize("key", ["mu", "arr_0"])
def test_pickled_objects_are_refused_without_loading(tmp_path, key):
    sentinel = tmp_path / "unpickled"
    path = tmp_path / "ref.npz"
    arrays = {"mu": np.zeros(3), "sigma": np.eye(3), key: np.array([Trap(sentinel)], dtype=object)}
    np.savez(path, **arrays)
    with zipfile.ZipFile(path) as z:
        assert f"{key}.npy" in z.namelist()
    for load in (False, True):
        with pytest.raises(UserError) as e:
            adm.read_reference(path, images=load)
        assert f"{key} holds pickled Python objects" in one_line(e)
    assert not sentinel.exists()


def test_unreadable_or_empty_references_are_one_line(tmp_path):
    with pytest.raises(UserError) as e:
        adm.read_reference(tmp_path / "missing.npz")
    assert "not found" in one_line(e)
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(UserError) as e:
        adm.read_reference(tmp_path / "junk.npz")
    assert "not a readable .npz" in one_line(e)
    np.save(tmp_path / "bare.npy", np.zeros(3))
    with pytest.raises(UserError) as e:
        adm.read_reference(tmp_path / "bare.npy")
    assert "not a readable .npz (BadZipFile" in one_line(e)
    np.savez(tmp_path / "other.npz", features=np.zeros((2, 3)))
    with pytest.raises(UserError) as e:
        adm.read_reference(tmp_path / "other.npz")
    assert "neither arr_0 nor mu/sigma (found features)" in one_line(e)
