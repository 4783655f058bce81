"""A reference with no more images than its extractor's features (issue 53, friction 3): `diffrelay validate` says
it, with the number of images needed, whenever the config and the disk tell how many images the reference will hold
(scores.md's line: test_fid.py::test_a_reference_of_no_more_images_than_features_is_said_in_scores_md_with_the_images_needed)."""

from diffrelay.config import report as validate
from diffrelay.data import captions
from diffrelay.evaluation import dinov2, extractor, protocol, refsize


def test_the_feature_counts_validate_knows_are_the_extractors_own():
    assert set(refsize.FEATURE_DIMS) == set(protocol.BUILTIN)
    assert refsize.FEATURE_DIMS["inception"] == extractor.INCEPTION_DIM == 2048
    assert refsize.FEATURE_DIMS["random"] == extractor.RANDOM_DIM
    assert refsize.FEATURE_DIMS["dinov2"] == dinov2.MODELS[dinov2.DEFAULT].dim == 1024
    for model in protocol.DINOV2_MODELS:
        assert refsize.FEATURE_DIMS[f"dinov2-{model}"] == dinov2.MODELS[model].dim


def test_the_held_out_count_is_prepares_own():
    for n in (2, 3, 10, 59, 60, 200, 1001):
        for fraction in (0.01, 0.1, 0.25, 0.5):
            names = [f"{i}.png" for i in range(n)]
            assert refsize.held_out_count(n, fraction) == len(captions.held_out(names, fraction, 0, "k")), (n, fraction)


def notes(data: dict, fid: dict, images: dict, dataset=None) -> list[str]:
    """config_notes of a config's data and fid sections, with `images` the images under each folder."""
    d = {"data": {"kind": "folder", "path": "imgs", "captions": "none", "val_fraction": 0.0, "val_path": None} | data,
         "fid": {"extractor": "random", "extractors": None, "reference": None, "ref_images": 0} | fid}
    return refsize.config_notes(d, lambda root, enough: min(images[str(root)], enough), dataset or "no-dataset")


def test_each_way_a_reference_is_drawn_is_counted_and_the_fix_names_its_key(tmp_path):
    # an image folder: all of it, or fid.ref_images of it
    [line] = notes({}, {}, {"imgs": 60})
    assert line == ("the reference of random has 60 images for its 128 features (it needs at least 129): its "
                    "covariance is singular and random is unreliable; use a dataset of at least 129 images, or an "
                    "extractor with fewer features")
    assert notes({}, {}, {"imgs": 129}) == []
    [line] = notes({}, {"ref_images": 100}, {"imgs": 5000})
    assert "has 100 images" in line and line.endswith("set fid.ref_images to at least 129 (0 = all)")
    # a text run's held-out split: data.val_fraction of the folder (prepare's rule), or data.val_path
    text = {"captions": "auto", "val_fraction": 0.1}
    [line] = notes(text, {}, {"imgs": 600})
    assert "has 60 images" in line and "raise data.val_fraction (it holds out 60 of 600), or give data.val_path" in line
    assert notes(text, {}, {"imgs": 1300}) == []  # 130 held out
    [line] = notes({"captions": "auto", "val_path": "val"}, {"ref_images": 1000}, {"val": 40})
    assert "has 40 images" in line and line.endswith("put at least 129 images in data.val_path")
    # every extractor it can say it of, the largest first needed; none of a file of your own or fid.reference's
    lines = notes({}, {"extractors": ["inception", "dinov2-vits14", "mine.pt"]}, {"imgs": 1500})
    assert [line.split(" has ")[0] for line in lines] == ["the reference of inception"]
    assert "(it needs at least 2049)" in lines[0]
    assert notes({}, {"extractors": ["inception"], "reference": {"inception": "cifar.npz"}}, {"imgs": 10}) == []
    # a prepared dataset says exactly (its held-out split in a text run)
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "dataset.json").write_text('{"count": 12}')
    [line] = notes(text, {}, {}, dataset=tmp_path)
    assert "has 12 images" in line and "(it holds out 12)" in line


def test_validate_says_it_with_the_images_needed(write_config, capsys):
    # The tests' tiny config: 96 shapes for the random extractor's 128 features.
    assert validate.main(type("Args", (), {"config": [str(write_config())]})) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "covariance is singular" in line]
    assert warnings == ["diffrelay: warning: the reference of random has 96 images for its 128 features (it needs at "
                        "least 129): its covariance is singular and random is unreliable; use a dataset of at least "
                        "129 images, or an extractor with fewer features"]
