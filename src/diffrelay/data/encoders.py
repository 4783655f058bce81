"""Autoencoders for latent diffusion (data.encoder): Stability's SD-VAE through diffusers, or your own.

Latent runs train on the latents of the images, encoded once by `prepare`, and `sample` decodes what the
network makes back to pixels. Everything else (order, seeds, segments, scores) is what it is for pixels.

Your own encoder (data.encoder: "package.module:Name"):
  Name.channels, Name.factor   latent channels C and down-sampling factor f, read without calling Name (the
                               config is checked before any weights load); f must divide data.resolution
  Name(path)                   path = data.encoder_path (or None); returns an object with
    encode(images)             uint8 (N, 3, H, W) -> (mean, std), float32 (N, C, H/f, W/f) each: the latent
                               distribution, unscaled; training draws mean + std * eps from it every step
    decode(latents)            float32 (N, C, H/f, W/f), unscaled -> uint8 (N, 3, H, W)
    scale, bias                C floats each: the network sees (mean + std * eps) * scale + bias
  Its identity (recorded by datasets and snapshots) is the sha256 of data.encoder_path (every file of a folder),
  else of its module file. It is called with CPU tensors on any device (diffrelay moves them).

The SD-VAE's two conventions (data.latent_norm), as their papers' code has them:
  dit    pixels in [-1, 1], latents x 0.18215 (DiT's and SiT's train.py; REPA's sd-vae-ft-ema path): the
         scaling_factor Stable Diffusion chose for unit variance of its latents. A save_pretrained folder's
         config.json has its own (SDXL's VAE 0.13025; SD3's 1.5305 with shift_factor 0.0609): the latents are
         then (z - shift_factor) x scaling_factor, as diffusers' pipelines scale them (scaling()).
  edm2   pixels in [0, 1], latents x 0.5 / raw_std - raw_mean x that, per channel: standard deviation 0.5,
         EDM's sigma_data (edm2 training/encoders.py StabilityVAEEncoder).
"""

import hashlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from diffrelay import io, logs
from diffrelay.errors import UserError

SD_VAE = {"sd-vae": "sd-vae-ft-mse", "sd-vae-ft-mse": "sd-vae-ft-mse", "sd-vae-ft-ema": "sd-vae-ft-ema"}
SD_CHANNELS, SD_FACTOR = 4, 8
SD_URL = "https://huggingface.co/stabilityai/{name}/resolve/main/diffusion_pytorch_model.safetensors"
# diffusers' config.json of stabilityai/sd-vae-ft-mse and sd-vae-ft-ema (the same network): what a bare
# .safetensors file is loaded into.
SD_CONFIG = {"act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
             "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
             "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2,
             "norm_num_groups": 32, "sample_size": 256}
DIT_SCALE = 0.18215
EDM2_RAW_MEAN, EDM2_RAW_STD, EDM2_FINAL_STD = (5.81, 3.25, 0.12, -2.15), (4.17, 4.62, 3.71, 3.28), 0.5
ROWS = 16  # images per encode/decode call, padded: CPU kernels agree row for row from 16 rows (sample.py)
WEIGHTS = "diffusion_pytorch_model.safetensors"
FIX = f"give data.encoder_path a diffusers AutoencoderKL: a save_pretrained folder or its {WEIGHTS}"


def is_latent(spec: str | None) -> bool:
    return bool(spec) and spec != "none"


