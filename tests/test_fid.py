"""FID/KID: reference statistics, their cache and integrity, scores, and the clean subprocess around them."""

import json
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import run_cli
from PIL import Image
from torch import nn
from torch.nn import functional as F

from diffrelay import cli, io
from diffrelay.evaluation import extractor, features, fid
from diffrelay.runtime import distributed
from diffrelay.errors import UserError

N = 128  # images per folder: enough for ordering, small enough for seconds


def shapes(n, seed, size=16):
    """Discs and squares of random colours on dark backgrounds."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    out = []
    for _ in range(n):
        img = np.empty((size, size, 3), np.uint8)
        img[:] = rng.integers(0, 80, 3)
        cx, cy = rng.integers(3, size - 3, 2)
        r = rng.integers(2, 6)
        disc = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
        square = (abs(xx - cx) <= r) & (abs(yy - cy) <= r)
        img[disc if rng.random() < 0.5 else square] = rng.integers(120, 256, 3)
        out.append(img)
    return out


def write_pngs(folder, imgs):
    folder.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(imgs):
        Image.fromarray(img).save(folder / f"{i:06d}.png")
    return folder


def write_dataset(folder, imgs, fingerprint):
    """A prepared dataset folder (arrays + dataset.json, as `diffrelay prepare` writes it) of these images."""
    folder.mkdir(parents=True)
    np.save(folder / "images.npy", np.stack(imgs))
    np.save(folder / "labels.npy", np.zeros(len(imgs), np.int64))
    io.write_json(folder / "dataset.json", {"format": "diffrelay-dataset/1", "count": len(imgs),
                                            "resolution": imgs[0].shape[0], "num_classes": 0, "class_names": [],
                                            "fingerprint": fingerprint})
    return folder


class TinyFeatures(nn.Module):
    """A user's extractor: colour means on a 4x4 grid (48 features)."""

    def forward(self, x):
        return F.adaptive_avg_pool2d(x / 255, 4).flatten(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fid")
    imgs = shapes(2 * N, seed=0)
    rng = np.random.default_rng(1)
    d = {"root": root,
         "dataset": write_dataset(root / "dataset", imgs[:N], "f" * 64),
         "dataset_png": write_pngs(root / "dataset_png", imgs[:N]),  # the same images as PNG files
         "half": write_pngs(root / "half", imgs[N:]),
         "noise": write_pngs(root / "noise", [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(N)]),
         "ext": extractor.build_random(root / "random-seed0.pt", seed=0)}
    d["ref"] = fid.make_ref(d["dataset"], d["ext"], out=root / "reference.npz")
    return d


def test_folder_scored_against_its_own_statistics_is_zero(data):
    r = fid.score(data["dataset_png"], data["ref"], data["ext"])
    assert abs(r["fid"]) < 1e-3
    assert r["metric"] == "FD-128 (random features)"
    assert r["num_images"] == r["num_ref"] == N


def test_disjoint_halves_score_far_below_noise(data):
    half = fid.score(data["half"], data["ref"], data["ext"])
    noise = fid.score(data["noise"], data["ref"], data["ext"])
    assert half["fid"] * 20 < noise["fid"]
    assert half["kid"] * 20 < noise["kid"]


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning", "ignore::DeprecationWarning")
def test_scores_equal_clean_fid_on_the_same_folders(data, tmp_path, workers):
    from cleanfid.fid import compute_fid

    # legacy_tensorflow mode feeds native-size images, which keeps this comparison fast.
    ref = fid.make_ref(data["dataset"], data["ext"], mode="legacy_tensorflow", out=tmp_path / "ref.npz",
                       workers=workers)
    ours = fid.score(data["half"], ref, data["ext"], mode="legacy_tensorflow", workers=workers)["fid"]
    model = extractor.load(data["ext"], mode="legacy_tensorflow").fn
    theirs = compute_fid(str(data["half"]), str(data["dataset_png"]), mode="legacy_tensorflow",
                         custom_feat_extractor=model, device=torch.device("cpu"), num_workers=0, batch_size=64,
                         use_dataparallel=False, verbose=False)
    assert ours == pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("mode", ["clean", "legacy_tensorflow"])
def test_reference_from_arrays_equals_clean_fid_on_png_files(data, tmp_path, mode):
    from cleanfid.fid import get_folder_features

    # Two resize threads and a batch that does not divide N: the batches must still be clean-fid's.
    ref = fid.load_ref(fid.make_ref(data["dataset"], data["ext"], mode=mode, batch_size=48, workers=2,
                                    out=tmp_path / "ref.npz"))
    model = extractor.load(data["ext"], mode=mode).fn
    feats = get_folder_features(str(data["dataset_png"]), model, num_workers=0, batch_size=48,
                                device=torch.device("cpu"), mode=mode, verbose=False)
    assert ref["settings"]["num_images"] == len(feats) == N
    np.testing.assert_allclose(ref["mu"], np.mean(feats, axis=0), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ref["sigma"], np.cov(feats, rowvar=False), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ref["features"], feats)


def test_threaded_features_equal_one_thread_in_order(data):
    ext = extractor.load(data["ext"], mode="clean")
    files = features.image_files(data["half"])[:40]
    one = features.of_files(files, [ext], "clean", 16, torch.device("cpu"), workers=1)[0]
    three = features.of_files(files, [ext], "clean", 16, torch.device("cpu"), workers=3)[0]
    assert one.shape == (40, extractor.RANDOM_DIM)
    np.testing.assert_array_equal(one, three)
    assert not np.array_equal(one[:20], one[20:])  # different images, different rows


def test_grid_and_other_files_in_a_sample_folder_are_not_scored(tmp_path):
    write_pngs(tmp_path, shapes(3, seed=2))
    Image.fromarray(shapes(1, seed=3, size=64)[0]).save(tmp_path / "grid.png")
    (tmp_path / "manifest.json").write_text("{}")
    assert [p.name for p in features.image_files(tmp_path)] == ["000000.png", "000001.png", "000002.png"]


def test_changed_byte_in_statistics_is_refused(data, tmp_path):
    bad = tmp_path / "reference.npz"
    raw = bytearray(data["ref"].read_bytes())
    raw[len(raw) // 2] ^= 0x01
    bad.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=str(bad)) as e:
        fid.load_ref(bad)
    assert "\n" not in str(e.value)


def test_truncated_statistics_are_refused(data, tmp_path):
    bad = tmp_path / "reference.npz"
    bad.write_bytes(data["ref"].read_bytes()[:-1000])
    with pytest.raises(UserError, match=f"{bad}: unreadable"):
        fid.load_ref(bad)


def test_rewritten_statistics_with_a_stale_digest_are_refused(data, tmp_path):
    # A valid .npz whose arrays were changed without recomputing the digest (e.g. edited by a script).
    with np.load(data["ref"]) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["mu"] = arrays["mu"] + 1
    bad = tmp_path / "reference.npz"
    np.savez(bad, **arrays)
    with pytest.raises(UserError, match=f"{bad}: digest mismatch"):
        fid.load_ref(bad)


def test_statistics_of_another_extractor_or_mode_are_refused(data, tmp_path):
    other = extractor.build_random(tmp_path / "random-seed1.pt", seed=1)
    with pytest.raises(UserError, match="extractor_sha256=.*another extractor"):
        fid.score(data["half"], data["ref"], other)
    with pytest.raises(UserError, match="mode=clean: scoring asked for mode=legacy_tensorflow"):
        fid.score(data["half"], data["ref"], data["ext"], mode="legacy_tensorflow")


def test_corrupt_statistics_fail_before_any_subprocess(data, tmp_path, capsys):
    bad = tmp_path / "reference.npz"
    bad.write_bytes(data["ref"].read_bytes()[:100])
    out = tmp_path / "fid.json"
    code = cli.main(["fid", "--images", str(data["half"]), "--ref", str(bad), "--extractor", str(data["ext"]),
                     "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"diffrelay: error: {bad}:")
    assert not out.exists()


def test_cached_statistics_are_reused_without_recomputing(data, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = fid.make_ref(data["dataset"], data["ext"], mode="legacy_tensorflow", num=100, cache_dir=cache,
                         out=tmp_path / "a.npz")
    [cached] = cache.iterdir()
    stamp = cached.stat().st_mtime_ns

    def no_features(*args, **kwargs):
        raise AssertionError("features recomputed although the cache holds them")

    monkeypatch.setattr(features, "features", no_features)
    second = fid.make_ref(data["dataset"], data["ext"], mode="legacy_tensorflow", num=100, cache_dir=cache,
                          out=tmp_path / "b.npz")
    assert second.read_bytes() == first.read_bytes()
    assert cached.stat().st_mtime_ns == stamp
    ref = fid.load_ref(second)
    assert ref["settings"]["num_images"] == 100 and ref["settings"]["mode"] == "legacy_tensorflow"
    # Another image count is another cache entry, so it is computed.
    with pytest.raises(AssertionError, match="features recomputed"):
        fid.make_ref(data["dataset"], data["ext"], mode="legacy_tensorflow", num=90, cache_dir=cache,
                     out=tmp_path / "c.npz")


def test_damaged_cache_entry_is_recomputed(data, tmp_path):
    cache = tmp_path / "cache"
    fid.make_ref(data["dataset"], data["ext"], mode="legacy_tensorflow", cache_dir=cache, out=tmp_path / "a.npz")
    [cached] = cache.iterdir()
    cached.write_bytes(cached.read_bytes()[:-10])
    out = fid.make_ref(data["dataset"], data["ext"], mode="legacy_tensorflow", cache_dir=cache,
                       out=tmp_path / "b.npz")
    fid.load_ref(out)
    fid.load_ref(cached)  # rewritten whole


def test_more_reference_images_than_the_dataset_has_is_refused(data, tmp_path):
    with pytest.raises(UserError, match=f"--num={N + 1}: .* has only {N} images"):
        fid.make_ref(data["dataset"], data["ext"], num=N + 1, out=tmp_path / "r.npz")


def test_missing_image_folder_is_refused_before_the_extractor_loads(data, tmp_path, monkeypatch):
    monkeypatch.setattr(extractor, "load", lambda *a, **k: pytest.fail("extractor loaded before the cheap checks"))
    with pytest.raises(UserError, match=f"{tmp_path / 'none'}: image folder not found"):
        fid.score(tmp_path / "none", data["ref"], data["ext"])


def test_custom_extractor_end_to_end_through_the_cli(data, tmp_path):
    src = tmp_path / "tiny.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(TinyFeatures()), str(src))
    ext = tmp_path / "resources" / "tiny.pt"
    ref = tmp_path / "ref.npz"
    # The first two stages run in this process to save two interpreter start-ups; fid runs as the workflow runs it.
    assert cli.main(["fetch-extractor", "--extractor", str(src), "--out", str(ext)]) == 0
    assert cli.main(["fid-ref", "--dataset", str(data["dataset"]), "--extractor", str(ext), "--out", str(ref),
                     "--cache-dir", str(tmp_path / "c")]) == 0
    out = tmp_path / "fid.json"
    p = run_cli("fid", "--images", data["half"], "--ref", ref, "--extractor", ext, "--out", out)
    r = json.loads(out.read_text())
    assert r["metric"] == "FD-128 (tiny.pt)"
    assert r["num_images"] == N and r["num_ref"] == N and r["mode"] == "clean"
    assert r["extractor_sha256"] == io.sha256_file(ext) and r["fid"] >= 0
    assert r["started"] <= r["finished"] and r["seconds"] >= 0
    assert "FD-128 (tiny.pt)" in p.stderr  # the child's log line reached the parent's stderr


def test_fid_child_started_inside_torchrun_sees_no_group_variables(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, os, sys\n"
        "from diffrelay.evaluation import fid\n"
        "out = sys.argv[1]\n"
        "json.dump(dict(os.environ), open(out + '.parent', 'w'))\n"
        "child = 'import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], \"w\"))'\n"
        "fid.run_clean([sys.executable, '-c', child, out + '.child'], 120)\n")
    out = tmp_path / "env"
    run_cli("torchrun", "--standalone", "--nproc-per-node", "1", script, out)
    parent = json.loads((tmp_path / "env.parent").read_text())
    child = json.loads((tmp_path / "env.child").read_text())
    assert {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} <= set(parent)
    assert any(k.startswith("TORCHELASTIC_") for k in parent)
    leaked = [k for k in child if k in distributed.GROUP_VARS or k.startswith(distributed.GROUP_PREFIXES)]
    assert leaked == []
    assert child["PATH"] == parent["PATH"]


def test_subprocess_timeout_is_one_line_error(data, tmp_path):
    out = tmp_path / "fid.json"
    p = run_cli("fid", "--images", data["half"], "--ref", data["ref"], "--extractor", data["ext"], "--out", out,
                "--timeout-minutes", "0.0005", check=False)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("diffrelay: error:") and "timed out after 0.0005 minutes" in lines[-1]
    assert not any(line.startswith("Traceback") for line in lines)
    assert not out.exists()


def test_run_clean_kills_a_child_that_outlives_its_timeout(tmp_path):
    with pytest.raises(UserError, match="timed out after 0.01 minutes"):
        fid.run_clean([sys.executable, "-c", "import time; time.sleep(60)"], 0.6)


def test_scoring_runs_in_strict_fp32_on_the_device_asked_for(data, tmp_path, monkeypatch):
    """run.device reaches the scorer (cpu on a GPU machine stays on the CPU), the scorer turns TF32 off
    (PyTorch's default allows it for cuDNN convolutions), and cached statistics are keyed by device type."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as far as `auto` can tell
    before = torch.backends.cudnn.conv.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # what a training process may have left behind
    try:
        r = fid.score(data["half"], data["ref"], data["ext"], device="cpu")
        assert r["fid"] > 0 and torch.backends.cudnn.conv.fp32_precision == "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.cudnn.conv.fp32_precision = before
    cache = tmp_path / "cache"
    fid.make_ref(data["dataset"], data["ext"], num=20, cache_dir=cache, out=tmp_path / "a.npz", device="cpu")
    [cached] = cache.iterdir()
    assert "-cpu-20.npz" in cached.name


def test_fid_passes_the_device_to_its_clean_child(data, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(fid, "run_clean", lambda cmd, timeout: seen.append(cmd) or type("P", (), {"returncode": 3}))
    code = cli.main(["fid", "--images", str(data["half"]), "--ref", str(data["ref"]), "--extractor", str(data["ext"]),
                     "--device", "cpu", "--out", str(tmp_path / "r.json")])
    assert code == 3 and "--device" in seen[0] and seen[0][seen[0].index("--device") + 1] == "cpu"


def test_a_bad_pick_model_or_classifier_fails_before_the_clean_child(data, tmp_path, monkeypatch, capsys):
    """fid.pick_model and fid.classifier are checked by the parent, as fid.clip_model is: no FID pass is paid for."""
    monkeypatch.setattr(fid, "run_clean", lambda cmd, timeout: pytest.fail("the scoring child started"))
    for flag, key in (("--pick-model", "fid.pick_model"), ("--classifier", "fid.classifier")):
        code = cli.main(["fid", "--images", str(data["half"]), "--ref", str(data["ref"]), "--extractor",
                         str(data["ext"]), flag, str(tmp_path / "absent"), "--out", str(tmp_path / "r.json")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and key in err and "not found" in err, err


def test_the_scoring_child_writes_pick_score_and_class_accuracy_beside_the_fid(data, tmp_path):
    """Issue 58: both per-file scores in the score file, where evaluation/columns.py reads them for metrics.csv."""
    import textmodels
    from test_adherence import colour_classifier

    from diffrelay.evaluation import columns

    images = tmp_path / "images"
    images.mkdir()
    for png in sorted(data["half"].glob("*.png")):
        (images / png.name).write_bytes(png.read_bytes())
        (images / png.name).with_suffix(".txt").write_text("a red dog")
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(f"- {{prompt: a red dog, num_images: {N}}}\n")
    pick = textmodels.clip_model(tmp_path / "pick", ("a", "red", "dog"))
    out = tmp_path / "r.json"
    code = cli.main(["fid", "--images", str(images), "--ref", str(data["ref"]), "--extractor", str(data["ext"]),
                     "--pick-model", str(pick), "--classifier", str(colour_classifier(tmp_path / "cls")),
                     "--prompts", str(prompts), "--device", "cpu", "--in-process", "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["pick_score"]["count"] == result["class_accuracy"]["count"] == N
    assert len(result["pick_score"]["sha256"]) == len(result["class_accuracy"]["sha256"]) == 64
    row = columns.values(result, result["scores"][0], True)
    assert row["pick_score"] == result["pick_score"]["pick_score"] and 0 <= row["class_accuracy"] <= 1


def test_an_unwritable_cache_folder_keeps_the_written_statistics(data, tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    caplog.set_level("WARNING")
    out = fid.make_ref(data["dataset"], data["ext"], num=20, cache_dir=blocker / "cache", out=tmp_path / "a.npz",
                       device="cpu")
    plain = fid.make_ref(data["dataset"], data["ext"], num=20, out=tmp_path / "b.npz", device="cpu")
    assert "statistics not cached" in caplog.text and blocker.read_text().startswith("a file")
    assert np.array_equal(fid.load_ref(out)["mu"], fid.load_ref(plain)["mu"])


def test_a_reference_of_no_more_images_than_features_is_said_in_scores_md_with_the_images_needed(data, tmp_path,
                                                                                                  caplog):
    """Issue 53, friction 3: a singular reference was said only in fid-ref's job log. `data`'s reference holds
    N = 128 images for the random extractor's 128 features; the score carries both, and scores.md says it."""
    from test_report import make_run

    caplog.set_level("WARNING")
    fid.make_ref(data["dataset"], data["ext"], num=20, out=tmp_path / "small.npz", device="cpu")
    assert "20 images for its 128 features (it needs at least 129)" in caplog.text
    result = fid.score(write_pngs(tmp_path / "few", shapes(8, seed=5)), data["ref"], data["ext"])
    assert (result["num_ref"], result["feature_dim"]) == (N, extractor.RANDOM_DIM) == (128, 128)
    run = make_run(tmp_path)
    for path in (run / "metrics" / "fid").iterdir():
        path.write_text(json.dumps(result))
    assert cli.main(["report", "--run-dir", str(run), "--out", str(run / "report")]) == 0
    text = (run / "report" / "scores.md").read_text()
    warning = ("**Warning:** the reference of FD (random features) has 128 images for its 128 features (it needs at "
               "least 129): its covariance is singular and FD (random features) is unreliable; hold out at least 129 "
               "images (data.val_fraction, data.val_path), or use at least 129 reference images (fid.ref_images, "
               "0 = all).")
    assert text.count("**Warning:**") == 1 and warning in text.splitlines()
    assert text.index("| step 8 |") < text.index(warning)  # under the table
