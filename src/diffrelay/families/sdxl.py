"""SDXL: StableDiffusionXLPipeline's UNet2DConditionModel with addition_embed_type text_time (model.arch
diffusers-unet, as SD's; `matches` tells them apart by that key).

added_cond_kwargs are {"text_embeds": pooled, "time_ids": (H, W, 0, 0, H, W)}: the original size, the crop's top-left
corner and the target size of pipeline_stable_diffusion_xl's _get_add_time_ids at its defaults (original = target =
the image's size, crop (0, 0)), with H = W = pixel_size (default the network's side R; a latent run sets the image's
side in pixels, 8R for SD's VAE), or each row's own sizes (Text.sizes: a bucketed run's original size and crop).
projection_class_embeddings_input_dim defaults to 6 addition_time_embed_dim + P, what that function checks it
against. Two CLIPs, both at their penultimate layer, the second pooled (encode_prompt, clip_skip None);
force_zeros_for_empty_prompt (model_index.json, default true) guides an image without a negative prompt against
zero embeddings.
"""

from diffrelay.errors import UserError
from diffrelay.families.sd import StableDiffusion


class StableDiffusionXL(StableDiffusion):
    name = short = "SDXL"
    pipelines = ("StableDiffusionXLPipeline",)
    pixel_sizes = True
    published = {"sdxl-base-1.0": {
        "repo": "stabilityai/stable-diffusion-xl-base-1.0 unet/config.json", "objective": "ddpm",
        "published": 2.6e9, "latent": (4, 128), "text": {"states": 2048, "length": 77, "pooled": 1280},
        "kwargs": {"block_out_channels": [320, 640, 1280], "layers_per_block": 2, "attention_head_dim": [5, 10, 20],
                   "transformer_layers_per_block": [1, 2, 10], "use_linear_projection": True,
                   "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                   "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                   "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
                   "projection_class_embeddings_input_dim": 2816, "out_channels": 4, "time_scale": 1}}}

    def matches(self, config: dict) -> bool:
        return config.get("addition_embed_type") == "text_time"

    def prepare(self, text: dict, config: dict) -> dict:
        if not text["pooled"]:
            raise UserError("model.kwargs.addition_embed_type=text_time (SDXL) needs a pooled text embedding; mark "
                            "a CLIP encoder of data.text_encoders pooled: true, or drop addition_embed_type")
        if config.get("addition_time_embed_dim") is None:
            raise ValueError("addition_embed_type text_time needs addition_time_embed_dim (SDXL: 256)")
        config.setdefault("projection_class_embeddings_input_dim", 6 * config["addition_time_embed_dim"] + text["pooled"])
        return config

    def call(self, net, x, t, labels, text, states, mask):
        b = x.shape[0]
        kw = {"class_labels": labels} if net.num_classes else {}
        ids = text.sizes.to(x.dtype) if text.sizes is not None else net.size_ids(x).expand(b, 6)
        kw["added_cond_kwargs"] = {"text_embeds": text.pooled.to(x.dtype), "time_ids": ids}
        return net.model(x, t, states, encoder_attention_mask=mask, return_dict=False, **kw)[0]

    def encoders(self, pipe) -> tuple[list, str]:
        return ([("text_encoder", {"layer": "penultimate"}), ("text_encoder_2", {"layer": "penultimate", "pooled": True})],
                "an SDXL pipeline (unet addition_embed_type text_time)")

    def zeros_for_empty_prompt(self, index: dict) -> bool:
        return bool(index.get("force_zeros_for_empty_prompt", True))


FAMILY = StableDiffusionXL()
