"""Stable Diffusion 1.x/2.x: StableDiffusionPipeline's UNet2DConditionModel (model.arch diffusers-unet).

UNet2DConditionModel: cross_attention_dim = D. SD's pipelines pass no encoder_attention_mask (the padded tokens are
attended to, as the UNet was trained), so the mask is ignored unless model.kwargs.use_mask: true. Class labels (K > 0)
use the UNet's class table, num_class_embeds = K + 1 (the null class K). One CLIP, its last layer
(pipeline_stable_diffusion's encode_prompt, clip_skip None). SDXL shares the class (families/sdxl.py).
"""

from diffrelay.families.base import Family

BLOCKS = [320, 640, 1280, 1280]  # UNet2DConditionModel's default block_out_channels


class StableDiffusion(Family):
    name = short = "SD 1.x/2.x"
    arch = "diffusers-unet"
    swap_lists = ()  # a UNet: no list of transformer blocks
    network_class = "UNet2DConditionModel"
    pipelines = ("StableDiffusionPipeline",)
    own_kwargs = ("time_scale", "use_mask", "pixel_size")
    set_keys = ("sample_size", "cross_attention_dim")
    width_key = "cross_attention_dim"
    class_labels = True
    comfyui = "kohya"  # sd-scripts' networks/lora.py: "lora_unet_" + the module's dotted name
    comfyui_label = "UNet pipelines (SD, SDXL)"
    single_file = True

    def matches(self, config: dict) -> bool:
        return config.get("addition_embed_type") != "text_time"

    def build(self, resolution, in_channels, num_classes, text=None, time_scale: float = 1000.0,
              use_mask: bool = False, pixel_size: int | None = None, **config):
        """UNet2DConditionModel(sample_size=R, in_channels=C, out_channels=C, cross_attention_dim=D, **config)."""
        from diffrelay.families import network

        network.check(self, config, text, num_classes)
        config = self.prepare(text, {**config, "out_channels": network.out_channels(config, in_channels)})
        if num_classes:
            if config.get("num_class_embeds") is not None or config.get("class_embed_type") is not None:
                raise ValueError("num_class_embeds and class_embed_type are set by diffrelay from the dataset's "
                                 "classes (K + 1 rows, the last the null class); remove them")
            config["num_class_embeds"] = num_classes + 1
        model = network.diffusers_class(self)(sample_size=resolution, in_channels=in_channels,
                                              cross_attention_dim=text["states"], **config)
        return network.TextNet(self, model, in_channels, num_classes, time_scale, use_mask,
                               pixel_size or resolution)

    def prepare(self, text: dict, config: dict) -> dict:
        """The UNet's config before it is built; SDXL adds its time ids' projection."""
        return config

    def call(self, net, x, t, labels, text, states, mask):
        kw = {"class_labels": labels} if net.num_classes else {}
        return net.model(x, t, states, encoder_attention_mask=mask, return_dict=False, **kw)[0]

    def downsampling(self, kwargs: dict) -> int:
        blocks = kwargs.get("block_out_channels", BLOCKS)
        return 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 1

    def geometry(self, kwargs: dict, res: int) -> list[tuple[str, str]]:
        """The UNet halves the side once per block after the first (diffusers' default block_out_channels has 4)."""
        blocks = kwargs.get("block_out_channels", BLOCKS)
        factor = self.downsampling(kwargs)
        if res % factor:
            return [(f"data.resolution={res}", f"diffusers' UNet with {len(blocks)} blocks halves it "
                     f"{len(blocks) - 1} times; use a multiple of {factor} or change model.kwargs.block_out_channels")]
        return []

    def encoders(self, pipe) -> tuple[list, str]:
        return [("text_encoder", {})], "a Stable Diffusion pipeline"


FAMILY = StableDiffusion()
