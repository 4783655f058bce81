"""Every supported pipeline family end to end on the CPU (issue 40): a tiny SD, SDXL, SD3 (with SD3.5's transformer
keys), PixArt-Sigma, HunyuanDiT, FLUX.1-dev and FLUX.1-schnell pipeline (tests/pipelines.py) fills its run's config,
fine-tunes one step in full and with LoRA, exports to a diffusers folder, and the exported pipeline's own __call__ (from_pretrained, its prompts, negative prompts, one generator
per image, steps, guidance and scheduler: by default its own, as it loads from the folder) gives the PNGs
`diffrelay sample` wrote for the snapshot: equal up to the last rounding of the decode, which diffusers does half
to even ((y / 2 + 0.5) x 255, rounded) and diffrelay half up (y x 127.5 + 128, truncated), so a value at a half may
differ by 1 in 255. A LoRA run's adapter file, loaded by the base pipeline's load_lora_weights where the class has one,
gives the same PNGs. `diffrelay export` replaces only a folder it wrote. Nothing is downloaded."""

import dataclasses
import json
import os
import warnings

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

import pipelines
from conftest import run_cli
from diffrelay import config
from diffrelay.errors import UserError
from diffrelay.sampling import sample, settings
from diffrelay.training import export, train
from test_lora import raw

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Capitals and a trailing space: PixArt's pipeline lower-cases and strips (its T5 here is case-sensitive, as the real one).
PROMPTS = [{"prompt": "A Red circle ", "seed": 3}, {"prompt": "a blue square", "negative_prompt": "a green star",
                                                   "seed": 8}]
# family: (builder, pipeline class, validation scheduler: a class, or the pipeline's own (its default))
FAMILIES = {"sd": (pipelines.sd, "StableDiffusionPipeline", "EulerAncestralDiscreteScheduler"),
            "sdxl": (pipelines.sdxl, "StableDiffusionXLPipeline", "pipeline"),
            # SD3's pipeline class with SD3.5's transformer keys (qk_norm, dual_attention_layers): SD3's own keys are a
            # subset, and check_diffusers_sampling.py's sd3/* cases run a plain SD3 transformer.
            "sd35": (pipelines.sd35, "StableDiffusion3Pipeline", "pipeline"),
            "pixart": (pipelines.pixart_sigma, "PixArtSigmaPipeline", "pipeline"),
            "hunyuandit": (pipelines.hunyuandit, "HunyuanDiTPipeline", "pipeline"),
            "flux": (pipelines.flux, "FluxPipeline", "pipeline"),
            "flux-schnell": (pipelines.flux_schnell, "FluxPipeline", "pipeline")}
