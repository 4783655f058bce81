"""FLUX.1 beyond the every-family test (tests/test_pretrained_families.py): a QLoRA (a LoRA on an NF4 base,
bitsandbytes' CPU backend here) in two segments equals one run bit for bit; its adapter exported in kohya's FLUX.1
keys reads back through diffusers' converter to the same transformer output; true CFG with negative prompts gives
FluxPipeline's PNGs; and each FLUX.1-specific refusal is one line before any work."""

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


def test_a_flux_lora_on_an_nf4_base_in_two_segments_equals_one_run(dev, monkeypatch):
    """The two segments swap both blocks (train.block_swap: 2, under activation checkpointing): the same bits."""
    from diffrelay.runtime import block_swap

    swaps, hook = [], block_swap.BlockSwap.hook
    monkeypatch.setattr(block_swap.BlockSwap, "hook", lambda self: swaps.append(self) or hook(self))
    work, spec = dev["work"], {"rank": 2, "quantize_base": "nf4"}
    assert train.run(config.Config(dev["cfg"]), until_step=2, dataset_dir=work / "dataset") == 0
    two = config.Config(config.validate(flux_raw(work, dev["pipe"], "two", lora=spec, block_swap=2,
                                                 activation_checkpointing=True)))
    for until in (1, 2):
        assert train.run(two, until_step=until, dataset_dir=work / "dataset") == 0
    a, _ = checkpoint.load_checkpoint(work / "results" / "one" / "checkpoints" / "step_0000002")
    b, _ = checkpoint.load_checkpoint(work / "results" / "two" / "checkpoints" / "step_0000002")
    assert a["net"] and set(a["net"]) == set(b["net"]) and any("ff_context.net.2" in k for k in a["net"])
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])
    # each segment swapped both blocks out and in again, the nf4 weights among them
    assert len(swaps) == 2 and all(s.events.count(("in", 0)) == 2 and ("out", 1) in s.events for s in swaps)
    assert any(type(p).__name__ == "Params4bit" for p in sum(swaps[0].host, []))
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
    d = flux_raw(tmp_path, pipe, "sw", lora={"rank": 2}, block_swap=1)
    assert "needs train.activation_checkpointing: true" in one_line(lambda: config.validate(d, "sw.yaml"))
    d = flux_raw(tmp_path, pipe, "sw", lora={"rank": 2}, block_swap=3, activation_checkpointing=True)
    assert "config.json has 2 blocks (transformer_blocks + single_transformer_blocks); swap at most 2" in one_line(
        lambda: config.validate(d, "sw.yaml"))
    d = flux_raw(tmp_path, pipe, "odd")
    d["data"]["resolution"] = 14  # latents of 7 x 7: no 2 x 2 packing (checked against the VAE's latents)
    (tmp_path / "odd.yaml").write_text(yaml.safe_dump(d))
    p = run_cli("validate", "--config", tmp_path / "odd.yaml", check=False)
    assert p.returncode == 2 and "packs 2 x 2 latent pixels" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # kohya's keys are built for UNets and FLUX.1: another transformer's export says where its diffusers file is,
    # before any work; a FLUX.1 adapter outside the blocks is refused before the file is written
    from diffrelay import cli
    from diffrelay.pretrained import comfyui
    from diffrelay.training import export

    d = config.validate(flux_raw(tmp_path, pipelines.pixart_sigma(tmp_path / "pix"), "pix", lora={"rank": 2}))
    (tmp_path / "pix.yaml").write_text(yaml.safe_dump(d))
    args = ["export", "--config", str(tmp_path / "pix.yaml"), "--snapshot", str(tmp_path / "none.safetensors"),
            "--out", str(tmp_path / "x.safetensors"), "--lora-format", "comfyui"]
    assert "built for UNet pipelines (SD, SDXL) and FLUX.1" in one_line(
        lambda: export.main(cli.build_parser().parse_args(args)))
    assert not (tmp_path / "x.safetensors").exists()
    assert "double_blocks and single_blocks only" in one_line(lambda: comfyui.flux_module("norm_out.linear"))
    assert comfyui.flux_module("single_transformer_blocks.3.proj_mlp") == ("single_blocks.3.linear1",
                                                                           "single_transformer_blocks.3", 3, 4)