def geometry(spec: str, path=None) -> tuple[int, int]:
    """(channels, factor) of data.encoder: an AutoencoderKL folder's config.json says; the SD-VAE's are 4 and 8;
    your class's attributes (its module is imported, its weights are not loaded)."""
    if spec in SD_VAE:
        cfg = Path(path).expanduser() / "config.json" if path else None
        if cfg is None or not cfg.is_file():
            return SD_CHANNELS, SD_FACTOR
        c = io.read_json(cfg)
        try:
            return int(c.get("latent_channels", 4)), 2 ** (len(c["block_out_channels"]) - 1)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise UserError(f"{cfg}: data.encoder_path: not an AutoencoderKL config (no block_out_channels); "
                            f"{FIX}") from e
    cls = _own_class(spec)
    channels, factor = getattr(cls, "channels", None), getattr(cls, "factor", None)
    for name, v in (("channels", channels), ("factor", factor)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UserError(f"data.encoder={spec}: {name} is {v!r}; the encoder class must have an integer "
                            f"attribute {name} >= 1 (see docs/data.md, latents)")
    return channels, factor


def _own_class(spec: str):
    module, _, name = spec.partition(":")
    if not module or not name:
        raise UserError(f"data.encoder={spec}: use none, sd-vae, sd-vae-ft-mse, sd-vae-ft-ema or "
                        "\"package.module:Name\" for your own")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UserError(f"data.encoder={spec}: cannot import {name} from {module} ({e}); put its package on "
                        "PYTHONPATH or fix the name") from e


def default_path(spec: str, resources) -> Path:
    """Where sd-vae's weights live when data.encoder_path is not given: fetched once into run.resources."""
    return Path(resources) / "vae" / f"{SD_VAE[spec]}.safetensors"


def weights_file(path: Path) -> Path:
    """The .safetensors file of data.encoder_path: the file itself, or a save_pretrained folder's."""
    return path / WEIGHTS if path.is_dir() else path


def identity(spec: str, path: Path | None) -> str:
    """sha256 naming the encoder: of its weights (and a folder's config.json), else of your module's file."""
    if path is None:
        module = importlib.import_module(spec.partition(":")[0])
        return io.sha256_file(module.__file__)
    if path.is_dir():  # an AutoencoderKL folder: its config and weights; your encoder's: every file in it
        files = [path / n for n in ("config.json", WEIGHTS)] if spec in SD_VAE else sorted(
            p for p in path.rglob("*") if p.is_file())
        parts = [f"{f.relative_to(path).as_posix()}:{io.sha256_file(f)}" for f in files if f.is_file()]
        return hashlib.sha256(" ".join(parts).encode()).hexdigest()
    return io.sha256_file(path)


# ---------------------------------------------------------------------------------------------
# Fetching SD-VAE weights


def url(spec: str) -> str:
    return SD_URL.format(name=SD_VAE[spec])


def fetch(spec: str, path: Path) -> Path:
    """sd-vae's weights at `path`: a file already there is used as is (checked when loaded); else downloaded to
    a temp file, checked against the SD-VAE's keys and shapes, and renamed, so a bad download never appears."""
    import safetensors
    from safetensors.torch import load as read_safetensors  # bytes in: the temp file is not yet renamed

    if path.exists():
        return path
    with io.atomic_write(path, "w+b") as f:
        io.download(url(spec), f, path, place_at=path)
        f.flush()
        f.seek(0)
        try:
            state = read_safetensors(f.read())
        except (OSError, ValueError, RuntimeError, safetensors.SafetensorError) as e:
            raise UserError(f"{path}: the download of {url(spec)} is not a .safetensors file ({e}); try again, or "
                            f"fetch it elsewhere and place it at {path.resolve()}") from e
        check_state(_vae_of(SD_CONFIG, path), state, path)
    return path


# ---------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class Norm:
    """How pixels enter the SD-VAE and latents the network: (u8 / div - sub), then z * scale + bias."""

    name: str
    div: float
    sub: float
    scale: tuple
    bias: tuple


def norm(name: str, channels: int = SD_CHANNELS, scaling: tuple = (DIT_SCALE, None)) -> Norm:
    """`scaling`: the VAE's (scaling_factor, shift_factor or None), which dit uses and edm2 does not."""
    import numpy as np

    if name == "edm2":  # float32 arithmetic as edm2 does it, so the constants are its bits
        scale = np.float32(EDM2_FINAL_STD) / np.asarray(EDM2_RAW_STD, dtype=np.float32)
        bias = np.float32(0) - np.asarray(EDM2_RAW_MEAN, dtype=np.float32) * scale
        return Norm("edm2", 255.0, 0.0, tuple(map(float, scale)), tuple(map(float, bias)))
    factor, shift = float(scaling[0]), float(scaling[1] or 0.0)
    return Norm("dit", 127.5, 1.0, (factor,) * channels, (0.0 - shift * factor,) * channels)


def scaling(path) -> tuple:
    """(scaling_factor, shift_factor or None) of the AutoencoderKL at `path`, as diffusers reads them: a
    save_pretrained folder's config.json (load_config), with AutoencoderKL's defaults for what it leaves out; a
    bare .safetensors file is the SD-VAE (0.18215, no shift)."""
    import inspect
    import math

    cfg = Path(path) / "config.json" if path is not None else None
    if cfg is None or not cfg.is_file():
        return DIT_SCALE, None
    from diffusers import AutoencoderKL

    try:
        c = AutoencoderKL.load_config(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"{cfg}: diffusers cannot read it ({e}); {FIX}") from e
    params = inspect.signature(AutoencoderKL.__init__).parameters
    got = {k: c.get(k, params[k].default if k in params else None) for k in ("scaling_factor", "shift_factor")}
    for key, v in got.items():
        if (v is not None or key == "scaling_factor") and not (
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
                key == "shift_factor" or v > 0)):
            raise UserError(f"{cfg}: {key}={v!r}; give a finite number{' > 0' * (key == 'scaling_factor')} (or "
                            "leave it out for diffusers' default)")
    return float(got["scaling_factor"]), None if got["shift_factor"] is None else float(got["shift_factor"])


