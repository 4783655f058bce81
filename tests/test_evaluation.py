"""The evaluation protocol: several extractors in one pass, seed sets, the second (best-K) pass, their config rules."""

import json

import numpy as np
import pytest
import torch
from conftest import TINY, deep_merge, run_cli
from test_dinov2 import TINY as TINY_VIT
from test_dinov2 import official_state
from test_fid import shapes, write_dataset, write_pngs

from diffrelay import config
from diffrelay.evaluation import dinov2, extractor, features, fid, protocol
from diffrelay.errors import UserError


# ---------------------------------------------------------------------------------------------- names and config
@pytest.mark.parametrize("count, guidance, seed_set, name", [
    (None, 1.0, 0, ""), (50000, 1.0, 0, "_n50000"), (None, 1.5, 0, "_g1.5"), (None, 1.0, 2, "_s2"),
    (50000, 2.0, 1, "_n50000_g2_s1"), (None, 0.0, 3, "_g0_s3")])
def test_variant_names_round_trip(count, guidance, seed_set, name):
    assert protocol.variant(count, guidance, seed_set) == name
    assert protocol.parse_variant(name) == (count, guidance, seed_set)


def test_a_post_hoc_ema_variant_names_its_width_first():
    name = protocol.variant(None, 1.5, 1, ema=0.08)
    assert name == "_ema0.08_g1.5_s1"
    assert protocol.variant_ema(name) == 0.08 and protocol.parse_variant(name) == (None, 1.5, 1)
    assert protocol.variant_ema("_n64_s1") is None


def test_an_ema_decay_variant_is_named_only_for_other_than_the_first_decay():
    name = protocol.variant(50000, 1.5, 1, decay=0.9999)
    assert name == "_decay0.9999_n50000_g1.5_s1"
    assert protocol.variant_decay(name) == 0.9999 and protocol.parse_variant(name) == (50000, 1.5, 1)
    assert protocol.variant_decay("_g2") is None and protocol.variant_ema(name) is None
    d = config.validate({"train": {"ema_decays": [0.999, 0.9999, 0.99]}, "sample": {"ema_decay": [0.9999, 0.999]}})
    assert protocol.ema_decays(d) == [0.9999, None]  # the first decay keeps the plain names
    assert protocol.ema_decays(config.validate({})) == [None]


def test_ranking_keeps_decays_apart_and_names_only_the_others():
    rows = [{"step": 4, "guidance": 1.0, "decay": None, "fid": 3.0}, {"step": 4, "guidance": 1.0, "decay": 0.99,
                                                                       "fid": 2.0},
            {"step": 4, "guidance": 1.0, "decay": 0.99, "fid": 4.5}, {"step": 8, "guidance": 1.0, "fid": 1.0}]
    assert protocol.rank(rows, 3) == [{"step": 8, "guidance": 1.0, "score": 1.0},
                                      {"step": 4, "guidance": 1.0, "score": 3.0},
                                      {"step": 4, "guidance": 1.0, "score": 3.25, "decay": 0.99}]


def test_a_name_that_is_no_variant_is_refused():
    with pytest.raises(ValueError):
        protocol.parse_variant("_s1_g2")  # the order is fixed: count, guidance, seed set


def test_seed_sets_are_disjoint_consecutive_ranges():
    ranges = [set(range(protocol.first_seed(7, 100, j), protocol.first_seed(7, 100, j) + 100)) for j in range(3)]
    assert ranges[0] == set(range(7, 107)) and not (ranges[0] & ranges[1] or ranges[1] & ranges[2])


def _validate(over):
    return config.validate(deep_merge(TINY, over), source="my.yaml")


@pytest.mark.parametrize("over, key, words", [
    ({"fid": {"extractors": ["random", "inception"], "reference": "cifar.npz"}}, "fid.reference=cifar.npz",
     "one file for 2 extractors"),
    ({"fid": {"extractors": ["random", "inception"], "reference": {"dinov2": "x.npz"}}}, "fid.reference.dinov2",
     "not one of the extractors"),
    ({"fid": {"extractors": ["a/feat.pt", "b/feat.pt"]}}, "fid.extractors=a/feat.pt", "named twice"),
    ({"fid": {"final": {"best": 2, "num_images": 8}}}, "fid.final.num_images=8", "not more than sample.num_images"),
    ({"sample": {"first_seed": 2**63 - 100, "seed_sets": 20}}, "sample.first_seed", "passes the largest seed"),
])
def test_evaluation_settings_that_cannot_work_are_one_line_errors(over, key, words):
    with pytest.raises(UserError) as e:
        _validate(over)
    msg = str(e.value)
    assert msg.startswith(f"my.yaml: {key}") and words in msg and "\n" not in msg, msg


