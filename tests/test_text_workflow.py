"""A text-to-image run end to end on the CPU: captions in, prompts out, scored outside the training job.

prepare (captions, held-out split, embedding cache) -> train (2 segments, bitwise one run) -> sample prompts
(byte-identical for 1 and 2 processes) -> held-out FID and CLIP score -> report, with tiny encoders, a tiny
CLIP and a tiny diffusers UNet built from configs by the tests (nothing is downloaded).
"""

import collections
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import yaml

import textmodels
from conftest import BIN, REPO, deep_merge, run_cli

UNET = {"block_out_channels": [16, 32], "layers_per_block": 1, "attention_head_dim": 8, "norm_num_groups": 8,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"]}
PROMPTS = [{"prompt": "a red circle center", "num_images": 2},
           {"prompt": "a blue square top left", "negative_prompt": "a red square", "guidance": 2, "seed": 7},
           {"prompt": "green triangle, center"}]


def text_config(work: Path, name: str = "t2i", **over) -> dict:
    d = {"run": {"name": name, "results": str(work / "results"), "resources": str(work / "resources"),
                 "device": "cpu"},
         "data": {"kind": "shapes", "count": 48, "resolution": 16, "captions": "auto", "caption_dropout": 0.2,
                  "val_fraction": 0.1, "text_encoders": [{"path": str(work / "enc")}]},
         "model": {"arch": "diffusers-unet", "class_conditional": False, "kwargs": UNET},
         "train": {"total_steps": 4, "segment_steps": 2, "batch_size": 8, "log_every": 1, "warmup_steps": 1},
         "sample": {"steps": 2, "batch_size": 8, "guidance": [1, 2], "prompts": str(work / "prompts.yaml")},
         "fid": {"extractor": "random", "batch_size": 16, "clip_model": str(work / "clip"),
                 "metrics": ["fid", "clip_score"], "best_by": "clip_score"}}
    return deep_merge(d, over)


def write(work: Path, d: dict, name: str) -> Path:
    path = work / name
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """The whole workflow once; returns (folder, config path, snakemake output)."""
    work = tmp_path_factory.mktemp("text")
    textmodels.clip_text(work / "enc", hidden=32)
    textmodels.clip_model(work / "clip")
    (work / "prompts.yaml").write_text(yaml.safe_dump(PROMPTS, sort_keys=False))
    cfg = write(work, text_config(work), "config.yaml")
    p = run_cli("snakemake", "--snakefile", REPO / "Snakefile", "--directory", work, "--configfile", cfg,
                "--cores", "2", cwd=work, env=os.environ | {"PATH": f"{BIN}:{os.environ['PATH']}"}, timeout=900)
    return work, cfg, p.stdout + p.stderr


@pytest.mark.slow
def test_the_workflow_reports_the_held_out_fid_and_the_clip_score_of_every_checkpoint(text_run):
    work, _, _ = text_run
    run = work / "results" / "t2i"
    report = run / "report"
    for name in ("metrics.csv", "scores.md", "best.json", "best_grid.png", "fid.png"):
        assert (report / name).stat().st_size > 0, name
    assert "CLIP score ↑" in (report / "scores.md").read_text()
    rows = (report / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",")[-1] == "clip_score" and len(rows) == 1 + 2 * 2  # 2 steps x guidance 1 and 2
    assert all(r.split(",")[-1] for r in rows[1:])
    best = json.loads((report / "best.json").read_text())
    assert best["best_by"] == "clip_score"
    scores = [json.loads(p.read_text()) for p in sorted((run / "metrics" / "fid").glob("step_*.json"))]
    assert max(s["clip_score"]["clip_score"] for s in scores) == pytest.approx(best["clip_score"])
    sha = hashlib.sha256((work / "clip" / "model.safetensors").read_bytes()).hexdigest()
    assert {s["clip_score"]["sha256"] for s in scores} == {sha}
    # The validation FID: the reference statistics are the held-out images' (dataset/val), never trained on.
    ref_log = next((work / "logs" / "t2i" / "compute_reference").glob("*.log")).read_text()
    assert "reference statistics of its 5 held-out images (val/)" in ref_log
    assert {s["scores"][0]["num_ref"] for s in scores} == {5}
    info = json.loads((run / "dataset" / "dataset.json").read_text())
    val = json.loads((run / "dataset" / "val" / "dataset.json").read_text())
    assert info["count"] + val["count"] == 48 and val["count"] == 5
    # Every checkpoint samples the same prompts with the same seeds; each PNG has its prompt beside it.
    for folder in (run / "samples").glob("step_*"):
        texts = [p.read_text() for p in sorted(folder.glob("*.txt"))]
        assert texts == ["a red circle center"] * 2 + ["a blue square top left", "green triangle, center"], folder
        assert (folder / "grid.png").is_file()
    manifests = [json.loads(p.read_text()) for p in (run / "samples").glob("step_*/manifest.json")]
    assert len({m["prompts"] for m in manifests}) == 1 and len(manifests) == 4


@pytest.mark.slow
def test_two_segments_train_the_weights_of_one_and_the_snapshot_records_its_encoders(text_run, tmp_path):
    import torch
    from diffrelay.training import checkpoint

    work, _, _ = text_run
    one = write(work, text_config(work, name="t2i-one", train={"segment_steps": 4}), "one.yaml")
    run_cli("prepare", "--config", one)
    run_cli("train", "--config", one, "--until-step", "4")
    a, meta = checkpoint.load_checkpoint(work / "results" / "t2i" / "checkpoints" / "step_0000004")
    b, _ = checkpoint.load_checkpoint(work / "results" / "t2i-one" / "checkpoints" / "step_0000004")
    assert set(a["net"]) == set(b["net"])
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])
    enc = meta["text"]["encoders"][0]
    weights = work / "enc" / "model.safetensors"
    assert enc["class"] == "CLIPTextModel" and enc["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert meta["text"]["dims"] == {"states": 32, "length": 77, "pooled": 0}


@pytest.mark.slow
def test_prompt_samples_are_byte_identical_for_one_and_two_processes(text_run, tmp_path):
    """The workflow's one process (batches of 8) against two processes with batches of 1."""
    work, cfg, _ = text_run
    snap = work / "results" / "t2i" / "snapshots" / "step_0000004.safetensors"
    one = work / "results" / "t2i" / "samples" / "step_0000004_g2"
    m = json.loads((one / "manifest.json").read_text())
    assert (m["nproc"], m["batch_size"], m["guidance"], m["steps"]) == (1, 8, 2, 2), m
    run_cli("torchrun", "--standalone", "--nproc-per-node", "2", "-m", "diffrelay", "sample", "--config", cfg,
            "--snapshot", snap, "--steps", "2", "--guidance", "2", "--out", tmp_path / "two", "--batch-size", "1")
    names = sorted(p.name for p in one.iterdir() if p.suffix in (".png", ".txt") and p.stem.isdigit())
    assert len(names) == 8
    for name in names:
        assert (one / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


@pytest.mark.slow
def test_bad_text_inputs_are_one_line_each(text_run, tmp_path):
    work, cfg, _ = text_run
    snap = work / "results" / "t2i" / "snapshots" / "step_0000002.safetensors"

    def refused(*args, match):
        p = run_cli(*args, check=False)
        lines = p.stderr.strip().splitlines()
        assert p.returncode != 0 and len(lines) == 1 and re.search(match, lines[0]), p.stderr

    # A negative prompt in a run whose every guidance scale is 1 (refused with the config), an unknown key.
    (tmp_path / "neg.txt").write_text("a red circle --n a blue square\n")
    neg = write(tmp_path, text_config(work, sample={"prompts": str(tmp_path / "neg.txt"), "guidance": 1}), "neg.yaml")
    refused("validate", "--config", neg, match=r"neg\.txt: prompt 1 has a negative prompt, and sample.guidance is 1")
    (tmp_path / "bad.yaml").write_text("- {prompt: a red circle, cfg_scale: 3}\n")
    refused("sample", "--config", cfg, "--snapshot", snap, "--out", tmp_path / "s2", "--prompts", tmp_path / "bad.yaml",
            "--guidance", "1", match=r"bad\.yaml.*cfg_scale")
    # A snapshot sampled with other text encoders than it was trained with.
    textmodels.clip_text(tmp_path / "other", hidden=32, seed=1)
    other = write(tmp_path, text_config(work, data={"text_encoders": [{"path": str(tmp_path / "other")}]}), "o.yaml")
    refused("sample", "--config", other, "--snapshot", snap, "--out", tmp_path / "s3", "--guidance", "2",
            match="trained with the text encoder of sha256")
    # Training on a cache made by other encoders.
    refused("train", "--config", other, "--until-step", "2", match="encoded by other text encoders")
    # A prompt file edited after the workflow planned the job.
    refused("sample", "--config", cfg, "--snapshot", snap, "--out", tmp_path / "s4", "--guidance", "1",
            "--prompts", work / "prompts.yaml", "--prompts-sha256", "0" * 64, match="changed since the workflow planned")
    # Prompts for a config without captions, at validation.
    plain = write(tmp_path, {"sample": {"prompts": str(work / "prompts.yaml")}}, "plain.yaml")
    refused("validate", "--config", plain, match="sample.prompts: prompts are for text runs")


def test_the_text_demo_config_plans_its_segments(tmp_path):
    """config/examples/text-shapes.yaml (make demo-text) as shipped: its encoder written by `diffrelay demo-encoder`,
    its prompt file where the config names it, relative to the working folder."""
    (tmp_path / "config" / "examples").mkdir(parents=True)
    prompts = REPO / "config" / "examples" / "shapes-prompts.txt"
    (tmp_path / "config" / "examples" / prompts.name).write_text(prompts.read_text())
    run_cli("demo-encoder", "--out", tmp_path / "resources" / "text" / "demo-clip")
    p = run_cli("snakemake", "--snakefile", REPO / "Snakefile", "--directory", tmp_path, "-n", "--configfile",
                REPO / "config" / "config.yaml", REPO / "config" / "examples" / "text-shapes.yaml", cwd=tmp_path)
    assert re.search(r"^train_segment\s+3$", p.stdout, re.M), p.stdout


@pytest.mark.slow
def test_each_prompt_file_and_the_held_out_captions_are_their_own_evaluations_and_report_rows(text_run, tmp_path):
    """sample.prompts as a list: every checkpoint samples and scores each file in its own jobs (_p<k> for the
    files after the first), and with sample.held_out_captions one image per held-out caption too (_ph, the held-out
    FID's images, which then pick the best checkpoint); the trained run is not touched, and the first file's
    evaluations are not redone."""
    from diffrelay.evaluation import protocol

    work, _, _ = text_run
    run = work / "results" / "t2i"
    second = tmp_path / "more.txt"
    second.write_text("a green square center\na red triangle center\n")  # FID needs 2 images or more
    before = {p.name: p.stat().st_mtime_ns for p in (run / "metrics" / "fid").glob("*.json")}
    # Guidance 2 only (the run's second scale): the second file and the held-out captions at both checkpoints.
    d = text_config(work, sample={"prompts": [str(work / "prompts.yaml"), str(second)], "held_out_captions": True,
                                  "guidance": 2})
    cfg = write(tmp_path, d, "two.yaml")
    p = run_cli("snakemake", "--snakefile", REPO / "Snakefile", "--directory", work, "--configfile", cfg,
                "--cores", "2", cwd=work, env=os.environ | {"PATH": f"{BIN}:{os.environ['PATH']}"}, timeout=900)
    ran = collections.Counter(re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", p.stdout + p.stderr))
    assert ran["train_segment"] == 0 and ran["sample_snapshot"] == 4 and ran["compute_fid"] == 4, ran
    assert {p.name: p.stat().st_mtime_ns for p in (run / "metrics" / "fid").glob("*.json") if p.name in before} == before
    for name in ("step_0000002_g2_p1", "step_0000004_g2_p1"):
        assert [t.read_text() for t in sorted((run / "samples" / name).glob("*.txt"))] == ["a green square center", "a red triangle center"]
    assert (run / "report" / "metrics.csv").read_text().splitlines()[0].endswith("clip_score,prompts")
    assert "| step 4, prompt file 2 | 2 |" in (run / "report" / "scores.md").read_text()
    held = json.loads((work / "results/t2i/dataset/val/captions.json").read_text())
    want = [held["texts"][row[0]] for row in held["rows"]]
    assert [t.read_text() for t in sorted((run / "samples" / "step_0000004_g2_ph").glob("*.txt"))] == want
    assert "| step 4, held-out captions |" in (run / "report" / "scores.md").read_text()
    assert json.loads((run / "report" / "best.json").read_text())["samples"].endswith("_ph")
    assert (run / "samples" / "step_0000002_g2_ph").is_dir()
    for m in (run / "samples").glob("step_*/manifest.json"):  # prompts, not classes, made these images
        assert "class_labels" not in json.loads(m.read_text()) and json.loads(m.read_text())["prompts"], m
    assert protocol.parse_variant("_g2_s1_p1") == (None, 2.0, 1) and protocol.variant_prompts("_g2_s1_p1") == 1
    assert protocol.variant(None, 2.0, 1, prompts=1) == "_g2_s1_p1" and protocol.variant_prompts("") == 0
    assert protocol.variant(None, 2.0, 0, prompts=protocol.HELD_OUT) == "_g2_ph"
    assert protocol.variant_prompts("_g2_ph") == protocol.HELD_OUT


@pytest.mark.slow
def test_encoding_in_the_step_trains_the_weights_of_the_cache(text_run):
    """data.text_cache: false (encoders whose cache would not fit): the training step encodes its captions, and
    since an embedding does not depend on its batch, the weights are bit for bit those of the cached run."""
    import torch
    from diffrelay.training import checkpoint

    work, _, _ = text_run
    live = write(work, text_config(work, name="t2i-live", data={"text_cache": False}), "live.yaml")
    run_cli("prepare", "--config", live)
    assert not (work / "results" / "t2i-live" / "dataset" / "text_states.npy").exists()
    run_cli("train", "--config", live, "--until-step", "2")
    a, _ = checkpoint.load_checkpoint(work / "results" / "t2i" / "checkpoints" / "step_0000002")
    b, _ = checkpoint.load_checkpoint(work / "results" / "t2i-live" / "checkpoints" / "step_0000002")
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])
    # Tag dropout (data/tags.py) goes through the same step: its captions, encoded there, train other weights.
    tagged = write(work, text_config(work, name="t2i-tags", data={"text_cache": False, "caption_tag_dropout": 0.5}),
                   "tags.yaml")
    run_cli("train", "--config", tagged, "--dataset", work / "results" / "t2i-live" / "dataset", "--until-step", "2")
    c, _ = checkpoint.load_checkpoint(work / "results" / "t2i-tags" / "checkpoints" / "step_0000002")
    assert not all(torch.equal(a["net"][k], c["net"][k]) for k in a["net"])


@pytest.mark.slow
def test_validate_prints_a_text_networks_flops_and_its_cache_size(text_run):
    work, cfg, _ = text_run
    out = run_cli("validate", "--config", cfg).stdout
    assert re.search(r"# network: diffusers-unet .* GFLOPs per forward", out), out.splitlines()[-2]
    assert re.search(r"# text: 1 encoder\(s\), .* MiB a caption in float32, \d+ captions: .*; cached by prepare", out)


@pytest.mark.slow
def test_a_damaged_text_sample_is_remade_with_its_prompt(text_run, tmp_path):
    """A finished text folder with one PNG gone: only that image is made again, every prompt sidecar is kept, and
    the manifest lists the sidecars (a damaged one is found like a damaged PNG)."""
    work, cfg, _ = text_run
    snap = work / "results" / "t2i" / "snapshots" / "step_0000004.safetensors"
    args = ["sample", "--config", cfg, "--snapshot", snap, "--out", tmp_path / "out", "--guidance", "1"]
    run_cli(*args)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {"000000.txt", "000003.txt"} <= set(manifest["files"])
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").glob("[0-9]*")}
    (tmp_path / "out" / "000001.png").unlink()
    (tmp_path / "out" / "000002.txt").write_text("damaged")
    p = run_cli(*args)
    assert "2 file(s) differ from manifest.json" in p.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").glob("[0-9]*")} == before
