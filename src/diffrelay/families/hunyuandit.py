"""HunyuanDiT: HunyuanDiTPipeline's HunyuanDiT2DModel (model.arch hunyuandit).

cross_attention_dim_t5 = D, the T5's width. The states carry both encoders (text/encoders.py: the BertModel's
text_len tokens zero-padded to D, then the T5's text_len_t5), split back here by the config: encoder_hidden_states =
the first text_len tokens' first cross_attention_dim features, encoder_hidden_states_t5 the rest, each with its part
of the mask (text_embedding_mask, text_embedding_mask_t5), as pipeline_hunyuandit's __call__ passes them.
image_meta_size = (original H, W, target H, W, crop top, left) = (P, P, P, P, 0, 0), P = pixel_size (the pipeline's
add_time_ids; its original_size default is 1024, ours the image's side, as SDXL's time ids); style = 0 (the
pipeline's torch.tensor([0])); image_rotary_emb from diffusers' get_2d_rotary_pos_embed(head dim,
get_resize_crop_region_for_grid(grid, 512 // 8 // patch), grid), the grid = the latents' side / patch_size, cached
per shape and device. The timestep is given as a float of x's dtype (the pipeline's t_expand; the time embedding
casts to the timestep's dtype, so ddpm's integer steps would fail). Learned sigma: learn_sigma (diffusers' default
true, out 2C) is the 2C layout; hidden_size defaults to heads x head dim. Activation checkpointing: diffusers has
none for it, so each block is recomputed (families.network.recomputed). Encoders: the BertModel (its bilingual CLIP
text tower) with its mask, 77 tokens, then the mT5 with its mask, 256 (__call__'s max_sequence_length of each).
"""

from diffrelay.errors import UserError
from diffrelay.families.base import Family

LENGTHS = (77, 256)  # HunyuanDiTPipeline.__call__'s max_sequence_length for its BertModel and its mT5
ROPE_BASE = 512 // 8  # pipeline_hunyuandit: base_size = 512 // 8 // patch_size (latents of 512 pixels, rope base512)


