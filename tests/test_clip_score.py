"""CLIP score (evaluation/clip_score.py) on a tiny random CLIP saved as save_pretrained writes it: the score is
Hessel et al.'s formula restated here, batch size does not change it, and bad model folders are refused."""

import hashlib
import json
import logging

import numpy as np
import pytest

from diffrelay.errors import UserError
from diffrelay.evaluation import clip_score
import textmodels

pytest.importorskip("transformers")

WORDS = ("a", "photo", "of", "red", "blue", "green", "circle", "square", "cat", "dog")
PROMPTS = ["a red circle", "a blue square", "a photo of a cat", "a green dog", "a photo of a red square"]


def build_clip(folder, seed=0):
    return textmodels.clip_model(folder, WORDS, seed)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_clip(tmp_path_factory.mktemp("clip") / "clip")


@pytest.fixture(scope="module")
def clip(folder):
    return clip_score.load(folder, "cpu")


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (int(rng.integers(24, 48)), int(rng.integers(24, 48)), 3), dtype=np.uint8)
            for _ in range(n)]


def restated(folder, pics, texts, negate_text=False, exact=False):
    """Hessel et al. 2021 with w = 100, written out: the processor's pixels and tokens (padded to 77, as
    openai/CLIP's clip.tokenize pads), CLIPModel's projected embeddings, normalised, cosine, max(., 0), x 100, mean.
    exact=True runs the model in float64: the score without any rounding of float32."""
    import torch
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

    model = CLIPModel.from_pretrained(folder, local_files_only=True, use_safetensors=True).eval()
    model = model.double() if exact else model
    if negate_text:
        model.text_projection.weight.data.neg_()
    pixels = CLIPImageProcessorPil.from_pretrained(folder, local_files_only=True)(images=pics, return_tensors="pt")
    tokens = AutoTokenizer.from_pretrained(folder, local_files_only=True)(texts, padding="max_length", max_length=77,
                                                                          return_tensors="pt")
    with torch.no_grad():
        e_image = model.get_image_features(pixel_values=pixels["pixel_values"].to(model.dtype)).pooler_output
        e_text = model.get_text_features(**tokens).pooler_output
    e_image, e_text = e_image.double(), e_text.double()
    cos = (e_image * e_text).sum(-1) / (e_image.norm(dim=-1) * e_text.norm(dim=-1))
    per = 100 * torch.clamp(cos, min=0)
    return per.mean().item(), per.tolist(), (100 * cos).tolist()


def test_load_records_the_weights(clip, folder):
    assert clip.sha256 == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert clip.max_length == 77 and len(clip.tokenizer) == clip.model.config.text_config.vocab_size
    assert type(clip.image_processor).__name__ == "CLIPImageProcessorPil"


def test_score_is_the_formula(clip, folder):
    pics, texts = images(10), [PROMPTS[i % 5] for i in range(10)]
    got = clip_score.score(clip, pics, texts, batch_size=4)
    mean, per, raw = restated(folder, pics, texts)
    assert got["count"] == 10 and got["model"] == str(folder) and got["sha256"] == clip.sha256
    assert got["per_image"] == pytest.approx(per, abs=1e-5)
    assert got["clip_score"] == pytest.approx(mean, abs=1e-5)
    assert got["per_image"] == pytest.approx(restated(folder, pics, texts, exact=True)[1], abs=1e-4)  # float32's error
    assert got["truncated"] == 0
    assert len({round(r, 3) for r in raw}) == 10  # the images and prompts tell apart: the test can fail


def test_a_negative_cosine_counts_as_zero(folder):
    pics, texts = images(10), [PROMPTS[i % 5] for i in range(10)]
    _, _, raw = restated(folder, pics, texts)
    flipped = clip_score.load(folder, "cpu")  # its own copy of the weights
    flipped.model.text_projection.weight.data.neg_()  # every cosine changes sign
    got = clip_score.score(flipped, pics, texts)
    mean, per, _ = restated(folder, pics, texts, negate_text=True)
    assert any(r > 1 for r in raw) and any(r < -1 for r in raw)  # both signs occur
    assert got["per_image"] == pytest.approx([max(-r, 0.0) for r in raw], abs=1e-5)
    assert got["per_image"] == pytest.approx(per, abs=1e-5)
    assert got["clip_score"] == pytest.approx(mean, abs=1e-5)
    assert got["clip_score"] != pytest.approx(max(np.mean([-r for r in raw]), 0), abs=1e-3)  # not the clamped mean


def test_batch_size_does_not_change_the_score(clip):
    pics, texts = images(11, seed=1), [PROMPTS[i % 5] for i in range(11)]
    results = [clip_score.score(clip, pics, texts, batch_size=b) for b in (1, 3, 32)]
    for r in results[1:]:
        assert r["per_image"] == pytest.approx(results[0]["per_image"], abs=1e-5)
        assert r["clip_score"] == pytest.approx(results[0]["clip_score"], abs=1e-5)


def test_long_prompts_are_truncated_once(clip, caplog):
    pics = images(2, seed=2)
    long = " ".join(["red"] * 100)
    with caplog.at_level(logging.WARNING, logger="diffrelay"):
        got = clip_score.score(clip, pics, [long, long])
    cut = clip_score.score(clip, pics, [" ".join(["red"] * 75)] * 2)  # 75 words + start and end: 77 tokens
    assert got["truncated"] == 1 and cut["truncated"] == 0
    assert got["per_image"] == pytest.approx(cut["per_image"], abs=1e-6)  # the end token is kept
    assert sum("longer than CLIP's 77 tokens" in r.message for r in caplog.records) == 1


