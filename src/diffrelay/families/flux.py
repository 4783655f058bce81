"""FLUX.1 dev / schnell: FluxPipeline's FluxTransformer2DModel (model.arch flux).

joint_attention_dim = D (the T5's states alone: the CLIP gives only its pooled embedding, layer none),
pooled_projection_dim = P; in_channels = 4C, as FluxPipeline packs each 2 x 2 block of latent pixels into one token
(_pack_latents: token (i, j) holds channels c x (2 x 2) in that order) and unpacks its output the same way
(_unpack_latents). img_ids are the packed grid's (0, row, column) (_prepare_latent_image_ids), txt_ids zeros (the
pipeline's text_ids), no mask (FLUX takes none). The timestep is t in [0, 1] (time_scale 1: the transformer
multiplies it by 1000 itself, as the pipeline's timestep / 1000 expects). guidance_embeds (dev): the guidance input
is Text.guidance when the sampler sets it (sample.guidance, FluxPipeline's guidance_scale) and model.kwargs.guidance
otherwise, the value train_dreambooth_lora_flux.py feeds in training (its --guidance_scale, default 3.5), in float32
as its torch.tensor([guidance_scale]); schnell (guidance_embeds false) takes none. Sampling: FluxPipeline's sigmas
linspace(1, 1 / N, N) and its dynamic shift mu of the packed token count (sampling/schedulers.py); true
classifier-free guidance with a negative prompt is sample.true_cfg_scale. Encoders: the CLIP's pooler_output alone,
the T5's states unmasked, 512 tokens (FluxPipeline.encode_prompt).
"""

from diffrelay.errors import UserError
from diffrelay.families.base import ATTENTION_TARGETS, Family

GUIDANCE = 3.5  # train_dreambooth_lora_flux.py's --guidance_scale default (FluxPipeline's guidance_scale too)
T5_LENGTH = 512  # FluxPipeline.__call__'s max_sequence_length (and train_dreambooth_lora_flux.py's)


