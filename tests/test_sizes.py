"""sample.sizes (issue 57): each image size its own sample folder, grid and report row; a prompt file's entry may give
its own width and height; sizes a network cannot take are refused in one line before any work; a pipeline samples
any size as its own __call__ does with height and width."""

import csv
import dataclasses
import json
import logging
import os

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from conftest import TINY
from diffrelay import cli, config, io, logs
from diffrelay.config import preflight
from diffrelay.data import prompts
from diffrelay.errors import UserError
from diffrelay.evaluation import extractor, features, fid, protocol
from diffrelay.sampling import sample, settings
from test_sample import make_snapshot
from test_workflow import job_counts, snakemake

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _quiet_logger():
    """cli.main binds a handler to the stream of the moment; drop it after each test."""
    yield
    logging.getLogger(logs.LOGGER).handlers.clear()


def one_line(fn) -> str:
    with pytest.raises(UserError) as e:
        fn()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def tiny(**over) -> dict:
    """TINY's sections (a pixel UNet halving once: sides of 2k) with `over` merged into them."""
    return {k: TINY.get(k, {}) | over.get(k, {}) for k in {*TINY, *over}}


def test_a_size_the_network_cannot_take_is_one_line_before_any_work(tmp_path):
    # A pixel UNet of 2 levels halves each side once; its deepest level needs 4 pixels.
    assert "sample.sizes=[24, 17]: each side must be a multiple of 2" in one_line(
        lambda: config.validate(tiny(sample={"sizes": [[24, 17]]}), "c.yaml"))
    assert "must be at least 8" in one_line(lambda: config.validate(tiny(sample={"sizes": [[16, 6]]}), "c.yaml"))
    # DiT's position table is made for the data.resolution square: that one size only.
    dit = tiny(model={"arch": "dit", "kwargs": {"size": "S", "patch": 4, "depth": 1}, "channels": 8},
               sample={"sizes": [[16, 16], [32, 16]]})
    assert "sample.sizes=[32, 16]: model.arch=dit has position tables for data.resolution=16" in one_line(
        lambda: config.validate(dit, "c.yaml"))
    config.validate(dit | {"sample": {"sizes": [[16, 16]]}})  # the square is the run's own size
    assert "fid.final.best: the second pass scores one image size" in one_line(lambda: config.validate(tiny(
        sample={"sizes": [[16, 16], [24, 16]]}, fid={"final": {"best": 1, "num_images": 16}}), "c.yaml"))
    # A latent run: the encoder's factor 8 times the network's 2 (preflight, as the VAE's factor needs its file).
    latent = config.Config(config.validate(tiny(data={"encoder": "sd-vae", "resolution": 64},
                                                sample={"sizes": [[64, 64], [72, 48]]})))
    assert "sample.sizes=[72, 48]: each side must be a multiple of 16 (the encoder's factor 8 x the network's " \
           "down-sampling 2); use e.g. [80, 48]" in one_line(lambda: preflight.check_sizes(latent, "c.yaml"))
    # A prompt entry's own size: both keys or neither, each in range; kohya's --w and --h in a .txt line.
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump([{"prompt": "a cat", "width": 24}]))
    assert "entry 1 (line 1): width without height; give both" in one_line(lambda: prompts.read(f))
    f.write_text(yaml.safe_dump([{"prompt": "a cat", "width": 24, "height": 4}]))
    assert "height 4 is out of range or not an integer; give the height in pixels" in one_line(lambda: prompts.read(f))
    (tmp_path / "p.txt").write_text("a cat --w 24 --h 16\n")
    assert (prompts.read(tmp_path / "p.txt")[0].width, prompts.read(tmp_path / "p.txt")[0].height) == (24, 16)
    # By hand: --size is checked against the snapshot's network before any folder is made.
    snap = make_snapshot(tmp_path / "step_0000040.safetensors")
    s = sample.default_settings(num_images=8, steps=2, batch_size=8, size=(24, 17))
    assert "--size 24x17 (sample.sizes) for" in one_line(lambda: sample.run(snap, tmp_path / "out", s))
    assert not (tmp_path / "out").exists()