def test_score_folder_reads_each_images_prompt(clip, tmp_path, caplog):
    from PIL import Image

    pics, texts = images(3, seed=3), ["a red circle", "a photo of a cat\n", "un chat \u732b"]
    for i, (p, t) in enumerate(zip(pics, texts)):
        Image.fromarray(p).save(tmp_path / f"{i:06d}.png")
        (tmp_path / f"{i:06d}.txt").write_bytes(t.encode("utf-8"))
    Image.fromarray(pics[0]).save(tmp_path / "grid.png")  # not a sample
    got = clip_score.score_folder(tmp_path, clip, batch_size=2)
    want = clip_score.score(clip, pics, texts)
    assert got["folder"] == str(tmp_path) and got["count"] == 3
    assert got["per_image"] == pytest.approx(want["per_image"], abs=1e-5)
    (tmp_path / "000002.txt").write_bytes(b" \n")  # emptied: scored, and said
    with caplog.at_level(logging.WARNING, logger="diffrelay"):
        clip_score.score_folder(tmp_path, clip)
    assert [r.message for r in caplog.records if "empty prompt" in r.message] == [
        f"{tmp_path / '000002.txt'}: empty prompt (1 of 3 images' prompt files are empty or blank); those images "
        "are scored against the empty text: if the files were emptied by mistake, sample the folder again "
        "(diffrelay sample writes each image's prompt)"]
    (tmp_path / "000001.txt").write_bytes(b"\xffcat")
    with pytest.raises(UserError, match=r"000001.txt: not valid UTF-8"):
        clip_score.score_folder(tmp_path, clip)
    (tmp_path / "000001.txt").unlink()
    with pytest.raises(UserError, match=r"000001.png: no 000001.txt beside it"):
        clip_score.score_folder(tmp_path, clip)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no numbered images"):
        clip_score.score_folder(tmp_path / "empty", clip)
    with pytest.raises(UserError, match="sample folder not found"):
        clip_score.score_folder(tmp_path / "missing", clip)


def test_score_checks_its_arguments(clip):
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        clip_score.score(clip, images(2), ["a"])
    with pytest.raises(ValueError, match="not \\(H, W, 3\\) uint8"):
        clip_score.score(clip, [np.zeros((8, 8, 3), np.float32)], ["a"])


def copy_folder(src, dst, skip=()):
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in skip:
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_refusals(folder, tmp_path, monkeypatch):
    def refused(path, *fragments):
        with pytest.raises(UserError) as e:
            clip_score.load(path, "cpu")
        assert "\n" not in str(e.value) and str(path) in str(e.value)
        for f in fragments:
            assert f in str(e.value), str(e.value)

    refused(tmp_path / "nothing", "not found", "nothing is downloaded", "fid.clip_model",
            "openai/clip-vit-large-patch14")
    pickled = copy_folder(folder, tmp_path / "pickled", skip=("model.safetensors",))
    (pickled / "pytorch_model.bin").write_bytes(b"not even a pickle")
    import torch

    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was opened"))
    refused(pickled, "only pickled weights (pytorch_model.bin)", "never loaded")
    refused(copy_folder(folder, tmp_path / "noweights", skip=("model.safetensors",)), "no model.safetensors")
    refused(copy_folder(folder, tmp_path / "noconfig", skip=("config.json",)), "no config.json")
    other = copy_folder(folder, tmp_path / "other")
    (other / "config.json").write_text(json.dumps({"model_type": "siglip"}))
    refused(other, "model_type 'siglip', not 'clip'")
    refused(copy_folder(folder, tmp_path / "notok", skip=("tokenizer.json", "vocab.json", "tokenizer_config.json")),
            "no tokenizer")
    refused(copy_folder(folder, tmp_path / "noproc", skip=("processor_config.json",)), "no image processor")


def test_a_tokenizer_that_is_not_the_models_is_refused(folder, tmp_path):
    from transformers import CLIPTokenizer

    wrong = copy_folder(folder, tmp_path / "wrong", skip=("tokenizer.json", "tokenizer_config.json"))
    CLIPTokenizer().save_pretrained(wrong)  # the 3-token vocabulary v5 builds when given no vocab=
    with pytest.raises(UserError, match="end token"):
        clip_score.load(wrong, "cpu")


def test_the_hub_layout_loads_the_same(folder, clip, tmp_path):
    """openai/clip-vit-large-patch14's files: preprocessor_config.json, and a tokenizer as vocab.json + merges.txt
    (read through transformers 5's converter, which must give the same vocabulary)."""
    from transformers import CLIPImageProcessorPil

    hub = copy_folder(folder, tmp_path / "hub", skip=("processor_config.json", "tokenizer.json", "tokenizer_config.json"))
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(hub)
    (hub / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "CLIPTokenizer", "model_max_length": 77}))
    other = clip_score.load(hub, "cpu")
    assert len(other.tokenizer) == len(clip.tokenizer) and other.sha256 == clip.sha256
    pics, texts = images(4, seed=4), PROMPTS[:4]
    assert clip_score.score(other, pics, texts)["per_image"] == pytest.approx(
        clip_score.score(clip, pics, texts)["per_image"], abs=1e-9)