class StabilityVAE:
    """The SD-VAE (diffusers' AutoencoderKL) under the contract above."""

    channels, factor = SD_CHANNELS, SD_FACTOR

    def __init__(self, vae, latent_norm: str):
        self.vae = vae
        self.channels = vae.config.latent_channels
        self.factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.norm = norm(latent_norm, self.channels, (vae.config.scaling_factor, vae.config.get("shift_factor")))
        self.scale, self.bias = list(self.norm.scale), list(self.norm.bias)

    def encode(self, images):
        import torch

        x = images.to(torch.float32) / self.norm.div - self.norm.sub
        d = self.vae.encode(x).latent_dist
        return d.mean, d.std

    def decode(self, latents):
        import torch

        y = self.vae.decode(latents).sample
        if self.norm.name == "edm2":  # edm2's decode: clamp to [0, 1], x 255, truncated
            return y.clamp(0, 1).mul(255).to(torch.uint8)
        return (y * 127.5 + 128).clamp(0, 255).to(torch.uint8)  # DiT's sample.py, and diffrelay's pixels


def _vae_of(cfg: dict, path: Path):
    from diffusers import AutoencoderKL

    try:
        return AutoencoderKL.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: diffusers cannot build an AutoencoderKL from its config ({e}); {FIX}") from e


