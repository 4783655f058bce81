"""sample.scheduler (diffrelay.sampling.schedulers) against diffusers' own pipelines: same weights, prompts, negative
prompts, seeds, steps, guidance and scheduler; the latents compared.

  python benchmarks/checks/check_diffusers_sampling.py [--diffusers-src /path/to/diffusers/src] [--schedulers A,B]

--diffusers-src is the `src` folder of a diffusers checkout, put first on sys.path (the script checks that
diffusers.__file__ is under it); without it the installed diffusers is the reference. Nothing is downloaded: the
models are tiny, built here from configs with seeded weights.

  sd/<case>/<Scheduler>:  a tiny StableDiffusionPipeline in memory (UNet2DConditionModel, AutoencoderKL, and a
      CLIPTextModel with its tokenizer written by diffrelay.text.demo.clip_text), called as a user calls it:
      pipe(prompts, negative_prompt=..., num_inference_steps, guidance_scale, generator=[one per image],
      output_type="latent"), its scheduler Scheduler.from_config(<case's config>), the way diffusers' docs swap
      schedulers. Against diffrelay's side: the prompts encoded by diffrelay's text encoders (text/encoders.py)
      into a Text with the negative prompts as its null rows, the pipeline's UNet under diffrelay's network
      contract (families.network.TextNet in ddpm.EpsModel), diffrelay's guidance (sampling/guidance.py) and
      schedulers.build/sample with model.ddpm and sample.scheduler_kwargs set to the case; the initial noise is
      generate()'s, randn of each image's own generator (the pipeline's prepare_latents draws the same numbers).
      The comparison is at the sampling loop's level: generate()'s batching, padding and PNG writing are left out
      (tests/test_sample_scheduler.py checks those). Cases: sd15 (Stable Diffusion 1.5's scheduler config:
      scaled_linear, epsilon, steps_offset 1) with every DDPM-family scheduler; vzsnr (v_prediction, zero terminal
      SNR, trailing spacing) with those that take rescale_betas_zero_snr; karras-sde (DPM-Solver++ SDE on Karras
      sigmas: noise drawn in every step); ddim-eta (DDIM with eta 0.5).
  sd3/FlowMatchEulerDiscreteScheduler (and FlowMatchHeun): a tiny StableDiffusion3Pipeline given the prompt
      embeddings (no text encoders), shift 3, against TextNet("sd3") in flow.VelocityModel.
  hunyuandit/<Scheduler>: a tiny HunyuanDiTPipeline (HunyuanDiT2DModel, learn_sigma; a 4-level VAE, the 8x the
      pipeline's rotary grid assumes) given the prompt embeddings and masks of both its encoders (random, with
      padding: the BertModel's 16 wide, the T5's 32), its scheduler HunyuanDiT-v1.1-Diffusers' DDPMScheduler config
      (v_prediction, scaled_linear to 0.03, steps_offset 1: stochastic, noise from each image's generator) and
      DDIM/DPM-Solver++ from it; called with use_resolution_binning=False, original_size = the image's side (its
      default is 1024; diffrelay's image_meta_size is pixel_size's, as SDXL's time ids), guidance_rescale 0.0
      (its default). Against TextNet("hunyuandit") in ddpm.EpsModel fed the combined Text (the Bert block
      zero-padded to the T5's width, then the T5's tokens), diffrelay's guidance and schedulers; the initial
      noise is generate()'s draw, which the pipeline's prepare_latents draws alike.
  flux-dev/FlowMatchEulerDiscreteScheduler and flux-schnell/...: a tiny FluxPipeline (FluxTransformer2DModel with
      guidance_embeds for dev, without for schnell; a 2-level VAE, scale factor 2) given the prompt embeddings
      (random, no text encoders), its scheduler FLUX.1-dev's (shift 3, use_dynamic_shifting: mu from the packed
      token count, pipeline_flux's calculate_shift) or FLUX.1-schnell's (shift 1), called with guidance_scale 3.5
      (dev: the transformer's guidance input; schnell's pipeline ignores it) on a non-square 16 x 24 image (8 x 12
      latents: 4 x 6 tokens, so the image ids and the 2 x 2 packing are exercised). Against families.flux's TextNet
      (the pipeline transformer's state dict loaded; its square `resolution` is only checked for evenness, the
      forward takes any even H, W) in flow.VelocityModel, fed a Text with guidance = torch.full((B,), 3.5) for dev
      (none for schnell), one forward a step (FLUX.1's guidance is no classifier-free guidance: guidance.guided
      at scale 1 is the bare network), schedulers.build/sample with model.arch flux (FluxPipeline's sigmas and
      mu). The pipeline returns packed latents (B, tokens, 4C); they are compared after FluxPipeline._unpack_latents,
      in diffrelay's (B, C, H, W) layout.
  config/...: the scheduler diffrelay builds has the reference's config, key for key.
What it covers is the loop around each scheduler's step() (timesteps, scale_model_input, guidance, the initial and
per-step noise): both sides build the same diffusers scheduler classes from the same checkout, so a fault inside a
scheduler's step() moves both alike and is not seen here. check_diffusers_objective.py compares DDIMScheduler.step
and EulerDiscreteScheduler.step with the papers' updates written out (ddim-step/*, euler-step/*).
Bound: max |latent difference| = 0, equal bit for bit: the same float32 arithmetic on the same batches (with
sample.scheduler diffrelay's guidance puts the unconditional rows first, as the pipelines do; the other order
moves the last bits, 8e-5 on latents of size 48 with EulerDiscreteScheduler). Exit status 1 with one FAIL line per
figure outside its bound. Writes benchmarks/results/diffusers_sampling.json.
"""

