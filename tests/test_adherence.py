"""PickScore (evaluation/pick_score.py) and class accuracy (evaluation/class_accuracy.py) on tiny models built from
configs: PickScore is the README's formula restated here, class accuracy counts exactly what a classifier with set
weights reads, and bad model folders, classes and prompts are refused in one line before any model is loaded."""

import json

import numpy as np
import pytest
from PIL import Image

from diffrelay.errors import UserError
from diffrelay.evaluation import class_accuracy, pick_score
import textmodels

pytest.importorskip("transformers")

WORDS = ("a", "photo", "of", "red", "blue", "green", "circle", "square", "cat", "dog")
PROMPTS = ["a red circle", "a blue square", "a photo of a cat", "a green dog", "a photo of a red square"]
COLOURS = {"red": (230, 20, 20), "green": (20, 230, 20), "blue": (20, 20, 230)}


@pytest.fixture(scope="module")
def pick_folder(tmp_path_factory):
    """A tiny random CLIP with PickScore_v1's learned temperature, logit_scale = log(100)."""
    import torch
    from transformers import CLIPModel

    folder = textmodels.clip_model(tmp_path_factory.mktemp("pick") / "pick", WORDS, seed=1)
    model = CLIPModel.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    with torch.no_grad():
        model.logit_scale.fill_(float(np.log(100.0)))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def colour_classifier(folder, labels=("red", "green", "blue")):
    """A ConvNeXt without blocks whose weights are set by hand: the patch convolution averages each colour channel,
    the layer norms keep which channel is largest, and the head is the identity, so the classifier reads the
    dominant colour of an image as that colour's label: its answers are known for painted images."""
    import torch
    from transformers import ConvNextConfig, ConvNextForImageClassification, ConvNextImageProcessor

    config = ConvNextConfig(num_stages=1, depths=[0], hidden_sizes=[3], patch_size=4, num_channels=3, num_labels=3,
                            id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    model = ConvNextForImageClassification(config).eval()
    with torch.no_grad():
        conv = model.convnext.embeddings.patch_embeddings
        conv.weight.zero_()
        for c in range(3):
            conv.weight[c, c] = 1 / 16
        conv.bias.zero_()
        model.classifier.weight.copy_(torch.eye(3))
        model.classifier.bias.zero_()
    model.save_pretrained(folder, safe_serialization=True)
    ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=1.0, image_mean=[0.5] * 3,
                           image_std=[0.5] * 3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory):
    return colour_classifier(tmp_path_factory.mktemp("cls") / "cls")


def painted(folder, colours, prompts=None, manifest=None):
    """A sample folder: image i a solid colour (24 x 32), its prompt beside it (a text run), a manifest."""
    folder.mkdir(parents=True)
    for i, c in enumerate(colours):
        Image.fromarray(np.full((24, 32, 3), COLOURS[c], np.uint8)).save(folder / f"{i:06d}.png")
        if prompts is not None:
            (folder / f"{i:06d}.txt").write_text(prompts[i], encoding="utf-8")
    if manifest is not None:
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def one_line(e) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------- PickScore

