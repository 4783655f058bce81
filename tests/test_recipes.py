"""The papers' recipes (config/examples/<paper>-*.yaml, docs/recipes.md): each validates with the paper's
parameter count, and each runs here through the whole workflow, shrunk. The shrinking overrides sizes only: the
network's width and depth, the image side, step and image counts, the machine (CPU, one process, one thread) and
the tests' small VAE and extractors in place of the real ones. Every other value is the recipe's own, and the test
checks that it reached the run, so a recipe that cannot run fails here and not on a user's cluster."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import deep_merge, run_cli, small_inception
from test_adm_scores import adm_batch, own_heads, pictures, save_folder
from test_dinov2 import TINY as TINY_VIT
from test_dinov2 import official_state
from test_latents import tiny_vae

from diffrelay import config
from diffrelay.evaluation import dinov2

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "config" / "examples"
PAPERS = ("edm-", "edm2-", "dit-", "sit-")  # a recipe named after a paper is one of these
RECIPES = ["edm-cifar10-ddpmpp-cond", "dit-xl2-imagenet256", "sit-xl2-imagenet256", "edm2-xs-imagenet512"]
# The papers' parameter counts, in millions, rounded as they print them: EDM's DDPM++ (conditional CIFAR-10,
# 9 augmentation labels), DiT-XL/2 and SiT-XL/2 (DiT's Table 4 / SiT's Table 1), edm2-XS (edm2's Table 2).
PAPER_MPARAMS = {"edm-cifar10-ddpmpp-cond": 55.7, "dit-xl2-imagenet256": 675, "sit-xl2-imagenet256": 675,
                 "edm2-xs-imagenet512": 125}
# Width and depth only, per network (model.kwargs keys; everything else in model.kwargs stays the recipe's).
SIZES = {
    "ddpmpp": {"model_channels": 16, "channel_mult": [1, 2], "num_blocks": 1, "attn_resolutions": [16]},
    "edm2": {"model_channels": 16, "channel_mult": [1, 2], "num_blocks": 1, "attn_resolutions": [8],
             "channels_per_head": 8},
    "dit": {"depth": 2, "hidden_size": 32, "num_heads": 2},
    "sit": {"depth": 2, "hidden_size": 32, "num_heads": 2},
}


def recipe(name: str) -> dict:
    return config.load([REPO / "config" / "config.yaml", EXAMPLES / f"{name}.yaml"]).to_dict()


def test_every_recipe_named_after_a_paper_is_checked_here():
    named = sorted(p.stem for p in EXAMPLES.glob("*.yaml") if p.stem.startswith(PAPERS))
    assert named == sorted(RECIPES)


CLASSES = {"cifar10": 10, "imagenet": 1000}  # the class folders a recipe's data.path holds


@pytest.mark.parametrize("name", RECIPES)
def test_validate_prints_the_papers_parameter_count(name, tmp_path):
    d = recipe(name)
    classes = next(n for key, n in CLASSES.items() if key in d["data"]["path"])
    for k in range(classes):  # the dataset's class folders, where the recipe expects them
        (tmp_path / d["data"]["path"] / f"n{k:08d}").mkdir(parents=True)
    save_folder(pictures(4, side=32), tmp_path / d["data"]["path"] / "n00000000")  # precision/recall need k + 1 = 4
    if isinstance(d["fid"]["reference"], str):  # checked when the config is read; its numbers do not matter here
        ref = tmp_path / d["fid"]["reference"]
        ref.parent.mkdir(parents=True, exist_ok=True)
        side, adm = d["data"]["resolution"], set(d["fid"]["metrics"] or ["fid"]) - {"fid", "fd_dinov2"}
        arrays = {"mu": np.zeros(2048, np.float32), "sigma": np.eye(2048, dtype=np.float32)}
        if adm:  # an ADM batch: the pictures and the spatial statistics too
            # 4 images: precision/recall need more than their k = 3 neighbours, and validate counts them.
            arrays |= {"arr_0": np.zeros((4, side, side, 3), np.uint8), "mu_s": np.zeros(2023, np.float32),
                       "sigma_s": np.eye(2023, dtype=np.float32)}
        np.savez(ref, **arrays)
    p = run_cli("validate", "--config", REPO / "config" / "config.yaml", "--config", EXAMPLES / f"{name}.yaml",
                cwd=tmp_path)
    line = next(ln for ln in p.stdout.splitlines() if " parameters (" in ln)
    count = int(re.search(r"([\d,]+) parameters", line).group(1).replace(",", "")) / 1e6
    paper = PAPER_MPARAMS[name]
    assert round(count, 1 if paper < 100 else 0) == paper, line


def shrink(d: dict, tmp: Path) -> dict:
    """The overrides that make recipe `d` run here: sizes, machine and local files only."""
    arch, latent = d["model"]["arch"], d["data"]["encoder"] != "none"
    side = 32  # latents of 16 x 16 from the tests' VAE (which halves); CIFAR-10's own side
    over = {"run": {"name": "shrunk", "device": "cpu", "gpus": None, "eval_gpus": None,
                    "results": str(tmp / "results"), "resources": str(tmp / "resources")},
            "data": {"resolution": side, "workers": 1},
            "model": {"kwargs": SIZES[arch]},
            # 8 steps: edm2's post-hoc widths are rebuilt within 15 % from 8 stored profiles, not from 2.
            "train": {"total_steps": 8, "segment_steps": 8, "batch_size": 4, "grad_accum": 1, "nproc_per_node": 1, "nnodes": 1,
                      "threads": 1, "recovery_every": 0, "log_every": 1},
            # 4 solver steps, not the papers' 18-250: the solver, guidance and their settings stay the recipe's.
            "sample": {"num_images": 6, "batch_size": 6, "steps": 4, "nproc": 1, "threads": 1},
            "fid": {"batch_size": 6, "threads": 1, "final": {"num_images": 6}}}
    if latent:
        over["data"]["encoder_path"] = str(tiny_vae(tmp / "vae"))
    if d["train"]["phema"]["every"]:
        over["train"]["phema"] = {"every": 1}
    # Each evaluation here costs a 2048-dimensional sqrtm (about 18 s on one core). One seed set and one post-hoc
    # width take every path of the recipe's evaluation but the min over seed sets, which test_workflow's
    # test_seed_sets_two_extractors_and_a_second_pass_run_end_to_end runs on its own.
    if d["sample"]["seed_sets"] > 1:
        over["sample"]["seed_sets"] = 1
    if len(d["sample"]["phema"]) > 1:
        over["sample"]["phema"] = d["sample"]["phema"][:1]
    if d["fid"]["ref_images"]:
        over["fid"]["ref_images"] = 16
    return over


def changed_keys(a, b, prefix="") -> set:
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(changed_keys(a.get(k), b.get(k), f"{prefix}{k}.") for k in set(a) | set(b)))
    return set() if a == b else {prefix.rstrip(".")}


def local_files(d: dict, tmp: Path, inception: Path) -> None:
    """The extractors and reference files the recipe names, made small: the tests' Inception and DINOv2, an
    ADM-format batch or a mu/sigma file of the Inception features of other pictures, at the recipe's path."""
    extractors = tmp / "resources" / "extractors"
    extractors.mkdir(parents=True)
    shutil.copy(inception, extractors / "inception-2015-12-05.pt")
    names = d["fid"]["extractors"] or [d["fid"]["extractor"]]
    if "dinov2" in names:
        mp = pytest.MonkeyPatch()
        mp.setitem(dinov2.MODELS, "tiny", TINY_VIT)
        torch.save(official_state(TINY_VIT), tmp / "tiny.pth")
        dinov2.fetch("tiny", extractors / "dinov2-vitl14.pt", weights=tmp / "tiny.pth")
        mp.undo()
    ref = d["fid"]["reference"]
    if isinstance(ref, str):
        path = tmp / ref
        path.parent.mkdir(parents=True, exist_ok=True)
        others = pictures(40, side=32, seed=3)
        if d["fid"]["metrics"] and set(d["fid"]["metrics"]) - {"fid"}:
            adm_batch(inception, path, others, d["fid"]["mode"])
        else:
            pool = own_heads(inception, others, d["fid"]["mode"])["pool"]
            np.savez(path, mu=pool.mean(0), sigma=np.cov(pool, rowvar=False))