# FLUX.1-dev's guidance is an input of its network (guidance_scale); schnell takes none (its pipeline ignores it).
GUIDANCE = {"flux-schnell": 1.0}
SIDE = {"hunyuandit": 32}  # its VAE divides by 8 (the pipeline's rotary grid assumes it): 4 x 4 latents
# The pipeline's pre-processing off: PixArt's and HunyuanDiT's resolution binning and PixArt's caption cleaning;
# HunyuanDiT's image_meta_size of the image's own size (its default original_size is 1024), as diffrelay gives it.
CALL = {"pixart": {"use_resolution_binning": False, "clean_caption": False},
        "hunyuandit": {"use_resolution_binning": False, "original_size": (32, 32)}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """One family's pipeline, a one-step full fine-tune and a one-step LoRA run of it on one dataset."""
    name = request.param
    build, cls, scheduler = FAMILIES[name]
    work = tmp_path_factory.mktemp(name)
    pipe = build(work / name)
    runs = {}
    for kind, lora in (("full", None), ("lora", {"rank": 2, "alpha": 4.0})):
        d = raw(work, pipe, name=kind, total_steps=1, lora=lora)
        d["sample"] = {"steps": 3}  # sample.scheduler: pipeline, the default
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
            "sd35": ("sd3", "flow", ["text_encoder", "text_encoder_2", "text_encoder_3"]),
            "pixart": ("pixart", "ddpm", ["text_encoder"]),
            "hunyuandit": ("hunyuandit", "ddpm", ["text_encoder", "text_encoder_2"]),
            "flux": ("flux", "flow", ["text_encoder", "text_encoder_2"]),
            "flux-schnell": ("flux", "flow", ["text_encoder", "text_encoder_2"])}[family["name"]]
    assert (m["arch"], m["objective"], [os.path.basename(e["path"]) for e in encoders]) == want
    if family["name"] == "sd35":  # SD3.5's transformer keys reach the network's config
        assert (m["kwargs"]["qk_norm"], m["kwargs"]["dual_attention_layers"]) == ("rms_norm", [0])
    if family["name"] == "sd35":  # the scheduler's shift; the T5 after the pooled CLIPs, unmasked as SD3 calls it
        assert d["train"]["flow"]["shift"] == 3.0 and [e["pooled"] for e in encoders] == [True, True, False]
        assert encoders[2]["use_mask"] is False and encoders[2]["max_length"] == 256
    if family["name"].startswith("flux"):  # the CLIP pooled only, the T5's 512 tokens unmasked; flow unshifted
        assert [(e["layer"], e["pooled"], e["use_mask"], e["max_length"]) for e in encoders] == [
            ("none", True, True, None), ("last", False, False, 512)]
        dev = family["name"] == "flux"  # dev: dynamic shifting (training draws unshifted) and the guidance input
        assert d["train"]["flow"]["shift"] == 1.0 and m["kwargs"]["time_scale"] == 1
        assert (m["kwargs"].get("guidance"), d["sample"]["guidance"]) == ((3.5, 3.5) if dev else (None, 1.0))
    if family["name"] == "pixart":  # PixArt-Sigma's 300 T5 tokens, masked; learned sigma kept as the config says
        assert encoders[0]["max_length"] == 300 and encoders[0]["use_mask"] and m["kwargs"]["out_channels"] == 8
    # The folder's files' sha256, in the run's record (its identity) and in every checkpoint's config.
    run = family["work"] / "results" / "full"
    recorded = json.loads((run / "run.json").read_text())["trajectory"]["model"]["pretrained"]["sha256"]
    meta = json.loads(next((run / "checkpoints").glob("*/meta.json")).read_text())
    assert recorded == meta["config"]["model"]["pretrained"]["sha256"] == m["pretrained"]["sha256"]
    assert any(k.endswith("diffusion_pytorch_model.safetensors") for k in recorded)
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
    assert d["sample"]["scheduler"] == "pipeline"  # a pipeline run's default
    g = GUIDANCE.get(family["name"], 4.0)
    s = dataclasses.replace(settings.Settings.from_section(d["sample"]), guidance=g, batch_size=2, weights="raw",
                            prompts=str(tmp_path / "prompts.yaml"), scheduler=family["scheduler"])
    manifest = sample.run(snap, tmp_path / "ours", s, model_cfg=d["model"], data_cfg=d["data"],
                          resources=d["run"]["resources"])
    side = SIDE.get(family["name"], 16)
    ours = np.stack([np.asarray(Image.open(tmp_path / "ours" / f"{i:06d}.png")) for i in range(2)])

    export.export(snap, d["model"], tmp_path / "exported", "raw")
    pipe = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "exported", local_files_only=True,
                                                       use_safetensors=True)
    assert type(pipe).__name__ == family["cls"]
    if family["scheduler"] == "pipeline":  # the pipeline's own scheduler, as it loads from the folder
        assert manifest["scheduler"]["class"] == type(pipe.scheduler).__name__
    else:  # the manifest's scheduler config (a non-finite float is text there: strict JSON)
        chosen = {k: float(v) if v in ("-inf", "inf") else v for k, v in manifest["scheduler"]["config"].items()}
        pipe.scheduler = getattr(diffusers, manifest["scheduler"]["class"]).from_config(chosen)
    pipe.set_progress_bar_config(disable=True)
    # One call per image, each with the pipeline's defaults where the prompt file leaves a value out (no negative
    # prompt: SDXL's force_zeros_for_empty_prompt); a batch gives the same (one generator per image).
    out = np.concatenate([pipe(prompt=p["prompt"], **{k: v for k, v in p.items() if k == "negative_prompt"},
                               generator=[torch.Generator().manual_seed(p["seed"])], num_inference_steps=3,
                               guidance_scale=g, height=side, width=side, output_type="np",
                               **CALL.get(family["name"], {})).images for p in PROMPTS])
    theirs = (out * 255).round().astype(np.uint8)
    if kind == "lora" and hasattr(pipe, "load_lora_weights"):  # PixArt's and HunyuanDiT's pipelines have no loader
        # The run's adapter file, as written at the checkpoint, loaded by the base pipeline's own load_lora_weights
        # (unfused, as diffrelay samples it): the same images as the fused export's.
        base = diffusers.DiffusionPipeline.from_pretrained(family["pipe"], local_files_only=True, use_safetensors=True)
        base.load_lora_weights(work / "results" / kind / "lora" / "step_0000001", weight_name="pytorch_lora_weights_raw.safetensors")
        base.set_progress_bar_config(disable=True)
        loaded = np.concatenate([base(prompt=p["prompt"], **{k: v for k, v in p.items() if k == "negative_prompt"},
                                      generator=[torch.Generator().manual_seed(p["seed"])], num_inference_steps=3,
                                      guidance_scale=g, height=side, width=side, output_type="np",
                                      **CALL.get(family["name"], {})).images for p in PROMPTS])
        assert np.abs((loaded * 255).round().astype(int) - ours.astype(int)).max() <= 1
    diff = np.abs(ours.astype(int) - theirs.astype(int))
    assert ours.shape == theirs.shape == (2, side, side, 3)
    assert ours.dtype == theirs.dtype == np.uint8
    # The same latents; the decode's last rounding may move a value by 1 where it lies at a half (measured: one
    # value of 6,144 in one of the ten cases; the LoRA runs' fused weights moved none).
    assert diff.max() <= 1 and (diff > 0).mean() < 0.002, (diff.max(), (diff > 0).mean())
    # The export's folder: the network in plain diffusers keys (a LoRA run's adapter fused, no peft
    # base_layer/lora_* keys), every other part byte for byte the pipeline's, and its record.
    net_part = "unet" if (family["pipe"] / "unet").is_dir() else "transformer"
    keys = load_file(tmp_path / "exported" / net_part / "diffusion_pytorch_model.safetensors").keys()
    assert keys and not [k for k in keys if "lora" in k or "base_layer" in k]
    parts = [p for p in family["pipe"].iterdir() if p.is_dir() and p.name != net_part]
    for f in (f for part in parts for f in part.rglob("*") if f.is_file()):
        assert (tmp_path / "exported" / f.relative_to(family["pipe"])).read_bytes() == f.read_bytes(), f
    record = json.loads((tmp_path / "exported" / export.MARK).read_text())
    assert (record["lora_fused"], record["step"], record["weights"]) == (kind == "lora", 1, "raw")


