"""model.pretrained: a tiny diffusers pipeline folder fills every part of the config (network, schedule, VAE, text
encoders), its files' sha256 join the run's identity, step 0 starts from its weights, and each bad folder is
one line (docs/pretrained.md). Pipelines are built from configs by tests/pipelines.py; nothing is downloaded."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

import pipelines
from diffrelay import config
from diffrelay.config import preflight
from diffrelay.errors import UserError

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def sd(tmp_path_factory) -> Path:
    return pipelines.sd(tmp_path_factory.mktemp("pipes") / "sd")


def raw(work: Path, pipe, **over) -> dict:
    d = {"run": {"name": "ft", "results": str(work / "results"), "resources": str(work / "resources"),
                 "device": "cpu"},
         "data": {"kind": "shapes", "count": 16, "resolution": 16, "captions": "auto", "val_fraction": 0.25},
         "model": {"pretrained": str(pipe)},
         "train": {"total_steps": 2, "segment_steps": 2, "batch_size": 4, "log_every": 1, "warmup_steps": 1},
         "sample": {"steps": 2, "batch_size": 4, "solver": "ddim"},
         "fid": {"extractor": "random", "batch_size": 16}}
    for section, keys in over.items():
        d[section] = {**d[section], **keys}
    return d


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **keys) -> None:
    d = json.loads(path.read_text())
    d.update(keys)
    path.write_text(json.dumps(d))


def refusal(d: dict) -> str:
    with pytest.raises(UserError) as e:
        config.validate(d, "ft.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("ft.yaml: "), msg
    return msg


def test_an_sd_pipeline_fills_the_network_schedule_vae_and_text_encoder(sd, tmp_path):
    d = config.validate(raw(tmp_path, sd))
    m, data = d["model"], d["data"]
    unet = json.loads((sd / "unet" / "config.json").read_text())
    assert m["arch"] == "diffusers-unet" and m["objective"] == "ddpm"
    assert m["kwargs"]["block_out_channels"] == unet["block_out_channels"] == [16, 32]
    assert m["kwargs"]["time_scale"] == 1 and "cross_attention_dim" not in m["kwargs"]  # set from the encoders
    assert {k: m["ddpm"][k] for k in ("beta_schedule", "beta_start", "beta_end", "prediction_type")} == {
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "prediction_type": "epsilon"}
    assert (data["encoder"], data["encoder_path"]) == ("sd-vae", str(sd / "vae"))
    assert [(e["path"], e["layer"], e["pooled"]) for e in data["text_encoders"]] == [
        (str(sd / "text_encoder"), "last", False)]
    # Every file's sha256, in the config every checkpoint records and in the trajectory (not the folder's path).
    sums = m["pretrained"]["sha256"]
    assert sums == {p.relative_to(sd).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in sd.rglob("*") if p.is_file()}
    assert config.trajectory(d)["model"]["pretrained"] == {"sha256": sums}
    assert config.validate(d) == d  # a recorded config reads back as itself


def test_v_prediction_and_a_flow_scheduler_come_from_scheduler_config(sd, tmp_path):
    v = copy(sd, tmp_path / "v")
    edit_json(v / "scheduler" / "scheduler_config.json", prediction_type="v_prediction")
    assert config.validate(raw(tmp_path, v))["model"]["ddpm"]["prediction_type"] == "v_prediction"
    # A fine-tuning choice of the user's wins: min-SNR weights and zero-terminal SNR on an epsilon pipeline.
    d = config.validate(raw(tmp_path, sd, model={"pretrained": str(sd), "ddpm": {
        "snr_gamma": 5.0, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True}}))
    assert (d["model"]["ddpm"]["snr_gamma"], d["model"]["ddpm"]["beta_schedule"]) == (5.0, "scaled_linear")
    f = copy(sd, tmp_path / "flow")
    (f / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}))
    d = config.validate(raw(tmp_path, f, sample={"solver": "euler"}))
    assert (d["model"]["objective"], d["train"]["flow"]["shift"], d["sample"]["flow"]["shift"]) == ("flow", 3.0, 3.0)
    assert d["model"]["kwargs"]["time_scale"] == 1000


def test_sdxl_takes_both_encoders_penultimate_and_pools_the_second(tmp_path):
    xl = pipelines.sdxl(tmp_path / "xl")
    d = config.validate(raw(tmp_path, xl, sample={"solver": "ddim"}))
    assert [(Path(e["path"]).name, e["layer"], e["pooled"]) for e in d["data"]["text_encoders"]] == [
        ("text_encoder", "penultimate", False), ("text_encoder_2", "penultimate", True)]
    assert d["model"]["kwargs"]["pixel_size"] == 16  # SDXL's time ids in pixels, not latents
    edit_json(xl / "model_index.json", text_encoder_2=[None, None])
    assert "no text_encoder_2; an SDXL pipeline" in refusal(raw(tmp_path, xl))


def test_step_0_starts_from_the_pipelines_weights(sd, tmp_path):
    import torch
    from safetensors.torch import load_file

    from diffrelay import objectives
    from diffrelay.pretrained import weights

    d = config.validate(raw(tmp_path, sd))
    torch.manual_seed(1)  # tests/pipelines.py drew the pipeline's with seed 0
    net = objectives.build(d["model"], 8, 0, 4, text={"states": 32, "length": 77, "pooled": 0})
    want = load_file(sd / "unet" / "diffusion_pytorch_model.safetensors")
    got = weights.text_net(net).state_dict()
    assert any(not torch.equal(got[k], want[k]) for k in want)  # a fresh init is not the pipeline's
    weights.load_initial(net, d["model"]["pretrained"])
    got = weights.text_net(net).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_changed_pipeline_folder_is_refused_for_the_run_it_made(sd, tmp_path):
    pipe = copy(sd, tmp_path / "p")
    d = config.validate(raw(tmp_path, pipe))
    (tmp_path / "results" / "ft").mkdir(parents=True)
    preflight.write_run_record(config.Config(d))
    edit_json(pipe / "scheduler" / "scheduler_config.json", steps_offset=0)  # a byte changes, no setting
    with pytest.raises(UserError, match=r"ft.yaml: the pretrained pipeline's scheduler/scheduler_config\.json has "
                       r"sha256 [0-9a-f]{12}\.\.\. now, but .*ft \(run.json\) was made with [0-9a-f]{12}\.\.\.: the base "
                       r"pipeline changed; restore the pipeline folder it was made with, or start a new run.name"):
        preflight.check_run_folder(config.Config(config.validate(raw(tmp_path, pipe))), "ft.yaml")
    # A recorded config (every checkpoint's) names the changed file.
    assert "scheduler/scheduler_config.json: sha256" in refusal(d)


@pytest.mark.parametrize("case, says", [
    ("missing", "no such folder; model.pretrained must be a local folder written by DiffusionPipeline.save_pretrained "
                "(not a Hub id: nothing is downloaded)"),
    ("pickle", "unet/diffusion_pytorch_model.bin: pickled weights are never loaded"),
    ("pipeline", "_class_name KandinskyPipeline: not supported; diffrelay fine-tunes StableDiffusionPipeline, "),
    ("component", "unet is a UNet2DModel, not supported; diffrelay loads UNet2DConditionModel, "),
    ("scaling", "vae/config.json: no scaling_factor"),
    ("single", "unet.ckpt: a single-file checkpoint is loaded from .safetensors only"),
    ("file", "a single file; give model.pretrained {path: "),
    ("arch", "model.arch=dit: contradicts model.pretrained, whose pipeline gives diffusers-unet; drop it"),
    ("kwargs", "model.kwargs.block_out_channels=[8, 16]: contradicts model.pretrained"),
    ("schedule", "model.ddpm.beta_end=0.03: contradicts model.pretrained, whose pipeline gives 0.012"),
    ("captions", "data.captions=none: model.pretrained is a text-to-image pipeline"),
    ("truncated-vae", "vae/diffusion_pytorch_model.safetensors: its tensors need "),
    ("header-unet", "unet/diffusion_pytorch_model.safetensors: its header is not valid JSON"),
    ("truncated-single", "model.pretrained.path: its tensors need "),
    ("missing-shard", "unet/diffusion_pytorch_model.safetensors.index.json: names the shard "
                      "diffusion_pytorch_model-00002-of-00002.safetensors, which is not in "),
])
def test_each_bad_pipeline_or_contradiction_is_one_line_before_any_weight_is_read(sd, tmp_path, case, says):
    pipe = tmp_path / "nowhere" if case == "missing" else copy(sd, tmp_path / "p")
    over = {}
    if case == "pickle":
        (pipe / "unet" / "diffusion_pytorch_model.safetensors").unlink()
        (pipe / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04not read")  # never opened
    elif case == "pipeline":
        edit_json(pipe / "model_index.json", _class_name="KandinskyPipeline")
    elif case == "component":
        edit_json(pipe / "model_index.json", unet=["diffusers", "UNet2DModel"])
    elif case == "scaling":
        c = json.loads((pipe / "vae" / "config.json").read_text())
        del c["scaling_factor"]
        (pipe / "vae" / "config.json").write_text(json.dumps(c))
    elif case == "single":
        (tmp_path / "unet.ckpt").write_bytes(b"\x80\x04not read")  # never opened
        over = {"model": {"pretrained": {"path": str(tmp_path / "unet.ckpt"), "config": str(pipe)}}}
    elif case == "file":
        over = {"model": {"pretrained": str(pipe / "unet" / "diffusion_pytorch_model.safetensors")}}
    elif case in ("arch", "kwargs", "schedule"):
        extra = {"arch": {"arch": "dit"}, "kwargs": {"kwargs": {"block_out_channels": [8, 16]}},
                 "schedule": {"ddpm": {"beta_end": 0.03}}}[case]
        over = {"model": {"pretrained": str(pipe), **extra}}
    elif case == "captions":
        over = {"data": {"captions": "none", "val_fraction": 0.0}}
    elif case in ("truncated-vae", "header-unet", "truncated-single"):
        f = pipe / ("vae" if case == "truncated-vae" else "unet") / "diffusion_pytorch_model.safetensors"
        b = f.read_bytes()
        f.write_bytes(b[:8] + b"!" * 8 + b[16:] if case == "header-unet" else b[:-7])
        if case == "truncated-single":
            over = {"model": {"pretrained": {"path": str(f), "config": str(pipe)}}}
    elif case == "missing-shard":  # a sharded part copied short: its index names a shard that is not there
        (pipe / "unet" / "diffusion_pytorch_model.safetensors").rename(
            pipe / "unet" / "diffusion_pytorch_model-00001-of-00002.safetensors")
        (pipe / "unet" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "diffusion_pytorch_model-00001-of-00002.safetensors",
            "b": "diffusion_pytorch_model-00002-of-00002.safetensors"}}))
    assert says in refusal(raw(tmp_path, pipe, **over))


def test_a_part_with_only_variant_weights_is_one_line_naming_the_conversion_and_the_conversion_works(sd, tmp_path):
    """save_pretrained(variant="fp16") writes diffusion_pytorch_model.fp16.safetensors and model.fp16.safetensors
    only, as a Hub download of the fp16 files leaves them: diffrelay reads the plain weights, so the config is
    refused when it is read (not at the first step, or in prepare), naming the part, the file and the fix."""
    import diffusers
    import torch

    source = diffusers.DiffusionPipeline.from_pretrained(sd, local_files_only=True)
    source.save_pretrained(tmp_path / "fp16", safe_serialization=True, variant="fp16")
    says = refusal(raw(tmp_path, tmp_path / "fp16"))
    assert "unet/diffusion_pytorch_model.fp16.safetensors: unet/ holds only the fp16 variant's weights" in says
    assert "DiffusionPipeline.from_pretrained(folder, variant='fp16', torch_dtype=torch.float32)" in says
    # Each loaded part is checked: the network, the VAE unless data.encoder_path replaces it, the text encoders.
    mixed = copy(sd, tmp_path / "mixed")
    for part in ("vae", "text_encoder"):
        shutil.rmtree(mixed / part)
        shutil.copytree(tmp_path / "fp16" / part, mixed / part)
    assert "vae/ holds only the fp16 variant's weights" in refusal(raw(tmp_path, mixed))
    says = refusal(raw(tmp_path, mixed, data={"encoder_path": str(sd / "vae")}))
    assert "text_encoder/model.fp16.safetensors: text_encoder/ holds only" in says
    (mixed / "text_encoder" / "model.fp16.safetensors").unlink()
    says = refusal(raw(tmp_path, mixed, data={"encoder_path": str(sd / "vae")}))
    assert f"{mixed / 'text_encoder'}: " in says and "no *.safetensors weights" in says
    empty = copy(sd, tmp_path / "empty")
    (empty / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    assert f"{empty / 'unet'}: no weights (*.safetensors) in unet/" in refusal(raw(tmp_path, empty))
    # What the line says to do gives a folder that validates, with the variant's weights as float32.
    diffusers.DiffusionPipeline.from_pretrained(tmp_path / "fp16", variant="fp16", torch_dtype=torch.float32,
                                                local_files_only=True).save_pretrained(tmp_path / "out",
                                                                                       safe_serialization=True)
    config.validate(raw(tmp_path, tmp_path / "out"))
    got = load_file(tmp_path / "out" / "unet" / "diffusion_pytorch_model.safetensors")
    want = load_file(sd / "unet" / "diffusion_pytorch_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_pixart_alpha_takes_120_masked_t5_tokens_and_its_size_conditions_in_pixels(tmp_path):
    alpha = pipelines.pixart_sigma(tmp_path / "alpha", alpha=True)
    d = config.validate(raw(tmp_path, alpha))
    assert (d["model"]["arch"], d["model"]["kwargs"]["use_additional_conditions"]) == ("pixart", True)
    assert d["model"]["kwargs"]["pixel_size"] == 16  # resolution and aspect ratio in pixels, as the pipeline's
    assert [(e["max_length"], e["use_mask"]) for e in d["data"]["text_encoders"]] == [(120, True)]


def test_a_pipeline_run_samples_with_the_folders_scheduler_unless_told_otherwise(sd, tmp_path):
    from diffrelay.sampling import schedulers, settings

    pipe = copy(sd, tmp_path / "p")
    # SDXL base's scheduler_config.json as the Hub has it: Euler with keys of other classes (skip_prk_steps,
    # set_alpha_to_one), which diffusers' from_config ignores too.
    edit_json(pipe / "scheduler" / "scheduler_config.json", _class_name="EulerDiscreteScheduler",
              timestep_spacing="leading", steps_offset=1, skip_prk_steps=True, set_alpha_to_one=False)
    d = config.validate({**raw(tmp_path, pipe), "sample": {"steps": 4}})
    assert d["sample"]["scheduler"] == "pipeline"
    built = schedulers.build(settings.Settings.from_section(d["sample"]), d["model"], "ft.yaml")
    assert type(built).__name__ == "EulerDiscreteScheduler"
    assert (built.config.timestep_spacing, built.config.steps_offset, built.config.beta_end) == ("leading", 1, 0.012)
    # The run's schedule over the folder's (a fine-tune to v-prediction samples v), the user's keys over both.
    d = config.validate({**raw(tmp_path, pipe, model={"pretrained": str(pipe), "ddpm": {
        "prediction_type": "v_prediction"}}), "sample": {"steps": 4, "scheduler": "pipeline",
                                                          "scheduler_kwargs": {"timestep_spacing": "trailing"}}})
    built = schedulers.build(settings.Settings.from_section(d["sample"]), d["model"], "ft.yaml")
    assert (built.config.prediction_type, built.config.timestep_spacing) == ("v_prediction", "trailing")
    # Another class (--scheduler, sample.scheduler) takes the folder's keys it accepts first, as diffusers'
    # EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config) does; the run's schedule over them.
    import diffusers

    d = config.validate({**raw(tmp_path, pipe), "sample": {"steps": 4, "scheduler": "EulerAncestralDiscreteScheduler"}})
    built = schedulers.build(settings.Settings.from_section(d["sample"]), d["model"], "ft.yaml")
    want = diffusers.EulerAncestralDiscreteScheduler.from_config(
        diffusers.EulerDiscreteScheduler.from_pretrained(pipe / "scheduler").config)
    assert (built.config.timestep_spacing, built.config.steps_offset) == ("leading", 1)
    keys = [k for k in built.config if not k.startswith("_")]  # from_config also carries keys the class ignores
    assert {k: built.config[k] for k in keys} == {k: want.config[k] for k in keys}
    # A solver of one's own keeps the objective's sampler; without a pipeline, `pipeline` is one line.
    assert config.validate(raw(tmp_path, pipe))["sample"]["scheduler"] is None  # raw() sets solver: ddim
    scratch = {"model": {"objective": "flow"}, "sample": {"scheduler": "pipeline", "solver": "euler"}}
    with pytest.raises(UserError, match=r"sample.scheduler=pipeline: the scheduler of model.pretrained's folder"):
        config.validate(scratch, "ft.yaml")


def test_a_single_file_network_loads_with_its_config_folder_as_from_single_file_does(sd, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from diffrelay import objectives
    from diffrelay.pretrained import weights

    # A fine-tuned UNet shared as one file, beside its base pipeline's folder (here without the UNet's own weights).
    tuned = {k: v + 0.01 for k, v in load_file(sd / "unet" / "diffusion_pytorch_model.safetensors").items()}
    save_file(tuned, tmp_path / "tuned.safetensors")
    base = copy(sd, tmp_path / "base")
    (base / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    spec = {"path": str(tmp_path / "tuned.safetensors"), "config": str(base)}
    d = config.validate(raw(tmp_path, base, model={"pretrained": spec}))
    sums = d["model"]["pretrained"]["sha256"]
    assert sums["single-file/tuned.safetensors"] == hashlib.sha256((tmp_path / "tuned.safetensors").read_bytes()
                                                                    ).hexdigest()
    assert d["model"]["pretrained"]["config"] == str(base) and config.validate(d) == d
    net = objectives.build(d["model"], 8, 0, 4, text={"states": 32, "length": 77, "pooled": 0})
    weights.load_initial(net, d["model"]["pretrained"])
    got = weights.text_net(net).state_dict()
    assert set(got) == set(tuned) and all(torch.equal(got[k], tuned[k]) for k in tuned)
    # PixArt's transformer is no class diffusers' from_single_file loads: one line, before any weight is read.
    pix = pipelines.pixart_sigma(tmp_path / "pix")
    spec = {"path": str(tmp_path / "tuned.safetensors"), "config": str(pix)}
    assert "a single-file PixArtTransformer2DModel is not loaded" in refusal(raw(tmp_path, pix, model={
        "pretrained": spec}))


def test_the_pipeline_sampler_is_checked_against_the_folders_class_before_any_work(sd, tmp_path):
    import inspect

    import diffusers

    from diffrelay.pretrained import parts

    # The static table is the installed diffusers' (the check is torch-free).
    for key, classes in parts.TAKES.items():
        have = {n for n in parts.DDPM_SCHEDULERS if key in inspect.signature(getattr(diffusers, n).__init__).parameters}
        assert have == set(classes), key
    pipe = copy(sd, tmp_path / "p")
    edit_json(pipe / "scheduler" / "scheduler_config.json", _class_name="PNDMScheduler")  # SD 1.5's
    zsnr = {"pretrained": str(pipe), "ddpm": {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction"}}
    msg = refusal({**raw(tmp_path, pipe, model=zsnr), "sample": {"steps": 4}})
    assert "sample.scheduler=pipeline: the folder's PNDMScheduler has no rescale_betas_zero_snr" in msg
    assert "DDIMScheduler" in msg
    # A guidance interval keeps the objective's sampler: no pipeline default (the pipelines guide every step).
    (pipe / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}))
    d = config.validate({**raw(tmp_path, pipe), "sample": {"steps": 4, "guidance": [3.0],
                                                           "guidance_interval": [0.2, 0.8]}})
    assert (d["sample"]["scheduler"], d["sample"]["solver"]) == (None, "heun")
    assert config.validate({**raw(tmp_path, pipe), "sample": {"steps": 4}})["sample"]["scheduler"] == "pipeline"


def test_a_solver_given_to_diffrelay_sample_replaces_the_pipeline_sampler(sd, tmp_path):
    from diffrelay import cli
    from diffrelay.sampling import settings

    d = config.validate({**raw(tmp_path, sd), "sample": {"steps": 4}})
    assert d["sample"]["scheduler"] == "pipeline"
    for flags, want in ((["--solver", "ddim"], (None, "ddim")), ([], ("pipeline", "heun")),
                        (["--solver", "ddim", "--scheduler", "UniPCMultistepScheduler"],
                         ("UniPCMultistepScheduler", "ddim"))):
        args = cli.build_parser().parse_args(["sample", "--snapshot", "s.safetensors", "--out", "o", *flags])
        s, _ = settings.from_args(args, json.loads(json.dumps(d)), config.validate)
        assert (s.scheduler, s.solver) == want, flags


def test_the_docs_example_over_the_base_config_validates_on_a_small_fine_tune_set(sd, tmp_path):
    """docs/pretrained.md's first example, layered over config/config.yaml as the README layers every file: the
    pipeline decides class conditioning (the base's class_conditional: true is no refusal), and the base's
    fid.ref_images: 1000 does not refuse 60 images, whose held-out split is the reference."""
    import re

    import numpy as np
    from PIL import Image

    repo = Path(__file__).resolve().parents[1]
    example = re.search(r"```yaml\n(.*?)```", (repo / "docs/pretrained.md").read_text(), re.S).group(1)
    example = example.replace("/models/stable-diffusion-v1-5", str(sd)).replace("my-images", str(tmp_path / "imgs"))
    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir()
    for i in range(60):
        Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype="uint8")).save(tmp_path / "imgs" / f"{i}.png")
        (tmp_path / "imgs" / f"{i}.txt").write_text(f"photo {i}")
    (tmp_path / "ex.yaml").write_text(example)
    cfg = config.load([repo / "config/config.yaml", tmp_path / "ex.yaml"],
                      {"run": {"results": str(tmp_path / "results"), "resources": str(tmp_path / "resources")}})
    assert cfg.model.class_conditional is False and cfg.fid.ref_images == 1000 and cfg.data.val_fraction > 0
    preflight.check_inputs(cfg, "ex.yaml")
