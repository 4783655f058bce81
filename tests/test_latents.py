"""Latent runs (data.encoder): prepare encodes once, training draws latents per step, sampling decodes.

The VAE is a tiny diffusers AutoencoderKL that the tests build (random weights, a few thousand parameters); the
formulas are restated here from DiT's and edm2's code, not read from diffrelay's modules.
"""

import dataclasses
import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import AutoencoderKL

from conftest import REPO, run_cli
from diffrelay import config
from diffrelay.data import datasets, encoders, latents, loader
from diffrelay.errors import UserError
from test_sample import folder_bytes, sample_args
from test_train import assert_tensors_equal, load_state, torchrun

OWN = '''
import os

import torch
import torch.nn.functional as F


class Pool:
    """Average 2x2 blocks: a toy encoder of the contract (4 channels: RGB and their mean)."""

    channels, factor = 4, 2

    def __init__(self, path):
        self.scale, self.bias = [2.0, 2.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.5]

    calls = 0

    def encode(self, images):
        Pool.calls += 1
        if Pool.calls == int(os.environ.get("POOL_DIES_AT", 0)):
            os._exit(137)  # killed mid-encode, as by SIGKILL
        x = F.avg_pool2d(images.float() / 127.5 - 1, 2)
        mean = torch.cat([x, x.mean(1, keepdim=True)], 1)
        return mean, torch.full_like(mean, 0.05)

    def decode(self, latents):
        x = F.interpolate(latents[:, :3], scale_factor=2, mode="nearest")
        return (x * 127.5 + 128).clamp(0, 255).to(torch.uint8)


class WrongShape(Pool):
    def encode(self, images):
        mean, std = super().encode(images)
        return mean[:, :3], std[:, :3].double()
'''


def tiny_vae(folder: Path, seed: int = 0, width: int = 4) -> Path:
    torch.manual_seed(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(width, width),
                        layers_per_block=1, latent_channels=4, norm_num_groups=2, sample_size=16)
    vae.save_pretrained(folder)
    return folder


def latent_config(tmp_path: Path, **data) -> dict:
    return {"run": {"name": "lat", "seed": 0, "device": "cpu", "results": str(tmp_path / "results"),
                    "resources": str(tmp_path / "resources")},
            "data": {"kind": "shapes", "resolution": 16, "count": 24, "seed": 0, "encoder": "sd-vae",
                     "encoder_path": str(tiny_vae(tmp_path / "vae")), "xflip": 0.5} | data,
            "model": {"channels": 8, "channel_mult": [1, 2], "num_blocks": 1, "class_conditional": True},
            "train": {"total_steps": 4, "segment_steps": 2, "batch_size": 8, "lr": 0.002, "warmup_steps": 1,
                      "log_every": 1, "label_dropout": 0.25},
            "sample": {"num_images": 8, "steps": 3, "batch_size": 8},
            "fid": {"extractor": "random", "batch_size": 16}}


def write(tmp_path: Path, d: dict, name="cfg.yaml") -> Path:
    (tmp_path / name).write_text(yaml.safe_dump(d))
    return tmp_path / name


def images_nchw(n=20, seed=1, side=16):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, 3, side, side), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------
# The encoder: diffusers' own calls, DiT's and edm2's conventions restated


