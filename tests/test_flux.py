"""FLUX.1 beyond the every-family test (tests/test_pretrained_families.py): a QLoRA (a LoRA on an NF4 base,
bitsandbytes' CPU backend here) in two segments equals one run bit for bit, and each FLUX.1-specific refusal is one
line before any work."""

import os

import pytest
import torch
import yaml

import pipelines
from conftest import run_cli
from diffrelay import config
from diffrelay.errors import UserError
from diffrelay.training import checkpoint, train
from test_lora import raw

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def flux_raw(work, pipe, name, **train_keys) -> dict:
    d = raw(work, pipe, name=name, **train_keys)
    d["sample"] = {"steps": 2}
    return d


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    work = tmp_path_factory.mktemp("flux")
    pipe = pipelines.flux(work / "flux")
    d = config.validate(flux_raw(work, pipe, "one", lora={"rank": 2, "quantize_base": "nf4"}))
    (work / "one.yaml").write_text(yaml.safe_dump(d))
    run_cli("prepare", "--config", work / "one.yaml", "--out", work / "dataset")
    return {"work": work, "pipe": pipe, "cfg": d}


def test_a_flux_lora_on_an_nf4_base_in_two_segments_equals_one_run(dev):
    work, spec = dev["work"], {"rank": 2, "quantize_base": "nf4"}
    assert train.run(config.Config(dev["cfg"]), until_step=2, dataset_dir=work / "dataset") == 0
    two = config.Config(config.validate(flux_raw(work, dev["pipe"], "two", lora=spec)))
    for until in (1, 2):
        assert train.run(two, until_step=until, dataset_dir=work / "dataset") == 0
    a, _ = checkpoint.load_checkpoint(work / "results" / "one" / "checkpoints" / "step_0000002")
    b, _ = checkpoint.load_checkpoint(work / "results" / "two" / "checkpoints" / "step_0000002")
    assert a["net"] and set(a["net"]) == set(b["net"]) and any("ff_context.net.2" in k for k in a["net"])
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])
    assert all(torch.equal(x["exp_avg_sq"], b["optimizer"]["state"][i]["exp_avg_sq"])
               for i, x in a["optimizer"]["state"].items())
    # The base was quantized: its linear layers are bitsandbytes' 4-bit ones, the convolutions none.
    import bitsandbytes as bnb

    from diffrelay.pretrained import lora, weights

    net, _ = checkpoint.load_snapshot(work / "results" / "one" / "snapshots" / "step_0000002.safetensors", "raw",
                                      model_cfg=dev["cfg"]["model"])
    plain = weights.text_net(net).transformer_blocks[0].ff.net[2].base_layer.weight.detach().clone()
    lora.quantize(net, "nf4")
    q = weights.text_net(net).transformer_blocks[0].ff.net[2].base_layer
    assert isinstance(q, bnb.nn.Linear4bit) and q.weight.dtype == torch.uint8 and q.weight.numel() * 2 == plain.numel()


def one_line(fn) -> str:
    with pytest.raises(UserError) as e:
        fn()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_flux_refusals_are_one_line_each(dev, tmp_path):
    pipe = dev["pipe"]
    schnell = pipelines.flux_schnell(tmp_path / "schnell")
    d = flux_raw(tmp_path, schnell, "s")
    d["sample"]["guidance"] = 3.5
    assert "guidance_embeds false (schnell)" in one_line(lambda: config.validate(d, "s.yaml"))
    d = flux_raw(tmp_path, pipe, "odd")
    d["data"]["resolution"] = 14  # latents of 7 x 7: no 2 x 2 packing (checked against the VAE's latents)
    (tmp_path / "odd.yaml").write_text(yaml.safe_dump(d))
    p = run_cli("validate", "--config", tmp_path / "odd.yaml", check=False)
    assert p.returncode == 2 and "packs 2 x 2 latent pixels" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # kohya's keys are built for UNets: a FLUX.1 run's export says where its diffusers file is, before any work
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(dev["cfg"]))
    p = run_cli("export", "--config", tmp_path / "one.yaml", "--snapshot", tmp_path / "none.safetensors", "--out",
                tmp_path / "x.safetensors", "--lora-format", "comfyui", check=False)
    assert p.returncode == 2 and "built for UNet pipelines" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.safetensors").exists()
