"""Every supported pipeline family end to end on the CPU (issue 40): a tiny SD, SDXL, SD3, PixArt-Sigma and
HunyuanDiT pipeline (tests/pipelines.py) fills its run's config, fine-tunes one step in full and with LoRA, exports to a diffusers
folder, and the exported pipeline's own __call__ (from_pretrained, its prompts, negative prompts, one generator
per image, steps, guidance and scheduler) gives the PNGs `diffrelay sample` wrote for the snapshot, byte for byte
(a LoRA run's exported network has the adapter fused into its weights: a pixel may move by 1 in 255 there; none
did). diffusers rounds half to even and diffrelay's decode (y x 127.5 + 128, truncated) half up, so a pixel could
differ by 1 at an exact half; none did. Nothing is downloaded."""

import json
import os

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import pipelines
from conftest import run_cli
from diffrelay import config
from diffrelay.sampling import sample
from diffrelay.training import export, train
from test_lora import raw

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = [{"prompt": "a red circle", "seed": 3}, {"prompt": "a blue square", "negative_prompt": "a green star",
                                                   "seed": 8}]
# family: (builder, pipeline class, validation scheduler, the objective's sampler for config validation)
FAMILIES = {"sd": (pipelines.sd, "StableDiffusionPipeline", "EulerAncestralDiscreteScheduler", "ddim"),
            "sdxl": (pipelines.sdxl, "StableDiffusionXLPipeline", "EulerDiscreteScheduler", "ddim"),
            "sd3": (pipelines.sd3, "StableDiffusion3Pipeline", "FlowMatchEulerDiscreteScheduler", "euler"),
            "pixart": (pipelines.pixart_sigma, "PixArtSigmaPipeline", "DPMSolverMultistepScheduler", "ddim"),
            "hunyuandit": (pipelines.hunyuandit, "HunyuanDiTPipeline", "DDPMScheduler", "ddim")}
