"""The fine-tuning recipes (config/examples/sdxl-lora.yaml, flux-dev-lora.yaml and hunyuandit-finetune.yaml;
sd3-lora.yaml and sd35-large-lora.yaml to their run's config,
docs/recipes.md) through the whole workflow, shrunk as the papers' recipes are (test_recipes.py): the tiny pipelines
of tests/pipelines.py in place of the real ones, a tiny captioned folder, the tests' CLIP and random features, sizes,
steps and the machine. Every other
value is the recipe's own, and the test checks that it reached the run. Nothing is downloaded."""

import csv
import json
import math
import os

import pytest
import torch
import yaml

import pipelines
import textmodels
from conftest import REPO, deep_merge
from test_adm_scores import pictures, save_folder
from test_workflow import snakemake

from diffrelay import config

CAPTIONS = ["a red circle", "a blue square", "a green triangle", "a yellow star"]


def leaves(d: dict, prefix: str = "") -> dict:
    """{"a.b.c": value} of a nested dict's leaves."""
    return {k2: v2 for k, v in d.items()
            for k2, v2 in (leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v}).items()}


def shrink(d: dict, tmp, pipe: str = "sdxl", steps: int = 2, baseline: bool = False) -> dict:
    """The overrides that make a fine-tuning recipe run here: local files, sizes and machine only; `steps`
    segments of one step (the SDXL recipe's two check the adapter-only checkpoints across a segment boundary in the
    workflow; one keeps the others' time down)."""
    return {"run": {"name": "shrunk", "device": "cpu", "gpus": None, "eval_gpus": None,
                    "results": str(tmp / "results"), "resources": str(tmp / "resources")},
            "data": {"resolution": 16, "workers": 1, "path": str(tmp / "images")},
            "model": {"pretrained": str(tmp / pipe)},
            "train": {"total_steps": steps, "segment_steps": 1, "batch_size": 4, "nproc_per_node": 1, "nnodes": 1,
                      "threads": 1, "recovery_every": 0, "log_every": 1},
            # sample.baseline (step 0, on for a pipeline): one recipe's test evaluates it, the others save the time
            "sample": {"steps": 2, "batch_size": 4, "nproc": 1, "threads": 1, "prompts": str(tmp / "prompts.yaml"),
                       "baseline": baseline},
            # The tests' scorers: random features (offline) and the tiny CLIP.
            "fid": {"extractor": "random", "clip_model": str(tmp / "clip"), "batch_size": 8, "threads": 1}}


# recipe: (tests/pipelines.py's builder, the diffusers pipeline class that loads the adapter)
LORA_RECIPES = {"sdxl-lora": ("sdxl", "StableDiffusionXLPipeline", 2), "flux-dev-lora": ("flux", "FluxPipeline", 1)}
# Recipes whose pipeline class another test runs through the workflow and every step of (test_pretrained_families.py
# trains, samples and exports SD3 and SD3.5 transformers): their files are checked to reach the run's config.
CONFIG_RECIPES = {"sd3-lora": "sd3", "sd35-large-lora": "sd35"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(LORA_RECIPES))
def test_lora_recipe_runs_through_the_workflow_shrunk_and_diffusers_loads_its_adapter(tmp_path, recipe):
    import diffusers

    family, cls, steps = LORA_RECIPES[recipe]
    files = [REPO / "config" / "config.yaml", REPO / "config" / "examples" / f"{recipe}.yaml"]
    base, d = (yaml.safe_load(f.read_text()) for f in files)
    assert d["train"]["lora"]["rank"] == 4 and d["model"]["pretrained"]
    getattr(pipelines, family)(tmp_path / family)
    textmodels.clip_model(tmp_path / "clip")
    images = save_folder(pictures(40, side=32), tmp_path / "images")
    with open(images / "metadata.jsonl", "w") as f:  # Hugging Face imagefolder captions, the recipe's "text"
        for i in range(40):
            f.write(json.dumps({"file_name": f"{i:06d}.png", "text": CAPTIONS[i % 4]}) + "\n")
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump([{"prompt": "a red circle", "num_images": 2},
                                                           {"prompt": "a blue square", "num_images": 2}]))
    over = shrink(d, tmp_path, family, steps, baseline=family == "sdxl")
    if family != "sdxl":  # the SDXL recipe's run checks val_loss in the workflow; the others save its jobs' time
        over["fid"]["metrics"] = ["fid", "clip_score"]
    (tmp_path / "shrink.yaml").write_text(yaml.safe_dump(over))
    snakemake(tmp_path, "--configfile", *files, tmp_path / "shrink.yaml")

    run = tmp_path / "results" / "shrunk"
    last = f"step_{steps:07d}"
    made = json.loads((run / "checkpoints" / last / "meta.json").read_text())["config"]
    # The run used exactly the merged files, filled from the pipeline folder; every key the recipe sets and the
    # shrinking does not reached the run with the recipe's value.
    assert made == json.loads(json.dumps(config.validate(deep_merge(deep_merge(base, d), over))))
    kept = {k: v for k, v in leaves(d).items() if k not in leaves(over)}
    assert {k: leaves(made)[k] for k in kept} == kept
    assert made["model"]["pretrained"]["path"] == str(tmp_path / family)
    table = list(csv.DictReader((run / "report" / "metrics.csv").open()))
    first = 0 if family == "sdxl" else 1  # sample.baseline: step 0, the pipeline before any update
    assert [int(r["step"]) for r in table] == list(range(first, steps + 1)), table  # one row a step
    assert all(r["clip_score"] for r in table)
    if family != "sdxl":
        assert "val_loss" not in table[0] and not (run / "metrics" / "val_loss").exists()
    else:  # val_loss (the recipe's fid.metrics): the held-out images' loss at every snapshot, by its own job; the
        # LoRA starts as a no-op, so step 0's is the pipeline's, and each trained step moves it.
        held = [json.loads((run / "metrics" / "val_loss" / f"step_{s:07d}.json").read_text())
                for s in range(first, steps + 1)]
        losses = [h["val_loss"] for h in held]
        assert all(math.isfinite(v) and v > 0 for v in losses) and len(set(losses)) == len(losses), losses
        assert [float(r["val_loss"]) for r in table] == pytest.approx(losses, rel=1e-5)
        assert {h["count"] for h in held} == {2} and [h["step"] for h in held] == list(range(first, steps + 1))
    best = json.loads((run / "report" / "best.json").read_text())
    assert best["best_by"] == "clip_score"
    # The last snapshot's adapter (the raw one, which the recipe samples) in diffusers' format:
    # the pipeline class's load_lora_weights reads it and leaves the base as it was.
    pipe = getattr(diffusers, cls).from_pretrained(tmp_path / family, local_files_only=True, use_safetensors=True)
    net = pipe.unet if family == "sdxl" else pipe.transformer
    before = {k: v.clone() for k, v in net.state_dict().items()}
    pipe.load_lora_weights(run / "lora" / last)  # the folder's default file: the weights sample.weights scores
    after = net.state_dict()
    assert any("lora" in k for k in after) and all(torch.equal(before[k], after[k]) for k in before if k in after)
    if family == "flux":  # the script's twelve projections: the text stream's and the feed-forwards too
        assert made["model"]["kwargs"]["guidance"] == 1.0 and made["sample"]["guidance"] == [3.5]
        assert any("add_k_proj.lora_A" in k for k in after) and any("ff_context.net.2.lora_B" in k for k in after)
    assert sorted(os.listdir(run / "lora")) == [f"step_{k:07d}" for k in range(first, steps + 1)]  # step 0's: B = 0


