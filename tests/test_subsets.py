"""data.subsets (data/subsets.py) and data.min_size: folders inside data.path with their repeats and trigger words.
The captions a dataset encodes carry the prefix, suffix and class tokens; an epoch holds each row `repeats` times,
the exact multiset, in an order of the seed and position alone (a resumed copy continues it); train.jsonl counts
each subset's rows; images below data.min_size are left out and listed; what cannot work is one line."""

import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from diffrelay import config
from diffrelay.data import datasets, subsets
from diffrelay.data.order import BucketOrder, DataOrder, PairedOrder
from diffrelay.errors import UserError


def folder(root, sizes: dict) -> None:
    """root/<sub>/<i>.png of the given (width, height), a ramp along x (so a crop's place shows), a caption
    "a <sub>" beside the "dog" ones only."""
    for sub, whs in sizes.items():
        (root / sub).mkdir(parents=True)
        for i, (w, h) in enumerate(whs):
            a = np.zeros((h, w, 3), dtype=np.uint8)
            a[..., 0], a[..., 1] = (np.arange(w) * 6 % 256)[None, :], 40 * i
            Image.fromarray(a).save(root / sub / f"{i}.png")
            if sub == "dog":
                (root / sub / f"{i}.txt").write_text(f"a {sub}\n")


def data_cfg(root, **over) -> dict:
    d = {"data": {"kind": "folder", "path": str(root), "resolution": 16, "val_fraction": 0,
                  "subsets": [{"path": "dog", "repeats": 3, "caption_prefix": "ohwx", "caption_suffix": "photo"},
                              {"path": str(root / "cat"), "class_tokens": "sks cat"}]} | over}
    d = config.validate(d)
    d["data"]["captions"] = "auto"  # the data section of a text run (the network's checks are not this test's)
    return d


def test_trigger_words_enter_the_captions_and_an_epoch_holds_each_row_its_repeats(tmp_path):
    folder(tmp_path / "src", {"dog": [(16, 16)] * 3, "cat": [(16, 16)] * 2, "tiny": [(8, 8)]})
    d = data_cfg(tmp_path / "src", min_size=12)
    d["data"]["subsets"].append({"path": "tiny"})
    with pytest.raises(UserError, match="data.subsets folder with no image"):  # every tiny image is too small
        datasets.plan(config.Config(d).data)
    d["data"]["subsets"].pop()
    (tmp_path / "src/tiny/0.png").rename(tmp_path / "src/dog/small.png")  # now a dog, and too small
    (tmp_path / "src/tiny").rmdir()
    p = datasets.plan(config.Config(d).data)
    assert p.too_small == ("dog/small.png",) and len(p.files) == 5
    info = datasets.build(p, tmp_path / "ds")
    assert info["too_small"] == ["dog/small.png"] and info["subsets"] == ["dog", "cat"]
    ds = datasets.open_prepared(tmp_path / "ds")
    assert ds.subsets.tolist() == [1, 1, 0, 0, 0]  # rows in path order: cat/0, cat/1, dog/0, dog/1, dog/2
    caps = json.loads((tmp_path / "ds/captions.json").read_text())
    assert [caps["texts"][r[0]] for r in caps["rows"]] == ["sks cat"] * 2 + ["ohwx a dog photo"] * 3
    repeats = subsets.repeats(d["data"]["subsets"], ds.subsets)
    assert repeats.tolist() == [1, 1, 3, 3, 3]
    order = DataOrder(0, ds.count, 1, repeats=repeats)
    epoch = [int(order.next_batch()[0][0]) for _ in range(11)]  # 2 cats + 3 dogs x 3
    assert Counter(epoch) == {0: 1, 1: 1, 2: 3, 3: 3, 4: 3}
    again = DataOrder(0, ds.count, 1, repeats=repeats)
    again.load_state_dict({"seed": 0, "consumed": 4})
    assert [int(again.copy().next_batch()[0][0])] == epoch[4:5]  # a resume (and its read-ahead copy) goes on
    assert DataOrder(0, 5, 1).next_batch()[0].tolist() == DataOrder(0, 5, 1, repeats=None).next_batch()[0].tolist()
    buckets = BucketOrder(0, [[0, 1], [2, 3, 4]], 1, repeats=repeats)
    assert Counter(int(buckets.next_batch()[0][0]) for _ in range(11)) == Counter(epoch)


