"""How often the text demo's samples show what their prompts say: colour, shape and position of the one shape.

  python benchmarks/text_demo_adherence.py --dataset results/text-demo/dataset \\
      --samples results/text-demo/samples/step_0003000 results/text-demo/samples/step_0003000_g4 \\
      --out benchmarks/results/text_demo_adherence.json

A sample folder holds NNNNNN.png and NNNNNN.txt (its prompt), as a text run's sampling writes them. Each image is
read by a fixed rule (`read_shape`), the same for samples and for the dataset:
  shape pixels  brighter than Otsu's threshold on V = max(R, G, B) (the shapes generator draws a saturated, bright
                shape, V >= 0.85, on a dark background, V <= 0.35), largest 8-connected blob of them;
  colour        the hue of the blob's brighter half (median RGB) named by shapes.colour_name: the captions' rule;
  coverage      per pixel, the fraction of shape in it: the pixel's RGB projected on the line from the background's
                median colour to the shape's (anti-aliased edges are such blends), on the blob and one pixel round it;
  shape         fill = area / (width x height), area the coverage's sum, width and height its extents (sums of
                the column and row profiles: the most coverage per column and per row): circle pi/4 = 0.785,
                square 1, triangle 1/2; and skew, the skewness of the coverage's mass by row: 0 for circles and
                squares, -0.566 for a triangle apex up (its rows' mass grows linearly from the apex). fill <
                FILL_TRIANGLE and skew < SKEW_TRIANGLE is a triangle (the skew keeps a lumpy circle of fill 0.7 a
                circle), else fill > FILL_SQUARE a square, else a circle. On the demo's dataset: fill 0.54-0.71
                and skew -0.65..-0.45 (triangles), 0.77-0.81 and -0.09..0.08 (circles), 0.98-1.0 (squares);
  position      the coverage's centre of mass (a triangle's moved up by side / 6 to its box's centre), named by
                shapes.place, as the captions name the centre of the shape's bounding box.
An image without a blob (all dark, or flat) matches nothing. The rule is first checked on the dataset's own images
against their captions (its training rows and held-out split): that accuracy is printed and written, and when any
attribute's is below --min-accuracy (0.9) the script exits 1, since the counts would then mean little.

Prompts are parsed in both caption wordings ("a red circle top left", "red circle, top left"); a prompt without a
position is scored for colour and shape only (its position count is out of the prompts that name one).
Writes --out (JSON): the classifier's accuracy on real images, and per sample folder (step, guidance from the
folder name) counts of colour / shape / position / colour-and-shape / all matched out of N, the counts on the
prompts saying "center" and on the others apart, and each image's reading. Exits 2 on bad input (a missing or
unreadable folder, an image without its prompt, a prompt that is not a shapes caption, fewer than --min-images).
"""

import argparse
import colorsys
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

from diffrelay.data import shapes

FILL_TRIANGLE = 0.72  # between the dataset's triangles (fill <= 0.71: pixels add to 1/2) and circles (>= 0.77)
SKEW_TRIANGLE = -0.28  # half a triangle's skewness, -0.566
FILL_SQUARE = 0.90  # between pi/4 and 1 (the dataset's squares: >= 0.98)
COLOURS = tuple(dict.fromkeys(name for _, name in shapes.HUES))
PLACE_NAMES = tuple(p for row in shapes.PLACES for p in row)
PROMPT = re.compile(r"(?:an? )?(?P<colour>\w+) (?P<shape>\w+)(?:,? (?P<place>[a-z ]+))?")
FOLDER = re.compile(r"step_(?P<step>\d+)(?:_g(?P<guidance>[0-9.]+))?")


class BadInput(Exception):
    pass


def parse(prompt: str, where: str) -> dict:
    """{colour, shape, place (None when the prompt names none)} of a shapes caption; BadInput otherwise."""
    m = PROMPT.fullmatch(prompt.strip().lower())
    if not m or m["colour"] not in COLOURS or m["shape"] not in shapes.SHAPE_NAMES or (
            m["place"] is not None and m["place"] not in PLACE_NAMES):
        raise BadInput(f"{where}: {prompt!r} is not a shapes caption (\"a red circle top left\": one of "
                       f"{', '.join(COLOURS)}; {', '.join(shapes.SHAPE_NAMES)}; optionally {', '.join(PLACE_NAMES)})")
    return {"colour": m["colour"], "shape": m["shape"], "place": m["place"]}


