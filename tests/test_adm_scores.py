"""ADM's five numbers from one Inception pass (evaluation/inception.py, scores.py): the heads against clean-fid
and against a restatement, fid.metrics, ADM reference batches as fid.reference, scores.md, and the workflow."""

import hashlib
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, small_inception
from PIL import Image
from scipy import linalg

from diffrelay.errors import UserError
from diffrelay.evaluation import adm, extractor, features, fid
from diffrelay.evaluation import inception as heads_module

MODES = ("clean", "legacy_tensorflow")


SQRTM: dict = {}  # (shape, dtype, sha256 of the bytes) -> scipy's sqrtm of that matrix


def sqrtm_once(a: np.ndarray) -> np.ndarray:
    """scipy's sqrtm, computed once per distinct matrix (by its bytes) in this module and handed out as a copy.
    A 2048-d one costs 15-25 s on one core, and the tests here score the same samples against the same batch
    again (the feature cache, the device, the record without metrics, the restatement): sqrtm is deterministic,
    and a changed feature, mean or covariance is another matrix, which is computed."""
    a = np.asarray(a)
    key = (a.shape, a.dtype.str, hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
    if key not in SQRTM:
        SQRTM[key] = linalg.sqrtm(a)
    return SQRTM[key].copy()


@pytest.fixture(scope="module", autouse=True)
def scorer_sqrtm_once():
    """The scorer's sqrtm (evaluation/frechet.py) through sqrtm_once while this module runs."""
    from diffrelay.evaluation import frechet

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frechet, "linalg", types.SimpleNamespace(sqrtm=sqrtm_once))
        yield


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Path:
    return small_inception(tmp_path_factory.mktemp("inception") / "inception-2015-12-05.pt")


def pictures(n: int, side: int = 32, seed: int = 0) -> np.ndarray:
    """Images that differ (colour, brightness, a bright square), so the small net's features spread."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 64, (n, side, side, 3)).astype(np.int64) + rng.integers(0, 192, (n, 1, 1, 3))
    for i in range(n):
        a, b = rng.integers(0, side - side // 3, 2)
        x[i, a:a + side // 3, b:b + side // 3] = rng.integers(0, 256, 3)
    return x.clip(0, 255).astype(np.uint8)


def save_folder(images: np.ndarray, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, a in enumerate(images):
        Image.fromarray(a).save(folder / f"{i:06d}.png")
    return folder


# ---- restatements of evaluator.py's arithmetic, in float64 where it does not matter ----------------

def restated_fd(a: np.ndarray, mu2, sigma2) -> float:
    mu1, sigma1 = a.mean(0), np.cov(a, rowvar=False)
    root = sqrtm_once(sigma1 @ sigma2)
    if not np.isfinite(root).all():
        off = np.eye(len(mu1)) * 1e-6
        root = sqrtm_once((sigma1 + off) @ (sigma2 + off))
    return float(((mu1 - mu2) ** 2).sum() + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(root.real))


def restated_is(p: np.ndarray, split: int = 5000) -> float:
    parts = [p[i:i + split] for i in range(0, len(p), split)]
    return float(np.mean([np.exp(np.mean(np.sum(q * (np.log(q) - np.log(q.mean(0, keepdims=True))), 1)))
                          for q in parts]))


def restated_pr(real: np.ndarray, fake: np.ndarray, k: int = 3) -> tuple[float, float]:
    def d(u, v):
        return np.sqrt(np.maximum((u * u).sum(1)[:, None] + (v * v).sum(1)[None] - 2 * u @ v.T, 0))

    rr, ff = (np.sort(d(x, x), 1)[:, k] for x in (real, fake))
    cross = d(real, fake)
    return float((cross <= rr[:, None]).any(0).mean()), float((cross <= ff[None, :]).any(1).mean())


def own_heads(net_path: Path, images: np.ndarray, mode: str) -> dict:
    """pool, spatial (NHWC order, 7 channels) and softmax(pool @ W) by walking the file's modules here."""
    base = torch.jit.load(str(net_path)).eval()
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float()
    if mode == "clean":
        x = torch.stack([features.CleanView("clean")(a) for a in images])
        x = (x - 128) / 128
    else:
        x = heads_module.tf_resize(x)
    layers = dict(base.layers.named_children())
    with torch.no_grad():
        for name, layer in layers.items():
            if name == "mixed_6":
                spatial = layer.conv(x).permute(0, 2, 3, 1)[..., :7].reshape(len(x), -1)
            x = layer(x)
        pool = x.flatten(1)
        logits = pool.double() @ base.output.weight.double().T
    return {"pool": pool.numpy(), "spatial": spatial.numpy(), "probs": torch.softmax(logits, 1).numpy()}


