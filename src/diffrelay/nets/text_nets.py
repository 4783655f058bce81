"""Text-conditional networks of diffusers under the diffrelay.nets contract: diffusers' own classes, built from
model.kwargs (their config keys) and the contract's text dims, called as their pipelines call them.

  diffusers-unet  UNet2DConditionModel (Stable Diffusion 1/2; SDXL with addition_embed_type: text_time):
                  cross_attention_dim = D. SD's and SDXL's pipelines pass no encoder_attention_mask (the padded
                  tokens are attended to, as the UNet was trained), so the mask is ignored unless use_mask: true.
                  SDXL's added_cond_kwargs are {"text_embeds": pooled, "time_ids": (H, W, 0, 0, H, W)}: the
                  original size, the crop's top-left corner and the target size of pipeline_stable_diffusion_xl's
                  _get_add_time_ids at its defaults (original = target = the image's size, crop (0, 0)), with H = W
                  = pixel_size (default the network's side R; a latent run sets the image's side in pixels, 8R for
                  SD's VAE). projection_class_embeddings_input_dim defaults to 6 addition_time_embed_dim + P, what
                  that function checks it against. Class labels (K > 0) use the UNet's class table,
                  num_class_embeds = K + 1 (the null class K).
  pixart          PixArtTransformer2DModel: caption_channels = D, the mask as encoder_attention_mask (PixArt's
                  pipeline passes it; use_mask: false drops it); with use_additional_conditions, resolution (H, W)
                  and aspect ratio H / W in pixels per row as pipeline_pixart_alpha makes them, else None.
                  cross_attention_dim defaults to the transformer's width (heads x head dim: the caption projection
                  maps D to it), diffusers' default 1152 for its default sizes.
  sd3             SD3Transformer2DModel: joint_attention_dim = D, pooled_projection_dim = P (SD3 needs a pooled
                  encoder), pooled_projections = pooled; SD3 takes no mask. caption_projection_dim defaults to the
                  transformer's width (heads x head dim), which equals diffusers' default for its default sizes.
  hunyuandit      HunyuanDiT2DModel: cross_attention_dim_t5 = D, the T5's width. The states carry both encoders
                  (text/encoders.py: the BertModel's text_len tokens zero-padded to D, then the T5's text_len_t5),
                  split back here by the config: encoder_hidden_states = the first text_len tokens' first
                  cross_attention_dim features, encoder_hidden_states_t5 the rest, each with its part of the mask
                  (text_embedding_mask, text_embedding_mask_t5), as pipeline_hunyuandit's __call__ passes them.
                  image_meta_size = (original H, W, target H, W, crop top, left) = (P, P, P, P, 0, 0), P =
                  pixel_size (the pipeline's add_time_ids; its original_size default is 1024, ours the image's
                  side, as SDXL's time ids here); style = 0 (the pipeline's torch.tensor([0])); image_rotary_emb
                  from diffusers' get_2d_rotary_pos_embed(head dim, get_resize_crop_region_for_grid(grid, 512 // 8
                  // patch), grid), the grid = the latents' side / patch_size, cached per shape and device. The
                  timestep is given as a float of x's dtype (the pipeline's t_expand; the time embedding casts to
                  the timestep's dtype, so ddpm's integer steps would fail). Learned sigma: learn_sigma (diffusers'
                  default true, out 2C) is the 2C layout below; hidden_size defaults to heads x head dim. Activation
                  checkpointing: diffusers has none for it, so each block is recomputed (recomputed, below).
  flux            FluxTransformer2DModel (FLUX.1 dev and schnell): joint_attention_dim = D (the T5's states alone:
                  the CLIP gives only its pooled embedding, layer none), pooled_projection_dim = P; in_channels =
                  4C, as FluxPipeline packs each 2 x 2 block of latent pixels into one token (_pack_latents: token
                  (i, j) holds channels c x (2 x 2) in that order) and unpacks its output the same way
                  (_unpack_latents). img_ids are the packed grid's (0, row, column) (_prepare_latent_image_ids),
                  txt_ids zeros (the pipeline's text_ids), no mask (FLUX takes none). The timestep is t in [0, 1]
                  (time_scale 1: the transformer multiplies it by 1000 itself, as the pipeline's timestep / 1000
                  expects). guidance_embeds (dev): the guidance input is Text.guidance when the sampler sets it
                  (sample.guidance, FluxPipeline's guidance_scale) and model.kwargs.guidance otherwise, the value
                  train_dreambooth_lora_flux.py feeds in training (its --guidance_scale, default 3.5), in float32
                  as its torch.tensor([guidance_scale]); schnell (guidance_embeds false) takes none.

Time input: diffusers embeds the timestep with sinusoids (Timesteps); c_noise is multiplied by `time_scale` first,
as nets/dit.py does: 1000 (default) stretches EDM's ln(sigma)/4 and flow's t in [0, 1] (SD3's pipeline gives its
transformer sigma x 1000, so flow with time_scale 1000 is SD3's convention); ddpm's integer steps need time_scale 1
(nets.checks says so). Output: the model's `.sample`; out_channels defaults to C (PixArt's diffusers default, 8, is the learned
sigma of 4 latent channels), and 2C is the learned-sigma layout (PixArt-alpha's):
forward returns the first C channels, forward_all all of them, as DiT does (ddpm reads the variance half).
PixArt, SD3 and HunyuanDiT take no class labels here (K > 0 is refused in one line).

diffusers is imported when a network is built, never by importing this module (nets.registry imports it).
"""

