"""PixArt-α / PixArt-Σ: PixArtAlphaPipeline's and PixArtSigmaPipeline's PixArtTransformer2DModel (model.arch pixart).

caption_channels = D, the T5's mask as encoder_attention_mask (PixArt's pipeline passes it; use_mask: false drops
it); with use_additional_conditions, resolution (H, W) and aspect ratio H / W in pixels per row as
pipeline_pixart_alpha makes them, else None. cross_attention_dim defaults to the transformer's width (heads x head
dim: the caption projection maps D to it), diffusers' default 1152 for its default sizes. One T5 with its mask, 120
tokens (α) or 300 (Σ): each pipeline's max_sequence_length. Both pipelines lower-case and strip prompts
(_text_preprocessing with clean_caption off).
"""

from diffrelay.families.base import Family

LENGTH = {"PixArtAlphaPipeline": 120, "PixArtSigmaPipeline": 300}  # their max_sequence_length


class PixArt(Family):
    name = short = "PixArt-α / PixArt-Σ"
    arch = "pixart"
    network_class = "PixArtTransformer2DModel"
    pipelines = ("PixArtAlphaPipeline", "PixArtSigmaPipeline")
    own_kwargs = ("time_scale", "use_mask", "pixel_size")
    set_keys = ("sample_size", "caption_channels")
    width_key = "caption_channels"
    pixel_sizes = True
    lowercase_prompts = True
    published = {"pixart-sigma-xl-2-1024": {
        "repo": "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS transformer/config.json", "objective": "ddpm",
        "published": 0.6e9, "latent": (4, 128), "text": {"states": 4096, "length": 300, "pooled": 0},
        "kwargs": {"num_attention_heads": 16, "attention_head_dim": 72, "out_channels": 8, "num_layers": 28,
                   "patch_size": 2, "norm_type": "ada_norm_single", "norm_elementwise_affine": False,
                   "norm_eps": 1e-6, "cross_attention_dim": 1152, "use_additional_conditions": False,
                   "interpolation_scale": 2, "time_scale": 1}}}

    def build(self, resolution, in_channels, num_classes, text=None, time_scale: float = 1000.0,
              use_mask: bool = True, pixel_size: int | None = None, **config):
        """PixArtTransformer2DModel(sample_size=R, in_channels=C, caption_channels=D, **config)."""
        from diffrelay.families import network

        network.check(self, config, text, num_classes)
        cls = network.diffusers_class(self)
        config = {"cross_attention_dim": network.width(cls, config), **config,
                  "out_channels": network.out_channels(config, in_channels)}
        model = cls(sample_size=resolution, in_channels=in_channels, caption_channels=text["states"], **config)
        return network.TextNet(self, model, in_channels, 0, time_scale, use_mask, pixel_size or resolution)

    def call(self, net, x, t, labels, text, states, mask):
        import torch

        b = x.shape[0]
        if net.model.use_additional_conditions:
            h, w = net.size_ids(x)[4:]
            extra = {"resolution": torch.stack([h, w]).view(1, 2).expand(b, 2),
                     "aspect_ratio": (h / w).view(1, 1).expand(b, 1)}
        else:
            extra = {"resolution": None, "aspect_ratio": None}
        return net.model(x, states, timestep=t, added_cond_kwargs=extra, encoder_attention_mask=mask,
                         return_dict=False)[0]

    def encoders(self, pipe) -> tuple[list, str]:
        return [("text_encoder", {"max_length": LENGTH[pipe.cls]})], f"a {pipe.cls}"


FAMILY = PixArt()