def test_a_paired_order_holds_instance_rows_then_regularisation_rows_and_resumes():
    order = PairedOrder(3, [0, 1, 2], [3, 4], 4, repeats=np.array([2, 1, 1, 1, 1]))
    batches = [order.next_batch()[0].tolist() for _ in range(4)]  # 2 + 2 a step: one instance epoch (4 rows)
    assert all(set(b[:2]) <= {0, 1, 2} and set(b[2:]) <= {3, 4} for b in batches)
    assert Counter(sum((b[:2] for b in batches), [])) == {0: 4, 1: 2, 2: 2}  # two epochs, row 0 twice in each
    again = PairedOrder(0, [0, 1, 2], [3, 4], 4, repeats=np.array([2, 1, 1, 1, 1]))
    again.load_state_dict(order.state_dict() | {"consumed": 4})
    assert again.state_dict() == {"seed": 3, "consumed": 4} and again.copy().next_batch()[0].tolist() == batches[2]
    w = subsets.prior_weights(4, 0.5)
    losses = np.array([1.0, 3.0, 10.0, 20.0])  # diffusers: mean(instance) + w x mean(class) = 2 + 0.5 x 15
    assert float((w * losses).mean()) == 9.5
    assert float((w[0::2] * losses[0::2]).mean() + (w[1::2] * losses[1::2]).mean()) / 2 == 9.5  # over 2 ranks


@pytest.mark.parametrize("subset, stray, why", [
    ({"path": "/elsewhere"}, None, "lies outside data.path"),
    ({"path": "dog/inner"}, None, "lies in data.subsets[0].path=dog"),
    ({"path": "cat"}, "bird", "in no folder of data.subsets (dog, cat); add a subset for its folder"),
])
def test_what_subsets_cannot_take_is_one_line(tmp_path, subset, stray, why):
    folder(tmp_path / "src", {"dog": [(16, 16)], "cat": [(16, 16)], **({stray: [(16, 16)]} if stray else {})})
    d = {"data": {"kind": "folder", "path": str(tmp_path / "src"), "resolution": 16,
                  "subsets": [{"path": "dog"}, subset]}}
    with pytest.raises(UserError) as e:
        datasets.plan(config.Config(config.validate(d)).data)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_train_jsonl_counts_each_subsets_rows_and_prior_preservation_resumes_bit_for_bit(write_config, tmp_path):
    """Batches of one instance and one regularisation row (is_reg): 11 steps hold one instance epoch (the dogs
    three times, the cats once) and 11 regularisation rows; two segments of 4 and 7 steps equal one run, the
    regularisation subset's wide images cut at random places (its own random_crop) too."""
    from test_train import assert_tensors_equal, load_state

    folder(tmp_path / "src", {"dog": [(16, 16)] * 3, "cat": [(16, 16)] * 2, "reg": [(40, 16)] * 4})
    over = {"data": {"kind": "folder", "path": str(tmp_path / "src"),
                     "subsets": [{"path": "dog", "repeats": 3}, {"path": "cat"},
                                 {"path": "reg", "is_reg": True, "random_crop": True}]},
            "model": {"class_conditional": False},
            "train": {"total_steps": 11, "segment_steps": 11, "batch_size": 2, "log_every": 11,
                      "prior_loss_weight": 0.5},
            "sample": {"num_images": 2, "batch_size": 2}, "fid": {"batch_size": 2}}
    one = write_config(over)
    run_cli("prepare", "--config", one)
    run_cli("train", "--config", one, "--until-step", 11)
    records = [json.loads(x) for x in (tmp_path / "results/tiny/metrics/train.jsonl").read_text().splitlines()]
    step = next(r for r in records if r.get("step") == 11 and "loss" in r)
    assert step["subsets"] == {"dog": 9, "cat": 2, "reg": 11}  # one instance epoch: the repeated union
    assert np.load(tmp_path / "results/tiny/dataset/subsets.npy").tolist() == [1, 1, 0, 0, 0, 2, 2, 2, 2]
    assert (tmp_path / "results/tiny/dataset/wide.u8").stat().st_size == (5 * 16 * 16 + 4 * 40 * 16) * 3
    two = write_config(over | {"run": {"name": "two", "results": str(tmp_path / "results"),
                                       "resources": str(tmp_path / "resources")}}, name="two.yaml")
    for until in (4, 11):
        run_cli("train", "--config", two, "--dataset", tmp_path / "results/tiny/dataset", "--until-step", until)
    a = load_state(tmp_path / "results/tiny/checkpoints/step_0000011")
    b = load_state(tmp_path / "results/two/checkpoints/step_0000011")
    for key in ("net", "ema", "optimizer", "order"):
        assert_tensors_equal(a[key], b[key], key)


