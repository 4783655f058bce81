"""data.crop: center (the old crop, byte for byte) and dhariwal (ADM's center_crop_arr), identities and errors."""

import io as bytes_io

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from diffrelay import config
from diffrelay.data import datasets
from diffrelay.errors import UserError

# (width, height): landscape and portrait, odd sides, square, smaller than twice the target, smaller than it
SIZES = [(1000, 600), (600, 1000), (517, 300), (300, 517), (256, 256), (130, 90), (90, 130), (129, 255),
         (64, 64), (47, 33)]


def noise(size, seed=0, mode="RGB") -> Image.Image:
    w, h = size
    bands = len(mode)
    a = np.random.default_rng(seed).integers(0, 256, (h, w, bands), dtype=np.uint8)
    return Image.fromarray(a[..., 0] if bands == 1 else a, mode)


def png(img: Image.Image) -> bytes:
    buf = bytes_io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def adm(img: Image.Image, size: int) -> np.ndarray:
    """ADM's procedure restated from its description: box halvings, bicubic to the short side, centre cut."""
    while min(img.width, img.height) >= 2 * size:
        img = img.resize((img.width // 2, img.height // 2), resample=Image.BOX)
    scale = size / min(img.width, img.height)
    img = img.resize((round(img.width * scale), round(img.height * scale)), resample=Image.BICUBIC)
    arr = np.array(img)
    y, x = (arr.shape[0] - size) // 2, (arr.shape[1] - size) // 2
    return arr[y:y + size, x:x + size]


def lanczos_square(img: Image.Image, size: int) -> np.ndarray:
    """The crop diffrelay always made: the centred square, then Lanczos."""
    side = min(img.size)
    x, y = (img.width - side) // 2, (img.height - side) // 2
    return np.array(img.crop((x, y, x + side, y + side)).resize((size, size), Image.LANCZOS))


@pytest.mark.parametrize("size", [64, 32])
def test_dhariwal_is_adms_center_crop_arr_pixel_for_pixel(size):
    for i, wh in enumerate(SIZES):
        img = noise(wh, seed=i)
        got = datasets.load_image(png(img), size, "dhariwal")
        assert got.shape == (size, size, 3) and got.dtype == np.uint8
        assert np.array_equal(got, adm(img, size)), (wh, size)
        if wh != (size, size):  # an image already of the size is kept as it is by both
            assert not np.array_equal(got, lanczos_square(img, size)), (wh, size)


def test_dhariwal_crops_after_the_usual_rgb_conversion():
    # Greyscale and transparent images become RGB (transparency over white) first, as with center.
    for img in (noise((300, 170), 1, "L"), noise((150, 301), 2, "RGBA")):
        with Image.open(bytes_io.BytesIO(png(img))) as decoded:
            want = adm(datasets.to_rgb(decoded), 32)
        assert np.array_equal(datasets.load_image(png(img), 32, "dhariwal"), want)


def test_center_is_the_crop_diffrelay_always_made():
    for i, wh in enumerate(SIZES):
        img = noise(wh, seed=i)
        want = lanczos_square(img, 32)
        assert np.array_equal(datasets.load_image(png(img), 32), want), wh
        assert np.array_equal(datasets.load_image(png(img), 32, "center"), want), wh


def test_prepare_with_dhariwal_writes_adms_pixels_under_another_fingerprint(write_config, tmp_path):
    src = tmp_path / "imgs"
    images = {}
    for i, (cls, wh) in enumerate([("a", (1000, 600)), ("a", (90, 130)), ("b", (517, 300)), ("b", (256, 256))]):
        (src / cls).mkdir(parents=True, exist_ok=True)
        images[f"{cls}/{i}.png"] = img = noise(wh, seed=i)
        img.save(src / cls / f"{i}.png")
    folder = {"kind": "folder", "path": str(src), "resolution": 32}
    cfgs = {mode: write_config({"data": folder | ({"crop": mode} if mode else {})}, name=f"{mode}.yaml")
            for mode in ("dhariwal", "center", None)}
    for mode in ("dhariwal", "center"):  # two workers: the mode travels to the decoding processes
        run_cli("prepare", "--config", cfgs[mode], "--out", tmp_path / mode, "--workers", "2")
    dhariwal, center = (datasets.open_prepared(tmp_path / mode) for mode in ("dhariwal", "center"))
    order = sorted(images)
    assert np.array_equal(dhariwal.images, np.stack([adm(images[rel], 32) for rel in order]))
    assert np.array_equal(center.images, np.stack([lanczos_square(images[rel], 32) for rel in order]))
    # The crop joins the fingerprint only when it is not center: datasets from before data.crop keep theirs.
    without = datasets.plan(config.load(cfgs[None]).data).fingerprint
    assert center.fingerprint == without != dhariwal.fingerprint


def test_run_and_data_hashes_change_only_for_dhariwal():
    default = config.Config(config.validate({}))
    assert (config.trajectory_hash(default), config.data_hash(default)) == ("87ee92ae704009a1", "e07cf8b263b3")
    folder = {"kind": "folder", "path": "/imgs", "resolution": 64}
    hashes = {}
    for mode in (None, "center", "dhariwal"):
        for encoder in ("none", "sd-vae"):
            data = folder | {"encoder": encoder} | ({"crop": mode} if mode else {})
            cfg = config.Config(config.validate({"data": data}))
            hashes[mode, encoder] = config.trajectory_hash(cfg), config.data_hash(cfg)
    for encoder in ("none", "sd-vae"):
        assert hashes[None, encoder] == hashes["center", encoder]
        a, b = hashes["center", encoder], hashes["dhariwal", encoder]
        assert a[0] != b[0] and a[1] != b[1]


def test_dhariwal_with_generated_shapes_is_one_line(write_config):
    path = write_config({"data": {"kind": "shapes", "crop": "dhariwal"}})
    with pytest.raises(UserError) as e:
        config.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: data.crop=dhariwal: ") and "drop it" in msg
    assert config.load(write_config({"data": {"crop": "center"}})).data.crop == "center"