import difflib
import inspect

import torch
from torch import nn

from diffrelay.errors import UserError
from diffrelay.nets import FLUX_GUIDANCE, TEXT_KWARGS, TEXT_SET

CLASSES = {"diffusers-unet": "UNet2DConditionModel", "pixart": "PixArtTransformer2DModel",
           "sd3": "SD3Transformer2DModel", "hunyuandit": "HunyuanDiT2DModel", "flux": "FluxTransformer2DModel"}
ROPE_BASE = 512 // 8  # pipeline_hunyuandit: base_size = 512 // 8 // patch_size (latents of 512 pixels, rope base512)


def diffusers_class(arch: str):
    import diffusers

    return getattr(diffusers, CLASSES[arch])


def config_keys(arch: str) -> tuple:
    """The keys model.kwargs may set for `arch`: its diffusers class's __init__ keywords, less those diffrelay sets
    (nets.TEXT_SET and the contract's channels), plus diffrelay's own (nets.TEXT_KWARGS)."""
    taken = set(TEXT_SET[arch]) | {"self", "in_channels", "args", "kwargs"}
    params = inspect.signature(diffusers_class(arch).__init__).parameters
    return tuple(k for k in params if k not in taken) + TEXT_KWARGS[arch]


def _check(arch: str, config: dict, text: dict | None, num_classes: int) -> None:
    if text is None:
        raise UserError(f"model.arch={arch}: a text-conditional network, built without text dims; give the run "
                        "captions (data.captions) and data.text_encoders")
    accepted = config_keys(arch)
    for key in config:
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ValueError(f"model.kwargs.{key} is not a config key of diffusers' {CLASSES[arch]}; {hint}"
                             "see its __init__ for the keys")
    if num_classes and arch != "diffusers-unet":
        raise UserError(f"model.arch={arch}: takes no class labels beside text ({num_classes} classes); set "
                        "model.class_conditional: false or use arch diffusers-unet")


def _width(cls, config: dict) -> int:
    """The transformer's width, heads x head dim, of `config` over the class's defaults."""
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    return config.get("num_attention_heads", defaults["num_attention_heads"]) * \
        config.get("attention_head_dim", defaults["attention_head_dim"])