def check_state(vae, state: dict, weights: Path) -> dict:
    """`state` with SD's old attention names renamed as diffusers renames them; one line unless its keys and
    shapes are exactly the VAE's (a file of another network)."""
    state = vae._fix_state_dict_keys_on_load(state)
    want = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    wrong = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    if missing or extra or wrong:
        what = (f"{len(missing)} missing keys (e.g. {missing[0]})" if missing else
                f"{len(extra)} unexpected keys (e.g. {extra[0]})" if extra else
                f"{wrong[0]} is {list(got[wrong[0]])}, the VAE has {list(want[wrong[0]])}")
        raise UserError(f"{weights}: not the weights of this AutoencoderKL ({what}); {FIX}")
    import torch

    bad = next((k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:  # every latent would be NaN: one line now, not a dataset of NaN rows
        raise UserError(f"{weights}: {bad} holds NaN or inf; the weights are damaged: fetch or copy them again")
    return state


def read_vae(path: Path, device="cpu"):
    """diffusers' AutoencoderKL from a save_pretrained folder or a bare .safetensors (SD's config); the keys and
    shapes are checked first, so a file of another network is one line."""
    import safetensors.torch

    weights = weights_file(path)
    if path.is_dir():
        io.check_regular_file(path / "config.json", 1 << 20, "AutoencoderKL config", FIX)
        cfg = io.read_json(path / "config.json")
        if not isinstance(cfg, dict) or cfg.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
            raise UserError(f"{path / 'config.json'}: not an AutoencoderKL config; {FIX}")
    else:
        cfg = SD_CONFIG
    io.check_regular_file(weights, 1 << 36, "VAE weights file", FIX)
    vae = _vae_of(cfg, path)
    try:
        state = safetensors.torch.load_file(str(weights))
    except (OSError, ValueError, RuntimeError, safetensors.SafetensorError) as e:  # a bad header, a short file
        raise UserError(f"{weights}: not a readable .safetensors file ({e}); {FIX}") from e
    state = check_state(vae, state, weights)
    vae.load_state_dict(state)
    return vae.to(device).eval().requires_grad_(False)  # float32: load_state_dict copies into its parameters


def load(spec: str, path: Path | None, latent_norm: str = "dit", device="cpu"):
    """The encoder of data.encoder as an object of the contract, on `device`."""
    if spec in SD_VAE:
        return StabilityVAE(read_vae(path, device), latent_norm)
    enc = _own_class(spec)(None if path is None else str(path))
    for name in ("encode", "decode", "scale", "bias"):
        if getattr(enc, name, None) is None:
            raise UserError(f"data.encoder={spec}: its object has no {name}; see the contract in docs/data.md")
    return enc


def resolve(data, resources, fetch_missing: bool = True) -> dict | None:
    """The record of data.encoder (None for pixels): its weights found (sd-vae: fetched once into
    <resources>/vae/ when data.encoder_path is null), hashed, and its geometry and scaling read."""
    spec = data.encoder
    if not is_latent(spec):
        return None
    path = Path(data.encoder_path).expanduser() if data.encoder_path else None
    if spec in SD_VAE:
        if path is None:
            path = default_path(spec, resources)
            if fetch_missing:
                fetch(spec, path)
        if not path.exists():
            raise UserError(f"data.encoder_path={path}: not found; "
                            + (f"fetch {url(spec)} and place it there" if not data.encoder_path else
                               "give the folder save_pretrained wrote, or the .safetensors file"))
        why = io.safetensors_problem(weights_file(path))  # its header, before any image is decoded
        if why:
            raise UserError(f"{weights_file(path)}: data.encoder_path: {why}; {FIX}")
        channels, factor = geometry(spec, path)
        if channels != SD_CHANNELS and data.latent_norm == "edm2":
            raise UserError(f"data.latent_norm=edm2: edm2's constants are for the SD-VAE's 4 channels, and "
                            f"{path} has {channels}; use latent_norm dit")
        vae_scale, shift = scaling(path)  # the record needs no weights: geometry and scaling only
        if (vae_scale, shift) != (DIT_SCALE, None):  # not the SD-VAE's: say which scaling applies, and why
            own = f"{path}'s config.json sets scaling_factor {vae_scale:g}" + (f", shift_factor {shift:g}" if shift
                                                                             is not None else "")
            logs.get().info(f"data.encoder_path: {own}; the latents are (z - shift) x scale as diffusers scales "
                            "them" if data.latent_norm == "dit" else f"data.latent_norm=edm2: {own}, which edm2's "
                            "per-channel constants (measured on the SD-VAE) replace; use latent_norm dit for them")
        n = norm(data.latent_norm, channels, (vae_scale, shift))
        enc = SimpleNamespace(channels=channels, factor=factor, scale=n.scale, bias=n.bias)
    else:
        if path is not None and not path.exists():
            raise UserError(f"data.encoder_path={path}: not found; give your encoder's weights, or null")
        enc = load(spec, path)
        import torch

        # Before any image is decoded: an encoder that breaks the contract is one line, not a half-built dataset.
        encode(enc, torch.zeros((ROWS, 3, data.resolution, data.resolution), dtype=torch.uint8), spec)
    if len(enc.scale) != enc.channels or len(enc.bias) != enc.channels:
        raise UserError(f"data.encoder={spec}: scale and bias need {enc.channels} values each (one per latent "
                        f"channel); it has {len(enc.scale)} and {len(enc.bias)}")
    return record(spec, path, identity(spec, path), data.latent_norm, enc)


RECORD_KEYS = ("encoder", "sha256", "norm", "channels", "factor", "scale", "bias")


def record(spec, path, sha, latent_norm, enc) -> dict:
    """What a dataset and a snapshot say about their encoder (json-ready); `path` is where to load it from."""
    return {"encoder": spec, "path": None if path is None else str(Path(path).resolve()), "sha256": sha,
            "norm": latent_norm if spec in SD_VAE else None, "channels": int(enc.channels), "factor": int(enc.factor),
            "scale": [float(v) for v in enc.scale], "bias": [float(v) for v in enc.bias]}


# ---------------------------------------------------------------------------------------------
# Running it: fixed-shape batches, outputs checked


def _padded(x, rows: int):
    import torch

    return torch.cat([x, x[:1].expand(rows - len(x), *x.shape[1:])]) if len(x) < rows else x


def encode(enc, images, spec: str, names=None):
    """(mean, std) float32 (N, C, h, w) of uint8 (N, 3, H, W) `images`, ROWS at a time (the last padded), so a
    row's bytes do not depend on how many there are; your encoder's output is checked first, and every call's
    for NaN or inf (one host sync a call), naming the images (`names`: one per row) and the encoder."""
    import torch

    n, _, height, width = images.shape
    device, own = images.device, not isinstance(enc, StabilityVAE)
    images = images.cpu() if own else images  # your encoder works on CPU tensors (the contract)
    want = (enc.channels, height // enc.factor, width // enc.factor)
    means, stds = [], []
    with torch.inference_mode():
        for start in range(0, n, ROWS):
            chunk = images[start:start + ROWS]
            out = enc.encode(_padded(chunk, ROWS))
            if not (isinstance(out, tuple) and len(out) == 2 and all(
                    isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (ROWS, *want)
                    for t in out)):
                got = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                       for t in (out if isinstance(out, tuple) else (out,))]
                raise UserError(f"data.encoder={spec}: encode() of {ROWS} images returned {got}; it must return "
                                f"(mean, std), two float32 tensors of shape {(ROWS, *want)}")
            mean, std = out[0][:len(chunk)], out[1][:len(chunk)]
            if not bool(torch.isfinite(mean).all() & torch.isfinite(std).all()):
                _non_finite(enc, spec, mean, std, [names[i] if names else f"row {i}"
                                                   for i in range(start, start + len(chunk))])
            means.append(mean.to(device))
            stds.append(std.to(device))
    return torch.cat(means), torch.cat(stds)


def _non_finite(enc, spec: str, mean, std, names: list) -> None:
    """One line naming the images whose latents hold NaN or inf, and the encoder (a VAE's weights, or your code):
    stored, they would make every training step non-finite."""
    import torch

    bad = [n for n, ok in zip(names, (torch.isfinite(mean) & torch.isfinite(std)).flatten(1).all(1).tolist())
           if not ok]
    what = f"{len(bad)} of these {len(names)} images ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
    if isinstance(enc, StabilityVAE):
        raise UserError(f"data.encoder={spec}: the VAE's latents of {what} hold NaN or inf; check data.encoder_path's "
                        "weights (any NaN or inf in them?), or fetch them again")
    raise UserError(f"data.encoder={spec}: encode() returned NaN or inf for {what}; fix the encoder (docs/data.md, "
                    "latents): latents must be finite")


def decode(enc, latents, spec: str, image_shape):
    """uint8 (N, 3, H, W) of unscaled latents, decoded in batches of exactly len(latents) rows (the caller pads)."""
    import torch

    own = not isinstance(enc, StabilityVAE)
    with torch.inference_mode():
        out = enc.decode(latents.cpu() if own else latents)  # your encoder works on CPU tensors
    want = (len(latents), *image_shape)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or tuple(out.shape) != want:
        got = (tuple(out.shape), str(out.dtype)) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"data.encoder={spec}: decode() returned {got}; it must return a uint8 tensor of shape {want}")
    return out.to(latents.device)