@pytest.fixture(scope="module")
def inception(tmp_path_factory) -> Path:
    return small_inception(tmp_path_factory.mktemp("inception") / "inception-2015-12-05.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_runs_through_the_workflow_shrunk(name, tmp_path, inception):
    from test_workflow import snakemake

    d = recipe(name)
    over = shrink(d, tmp_path)
    (tmp_path / "shrink.yaml").write_text(yaml.safe_dump(over))
    if d["data"]["kind"] == "folder":  # two classes of pictures where the recipe expects its images
        for k in range(2):
            save_folder(pictures(8, side=32, seed=k), tmp_path / d["data"]["path"] / f"class{k}")
    local_files(d, tmp_path, inception)
    snakemake(tmp_path, "--configfile", REPO / "config" / "config.yaml", EXAMPLES / f"{name}.yaml",
              tmp_path / "shrink.yaml")

    run = tmp_path / "results" / "shrunk"
    made = json.loads((run / "checkpoints" / "step_0000008" / "meta.json").read_text())["config"]
    wanted = deep_merge(d, over)
    # Only the shrinking keys differ from the recipe, and the run used exactly the merged values.
    assert changed_keys(d, made) <= changed_keys(d, wanted)
    assert changed_keys(wanted, made) == set()
    scores = sorted((run / "metrics" / "fid").glob("*.json"))
    assert scores, f"no scores in {run}"
    result = json.loads(scores[-1].read_text())
    if d["fid"]["metrics"]:
        assert set(result["scores"][0]["labels"]) == set(d["fid"]["metrics"]) - {"fd_dinov2"}
    assert (run / "report" / "scores.md").is_file()
    if isinstance(d["fid"]["reference"], str) and set(d["fid"]["metrics"] or []) - {"fid"}:
        # ADM's five numbers against an ADM reference batch the test built, through the workflow, with the npz
        # export and scores.md (test_adm_scores.py's workflow run of the tiny config asserted these same things).
        n, ref = over["sample"]["num_images"], Path(d["fid"]["reference"]).name
        assert result["scores"][0]["protocol"] == "adm" and result["num_images"] == n
        with np.load(run / "samples" / scores[-1].stem / "samples.npz") as z:
            assert z["arr_0"].shape == (n, 32, 32, 3)
        table = (run / "report" / "scores.md").read_text()
        assert f"| FID-{n} ↓ | sFID-{n} ↓ | IS-{n} ↑ | Precision-{n} ↑ | Recall-{n} ↑ |" in table
        assert (f"| step 8 | {d['sample']['guidance']:g} | {result['fid']:.2f} | {result['sfid']:.2f} | "
                f"{result['is']:.2f} |") in table
        assert f"against {ref} (ADM evaluator, legacy_tensorflow mode)" in table
        assert list((tmp_path / "resources" / "fid-ref").glob("adm-*.npz"))  # arr_0's features, cached