def _out_channels(config: dict, in_channels: int) -> int:
    out = config.get("out_channels") or in_channels
    if out not in (in_channels, 2 * in_channels):
        raise ValueError(f"out_channels={out}: {in_channels} (the image's channels) or {2 * in_channels} "
                         "(the learned-sigma layout)")
    return out


class Recomputed:
    """Mixed into a block's class by `recomputed`: its forward runs under torch's non-reentrant checkpoint while
    gradients are recorded (nets/memory.py says why the gradients stay bitwise a plain backward's). A class, not
    a closure over the block: a deep copy (an EMA's) keeps calling its own weights."""

    def forward(self, *args, **kwargs):
        run = super().forward
        if torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(run, *args, use_reentrant=False, **kwargs)
        return run(*args, **kwargs)


_RECOMPUTED: dict = {}  # a block class -> its Recomputed subclass


def recomputed(block: nn.Module, on: bool) -> None:
    """Checkpoint `block` (on) or not, by swapping its class; its parameters and state-dict keys stay as they are."""
    base = type(block).__mro__[2] if isinstance(block, Recomputed) else type(block)
    if on:
        if base not in _RECOMPUTED:
            _RECOMPUTED[base] = type(f"Recomputed{base.__name__}", (Recomputed, base), {})
        block.__class__ = _RECOMPUTED[base]
    else:
        block.__class__ = base