@pytest.mark.parametrize("norm", ["dit", "edm2"])
def test_encode_and_decode_are_diffusers_calls_with_the_papers_conventions(tmp_path, norm):
    folder = tiny_vae(tmp_path / "vae")
    # As edm2's load_stability_vae sets it up: with gradients on, torch's attention takes another kernel (2e-7).
    vae = AutoencoderKL.from_pretrained(folder).eval().requires_grad_(False)
    enc = encoders.load("sd-vae", folder, norm)
    images = images_nchw(32)  # two whole calls of encoders.ROWS: the same rows as diffusers gets below
    mean, std = encoders.encode(enc, images, "sd-vae")
    # DiT feeds [-1, 1] (Normalize(0.5, 0.5)); edm2 feeds x / 255 (training/encoders.py encode_pixels).
    x = images.float() / 127.5 - 1 if norm == "dit" else images.float() / 255
    with torch.no_grad():
        dist = torch.cat([vae.encode(x[i:i + 16]).latent_dist.mean for i in range(0, 32, 16)])
        dstd = torch.cat([vae.encode(x[i:i + 16]).latent_dist.std for i in range(0, 32, 16)])
        assert torch.equal(mean, dist) and torch.equal(std, dstd)
        z = torch.randn(16, 4, 8, 8, generator=torch.Generator().manual_seed(3))
        y = vae.decode(z).sample
    want = ((y * 127.5 + 128).clamp(0, 255) if norm == "dit" else y.clamp(0, 1).mul(255)).to(torch.uint8)
    assert torch.equal(encoders.decode(enc, z, "sd-vae", (3, 16, 16)), want)
    if norm == "dit":  # DiT's train.py: latent_dist.sample().mul_(0.18215)
        assert enc.scale == [0.18215] * 4 and enc.bias == [0.0] * 4
    else:  # edm2: final_std / raw_std, final_mean - raw_mean * scale, in float32
        scale = np.float32(0.5) / np.array([4.17, 4.62, 3.71, 3.28], dtype=np.float32)
        bias = -np.array([5.81, 3.25, 0.12, -2.15], dtype=np.float32) * scale
        assert enc.scale == scale.tolist() and enc.bias == bias.tolist()


def test_a_rows_latent_does_not_depend_on_the_other_images(tmp_path):
    enc = encoders.load("sd-vae", tiny_vae(tmp_path / "vae"))
    images = images_nchw(40)
    mean, _ = encoders.encode(enc, images, "sd-vae")
    alone, _ = encoders.encode(enc, images[17:18], "sd-vae")
    assert torch.equal(mean[17:18], alone)


# ---------------------------------------------------------------------------------------------
# prepare: the distribution, the mirrored images' latents, the encoder's identity


def test_prepare_stores_each_images_latent_distribution_and_its_mirrors(trained):
    tmp, d, _, _ = trained  # the workflow's prepare of latent_config
    data = datasets.open_prepared(tmp / "results/lat/dataset")
    assert data.shape == (4, 8, 8) and data.latents.shape == (24, 8, 8, 8) and data.images.shape == (24, 16, 16, 3)
    enc = encoders.load("sd-vae", Path(d["data"]["encoder_path"]))
    pixels = torch.from_numpy(np.array(data.images)).permute(0, 3, 1, 2)
    for stored, view in ((data.latents, pixels), (data.latents_xflip, pixels.flip(3))):
        mean, std = encoders.encode(enc, view.contiguous(), "sd-vae")
        assert np.array_equal(stored, torch.cat([mean, std], 1).numpy())
    # A mirrored image's latent is not the mirrored latent: that is why they are stored.
    assert not np.allclose(data.latents_xflip[:, :4], data.latents[:, :4, :, ::-1], atol=1e-3)
    rec = json.loads((tmp / "results/lat/dataset/dataset.json").read_text())["latent"]
    assert rec["sha256"] == encoders.identity("sd-vae", Path(d["data"]["encoder_path"]))
    assert (rec["channels"], rec["factor"], rec["xflip"]) == (4, 2, True)
    # The pixels' fingerprint is not the latents': a pixel run never takes this folder for its own.
    pixel = config.Config(config.validate({k: v for k, v in d.items()} | {"data": {"kind": "shapes", "resolution": 16,
                                                                          "count": 24, "seed": 0, "xflip": 0.5}}))
    assert datasets.plan(pixel.data).fingerprint != data.fingerprint