@pytest.mark.parametrize("recipe", list(CONFIG_RECIPES))
def test_sd3_recipes_reach_the_runs_config_over_a_pipeline_of_their_class(tmp_path, recipe):
    files = [REPO / "config" / "config.yaml", REPO / "config" / "examples" / f"{recipe}.yaml"]
    base, d = (yaml.safe_load(f.read_text()) for f in files)
    assert d["train"]["lora"]["rank"] == 4 and d["model"]["pretrained"]
    getattr(pipelines, CONFIG_RECIPES[recipe])(tmp_path / "pipe")
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump([{"prompt": "a red circle"}]))
    over = shrink(d, tmp_path, "pipe", 1)
    made = config.validate(deep_merge(deep_merge(base, d), over))
    kept = {k: v for k, v in leaves(d).items() if k not in leaves(over)}
    assert {k: leaves(made)[k] for k in kept} == kept
    assert (made["model"]["arch"], made["train"]["flow"]["shift"], made["train"]["lora"]["target_modules"][0]) == (
        "sd3", 3.0, "attn.add_k_proj")


@pytest.mark.slow
def test_hunyuandit_finetune_recipe_runs_through_the_workflow_shrunk(tmp_path):
    from safetensors.torch import load_file

    files = [REPO / "config" / "config.yaml", REPO / "config" / "examples" / "hunyuandit-finetune.yaml"]
    base, d = (yaml.safe_load(f.read_text()) for f in files)
    assert d["train"].get("lora") is None and d["model"]["pretrained"]
    pipelines.hunyuandit(tmp_path / "hunyuandit")
    textmodels.clip_model(tmp_path / "clip")
    images = save_folder(pictures(40, side=32), tmp_path / "images")
    with open(images / "metadata.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"file_name": f"{i:06d}.png", "text": CAPTIONS[i % 4]}) + "\n")
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump([{"prompt": "a red circle", "num_images": 2},
                                                           {"prompt": "a blue square", "num_images": 2}]))
    over = shrink(d, tmp_path, "hunyuandit", steps=1)
    (tmp_path / "shrink.yaml").write_text(yaml.safe_dump(over))
    snakemake(tmp_path, "--configfile", *files, tmp_path / "shrink.yaml")

    run = tmp_path / "results" / "shrunk"
    made = json.loads((run / "checkpoints" / "step_0000001" / "meta.json").read_text())["config"]
    assert made == json.loads(json.dumps(config.validate(deep_merge(deep_merge(base, d), over))))
    kept = {k: v for k, v in leaves(d).items() if k not in leaves(over)}
    assert {k: leaves(made)[k] for k in kept} == kept
    assert made["model"]["arch"] == "hunyuandit" and made["model"]["ddpm"]["beta_end"] == 0.03
    rows = (run / "report" / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",")[-1] == "clip_score" and len(rows) == 1 + 1, rows
    # A full fine-tune: every snapshot holds the whole transformer under diffusers' names.
    snap = load_file(run / "snapshots" / "step_0000001.safetensors")
    want = load_file(tmp_path / "hunyuandit" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert len(snap) >= len(want)