def test_the_comfyui_export_of_a_flux_lora_is_kohyas_layout_and_diffusers_reads_it_to_the_same_output(dev, tmp_path,
                                                                                                     capsys):
    """`diffrelay export --lora-format comfyui` of a FLUX.1 LoRA: kohya's lora_unet_ keys of BFL's modules, q/k/v
    fused (double blocks' qkv, single blocks' linear1 with the MLP's input) with a stacked down, a block-diagonal up
    and alpha x parts; FluxPipeline's own reader (lora_state_dict: diffusers' kohya converter) and load_lora_weights
    give diffrelay's transformer output within 1e-6."""
    from diffusers import FluxPipeline
    from safetensors.torch import load_file, save_file

    from diffrelay import cli
    from diffrelay.pretrained import weights
    from diffrelay.training import export

    work = dev["work"]
    assert train.run(config.Config(dev["cfg"]), until_step=2, dataset_dir=work / "dataset") == 0  # done: no work
    snap = work / "results" / "one" / "snapshots" / "step_0000002.safetensors"
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(dev["cfg"]))
    out = tmp_path / "flux-lora.safetensors"
    assert export.main(cli.build_parser().parse_args(["export", "--config", str(tmp_path / "one.yaml"), "--snapshot",
                                                      str(snap), "--out", str(out), "--weights", "raw",
                                                      "--lora-format", "comfyui"])) == 0
    # What was checked, and only that: the file read back; diffusers' converter cannot read a tiny FLUX.1's (below)
    said = capsys.readouterr().out.strip().splitlines()
    assert said[0].startswith("diffrelay: exporting the raw weights (--weights) of") and len(said) == 2, said
    assert "checked: it reads back with the same tensors" in said[1] and "load_lora_weights(" not in said[1]
    assert "diffusers' load_lora_weights cannot read this file: its converter cuts a single block's linear1 at " \
        "FLUX.1's widths [3072, 3072, 3072, 12288], and this transformer's are [16, 16, 16, 64]" in said[1], said
    sd = load_file(out)
    r, inner, mlp = 2, 16, 64  # the run's rank; the tiny transformer's width and its single blocks' MLP width
    assert sorted({k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in sd}) == [
        f"lora_unet_{m}" for m in ("double_blocks_0_img_attn_proj", "double_blocks_0_img_attn_qkv",
                                   "double_blocks_0_img_mlp_0", "double_blocks_0_img_mlp_2",
                                   "double_blocks_0_txt_attn_proj", "double_blocks_0_txt_attn_qkv",
                                   "double_blocks_0_txt_mlp_0", "double_blocks_0_txt_mlp_2", "single_blocks_0_linear1")]
    qkv, linear1 = "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"
    assert sd[f"{qkv}.lora_down.weight"].shape == (3 * r, inner) and sd[f"{qkv}.lora_up.weight"].shape == (3 * inner,
                                                                                                          3 * r)
    assert sd[f"{qkv}.alpha"].item() == 3 * r and sd[f"{linear1}.alpha"].item() == 4 * r
    assert sd[f"{qkv}.lora_up.weight"][:inner, r:].abs().sum() == 0  # block-diagonal
    net, _ = checkpoint.load_snapshot(snap, "raw", model_cfg=dev["cfg"]["model"])
    mine = weights.text_net(net)
    # diffusers' converter cuts a single block's linear1 at FLUX.1's widths, written into it (3 x 3,072 + 12,288):
    # the tiny transformer's parts are placed at those rows for it and cut back to their width after.
    wide, small = [0, 3072, 6144, 9216, 21504], [0, inner, 2 * inner, 3 * inner, 3 * inner + mlp]
    up = sd[f"{linear1}.lora_up.weight"]
    sd[f"{linear1}.lora_up.weight"] = torch.zeros(wide[-1], 4 * r)
    for j in range(4):
        sd[f"{linear1}.lora_up.weight"][wide[j]:wide[j] + small[j + 1] - small[j]] = up[small[j]:small[j + 1]]
    save_file(sd, tmp_path / "flux1-widths.safetensors")
    read = FluxPipeline.lora_state_dict(str(tmp_path / "flux1-widths.safetensors"))
    single = "transformer.single_transformer_blocks.0."
    cut = [f"{single}{m}.lora_B.weight" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]
    read = {k: v[:mlp if "proj_mlp" in k else inner] if k in cut else v for k, v in read.items()}
    assert read[f"{single}attn.to_k.lora_A.weight"].shape == (r, inner) and not read[f"{single}proj_mlp.lora_B.weight"].any()
    pipe = FluxPipeline.from_pretrained(dev["pipe"], local_files_only=True, use_safetensors=True)
    pipe.load_lora_weights(read)
    torch.manual_seed(0)
    x, text, pooled = torch.randn(2, 16, 16), torch.randn(2, 5, 32), torch.randn(2, 32)
    ids, txt = torch.randint(0, 4, (16, 3)).float(), torch.zeros(5, 3)
    kw = {"hidden_states": x, "encoder_hidden_states": text, "pooled_projections": pooled, "timestep": torch.tensor([0.2, 0.9]),
          "img_ids": ids, "txt_ids": txt, "guidance": torch.tensor([3.5, 3.5]), "return_dict": False}
    with torch.no_grad():
        got, want = mine(**kw)[0], pipe.transformer(**kw)[0]
        pipe.transformer.disable_lora()
        before = pipe.transformer(**kw)[0]
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    assert (got - before).abs().max() > 1e-3  # the trained adapter changes the output