def test_the_dataset_is_the_same_for_any_number_of_decoding_workers_and_without_pixels(tmp_path):
    d = latent_config(tmp_path)
    run_cli("prepare", "--config", write(tmp_path, d), "--workers", 1, "--out", tmp_path / "one")
    d["data"]["keep_images"] = False
    d["fid"]["reference"] = str(tmp_path / "elsewhere.npz")
    run_cli("prepare", "--config", write(tmp_path, d), "--workers", 2, "--out", tmp_path / "two")
    assert not (tmp_path / "two/images.npy").exists()
    from diffrelay.evaluation import fid

    with pytest.raises(UserError, match="keep_images false .* fid.reference"):
        fid.make_ref(tmp_path / "two", tmp_path / "no-extractor.pt", tmp_path / "ref.npz")
    for name in ("latents.npy", "latents_xflip.npy", "labels.npy"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_latent_prepare_spawns_its_decoding_processes(tmp_path, monkeypatch):
    """The encoder is loaded (CUDA's threads on a GPU) and NCCL's threads run before the decoding processes
    start: a fork would copy those threads' locks mid-use. The processes are spawned, and give the bytes of a
    prepare without any. In process, so the start method can be watched."""
    import multiprocessing

    from diffrelay import cli, logs
    from diffrelay.data import prepare

    methods, real = [], multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: methods.append(method) or real(method))
    monkeypatch.setattr(logs, "setup", lambda *a, **k: logs.get())  # leave the test process's logging alone
    cfg = write(tmp_path, latent_config(tmp_path))
    for workers, out in ((2, "two"), (1, "one")):  # 1: decoded in this process, no pool
        args = cli.build_parser().parse_args(["prepare", "--config", str(cfg), "--workers", str(workers),
                                              "--out", str(tmp_path / out)])
        assert prepare.main(args) == 0
    assert methods == ["spawn"]
    for name in ("images.npy", "latents.npy", "latents_xflip.npy", "labels.npy"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


# ---------------------------------------------------------------------------------------------
# Training: a new draw of each latent every step, by global position


def test_each_step_draws_every_latent_anew_after_the_noise_for_any_process_count(trained):
    from diffrelay.data.order import noise_seed
    from diffrelay.objectives import edm

    data = datasets.open_prepared(trained[0] / "results/lat/dataset")  # the workflow's prepare of latent_config
    idx = np.array([5, 3, 17, 3, 0, 22, 9, 11])
    whole = loader.BatchMaker(data, 7, 8, rank=0, world=1, grad_accum=1, device="cpu", xflip=0.5).make(2, idx)
    parts = [loader.BatchMaker(data, 7, 8, rank=r, world=2, grad_accum=1, device="cpu", xflip=0.5).make(2, idx)
             for r in range(2)]
    # Restated: the step's generator draws EDM's noise for the global batch, then one eps per latent.
    g = torch.Generator().manual_seed(noise_seed(7, 2))
    edm.draw_noise(g, 8, (4, 8, 8), "cpu")
    eps = torch.randn((8, 4, 8, 8), generator=g)
    from diffrelay.data import augment

    flips = augment.masks(7, 2, 8, 0, 1, 0.0, 0.5)[1]
    assert 0 < flips.sum() < 8
    rows = np.where(flips[:, None, None, None], data.latents_xflip[idx], data.latents[idx])
    mean, std = torch.from_numpy(rows[:, :4]), torch.from_numpy(rows[:, 4:])
    want = (mean + std * eps) * 0.18215
    assert torch.equal(whole.rounds[0][0], want)
    assert not whole.masks[0][1].any  # the flips were taken from the stored mirrors, not applied again
    for r, part in enumerate(parts):
        assert torch.equal(part.rounds[0][0], want[r::2])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The latent run through the whole workflow: prepare, two segments of 2 steps, sampling, FID and the report.
    The tests below take its dataset, its checkpoints and its step-2 snapshot."""
    tmp = tmp_path_factory.mktemp("latent")
    d = latent_config(tmp)
    cfg = write(tmp, d)
    run_cli("snakemake", "--cores", 2, "--configfile", cfg, "-d", tmp / "wf", "-s", REPO / "Snakefile",
            timeout=900)
    return tmp, d, cfg, tmp / "results/lat/snapshots/step_0000002.safetensors"


def test_latent_training_in_two_segments_matches_one_run_bitwise(trained, tmp_path):
    """The workflow's two segments (2 + 2 steps, the second from the first's checkpoint) against one run of 4
    steps on the same dataset folder: every tensor of the step-4 checkpoints, bit for bit. (prepare's own
    determinism is test_the_dataset_is_the_same_for_any_number_of_decoding_workers_and_without_pixels's.)"""
    tmp, d, _, _ = trained
    cfg = write(tmp_path, dict(d, run=dict(d["run"], results=str(tmp_path / "one"))))
    torchrun(1, "--config", cfg, "--until-step", 4, "--dataset", tmp / "results/lat/dataset")
    one, two = (load_state(rd / "checkpoints/step_0000004") for rd in (tmp_path / "one/lat", tmp / "results/lat"))
    for key in ("net", "ema", "optimizer", "order", "step"):
        assert_tensors_equal(one[key], two[key], key)
    log = tmp_path / "one/lat/metrics/train.jsonl"
    losses = [json.loads(x)["loss"] for x in log.read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 4 and all(np.isfinite(losses))


# ---------------------------------------------------------------------------------------------
# Sampling decodes; bad input is one line


def test_samples_are_decoded_images_byte_identical_for_any_process_count(trained):
    tmp, d, cfg, snap = trained
    run_cli(*sample_args(snap, tmp / "one", "--config", cfg, "--num-images", 10, "--batch-size", 8))
    run_cli("torchrun", "--standalone", "--nproc-per-node", 2, "-m", "diffrelay",
            *sample_args(snap, tmp / "two", "--config", cfg, "--num-images", 10, "--batch-size", 3))
    ref = folder_bytes(tmp / "one")
    assert len(ref) == 11 and folder_bytes(tmp / "two") == ref
    from PIL import Image

    with Image.open(tmp / "one/000003.png") as im:
        assert im.size == (16, 16) and im.mode == "RGB"  # the image resolution, not the latents' 8 x 8
    # Without --config the snapshot's record finds the weights (sd-vae is built in).
    run_cli(*sample_args(snap, tmp / "bare", "--num-images", 10, "--batch-size", 8, "--steps", 3))
    assert folder_bytes(tmp / "bare") == ref


def test_a_hand_run_train_checks_the_network_against_the_latents(trained, tmp_path):
    tmp, d, _, _ = trained
    # 5 levels halve 4 times: the 16 px images would do, the 8 x 8 latents do not.
    wide = d | {"model": d["model"] | {"channel_mult": [1, 1, 1, 1, 1]}, "run": d["run"] | {"name": "deep"}}
    p = run_cli("train", "--config", write(tmp_path, wide), "--dataset", tmp / "results/lat/dataset", check=False)
    assert p.returncode != 0 and "UNet with 5 levels" in p.stderr and "sees 8x8 latents" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_sampling_refuses_another_decoder(trained, tmp_path):
    tmp, d, cfg, snap = trained
    other = dict(d, data=dict(d["data"], encoder_path=str(tiny_vae(tmp_path / "other", seed=5))))
    p = run_cli(*sample_args(snap, tmp_path / "s", "--config", write(tmp_path, other)), check=False)
    assert p.returncode != 0 and "another" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "s").exists()


def test_a_pixel_dataset_for_a_latent_run_and_the_reverse_are_one_line(trained, tmp_path):
    tmp, d, cfg, snap = trained
    pixel = config.Config(config.validate(dict(d, run=dict(d["run"], name="pix"),
                                               data={"kind": "shapes", "resolution": 16, "count": 24})))
    run_cli("prepare", "--config", write(tmp_path, pixel.to_dict()), "--out", tmp_path / "pixels")
    lat = datasets.open_prepared(tmp / "results/lat/dataset")
    with pytest.raises(UserError, match="a latent dataset .* trains on pixels"):
        latents.check_kind(lat, pixel.data, tmp / "resources")
    with pytest.raises(UserError, match="a pixel dataset; .* trains on latents"):
        latents.check_kind(datasets.open_prepared(tmp_path / "pixels"), config.Config(config.validate(d)).data,
                           tmp / "resources")
    other = dict(d, data=dict(d["data"], encoder_path=str(tiny_vae(tmp_path / "other", seed=5))))
    with pytest.raises(UserError, match="encoded by another encoder"):
        latents.check_kind(lat, config.Config(config.validate(other)).data, tmp / "resources")
    # Without the weights on this machine, the name and the scaling are still compared.
    edm2 = dict(d, data=dict(d["data"], latent_norm="edm2", encoder_path=str(tmp_path / "gone")))
    with pytest.raises(UserError, match="latent_norm dit; this run has sd-vae, edm2"):
        latents.check_kind(lat, config.Config(config.validate(edm2)).data, tmp / "resources")
    unflipped = dict(d, run=dict(d["run"], name="noflip"), data=dict(d["data"], xflip=0.0))
    run_cli("prepare", "--config", write(tmp_path, unflipped, "noflip.yaml"), "--out", tmp_path / "noflip")
    with pytest.raises(UserError, match="no latents of mirrored images"):
        latents.check_kind(datasets.open_prepared(tmp_path / "noflip"), config.Config(config.validate(d)).data,
                           tmp / "resources")


def test_missing_weights_offline_name_the_url_and_the_path(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    cfg = config.Config(config.validate({"data": {"encoder": "sd-vae-ft-ema", "resolution": 32}}))
    with pytest.raises(UserError) as err:
        encoders.resolve(cfg.data, tmp_path / "res")
    msg = str(err.value)
    want = tmp_path / "res/vae/sd-vae-ft-ema.safetensors"
    assert "huggingface.co/stabilityai/sd-vae-ft-ema" in msg and str(want) in msg and "\n" not in msg
    assert not want.exists() and not list((tmp_path / "res/vae").iterdir())  # no partial file left


def test_your_encoders_folder_is_named_by_every_file_in_it(tmp_path):
    for name, text in (("a", "1"), ("b", "2")):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub/weights.bin").write_text(text)
    assert encoders.identity("m:E", tmp_path / "a") != encoders.identity("m:E", tmp_path / "b")


def test_weights_of_another_network_are_one_line(tmp_path):
    folder = tiny_vae(tmp_path / "vae")
    # A bare .safetensors is read as the SD-VAE's: a tiny VAE's file is not that.
    with pytest.raises(UserError, match="not the weights of this AutoencoderKL"):
        encoders.load("sd-vae", folder / encoders.WEIGHTS)
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="not a readable .safetensors"):
        encoders.load("sd-vae", tmp_path / "bad.safetensors")


@pytest.mark.parametrize("data, words", [
    ({"encoder": "sd-vea"}, ["data.encoder=sd-vea", "sd-vae"]),
    ({"encoder_path": "/x"}, ["data.encoder_path=/x", "latent runs only"]),
    ({"encoder": "sd-vae", "keep_images": False}, ["data.keep_images=false", "fid.reference"]),
    ({"encoder": "mine.enc:Pool", "latent_norm": "edm2"}, ["data.latent_norm=edm2", "your own encoder"]),
])
def test_latent_config_mistakes_are_one_line_at_parse_time(data, words):
    with pytest.raises(UserError) as err:
        config.validate({"data": data})
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_a_resolution_the_factor_does_not_divide_is_one_line(tmp_path, write_config):
    p = run_cli("validate", "--config", write_config({"data": {"resolution": 20, "encoder": "sd-vae"}}), check=False)
    assert p.returncode != 0 and "data.resolution=20" in p.stderr and "multiple of 8" in p.stderr, p.stderr


def test_pixel_runs_keep_their_identity_and_the_weights_path_is_not_part_of_a_latent_runs():
    pixel = config.Config(config.validate({}))
    assert "encoder" not in config.trajectory(pixel)["data"]
    a = config.Config(config.validate({"data": {"encoder": "sd-vae", "encoder_path": "/a"}}))
    b = config.Config(config.validate({"data": {"encoder": "sd-vae", "encoder_path": "/b"}}))
    c = config.Config(config.validate({"data": {"encoder": "sd-vae", "latent_norm": "edm2"}}))
    assert config.trajectory_hash(a) == config.trajectory_hash(b) != config.trajectory_hash(pixel)
    assert config.trajectory_hash(c) != config.trajectory_hash(a)
    assert config.data_hash(a) != config.data_hash(b)  # other weights: the dataset is encoded again


# ---------------------------------------------------------------------------------------------
# Your own encoder


def test_your_own_encoder_trains_and_samples_and_a_wrong_one_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "mine_enc.py").write_text(OWN)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO / 'src'}", "PATH": str(Path(sys.executable).parent)}
    d = latent_config(tmp_path, encoder="mine_enc:Pool", encoder_path=None)
    cfg = write(tmp_path, d)
    run_cli("prepare", "--config", cfg, env=env)
    data_json = json.loads((tmp_path / "results/lat/dataset/dataset.json").read_text())
    assert data_json["latent"]["sha256"] == __import__("hashlib").sha256((tmp_path / "mine_enc.py").read_bytes()
                                                                         ).hexdigest()
    run_cli("torchrun", "--standalone", "--nproc-per-node=1", "-m", "diffrelay", "train", "--config", cfg,
            "--until-step", 2, env=env)
    snap = tmp_path / "results/lat/snapshots/step_0000002.safetensors"
    run_cli(*sample_args(snap, tmp_path / "s", "--config", cfg, "--num-images", 4), env=env)
    assert len(folder_bytes(tmp_path / "s")) == 5
    # Without a config the file does not get to choose the code that decodes it.
    p = run_cli(*sample_args(snap, tmp_path / "t", "--num-images", 4), env=env, check=False)
    assert p.returncode != 0 and "--config" in p.stderr
    d = latent_config(tmp_path, encoder="mine_enc:WrongShape", encoder_path=None)
    d["run"]["name"] = "wrong"
    p = run_cli("prepare", "--config", write(tmp_path, d, "wrong.yaml"), "--out", tmp_path / "w", env=env,
                check=False)
    assert p.returncode != 0 and "encode() of 16 images returned" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_latent_run_goes_through_the_whole_workflow(trained):
    rd = trained[0] / "results/lat"
    metrics = (rd / "report/metrics.csv").read_text()
    assert "fid" in metrics.splitlines()[0] and len(metrics.splitlines()) >= 3
    from PIL import Image

    with Image.open(rd / "samples/step_0000004/000000.png") as im:
        assert im.size == (16, 16)
    assert (rd / "report/best_grid.png").is_file()


