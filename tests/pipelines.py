"""Tiny diffusers pipelines for the tests, built from configs and written as DiffusionPipeline.save_pretrained
writes them (model_index.json, unet/, vae/, text_encoder*/, tokenizer*/, scheduler/; safetensors only).

Nothing is downloaded: the text encoders are tests/textmodels' (the shapes captions' vocabulary), every weight is
drawn from a seeded generator. A pipeline is a few 10k parameters and saves in about a second.
"""

import shutil
from pathlib import Path

import textmodels

# A 2-level UNet2DConditionModel (latents down by 2 inside), attention at the second level.
UNET = {"block_out_channels": [16, 32], "layers_per_block": 1, "attention_head_dim": 8, "norm_num_groups": 8,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"]}
# A 2-level AutoencoderKL: pixels down by 2 into 4 latent channels.
VAE = {"block_out_channels": [8, 16], "layers_per_block": 1, "norm_num_groups": 8, "latent_channels": 4,
       "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
       "scaling_factor": 0.5}
# Stable Diffusion's schedule (scheduler_config.json of runwayml/stable-diffusion-v1-5, less its sampling keys).
SD_SCHEDULE = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
               "prediction_type": "epsilon", "num_train_timesteps": 1000}


def _clip(folder: Path, projection: bool = False, hidden: int = 32, seed: int = 0):
    """(model, tokenizer) of a tiny CLIP text encoder, read back from the folder textmodels writes."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    textmodels.clip_text(folder, projection=projection, hidden=hidden, seed=seed)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls.from_pretrained(folder, local_files_only=True), CLIPTokenizer.from_pretrained(folder)


def sd(folder, work=None, prediction_type: str = "epsilon", seed: int = 0, **unet) -> Path:
    """A Stable Diffusion 1.x-style pipeline: UNet2DConditionModel (cross-attention 32 wide), AutoencoderKL, one
    CLIP text encoder and a DDPMScheduler. `work`: a scratch folder for the encoder (default: beside `folder`)."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    folder = Path(folder)
    work = Path(work or folder.parent / f"{folder.name}-parts")
    encoder, tokenizer = _clip(work / "clip")
    torch.manual_seed(seed)
    net = UNet2DConditionModel(**(UNET | {"sample_size": 8, "in_channels": 4, "out_channels": 4,
                                          "cross_attention_dim": 32} | unet))
    vae = AutoencoderKL(**VAE)
    scheduler = DDPMScheduler(**(SD_SCHEDULE | {"prediction_type": prediction_type, "clip_sample": False}))
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=encoder, tokenizer=tokenizer, unet=net, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def sdxl(folder, work=None, seed: int = 0) -> Path:
    """An SDXL-style pipeline: two CLIPs (the second with projection, pooled), a text_time UNet."""
    import torch
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline,
                           UNet2DConditionModel)

    folder = Path(folder)
    work = Path(work or folder.parent / f"{folder.name}-parts")
    enc1, tok1 = _clip(work / "clip1", hidden=32, seed=1)
    enc2, tok2 = _clip(work / "clip2", projection=True, hidden=32, seed=2)
    torch.manual_seed(seed)
    net = UNet2DConditionModel(**(UNET | {"sample_size": 8, "in_channels": 4, "out_channels": 4,
                                          "cross_attention_dim": 64, "addition_embed_type": "text_time",
                                          "addition_time_embed_dim": 8,
                                          "projection_class_embeddings_input_dim": 6 * 8 + 32}))
    pipe = StableDiffusionXLPipeline(vae=AutoencoderKL(**VAE), text_encoder=enc1, text_encoder_2=enc2, tokenizer=tok1,
                                     tokenizer_2=tok2, unet=net, scheduler=EulerDiscreteScheduler(**SD_SCHEDULE))
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def _t5(folder: Path, d_model: int, seed: int, spiece: bool = False):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, T5EncoderModel

    textmodels.t5(folder, d_model=d_model, seed=seed, spiece=spiece)
    return (T5EncoderModel.from_pretrained(folder, local_files_only=True),
            (AutoTokenizer if spiece else PreTrainedTokenizerFast).from_pretrained(folder, local_files_only=True))


def _as_spiece(tokenizer_folder: Path, source: Path) -> None:
    """The pipeline's tokenizer folder as the Hub's PixArt and HunyuanDiT folders hold it: spiece.model and its
    configs from `source` (textmodels.spiece_tokenizer), no tokenizer.json (save_pretrained wrote one)."""
    shutil.rmtree(tokenizer_folder)
    tokenizer_folder.mkdir()
    for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, tokenizer_folder / name)