def test_a_kohya_dataset_config_imports_as_subsets_and_says_what_it_leaves(tmp_path):
    folder(tmp_path / "img", {"10_dog": [(16, 16)] * 2, "cat": [(16, 16)], "reg": [(16, 16)]})
    for i in range(2):  # kohya's default caption extension beside the dog images
        (tmp_path / f"img/10_dog/{i}.caption").write_text("a dog\n")
    (tmp_path / "dataset.toml").write_text(f"""
[general]
shuffle_caption = true
caption_extension = '.caption'
keep_tokens = 1

[[datasets]]
resolution = 16
batch_size = 2
enable_bucket = true
bucket_no_upscale = true

  [[datasets.subsets]]
  image_dir = '{tmp_path}/img/10_dog'
  num_repeats = 10
  caption_prefix = 'ohwx'

  [[datasets.subsets]]
  image_dir = '{tmp_path}/img/cat'
  class_tokens = 'sks cat'
  flip_aug = true

  [[datasets.subsets]]
  image_dir = '{tmp_path}/img/reg'
  is_reg = true
""")
    p = run_cli("import-dataset", tmp_path / "dataset.toml", "--out", tmp_path / "data.yaml")
    lines = p.stderr.strip().splitlines()
    assert all(line.startswith(f"diffrelay: import-dataset: {tmp_path / 'dataset.toml'}: ") for line in lines)
    assert any("subsets[2].is_reg: carried over; diffrelay makes each batch half instance" in x for x in lines)
    assert any("set data.text_cache: false (a new caption each step" in x for x in lines)
    assert any("flip_aug: on some subsets only: data.subsets[].flip 0.5 there" in x for x in lines)
    overlay = __import__("yaml").safe_load((tmp_path / "data.yaml").read_text())
    assert overlay["train"] == {"batch_size": 2} and overlay["data"]["buckets"] == {"step": 64, "upscale": False}
    assert (overlay["data"]["shuffle_caption"], overlay["data"]["keep_tokens"], overlay["data"]["text_cache"]) == (
        True, 1, False)
    assert overlay["data"]["subsets"] == [{"path": "10_dog", "repeats": 10, "caption_prefix": "ohwx"},
                                          {"path": "cat", "class_tokens": "sks cat", "flip": 0.5},
                                          {"path": "reg", "is_reg": True}]
    (tmp_path / "img/reg/0.txt").write_text("a dog\n")
    d = config.validate({"data": overlay["data"] | {"captions": "none", "buckets": None, "shuffle_caption": False,
                                                    "keep_tokens": 0}, "train": overlay["train"]})
    d["data"]["captions"] = "auto"
    plan = datasets.plan(config.Config(d).data)
    assert plan.texts == ("", "ohwx a dog", "sks cat", "a dog") and plan.subsets == ("10_dog", "cat", "reg")
    again = run_cli("import-dataset", tmp_path / "dataset.toml", "--out", tmp_path / "data.yaml", check=False)
    assert again.returncode == 2 and "exists; give --out a new file" in again.stderr