def test_every_way_a_size_comes_in_has_the_same_bounds_in_one_line(tmp_path, capsys):
    """--size 100000x16 was accepted (cli checked only "at least 8") and sampled on for minutes, while sample.sizes
    and prompt files cap sides at 16384: one constant and one rule (data.prompts.SIDES) for every way in."""
    low, high = prompts.SIDES
    schema = config.load_schema()["properties"]
    item = schema["sample"]["properties"]["sizes"]["items"]["items"]
    assert (item["minimum"], item["maximum"]) == (low, high)
    assert schema["data"]["properties"]["resolution"]["minimum"] == low  # its maximum, 1024: training's own

    def parse_error(*argv) -> str:
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(list(argv))
        assert e.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    flags = ["sample", "--snapshot", "s", "--out", "o"]
    for size in ("100000x16", "16x16385", "7x16"):
        assert f"argument --size: '{size}': use WIDTHxHEIGHT in pixels, each side from 8 to 16384" in parse_error(
            *flags, "--size", size)
    assert "argument --resolution: '100000': use the image side in pixels, from 8 to 16384" in parse_error(
        *flags, "--resolution", "100000")
    assert "argument --best-size: '100000x16'" in parse_error("report", "--run-dir", "r", "--out", "o", "--best-size",
                                                               "100000x16")
    assert cli.build_parser().parse_args([*flags, "--size", "16384x8", "--resolution", "16384"]).size == (16384, 8)
    assert "sample.sizes.0.0=100000: must be at most 16384" in one_line(
        lambda: config.validate(tiny(sample={"sizes": [[100000, 16]]}), "c.yaml"))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump([{"prompt": "a cat", "width": 100000, "height": 16}]))
    assert "width 100000 is out of range or not an integer; give the width in pixels, an integer from 8 to 16384" \
        in one_line(lambda: prompts.read(tmp_path / "p.yaml"))
    (tmp_path / "p.txt").write_text("a cat --w 100000 --h 16\n")  # kohya's options
    assert "line 1: width 100000 is out of range" in one_line(lambda: prompts.read(tmp_path / "p.txt"))
    # sample.run given a size any other way (a caller of its own): the same rule, before any folder
    snap = make_snapshot(tmp_path / "step_0000040.safetensors")
    s = sample.default_settings(num_images=8, steps=2, batch_size=8, size=(100000, 16))
    assert "--size 100000x16 (sample.sizes) for" in one_line(lambda: sample.run(snap, tmp_path / "out", s))
    assert "100000 pixels: each side must be an integer from 8 to 16384" in one_line(
        lambda: sample.run(snap, tmp_path / "out", s))
    assert not (tmp_path / "out").exists() and not sample.work_dir(tmp_path / "out").exists()


def test_two_sizes_are_two_folders_of_their_shapes_grids_and_report_rows(tmp_path):
    run = tmp_path / "results" / "tiny"
    snap = make_snapshot(run / "snapshots" / "step_0000040.safetensors")
    sizes = [(24, 16), None]  # the first picks the best; None: the data.resolution square, as the workflow names it
    ext, made = extractor.build_random(tmp_path / "random.pt"), {}
    for size in sizes:
        name = f"step_0000040{protocol.variant(size=size)}"
        flags = ["--size", protocol.size_name(size)] if size else []  # as the workflow's jobs are called
        assert cli.main(["sample", "--snapshot", str(snap), "--out", str(run / "samples" / name), "--num-images", "8",
                         "--steps", "2", *flags]) == 0
        m = io.read_json(run / "samples" / name / "manifest.json")
        w, h = size or (16, 16)
        assert m["image_shape"] == [3, h, w] and "size" not in m  # the square's key is the one it always was
        made[size] = m
        assert {Image.open(p).size for p in (run / "samples" / name).glob("0*.png")} == {(w, h)}
        assert Image.open(run / "samples" / name / "grid.png").size[0] == 8 * w * -(-64 // w)
        if size is None:  # statistics of the square's own samples: a reference of the clean-fid kind
            feats = features.of_files(features.image_files(run / "samples" / name), [extractor.load(ext)], "clean",
                                      8, "cpu")[0]
            fid.save_ref(tmp_path / "ref.npz", *fid.statistics(feats), feats, {
                "format": fid.FORMAT, "mode": "clean", "metric": "FD", "extractor": ext.name,
                "extractor_sha256": io.sha256_file(ext), "num_images": 8, "num_features": 8, "feature_dim": 128})
    for size in sizes:  # clean-fid's resize makes every image 299 x 299, whatever its aspect ratio
        name = f"step_0000040{protocol.variant(size=size)}"
        io.write_json(run / "metrics" / "fid" / f"{name}.json",
                      fid.score_all(run / "samples" / name, [(ext, tmp_path / "ref.npz")], device="cpu"))
    # The pixels of a size do not depend on the batch size (every forward batch is padded to one shape).
    again = sample.run(snap, tmp_path / "again", sample.default_settings(num_images=8, steps=2, size=(24, 16),
                                                                         batch_size=3))
    assert again["files"]["000005.png"] == made[(24, 16)]["files"]["000005.png"]
    io.write_text(run / "metrics" / "train.jsonl", json.dumps({"step": 40, "loss": 0.5}) + "\n")
    assert cli.main(["report", "--run-dir", str(run), "--out", str(run / "report"), "--best-size", "24x16"]) == 0
    with open(run / "report" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["size"]) for r in rows] == [("40", "16x16"), ("40", "24x16")]
    assert float(rows[0]["fid"]) < 1e-6 < float(rows[1]["fid"])  # the square against its own statistics
    best = json.loads((run / "report" / "best.json").read_text())
    assert best["size"] == "24x16" and best["samples"].endswith("step_0000040_24x16")
    table = (run / "report" / "scores.md").read_text()
    assert "| step 40, 16x16 |" in table and "| step 40, 24x16 |" in table