def sd3(folder, work=None, seed: int = 0, **transformer) -> Path:
    """An SD3-style pipeline: SD3Transformer2DModel, two CLIPs with projection (pooled, 32 + 32), a T5 64 wide (the
    CLIPs' 64 features zero-padded to it), FlowMatchEulerDiscreteScheduler with shift 3 (SD3-medium's), and a VAE
    with SD3's shift_factor beside its scaling_factor. `transformer`: more config keys (sd35's)."""
    import torch
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    folder = Path(folder)
    work = Path(work or folder.parent / f"{folder.name}-parts")
    enc1, tok1 = _clip(work / "clip1", projection=True, hidden=32, seed=1)
    enc2, tok2 = _clip(work / "clip2", projection=True, hidden=32, seed=2)
    enc3, tok3 = _t5(work / "t5", 64, seed=3)
    torch.manual_seed(seed)
    net = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=64,
                                caption_projection_dim=16, pooled_projection_dim=64, pos_embed_max_size=8,
                                **transformer)
    pipe = StableDiffusion3Pipeline(transformer=net, vae=AutoencoderKL(**(VAE | {"shift_factor": 0.1})),
                                    scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    text_encoder=enc1, tokenizer=tok1, text_encoder_2=enc2, tokenizer_2=tok2,
                                    text_encoder_3=enc3, tokenizer_3=tok3)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


# FLUX.1-dev's scheduler/scheduler_config.json (shift 3 is unused there: use_dynamic_shifting); schnell's is shift 1,
# no dynamic shifting.
FLUX_DEV_SCHEDULE = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                     "base_image_seq_len": 256, "max_image_seq_len": 4096}
FLUX_SCHNELL_SCHEDULE = {"shift": 1.0, "use_dynamic_shifting": False}


def flux(folder, work=None, seed: int = 0, schnell: bool = False) -> Path:
    """A FLUX.1-style pipeline: FluxTransformer2DModel (one double-stream and one single-stream block, rotary axes
    2 + 2 + 4 = the head's 8), a CLIPTextModel (pooled, 32 wide), a T5 32 wide, a VAE with a shift_factor and the
    FLUX.1-dev scheduler (guidance_embeds) or schnell's (none)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    folder = Path(folder)
    work = Path(work or folder.parent / f"{folder.name}-parts")
    enc1, tok1 = _clip(work / "clip", hidden=32, seed=1)
    enc2, tok2 = _t5(work / "t5", 32, seed=3)
    torch.manual_seed(seed)
    net = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                 guidance_embeds=not schnell, axes_dims_rope=(2, 2, 4))
    schedule = FLUX_SCHNELL_SCHEDULE if schnell else FLUX_DEV_SCHEDULE
    pipe = FluxPipeline(transformer=net, vae=AutoencoderKL(**(VAE | {"shift_factor": 0.1})),
                        scheduler=FlowMatchEulerDiscreteScheduler(**schedule), text_encoder=enc1, tokenizer=tok1,
                        text_encoder_2=enc2, tokenizer_2=tok2)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def flux_schnell(folder, work=None, seed: int = 0) -> Path:
    return flux(folder, work, seed, schnell=True)


def sd35(folder, work=None, seed: int = 0) -> Path:
    """An SD3.5-style pipeline: SD3's, its transformer with SD3.5's RMS-normed queries and keys (qk_norm, Large and
    Medium) and Medium's second attention in its first block (dual_attention_layers)."""
    return sd3(folder, work, seed, qk_norm="rms_norm", dual_attention_layers=(0,))


def pixart_sigma(folder, work=None, seed: int = 0, alpha: bool = False) -> Path:
    """A PixArt-Sigma-style pipeline: PixArtTransformer2DModel with learned sigma (8 = 2 x 4 output channels) and
    no additional conditions (PixArt-Sigma's), one T5 (the mask passed), DPMSolverMultistepScheduler as the
    pipeline ships it (epsilon, linear betas). alpha: PixArt-alpha's, with the resolution and aspect-ratio
    conditions (use_additional_conditions; PixArtAlphaPipeline passes them only to a transformer of sample_size 128,
    the 1024 px model's, so a tiny one cannot be called by the pipeline with them) and PixArtAlphaPipeline."""
    import diffusers
    import torch
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtTransformer2DModel

    folder = Path(folder)
    work = Path(work or folder.parent / f"{folder.name}-parts")
    enc, tok = _t5(work / "t5", 32, seed=3, spiece=True)  # case-sensitive, as the real T5's
    torch.manual_seed(seed)
    # PixArt-alpha's size embeddings take a third of the width each: heads x head dim divisible by 3 there.
    net = PixArtTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=8, num_layers=2,
                                   attention_head_dim=8, num_attention_heads=3 if alpha else 2,
                                   cross_attention_dim=24 if alpha else 16,
                                   caption_channels=32, norm_num_groups=8, use_additional_conditions=alpha,
                                   interpolation_scale=None)
    cls = diffusers.PixArtAlphaPipeline if alpha else diffusers.PixArtSigmaPipeline
    pipe = cls(transformer=net, vae=AutoencoderKL(**VAE), text_encoder=enc, tokenizer=tok,
               scheduler=DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02))
    pipe.save_pretrained(folder, safe_serialization=True)
    _as_spiece(folder / "tokenizer", work / "t5")
    return folder