# ---------------------------------------------------------------------------------------------
# Encoding in chunks: any number of ranks, resumed after a kill


def test_ranks_encode_disjoint_chunks_to_the_same_bytes_and_a_killed_encode_resumes(tmp_path):
    (tmp_path / "mine_enc.py").write_text(OWN)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO / 'src'}", "PATH": str(Path(sys.executable).parent)}
    # 600 images of 16 px: chunks of 256, 256 and 88 rows (encoding.chunk_rows), more chunks than ranks.
    d = latent_config(tmp_path, count=600, encoder="mine_enc:Pool", encoder_path=None)
    cfg = write(tmp_path, d)
    run_cli("prepare", "--config", cfg, "--out", tmp_path / "one", env=env)
    # As the workflow runs it: prepare starts itself again under `diffrelay launch` with 2 ranks.
    run_cli("prepare", "--config", cfg, "--out", tmp_path / "two", "--relaunch",
            "diffrelay launch --standalone --nproc-per-node 2 -m diffrelay", env=env)
    info = json.loads((tmp_path / "two/dataset.json").read_text())
    assert info["encoded_on"]["processes"] == 2 and info["encoded_on"]["device"] == "cpu"
    assert not (tmp_path / ".two.encoding").exists() and not (tmp_path / ".one.encoding").exists()
    # Killed (os._exit, as SIGKILL) at its 40th encode call: after chunk 0's 32 calls (16 rows each, and the
    # mirrored images), inside chunk 1. The rerun encodes chunks 1 and 2 only.
    p = run_cli("prepare", "--config", cfg, "--out", tmp_path / "killed", env=env | {"POOL_DIES_AT": "40"},
                check=False)
    assert p.returncode == 137 and not (tmp_path / "killed").exists()
    work = tmp_path / ".killed.encoding"
    assert sorted(f.name for f in work.glob("chunk_*")) == ["chunk_000000.safetensors"]
    p = run_cli("prepare", "--config", cfg, "--out", tmp_path / "killed", env=env)
    assert "resumes: 1 of its 3 chunks are already encoded" in p.stdout + p.stderr
    assert not work.exists()
    for name in ("images.npy", "latents.npy", "latents_xflip.npy", "labels.npy"):
        one = (tmp_path / "one" / name).read_bytes()
        assert one == (tmp_path / "two" / name).read_bytes() == (tmp_path / "killed" / name).read_bytes(), name
    # The chunks are the images in order: the stored latents are those of the stored images.
    data = datasets.open_prepared(tmp_path / "two")
    assert data.count == 600 and np.array_equal(data.labels, datasets.open_prepared(tmp_path / "one").labels)
    pixels = torch.from_numpy(np.array(data.images[590:])).permute(0, 3, 1, 2)
    expect = torch.nn.functional.avg_pool2d(pixels.float() / 127.5 - 1, 2)
    assert torch.equal(torch.from_numpy(np.array(data.latents[590:, :3])), expect)