# ---- the heads -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_pool_features_equal_clean_fids_and_the_other_heads_their_restatement(net, mode):
    images = pictures(12)
    plain = extractor.load(net, mode)  # today's path: clean-fid's InceptionV3W
    full = extractor.load(net, mode, heads=True)
    view = [features.view_of(plain, mode)]
    [want] = features.features(features.array_images(images, np.arange(12), view), [plain], mode, 5, "cpu")
    [got] = features.features(features.array_images(images, np.arange(12), view), [full], mode, 5, "cpu")
    assert np.array_equal(got["pool"], want)  # bit for bit: FID does not move
    own = own_heads(net, images, mode)
    assert got["spatial"].shape == (12, 2023)
    assert np.abs(got["spatial"] - own["spatial"]).max() <= 1e-6 * np.abs(own["spatial"]).max()
    assert np.abs(got["probs"] - own["probs"]).max() < 1e-6  # float32 softmax against float64
    assert got["probs"].std(0).max() > 1e-3  # the test means something: the classes differ between images


def test_tf_resize_samples_pixel_j_times_in_over_out():
    x = torch.arange(2 * 3 * 5 * 7, dtype=torch.float32).reshape(2, 3, 5, 7) * 3
    y = heads_module.tf_resize(x, size=11) * 128 + 128
    for j, src in ((0, 0.0), (4, 4 * 7 / 11), (10, 10 * 7 / 11)):
        lo = int(np.floor(src))
        hi, t = min(lo + 1, 6), src - lo
        want = x[..., 0, lo] * (1 - t) + x[..., 0, hi] * t
        assert torch.allclose(y[..., 0, j], want, atol=1e-3)


def test_a_file_without_the_spatial_branch_gives_no_sfid_in_one_line(tmp_path):
    from test_extractor import FakeInception, save_script

    path = save_script(FakeInception(), tmp_path / "fake.pt")
    with pytest.raises(UserError, match=r"fake.pt: not clean-fid's Inception file .* drop sfid and is"):
        extractor.load(path, "clean", heads=True)


# ---- scoring against an ADM reference batch ------------------------------------------------------

def adm_batch(net, path: Path, images: np.ndarray, mode: str, keys=("arr_0", "mu", "sigma", "mu_s", "sigma_s"),
              **arrays) -> Path:
    own = own_heads(net, images, mode)
    every = {"arr_0": images, "mu": own["pool"].mean(0), "sigma": np.cov(own["pool"], rowvar=False),
             "mu_s": own["spatial"].mean(0), "sigma_s": np.cov(own["spatial"], rowvar=False)}
    np.savez(path, **{k: every[k] for k in keys}, **arrays)
    return path


ALL = ["fid", "sfid", "is", "precision", "recall", "kid"]
# Every metric but sFID: it reads the batch's mu_s/sigma_s, not arr_0's cached features, and its 2023-d matrix
# square root costs about 15 s on one core (FID's is needed: fid.metrics must hold fid).
FROM_IMAGES = ["fid", "is", "precision", "recall", "kid"]


