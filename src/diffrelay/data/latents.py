"""Latent datasets: `prepare` encodes every image once; training draws a latent from the stored distribution.

What prepare writes beside labels.npy and dataset.json (its "latent" entry is encoders.record; the encoding
itself, in chunks over the ranks, is data/encoding.py):
  latents.npy        float32 (N, 2C, h, w): the mean and then the std of each image's latent distribution,
                     unscaled, as edm2's dataset_tool.py encode stores them (so a run can pick its own draw)
  latents_xflip.npy  the same of the mirrored images, when data.xflip > 0: the latent of a mirrored image is not
                     the mirrored latent, so flips take these rows (as LightningDiT and MAR store them)
  images.npy         the pixels too, unless data.keep_images is false (the dataset's FID reference reads them)

Each step the loader draws eps ~ N(0, I) for every row of the global batch from the step's generator, after the
objective's noise, and the network sees (mean + std * eps) * scale + bias: a new sample of the latent each time
an image is seen, the same for any process count and on resume (edm2's encode_latents; DiT's
latent_dist.sample() * 0.18215 is the same draw with bias 0).
"""

from pathlib import Path

import numpy as np

from diffrelay.data import encoders
from diffrelay.errors import UserError

ENCODED, FLIPPED = "latents.npy", "latents_xflip.npy"


