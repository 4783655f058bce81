"""Reference files made elsewhere (ADM batches, mu/sigma files) are judged before any pass: one check of a
covariance for both, an ADM batch only for Inception, and every member's header read (no array loaded) against
the bytes the archive holds, the memory there is and the images the metrics need.

Tiny arrays (8 features, 16 px images) and a random extractor; no feature pass runs.
"""

import io
import re
import resource
import zipfile

import numpy as np
import pytest
from PIL import Image

from diffrelay import config
from diffrelay.config import preflight
from diffrelay.errors import UserError
from diffrelay.evaluation import adm, extractor, fid, metrics, npz, scores


def stats(dim=8, seed=0):
    x = np.random.default_rng(seed).normal(size=(40, dim))
    return x.mean(0), np.cov(x, rowvar=False)


def pictures(n, side=16):
    return np.random.default_rng(1).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


def sample_folder(tmp_path, n=4):
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, im in enumerate(pictures(n)):
        Image.fromarray(im).save(folder / f"{i:06d}.png")
    return folder


def validate(write_config, ref, **fid_cfg):
    cfg = config.load(write_config({"fid": {"reference": str(ref)} | fid_cfg}))
    preflight.check_inputs(cfg, "config.yaml")


def npz_with(path, members: dict, compress=zipfile.ZIP_STORED):
    """An .npz whose members are raw .npy bytes: headers that can declare what np.savez would never write."""
    with zipfile.ZipFile(path, "w", compress) as z:
        for name, data in members.items():
            z.writestr(f"{name}.npy", data)
    return path


def npy(array=None, shape=None, dtype="<f8", data=b""):
    f = io.BytesIO()
    if array is not None:
        np.save(f, array)
    else:
        np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": shape})
        f.write(data)
    return f.getvalue()


# ---------------------------------------------------------------------------------------------
# Item 6: one covariance check for a plain statistics file and an ADM batch


@pytest.mark.parametrize("keys", [("mu", "sigma"), ("mu_s", "sigma_s")])
def test_an_asymmetric_sigma_is_refused_in_an_adm_batch_as_in_a_statistics_file(tmp_path, keys):
    mu, sigma = stats()
    sigma[0, 1] += 0.5
    other = {"mu": stats()[0], "sigma": stats()[1]} if keys[0] == "mu_s" else {}
    np.savez(tmp_path / "adm.npz", arr_0=pictures(4), **{keys[0]: mu, keys[1]: sigma}, **other)
    with pytest.raises(UserError, match=rf"adm.npz: {keys[1]} is not symmetric, so it is no covariance matrix"):
        adm.read_reference(tmp_path / "adm.npz")
    if keys[0] == "mu":
        np.savez(tmp_path / "plain.npz", mu=mu, sigma=sigma)
        with pytest.raises(UserError, match=r"plain.npz: sigma is not symmetric, so it is no covariance matrix"):
            metrics.load_foreign_ref(tmp_path / "plain.npz")
    sigma = -np.eye(8)  # symmetric, not positive semi-definite: the same check says so
    np.savez(tmp_path / "adm.npz", arr_0=pictures(4), **{keys[0]: mu, keys[1]: sigma}, **other)
    with pytest.raises(UserError, match=rf"{keys[1]} is not positive semi-definite"):
        adm.read_reference(tmp_path / "adm.npz")


# ---------------------------------------------------------------------------------------------
# Item 7: an ADM batch is Inception's, whatever fid.metrics says


def test_an_adm_batch_for_another_extractor_is_refused_without_metrics(tmp_path, write_config):
    rnd = extractor.build_random(tmp_path / "random.pt")
    mu, sigma = stats(extractor.RANDOM_DIM)  # the random extractor's feature count: it used to be scored
    np.savez(tmp_path / "adm.npz", arr_0=pictures(4), mu=mu, sigma=sigma)
    with pytest.raises(UserError, match=r"adm.npz: an ADM reference batch holds Inception statistics, but its "
                       r"extractor random.pt is not clean-fid's Inception"):
        fid.score_all(sample_folder(tmp_path), [(rnd, tmp_path / "adm.npz")], "clean", 4, device="cpu")
    with pytest.raises(UserError, match=r"^config.yaml: fid.reference: .*adm.npz: an ADM reference batch holds "
                       r"Inception statistics, and the extractor is random; give it only for inception"):
        validate(write_config, tmp_path / "adm.npz")


# ---------------------------------------------------------------------------------------------
# Item 9: headers, sizes, memory and image counts, before any array is loaded or any pass runs


