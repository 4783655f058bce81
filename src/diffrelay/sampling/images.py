"""Sample images as files and pictures: PNG bytes, the check that a PNG is whole, and the labelled grid."""

import io as bytes_io
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from diffrelay.training import checkpoint

GRID_IMAGES, GRID_COLUMNS, GRID_TILE_PX, LABEL_PX, TITLE_PX = 64, 8, 64, 12, 14


def encode_png(pixels: np.ndarray) -> bytes:
    buf = bytes_io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(buf, format="PNG")
    return buf.getvalue()


def read_png(path: Path) -> np.ndarray:
    """A PNG file's pixels as written (H x W, or H x W x C)."""
    with Image.open(path) as im:
        return np.asarray(im)


def is_valid_png(path: Path, shape) -> bool:
    """The file exists, decodes completely and has the snapshot's size and channel count."""
    c, h, w = shape
    try:
        with Image.open(path) as im:
            im.load()
            return im.size == (w, h) and len(im.getbands()) == c
    except (OSError, ValueError, SyntaxError):  # missing, or PIL's ways of saying "truncated or not a PNG"
        return False


def grid_title(meta: dict, s) -> str:
    """What made these pixels, for the grid's title: step, guidance, which weights (EMA, post-hoc EMA, raw) and the
    size of sample.sizes (none for the snapshot's square)."""
    if s.weights == "raw":
        weights = "raw weights"
    elif "phema" in meta:
        weights = f"post-hoc EMA sigma_rel {meta['phema']['sigma_rel']:g}"
    else:
        decay = s.ema_decay if s.ema_decay is not None else (checkpoint.ema_decays(meta) or [None])[0]
        weights = "EMA" if decay is None else f"EMA {decay:g}"
    size = getattr(s, "size", None)
    return f"step {meta['step']} | guidance {s.guidance:g} | {weights}" + (f" | {size[0]}x{size[1]}" if size else "")


def fit(draw, text: str, font, width: float) -> str:
    """The longest prefix of `text` (on one line: a line break is a space) that is at most `width` pixels wide, in
    O(log n) measurements: a binary search on the prefix's length, since a prefix is never wider than a longer one.
    Cutting one character a measurement made grid.png of a 10,000-character prompt take minutes."""
    text = " ".join(str(text).splitlines())
    if draw.textlength(text, font=font) <= width:
        return text
    lo, hi = 0, len(text)  # text[:lo] fits, text[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if draw.textlength(text[:mid], font=font) <= width else (lo, mid)
    return text[:lo]


def make_grid(images: list[np.ndarray], names: list[str] | None, title: str | None = None,
              tile_px: int = GRID_TILE_PX) -> Image.Image:
    """Up to GRID_COLUMNS tiles a row, small images enlarged (NEAREST) to about GRID_TILE_PX, names underneath,
    and a title line above (a grid copied into a report or a paper draft still says what it shows). Images of
    several sizes (a prompt file's entries may have their own) share one scale, each at the top left of a cell of
    the largest height and width."""
    h, w = max(im.shape[0] for im in images), max(im.shape[1] for im in images)
    scale = max(1, math.ceil(tile_px / max(h, w)))
    th, tw = h * scale, w * scale
    label_h = LABEL_PX if names else 0
    title_h = TITLE_PX if title else 0
    cols = min(GRID_COLUMNS, len(images))
    rows = math.ceil(len(images) / cols)
    grid = Image.new("RGB", (cols * tw, title_h + rows * (th + label_h)), "white")
    draw, font = ImageDraw.Draw(grid), ImageFont.load_default()
    if title:
        draw.text((1, 1), fit(draw, title, font, cols * tw - 2), fill="black", font=font)
    for k, pixels in enumerate(images):
        x, y = (k % cols) * tw, title_h + (k // cols) * (th + label_h)
        tile = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).convert("RGB")
        grid.paste(tile.resize((tile.width * scale, tile.height * scale), Image.NEAREST), (x, y))
        if names:
            draw.text((x + 1, y + th), fit(draw, names[k], font, tw - 2), fill="black", font=font)
    return grid


def grid_picks(keys: list, cells: int = GRID_IMAGES) -> tuple[list[int], str | None]:
    """Which images a grid of `cells` tiles shows, given each image's prompt or class (`keys`, in image order), and
    a note for its title when they are not simply the first images. The first images when they hold every key
    (a balanced class run's do); else every distinct key once, in the order it first appears, then further images
    of each in turn, grouped by key: a prompt file ordered by prompt (20 images each) shows every prompt, not the
    first three."""
    by: dict = {}
    for i, k in enumerate(keys):
        by.setdefault(k, []).append(i)
    first = list(range(min(cells, len(keys))))
    if len({keys[i] for i in first}) == min(len(by), cells):  # more keys than cells: say how many are left out
        more = f"{len(first)} of {len(keys)} images: the first {cells} of the {len(by)}"
        return first, None if len(by) <= cells else more
    groups, picked = list(by.values()), []
    for depth in range(max(map(len, groups))):
        picked += [g[depth] for g in groups if depth < len(g)][:cells - len(picked)]
    order = {k: n for n, k in enumerate(by)}
    shown = min(len(by), cells)
    what = f"every one of the {len(by)}" if shown == len(by) else f"the first {shown} of the {len(by)}"
    return sorted(picked, key=lambda i: (order[keys[i]], i)), f"{len(picked)} of {len(keys)} images: {what}"