class Flux(Family):
    name = "FLUX.1 dev / schnell"
    short = "FLUX.1"
    arch = "flux"
    network_class = "FluxTransformer2DModel"
    pipelines = ("FluxPipeline",)
    own_kwargs = ("time_scale", "guidance")
    set_keys = ("joint_attention_dim", "pooled_projection_dim")
    width_key = "joint_attention_dim"
    packing = 2
    dynamic_shift = pipeline_sigmas = true_cfg = True
    guidance = GUIDANCE
    # train_dreambooth_lora_flux.py's default target_modules (its --lora_layers unset)
    lora_targets = tuple(f"attn.{m}" for m in ATTENTION_TARGETS) + (
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
        "ff_context.net.0.proj", "ff_context.net.2")
    comfyui = "kohya-flux"  # sd-scripts' networks/lora_flux.py: "lora_unet_" + Black Forest Labs' module names
    comfyui_label = "FLUX.1"
    swap_lists = ("transformer_blocks", "single_transformer_blocks")  # in the order they run
    fsdp_views = ("FSDPFluxSingleTransformerBlock",)
    published = {"flux.1-dev": {
        "repo": "black-forest-labs/FLUX.1-dev transformer/config.json", "objective": "flow",
        "published": 12e9, "latent": (16, 128), "text": {"states": 4096, "length": 512, "pooled": 768},
        "kwargs": {"patch_size": 1, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                   "num_attention_heads": 24, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
                   "time_scale": 1}}}

    def build(self, resolution, in_channels, num_classes, text=None, time_scale: float = 1.0,
              guidance: float = GUIDANCE, **config):
        """FluxTransformer2DModel(in_channels=4C, joint_attention_dim=D, pooled_projection_dim=P, **config); the
        latents' side must be even (2 x 2 packing)."""
        from diffrelay.families import network

        network.check(self, config, text, num_classes)
        if not text["pooled"]:
            raise UserError("model.arch=flux: FLUX.1's transformer needs a pooled text embedding (pooled_projections); "
                            "mark its CLIP encoder of data.text_encoders pooled: true")
        if resolution % 2:
            raise UserError(f"model.arch=flux: a latent side of {resolution}; FLUX.1 packs 2 x 2 latent pixels into one "
                            "token, so the side must be even")
        out = config.get("out_channels")
        if out not in (None, 4 * in_channels):
            raise ValueError(f"out_channels={out}: FLUX.1's is its packed in_channels, {4 * in_channels} (or null)")
        model = network.diffusers_class(self)(in_channels=4 * in_channels, joint_attention_dim=text["states"],
                                              pooled_projection_dim=text["pooled"], **config)
        return network.TextNet(self, model, in_channels, 0, time_scale, False, resolution, guidance)

    def call(self, net, x, t, labels, text, states, mask):
        import torch

        b, c, h, w = x.shape
        packed = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
        key = ("img_ids", h, w, str(x.device), x.dtype)
        if key not in net.cache:  # FluxPipeline._prepare_latent_image_ids: (0, row, column) of each token
            ids = torch.zeros(h // 2, w // 2, 3, device=x.device, dtype=x.dtype)
            ids[..., 1] += torch.arange(h // 2, device=x.device)[:, None]
            ids[..., 2] += torch.arange(w // 2, device=x.device)[None, :]
            net.cache[key] = ids.reshape(-1, 3)
        guidance = None
        if net.model.config.guidance_embeds:
            guidance = text.guidance if text.guidance is not None else torch.full(
                (b,), net.guidance, dtype=torch.float32, device=x.device)
        out = net.model(hidden_states=packed, timestep=t.to(x.dtype).reshape(-1).expand(b), guidance=guidance,
                        pooled_projections=text.pooled.to(x.dtype), encoder_hidden_states=states,
                        txt_ids=states.new_zeros(states.shape[1], 3), img_ids=net.cache[key], return_dict=False)[0]
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def block_count(self, config: dict) -> int | None:
        if "num_layers" not in config or "num_single_layers" not in config:
            return None
        return config["num_layers"] + config["num_single_layers"]

    def downsampling(self, kwargs: dict) -> int:
        return 2  # 2 x 2 latent pixels a token

    def geometry(self, kwargs: dict, res: int) -> list[tuple[str, str]]:
        if res % 2:  # FluxPipeline packs 2 x 2 latent pixels into a token
            return [(f"data.resolution={res}", "FLUX.1 packs 2 x 2 latent pixels into one token; use an even side")]
        return []

    def time_scale(self, objective: str) -> float:
        return 1  # the transformer multiplies t by 1000 itself

    def encoders(self, pipe) -> tuple[list, str]:
        return ([("text_encoder", {"layer": "none", "pooled": True}),
                 ("text_encoder_2", {"use_mask": False, "max_length": T5_LENGTH})],
                "a FLUX.1 pipeline (CLIPTextModel, then T5EncoderModel)")

    def check_dims(self, c: dict, recs: list, dims: dict, where, fix: str) -> None:
        super().check_dims(c, recs, dims, where, fix)
        if c.get("pooled_projection_dim") not in (None, dims["pooled"]):
            raise UserError(f"{where}: pooled_projection_dim {c['pooled_projection_dim']}, but the text encoders' "
                            f"pooled embedding is {dims['pooled']} wide; {fix}")

    def guidance_input(self, model_cfg: dict) -> bool | None:
        return bool((model_cfg.get("kwargs") or {}).get("guidance_embeds", False))

    def expand(self, pipe, kwargs: dict, sample: dict) -> list[tuple[str, str]]:
        """FLUX.1-dev (guidance_embeds) takes sample.guidance as its guidance input, FluxPipeline's guidance_scale,
        whose default (3.5) it gets when the key is left at the schema's 1; schnell takes none, and FluxPipeline
        ignores guidance_scale there, so any other value is refused rather than ignored."""
        scales = sample["guidance"] if isinstance(sample["guidance"], list) else [sample["guidance"]]
        if self.guidance_input({"kwargs": kwargs}):
            kwargs.setdefault("guidance", GUIDANCE)
            if scales == [1.0]:
                sample["guidance"] = GUIDANCE
            return []
        if "guidance" in kwargs:
            return [("model.kwargs.guidance", "this FLUX.1 transformer has guidance_embeds false (schnell): it takes "
                     "no guidance input; drop it")]
        if scales != [1.0]:
            return [(f"sample.guidance={sample['guidance']}", "this FLUX.1 transformer has guidance_embeds false "
                     "(schnell): it takes no guidance and FluxPipeline ignores guidance_scale; use 1")]
        return []


FAMILY = Flux()