def test_a_bare_npy_named_npz_is_one_line_everywhere(tmp_path, write_config):
    path = tmp_path / "ref.npz"
    path.write_bytes(npy(stats()[1]))
    for read in (metrics.load_foreign_ref, adm.read_reference, fid.load_reference):
        with pytest.raises(UserError, match=r"ref.npz: not a readable .npz \(BadZipFile: a bare .npy array \(np.save\)"):
            read(path)
    with pytest.raises(UserError, match=r"^config.yaml: fid.reference: .*ref.npz: not a readable .npz \(BadZipFile: a bare .npy"):
        validate(write_config, path)


@pytest.mark.parametrize("key", ["sigma", "arr_0"])
def test_a_compressed_member_declaring_a_huge_shape_is_one_line_before_it_is_loaded(tmp_path, write_config, key):
    mu, sigma = stats()
    members = {"mu": npy(mu), "sigma": npy(sigma), "arr_0": npy(pictures(4))}
    members[key] = npy(shape=(200000, 200000) if key == "sigma" else (10**6, 512, 512, 3),
                       dtype="<f8" if key == "sigma" else "|u1", data=bytes(64))
    path = npz_with(tmp_path / "ref.npz", members, zipfile.ZIP_DEFLATED)
    want = r"ref.npz: %s's header declares \(200000, 200000\) float64 \(298.0 GiB\) but the archive holds 64 bytes" \
        if key == "sigma" else r"ref.npz: arr_0's header declares \(1000000, 512, 512, 3\) uint8 \(732.4 GiB\)"
    with pytest.raises(UserError, match=want % key if key == "sigma" else want):
        adm.read_reference(path)
    if key == "sigma":
        with pytest.raises(UserError, match=want % key):
            metrics.load_foreign_ref(path)
    with pytest.raises(UserError, match=r"^config.yaml: fid.reference: .*" + (want % key if key == "sigma" else want)):
        validate(write_config, path, extractor="inception", metrics=["fid", "precision"])


def test_a_compressed_arr_0_larger_than_the_memory_left_is_one_line_before_the_pass(tmp_path, monkeypatch):
    np.savez_compressed(tmp_path / "ref.npz", arr_0=pictures(8))
    files = sorted(sample_folder(tmp_path).iterdir())
    monkeypatch.setattr(npz, "available_memory", lambda: 1000)  # 8 x 16 x 16 x 3 = 6144 bytes will not fit
    with pytest.raises(UserError, match=r"ref.npz: arr_0 \(compressed\) needs 6144 bytes of memory to load and this "
                       r"process has 1000 bytes available; store it uncompressed"):
        scores.adm_reference(tmp_path / "ref.npz", files, {"fid"})
    np.savez(tmp_path / "stored.npz", arr_0=pictures(8))  # uncompressed: memory-mapped, so it needs no memory
    assert scores.adm_reference(tmp_path / "stored.npz", files, {"fid"})["need_pool"]


def test_the_memory_left_follows_the_address_space_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), hard))  # ulimit -v: 256 MiB above what is in use
    try:
        left = npz.available_memory()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert 200 << 20 < left <= 256 << 20


@pytest.mark.parametrize("n, wanted, want", [
    (0, {"fid"}, "arr_0 holds 0 images; fid from its images (no mu/sigma) need at least 2"),
    (1, {"fid"}, "arr_0 holds 1 image; fid from its images (no mu/sigma) need at least 2"),
    (3, {"fid", "precision", "recall"}, "arr_0 holds 3 images; precision, recall need at least 4"),
    (1, {"fid", "kid"}, "arr_0 holds 1 image; kid, fid from its images (no mu/sigma) need at least 2")])
def test_an_arr_0_too_small_for_the_metrics_is_one_line_before_any_pass(tmp_path, write_config, n, wanted, want):
    np.savez(tmp_path / "ref.npz", arr_0=pictures(n))
    files = sorted(sample_folder(tmp_path).iterdir())
    with pytest.raises(UserError, match=rf"ref.npz: {re.escape(want)}; use a reference batch with more images"):
        scores.adm_reference(tmp_path / "ref.npz", files, wanted)
    with pytest.raises(UserError, match=rf"^config.yaml: fid.reference: .*{re.escape(want)}"):
        validate(write_config, tmp_path / "ref.npz", extractor="inception", metrics=sorted(wanted))
    mu, sigma = stats(2048)  # with the file's own statistics, fid needs no images
    np.savez(tmp_path / "ref.npz", arr_0=pictures(n), mu=mu, sigma=sigma)
    if wanted == {"fid"}:
        scores.adm_reference(tmp_path / "ref.npz", files, wanted)
