"""The family interface: what makes one pipeline family (SD, SDXL, SD3, PixArt, HunyuanDiT, FLUX.1, ...) different,
declared in one module a family and asked by the rest of diffrelay, which names no family (docs/development.md,
"Adding a pipeline family").

A family is a `Family` subclass instance. Its class attributes are data (torch-free: config validation reads them at
Snakefile parse time); its methods have the behaviour most families share, so a module overrides only what differs.
Methods that touch tensors import torch (and diffusers) inside them, never at import.

Imports the base modules only (errors); nets.registry calls `build`, and families.network.TextNet calls `call`.
"""

from diffrelay.errors import UserError

# diffusers' LoRA training scripts adapt the attention projections: train_text_to_image_lora*.py these four (the
# same names exist in PixArt's and HunyuanDiT's transformers; HunyuanDiT's own repository names them Wqkv, q_proj,
# kv_proj, out_proj, the network here is diffusers').
ATTENTION_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")


class Family:
    # --- what it is
    name = ""  # as the docs name it: "FLUX.1 dev / schnell"
    short = ""  # as messages name it: "FLUX.1"
    arch = ""  # its model.arch
    network_class = ""  # the diffusers class of its network (unet/ or transformer/ config.json's _class_name)
    pipelines: tuple = ()  # the pipeline classes (model_index.json's _class_name) that hold it
    # --- model.kwargs
    own_kwargs: tuple = ("time_scale",)  # diffrelay's keys beside the class's config keys
    set_keys: tuple = ("sample_size",)  # config keys diffrelay sets from data.resolution and the text widths
    width_key = ""  # the config key of the text states' width (checked against the encoders', pretrained.parts)
    class_labels = False  # takes class labels beside text (num_class_embeds)
    labelled_archs: tuple = ()  # the model.arch of every family with class_labels (set by families/__init__.py)
    pixel_sizes = False  # conditions on image sizes in pixels: a pipeline run sets model.kwargs.pixel_size
    packing = 1  # latent pixels a token holds along each side before the network (FLUX.1: 2 x 2)
    # --- text
    lowercase_prompts = False  # the pipeline lower-cases and strips prompts before its encoders (PixArt)
    # --- sampling
    dynamic_shift = False  # its scheduler's use_dynamic_shifting is honoured (the pipeline computes mu)
    pipeline_sigmas = False  # the pipeline passes sigmas = linspace(1, 1 / N, N) to set_timesteps (FluxPipeline)
    true_cfg = False  # sample.true_cfg_scale (true classifier-free guidance beside a guidance input)
    # --- LoRA and export
    lora_targets: tuple = ATTENTION_TARGETS  # train.lora.target_modules' default
    comfyui = None  # kohya/ComfyUI key layout export --lora-format comfyui writes (pretrained.comfyui.LAYOUTS), or None
    comfyui_label = ""  # how the refusal of another family names this one
    comfyui_hint = ""  # said when comfyui is None
    single_file = False  # diffusers' from_single_file loads the network (model.pretrained {path: file, config: dir})
    guidance = 1.0  # the training guidance input of a guidance-distilled network (guidance_input)
    # --- training
    swap_lists: tuple = ("transformer_blocks",)  # the network's ModuleLists of blocks train.block_swap may swap
    fsdp_views: tuple = ()  # block classes whose outputs FSDP2 may hand on as views (warnings filtered, sharding)
    # --- docs/pretrained.md's memory table (benchmarks/pretrained_memory.py): name -> published config
    published: dict = {}

    def matches(self, config: dict) -> bool:
        """Whether a network config of `network_class` is this family's (SDXL and SD share a class)."""
        return True

    # --- network
    def build(self, resolution: int, in_channels: int, num_classes: int, text: dict | None, **config):
        """The nets contract's builder for model.arch == self.arch: a families.network.TextNet."""
        raise NotImplementedError

    def call(self, net, x, t, labels, text, states, mask):
        """The diffusers network `net.model` called as its pipeline calls it: x (B, C, H, W), t the scaled time
        input, labels the classes or None, text the Text, states its hidden states in x's dtype, mask the
        attention mask or None (families.network.TextNet.forward_all)."""
        raise NotImplementedError

    def recompute_blocks(self, model):
        """The blocks to wrap in torch's checkpoint when the class has no gradient checkpointing of its own, or
        None (the class's own, or none)."""
        return None

    # --- geometry
    def downsampling(self, kwargs: dict) -> int:
        """How much the network shrinks the latents' sides: its patch size."""
        return int(kwargs.get("patch_size", 2))

    def geometry(self, kwargs: dict, res: int) -> list[tuple[str, str]]:
        """(key, message) when the latent side `res` cannot enter the network."""
        patch = kwargs.get("patch_size", 2)
        if not isinstance(patch, int) or patch < 1 or res % patch:
            return [(f"model.kwargs.patch_size={patch}", f"does not divide data.resolution={res}; use a divisor of it")]
        return []

    def position_table(self, kwargs: dict) -> int | None:
        """Patches a side the network's position table holds (None: it makes one for any grid)."""
        return None

    def tokens(self, side: tuple) -> int:
        """Image tokens of latents of `side` (H, W), as the pipeline counts them for its dynamic shift."""
        return (side[0] // self.packing) * (side[1] // self.packing)

    # --- pipeline folders (pretrained)
    def encoders(self, pipe) -> tuple[list, str]:
        """([(text encoder folder, its data.text_encoders settings)], what the pipeline is, for messages)."""
        raise NotImplementedError

    def time_scale(self, objective: str) -> float:
        """model.kwargs.time_scale of a pipeline's network: ddpm's integer steps, flow's sigma x 1000."""
        return 1 if objective == "ddpm" else 1000

    def check_dims(self, c: dict, recs: list, dims: dict, where, fix: str) -> None:
        """Refuse (UserError) a network config that does not take the text encoders' outputs."""
        if c.get(self.width_key) is not None and c[self.width_key] != dims["states"]:
            raise UserError(f"{where}: {self.width_key} {c[self.width_key]}, but the text encoders give "
                            f"{dims['states']} features a token; {fix}")

    def expand(self, pipe, kwargs: dict, sample: dict) -> list[tuple[str, str]]:
        """The family's own filling of a pipeline run's config (in place); (key, message) of what cannot work."""
        return []

    def zeros_for_empty_prompt(self, index: dict) -> bool:
        """The pipeline guides an image without a negative prompt against zero embeddings (SDXL)."""
        return False

    def block_count(self, config: dict) -> int | None:
        """The blocks of `swap_lists` a network of `config` has (train.block_swap's bound), None when unknown."""
        return config.get("num_layers")

    def guidance_input(self, model_cfg: dict) -> bool | None:
        """None for a family without a guidance input; else whether this network takes one (FLUX.1-dev)."""
        return None
