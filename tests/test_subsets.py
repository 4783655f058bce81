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
from diffrelay.data.order import BucketOrder, DataOrder
from diffrelay.errors import UserError


def folder(root, sizes: dict) -> None:
    """root/<sub>/<i>.png of the given (width, height), a caption "a <sub>" beside the "dog" ones only."""
    for sub, whs in sizes.items():
        (root / sub).mkdir(parents=True)
        for i, (w, h) in enumerate(whs):
            Image.new("RGB", (w, h), (40 * i, 90, 200)).save(root / sub / f"{i}.png")
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


def test_train_jsonl_counts_each_subsets_rows(write_config, tmp_path):
    folder(tmp_path / "src", {"dog": [(16, 16)] * 3, "cat": [(16, 16)] * 2})
    cfg = write_config({"data": {"kind": "folder", "path": str(tmp_path / "src"),
                                 "subsets": [{"path": "dog", "repeats": 3}, {"path": "cat"}]},
                        "model": {"class_conditional": False},
                        "train": {"total_steps": 11, "segment_steps": 11, "batch_size": 1, "log_every": 11},
                        "sample": {"num_images": 2, "batch_size": 2}, "fid": {"batch_size": 2}})
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg, "--until-step", 11)
    records = [json.loads(x) for x in (tmp_path / "results/tiny/metrics/train.jsonl").read_text().splitlines()]
    step = next(r for r in records if r.get("step") == 11 and "loss" in r)
    assert step["subsets"] == {"dog": 9, "cat": 2}  # one epoch: the repeated, weighted union
    assert np.load(tmp_path / "results/tiny/dataset/subsets.npy").tolist() == [1, 1, 0, 0, 0]


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
    assert any("subsets[2].is_reg=True: not carried over: regularisation images" in x for x in lines)
    assert any("subsets[0].shuffle_caption=True: not carried over" in x for x in lines)
    assert any("flip_aug: set on some subsets only" in x for x in lines)
    overlay = __import__("yaml").safe_load((tmp_path / "data.yaml").read_text())
    assert overlay["train"] == {"batch_size": 2} and overlay["data"]["buckets"] == {"step": 64, "upscale": False}
    assert overlay["data"]["subsets"] == [{"path": "10_dog", "repeats": 10, "caption_prefix": "ohwx"},
                                          {"path": "cat", "class_tokens": "sks cat"}]
    (tmp_path / "img/reg/0.png").unlink()  # what import left out is not in data.path (or prepare would refuse it)
    (tmp_path / "img/reg").rmdir()
    d = config.validate({"data": overlay["data"] | {"captions": "none", "buckets": None}})
    d["data"]["captions"] = "auto"
    plan = datasets.plan(config.Config(d).data)
    assert plan.texts == ("", "ohwx a dog", "sks cat") and plan.subsets == ("10_dog", "cat")
    again = run_cli("import-dataset", tmp_path / "dataset.toml", "--out", tmp_path / "data.yaml", check=False)
    assert again.returncode == 2 and "exists; give --out a new file" in again.stderr