def open_arrays(path: Path, info: dict, count: int) -> tuple:
    """(latents, latents_xflip or None) of a latent dataset, memory-mapped and checked against dataset.json."""
    latent, fix = info["latent"], "rerun `diffrelay prepare --config <your config>`"
    c, side = latent["channels"], info["resolution"] // latent["factor"]
    out = []
    for name in (ENCODED, FLIPPED) if latent.get("xflip") else (ENCODED,):
        try:
            array = np.load(path / name, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise UserError(f"{path / name}: missing or unreadable ({e}); {fix}") from e
        if array.shape != (count, 2 * c, side, side) or array.dtype != np.float32:
            raise UserError(f"{path / name}: shape {array.shape} {array.dtype} does not match dataset.json "
                            f"(count={count}, {2 * c} x {side} x {side}, float32); {fix}")
        out.append(array)
    return out[0], (out[1] if len(out) > 1 else None)


def check_kind(data, cfg_data, resources) -> None:
    """A latent run needs a dataset made by its encoder; a pixel run a pixel dataset. One line otherwise. The
    config's weights are hashed and compared when they are on this machine (training itself does not need them)."""
    fix = "rerun `diffrelay prepare --config <your config>` into a new folder"
    encoder_sha = None
    if data.latent is not None and cfg_data.encoder != "none":
        made, want = (encoders.SD_VAE.get(s, s) for s in (data.latent["encoder"], cfg_data.encoder))
        norm = cfg_data.latent_norm if cfg_data.encoder in encoders.SD_VAE else None
        if made != want or data.latent.get("norm") != norm:
            raise UserError(f"{data.path}: encoded with data.encoder={data.latent['encoder']}, latent_norm "
                            f"{data.latent.get('norm')}; this run has {cfg_data.encoder}, {norm}; set them as the "
                            f"dataset was made, or {fix}")
        if cfg_data.xflip > 0 and not data.latent.get("xflip"):  # (a bucketed dataset's are per bucket)
            raise UserError(f"{data.path}: has no latents of mirrored images (made with data.xflip 0) and this run "
                            f"has data.xflip={cfg_data.xflip}; {fix}")
        try:
            encoder_sha = encoders.resolve(cfg_data, resources, fetch_missing=False)["sha256"]
        except UserError:
            encoder_sha = None  # not here: the dataset's record is what training uses
    if cfg_data.encoder == "none" and data.latent is not None:
        raise UserError(f"{data.path}: a latent dataset (made with data.encoder={data.latent['encoder']}); this run "
                        f"has data.encoder none and trains on pixels; set data.encoder as it was, or {fix}")
    if cfg_data.encoder != "none" and data.latent is None:
        raise UserError(f"{data.path}: a pixel dataset; this run has data.encoder={cfg_data.encoder} and trains on "
                        f"latents; {fix}")
    if data.latent is not None and encoder_sha is not None and data.latent["sha256"] != encoder_sha:
        raise UserError(f"{data.path}: encoded by another encoder (sha256 {data.latent['sha256'][:12]}, the "
                        f"config's is {encoder_sha[:12]}); point data.encoder_path at the weights it was made with, "
                        f"or {fix}")


def snapshot_record(data) -> dict:
    """A snapshot's record of its decoder (the dataset's encoder) and of the images it decodes to."""
    return {k: v for k, v in data.latent.items() if k not in ("xflip", "keep_images")} | {
        "image_shape": [3, data.resolution, data.resolution]}


def output_shape(meta: dict) -> list:
    """[C, H, W] of the images a snapshot's samples are: the decoded images of a latent snapshot."""
    return (meta.get("latent") or {}).get("image_shape") or meta["image_shape"]


def load_decoder(meta: dict, snapshot, data_cfg: dict | None, resources, device):
    """The encoder that decodes a latent snapshot's samples (None for a pixel snapshot), checked to be the one its
    dataset was encoded with. A config's data.encoder_path (or sd-vae's fetched copy) is used when a config is
    given; else the weights the snapshot recorded. Your own encoder's code is named by the config, never by the
    file (as for networks, checkpoint.load_snapshot)."""
    rec = meta.get("latent")
    if rec is None:
        return None
    spec = rec["encoder"]
    if data_cfg is not None and data_cfg.get("encoder") != spec and not (
            data_cfg.get("encoder") in encoders.SD_VAE and spec in encoders.SD_VAE):
        raise UserError(f"{snapshot}: a latent snapshot of data.encoder={spec}; the config has data.encoder="
                        f"{data_cfg.get('encoder')}; set it as the snapshot was trained")
    if spec not in encoders.SD_VAE and data_cfg is None:
        raise UserError(f"{snapshot}: decodes with your own encoder {spec}; pass the run's config with --config, "
                        "so the config, not the file, names the code to run")
    path = None if rec.get("path") is None else Path(rec["path"])
    if data_cfg is not None and data_cfg.get("encoder_path"):
        path = Path(data_cfg["encoder_path"]).expanduser()
    elif data_cfg is not None and spec in encoders.SD_VAE:
        fetched = encoders.default_path(data_cfg["encoder"], resources)
        path = fetched if fetched.exists() or path is None or not path.exists() else path
    if path is not None and not path.exists():
        where = f"fetch {encoders.url(spec)} and place it there, or " if spec in encoders.SD_VAE else ""
        raise UserError(f"{snapshot}: decodes with the {spec} weights at {path}, not found; {where}set "
                        "data.encoder_path to a copy of the weights it was trained with")
    sha = encoders.identity(spec, path)
    if sha != rec["sha256"]:
        raise UserError(f"{snapshot}: trained on latents of the encoder with sha256 {rec['sha256'][:12]}; {path} is "
                        f"another ({sha[:12]}); point data.encoder_path at the weights it was trained with")
    enc = encoders.load(spec, path, rec.get("norm") or "dit", device)
    if [float(v) for v in enc.scale] != rec["scale"] or [float(v) for v in enc.bias] != rec["bias"]:
        raise UserError(f"{snapshot}: {spec} now scales its latents by {list(enc.scale)} + {list(enc.bias)}, the "
                        f"snapshot was trained with {rec['scale']} + {rec['bias']}; use the encoder it was trained with")
    return enc


def decode(enc, latents_batch, rec: dict):
    """uint8 NCHW images of a batch of the network's (scaled) latents: unscaled as edm2's decode does, then
    decoded (the caller passes the whole fixed-shape batch, padding included)."""
    import torch

    scale, bias = (torch.tensor(rec[k], dtype=torch.float32, device=latents_batch.device).view(1, -1, 1, 1)
                   for k in ("scale", "bias"))
    raw = (latents_batch.to(torch.float32) - bias) / scale
    # encoders.ROWS at a time (sampling's batches are a multiple of it): the same calls for any batch size, and
    # the decoder's memory bounded at any resolution.
    return torch.cat([encoders.decode(enc, part, rec["encoder"], tuple(rec["image_shape"]))
                      for part in raw.split(encoders.ROWS)])