def test_true_cfg_with_negative_prompts_samples_as_flux_pipelines_call(dev, tmp_path):
    """sample.true_cfg_scale: FluxPipeline's true_cfg_scale: a prompt with a negative prompt takes two forwards a
    step (the guidance input in both), neg + scale (pos - neg); one without is unguided, as the pipeline called
    without one. Step 0 (the pipeline as it came) sampled in one batch of 3 gives FluxPipeline's PNGs, one call an
    image. Keyed only when above 1; on another network, one line."""
    import dataclasses

    import numpy as np
    from diffusers import FluxPipeline
    from PIL import Image

    from diffrelay.sampling import sample, settings

    work, d = dev["work"], dev["cfg"]
    assert train.run(config.Config(d), until_step=2, dataset_dir=work / "dataset") == 0  # done: no work
    snap = work / "results" / "one" / "snapshots" / "step_0000000.safetensors"
    prompts = [{"prompt": "a red circle", "negative_prompt": "a blue square", "seed": 3},
               {"prompt": "a green star", "seed": 5},
               {"prompt": "a blue square", "negative_prompt": "", "seed": 8}]
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump(prompts))
    s = dataclasses.replace(settings.Settings.from_section(d["sample"]), batch_size=3, weights="raw",
                            prompts=str(tmp_path / "prompts.yaml"))
    where = {"model_cfg": d["model"], "data_cfg": d["data"], "resources": d["run"]["resources"]}
    manifest = sample.run(snap, tmp_path / "cfg", dataclasses.replace(s, true_cfg_scale=4.0), **where)
    plain = sample.run(snap, tmp_path / "plain", s, **where)
    assert manifest["true_cfg_scale"] == 4.0 and "true_cfg_scale" not in plain and s.guidance == 3.5
    ours, unguided = (np.stack([np.asarray(Image.open(tmp_path / f / f"{i:06d}.png")) for i in range(3)]).astype(int)
                      for f in ("cfg", "plain"))
    pipe = FluxPipeline.from_pretrained(dev["pipe"], local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    out = np.concatenate([pipe(prompt=p["prompt"], negative_prompt=p.get("negative_prompt"), true_cfg_scale=4.0,
                               guidance_scale=3.5, generator=[torch.Generator().manual_seed(p["seed"])],
                               num_inference_steps=2, height=16, width=16, output_type="np").images for p in prompts])
    theirs = (out * 255).round().astype(int)
    assert np.array_equal(ours, theirs)  # byte for byte (the decode's rounding agrees on every value here)
    moved = np.abs(ours - unguided).max(axis=(1, 2, 3))  # measured: 11, 0, 13 of 255
    assert moved[1] == 0 and moved[0] > 0 and moved[2] > 0  # "" is a negative prompt too, as in the pipeline
    other = flux_raw(tmp_path, pipelines.sd(tmp_path / "sd"), "sd")
    other["sample"]["true_cfg_scale"] = 4.0
    assert "for FLUX.1 networks" in one_line(lambda: config.validate(other, "sd.yaml"))
