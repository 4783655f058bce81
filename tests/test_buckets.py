"""Aspect-ratio buckets (data.buckets): sizes and assignment as sd-scripts makes them, the prepared arrays, batches
from one bucket that are the same for any process count and across segments, SDXL's size conditioning, and the
refusals."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import run_cli
from test_train import assert_tensors_equal, load_state, read_trace, torchrun

from diffrelay.data import buckets, datasets, order

SHAPES = [(64, 32), (32, 64), (48, 48), (60, 40), (40, 60), (70, 35)]  # (width, height) of the folder's images


def kohya_sizes(max_reso, min_size, max_size, divisible):
    """sd-scripts' make_bucket_resolutions (library/model_util.py), restated: the square, then for each width from
    min_size to max_size the height that keeps the area, both floored to `divisible`, and its transpose."""
    area = max_reso[0] * max_reso[1]
    found = {(int(math.sqrt(area) // divisible) * divisible,) * 2}
    for w in range(min_size, max_size + 1, divisible):
        h = min(max_size, int((area // w) // divisible) * divisible)
        if h >= min_size:
            found |= {(w, h), (h, w)}
    return sorted(found)


@pytest.mark.parametrize("res,step,aspect", [(512, 64, 4.0), (1024, 64, 2.0), (768, 32, 1.5), (32, 8, 2.0)])
def test_bucket_sizes_are_sd_scripts_with_the_ratio_bound_in_place_of_the_side_bounds(res, step, aspect):
    theirs = [b for b in kohya_sizes((res, res), step, res * res // step, step) if max(b) / min(b) <= aspect]
    assert buckets.sizes(res, step, aspect) == theirs
    # sd-scripts' own defaults at 512 px (sides 256-1024) are the same set as max_aspect 4 here
    assert buckets.sizes(512, 64, 4.0) == kohya_sizes((512, 512), 256, 1024, 64)


def test_each_image_takes_the_nearest_ratio_is_covered_and_centre_cropped():
    sizes = buckets.sizes(1024, 64, 2.0)
    assert sizes[buckets.nearest(1024, 1024, sizes)] == (1024, 1024)
    assert sizes[buckets.nearest(3000, 2000, sizes)] == (1216, 832)  # 1.5 -> 1.46 (1152 x 768 is not a bucket)
    assert sizes[buckets.nearest(832, 1216, sizes)] == (832, 1216)  # its own size
    (rw, rh), (top, left) = buckets.cover(3000, 2000, (1216, 832))
    assert (rw, rh) == (1248, 832) and (top, left) == (0, 16)  # height binds: 2000 x 0.416 = 832
    assert buckets.too_small(500, 400, sizes) and not buckets.too_small(1000, 1000, sizes)
    # merging: the smallest bucket below the minimum goes to the nearest ratio with images, until none is small
    into = buckets.merge({0: 2, 1: 10, 5: 1, 6: 9}, sizes, 4)
    assert into[5] == 6 and into[0] == 1 and into[1] == 1 and into[6] == 6


def test_upscale_false_never_enlarges_an_image_its_own_size_floored_to_the_step_is_its_bucket():
    """sd-scripts' bucket_no_upscale: an image its nearest bucket would enlarge gets its own size floored to the
    step (the long side first cut to max_aspect); an image a bucket fits inside keeps the nearest, as before."""
    grid, keep = buckets.sizes(32, 8, 2.0), {"step": 8, "max_aspect": 2.0, "upscale": False}
    assert buckets.assign(24, 16, grid, 32, keep) == (24, 16)  # not 40x24, enlarged 1.5x
    assert buckets.assign(16, 16, grid, 32, keep) == (16, 16)  # not 32x32
    assert buckets.assign(20, 12, grid, 32, keep) == (16, 8)  # floored to the step, then cropped
    assert buckets.assign(60, 20, grid, 32, keep) == (32, 16)  # 3:1: 40x16 passes max_aspect 2
    assert buckets.assign(64, 32, grid, 32, keep) == (40, 24)  # fits inside: the nearest, unchanged
    assert buckets.assign(24, 16, grid, 32, keep | {"upscale": True}) == (40, 24)  # upscale true enlarges
    assert 0 in buckets.assign(6, 30, grid, 32, keep)  # narrower than one step: no bucket (prepare refuses it)
    for w in range(8, 100, 3):
        for h in range(8, 100, 5):
            b = buckets.assign(w, h, grid, 32, keep)
            (rw, rh), _ = buckets.cover(w, h, b)
            assert rw <= w and rh <= h and b[0] % 8 == b[1] % 8 == 0 and max(b) / min(b) <= 2, (w, h, b)
            assert b[0] * b[1] <= 32 * 32
    # a merge goes only into a bucket that fits inside each of its images: 16x16's one image cannot go to 24x16
    sizes = [(16, 16), (24, 16)]
    assert buckets.merge({0: 1, 1: 5}, sizes, 4, least={0: (16, 16), 1: (24, 16)}) == {0: 0, 1: 1}
    assert buckets.merge({0: 5, 1: 3}, sizes, 4, least={0: (16, 16), 1: (24, 16)}) == {0: 0, 1: 0}
    assert buckets.merge({0: 1, 1: 5}, sizes, 4) == {0: 1, 1: 1}  # upscale true: as before


def test_upscale_false_plans_own_buckets_and_validate_says_each_buckets_crop_and_the_worst(tmp_path):
    """A folder with images smaller than every bucket and 3:1 panoramas: the small ones get buckets of their own
    size, nothing is enlarged, and validate's lines give each bucket's crop and name the image that loses most."""
    from diffrelay import config
    from diffrelay.config import report

    folder = make_folder(tmp_path / "imgs", count=12)  # 4 to 24x40, 2 to 32x32, 6 to 40x24
    for i in range(4):
        Image.new("RGB", (24, 16)).save(folder / f"small{i}.png")
        Image.new("RGB", (16, 16)).save(folder / f"tiny{i}.png")
    Image.new("RGB", (96, 32)).save(folder / "pano.png")  # 3:1 into 40x24: loses 44 % of its width
    cfg = config.load(bucket_config(tmp_path, "own", train={"batch_size": 2}))
    p = datasets.plan(cfg.data, batch=2)
    assert p.buckets == ((16, 16), (24, 16), (24, 40), (32, 32), (40, 24))
    for (rel, _), b in zip(p.files, p.bucket_of):
        with Image.open(folder / rel) as img:
            (rw, rh), _ = buckets.cover(*img.size, p.buckets[b])
            assert rw <= img.size[0] and rh <= img.size[1], rel  # never enlarged
    lines = report.bucket_lines(cfg)
    assert "#  16x16: 4 images (their own size: data.buckets.upscale false never enlarges), crop mean 0 %" in lines[1]
    heavy = [line for line in lines if "lose more than 20 %" in line]
    assert len(heavy) == 1 and "1 image(s)" in heavy[0] and "the worst: pano.png, 44 %" in heavy[0], lines
    assert "data.buckets.max_aspect=2" in heavy[0]


def make_folder(path, count=36, captions=False):
    rng = np.random.default_rng(0)
    path.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        w, h = SHAPES[i % len(SHAPES)]
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path / f"img{i:03d}.png")
        if captions:
            (path / f"img{i:03d}.txt").write_text(["a red circle", "a blue square"][i % 2])
    return path


def bucket_config(tmp_path, name="b", **over):
    d = {"run": {"name": "b", "seed": 0, "device": "cpu", "results": str(tmp_path / name),
                 "resources": str(tmp_path / "res")},
         "data": {"kind": "folder", "path": str(tmp_path / "imgs"), "resolution": 32,
                  "buckets": {"step": 8, "max_aspect": 2.0}},
         "model": {"channels": 8, "channel_mult": [1, 2], "num_blocks": 1, "class_conditional": False},
         "train": {"total_steps": 4, "segment_steps": 2, "batch_size": 4, "lr": 0.002, "warmup_steps": 2,
                   "log_every": 1},
         "sample": {"num_images": 8, "steps": 3, "batch_size": 8}, "fid": {"extractor": "random", "batch_size": 16}}
    for key, value in over.items():
        d[key] = {**d[key], **value}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def bucketed_runs(tmp_path_factory):
    """A mixed folder prepared with buckets; one 4-step run on 1 process, the same on 2, and 2 segments of 2."""
    tmp = tmp_path_factory.mktemp("buckets")
    make_folder(tmp / "imgs")
    out = {}
    for name in ("one", "two", "segments"):  # one prepare; the others train on a copy of its dataset
        out[name] = (bucket_config(tmp, name), tmp / name / "b")
    out["prepared"] = run_cli("prepare", "--config", out["one"][0]).stderr
    for name in ("two", "segments"):
        shutil.copytree(out["one"][1] / "dataset", out[name][1] / "dataset")
    torchrun(1, "--config", out["one"][0], "--until-step", 4, "--trace", tmp / "one.trace")
    torchrun(2, "--config", out["two"][0], "--until-step", 4, "--trace", tmp / "two.trace")
    cfg, rd = out["segments"]
    torchrun(1, "--config", cfg, "--until-step", 2)
    torchrun(1, "--config", cfg, "--until-step", 4, "--init", rd / "checkpoints/step_0000002")
    return tmp, out


def test_prepare_writes_each_bucket_its_array_and_each_row_its_sizes(bucketed_runs):
    tmp, out = bucketed_runs
    data = datasets.open_prepared(out["one"][1] / "dataset")
    b = data.buckets
    assert b.sizes == ((24, 40), (32, 32), (40, 24)) and data.images.shape == (36, 32, 32, 3)  # squares kept: FID
    assert [len(a) for a in b.arrays] == [12, 6, 18]
    for i in (0, 2, 5):  # 64x32 -> 40x24 (height binds: 48 x 24 resized, crop left 4); 48x48 -> 32x32; 70x35
        w, h = SHAPES[i]
        bucket, row = b.rows[i]
        bw, bh = b.sizes[bucket]
        (rw, rh), (top, left) = buckets.cover(w, h, (bw, bh))
        assert list(b.meta[i]) == [h, w, top, left]
        with Image.open(tmp / "imgs" / f"img{i:03d}.png") as img:
            want = np.asarray(img.convert("RGB").resize((rw, rh), Image.Resampling.LANCZOS))[top:top + bh, left:left + bw]
        assert np.array_equal(b.arrays[bucket][row], want)
    assert list(b.meta[0]) == [32, 64, 0, 4]
    # prepare says how much each bucket crops: 70x35 and 64x32 lose 1/6 of their width to 40x24, 48x48 nothing
    assert "prepare: 32x32: 6 images, crop mean 0 %, max 0 % of the pixels" in out["prepared"]
    assert "prepare: 40x24: 18 images, crop mean 15 %, max 17 % of the pixels" in out["prepared"]


def test_batches_come_from_one_bucket_the_same_for_any_process_count_and_segments_equal_one_run(bucketed_runs):
    tmp, out = bucketed_runs
    one, two = read_trace(tmp / "one.trace", 1), read_trace(tmp / "two.trace", 2)
    assert one == two  # the same global batches, in the same order
    rows = datasets.open_prepared(out["one"][1] / "dataset").buckets.rows
    seen = {int(rows[i, 0]) for _, batch in one for i in batch}
    assert all(len({int(rows[i, 0]) for i in batch}) == 1 for _, batch in one) and len(seen) >= 2
    a, b, c = (load_state(out[k][1] / "checkpoints/step_0000004") for k in ("one", "two", "segments"))
    for key in ("net", "ema", "optimizer", "order", "step"):
        assert_tensors_equal(a[key], c[key], key)  # K segments = one run, bit for bit
    for k, v in a["net"].items():  # 2 processes: the same batches, all-reduced: within rounding
        assert torch.allclose(v, b["net"][k], rtol=1e-4, atol=1e-5), k


def test_the_bucket_order_is_a_function_of_seed_and_position():
    groups = [np.arange(0, 10), np.arange(10, 13), np.arange(13, 30)]
    o = order.BucketOrder(7, groups, 4)
    batches = [(o.next_batch()[0], o.bucket) for _ in range(12)]
    assert o.per_epoch == 2 + 0 + 4
    for idx, b in batches:
        assert set(idx) <= set(groups[b]) and len(idx) == 4 and b != 1
    resumed = order.BucketOrder(7, groups, 4, consumed=5 * 4)  # mid-epoch
    assert all(np.array_equal(resumed.next_batch()[0], batches[k][0]) for k in range(5, 12))


def test_sdxl_size_conditioning_equals_the_pipelines_add_time_ids(tmp_path):
    """Each row's (original size, crop top-left, target size) and, with no sizes, x's own shape: what
    StableDiffusionXLPipeline._get_add_time_ids builds for the same sizes."""
    import pipelines
    from diffusers import StableDiffusionXLPipeline

    from diffrelay.data import loader

    pipe = StableDiffusionXLPipeline.from_pretrained(pipelines.sdxl(tmp_path / "sdxl"), local_files_only=True)
    proj = pipe.text_encoder_2.config.projection_dim

    def theirs(original, crop, target):
        return pipe._get_add_time_ids(original, crop, target, torch.float32, text_encoder_projection_dim=proj)

    class Data:  # a bucketed dataset's sizes, as the loader reads them
        buckets = type("B", (), {"sizes": ((24, 40), (40, 24)), "meta": np.array([[32, 64, 0, 4], [60, 40, 3, 0]])})
    maker = loader.BatchMaker.__new__(loader.BatchMaker)
    maker.data, maker.device = Data, torch.device("cpu")
    got = maker._sizes(np.array([0, 1]), 1)
    assert torch.equal(got[0:1], theirs((32, 64), (0, 4), (24, 40)))
    assert torch.equal(got[1:2], theirs((60, 40), (3, 0), (24, 40)))
    from diffrelay import families
    from diffrelay.families import network as text_nets

    # a 16-pixel pipeline: 8 latents
    net = text_nets.TextNet(families.of_network("diffusers-unet", pipe.unet.config), pipe.unet, 4, 0, 1.0, False, 16)
    x = torch.zeros(1, 4, 12, 20)  # a 24 x 40 pixel image's latent (the VAE halves)
    assert torch.equal(net.size_ids(x).view(1, 6), theirs((24, 40), (0, 0), (24, 40)))
    assert torch.equal(net.size_ids(torch.zeros(1, 4, 8, 8)).view(1, 6), theirs((16, 16), (0, 0), (16, 16)))


def test_bucket_faults_are_one_line_before_any_work(tmp_path):
    make_folder(tmp_path / "imgs", count=12)
    Image.new("RGB", (20, 12)).save(tmp_path / "imgs" / "tiny.png")  # both sides under every bucket's
    # upscale false: its own bucket, 16x8, of one image, with no smaller bucket to merge into without enlarging it
    p = run_cli("prepare", "--config", bucket_config(tmp_path, "small"), check=False)
    assert p.returncode == 2 and "tiny.png: 20x12 pixels: its bucket 16x8 holds 1 image(s)" in p.stderr
    assert "data.buckets.min_images=4" in p.stderr and "data.buckets.upscale: true" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "small" / "b" / "dataset").exists()
    (tmp_path / "imgs" / "tiny.png").unlink()
    # a step the network's halving cannot divide (3 levels: multiples of 4)
    p = run_cli("validate", "--config", bucket_config(tmp_path, "step", data={"buckets": {"step": 10}},
                model={"channel_mult": [1, 2, 2]}), check=False)
    assert p.returncode != 0 and "data.buckets.step=10" in p.stderr and "multiple of 4" in p.stderr
    p = run_cli("validate", "--config", bucket_config(tmp_path, "dit", model={"arch": "dit"}), check=False)
    assert p.returncode != 0 and "position tables of one size" in p.stderr
    # a bucket smaller than one global batch (min_images set below it): validate and prepare refuse, where the
    # counts are known (32x32 holds 2 of the 12 images), before any decoding
    cfg = bucket_config(tmp_path, "few", data={"buckets": {"step": 8, "min_images": 1}}, train={"batch_size": 4})
    for command in ("validate", "prepare"):
        p = run_cli(command, "--config", cfg, check=False)
        assert p.returncode == 2 and "bucket 32x32 holds 2 image(s)" in p.stderr, p.stderr
        assert "fewer than one global batch (train.batch_size=4)" in p.stderr and "data.buckets.min_images=1" in p.stderr
        assert "Traceback" not in p.stderr and not (tmp_path / "few" / "b" / "dataset").exists()
    # and training still refuses a dataset whose bucket lost files while decoding (data.on_corrupt: skip)
    from diffrelay.data import bucketed
    from diffrelay.errors import UserError

    class Held:
        path, count = tmp_path / "dataset", 6
        buckets = bucketed.Buckets(((24, 40), (32, 32)), np.array([[0, 0], [0, 1], [1, 0], [1, 1], [1, 2], [1, 3]]),
                                   None, (), (), {})
    with pytest.raises(UserError, match="bucket 24x40 holds 2 image.*fewer than one global batch"):
        bucketed.check_batches(Held, 4, "config")
    # a resume with other bucket settings
    cfg = bucket_config(tmp_path, "resume")
    run_cli("prepare", "--config", cfg)
    torchrun(1, "--config", cfg, "--until-step", 2)
    other = bucket_config(tmp_path, "resume", data={"buckets": {"step": 8, "max_aspect": 1.5}})
    p = torchrun_fails(other, "--init", tmp_path / "resume" / "b" / "checkpoints/step_0000002")
    assert "data.buckets" in p.stderr


def torchrun_fails(cfg, *args):
    p = run_cli("torchrun", "--standalone", "--nproc-per-node=1", "-m", "diffrelay", "train", "--config", cfg,
                "--until-step", 2, *args, check=False)
    assert p.returncode != 0
    return p


def test_a_latent_sdxl_lora_run_encodes_each_bucket_and_trains_on_it(tmp_path):
    """prepare encodes each image's cut to its bucket with the pipeline's VAE, and its mirror (per-bucket latents,
    the squares kept for the FID reference); a LoRA step trains on them, mirrored rows included."""
    import pipelines
    from diffusers import AutoencoderKL

    pipelines.sdxl(tmp_path / "sdxl")
    make_folder(tmp_path / "imgs", count=24, captions=True)
    (tmp_path / "prompts.yaml").write_text("- {prompt: a red circle, num_images: 1}\n")
    cfg = bucket_config(tmp_path, "x", data={"captions": "auto", "text_cache": True, "xflip": 0.5},
                        model={"pretrained": str(tmp_path / "sdxl")},
                        train={"total_steps": 1, "segment_steps": 1, "lora": {"rank": 4}},
                        sample={"prompts": str(tmp_path / "prompts.yaml")})
    run_cli("prepare", "--config", cfg)
    data = datasets.open_prepared(tmp_path / "x" / "b" / "dataset")
    b = data.buckets
    assert data.latents is None and data.images.shape == (24, 32, 32, 3)
    assert [a.shape for a in b.arrays] == [(8, 8, 20, 12), (4, 8, 16, 16), (12, 8, 12, 20)]  # mean and std, /2
    assert [a.shape for a in b.flipped] == [a.shape for a in b.arrays]  # data.xflip: the mirrored cuts' latents
    vae = AutoencoderKL.from_pretrained(tmp_path / "sdxl" / "vae")
    for i in (0, 2):
        bucket, row = b.rows[i]
        w, h = b.sizes[bucket]
        (rw, rh), (top, left) = buckets.cover(*SHAPES[i], (w, h))
        with Image.open(tmp_path / "imgs" / f"img{i:03d}.png") as img:
            cut = np.asarray(img.convert("RGB").resize((rw, rh), Image.Resampling.LANCZOS))[top:top + h, left:left + w]
        with torch.no_grad():
            d = vae.encode(torch.from_numpy(cut.copy()).permute(2, 0, 1)[None].float() / 127.5 - 1).latent_dist
        assert torch.allclose(torch.from_numpy(np.array(b.arrays[bucket][row][:4])), d.mean[0], atol=1e-5)
        with torch.no_grad():
            d = vae.encode(torch.from_numpy(cut[:, ::-1].copy()).permute(2, 0, 1)[None].float() / 127.5 - 1).latent_dist
        assert torch.allclose(torch.from_numpy(np.array(b.flipped[bucket][row][:4])), d.mean[0], atol=1e-5)
    torchrun(1, "--config", cfg, "--until-step", 1)
    assert (tmp_path / "x" / "b" / "checkpoints" / "step_0000001").is_dir()