@pytest.fixture(scope="module")
def scored(net, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scored")
    samples, ref_images = pictures(40, seed=1), pictures(30, seed=2)
    folder = save_folder(samples, tmp / "samples")
    ref = adm_batch(net, tmp / "ref.npz", ref_images, "legacy_tensorflow")
    result = fid.score_all(folder, [(net, ref)], "legacy_tensorflow", 16, device="cpu", metrics=ALL,
                           cache_dir=tmp / "cache")
    return tmp, samples, ref_images, ref, result


def test_the_five_numbers_against_an_adm_batch_agree_with_the_restated_evaluator(net, scored):
    tmp, samples, ref_images, ref, result = scored
    r = result["scores"][0]
    mine, theirs = own_heads(net, samples, "legacy_tensorflow"), own_heads(net, ref_images, "legacy_tensorflow")
    with np.load(ref) as z:
        assert r["fid"] == pytest.approx(restated_fd(mine["pool"].astype(np.float64), z["mu"], z["sigma"]),
                                         rel=1e-6, abs=1e-6)
        assert r["sfid"] == pytest.approx(restated_fd(mine["spatial"].astype(np.float64), z["mu_s"], z["sigma_s"]),
                                          rel=1e-6, abs=1e-6)
    assert r["is"] == pytest.approx(restated_is(mine["probs"]), rel=1e-6)
    # ADM's float16 distances (restated in test_adm.py) against the reference images' features ...
    assert (r["precision"], r["recall"]) == adm.precision_recall(theirs["pool"], mine["pool"])
    # ... which float64 distances move by a little on these nearly alike features.
    assert (r["precision"], r["recall"]) == pytest.approx(restated_pr(theirs["pool"].astype(np.float64),
                                                                      mine["pool"].astype(np.float64)), abs=0.05)
    assert 0 < r["precision"] < 1 or 0 < r["recall"] < 1 or r["fid"] > 1e-3  # not a degenerate case
    assert r["labels"] == {"fid": "FID-40", "sfid": "sFID-40", "is": "IS-40", "precision": "Precision-40",
                           "recall": "Recall-40", "kid": "KID-40"}
    assert r["protocol"] == "adm" and r["num_ref"] == 30 and r["reference"] == "ref.npz"
    assert result["metrics"] == sorted(ALL) and result["fid"] == r["fid"]


def test_the_reference_images_features_are_cached_and_a_damaged_cache_is_remade(net, scored, monkeypatch):
    tmp, _, _, ref, result = scored
    [cached] = list((tmp / "cache").iterdir())
    good = cached.read_bytes()
    passes = []
    real = features.features
    monkeypatch.setattr(features, "features", lambda items, *a, **k: passes.append(len(items)) or real(items, *a, **k))
    again = fid.score_all(tmp / "samples", [(net, ref)], "legacy_tensorflow", 16, device="cpu",
                          metrics=FROM_IMAGES, cache_dir=tmp / "cache")
    assert passes == [40]  # the samples only: arr_0's 30 images came from the cache
    assert {k: again["scores"][0][k] for k in FROM_IMAGES} == {k: result["scores"][0][k] for k in FROM_IMAGES}
    cached.write_bytes(good[:-100])
    third = fid.score_all(tmp / "samples", [(net, ref)], "legacy_tensorflow", 16, device="cpu",
                          metrics=["fid", "precision"], cache_dir=tmp / "cache")
    assert passes == [40, 30, 40] and cached.read_bytes() == good
    assert third["scores"][0]["precision"] == result["scores"][0]["precision"]


def test_adm_precision_and_recall_run_on_the_scoring_device(net, scored, monkeypatch):
    """The distance blocks go to the device the job scores on (a GPU in a real job), not to host NumPy."""
    tmp, _, _, ref, result = scored
    devices, real = [], adm.precision_recall
    monkeypatch.setattr(adm, "precision_recall", lambda *a, **k: devices.append(k.get("device")) or real(*a, **k))
    again = fid.score_all(tmp / "samples", [(net, ref)], "legacy_tensorflow", 16, device="cpu",
                          metrics=["fid", "precision", "recall"], cache_dir=tmp / "cache")
    assert devices == [torch.device("cpu")]
    assert [again["scores"][0][k] for k in ("precision", "recall")] == [result["scores"][0][k]
                                                                      for k in ("precision", "recall")]


def test_without_metrics_the_result_is_what_it_was(net, scored):
    """fid.metrics unset: today's record (clean-fid's FID from mu/sigma, no sFID/IS), the ADM file read as
    mu/sigma statistics."""
    tmp, _, _, ref, result = scored
    old = fid.score_all(tmp / "samples", [(net, ref)], "legacy_tensorflow", 16, device="cpu")
    assert "sfid" not in old and "labels" not in old and old["metric"] == "FID-40"
    assert old["fid"] == pytest.approx(result["fid"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("case, keys, metrics, match", [
    ("no_spatial", ("arr_0", "mu", "sigma"), ["fid", "sfid"], r"ref.npz: an ADM reference batch without mu_s/sigma_s; "
     r"sfid needs them"),
    ("no_images", ("mu", "sigma", "mu_s", "sigma_s"), ["fid", "precision"], r"without arr_0; precision need its images"),
    ("resolution", None, ["fid"], r"arr_0 holds 16x16 images and the samples \(000000.png\) are 32x32"),
    ("dtype", None, ["fid"], r"arr_0 is float32 of shape \(30, 32, 32, 3\); an ADM reference batch holds uint8"),
    ("own_metric", ("arr_0", "mu", "sigma", "mu_s", "sigma_s"), ["is"], r"no fid for the extractor"),
])
def test_bad_reference_batches_and_metric_sets_are_one_line_before_the_pass(net, scored, tmp_path, case, keys,
                                                                           metrics, match):
    folder = scored[0] / "samples"
    images = pictures(30, seed=2)
    if case == "resolution":
        ref = adm_batch(net, tmp_path / "ref.npz", pictures(30, side=16), "legacy_tensorflow")
    elif case == "dtype":
        ref = tmp_path / "ref.npz"
        np.savez(ref, arr_0=images.astype(np.float32))
    else:
        ref = adm_batch(net, tmp_path / "ref.npz", images, "legacy_tensorflow", keys)
    with pytest.raises(UserError, match=match):
        fid.score_all(folder, [(net, ref)], "legacy_tensorflow", 16, device="cpu", metrics=metrics)


def test_an_adm_batch_for_another_extractor_is_refused_before_the_pass(scored, tmp_path):
    tmp, _, _, ref, _ = scored
    run_cli("fetch-extractor", "--extractor", "random", "--out", tmp_path / "random.pt")
    with pytest.raises(UserError, match=r"ref.npz: an ADM reference batch holds Inception statistics, but its "
                       r"extractor random.pt is not"):
        fid.score_all(tmp / "samples", [(tmp_path / "random.pt", ref)], "legacy_tensorflow", 16, device="cpu",
                      metrics=["fid"])


def test_the_workflow_checks_an_adm_batch_against_the_metrics_when_it_reads_the_config(net, tmp_path,
                                                                                      write_config):
    stats_only = adm_batch(net, tmp_path / "stats.npz", pictures(30, seed=2), "legacy_tensorflow", ("mu", "sigma"))
    wrong_side = adm_batch(net, tmp_path / "side.npz", pictures(30, side=32, seed=2), "legacy_tensorflow")
    for i, (ref, metrics, want) in enumerate([(stats_only, ["fid", "precision"], "holds mu and sigma only, so no "
                                               "precision"),
                                              (wrong_side, ["fid"], "arr_0 holds 32x32 images and data.resolution=16 "
                                               "images are 16x16")]):
        cfg = write_config({"fid": {"extractor": "inception", "reference": str(ref), "metrics": metrics}},
                           name=f"c{i}.yaml")
        p = run_cli("validate", "--config", cfg, check=False)
        assert p.returncode != 0 and want in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_the_cli_refuses_an_unknown_metric_and_a_statistics_only_reference_for_precision(net, scored, tmp_path):
    tmp, _, ref_images, _, _ = scored
    p = run_cli("fid", "--images", tmp / "samples", "--extractor", net, "--ref", tmp / "ref.npz", "--metrics",
                "fid,fdd", "--out", tmp_path / "r.json", check=False)
    assert p.returncode == 2 and "'fdd': not a metric; use some of fid, sfid, is" in p.stderr
    stats = adm_batch(net, tmp_path / "stats.npz", ref_images, "legacy_tensorflow", ("mu", "sigma"))
    dataset_like = tmp_path / "plain.npz"
    shutil.copy(stats, dataset_like)
    p = run_cli("fid", "--images", tmp / "samples", "--extractor", net, "--ref", dataset_like, "--metrics",
                "fid,recall", "--mode", "legacy_tensorflow", "--out", tmp_path / "r.json", check=False)
    assert p.returncode == 2 and "plain.npz: holds mu and sigma only, so no recall" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "r.json").exists()


def test_scores_table_prints_the_papers_columns_with_counts_and_the_reference(tmp_path):
    import pandas as pd

    from diffrelay.evaluation import tables

    nan = float("nan")
    rows = [dict(step=400, phema=nan, ema_decay=nan, guidance=1.5, metric="FID-50k", num_images=50000, seed_sets=1,
                 fid=2.2712, sfid=4.604, **{"is": 278.239}, precision=0.8312, recall=0.574, primary=True,
                 reference="VIRTUAL_imagenet256_labeled.npz", protocol="adm", mode="legacy_tensorflow"),
            dict(step=400, phema=nan, ema_decay=nan, guidance=1.5, metric="FD_DINOv2-50k", num_images=50000,
                 seed_sets=1, fid=52.081, sfid=nan, **{"is": nan}, precision=nan, recall=nan, primary=False,
                 reference="reference_dinov2-vitl14.npz", protocol="clean-fid", mode="legacy_tensorflow")]
    text = tables.scores_table(pd.DataFrame(rows), "dit")
    assert ("| Snapshot | Guidance | FID-50k ↓ | sFID-50k ↓ | IS-50k ↑ | Precision-50k ↑ | Recall-50k ↑ | "
            "FD_DINOv2-50k ↓ |") in text
    assert "| step 400 | 1.5 | 2.27 | 4.60 | 278.24 | 0.831 | 0.574 | 52.08 |" in text  # >= 3 significant digits
    assert "FID-50k against VIRTUAL_imagenet256_labeled.npz (ADM evaluator, legacy_tensorflow mode)" in text


def test_config_names_what_a_metric_set_lacks_in_one_line(tmp_path, write_config):
    cases = [({"metrics": ["fid", "fd_dinov2"]}, "fd_dinov2 needs a DINOv2 extractor"),
             ({"metrics": ["sfid", "fid"]}, "sfid and is come from clean-fid's Inception"),
             ({"extractor": "inception", "metrics": ["fid", "sfid"]}, "sfid needs ADM's spatial statistics"),
             ({"extractors": ["inception", "dinov2"], "metrics": ["fid"]}, "has no fd_dinov2 for the extractor dinov2"),
             ({"metrics": ["fid", "mmd"]}, "fid.metrics")]
    for i, (over, want) in enumerate(cases):
        p = run_cli("validate", "--config", write_config({"fid": over}, name=f"c{i}.yaml"), check=False)
        assert p.returncode != 0 and want in p.stderr, (over, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


# The workflow's run of the five numbers against an ADM batch (the tests' small Inception, an ADM-format reference the
# test builds, all five metrics, the npz export, scores.md, arr_0's cached features) is asserted on the shrunk DiT and
# SiT recipes' runs: test_recipes.py::test_each_recipe_runs_through_the_workflow_shrunk.


def test_the_cache_key_follows_the_arrays_and_an_unwritable_cache_keeps_the_scores(net, scored, tmp_path, caplog):
    tmp, _, ref_images, ref, result = scored
    copy = tmp_path / "copy.npz"
    copy.write_bytes(ref.read_bytes())
    assert adm.fingerprint(copy) == adm.fingerprint(ref)  # a copy elsewhere reuses the cached features
    with np.load(ref) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["arr_0"] = arrays["arr_0"].copy()
    arrays["arr_0"][3, 5, 7, 1] ^= 1  # one bit of one pixel: same sizes, another CRC-32
    np.savez(copy, **arrays)
    assert copy.stat().st_size == ref.stat().st_size and adm.fingerprint(copy) != adm.fingerprint(ref)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    caplog.set_level("WARNING")
    again = fid.score_all(tmp / "samples", [(net, ref)], "legacy_tensorflow", 16, device="cpu",
                          metrics=FROM_IMAGES, cache_dir=blocker / "cache")
    assert {k: again["scores"][0][k] for k in FROM_IMAGES} == {k: result["scores"][0][k] for k in FROM_IMAGES}
    assert "arr_0's features not cached" in caplog.text and blocker.read_text().startswith("a file")


def test_an_arr_0_header_larger_than_its_data_is_one_line(tmp_path):
    images = pictures(4, side=8)
    path = tmp_path / "ref.npz"
    np.savez(path, arr_0=images)
    raw = path.read_bytes()
    assert raw.count(b"(4, 8, 8, 3)") == 1
    path.write_bytes(raw.replace(b"(4, 8, 8, 3)", b"(9, 8, 8, 3)"))
    with pytest.raises(UserError, match=r"ref\.npz: arr_0's header declares \(9, 8, 8, 3\) \(1728 bytes\) but the "
                                        r"archive holds 768 bytes"):
        adm.images(path)
    np.savez(path, arr_0=images)
    assert np.array_equal(adm.images(path), images)


def test_scores_table_puts_the_training_ema_before_post_hoc_rows_and_prints_kid_per_mille():
    import pandas as pd

    from diffrelay.evaluation import tables

    nan = float("nan")
    common = dict(step=200, ema_decay=nan, guidance=1.0, metric="FID-2k", num_images=2000, seed_sets=1, sfid=nan,
                  **{"is": nan}, precision=nan, recall=nan, primary=True, reference="ref.npz", protocol="clean-fid",
                  mode="clean")
    rows = [dict(common, phema=0.10, fid=9.0, kid=0.0031), dict(common, phema=0.05, fid=8.5, kid=0.0029),
            dict(common, phema=nan, fid=10.25, kid=0.004567), dict(common, step=100, phema=0.05, fid=20.0, kid=None)]
    lines = tables.scores_table(pd.DataFrame(rows), "edm2").splitlines()
    assert "| Snapshot | Guidance | FID-2k ↓ | KID-2k ×10³ ↓ |" in lines
    body = [line for line in lines if line.startswith("| step")]
    assert body == ["| step 100, post-hoc EMA 0.05 | 1 | 20.00 | – |", "| step 200 | 1 | 10.25 | 4.57 |",
                    "| step 200, post-hoc EMA 0.05 | 1 | 8.50 | 2.90 |", "| step 200, post-hoc EMA 0.1 | 1 | 9.00 | 3.10 |"]
