"""The generated `shapes` set: one large anti-aliased circle, square or triangle per image, class = shape.

Captions (data.captions: auto) say what each image holds, "a red circle top left": `geometry` replays the random
draws of draw_shape to get the shape's hue and centre without drawing a pixel.
"""

import colorsys
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES_VERSION = 1  # bump when the drawing code changes the pixels, so old fingerprints stop matching
CAPTIONS_VERSION = 1  # bump when the wording of the captions changes
SHAPE_NAMES = ("circle", "square", "triangle")
SUPERSAMPLE = 4
# Colour names by hue in degrees (HSV): each name up to the bound after it; 345-360 wraps round to red.
HUES = ((15, "red"), (45, "orange"), (70, "yellow"), (160, "green"), (200, "cyan"), (260, "blue"),
        (290, "purple"), (345, "pink"), (360, "red"))
# Where the shape's centre lies, by third of the frame: [row][column].
PLACES = (("top left", "top", "top right"), ("left", "center", "right"), ("bottom left", "bottom", "bottom right"))


def _rgb(h, s, v) -> tuple:
    return tuple(int(round(c * 255)) for c in colorsys.hsv_to_rgb(h % 1.0, s, v))


@dataclass(frozen=True)
class Draws:
    """Every random draw of one image, in draw_shape's order; lengths are in supersampled pixels."""

    hue: float
    colour: tuple
    c1: tuple  # background colour
    c2: tuple | None  # the gradient's other end; None for a plain background
    angle: float
    side: float
    cx: float
    cy: float


def _draws(seed: int, index: int, resolution: int) -> Draws:
    rng = np.random.default_rng(np.random.SeedSequence([SHAPES_VERSION, seed, index]))
    big = resolution * SUPERSAMPLE
    hue = rng.random()
    colour = _rgb(hue, rng.uniform(0.75, 1.0), rng.uniform(0.85, 1.0))
    # A dark plain or linear-gradient background with a hue far from the shape's, so edges stay sharp.
    bg_hue = hue + 0.5 + rng.uniform(-0.2, 0.2)
    c1 = _rgb(bg_hue, rng.uniform(0.2, 0.7), rng.uniform(0.05, 0.3))
    c2, angle = None, 0.0
    if rng.random() >= 0.5:
        c2 = _rgb(bg_hue + rng.uniform(-0.15, 0.15), rng.uniform(0.2, 0.7), rng.uniform(0.05, 0.35))
        angle = rng.uniform(0, 2 * np.pi)
    side = rng.uniform(0.35, 0.75) * big
    margin = SUPERSAMPLE  # one output pixel, so no shape touches the border
    cx, cy = (rng.uniform(side / 2 + margin, big - side / 2 - margin) for _ in range(2))
    return Draws(hue, colour, c1, c2, angle, side, cx, cy)


def _background(d: Draws, big: int) -> Image.Image:
    if d.c2 is None:
        return Image.new("RGB", (big, big), d.c1)
    xy = (np.arange(big) + 0.5) / big - 0.5
    t = np.cos(d.angle) * xy[None, :] + np.sin(d.angle) * xy[:, None]
    t = (t - t.min()) / (t.max() - t.min())
    # A 256-entry colour table indexed by position: much cheaper than blending every pixel in float.
    ramp = np.linspace(0.0, 1.0, 256)[:, None]
    table = np.rint(np.asarray(d.c1) + ramp * (np.asarray(d.c2) - np.asarray(d.c1))).astype(np.uint8)
    return Image.fromarray(table[np.rint(t * 255).astype(np.intp)])


def draw_shape(seed: int, index: int, shape: int, resolution: int) -> np.ndarray:
    """Image `index` of the shapes set: one large saturated shape, fully inside the frame, anti-aliased."""
    d = _draws(seed, index, resolution)
    img = _background(d, resolution * SUPERSAMPLE)
    cx, cy, side = d.cx, d.cy, d.side
    x0, y0, x1, y1 = cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2
    draw = ImageDraw.Draw(img)
    if SHAPE_NAMES[shape] == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=d.colour)
    elif SHAPE_NAMES[shape] == "square":
        draw.rectangle([x0, y0, x1, y1], fill=d.colour)
    else:
        draw.polygon([(x0, y1), (x1, y1), (cx, y0)], fill=d.colour)
    # reduce() averages each 4x4 block: exact area coverage, so edges are anti-aliased without ringing.
    return np.asarray(img.reduce(SUPERSAMPLE))


def shape_row(seed: int, resolution: int, labels: str, i: int) -> tuple:
    """(image, label) of shapes image i; its class is i mod 3, so the classes are exactly balanced."""
    shape = i % len(SHAPE_NAMES)
    return draw_shape(seed, i, shape, resolution), shape if labels == "auto" else 0


def geometry(seed: int, index: int, resolution: int) -> tuple[float, float, float]:
    """(hue in [0, 1), x, y of the centre of the shape's bounding box in output pixels) of image `index`."""
    d = _draws(seed, index, resolution)
    return d.hue, d.cx / SUPERSAMPLE, d.cy / SUPERSAMPLE


def colour_name(hue: float) -> str:
    degrees = (hue % 1.0) * 360
    return next(name for bound, name in HUES if degrees < bound)


def place(x: float, y: float, resolution: int) -> str:
    """The third of the frame (rows, columns) that holds the point (x, y)."""
    col, row = (min(2, int(3 * v / resolution)) for v in (x, y))
    return PLACES[row][col]


def captions(seed: int, index: int, resolution: int) -> list[str]:
    """Two wordings of what image `index` holds: ["a red circle top left", "red circle, top left"]."""
    hue, x, y = geometry(seed, index, resolution)
    colour, shape, where = colour_name(hue), SHAPE_NAMES[index % len(SHAPE_NAMES)], place(x, y, resolution)
    return [f"a {colour} {shape} {where}", f"{colour} {shape}, {where}"]