import argparse
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
from official import RESULTS, Gate, write_results

SEEDS = [5, 6, 7]
PROMPTS = ["a red circle top left", "a photo of a blue square", "a green triangle"]
NEGATIVE = ["a blue square", "", "a photo"]
STEPS, GUIDANCE = 4, 3.0
BOUND = 0.0  # bit for bit (see the docstring)
SD15 = {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
        "prediction_type": "epsilon", "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1,
        "skip_prk_steps": True, "trained_betas": None}
VZSNR = {**SD15, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
# HunyuanDiT-v1.1-Diffusers' scheduler/scheduler_config.json, its DDPMScheduler keys (also Tencent's train_v1.1.sh).
HUNYUAN = {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.03,
           "prediction_type": "v_prediction", "clip_sample": False, "steps_offset": 1, "timestep_spacing": "leading",
           "variance_type": "fixed_small", "trained_betas": None, "rescale_betas_zero_snr": False}
HUNYUAN_SCHEDULERS = ("DDPMScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler")
# FLUX.1-dev's and FLUX.1-schnell's scheduler/scheduler_config.json keys (FlowMatchEulerDiscreteScheduler).
FLUX = {"dev": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096},
        "schnell": {"num_train_timesteps": 1000, "shift": 1.0}}
FLUX_GUIDANCE = 3.5  # FluxPipeline's guidance_scale default: dev's guidance input
FLUX_SIZE = (16, 24)  # pixels (H, W): 8 x 12 latents, 4 x 6 tokens
# The keys diffrelay takes from model.ddpm (the rest of a case's config goes to sample.scheduler_kwargs).
MODEL_KEYS = ("beta_schedule", "beta_start", "beta_end", "prediction_type", "rescale_betas_zero_snr")


def import_diffusers(src: Path | None):
    if src is not None:
        sys.path.insert(0, str(src))
        for name in [m for m in sys.modules if m == "diffusers" or m.startswith("diffusers.")]:
            del sys.modules[name]  # another diffusers was imported first: import this one
    import diffusers

    if src is not None and not Path(diffusers.__file__).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"diffusers imported from {diffusers.__file__}, not from {src}")
    return diffusers


def cases(diffusers, names=None) -> list[tuple[str, str, dict, float]]:
    """(case, scheduler class, reference config, eta)."""
    import inspect

    from diffrelay.sampling.schedulers import DDPM_FAMILY

    out = [("sd15", n, SD15, 0.0) for n in DDPM_FAMILY]
    out += [("vzsnr", n, VZSNR, 0.0) for n in DDPM_FAMILY
            if "rescale_betas_zero_snr" in inspect.signature(getattr(diffusers, n).__init__).parameters]
    out += [("karras-sde", "DPMSolverMultistepScheduler",
             {**SD15, "use_karras_sigmas": True, "algorithm_type": "sde-dpmsolver++"}, 0.0),
            ("ddim-eta", "DDIMScheduler", SD15, 0.5)]
    return [c for c in out if names is None or c[1] in names]