def otsu(v: np.ndarray) -> float:
    """Otsu's threshold of the values v (in [0, 1]): the cut that maximises the between-class variance."""
    values = np.sort(v.ravel())
    cuts = (values[1:] + values[:-1]) / 2
    best, best_t = -1.0, None
    for t in np.unique(cuts):
        lo, hi = values[values <= t], values[values > t]
        if len(lo) == 0 or len(hi) == 0:
            continue
        between = len(lo) * len(hi) * (hi.mean() - lo.mean()) ** 2
        if between > best:
            best, best_t = between, t
    return best_t


def read_shape(img: np.ndarray) -> dict | None:
    """{colour, shape, place, fill, hue, x, y} of the one shape in an (H, W, 3) uint8 image; None when none shows."""
    rgb = img.astype(np.float64) / 255
    res = rgb.shape[0]
    v = rgb.max(axis=2)
    if v.max() - v.min() < 0.1:  # flat: no shape
        return None
    mask = v > otsu(v)
    blobs, n = ndimage.label(mask, structure=np.ones((3, 3)))
    if n == 0:
        return None
    blob = blobs == (1 + int(np.argmax(ndimage.sum(mask, blobs, range(1, n + 1)))))
    inner = blob & (v >= np.median(v[blob]))
    fg = np.median(rgb[inner], axis=0)
    near = ndimage.binary_dilation(blob, structure=np.ones((3, 3)))
    outside = ~ndimage.binary_dilation(blob, structure=np.ones((3, 3)), iterations=2)
    bg = np.median(rgb[outside], axis=0) if outside.any() else np.zeros(3)
    d = fg - bg
    if d @ d < 1e-4:
        return None
    alpha = np.clip((rgb - bg) @ d / (d @ d), 0, 1) * near
    cols, rows = alpha.max(axis=0), alpha.max(axis=1)
    width, height, area = cols.sum(), rows.sum(), alpha.sum()
    fill = area / (width * height)
    centre = np.arange(res) + 0.5
    x, y = (centre @ alpha.sum(axis=0)) / area, (centre @ alpha.sum(axis=1)) / area  # centre of mass
    dy = centre - y
    mass = alpha.sum(axis=1)
    skew = (mass @ dy**3 / area) / max(mass @ dy**2 / area, 1e-9) ** 1.5  # of the mass by row; apex up: < 0
    triangle = fill < FILL_TRIANGLE and skew < SKEW_TRIANGLE
    shape = "triangle" if triangle else "square" if fill > FILL_SQUARE else "circle"
    if shape == "triangle":  # apex up, base = height = s, area s^2 / 2: the mass centre is s / 6 below the box's
        y -= np.sqrt(2 * area) / 6
    hue = colorsys.rgb_to_hsv(*fg)[0]
    return {"colour": shapes.colour_name(hue), "shape": shape, "place": shapes.place(x, y, res),
            "fill": round(float(fill), 3), "skew": round(float(skew), 3), "hue": round(float(hue) * 360, 1), "x": round(float(x), 2),
            "y": round(float(y), 2)}


def score(want: dict, got: dict | None) -> dict:
    """Which of the prompt's attributes the reading matches (position None when the prompt names none)."""
    colour = got is not None and got["colour"] == want["colour"]
    shape = got is not None and got["shape"] == want["shape"]
    place = None if want["place"] is None else got is not None and got["place"] == want["place"]
    return {"colour": colour, "shape": shape, "position": place, "colour_and_shape": colour and shape,
            "all": colour and shape and place is not False}


def tally(rows: list[dict]) -> dict:
    named = [r for r in rows if r["position"] is not None]
    out = {"n": len(rows), "n_with_position": len(named)}
    for key in ("colour", "shape", "colour_and_shape", "all"):
        out[key] = sum(r[key] for r in rows)
    out["position"] = sum(r["position"] for r in named)
    return out


def load_images(path: Path) -> np.ndarray:
    try:
        images = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: unreadable ({e})") from e
    if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
        raise BadInput(f"{path}: shape {images.shape} {images.dtype}, expected (N, H, W, 3) uint8")
    return images