class TextNet(nn.Module):
    """F(x, c_noise, labels, text) -> like x, around one diffusers model (`model`, its parameters named as in
    diffusers under `model.`, so diffusers' state dicts load with that prefix)."""

    def __init__(self, arch: str, model: nn.Module, in_channels: int, num_classes: int, time_scale: float,
                 use_mask: bool, pixel_size: int, guidance: float = FLUX_GUIDANCE):
        super().__init__()
        self.arch, self.model, self.in_channels, self.num_classes = arch, model, in_channels, num_classes
        self.guidance = float(guidance)  # flux with guidance_embeds: the training guidance input
        self.time_scale, self.use_mask = float(time_scale), bool(use_mask)
        cfg = model.config
        self.sdxl = arch == "diffusers-unet" and cfg.addition_embed_type == "text_time"
        self.extra_conditions = arch == "pixart" and bool(model.use_additional_conditions)
        # SDXL's time ids (original size, crop top-left, target size) and PixArt's resolution, in pixels: a
        # buffer, so a step copies nothing from the host; not persistent, so state dicts are diffusers' alone.
        self.register_buffer("pixels", torch.tensor([float(pixel_size)]), persistent=False)
        self._rope = {}  # hunyuandit: (grid h, grid w, device) -> diffusers' (cos, sin)

    @property
    def checkpointing(self) -> bool:
        """train.activation_checkpointing (nets.memory.enable): diffusers' own gradient checkpointing, which is
        torch's non-reentrant checkpoint of each block (modeling_utils.enable_gradient_checkpointing); for
        HunyuanDiT2DModel, which has none, the same around each of its blocks (recomputed)."""
        if self.arch == "hunyuandit" and not self.model._supports_gradient_checkpointing:
            return any(isinstance(b, Recomputed) for b in self.model.blocks)
        return bool(self.model.is_gradient_checkpointing)

    @checkpointing.setter
    def checkpointing(self, on: bool) -> None:
        if self.arch == "hunyuandit" and not self.model._supports_gradient_checkpointing:
            for block in self.model.blocks:  # diffusers' HunyuanDiT2DModel has none: its blocks, by torch's
                recomputed(block, on)
            return
        if on and not self.model._supports_gradient_checkpointing:
            raise UserError(f"train.activation_checkpointing: diffusers' {type(self.model).__name__} has no gradient "
                            "checkpointing (its _supports_gradient_checkpointing is false); set it false")
        if on:
            self.model.enable_gradient_checkpointing()
        else:
            self.model.disable_gradient_checkpointing()

    def forward_all(self, x, c_noise, labels=None, text=None):
        """Every output channel, the learned-sigma half too."""
        if text is None:
            raise ValueError(f"model.arch={self.arch} is text-conditional: call it with text=Text(...)")
        b = x.shape[0]
        t = c_noise if self.time_scale == 1 else c_noise * self.time_scale
        states = text.states.to(x.dtype)
        mask = text.mask if self.use_mask else None
        if self.arch == "hunyuandit":
            return self._hunyuandit(x, t, text, states)
        if self.arch == "flux":
            return self._flux(x, t, text, states)
        if self.arch == "sd3":
            return self.model(x, states, pooled_projections=text.pooled.to(x.dtype), timestep=t, return_dict=False)[0]
        if self.arch == "pixart":
            h, w = self.size_ids(x)[4:]
            extra = {"resolution": torch.stack([h, w]).view(1, 2).expand(b, 2), "aspect_ratio": (h / w).view(1, 1)
                     .expand(b, 1)} if self.extra_conditions else {"resolution": None, "aspect_ratio": None}
            return self.model(x, states, timestep=t, added_cond_kwargs=extra, encoder_attention_mask=mask,
                              return_dict=False)[0]
        kw = {"class_labels": labels} if self.num_classes else {}
        if self.sdxl:
            ids = text.sizes.to(x.dtype) if text.sizes is not None else self.size_ids(x).expand(b, 6)
            kw["added_cond_kwargs"] = {"text_embeds": text.pooled.to(x.dtype), "time_ids": ids}
        return self.model(x, t, states, encoder_attention_mask=mask, return_dict=False, **kw)[0]

    def size_ids(self, x) -> torch.Tensor:
        """(6,) in x's dtype: original height, width, crop top, left, target height, width in pixels, as the
        pipelines' _get_add_time_ids make them at their defaults (original = target = the image's size, crop (0,
        0)): x's sides times pixel_size / the network's side (sample_size). Square x: pixel_size itself."""
        size = self.pixels.to(x.dtype)
        side = self.model.config.sample_size
        side = side if isinstance(side, int) else side[0]
        h, w = x.shape[-2:]
        if h == w == side:
            return torch.cat([size, size, torch.zeros_like(size), torch.zeros_like(size), size, size])
        ph, pw = (size * n / side for n in (h, w))  # exact: pixel_size is a multiple of side in every family
        return torch.cat([ph, pw, torch.zeros_like(size), torch.zeros_like(size), ph, pw])

    def rotary(self, h: int, w: int, device):
        """HunyuanDiT's image_rotary_emb for an h x w latent, as pipeline_hunyuandit's __call__ makes it."""
        key = (h, w, str(device))
        if key not in self._rope:
            from diffusers.models.embeddings import get_2d_rotary_pos_embed
            from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

            patch = self.model.config.patch_size
            grid = (h // patch, w // patch)
            crops = get_resize_crop_region_for_grid(grid, ROPE_BASE // patch)
            self._rope[key] = get_2d_rotary_pos_embed(self.model.inner_dim // self.model.num_heads, crops, grid,
                                                      device=device, output_type="pt")
        return self._rope[key]

    def _hunyuandit(self, x, t, text, states):
        b, cfg = x.shape[0], self.model.config
        n = cfg.text_len
        t = t.to(x.dtype).reshape(-1).expand(b)  # a float timestep: an integer one fails in the time embedding
        # image_meta_size: original H, W, target H, W, crop top, left (the add_time_ids of pipeline_hunyuandit)
        ids = text.sizes.to(x.dtype) if text.sizes is not None else self.size_ids(x).repeat(b, 1)
        meta = ids[:, [0, 1, 4, 5, 2, 3]]
        style = torch.zeros(b, dtype=torch.int64, device=x.device)
        # Contiguous parts: diffusers views the T5's as (B x L, D).
        first, second = states[:, :n, :cfg.cross_attention_dim].contiguous(), states[:, n:].contiguous()
        return self.model(x, t, encoder_hidden_states=first, text_embedding_mask=text.mask[:, :n].contiguous(),
                          encoder_hidden_states_t5=second, text_embedding_mask_t5=text.mask[:, n:].contiguous(),
                          image_meta_size=meta, style=style,
                          image_rotary_emb=self.rotary(x.shape[-2], x.shape[-1], x.device), return_dict=False)[0]

    def _flux(self, x, t, text, states):
        b, c, h, w = x.shape
        packed = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
        key = (h, w, str(x.device), x.dtype)
        if key not in self._rope:  # FluxPipeline._prepare_latent_image_ids: (0, row, column) of each token
            ids = torch.zeros(h // 2, w // 2, 3, device=x.device, dtype=x.dtype)
            ids[..., 1] += torch.arange(h // 2, device=x.device)[:, None]
            ids[..., 2] += torch.arange(w // 2, device=x.device)[None, :]
            self._rope[key] = ids.reshape(-1, 3)
        guidance = None
        if self.model.config.guidance_embeds:
            guidance = text.guidance if text.guidance is not None else torch.full(
                (b,), self.guidance, dtype=torch.float32, device=x.device)
        out = self.model(hidden_states=packed, timestep=t.to(x.dtype).reshape(-1).expand(b), guidance=guidance,
                         pooled_projections=text.pooled.to(x.dtype), encoder_hidden_states=states,
                         txt_ids=states.new_zeros(states.shape[1], 3), img_ids=self._rope[key], return_dict=False)[0]
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def forward(self, x, c_noise, labels=None, text=None):
        out = self.forward_all(x, c_noise, labels, text)
        return out[:, :self.in_channels] if out.shape[1] != self.in_channels else out


def build_unet(resolution: int, in_channels: int, num_classes: int, text: dict | None = None,
               time_scale: float = 1000.0, use_mask: bool = False, pixel_size: int | None = None, **config) -> TextNet:
    """`arch: diffusers-unet`: UNet2DConditionModel(sample_size=R, in_channels=C, out_channels=C,
    cross_attention_dim=D, **config)."""
    _check("diffusers-unet", config, text, num_classes)
    config = {**config, "out_channels": _out_channels(config, in_channels)}
    if config.get("addition_embed_type") == "text_time":
        if not text["pooled"]:
            raise UserError("model.kwargs.addition_embed_type=text_time (SDXL) needs a pooled text embedding; mark "
                            "a CLIP encoder of data.text_encoders pooled: true, or drop addition_embed_type")
        if config.get("addition_time_embed_dim") is None:
            raise ValueError("addition_embed_type text_time needs addition_time_embed_dim (SDXL: 256)")
        config.setdefault("projection_class_embeddings_input_dim", 6 * config["addition_time_embed_dim"] + text["pooled"])
    if num_classes:
        if config.get("num_class_embeds") is not None or config.get("class_embed_type") is not None:
            raise ValueError("num_class_embeds and class_embed_type are set by diffrelay from the dataset's classes "
                             "(K + 1 rows, the last the null class); remove them")
        config["num_class_embeds"] = num_classes + 1
    model = diffusers_class("diffusers-unet")(sample_size=resolution, in_channels=in_channels,
                                              cross_attention_dim=text["states"], **config)
    return TextNet("diffusers-unet", model, in_channels, num_classes, time_scale, use_mask, pixel_size or resolution)


def build_pixart(resolution: int, in_channels: int, num_classes: int, text: dict | None = None,
                 time_scale: float = 1000.0, use_mask: bool = True, pixel_size: int | None = None,
                 **config) -> TextNet:
    """`arch: pixart`: PixArtTransformer2DModel(sample_size=R, in_channels=C, caption_channels=D, **config)."""
    _check("pixart", config, text, num_classes)
    cls = diffusers_class("pixart")
    config = {"cross_attention_dim": _width(cls, config), **config, "out_channels": _out_channels(config, in_channels)}
    model = cls(sample_size=resolution, in_channels=in_channels, caption_channels=text["states"], **config)
    return TextNet("pixart", model, in_channels, 0, time_scale, use_mask, pixel_size or resolution)


def build_sd3(resolution: int, in_channels: int, num_classes: int, text: dict | None = None,
              time_scale: float = 1000.0, **config) -> TextNet:
    """`arch: sd3`: SD3Transformer2DModel(sample_size=R, in_channels=C, joint_attention_dim=D,
    pooled_projection_dim=P, **config)."""
    _check("sd3", config, text, num_classes)
    if not text["pooled"]:
        raise UserError("model.arch=sd3: SD3's transformer needs a pooled text embedding (pooled_projections); mark a "
                        "CLIP encoder of data.text_encoders pooled: true")
    cls = diffusers_class("sd3")
    config = {"caption_projection_dim": _width(cls, config), **config, "out_channels": _out_channels(config, in_channels)}
    model = cls(sample_size=resolution, in_channels=in_channels, joint_attention_dim=text["states"],
                pooled_projection_dim=text["pooled"], **config)
    return TextNet("sd3", model, in_channels, 0, time_scale, False, resolution)


def build_hunyuandit(resolution: int, in_channels: int, num_classes: int, text: dict | None = None,
                     time_scale: float = 1000.0, pixel_size: int | None = None, **config) -> TextNet:
    """`arch: hunyuandit`: HunyuanDiT2DModel(sample_size=R, in_channels=C, cross_attention_dim_t5=D, **config);
    the text's L tokens must be text_len + text_len_t5 and its width hold cross_attention_dim (the first encoder's)."""
    _check("hunyuandit", config, text, num_classes)
    cls = diffusers_class("hunyuandit")
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    first, second = (config.get(k, defaults[k]) for k in ("text_len", "text_len_t5"))
    if first + second != text["length"]:
        raise UserError(f"model.kwargs text_len {first} + text_len_t5 {second}: the text encoders give "
                        f"{text['length']} tokens (the first encoder's, then the T5's); set them to the encoders' "
                        "max_length")
    width = config.get("cross_attention_dim", defaults["cross_attention_dim"])
    if width > text["states"]:
        raise UserError(f"model.kwargs.cross_attention_dim {width}: wider than the text states ({text['states']}); "
                        "set it to the first encoder's width")
    config = {"hidden_size": _width(cls, config), "patch_size": 2, **config}
    model = cls(sample_size=resolution, in_channels=in_channels, cross_attention_dim_t5=text["states"], **config)
    return TextNet("hunyuandit", model, in_channels, 0, time_scale, True, pixel_size or resolution)


def build_flux(resolution: int, in_channels: int, num_classes: int, text: dict | None = None,
               time_scale: float = 1.0, guidance: float = FLUX_GUIDANCE, **config) -> TextNet:
    """`arch: flux`: FluxTransformer2DModel(in_channels=4C, joint_attention_dim=D, pooled_projection_dim=P,
    **config); the latents' side must be even (2 x 2 packing)."""
    _check("flux", config, text, num_classes)
    if not text["pooled"]:
        raise UserError("model.arch=flux: FLUX.1's transformer needs a pooled text embedding (pooled_projections); "
                        "mark its CLIP encoder of data.text_encoders pooled: true")
    if resolution % 2:
        raise UserError(f"model.arch=flux: a latent side of {resolution}; FLUX.1 packs 2 x 2 latent pixels into one "
                        "token, so the side must be even")
    out = config.get("out_channels")
    if out not in (None, 4 * in_channels):
        raise ValueError(f"out_channels={out}: FLUX.1's is its packed in_channels, {4 * in_channels} (or null)")
    model = diffusers_class("flux")(in_channels=4 * in_channels, joint_attention_dim=text["states"],
                                    pooled_projection_dim=text["pooled"], **config)
    return TextNet("flux", model, in_channels, 0, time_scale, False, resolution, guidance)