def sd_pipeline(diffusers, folder: Path):
    """A tiny StableDiffusionPipeline: 8x8 latents (a one-level VAE), a 2-level UNet, diffrelay's demo CLIP."""
    from transformers import AutoTokenizer, CLIPTextModel

    from diffrelay.text.demo import clip_text

    clip_text(folder, hidden=32)
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    with torch.no_grad():  # seeded weights large enough that every input bit matters (zero-init out conv)
        for p in unet.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    vae = diffusers.AutoencoderKL(block_out_channels=(32,), latent_channels=4, norm_num_groups=32,
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",))
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=CLIPTextModel.from_pretrained(folder, local_files_only=True),
        tokenizer=AutoTokenizer.from_pretrained(folder, local_files_only=True), unet=unet,
        scheduler=diffusers.DDIMScheduler.from_config(SD15), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _settings(name: str, config: dict, eta: float, kind: str, accepted, **extra):
    from diffrelay.objectives.ddpm import SamplerSettings
    from diffrelay.sampling import sample

    skip = set(MODEL_KEYS) | {"num_train_timesteps", "clip_sample", "trained_betas", "shift"}
    kwargs = {k: v for k, v in config.items() if k not in skip and k in accepted}
    return sample.default_settings(**{"steps": STEPS, "guidance": GUIDANCE, "scheduler": name,
                                      "scheduler_kwargs": kwargs, "ddpm": SamplerSettings(eta=eta), **extra})


def _same(ours, reference: dict, accepted) -> bool:
    """diffrelay's scheduler has the reference config on every key of the class (from_config keeps foreign keys
    too)."""
    return all(ours.config.get(k) == reference.get(k) for k in accepted if k not in ("self", "kwargs"))


def _noise(shape) -> tuple[list, torch.Tensor]:
    """generate()'s draw: one generator per image, its latent first (sample.generate)."""
    gens = [torch.Generator().manual_seed(s) for s in SEEDS]
    return gens, torch.stack([torch.randn(shape, generator=g) for g in gens])


def compare_sd(diffusers, pipe, text, case: str, name: str, config: dict, eta: float) -> tuple[float, bool]:
    """(max |diffrelay - pipeline| of the latents, whether the two schedulers' configs are equal)."""
    import inspect

    from diffrelay.families import of_network
    from diffrelay.families.network import TextNet
    from diffrelay.objectives import ddpm
    from diffrelay.sampling import guidance, prompted, schedulers

    cls = getattr(diffusers, name)
    pipe.scheduler = cls.from_config(config)
    reference = dict(pipe.scheduler.config)  # before the call: set_timesteps may rewrite it (DPMSolverSinglestep)
    want = pipe(PROMPTS, negative_prompt=NEGATIVE, num_inference_steps=STEPS, guidance_scale=GUIDANCE, eta=eta,
                generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="latent").images
    accepted = inspect.signature(cls.__init__).parameters
    s = _settings(name, config, eta, "ddpm", accepted)
    model = {"objective": "ddpm", "ddpm": {k: config[k] for k in MODEL_KEYS if k in config}}
    scheduler = schedulers.build(s, model, f"{case}/{name}")
    same = _same(scheduler, reference, accepted)
    net = ddpm.EpsModel(TextNet(of_network("diffusers-unet", pipe.unet.config), pipe.unet, 4, 0, 1.0, False, 8), 4)
    items = [types.SimpleNamespace(prompt=p, negative_prompt=n) for p, n in zip(PROMPTS, NEGATIVE)]
    cond = prompted.condition(text, items, "cpu", None, True, 0)
    gens, x = _noise((4, 8, 8))
    got = schedulers.sample(guidance.guided(net, GUIDANCE, 0, uncond_first=True), x, cond, STEPS, scheduler, gens,
                            eta)
    return float((got - want).abs().max()), same


def sd3_pipeline(diffusers):
    torch.manual_seed(0)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=8)
    with torch.no_grad():
        for p in transformer.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    vae = diffusers.AutoencoderKL(block_out_channels=(32,), latent_channels=4, norm_num_groups=32,
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",))
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
        tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def compare_sd3(diffusers, pipe, name: str) -> tuple[float, bool]:
    """FlowMatch* on SD3's pipeline, given the same prompt embeddings (random: the text encoders are not the
    subject here; benchmarks/checks/check_text_encoding.py compares those)."""
    import inspect

    from diffrelay.families import of_network
    from diffrelay.families.network import TextNet
    from diffrelay.objectives.flow import SamplerSettings, VelocityModel
    from diffrelay.sampling import guidance, schedulers
    from diffrelay.text.condition import Text

    g = torch.Generator().manual_seed(1)
    states, null_states = torch.randn(3, 6, 32, generator=g), torch.randn(3, 6, 32, generator=g)
    pooled, null_pooled = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    cls = getattr(diffusers, name)
    config = {"num_train_timesteps": 1000, "shift": 3.0}
    pipe.scheduler = cls.from_config(config)
    reference = dict(pipe.scheduler.config)
    want = pipe(prompt_embeds=states, negative_prompt_embeds=null_states, pooled_prompt_embeds=pooled,
                negative_pooled_prompt_embeds=null_pooled, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                height=8, width=8, generator=[torch.Generator().manual_seed(s) for s in SEEDS],
                output_type="latent").images
    s = _settings(name, config, 0.0, "flow", inspect.signature(cls.__init__).parameters,
                  flow=SamplerSettings(shift=3.0))
    scheduler = schedulers.build(s, {"objective": "flow"}, f"sd3/{name}")
    same = _same(scheduler, reference, inspect.signature(cls.__init__).parameters)
    net = VelocityModel(TextNet(of_network("sd3", pipe.transformer.config), pipe.transformer, 4, 0, 1000.0, False, 8))
    ones = torch.ones(3, 6, dtype=torch.int64)
    cond = Text(states, ones, pooled, null=Text(null_states, ones, null_pooled))
    gens, x = _noise((4, 8, 8))
    got = schedulers.sample(guidance.guided(net, GUIDANCE, 0, uncond_first=True), x, cond, STEPS, scheduler, gens)
    return float((got - want).abs().max()), same


def hunyuandit_pipeline(diffusers):
    torch.manual_seed(0)
    transformer = diffusers.HunyuanDiT2DModel(
        num_attention_heads=2, attention_head_dim=8, hidden_size=16, num_layers=4, patch_size=2, sample_size=8,
        in_channels=4, learn_sigma=True, cross_attention_dim=16, cross_attention_dim_t5=32, pooled_projection_dim=16,
        text_len=77, text_len_t5=256, use_style_cond_and_image_meta_size=True)
    with torch.no_grad():
        for p in transformer.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    vae = diffusers.AutoencoderKL(block_out_channels=(8,) * 4, latent_channels=4, norm_num_groups=8,
                                  down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    pipe = diffusers.HunyuanDiTPipeline(
        vae=vae, text_encoder=None, tokenizer=None, transformer=transformer,
        scheduler=diffusers.DDPMScheduler.from_config(HUNYUAN), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False, text_encoder_2=None, tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _masked(g, n: int, tokens: int, width: int):
    """(states (n, tokens, width), int64 mask) with each row's padding after a few tokens, as a tokenizer gives."""
    states = torch.randn(n, tokens, width, generator=g)
    mask = (torch.arange(tokens) < torch.randint(2, 9, (n, 1), generator=g)).to(torch.int64)
    return states, mask


def compare_hunyuandit(diffusers, pipe, name: str) -> tuple[float, bool]:
    """HunyuanDiTPipeline's loop against diffrelay's, given the same prompt embeddings of both encoders."""
    import inspect

    from diffrelay.families import of_network
    from diffrelay.families.network import TextNet
    from diffrelay.objectives import ddpm
    from diffrelay.sampling import guidance, schedulers
    from diffrelay.text.condition import Text

    g = torch.Generator().manual_seed(1)
    (s1, m1), (n1, nm1) = _masked(g, 3, 77, 16), _masked(g, 3, 77, 16)
    (s2, m2), (n2, nm2) = _masked(g, 3, 256, 32), _masked(g, 3, 256, 32)
    cls = getattr(diffusers, name)
    pipe.scheduler = cls.from_config(HUNYUAN)
    reference = dict(pipe.scheduler.config)
    want = pipe(prompt_embeds=s1, negative_prompt_embeds=n1, prompt_attention_mask=m1,
                negative_prompt_attention_mask=nm1, prompt_embeds_2=s2, negative_prompt_embeds_2=n2,
                prompt_attention_mask_2=m2, negative_prompt_attention_mask_2=nm2, num_inference_steps=STEPS,
                guidance_scale=GUIDANCE, height=64, width=64, original_size=(64, 64), use_resolution_binning=False,
                generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="latent").images
    accepted = inspect.signature(cls.__init__).parameters
    s = _settings(name, HUNYUAN, 0.0, "ddpm", accepted)
    model = {"objective": "ddpm", "ddpm": {k: HUNYUAN[k] for k in MODEL_KEYS}}
    scheduler = schedulers.build(s, model, f"hunyuandit/{name}")
    same = _same(scheduler, reference, accepted)
    family = of_network("hunyuandit", pipe.transformer.config)
    net = ddpm.EpsModel(TextNet(family, pipe.transformer, 4, 0, 1.0, True, 64), 4)

    def combined(a, ma, b, mb):  # text/encoders.py's layout: the Bert block zero-padded to the T5's width
        return torch.cat([torch.nn.functional.pad(a, (0, b.shape[-1] - a.shape[-1])), b], 1), torch.cat([ma, mb], 1)

    cond = Text(*combined(s1, m1, s2, m2), null=Text(*combined(n1, nm1, n2, nm2)))
    gens, x = _noise((4, 8, 8))
    got = schedulers.sample(guidance.guided(net, GUIDANCE, 0, uncond_first=True), x, cond, STEPS, scheduler, gens)
    return float((got - want).abs().max()), same


def flux_pipeline(diffusers, variant: str):
    """A tiny FluxPipeline: FLUX.1-dev's (guidance_embeds) or -schnell's transformer shape in small, a 2-level VAE
    (vae_scale_factor 2), no text encoders (called with prompt embeddings)."""
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=variant == "dev", axes_dims_rope=(2, 2, 4))
    with torch.no_grad():  # as sd3_pipeline: seeded weights with no zero-initialised layer left
        for p in transformer.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), latent_channels=4, norm_num_groups=8,
                                  down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                                  shift_factor=0.1, scaling_factor=0.5)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**FLUX[variant]), vae=vae, text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def compare_flux(diffusers, pipe, variant: str, name: str = "FlowMatchEulerDiscreteScheduler") -> tuple[float, bool]:
    """FluxPipeline's loop against diffrelay's (model.arch flux), given the same prompt embeddings; the latents
    compared unpacked, (B, C, H, W)."""
    import inspect

    from diffrelay.families import flux as flux_family
    from diffrelay.objectives.flow import SamplerSettings, VelocityModel
    from diffrelay.sampling import guidance, schedulers
    from diffrelay.text.condition import Text

    g = torch.Generator().manual_seed(1)
    n, tokens = len(SEEDS), 6
    states, pooled = torch.randn(n, tokens, 32, generator=g), torch.randn(n, 32, generator=g)
    cls = getattr(diffusers, name)
    config = FLUX[variant]
    pipe.scheduler = cls.from_config(config)
    reference = dict(pipe.scheduler.config)
    height, width = FLUX_SIZE
    packed = pipe(prompt_embeds=states, pooled_prompt_embeds=pooled, num_inference_steps=STEPS,
                  guidance_scale=FLUX_GUIDANCE, height=height, width=width,
                  generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="latent").images
    want = diffusers.FluxPipeline._unpack_latents(packed, height, width, pipe.vae_scale_factor)
    side = (height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    dev = variant == "dev"
    model_cfg = {"arch": "flux", "objective": "flow", "kwargs": {"guidance_embeds": dev}}
    # sample.guidance: dev's is the network's input, schnell's must be 1 (generate's classifier_free)
    scale, _ = guidance.classifier_free(model_cfg, FLUX_GUIDANCE if dev else 1.0)
    accepted = inspect.signature(cls.__init__).parameters
    s = _settings(name, config, 0.0, "flow", accepted, flow=SamplerSettings(shift=config["shift"]),
                  guidance=FLUX_GUIDANCE if dev else 1.0)
    scheduler = schedulers.build(s, model_cfg, f"flux-{variant}/{name}")
    same = _same(scheduler, reference, accepted)
    c = pipe.transformer.config
    net = flux_family.FAMILY.build(
        resolution=side[0], in_channels=4, num_classes=0, text={"states": 32, "length": tokens, "pooled": 32},
        guidance=FLUX_GUIDANCE, patch_size=c.patch_size, num_layers=c.num_layers,
        num_single_layers=c.num_single_layers, attention_head_dim=c.attention_head_dim,
        num_attention_heads=c.num_attention_heads, guidance_embeds=c.guidance_embeds,
        axes_dims_rope=tuple(c.axes_dims_rope))
    net.model.load_state_dict(pipe.transformer.state_dict())
    net = VelocityModel(net)
    cond = Text(states, torch.ones(n, tokens, dtype=torch.int64), pooled,
                guidance=torch.full((n,), FLUX_GUIDANCE, dtype=torch.float32) if dev else None)
    gens, x = _noise((4, *side))
    got = schedulers.sample(guidance.guided(net, scale, 0, uncond_first=True), x, cond, STEPS, scheduler, gens,
                            family=flux_family.FAMILY)
    return float((got - want).abs().max()), same


def run(diffusers, names=None) -> dict:
    """{case: (max difference, configs equal)} of every case (names: only these scheduler classes)."""
    from diffrelay.sampling.schedulers import FLOW_FAMILY
    from diffrelay.text import encoders
    from diffrelay.text.source import TextSource

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        chosen = cases(diffusers, names)
        if chosen:
            pipe = sd_pipeline(diffusers, Path(tmp) / "clip")
            recs = encoders.records([{"path": str(Path(tmp) / "clip")}])
            text = TextSource(recs, encoders.combined_dims(recs),
                              encoders=[encoders.load({"path": str(Path(tmp) / "clip")}, "cpu")])
            for case, name, config, eta in chosen:
                out[f"sd/{case}/{name}"] = compare_sd(diffusers, pipe, text, case, name, config, eta)
    flows = [n for n in FLOW_FAMILY if names is None or n in names]
    if flows:
        pipe = sd3_pipeline(diffusers)
        for name in flows:
            out[f"sd3/{name}"] = compare_sd3(diffusers, pipe, name)
    hunyuan = [n for n in HUNYUAN_SCHEDULERS if names is None or n in names]
    if hunyuan:
        pipe = hunyuandit_pipeline(diffusers)
        for name in hunyuan:
            out[f"hunyuandit/{name}"] = compare_hunyuandit(diffusers, pipe, name)
    if names is None or "FlowMatchEulerDiscreteScheduler" in names:  # FluxPipeline's sigmas: Heun takes none
        for variant in FLUX:
            out[f"flux-{variant}/FlowMatchEulerDiscreteScheduler"] = compare_flux(
                diffusers, flux_pipeline(diffusers, variant), variant)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--diffusers-src", type=Path, help="the src folder of a diffusers checkout (default: the "
                    "installed diffusers)")
    ap.add_argument("--schedulers", help="comma-separated scheduler classes (default: every supported one)")
    ap.add_argument("--out", type=Path, default=RESULTS / "diffusers_sampling.json")
    a = ap.parse_args(argv)
    diffusers = import_diffusers(a.diffusers_src)
    started = time.time()
    g = Gate()
    for case, (diff, same) in run(diffusers, a.schedulers.split(",") if a.schedulers else None).items():
        print(f"{case:60s} max |diff| {diff:.3g}")
        g.at_most(case, diff, BOUND)
        g.equal(f"config/{case}", same, True)
    write_results(a.out, "diffrelay's sample.scheduler against diffusers' StableDiffusionPipeline, "
                  "StableDiffusion3Pipeline, HunyuanDiTPipeline and FluxPipeline (latents, same weights, prompts, seeds and scheduler)",
                  diffusers=diffusers.__version__, diffusers_file=diffusers.__file__, steps=STEPS, guidance=GUIDANCE,
                  seeds=SEEDS, bound=BOUND, seconds=round(time.time() - started, 1), **g.to_json())
    g.finish("check_diffusers_sampling")


if __name__ == "__main__":
    main()