def test_extractors_list_replaces_the_single_extractor_and_keys_files():
    d = _validate({"fid": {"extractors": ["inception", "dinov2", "/x/my feats.pt"], "reference": {"inception": "r.npz"}}})
    names = protocol.extractor_names(d["fid"])
    assert names == ["inception", "dinov2", "/x/my feats.pt"]
    assert [protocol.extractor_key(n, 0) for n in names] == ["inception-2015-12-05", "dinov2-vitl14", "my_feats"]
    assert protocol.extractor_file("dinov2", 0, "res") == "res/extractors/dinov2-vitl14.pt"
    assert [protocol.reference_file(d["fid"], n) for n in names] == ["r.npz", None, None]
    assert protocol.extractor_names(_validate({})["fid"]) == ["random"]


def test_ranking_uses_the_mean_over_seed_sets_and_never_picks_nan():
    results = [{"step": 2, "guidance": 1.0, "fid": 5.0}, {"step": 2, "guidance": 1.0, "fid": 1.0},  # mean 3
               {"step": 4, "guidance": 1.0, "fid": 2.0}, {"step": 4, "guidance": 1.0, "fid": 4.5},  # mean 3.25
               {"step": 4, "guidance": 2.0, "fid": 2.5}, {"step": 6, "guidance": 1.0, "fid": float("nan")}]
    assert [(r["step"], r["guidance"]) for r in protocol.rank(results, 2)] == [(4, 2.0), (2, 1.0)]
    assert len(protocol.rank(results, 10)) == 3


def test_select_best_reads_first_pass_scores_from_the_segment_lists(tmp_path):
    folder = tmp_path / "metrics" / "fid"
    folder.mkdir(parents=True)
    values = {"step_0000002": 9.0, "step_0000002_s1": 7.0, "step_0000004": 3.0, "step_0000004_s1": 6.0,
              "step_0000004_n64": 0.1, "step_0000006": float("nan")}  # a second-pass score is not ranked
    for stem, v in values.items():
        (folder / f"{stem}.json").write_text(json.dumps({"metric": "FID-8", "fid": v}))
    seg = tmp_path / "seg.json"
    seg.write_text(json.dumps({"scores": [str(p) for p in sorted(folder.iterdir())]}))
    p = run_cli("select-best", "--best", "1", "--out", tmp_path / "selected.json", seg)
    got = json.loads((tmp_path / "selected.json").read_text())
    assert got["selected"] == [{"step": 4, "guidance": 1.0, "score": 4.5}] and got["metric"] == ["FID-8"]
    # a NaN score never wins, and is named in one line
    said = [line for line in p.stderr.splitlines() if "NaN" in line]
    assert len(said) == 1 and "step 6" in said[0], p.stderr


# ---------------------------------------------------------------------------------------------- one pass, two extractors
@pytest.fixture(scope="module")
def two(tmp_path_factory, request):
    """Images, a random extractor and a tiny DINOv2, each with reference statistics of other images."""
    root = tmp_path_factory.mktemp("two")
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    mp.setitem(dinov2.MODELS, "tiny", TINY_VIT)
    torch.save(official_state(TINY_VIT), root / "tiny.pth")
    vit = dinov2.fetch("tiny", root / "vit.pt", weights=root / "tiny.pth")
    rnd = extractor.build_random(root / "rnd.pt", seed=0)
    rnd2 = extractor.build_random(root / "rnd2.pt", seed=1)
    real, fake = write_pngs(root / "real", shapes(40, seed=0)), write_pngs(root / "fake", shapes(24, seed=1))
    refs = {}
    for name, path in {"vit": vit, "rnd": rnd, "rnd2": rnd2}.items():
        ext = extractor.load(path)
        [feats] = features.of_files(features.image_files(real), [ext], "clean", 16, "cpu")
        refs[name] = root / f"ref-{name}.npz"
        fid.save_ref(refs[name], *fid.statistics(feats), feats, {
            "format": fid.FORMAT, "mode": "clean", "metric": ext.label, "extractor": path.name,
            "extractor_sha256": ext.sha256, "num_images": len(feats)})
    return {"fake": fake, "vit": vit, "rnd": rnd, "rnd2": rnd2, "refs": refs}