@pytest.mark.parametrize("train, data, why", [
    ({"batch_size": 3}, {}, "train.batch_size=3: is half instance, half regularisation images"),
    ({}, {"buckets": {}}, "with data.buckets is not built"),
    ({}, {"all_reg": True}, "marks every subset; prior preservation needs instance images too"),
])
def test_what_prior_preservation_cannot_take_is_one_line(tmp_path, train, data, why):
    subs = [{"path": "dog", "is_reg": bool(data.pop("all_reg", False))}, {"path": "reg", "is_reg": True}]
    d = {"data": {"kind": "folder", "path": str(tmp_path), "subsets": subs} | data, "train": train}
    with pytest.raises(UserError) as e:
        config.validate(d)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_caption_tags_are_kept_dropped_and_shuffled_by_seed_and_position_alone():
    from types import SimpleNamespace

    from diffrelay.data import tags

    caption = "ohwx, a dog, grass, sky, red collar, running"
    rng = np.random.Generator(np.random.PCG64(1))
    out = tags.process(caption, rng, shuffle=True, keep=2, keep_separator="", dropout=0.0)
    assert out.startswith("ohwx, a dog, ") and sorted(out.split(", ")) == sorted(caption.split(", "))
    kept = tags.process("ohwx, a dog ||| grass, sky", rng, shuffle=True, keep=0, keep_separator="|||", dropout=0.99)
    assert kept == "ohwx, a dog"  # everything before the separator stays; the rest dropped at 0.99
    data = SimpleNamespace(shuffle_caption=True, keep_tokens=1, keep_tokens_separator="", caption_tag_dropout=0.3)
    texts = [caption] * 4
    whole = tags.rows(texts, 0, 5, np.arange(4), data)
    assert len(set(whole)) > 1 and all(t.startswith("ohwx, ") for t in whole)
    # rank r of 2 holds positions r::2: the same captions as the whole batch's, and again on a rerun (a resume)
    assert tags.rows(texts[0::2], 0, 5, np.arange(4)[0::2], data) == whole[0::2]
    assert tags.rows(texts[1::2], 0, 5, np.arange(4)[1::2], data) == whole[1::2] == tags.rows(texts, 0, 5,
                                                                                                 np.arange(4), data)[1::2]
    assert tags.rows(texts, 0, 6, np.arange(4), data) != whole  # another step, other draws
    assert tags.process("", rng, True, 0, "", 0.5) == ""  # a dropped caption stays empty


@pytest.mark.parametrize("data, why", [
    ({"shuffle_caption": True}, "data.shuffle_caption=True: makes a new caption each step, and data.text_cache"),
    ({"keep_tokens": 2, "text_cache": False}, "says which tags stay in place"),
    ({"caption_tag_dropout": 0.1, "captions": "none"}, "processes captions; this run has none"),
])
def test_what_caption_tags_cannot_take_is_one_line(data, why):
    d = {"data": {"kind": "shapes", "captions": "auto"} | data}
    with pytest.raises(UserError) as e:
        config.validate(d)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_subsets_own_flip_probability_is_compared_with_the_same_draw_as_data_xflip():
    from diffrelay.data import augment

    subs = [{"flip": None}, {"flip": 1.0}, {"flip": 0.0}]
    p = subsets.per_row(subs, np.array([0, 1, 2, 0, 1, 2, 0, 1], dtype=np.int16), "flip", 0.5)
    assert p.tolist() == [0.5, 1.0, 0.0] * 2 + [0.5, 1.0] and subsets.per_row([{"flip": None}], p, "flip", 0.5) == 0.5
    _, plain = augment.masks(0, 3, 8, 0, 1, 0.0, 0.5)
    _, own = augment.masks(0, 3, 8, 0, 1, 0.0, p)
    assert own[[1, 4, 7]].all() and not own[[2, 5]].any() and (own[[0, 3, 6]] == plain[[0, 3, 6]]).all()
    _, rank1 = augment.masks(0, 3, 8, 1, 2, 0.0, p[1::2])  # rank 1 of 2: its rows' own probabilities
    assert (rank1 == own[1::2]).all()
    rows = np.array([0, 1, 2, 0], dtype=np.int16)  # caption dropout likewise: a subset's own, else the run's
    flip, drop, _ = subsets.probabilities({"subsets": [{}, {"caption_dropout": 0.9}, {}], "xflip": 0.5,
                                        "caption_dropout": 0.1}, rows)
    assert flip == 0.5 and drop.tolist() == [0.1, 0.9, 0.1, 0.1]
    assert (augment.captions(0, 3, 4, 0, 1, drop)[1] == (augment.uniforms(0, augment.CAPTION_DROPOUT, 3, 4) < drop)).all()
    d = {"data": {"kind": "folder", "path": "/x", "encoder": "sd-vae", "subsets": [{"path": "a", "flip": 0.5}]}}
    with pytest.raises(UserError, match=r"data.subsets\[0\].flip=0.5: flips a latent run by its mirrored latents"):
        config.validate(d)


