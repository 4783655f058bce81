"""Latent prepare keeps only what it can vouch for: chunks are checked by their sha256 when resumed, non-finite
latents are refused as they are encoded, and a user's AutoencoderKL folder brings its own scaling.

Everything runs in-process on a tiny random AutoencoderKL (16 px images, one decoding process); chunk_rows is
cut to 16 rows so that 48 images make three chunks.
"""

import json
import logging
import struct
import sys

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL

from diffrelay import config, logs
from diffrelay.data import datasets, encoders, encoding
from diffrelay.errors import UserError


def tiny_vae(folder, **cfg):
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 4), layers_per_block=1,
                        latent_channels=4, norm_num_groups=2, sample_size=16, **cfg)
    vae.save_pretrained(folder)
    return folder


def data_config(tmp_path, **data):
    d = {"run": {"name": "lat", "seed": 0, "device": "cpu", "results": str(tmp_path / "results"),
                 "resources": str(tmp_path / "resources")},
         "data": {"kind": "shapes", "resolution": 16, "count": 48, "seed": 0, "encoder": "sd-vae",
                  "encoder_path": str(tiny_vae(tmp_path / "vae"))} | data,
         "model": {"channels": 8, "channel_mult": [1, 2], "num_blocks": 1, "class_conditional": True},
         "train": {"total_steps": 4, "segment_steps": 2, "batch_size": 8, "lr": 0.002, "warmup_steps": 1},
         "sample": {"num_images": 8, "steps": 3, "batch_size": 8}, "fid": {"extractor": "random"}}
    return config.Config(config.validate(d))


@pytest.fixture
def lines(monkeypatch, caplog):
    """The messages diffrelay logs here (its logger stops propagating once a stage has set it up)."""
    monkeypatch.setattr(logging.getLogger(logs.get().name), "propagate", True)
    caplog.set_level(logging.INFO)
    return lambda: [r.getMessage() for r in caplog.records]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(encoding, "CHUNK_BYTES", 1)  # chunk_rows(16) == encoders.ROWS == 16


def encode(cfg, work, enc=None):
    plan = datasets.plan(cfg.data, encoders.resolve(cfg.data, cfg.run.resources))
    encoding.write_plan(work, plan, "cpu")
    plan = encoding.read_plan(work)
    enc = enc or encoders.load("sd-vae", encoders.Path(cfg.data.encoder_path))
    encoding.encode_chunks(plan, work, 1, enc, torch.device("cpu"), 0, 1)
    return plan