def test_two_extractors_in_one_pass_equal_each_alone_and_decode_each_image_once(two, monkeypatch):
    decoded = []
    real_decode = features.decode
    monkeypatch.setattr(features, "decode", lambda p: decoded.append(p) or real_decode(p))
    both = fid.score_all(two["fake"], [(two["rnd"], two["refs"]["rnd"]), (two["vit"], two["refs"]["vit"])],
                         batch_size=10, workers=2)
    assert len(decoded) == 24 and len(set(decoded)) == 24  # one decode per image for both extractors
    alone = [fid.score(two["fake"], two["refs"][k], two[k], batch_size=10) for k in ("rnd", "vit")]
    assert [s["metric"] for s in both["scores"]] == ["FD-24 (random features)", "FD_DINOv2-24"]
    for s, a in zip(both["scores"], alone):
        for key in ("fid", "kid", "precision", "recall"):
            assert s[key] == a[key], key
    # The top level is the primary (first) score, as before there were several.
    assert both["metric"] == both["scores"][0]["metric"] and both["fid"] == both["scores"][0]["fid"]


def test_dinov2_sees_the_images_at_their_own_size_and_inception_kinds_clean_fids_view(two):
    vit, rnd = extractor.load(two["vit"]), extractor.load(two["rnd"])
    assert features.view_of(vit, "clean") == features.NATIVE and features.view_of(rnd, "clean") == "clean"
    item = features.file_images(features.image_files(two["fake"])[:1], [features.NATIVE, "clean"])[0]
    assert tuple(item[features.NATIVE].shape) == (3, 16, 16) and tuple(item["clean"].shape) == (3, 299, 299)


def test_two_extractors_of_one_kind_get_distinct_metric_names(two):
    r = fid.score_all(two["fake"], [(two["rnd"], two["refs"]["rnd"]), (two["rnd2"], two["refs"]["rnd2"])])
    names = [s["metric"] for s in r["scores"]]
    assert names == ["FD-24 (random features) [rnd.pt]", "FD-24 (random features) [rnd2.pt]"]
    assert r["scores"][0]["fid"] != r["scores"][1]["fid"]


def test_fid_cli_scores_every_pair_and_refuses_unpaired_arguments(two, tmp_path):
    out = tmp_path / "r.json"
    run_cli("fid", "--images", two["fake"], "--extractor", two["rnd"], "--ref", two["refs"]["rnd"],
            "--extractor", two["vit"], "--ref", two["refs"]["vit"], "--out", out)
    rec = json.loads(out.read_text())
    assert [s["reference"] for s in rec["scores"]] == ["ref-rnd.npz", "ref-vit.npz"]
    p = run_cli("fid", "--images", two["fake"], "--extractor", two["rnd"], "--extractor", two["vit"],
                "--ref", two["refs"]["rnd"], "--out", tmp_path / "x.json", check=False)
    assert p.returncode == 2 and "--extractor given 2 times, --ref 1 times" in p.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_mismatched_reference_of_the_second_extractor_fails_before_scoring(two, tmp_path):
    p = run_cli("fid", "--images", two["fake"], "--extractor", two["rnd"], "--ref", two["refs"]["rnd"],
                "--extractor", two["vit"], "--ref", two["refs"]["rnd"], "--out", tmp_path / "x.json", check=False)
    assert p.returncode == 2 and "ref-rnd.npz" in p.stderr and "another extractor" in p.stderr, p.stderr


def test_reference_statistics_of_a_prepared_dataset_for_dinov2_equal_those_of_its_pngs(two, tmp_path):
    imgs = shapes(20, seed=3)
    ref = fid.load_ref(fid.make_ref(write_dataset(tmp_path / "ds", imgs, "e" * 64), two["vit"], tmp_path / "r.npz"))
    [feats] = features.of_files(features.image_files(write_pngs(tmp_path / "png", imgs)),
                                [extractor.load(two["vit"])], "clean", 64, "cpu")
    np.testing.assert_array_equal(ref["features"], feats)