def test_weights_become_repeats_in_proportion_and_exclude_repeats():
    subs = [{"weight": 1.0}, {"weight": 3.0}, {"weight": None}, {"weight": 2.0, "is_reg": True}]
    counts = np.array([100, 10, 50, 7])
    r = subsets.weighted_repeats(subs, counts)
    assert r.tolist() == [1, 30, 2, 1]  # 100, 300, 100 rows: 1 : 3 : 1; the regularisation group on its own
    of_row = np.repeat(np.arange(4), counts).astype(np.int16)
    assert subsets.repeats([s | {"repeats": 1} for s in subs], of_row).tolist() == np.repeat(r, counts).tolist()
    d = {"data": {"kind": "folder", "path": "/x", "subsets": [{"path": "a", "repeats": 2}, {"path": "b", "weight": 1}]}}
    with pytest.raises(UserError, match=r"data.subsets\[0\].repeats=2: and data.subsets\[1\].weight both set"):
        config.validate(d)


def test_a_random_crop_cuts_each_step_its_own_square_of_the_resized_image(tmp_path):
    from diffrelay.data import augment, wide

    root = tmp_path / "src"
    root.mkdir()
    for i, (w, h) in enumerate([(48, 16), (16, 40), (16, 16)]):
        a = np.zeros((h, w, 3), dtype=np.uint8)
        a[..., 0] = np.arange(w, dtype=np.uint8)[None, :] * 5  # a ramp along x, one along y: where the cut was
        a[..., 1] = np.arange(h, dtype=np.uint8)[:, None] * 5
        Image.fromarray(a).save(root / f"{i}.png")
    d = config.validate({"data": {"kind": "folder", "path": str(root), "resolution": 16, "random_crop": True}})
    p = datasets.plan(config.Config(d).data)
    assert p.random_crop and p.fingerprint != datasets.plan(config.Config(config.validate(
        {"data": {"kind": "folder", "path": str(root), "resolution": 16}})).data).fingerprint
    datasets.build(p, tmp_path / "ds")
    ds = datasets.open_prepared(tmp_path / "ds")
    assert ds.wide.index[:, 1:].tolist() == [[16, 48], [40, 16], [16, 16]]  # the short side at the resolution
    def cut(rows, u_top, u_left, w=16, h=16):
        return ds.wide.crops(np.array(rows), np.array(u_top), np.array(u_left), w, h)

    ends = [cut([0], [0.5], [u]) for u in (0.0, 0.999)]
    assert ends[0][0][0, 0, 0, 0] == 0 and ends[1][0][0, -1, -1, 0] == 235  # the leftmost and the rightmost square
    assert ends[0][1].tolist() == [[0, 0]] and ends[1][1].tolist() == [[0, 32]]  # their top and left
    assert (cut([2], [0.7], [0.7])[0][0] == ds.images[2]).all()  # a square: its only cut
    u = augment.uniforms(0, augment.CROP, 3, 4)
    both = cut([0, 1], u[:2], u[2:])[0]  # a row's cut depends on its own draws alone, not on the batch around it
    assert (both[0] == cut([0], u[:1], u[2:3])[0][0]).all() and (both[1] == cut([1], u[1:2], u[3:])[0][0]).all()
    (tmp_path / "ds" / wide.FILE).write_bytes(b"\0" * 10)  # damaged: refused in one line
    with pytest.raises(UserError, match="wide.u8: does not match wide_index.npy"):
        datasets.open_prepared(tmp_path / "ds")
    for over, why in (({"encoder": "sd-vae"}, "trains on latents encoded once"), ({"crop": "dhariwal"}, "fixed protocol")):
        with pytest.raises(UserError, match=why):
            config.validate({"data": {"kind": "folder", "path": str(root), "random_crop": True} | over})