def latents_at(path):
    """Byte offset of the first value of a chunk file's latents (safetensors: 8-byte size, JSON, data)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n + json.loads(raw[8:8 + n])["latents"]["data_offsets"][0]


# ---------------------------------------------------------------------------------------------
# Item 4: chunks carry a sha256 of their data, checked when resumed


def test_a_resumed_prepare_encodes_again_each_chunk_that_fails_its_sha256(tmp_path, small_chunks, lines):
    cfg = data_config(tmp_path)
    work = tmp_path / ".ds.encoding"
    plan = encode(cfg, work)
    paths = [encoding.chunk_path(work, c) for c in range(3)]
    clean = [p.read_bytes() for p in paths]
    # As the issue damaged them: bytes flipped in one chunk, a NaN written into a row of another, and one chunk
    # copied over another of the same shape. Each header still reads as this plan's.
    raw, at = bytearray(clean[0]), latents_at(paths[0]) + 256
    raw[at:at + 64] = bytes(b ^ 0xFF for b in raw[at:at + 64])
    paths[0].write_bytes(bytes(raw))
    raw, at = bytearray(clean[1]), latents_at(paths[1])
    raw[at:at + 4] = struct.pack("<f", float("nan"))
    paths[1].write_bytes(bytes(raw))
    paths[2].write_bytes(clean[0])
    assert all(encoding.check_chunk(work, plan, c) is not None for c in range(3))  # the header-only check passes
    encode(cfg, work)
    said = [m for m in lines() if "encoding it again" in m]
    assert len(said) == 3 and all("sha256" in m for m in said), said
    assert "chunk_000002" in said[2] and "copied from another chunk" in said[2]
    assert [p.read_bytes() for p in paths] == clean
    out = tmp_path / "out"
    out.mkdir()
    encoding.join(plan, work, out)
    assert np.isfinite(np.load(out / "latents.npy")).all()


def test_join_refuses_a_chunk_changed_after_it_was_checked(tmp_path, small_chunks):
    cfg = data_config(tmp_path)
    work = tmp_path / ".ds.encoding"
    plan = encode(cfg, work)
    path = encoding.chunk_path(work, 1)
    raw, at = bytearray(path.read_bytes()), latents_at(path)
    raw[at:at + 4] = struct.pack("<f", 1e9)
    path.write_bytes(bytes(raw))
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"chunk_000001\.safetensors: its data fail the sha256 .* rerun prepare"):
        encoding.join(plan, work, tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# Item 5: non-finite latents are refused as they are encoded, naming the images and the encoder

OWN = '''
import torch
import torch.nn.functional as F


class NanAfter:
    """4 channels, factor 2; NaN latents from encode call number `after` + 1 on (0: from the first)."""

    channels, factor, after = 4, 2, 0

    def __init__(self, path):
        self.scale, self.bias, self.calls = [1.0] * 4, [0.0] * 4, 0

    def encode(self, images):
        self.calls += 1
        x = F.avg_pool2d(images.float() / 127.5 - 1, 2)
        mean = torch.cat([x, x.mean(1, keepdim=True)], 1)
        if self.calls > self.after and images.float().mean() > 0:  # the probe batch (zeros) stays finite
            mean[3, 0, 0, 0] = float("nan")
        return mean, torch.full_like(mean, 0.05)

    def decode(self, latents):
        return (F.interpolate(latents[:, :3], scale_factor=2) * 127.5 + 128).clamp(0, 255).to(torch.uint8)


class NanLater(NanAfter):
    after = 1
'''


@pytest.mark.parametrize("name, row", [("NanAfter", 3), ("NanLater", 19)])
def test_your_encoder_returning_nan_is_refused_naming_the_images(tmp_path, monkeypatch, small_chunks, name, row):
    (tmp_path / "nan_enc.py").write_text(OWN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("nan_enc", None)
    cfg = data_config(tmp_path, encoder=f"nan_enc:{name}", encoder_path=None)
    work = tmp_path / ".ds.encoding"
    # The probe batch of zeros in resolve passes: the first real batch (or the second) is what fails.
    with pytest.raises(UserError) as e:
        encode(cfg, work, encoders.load(f"nan_enc:{name}", None))
    msg = str(e.value)
    assert "\n" not in msg and f"data.encoder=nan_enc:{name}: encode() returned NaN or inf" in msg
    assert f"image {row} of " in msg, msg
    done = sorted(p.name for p in work.glob("chunk_*"))
    assert done == ([] if row < 16 else ["chunk_000000.safetensors"])  # nothing with NaN was written


def test_an_sd_vae_with_a_nan_weight_is_refused(tmp_path):
    folder = tiny_vae(tmp_path / "vae")
    vae = AutoencoderKL.from_pretrained(folder)
    with torch.no_grad():
        vae.encoder.conv_in.weight[0, 0, 0, 0] = float("nan")
    vae.save_pretrained(tmp_path / "bad")
    with pytest.raises(UserError, match=r"encoder\.conv_in\.weight holds NaN or inf; the weights are damaged"):
        encoders.load("sd-vae", tmp_path / "bad")
    # A NaN that appears later (here, put into the loaded weights) is refused by the latents' own check.
    enc = encoders.load("sd-vae", folder)
    with torch.no_grad():
        enc.vae.encoder.conv_in.weight[0, 0, 0, 0] = float("nan")
    images = torch.randint(0, 256, (20, 3, 16, 16), dtype=torch.uint8)
    with pytest.raises(UserError, match=r"data.encoder=sd-vae: the VAE's latents of 16 of these 16 images "
                       r"\(a, b, c, \.\.\.\) hold NaN or inf"):
        encoders.encode(enc, images, "sd-vae", ["a", "b", "c"] + [f"x{i}" for i in range(17)])


# ---------------------------------------------------------------------------------------------
# Newcomer: a user's own AutoencoderKL folder brings its scaling_factor (and shift_factor)


def test_an_autoencoder_folder_brings_its_scaling_factor_and_shift(tmp_path, lines):
    own = str(tiny_vae(tmp_path / "sd3like", scaling_factor=1.5, shift_factor=0.25))
    cfg = data_config(tmp_path, encoder_path=own)
    rec = encoders.resolve(cfg.data, cfg.run.resources)
    # diffusers' pipelines: latents = (z - shift_factor) * scaling_factor
    assert rec["scale"] == [1.5] * 4 and rec["bias"] == [-0.375] * 4
    assert any("scaling_factor 1.5, shift_factor 0.25" in m and "(z - shift) x scale" in m for m in lines())
    enc = encoders.load("sd-vae", tmp_path / "sd3like")  # what sampling decodes with agrees with the record
    assert enc.scale == rec["scale"] and enc.bias == rec["bias"]
    cfg = data_config(tmp_path, encoder_path=own, latent_norm="edm2")  # edm2's constants replace it, said so
    rec = encoders.resolve(cfg.data, cfg.run.resources)
    assert rec["scale"] == list(encoders.norm("edm2").scale)
    assert any("latent_norm=edm2" in m and "scaling_factor 1.5" in m for m in lines())
    # The SD-VAE's own folder (and a bare weights file) keep SD's 0.18215 and no bias, as before.
    cfg = data_config(tmp_path)
    assert encoders.resolve(cfg.data, cfg.run.resources)["scale"] == [0.18215] * 4
    assert encoders.scaling(tmp_path / "vae" / encoders.WEIGHTS) == (0.18215, None)


def test_a_bad_scaling_factor_is_one_line(tmp_path):
    folder = tiny_vae(tmp_path / "vae")
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(c | {"scaling_factor": -1}))
    with pytest.raises(UserError, match=r"config.json: scaling_factor=-1; give a finite number > 0"):
        encoders.scaling(folder)
