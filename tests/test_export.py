"""`diffrelay export` (training/export.py): a model.pretrained run's snapshot as a complete diffusers pipeline
folder that DiffusionPipeline.from_pretrained loads, whose network gives diffrelay's output, for a full fine-tune
and for a LoRA run (the adapter merged into the base); and the folders it must not replace. Nothing is downloaded."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

import pipelines
from conftest import run_cli
from diffrelay import config
from diffrelay.errors import UserError
from diffrelay.pretrained import weights
from diffrelay.training import export
from diffrelay.training import checkpoint, train
from test_lora import raw


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A one-step full fine-tune and a one-step LoRA run of the tiny SD pipeline, on one dataset."""
    work = tmp_path_factory.mktemp("export")
    sd = pipelines.sd(work / "sd")
    full = config.validate(raw(work, sd, name="full", total_steps=1, lora=None))
    lora = config.validate(raw(work, sd, name="lora", total_steps=1))
    for name, d in (("full", full), ("lora", lora)):
        (work / f"{name}.yaml").write_text(yaml.safe_dump(d))
    run_cli("prepare", "--config", work / "full.yaml", "--out", work / "dataset")
    for d in (full, lora):
        assert train.run(config.Config(d), until_step=1, dataset_dir=work / "dataset") == 0
    return {"work": work, "sd": sd, "full": full, "lora": lora}


def outputs(unet):
    torch.manual_seed(0)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 77, 32)
    with torch.no_grad():
        return unet(x, t, encoder_hidden_states=text).sample


@pytest.mark.parametrize("name", ["full", "lora"])
def test_the_exported_pipeline_loads_with_from_pretrained_and_its_network_is_the_snapshots(runs, name):
    from diffusers import DiffusionPipeline

    work, d = runs["work"], runs[name]
    snap = work / "results" / name / "snapshots" / "step_0000001.safetensors"
    out = work / f"exported-{name}"
    p = run_cli("export", "--config", work / f"{name}.yaml", "--snapshot", snap, "--out", out, "--weights", "raw")
    assert "DiffusionPipeline.from_pretrained" in p.stdout
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True, use_safetensors=True)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    net, _ = checkpoint.load_snapshot(snap, "raw", model_cfg=d["model"])
    mine = outputs(weights.text_net(net))
    theirs = outputs(pipe.unet)
    base = outputs(DiffusionPipeline.from_pretrained(runs["sd"], local_files_only=True, use_safetensors=True).unet)
    assert not torch.allclose(mine, base, atol=1e-6)  # the run changed the network
    if name == "full":  # the same weights: the same bits
        assert torch.equal(mine, theirs)
    else:  # the adapter merged into the base: equal up to float32 rounding
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-5), (mine - theirs).abs().max()
    # Plain diffusers keys (no peft base_layer/lora_*), and every other part byte for byte the pipeline's.
    keys = load_file(out / "unet" / "diffusion_pytorch_model.safetensors").keys()
    assert not [k for k in keys if "lora" in k or "base_layer" in k]
    for part in ("vae", "text_encoder", "tokenizer", "scheduler"):
        for f in (runs["sd"] / part).rglob("*"):
            if f.is_file():
                assert (out / part / f.relative_to(runs["sd"] / part)).read_bytes() == f.read_bytes(), f
    record = json.loads((out / export.MARK).read_text())
    assert record["lora_fused"] == (name == "lora") and record["step"] == 1 and record["weights"] == "raw"


def test_export_replaces_only_its_own_folder_and_needs_a_pipeline(runs, tmp_path):
    work = runs["work"]
    snap = work / "results" / "full" / "snapshots" / "step_0000001.safetensors"
    theirs = tmp_path / "mine"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    p = run_cli("export", "--config", work / "full.yaml", "--snapshot", snap, "--out", theirs, check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"{theirs}: exists and is not a folder `diffrelay export` wrote" in p.stderr
    assert sorted(x.name for x in theirs.iterdir()) == ["notes.txt"]
    # An earlier export is replaced (ema weights this time).
    out = tmp_path / "again"
    for weights_ in ("raw", "ema"):
        export.export(snap, runs["full"]["model"], out, weights_)
    assert json.loads((out / export.MARK).read_text())["weights"] == "ema"
    from diffrelay import cli

    (tmp_path / "scratch.yaml").write_text(yaml.safe_dump({"model": {"arch": "unet"}}))  # a run from scratch
    args = cli.build_parser().parse_args(["export", "--config", str(tmp_path / "scratch.yaml"), "--snapshot",
                                          str(snap), "--out", str(tmp_path / "x")])
    with pytest.raises(UserError, match=r"scratch.yaml: model.pretrained is not set: export writes a diffusers"):
        export.main(args)
    assert not (tmp_path / "x").exists()