def test_pick_score_is_the_readme_formula_restated(pick_folder):
    """Kirstain et al. 2023 (the PickScore README's calc_probs before its softmax): logit_scale.exp() times the
    cosine of the projected, normalised image and text embeddings; per image, then the mean."""
    import torch
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

    rng = np.random.default_rng(0)
    pics = [rng.integers(0, 256, (int(rng.integers(24, 48)), 40, 3), dtype=np.uint8) for _ in range(5)]
    model = CLIPModel.from_pretrained(pick_folder, local_files_only=True, use_safetensors=True).eval()
    pixels = CLIPImageProcessorPil.from_pretrained(pick_folder)(images=pics, return_tensors="pt")
    tokens = AutoTokenizer.from_pretrained(pick_folder)(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        e_image = model.get_image_features(**pixels).pooler_output.double()
        e_text = model.get_text_features(**tokens).pooler_output.double()
    e_image, e_text = e_image / e_image.norm(dim=-1, keepdim=True), e_text / e_text.norm(dim=-1, keepdim=True)
    want = (model.logit_scale.exp().item() * (e_image * e_text).sum(-1)).tolist()

    got = pick_score.score(pick_score.load(pick_folder), pics, PROMPTS, batch_size=2)
    assert got["per_image"] == pytest.approx(want, abs=1e-4)
    assert got["pick_score"] == pytest.approx(np.mean(want), abs=1e-4)
    assert got["logit_scale"] == pytest.approx(100.0) and got["count"] == 5
    assert got["sha256"] and got["model"] == str(pick_folder)
    assert max(want) - min(want) > 1  # the images are told apart, so a wrong formula would show


def test_a_bad_pick_model_is_one_line_naming_the_key(pick_folder, tmp_path):
    with pytest.raises(UserError) as e:
        pick_score.check(tmp_path / "missing")
    assert "fid.pick_model" in one_line(e) and "PickScore_v1" in str(e.value)
    pickled = textmodels.pickled(tmp_path / "pickled", pick_folder)
    with pytest.raises(UserError) as e:
        pick_score.load(pickled)
    assert "only pickled weights" in one_line(e)
    samples = painted(tmp_path / "samples", ["red"])  # no prompt beside the image: not a text run's
    with pytest.raises(UserError) as e:
        pick_score.check(pick_folder, samples)
    assert "fid.pick_model" in one_line(e) and "000000.txt" in str(e.value)


# ---------------------------------------------------------------------------- class accuracy

def class_manifest(names, spec="balanced"):
    return {"format": "diffrelay-samples/2", "num_classes": len(names), "class_labels": spec, "class_names": names}


def test_class_accuracy_of_a_class_run(classifier_folder, tmp_path):
    # balanced: image i is class i mod 3 = red, green, blue, red; painted red, green, red, green: 2 of 4 right.
    samples = painted(tmp_path / "s", ["red", "green", "red", "green"],
                      manifest=class_manifest(["Red", "green", "BLUE"]))  # names match case-insensitively
    plan = class_accuracy.check(classifier_folder, samples)
    assert plan.targets == [0, 1, 2, 0]
    got = class_accuracy.score_folder(plan, class_accuracy.load(classifier_folder), batch_size=3)
    assert got["class_accuracy"] == 0.5 and got["correct"] == 2 and got["count"] == 4
    assert got["per_image"] == [0, 1, 0, 1] and len(got["sha256"]) == 64
    fixed = painted(tmp_path / "fixed", ["blue", "blue", "red"], manifest=class_manifest(["red", "green", "blue"], 2))
    plan = class_accuracy.check(classifier_folder, fixed)  # sample.class_labels 2: every image blue
    assert class_accuracy.score_folder(plan, class_accuracy.load(classifier_folder))["class_accuracy"] == 2 / 3


def test_class_accuracy_of_a_text_run_with_prompt_labels(classifier_folder, tmp_path):
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text("- {prompt: a crimson square, label: Red}\n"  # no label word: its label key
                       "- {prompt: a green dog, num_images: 2}\n"  # the one label word
                       "- a BLUE_sky\n")  # '_' reads as a space, case-insensitive
    texts = ["a crimson square", "a green dog", "a green dog", "a BLUE_sky"]
    samples = painted(tmp_path / "s", ["red", "blue", "green", "red"], texts)
    plan = class_accuracy.check(classifier_folder, samples, prompts)
    assert plan.targets == [0, 1, 1, 2]
    assert class_accuracy.score_folder(plan, class_accuracy.load(classifier_folder))["class_accuracy"] == 0.5
    # Held-out captions (no prompt file): their one label word; captions naming none or several are left out.
    held_out = painted(tmp_path / "h", ["red", "blue", "red", "red"],
                       ["a red circle", "a cat", "red and green", "green grass"])
    plan = class_accuracy.check(classifier_folder, held_out)
    assert (plan.targets, [p.name for p in plan.files], plan.left_out) == ([0, 1], ["000000.png", "000003.png"], 2)
    got = class_accuracy.score_folder(plan, class_accuracy.load(classifier_folder))
    assert (got["class_accuracy"], got["count"], got["left_out"]) == (0.5, 2, 2)
    none = painted(tmp_path / "n", ["red"], ["a cat"])
    with pytest.raises(UserError) as e:
        class_accuracy.check(classifier_folder, none)
    assert str(none) in one_line(e) and "label: keys" in str(e.value)


def test_prompts_without_one_label_are_one_line_naming_the_file(classifier_folder, tmp_path):
    for i, (entry, text, says) in enumerate([("a cat", "a cat", "none"), ("a red and blue cat", "a red and blue cat",
                                                                            "several"),
                                             ("{prompt: a cat, label: purple}", "a cat", "label 'purple'")]):
        prompts = tmp_path / f"p{i}.yaml"
        prompts.write_text(f"- {entry}\n")
        samples = painted(tmp_path / f"s{i}", ["red"], [text])
        with pytest.raises(UserError) as e:
            class_accuracy.check(classifier_folder, samples, prompts)
        assert str(prompts) in one_line(e) and says in str(e.value) and "label" in str(e.value)
    other = tmp_path / "other.yaml"
    other.write_text("- a red dog\n")
    with pytest.raises(UserError) as e:  # a folder sampled from another file
        class_accuracy.check(classifier_folder, tmp_path / "s0", other)
    assert "another prompt file" in one_line(e)


def test_a_class_without_a_label_is_refused_before_any_work(classifier_folder, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForImageClassification, "from_pretrained",
                        lambda *a, **k: pytest.fail("a model was loaded"))
    samples = painted(tmp_path / "s", ["red", "red"], manifest=class_manifest(["red", "cyan"]))
    with pytest.raises(UserError) as e:
        class_accuracy.check(classifier_folder, samples)
    assert "class 1 'cyan'" in one_line(e) and "fid.classifier" in str(e.value)
    bare = painted(tmp_path / "u", ["red"], manifest={"num_classes": 0, "class_labels": "balanced"})
    with pytest.raises(UserError) as e:
        class_accuracy.check(classifier_folder, bare)
    assert "unconditional" in one_line(e)


def test_a_bad_classifier_is_one_line(classifier_folder, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was opened"))
    samples = painted(tmp_path / "s", ["red"], manifest=class_manifest(["red", "green", "blue"]))

    def refused(folder, *fragments):
        with pytest.raises(UserError) as e:
            class_accuracy.check(folder, samples)
        assert str(folder) in one_line(e)
        for f in fragments:
            assert f in str(e.value), str(e.value)

    refused(tmp_path / "missing", "not found", "nothing is downloaded", "fid.classifier")
    refused(textmodels.pickled(tmp_path / "pickled", classifier_folder), "only pickled weights",
            "AutoModelForImageClassification")
    bare = tmp_path / "nolabels"
    bare.mkdir()
    config = json.loads((classifier_folder / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "id2label"}))
    refused(bare, "no id2label", "fid.classifier")
    noproc = tmp_path / "noproc"
    noproc.mkdir()
    for name in ("config.json", "model.safetensors"):
        (noproc / name).write_bytes((classifier_folder / name).read_bytes())
    refused(noproc, "no image processor")


def test_a_folder_whose_manifest_has_no_class_names_reads_them_from_its_snapshot(classifier_folder, tmp_path):
    """Sample folders made before manifests held class_names: the snapshot's header (metadata only) names them."""
    import torch

    from diffrelay.training import checkpoint

    snapshot = checkpoint.write_signed(tmp_path / "step.safetensors", {"w": torch.zeros(1)},
                                       {"format": checkpoint.SNAPSHOT_FORMAT, "class_names": ["red", "green", "blue"]})
    manifest = {k: v for k, v in class_manifest(["x", "y", "z"]).items() if k != "class_names"}
    samples = painted(tmp_path / "s", ["green", "green"], manifest={**manifest, "snapshot": str(snapshot)})
    assert class_accuracy.check(classifier_folder, samples).targets == [0, 1]
    snapshot.unlink()
    with pytest.raises(UserError) as e:
        class_accuracy.check(classifier_folder, samples)
    assert "snapshot" in one_line(e) and "sample the folder again" in str(e.value)


def test_a_prompt_files_label_is_a_name_and_changes_no_sampled_image(tmp_path):
    from diffrelay.data import prompts
    from diffrelay.sampling import prompted

    plain, labelled, bad = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    plain.write_text("- {prompt: a red dog, seed: 3}\n")
    labelled.write_text("- {prompt: a red dog, seed: 3, label: ' red '}\n")
    bad.write_text("- {prompt: a red dog, label: 3}\n")
    assert prompts.read(labelled)[0].label == "red" and prompts.read(plain)[0].label is None
    # the sample folder's key: a label added to a file resamples nothing
    assert prompted.fingerprint(prompted.items(plain, 0)) == prompted.fingerprint(prompted.items(labelled, 0))
    with pytest.raises(UserError) as e:
        prompts.read(bad)
    assert str(bad) in one_line(e) and "label 3 is not a name" in str(e.value)