SIDE = {"hunyuandit": 32}  # its VAE divides by 8 (the pipeline's rotary grid assumes it): 4 x 4 latents
# The pipeline's pre-processing off: PixArt's and HunyuanDiT's resolution binning and PixArt's caption cleaning;
# HunyuanDiT's image_meta_size of the image's own size (its default original_size is 1024), as diffrelay gives it.
CALL = {"pixart": {"use_resolution_binning": False, "clean_caption": False},
        "hunyuandit": {"use_resolution_binning": False, "original_size": (32, 32)}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """One family's pipeline, a one-step full fine-tune and a one-step LoRA run of it on one dataset."""
    name = request.param
    build, cls, scheduler, solver = FAMILIES[name]
    work = tmp_path_factory.mktemp(name)
    pipe = build(work / name)
    runs = {}
    for kind, lora in (("full", None), ("lora", {"rank": 2, "alpha": 4.0})):
        d = raw(work, pipe, name=kind, total_steps=1, lora=lora)
        d["sample"] = {**d["sample"], "solver": solver}
        d["data"]["resolution"] = SIDE.get(name, 16)
        runs[kind] = config.validate(d)
        (work / f"{kind}.yaml").write_text(yaml.safe_dump(runs[kind]))
    run_cli("prepare", "--config", work / "full.yaml", "--out", work / "dataset")
    for d in runs.values():
        assert train.run(config.Config(d), until_step=1, dataset_dir=work / "dataset") == 0
    return {"name": name, "work": work, "pipe": pipe, "cls": cls, "scheduler": scheduler, **runs}


def test_the_family_fills_its_config_and_trains_from_its_weights(family):
    d = family["full"]
    m, encoders = d["model"], d["data"]["text_encoders"]
    want = {"sd": ("diffusers-unet", "ddpm", ["text_encoder"]),
            "sdxl": ("diffusers-unet", "ddpm", ["text_encoder", "text_encoder_2"]),
            "sd3": ("sd3", "flow", ["text_encoder", "text_encoder_2", "text_encoder_3"]),
            "pixart": ("pixart", "ddpm", ["text_encoder"]),
            "hunyuandit": ("hunyuandit", "ddpm", ["text_encoder", "text_encoder_2"])}[family["name"]]
    assert (m["arch"], m["objective"], [os.path.basename(e["path"]) for e in encoders]) == want
    if family["name"] == "sd3":  # the scheduler's shift; the T5 after the pooled CLIPs, unmasked as SD3 calls it
        assert d["train"]["flow"]["shift"] == 3.0 and [e["pooled"] for e in encoders] == [True, True, False]
        assert encoders[2]["use_mask"] is False and encoders[2]["max_length"] == 256
    if family["name"] == "pixart":  # PixArt-Sigma's 300 T5 tokens, masked; learned sigma kept as the config says
        assert encoders[0]["max_length"] == 300 and encoders[0]["use_mask"] and m["kwargs"]["out_channels"] == 8
    # Only the adapter of the LoRA run trained: its checkpoint is a fraction of the full run's.
    size = {k: sum(f.stat().st_size for f in (family["work"] / "results" / k / "checkpoints").rglob("*") if
                   f.is_file()) for k in ("full", "lora")}
    assert size["lora"] * 4 < size["full"], size


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_exported_pipelines_call_gives_the_pngs_diffrelay_sampled(family, kind, tmp_path):
    import diffusers

    work, d = family["work"], family[kind]
    snap = work / "results" / kind / "snapshots" / "step_0000001.safetensors"
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump(PROMPTS))
    s = sample.default_settings(steps=3, guidance=4.0, batch_size=2, weights="raw", prompts=str(tmp_path /
                                "prompts.yaml"), scheduler=family["scheduler"], solver=d["sample"]["solver"])
    manifest = sample.run(snap, tmp_path / "ours", s, model_cfg=d["model"], data_cfg=d["data"],
                          resources=d["run"]["resources"])
    side = SIDE.get(family["name"], 16)
    ours = np.stack([np.asarray(Image.open(tmp_path / "ours" / f"{i:06d}.png")) for i in range(2)])

    export.export(snap, d["model"], tmp_path / "exported", "raw")
    pipe = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "exported", local_files_only=True,
                                                       use_safetensors=True)
    assert type(pipe).__name__ == family["cls"]
    # The manifest's scheduler config (a non-finite float is text there: strict JSON).
    chosen = {k: float(v) if v in ("-inf", "inf") else v for k, v in manifest["scheduler"]["config"].items()}
    pipe.scheduler = getattr(diffusers, manifest["scheduler"]["class"]).from_config(chosen)
    pipe.set_progress_bar_config(disable=True)
    # One call per image, each with the pipeline's defaults where the prompt file leaves a value out (no negative
    # prompt: SDXL's force_zeros_for_empty_prompt); a batch gives the same (one generator per image).
    out = np.concatenate([pipe(prompt=p["prompt"], **{k: v for k, v in p.items() if k == "negative_prompt"},
                               generator=[torch.Generator().manual_seed(p["seed"])], num_inference_steps=3,
                               guidance_scale=4.0, height=side, width=side, output_type="np",
                               **CALL.get(family["name"], {})).images for p in PROMPTS])
    theirs = (out * 255).round().astype(np.uint8)
    diff = np.abs(ours.astype(int) - theirs.astype(int))
    assert ours.shape == theirs.shape == (2, side, side, 3)
    assert ours.dtype == theirs.dtype == np.uint8
    if kind == "full":  # the same weights: the same bytes (measured: every family, every pixel)
        assert diff.max() == 0, (diff.max(), (diff > 0).mean())
    else:  # the adapter fused into the base: float32 rounding may move a pixel by 1 (measured: none did)
        assert diff.max() <= 1 and (diff > 0).mean() < 0.02, (diff.max(), (diff > 0).mean())
    assert json.loads((tmp_path / "exported" / export.MARK).read_text())["lora_fused"] == (kind == "lora")