def test_a_random_crop_inside_buckets_is_the_same_on_two_processes_and_across_segments(tmp_path):
    """A bucketed pixel run with data.random_crop: 4 steps on 1 process, on 2, and in 2 segments of 2: the same
    batches, K segments equal one run bit for bit, 2 processes within rounding; the windows move with the step."""
    import shutil

    import torch
    from test_buckets import bucket_config, make_folder
    from test_train import assert_tensors_equal, load_state, torchrun

    from diffrelay.data import augment

    make_folder(tmp_path / "imgs", count=24)
    runs = {name: (bucket_config(tmp_path, name, data={"random_crop": True}), tmp_path / name / "b")
            for name in ("one", "two", "segments")}
    run_cli("prepare", "--config", runs["one"][0])
    for name in ("two", "segments"):
        shutil.copytree(runs["one"][1] / "dataset", runs[name][1] / "dataset")
    torchrun(1, "--config", runs["one"][0], "--until-step", 4)
    torchrun(2, "--config", runs["two"][0], "--until-step", 4)
    torchrun(1, "--config", runs["segments"][0], "--until-step", 2)
    torchrun(1, "--config", runs["segments"][0], "--until-step", 4)
    a, b, c = (load_state(runs[k][1] / "checkpoints/step_0000004") for k in ("one", "two", "segments"))
    for key in ("net", "ema", "optimizer", "order"):
        assert_tensors_equal(a[key], c[key], key)
    for k, v in a["net"].items():
        assert torch.allclose(v, b["net"][k], rtol=1e-4, atol=1e-5), k
    ds = datasets.open_prepared(runs["one"][1] / "dataset")
    row = int(np.flatnonzero(ds.buckets.rows[:, 0] == 2)[0])  # a 40x24 bucket's image, resized wider than 40
    w, h = ds.buckets.sizes[2]
    cuts = {tuple(ds.wide.crops(np.array([row]), augment.uniforms(0, augment.CROP, s, 4)[:1],
                                augment.uniforms(0, augment.CROP + 1, s, 4)[:1], w, h)[1][0]) for s in range(6)}
    assert len(cuts) > 1 and all(top == 0 for top, _ in cuts)  # the window moves along the width alone


def test_a_simpletuner_dataloader_config_imports_as_subsets(tmp_path):
    folder(tmp_path / "img", {"dog": [(16, 16)] * 2, "style": [(16, 16)]})
    backends = [{"id": "dog", "type": "local", "instance_data_dir": str(tmp_path / "img/dog"), "repeats": 4,
                 "caption_strategy": "textfile", "instance_prompt": "ohwx", "prepend_instance_prompt": True,
                 "resolution": 16, "resolution_type": "pixel_area", "minimum_image_size": 8, "crop": True,
                 "crop_style": "random", "crop_aspect": "square", "cache_dir_vae": "/x", "probability": 0.5},
                {"id": "style", "instance_data_dir": str(tmp_path / "img/style"), "caption_strategy": "instanceprompt",
                 "instance_prompt": "in watercolour"},
                {"id": "reg", "instance_data_dir": "/elsewhere", "is_regularisation_data": True},
                {"id": "embeds", "dataset_type": "text_embeds", "default": True, "cache_dir": "/c"}]
    (tmp_path / "multidatabackend.json").write_text(json.dumps(backends))
    p = run_cli("import-dataset", tmp_path / "multidatabackend.json")
    overlay = __import__("yaml").safe_load(p.stdout)
    assert overlay["data"]["subsets"] == [{"path": "dog", "repeats": 5, "caption_prefix": "ohwx"},
                                          {"path": "style", "class_tokens": "in watercolour"}]
    assert {k: overlay["data"][k] for k in ("resolution", "min_size", "random_crop")} == {
        "resolution": 16, "min_size": 8, "random_crop": True}
    err = p.stderr
    assert "is_regularisation_data is SimpleTuner's parent-teacher regularisation" in err
    assert "probability=0.5: diffrelay has no per-step draw" in err and "dataset_type text_embeds" in err
    d = config.validate({"data": overlay["data"] | {"captions": "none"}})
    d["data"]["captions"] = "auto"
    assert datasets.plan(config.Config(d).data).texts == ("", "ohwx a dog", "in watercolour")


def test_a_subset_may_crop_at_random_alone(tmp_path):
    folder(tmp_path / "src", {"dog": [(32, 16)] * 2, "cat": [(16, 16)]})
    subs = [{"path": "dog", "random_crop": True}, {"path": "cat"}]
    d = config.validate({"data": {"kind": "folder", "path": str(tmp_path / "src"), "resolution": 16,
                                  "subsets": subs}})
    p = datasets.plan(config.Config(d).data)
    assert p.random_crop  # the store is made for every row; the cat's rows keep their centred cut
    _, _, cropped = subsets.probabilities(d["data"], np.array([1, 0, 0], dtype=np.int16))
    assert cropped.tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(UserError, match=r"data.subsets\[\].random_crop=true: needs the pixels at each step"):
        config.validate({"data": {"kind": "folder", "path": "/x", "encoder": "sd-vae", "subsets": subs}})
