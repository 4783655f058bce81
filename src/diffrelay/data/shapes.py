"""The generated `shapes` set: one large anti-aliased circle, square or triangle per image, class = shape."""

import colorsys

import numpy as np
from PIL import Image, ImageDraw

SHAPES_VERSION = 1  # bump when the drawing code changes the pixels, so old fingerprints stop matching
SHAPE_NAMES = ("circle", "square", "triangle")
SUPERSAMPLE = 4


def _rgb(h, s, v) -> tuple:
    return tuple(int(round(c * 255)) for c in colorsys.hsv_to_rgb(h % 1.0, s, v))


def _background(rng, big: int, hue: float) -> Image.Image:
    """A dark plain or linear-gradient background with a hue far from the shape's, so edges stay sharp."""
    bg_hue = hue + 0.5 + rng.uniform(-0.2, 0.2)
    c1 = _rgb(bg_hue, rng.uniform(0.2, 0.7), rng.uniform(0.05, 0.3))
    if rng.random() < 0.5:
        return Image.new("RGB", (big, big), c1)
    c2 = _rgb(bg_hue + rng.uniform(-0.15, 0.15), rng.uniform(0.2, 0.7), rng.uniform(0.05, 0.35))
    angle = rng.uniform(0, 2 * np.pi)
    xy = (np.arange(big) + 0.5) / big - 0.5
    t = np.cos(angle) * xy[None, :] + np.sin(angle) * xy[:, None]
    t = (t - t.min()) / (t.max() - t.min())
    # A 256-entry colour table indexed by position: much cheaper than blending every pixel in float.
    ramp = np.linspace(0.0, 1.0, 256)[:, None]
    table = np.rint(np.asarray(c1) + ramp * (np.asarray(c2) - np.asarray(c1))).astype(np.uint8)
    return Image.fromarray(table[np.rint(t * 255).astype(np.intp)])


def draw_shape(seed: int, index: int, shape: int, resolution: int) -> np.ndarray:
    """Image `index` of the shapes set: one large saturated shape, fully inside the frame, anti-aliased."""
    rng = np.random.default_rng(np.random.SeedSequence([SHAPES_VERSION, seed, index]))
    big = resolution * SUPERSAMPLE
    hue = rng.random()
    colour = _rgb(hue, rng.uniform(0.75, 1.0), rng.uniform(0.85, 1.0))
    img = _background(rng, big, hue)
    side = rng.uniform(0.35, 0.75) * big
    margin = SUPERSAMPLE  # one output pixel, so no shape touches the border
    cx, cy = (rng.uniform(side / 2 + margin, big - side / 2 - margin) for _ in range(2))
    x0, y0, x1, y1 = cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2
    draw = ImageDraw.Draw(img)
    if SHAPE_NAMES[shape] == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=colour)
    elif SHAPE_NAMES[shape] == "square":
        draw.rectangle([x0, y0, x1, y1], fill=colour)
    else:
        draw.polygon([(x0, y1), (x1, y1), (cx, y0)], fill=colour)
    # reduce() averages each 4x4 block: exact area coverage, so edges are anti-aliased without ringing.
    return np.asarray(img.reduce(SUPERSAMPLE))


def shape_row(seed: int, resolution: int, labels: str, i: int) -> tuple:
    """(image, label) of shapes image i; its class is i mod 3, so the classes are exactly balanced."""
    shape = i % len(SHAPE_NAMES)
    return draw_shape(seed, i, shape, resolution), shape if labels == "auto" else 0