def test_the_workflow_plans_each_size_as_its_own_sampling_and_scoring(tmp_path, write_config):
    snap = make_snapshot(tmp_path / "imported.safetensors", model={"num_blocks": 1})
    cfg = write_config({"sample": {"snapshot": str(snap), "sizes": [[24, 16], [16, 16]]}})
    p = snakemake(tmp_path, "-n", "--configfile", cfg)
    plan = job_counts(p.stdout)
    assert plan["sample_snapshot"] == plan["compute_fid"] == 2, plan
    assert p.stdout.count("--size 24x16") == 1 and "--size 16x16" not in p.stdout  # the square: its plain command
    assert "samples/step_0000040_24x16" in p.stdout and "metrics/fid/step_0000040.json" in p.stdout
    assert "diffrelay report" in p.stdout and "--best-size 24x16" in p.stdout


def test_a_pipeline_samples_other_sizes_as_its_call_with_height_and_width(tmp_path):
    """SDXL's time ids of the image's own size (original = target = (height, width), crop (0, 0)), its latents of
    (4, height / 2, width / 2) here: a folder at 24 x 16 with one entry of its own 16 x 32, against
    StableDiffusionXLPipeline.__call__(height=, width=). Both are scored: FD features in runs of one size, the CLIP
    score through CLIP's processor (short side resized, centre crop)."""
    import pipelines
    import textmodels
    from diffusers import StableDiffusionXLPipeline

    from diffrelay.evaluation import clip_score

    pipe_dir = pipelines.sdxl(tmp_path / "sdxl")
    entries = [{"prompt": "a red circle", "seed": 3}, {"prompt": "a blue square", "seed": 8, "width": 16, "height": 32}]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(entries))
    cfg, _ = config.sample_config(pipe_dir, None, 16, str(tmp_path / "p.yaml"))
    # An entry's size the pipeline cannot take (its VAE's factor 2 x its UNet's 2): one line when the config is read.
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump([{"prompt": "a", "width": 18, "height": 16}]))
    bad, _ = config.sample_config(pipe_dir, None, 16, str(tmp_path / "bad.yaml"))
    assert "bad.yaml: entry 1: width 18, height 16: each side must be a multiple of 4 (the encoder's factor 2" in \
        one_line(lambda: preflight.check_sizes(config.Config(bad), "c.yaml"))
    s = dataclasses.replace(settings.Settings.from_section(cfg["sample"]), guidance=4.0, steps=3, batch_size=2,
                            size=(24, 16))
    sample.run(pipe_dir, tmp_path / "ours", s, model_cfg=cfg["model"], data_cfg=cfg["data"],
               resources=cfg["run"]["resources"])
    pipe = StableDiffusionXLPipeline.from_pretrained(pipe_dir, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    ours = [np.asarray(Image.open(tmp_path / "ours" / f"{i:06d}.png")) for i in range(2)]
    for mine, e in zip(ours, entries):
        theirs = pipe(prompt=e["prompt"], generator=[torch.Generator().manual_seed(e["seed"])], num_inference_steps=3,
                      guidance_scale=4.0, height=e.get("height", 16), width=e.get("width", 24),
                      output_type="np").images[0]
        assert mine.shape == theirs.shape == (e.get("height", 16), e.get("width", 24), 3)
        diff = np.abs(mine.astype(int) - (theirs * 255).round().astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.002, (diff.max(), (diff > 0).mean())
    # Native views of two sizes (legacy_tensorflow mode) go through the extractor a size at a time.
    ext = extractor.load(extractor.build_random(tmp_path / "random.pt"))
    files = features.image_files(tmp_path / "ours")
    together = features.of_files(files, [ext], "legacy_tensorflow", 2, "cpu")[0]
    alone = np.concatenate([features.of_files([f], [ext], "legacy_tensorflow", 2, "cpu")[0] for f in files])
    assert np.array_equal(together, alone)
    clip = clip_score.load(textmodels.clip_model(tmp_path / "clip"))
    score = clip_score.score_folder(tmp_path / "ours", clip)
    each = [clip_score.score(clip, [a], [e["prompt"]])["clip_score"] for a, e in zip(ours, entries)]
    assert score["per_image"] == pytest.approx(each, abs=1e-5)