def test_export_replaces_only_its_own_folder_and_needs_a_pipeline(family, tmp_path):
    if family["name"] != "sd":
        pytest.skip("the refusals do not depend on the family: checked once, on SD")
    work = family["work"]
    snap = work / "results" / "full" / "snapshots" / "step_0000001.safetensors"
    theirs = tmp_path / "mine"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    p = run_cli("export", "--config", work / "full.yaml", "--snapshot", snap, "--out", theirs, check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"{theirs}: exists and is not a folder `diffrelay export` wrote" in p.stderr
    assert sorted(x.name for x in theirs.iterdir()) == ["notes.txt"]
    # An earlier export is replaced (ema weights this time); the command says how to load it.
    out = tmp_path / "again"
    export.export(snap, family["full"]["model"], out, "raw")
    p = run_cli("export", "--config", work / "full.yaml", "--snapshot", snap, "--out", out, "--weights", "ema")
    assert "DiffusionPipeline.from_pretrained" in p.stdout
    assert json.loads((out / export.MARK).read_text())["weights"] == "ema"
    from diffrelay import cli

    (tmp_path / "scratch.yaml").write_text(yaml.safe_dump({"model": {"arch": "unet"}}))  # a run from scratch
    args = cli.build_parser().parse_args(["export", "--config", str(tmp_path / "scratch.yaml"), "--snapshot",
                                          str(snap), "--out", str(tmp_path / "x")])
    with pytest.raises(UserError, match=r"scratch.yaml: model.pretrained is not set: export writes a diffusers"):
        export.main(args)
    assert not (tmp_path / "x").exists()


def test_a_moved_pipeline_samples_as_before_and_default_settings_keep_the_folders_shift(family, tmp_path):
    import shutil

    if family["name"] != "sd35":
        pytest.skip("the flow shift is SD3's; a move is the same for every family")
    work, d = family["work"], family["full"]
    snap = work / "results" / "full" / "snapshots" / "step_0000001.safetensors"
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump(PROMPTS[:1]))
    moved = shutil.copytree(family["pipe"], tmp_path / "moved")  # the same files elsewhere: the same run
    model = {**d["model"], "pretrained": {**d["model"]["pretrained"], "path": str(moved)}}
    data = {**d["data"], "text_encoders": [{**e, "path": e["path"].replace(str(family["pipe"]), str(moved))}
                                           for e in d["data"]["text_encoders"]]}
    s = dataclasses.replace(settings.Settings.from_section(d["sample"]), batch_size=1, weights="raw",
                            prompts=str(tmp_path / "prompts.yaml"))
    a = sample.run(snap, tmp_path / "a", s, model_cfg=model, data_cfg=data, resources=d["run"]["resources"])
    # Without the run's config (a hand-run with --scheduler pipeline): the schema's sample.flow.shift (1) is the
    # default, so the folder's shift (3) is the sampler's, as in the run.
    bare = dataclasses.replace(sample.default_settings(), steps=s.steps, batch_size=1, weights="raw",
                               prompts=str(tmp_path / "prompts.yaml"), scheduler="pipeline")
    b = sample.run(snap, tmp_path / "b", bare, data_cfg=data, resources=d["run"]["resources"])
    assert a["scheduler"] == b["scheduler"] and a["scheduler"]["config"]["shift"] == 3.0
    assert (tmp_path / "a" / "000000.png").read_bytes() == (tmp_path / "b" / "000000.png").read_bytes()


