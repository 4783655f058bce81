"""data.crop: how a decoded RGB image becomes a resolution x resolution square."""

import numpy as np
from PIL import Image

MODES = ("center", "dhariwal")


def center(img: Image.Image, resolution: int) -> np.ndarray:
    """The largest centred square, resized with Lanczos."""
    w, h = img.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    # Crop first: resize(box=...) would let the filter reach pixels outside the square.
    img = img.crop((left, top, left + side, top + side)).resize((resolution, resolution), Image.Resampling.LANCZOS)
    return np.asarray(img, dtype=np.uint8)


def dhariwal(img: Image.Image, resolution: int) -> np.ndarray:
    """ADM's centre crop (center_crop_arr in openai/guided-diffusion, guided_diffusion/image_datasets.py): halve
    the whole image with a box filter while its short side is at least twice the resolution, bring the short
    side to the resolution with bicubic, then cut the centred square out of the pixel array."""
    while min(img.size) >= 2 * resolution:
        img = img.resize((img.size[0] // 2, img.size[1] // 2), Image.Resampling.BOX)
    scale = resolution / min(img.size)  # the same float product and round() as ADM, so sizes match exactly
    img = img.resize(tuple(round(n * scale) for n in img.size), Image.Resampling.BICUBIC)
    a = np.asarray(img, dtype=np.uint8)
    top, left = (a.shape[0] - resolution) // 2, (a.shape[1] - resolution) // 2
    return np.ascontiguousarray(a[top:top + resolution, left:left + resolution])


def square(img: Image.Image, resolution: int, mode: str = "center") -> np.ndarray:
    """uint8 (resolution, resolution, 3) of an RGB image, cropped and resized as data.crop `mode` says."""
    return {"center": center, "dhariwal": dhariwal}[mode](img, resolution)