# HunyuanDiT-v1.1-Diffusers' scheduler/scheduler_config.json (Tencent's train_v1.1.sh: --noise-schedule
# scaled_linear --beta-start 0.00085 --beta-end 0.03 --predict-type v_prediction), less the keys DDPMScheduler does
# not take (set_alpha_to_one, skip_prk_steps) and those at their defaults.
HUNYUAN_SCHEDULE = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.03,
                    "prediction_type": "v_prediction", "num_train_timesteps": 1000, "clip_sample": False,
                    "steps_offset": 1, "timestep_spacing": "leading", "variance_type": "fixed_small"}
# A 4-level AutoencoderKL: pixels down by 8, as HunyuanDiTPipeline assumes (its rotary grid is height // 8 // patch).
VAE8 = VAE | {"block_out_channels": [8, 8, 8, 8], "down_block_types": ["DownEncoderBlock2D"] * 4,
              "up_block_types": ["UpDecoderBlock2D"] * 4}
# A 4-block HunyuanDiT2DModel (one long skip): 4 latent channels in, 8 out (learn_sigma), 16 wide, the pipeline's 77 + 256 tokens.
HUNYUAN = {"num_attention_heads": 2, "attention_head_dim": 8, "hidden_size": 16, "num_layers": 4, "patch_size": 2,
           "sample_size": 8, "in_channels": 4, "learn_sigma": True, "cross_attention_dim": 32,
           "cross_attention_dim_t5": 32, "pooled_projection_dim": 16, "text_len": 77, "text_len_t5": 256,
           "use_style_cond_and_image_meta_size": True}


def bert(folder: Path, hidden: int = 32, seed: int = 0):
    """(model, tokenizer) of a tiny BertModel whose vocab.txt (written here) holds textmodels.WORDS."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(textmodels.WORDS)]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = BertTokenizer(str(folder / "vocab.txt"), model_max_length=512)
    assert tokenizer("a red circle")["input_ids"][1:-1] == [words.index(w) for w in ("a", "red", "circle")]
    config = BertConfig(vocab_size=len(words), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=512, pad_token_id=0)
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return BertModel.from_pretrained(folder, local_files_only=True), tokenizer


def hunyuandit(folder, work=None, seed: int = 0, **transformer) -> Path:
    """A HunyuanDiT-style pipeline: HunyuanDiT2DModel (HUNYUAN), a 4-level AutoencoderKL (VAE8), a tiny BertModel
    (text_encoder) and tests' tiny T5 (text_encoder_2), HunyuanDiT's DDPMScheduler (HUNYUAN_SCHEDULE)."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline
    from transformers import AutoTokenizer, T5EncoderModel

    folder = Path(folder)
    work = Path(work or folder.parent / f"{folder.name}-parts")
    enc1, tok1 = bert(work / "bert", seed=1)
    textmodels.t5(work / "t5", seed=2, spiece=True)
    enc2 = T5EncoderModel.from_pretrained(work / "t5", local_files_only=True)
    tok2 = AutoTokenizer.from_pretrained(work / "t5", local_files_only=True)
    torch.manual_seed(seed)
    net = HunyuanDiT2DModel(**(HUNYUAN | transformer))
    pipe = HunyuanDiTPipeline(vae=AutoencoderKL(**VAE8), text_encoder=enc1, tokenizer=tok1, transformer=net,
                              scheduler=DDPMScheduler(**HUNYUAN_SCHEDULE), safety_checker=None, feature_extractor=None,
                              requires_safety_checker=False, text_encoder_2=enc2, tokenizer_2=tok2)
    pipe.save_pretrained(folder, safe_serialization=True)
    _as_spiece(folder / "tokenizer_2", work / "t5")
    return folder