def validate(dataset: Path, limit: int) -> dict:
    """The rule's accuracy on the dataset's images (training rows, then val/) against each image's first caption."""
    rows, confusion = [], {}
    for part in (dataset, dataset / "val"):
        if part != dataset and not (part / "images.npy").is_file():
            continue
        images = load_images(part / "images.npy")
        try:
            caps = json.loads((part / "captions.json").read_text())
            texts, per_row = caps["texts"], caps["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BadInput(f"{part / 'captions.json'}: unreadable ({e}); is {dataset} a captioned shapes dataset?")
        if len(per_row) != len(images):
            raise BadInput(f"{part}: {len(per_row)} caption rows for {len(images)} images")
        for i in range(min(len(images), limit)):
            want = parse(texts[per_row[i][0]], f"{part} row {i}")
            got = read_shape(np.asarray(images[i]))
            rows.append(score(want, got))
            if got is None or got["shape"] != want["shape"]:
                key = f"{want['shape']}->{got['shape'] if got else 'none'}"
                confusion[key] = confusion.get(key, 0) + 1
    if not rows:
        raise BadInput(f"{dataset}: no images")
    t = tally(rows)
    acc = {k: round(t[k] / (t["n_with_position"] if k == "position" else t["n"]), 4)
           for k in ("colour", "shape", "position", "colour_and_shape", "all")}
    return {"images": t["n"], "accuracy": acc, "counts": t, "shape_errors": confusion}


def sample_folder(folder: Path, min_images: int) -> dict:
    if not folder.is_dir():
        raise BadInput(f"{folder}: no such folder")
    pngs = sorted(p for p in folder.glob("[0-9]*.png") if p.stem.isdigit())
    if len(pngs) < min_images:
        raise BadInput(f"{folder}: {len(pngs)} numbered images, fewer than --min-images {min_images}")
    rows, center, other, images = [], [], [], []
    for png in pngs:
        txt = png.with_suffix(".txt")
        if not txt.is_file():
            raise BadInput(f"{png}: no prompt file {txt.name} beside it (a text run's samples have one)")
        prompt = txt.read_text(encoding="utf-8").strip()
        want = parse(prompt, str(txt))
        try:
            with Image.open(png) as im:
                img = np.asarray(im.convert("RGB"))
        except OSError as e:
            raise BadInput(f"{png}: unreadable ({e})") from e
        got = read_shape(img)
        s = score(want, got)
        rows.append(s)
        (center if want["place"] == "center" else other).append(s)
        images.append({"image": png.name, "prompt": prompt, "read": got, **s})
    m = FOLDER.fullmatch(folder.name)
    return {"folder": str(folder), "step": int(m["step"]) if m else None,
            "guidance": float(m["guidance"]) if m and m["guidance"] else 1.0 if m else None,
            **tally(rows), "center_prompts": tally(center), "other_prompts": tally(other), "images": images}


def line(r: dict) -> str:
    n = r["n"]
    return (f"colour {r['colour']}/{n}, shape {r['shape']}/{n}, colour+shape {r['colour_and_shape']}/{n}, "
            f"position {r['position']}/{r['n_with_position']}, all {r['all']}/{n}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=Path, nargs="+", required=True, help="sample folders (NNNNNN.png + .txt)")
    ap.add_argument("--dataset", type=Path, required=True, help="the run's dataset folder (images.npy, captions.json)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "text_demo_adherence.json")
    ap.add_argument("--min-images", type=int, default=30, help="fewest images a sample folder may hold [30]")
    ap.add_argument("--min-accuracy", type=float, default=0.9,
                    help="the rule's least accuracy on the dataset, per attribute, for the counts to count [0.9]")
    ap.add_argument("--validate-images", type=int, default=100000, help="dataset images checked at most, per split")
    args = ap.parse_args()
    try:
        real = validate(args.dataset, args.validate_images)
        folders = [sample_folder(f, args.min_images) for f in args.samples]
    except BadInput as e:
        print(f"text_demo_adherence: {e}", file=sys.stderr)
        return 2
    acc = real["accuracy"]
    print(f"classifier on {real['images']} dataset images: colour {acc['colour']:.1%}, shape {acc['shape']:.1%}, "
          f"position {acc['position']:.1%}, all {acc['all']:.1%}"
          + (f"; shape errors {real['shape_errors']}" if real["shape_errors"] else ""))
    for r in folders:
        print(f"{Path(r['folder']).name}: {line(r)}  [center prompts: {line(r['center_prompts'])}]")
    low = [k for k in ("colour", "shape", "position") if acc[k] < args.min_accuracy]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "text demo prompt adherence: colour, shape and position of each sample read by a fixed rule, "
                "the rule checked on the dataset's captioned images first",
        "time": time.strftime("%Y-%m-%d"), "dataset": str(args.dataset), "classifier": real,
        "classifier_ok": not low, "min_accuracy": args.min_accuracy,
        "chance": {"colour": 1 / len(COLOURS), "shape": 1 / len(shapes.SHAPE_NAMES)},
        "steps": folders}, indent=1) + "\n")
    print(f"wrote {args.out}")
    if low:
        print(f"text_demo_adherence: the rule reads {', '.join(low)} of the dataset's images below "
              f"{args.min_accuracy:.0%}: the counts above say little", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