def test_the_family_trains_under_fsdp2_as_under_ddp_full_and_lora(family):
    """train.sharding: fsdp2 (one process here: fully_shard on each block of the family's network, then the root)
    gives the weights ddp gives, full fine-tune and LoRA, within rounding; the LoRA checkpoint holds the adapter."""
    import diffusers

    from diffrelay.training import sharded_checkpoint, sharding

    for kind in ("full", "lora"):
        d = json.loads(json.dumps(family[kind]))
        d["run"]["name"] = f"{kind}-fsdp2"
        d["train"]["sharding"] = "fsdp2"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert train.run(config.Config(config.validate(d)), until_step=1,
                             dataset_dir=family["work"] / "dataset") == 0
        # FSDP2's "returned a view tensor" of FLUX.1's single-stream blocks, harmless there (sharding.VIEWS_OK): unsaid
        assert not [w for w in caught if "returned a view tensor" in str(w.message)], family["name"]
        results = family["work"] / "results"
        a = load_file(results / f"{kind}-fsdp2/snapshots/step_0000001.safetensors")
        b = load_file(results / f"{kind}/snapshots/step_0000001.safetensors")
        assert a.keys() == b.keys()
        # Adam's first step moves every weight by about lr (0.01) times g / |g|: where |g| is near Adam's eps, the
        # gradient's last bits move it visibly (HunyuanDiT: 1.7e-4 at most, 12 of 319,456 beyond 1e-5). A wrong
        # weight or a lost update would be off by about lr nearly everywhere.
        diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
        assert diff.max() <= 1e-3 and (diff > 1e-5).float().mean() < 1e-3, (kind, diff.max(), (diff > 1e-5).sum())
        held = sharded_checkpoint.read_whole(results / f"{kind}-fsdp2/checkpoints/step_0000001")
        nets = {k[len("net."):] for k in held if k.startswith("net.")}
        assert nets == {k[len("raw."):] for k in a if k.startswith("raw.")}  # a LoRA run's: the adapter only
    part = "unet" if (family["pipe"] / "unet").is_dir() else "transformer"
    cls = json.loads((family["pipe"] / part / "config.json").read_text())["_class_name"]
    assert len(sharding.units(getattr(diffusers, cls).from_pretrained(family["pipe"] / part))) >= 2  # its blocks
