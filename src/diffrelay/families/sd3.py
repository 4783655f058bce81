"""SD3 / SD3.5: StableDiffusion3Pipeline's SD3Transformer2DModel (model.arch sd3; SD3.5 Large and Medium are config
keys of the same class: qk_norm, dual_attention_layers).

joint_attention_dim = D, pooled_projection_dim = P (SD3 needs a pooled encoder), pooled_projections = pooled; SD3
takes no mask. caption_projection_dim defaults to the transformer's width (heads x head dim), which equals diffusers'
default for its default sizes. Two CLIPs at their penultimate layer, both pooled, then a T5 without its mask, 256
tokens (_get_t5_prompt_embeds, max_sequence_length 256). Its position table is cropped from pos_embed_max_size
patches a side (diffusers' default 96), so no grid may be longer.
"""

from diffrelay.errors import UserError
from diffrelay.families.base import Family

T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length
TABLE = 96  # SD3Transformer2DModel's default pos_embed_max_size
_PUBLISHED = {"objective": "flow", "latent": (16, 128), "text": {"states": 4096, "length": 333, "pooled": 2048}}


class SD3(Family):
    name = "SD3 / SD3.5"
    short = "SD3"
    arch = "sd3"
    network_class = "SD3Transformer2DModel"
    pipelines = ("StableDiffusion3Pipeline",)
    set_keys = ("sample_size", "joint_attention_dim", "pooled_projection_dim")
    width_key = "joint_attention_dim"
    single_file = True
    # train_dreambooth_lora_sd3.py's default target_modules: the attention's and the joint attention's text side
    lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                    "attn.to_out.0", "attn.to_q", "attn.to_v")
    comfyui_hint = "; <run>/lora/step_N/ holds its diffusers file, whose transformer. keys ComfyUI reads as they are"
    published = {
        "sd3-medium": {**_PUBLISHED, "repo": "stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json",
                       "published": 2.0e9,
                       "kwargs": {"patch_size": 2, "num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24,
                                  "caption_projection_dim": 1536, "out_channels": 16, "pos_embed_max_size": 192,
                                  "time_scale": 1000}},
        "sd3.5-large": {**_PUBLISHED, "repo": "stabilityai/stable-diffusion-3.5-large transformer/config.json",
                        "published": 8.1e9,
                        "kwargs": {"patch_size": 2, "num_layers": 38, "attention_head_dim": 64, "num_attention_heads": 38,
                                   "caption_projection_dim": 2432, "out_channels": 16, "pos_embed_max_size": 192,
                                   "qk_norm": "rms_norm", "time_scale": 1000}},
        "sd3.5-medium": {**_PUBLISHED, "repo": "stabilityai/stable-diffusion-3.5-medium transformer/config.json",
                         "published": 2.5e9,
                         "kwargs": {"patch_size": 2, "num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24,
                                    "caption_projection_dim": 1536, "out_channels": 16, "pos_embed_max_size": 384,
                                    "qk_norm": "rms_norm", "dual_attention_layers": list(range(13)), "time_scale": 1000}},
    }

    def build(self, resolution, in_channels, num_classes, text=None, time_scale: float = 1000.0, **config):
        """SD3Transformer2DModel(sample_size=R, in_channels=C, joint_attention_dim=D, pooled_projection_dim=P,
        **config)."""
        from diffrelay.families import network

        network.check(self, config, text, num_classes)
        if not text["pooled"]:
            raise UserError("model.arch=sd3: SD3's transformer needs a pooled text embedding (pooled_projections); "
                            "mark a CLIP encoder of data.text_encoders pooled: true")
        cls = network.diffusers_class(self)
        config = {"caption_projection_dim": network.width(cls, config), **config,
                  "out_channels": network.out_channels(config, in_channels)}
        model = cls(sample_size=resolution, in_channels=in_channels, joint_attention_dim=text["states"],
                    pooled_projection_dim=text["pooled"], **config)
        return network.TextNet(self, model, in_channels, 0, time_scale, False, resolution)

    def call(self, net, x, t, labels, text, states, mask):
        return net.model(x, states, pooled_projections=text.pooled.to(x.dtype), timestep=t, return_dict=False)[0]

    def position_table(self, kwargs: dict) -> int | None:
        return kwargs.get("pos_embed_max_size", TABLE)

    def encoders(self, pipe) -> tuple[list, str]:
        clip = {"layer": "penultimate", "pooled": True}
        return ([("text_encoder", clip), ("text_encoder_2", clip),
                 ("text_encoder_3", {"use_mask": False, "max_length": T5_LENGTH})], "an SD3 pipeline")


FAMILY = SD3()