def test_the_workflow_encodes_on_the_gpus_training_uses(tmp_path):
    d = latent_config(tmp_path)
    relaunch = " --relaunch 'diffrelay launch --standalone --nproc-per-node 2 -m diffrelay'"
    for device, nproc, extra in (("cuda", 2, relaunch), ("cpu", 2, "")):
        d["run"]["device"], d["train"]["nproc_per_node"] = device, nproc
        p = run_cli("snakemake", "-n", "-p", "--cores", 2, "--configfile", write(tmp_path, d), "-d", tmp_path / "wf",
                    "-s", REPO / "Snakefile")
        # The shell text is the one it was before latents (a rerun trigger); the launcher travels as an argument.
        command = re.search(r"set -x; (diffrelay prepare --config .*)", p.stdout).group(1)
        assert command.endswith(f"--workers 0{extra} --out {tmp_path / 'results/lat/dataset'}"), command


def test_chunks_are_reused_only_from_the_same_plan_on_the_same_kind_of_device(tmp_path):
    from diffrelay.data import encoding

    d = latent_config(tmp_path)
    plan = datasets.plan(config.Config(config.validate(d)).data)
    work = tmp_path / ".dataset.encoding"
    chunk = encoding.chunk_path(work, 0)

    def left_after(p, device="cpu", plan_file=True):
        work.mkdir(exist_ok=True)
        chunk.write_bytes(b"a finished chunk")
        if not plan_file:
            (work / encoding.PLAN).unlink(missing_ok=True)
        encoding.write_plan(work, p, device)
        return chunk.exists()

    assert not left_after(plan, plan_file=False)  # chunks without a plan are never taken
    assert left_after(plan)  # the same plan: resumed
    assert encoding.read_plan(work) == plan
    assert not left_after(plan, device="cuda")  # a GPU's latents are not a CPU's
    left_after(plan)
    assert not left_after(dataclasses.replace(plan, on_corrupt="skip"))  # not in the fingerprint, still a change
    encoding.remove_work(work)
    assert not work.exists()


def test_a_truncated_sd_vae_file_is_one_line_when_the_config_is_checked(tmp_path):
    """data.encoder_path's weights by their header, before any job: not a traceback in prepare's first encode."""
    from safetensors.torch import save_file

    from diffrelay.config import preflight

    save_file({"decoder.conv_in.weight": torch.zeros(4, 4)}, tmp_path / "vae.safetensors")
    (tmp_path / "vae.safetensors").write_bytes((tmp_path / "vae.safetensors").read_bytes()[:-3])
    cfg = config.Config(config.validate({"data": {"encoder": "sd-vae", "resolution": 32,
                                                  "encoder_path": str(tmp_path / "vae.safetensors")}}))
    with pytest.raises(UserError, match=r"^x.yaml: data.encoder_path: .*vae.safetensors: its tensors need 64 bytes "
                                        r"of data, the file holds 61: truncated; give data.encoder_path"):
        preflight.check_latent(cfg, "x.yaml")
