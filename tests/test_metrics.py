"""Evaluation one can compare: image counts in metric names, precision/recall, reference statistics
made elsewhere."""

import numpy as np
import pytest
from scipy.spatial.distance import cdist

from conftest import run_cli
from diffrelay.evaluation import extractor, features, fid, metrics
from diffrelay.errors import UserError
from test_fid import shapes, write_pngs


@pytest.mark.parametrize("label, n, name", [("FID", 50000, "FID-50k"), ("FID", 2000, "FID-2k"),
                                            ("FD (random features)", 256, "FD-256 (random features)"),
                                            ("FID", 2500, "FID-2.5k"), ("FD (x.pt)", 1_000_000, "FD-1M (x.pt)")])
def test_metric_names_carry_the_number_of_generated_images(label, n, name):
    assert metrics.metric_name(label, n) == name


def reference_precision_recall(real, fake, k=3):
    """The definition, written as plainly as possible (Kynkaanniemi et al. 2019)."""
    rr, ff, fr = cdist(real, real), cdist(fake, fake), cdist(fake, real)
    r_real = np.sort(rr, axis=1)[:, k]  # column 0 is the point itself
    r_fake = np.sort(ff, axis=1)[:, k]
    precision = np.mean([any(fr[i, j] <= r_real[j] for j in range(len(real))) for i in range(len(fake))])
    recall = np.mean([any(fr[j, i] <= r_fake[j] for j in range(len(fake))) for i in range(len(real))])
    return precision, recall


@pytest.mark.parametrize("seed", [0, 1])
def test_precision_recall_equal_a_plain_reference_implementation(seed, monkeypatch):
    monkeypatch.setattr(metrics, "PR_CHUNK", 37)  # several blocks, a ragged last one
    rng = np.random.default_rng(seed)
    real = rng.normal(size=(150, 16))
    fake = rng.normal(loc=0.4, scale=1.3, size=(120, 16))
    p, r = metrics.precision_recall(real, fake)
    p0, r0 = reference_precision_recall(real, fake)
    assert abs(p - p0) <= 1e-6 and abs(r - r0) <= 1e-6
    assert 0 < p < 1 and 0 < r < 1  # the shifted, wider set is neither inside nor around the real one
    assert metrics.precision_recall(real, real) == (1.0, 1.0)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign")
    imgs = shapes(64, seed=0)
    ext = extractor.build_random(root / "ext.pt", seed=0)
    loaded = extractor.load(ext)
    real = write_pngs(root / "real", imgs[:32])
    ref_feats = features.of_files(sorted(real.glob("*.png")), [loaded], "clean", 16, "cpu")[0]
    mu, sigma = fid.statistics(ref_feats)
    np.savez(root / "edm-stats.npz", mu=mu, sigma=sigma)  # the shape of EDM's and ADM's files
    return root, ext, write_pngs(root / "fake", imgs[32:]), mu, sigma


def test_reference_made_elsewhere_gives_fid_named_after_the_file_and_no_kid(scored):
    root, ext, fake, mu, sigma = scored
    r = fid.score(fake, root / "edm-stats.npz", ext)
    feats = features.of_files(sorted(fake.glob("*.png")), [extractor.load(ext)], "clean", 64, "cpu")[0]
    from cleanfid.fid import frechet_distance

    expected = frechet_distance(*fid.statistics(feats), mu, sigma)
    assert abs(r["fid"] - expected) <= 1e-6 and r["kid"] is None and "precision" not in r
    assert r["reference"] == "edm-stats.npz" and "no KID" in r["note"] and r["metric"] == "FD-32 (random features)"


@pytest.mark.parametrize("case, expect", [
    ("no-mu", "no mu and sigma arrays"), ("pickle", "pickled Python objects"), ("dim", "statistics of 5 features"),
    ("shape", "do not fit together"), ("nan-mu", "mu holds NaN or inf"), ("inf-sigma", "sigma holds NaN or inf"),
    ("not-psd", "sigma is not positive semi-definite"), ("asymmetric", "sigma is not symmetric")])
def test_bad_reference_files_are_one_line(scored, case, expect):
    root, ext, fake, mu, sigma = scored
    path = root / f"{case}.npz"
    if case == "no-mu":
        np.savez(path, m=mu, s=sigma)
    elif case == "pickle":
        np.savez(path, mu=np.array([{"a": 1}], dtype=object), sigma=sigma)
    elif case == "dim":
        np.savez(path, mu=np.zeros(5), sigma=np.eye(5))
    elif case == "nan-mu":
        np.savez(path, mu=np.where(np.arange(len(mu)) == 7, np.nan, mu), sigma=sigma)
    elif case == "inf-sigma":
        bad = sigma.copy()
        bad[2, 2] = np.inf
        np.savez(path, mu=mu, sigma=bad)
    elif case == "not-psd":
        np.savez(path, mu=mu, sigma=sigma - 2 * np.abs(sigma).max() * np.eye(len(mu)))
    elif case == "asymmetric":
        bad = sigma.copy()
        bad[0, 1] += np.abs(sigma).max()
        np.savez(path, mu=mu, sigma=bad)
    else:
        np.savez(path, mu=mu, sigma=np.eye(3))
    with pytest.raises(UserError, match=expect):
        fid.score(fake, path, ext)
    # Through the command: one line and status 2, before any scoring child is started.
    p = run_cli("fid", "--images", fake, "--ref", path, "--extractor", ext, "--out", root / "r.json", check=False)
    assert p.returncode == 2 and expect in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::scipy.linalg.LinAlgWarning")
@pytest.mark.parametrize("n_ref, n_fake", [(300, 40), (50, 1200)])  # fewer samples than the subset cap, and more
def test_fd_and_kid_equal_clean_fids_functions_and_keep_the_callers_random_state(n_ref, n_fake):
    from cleanfid.fid import frechet_distance, kernel_distance

    rng = np.random.default_rng(n_fake)
    ref_feats = rng.normal(size=(n_ref, 24)).astype(np.float32)
    feats = (rng.normal(size=(n_fake, 24)) * 1.1 + 0.2).astype(np.float32)
    ref = {"mu": ref_feats.mean(0), "sigma": np.cov(ref_feats, rowvar=False), "features": ref_feats}
    np.random.seed(7)
    before = np.random.get_state()[1].copy()
    ours = metrics.kernel_distance(feats, ref)
    assert np.array_equal(np.random.get_state()[1], before)
    np.random.seed(0)
    assert ours == kernel_distance(ref_feats, feats)  # the same draws, the same arithmetic: equal, not close
    mu, sigma = fid.statistics(feats)
    assert metrics.frechet(mu, sigma, ref) == pytest.approx(frechet_distance(mu, sigma, ref["mu"], ref["sigma"]),
                                                             rel=1e-12)