class HunyuanDiT(Family):
    name = short = "HunyuanDiT"
    arch = "hunyuandit"
    # Its blocks are recomputed by diffrelay's own wrapper (recompute_blocks), whose rerun calls forward, not the
    # module, so the swap's hooks would not run in the backward; at 1.5B parameters it fits without a swap.
    swap_lists = ()
    network_class = "HunyuanDiT2DModel"
    pipelines = ("HunyuanDiTPipeline",)
    own_kwargs = ("time_scale", "pixel_size")
    set_keys = ("sample_size", "cross_attention_dim_t5")
    width_key = "cross_attention_dim_t5"
    pixel_sizes = True
    published = {"hunyuandit-v1.1": {
        "repo": "Tencent-Hunyuan/HunyuanDiT-v1.1-Diffusers transformer/config.json", "objective": "ddpm",
        "published": 1.5e9, "latent": (4, 128), "text": {"states": 2048, "length": 77 + 256, "pooled": 0},
        "kwargs": {"num_attention_heads": 16, "attention_head_dim": 88, "hidden_size": 1408, "patch_size": 2,
                   "num_layers": 40, "mlp_ratio": 4.3637, "learn_sigma": True, "cross_attention_dim": 1024,
                   "norm_type": "layer_norm", "pooled_projection_dim": 1024, "text_len": 77, "text_len_t5": 256,
                   "activation_fn": "gelu-approximate", "time_scale": 1}}}

    def build(self, resolution, in_channels, num_classes, text=None, time_scale: float = 1000.0,
              pixel_size: int | None = None, **config):
        """HunyuanDiT2DModel(sample_size=R, in_channels=C, cross_attention_dim_t5=D, **config); the text's L tokens
        must be text_len + text_len_t5 and its width hold cross_attention_dim (the first encoder's)."""
        from diffrelay.families import network

        network.check(self, config, text, num_classes)
        cls = network.diffusers_class(self)
        defaults = network.defaults(cls)
        first, second = (config.get(k, defaults[k]) for k in ("text_len", "text_len_t5"))
        if first + second != text["length"]:
            raise UserError(f"model.kwargs text_len {first} + text_len_t5 {second}: the text encoders give "
                            f"{text['length']} tokens (the first encoder's, then the T5's); set them to the encoders' "
                            "max_length")
        width = config.get("cross_attention_dim", defaults["cross_attention_dim"])
        if width > text["states"]:
            raise UserError(f"model.kwargs.cross_attention_dim {width}: wider than the text states ({text['states']}); "
                            "set it to the first encoder's width")
        config = {"hidden_size": network.width(cls, config), "patch_size": 2, **config}
        model = cls(sample_size=resolution, in_channels=in_channels, cross_attention_dim_t5=text["states"], **config)
        return network.TextNet(self, model, in_channels, 0, time_scale, True, pixel_size or resolution)

    def recompute_blocks(self, model):
        return None if model._supports_gradient_checkpointing else model.blocks

    def rotary(self, net, h: int, w: int, device):
        """image_rotary_emb for an h x w latent, as pipeline_hunyuandit's __call__ makes it."""
        key = ("rotary", h, w, str(device))
        if key not in net.cache:
            from diffusers.models.embeddings import get_2d_rotary_pos_embed
            from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

            patch = net.model.config.patch_size
            grid = (h // patch, w // patch)
            crops = get_resize_crop_region_for_grid(grid, ROPE_BASE // patch)
            net.cache[key] = get_2d_rotary_pos_embed(net.model.inner_dim // net.model.num_heads, crops, grid,
                                                     device=device, output_type="pt")
        return net.cache[key]

    def call(self, net, x, t, labels, text, states, mask):
        import torch

        b, cfg = x.shape[0], net.model.config
        n = cfg.text_len
        t = t.to(x.dtype).reshape(-1).expand(b)  # a float timestep: an integer one fails in the time embedding
        # image_meta_size: original H, W, target H, W, crop top, left (the add_time_ids of pipeline_hunyuandit)
        ids = text.sizes.to(x.dtype) if text.sizes is not None else net.size_ids(x).repeat(b, 1)
        meta = ids[:, [0, 1, 4, 5, 2, 3]]
        style = torch.zeros(b, dtype=torch.int64, device=x.device)
        # Contiguous parts: diffusers views the T5's as (B x L, D).
        first, second = states[:, :n, :cfg.cross_attention_dim].contiguous(), states[:, n:].contiguous()
        return net.model(x, t, encoder_hidden_states=first, text_embedding_mask=text.mask[:, :n].contiguous(),
                         encoder_hidden_states_t5=second, text_embedding_mask_t5=text.mask[:, n:].contiguous(),
                         image_meta_size=meta, style=style,
                         image_rotary_emb=self.rotary(net, x.shape[-2], x.shape[-1], x.device), return_dict=False)[0]

    def encoders(self, pipe) -> tuple[list, str]:
        return ([("text_encoder", {"max_length": LENGTHS[0]}), ("text_encoder_2", {"max_length": LENGTHS[1]})],
                "a HunyuanDiT pipeline (BertModel, then T5EncoderModel)")

    def check_dims(self, c: dict, recs: list, dims: dict, where, fix: str) -> None:
        super().check_dims(c, recs, dims, where, fix)
        # the first encoder's tokens and width, the T5's tokens (the network splits the states)
        for key, value in (("text_len", recs[0]["length"]), ("cross_attention_dim", recs[0]["states_dim"]),
                           ("text_len_t5", recs[-1]["length"])):
            if c.get(key) is not None and c[key] != value:
                raise UserError(f"{where}: {key} {c[key]}, but the text encoders give {value} ({key} of "
                                f"HunyuanDiTPipeline's encoders); {fix}")


FAMILY = HunyuanDiT()
