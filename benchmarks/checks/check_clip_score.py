"""Our CLIP score (diffrelay.evaluation.clip_score) against torchmetrics' clip_score, on the same tiny CLIP.

  git clone https://github.com/Lightning-AI/torchmetrics /tmp/torchmetrics
  git clone https://github.com/Lightning-AI/utilities /tmp/lightning-utilities  # torchmetrics imports it
  python benchmarks/checks/check_clip_score.py --torchmetrics-src /tmp/torchmetrics \\
      --extra-path /tmp/lightning-utilities/src

--torchmetrics-src is a checkout of torchmetrics (its src/ goes first on sys.path); --extra-path adds folders
after it (lightning_utilities, where it is not installed). Their code is imported at run time; nothing of it
enters the package. Both sides get one tiny random CLIP built here from a seeded config (text and vision width 32,
32 px images, patch 8), saved with save_pretrained and read by clip_score.load; torchmetrics gets the same model
and processors through its callable model_name_or_path (a CLIPProcessor around clip_score's PIL image processor
and tokenizer), so both see the same pixels and tokens. Images: seeded uint8 noise of mixed sizes; torchmetrics
takes them as (3, H, W) tensors, ours as (H, W, 3) arrays.

torchmetrics clamps the mean (functional/multimodal/clip_score.py clip_score: max(mean(100 cos), 0); the CLIPScore
module's compute does the same), ours each image (Hessel et al. 2021: max(cos, 0) per image, then the mean). A
random CLIP gives cosines of both signs (MODEL_SEED: 14 of 24 positive), so the cases are:
  per-image       max |ours_i - max(theirs_i, 0)|, theirs_i = 100 cos_i from _clip_score_update (unclamped)
  mean-positive   the images whose cosine is positive: |ours - clip_score()| and |ours - CLIPScore()| (the module
                  accumulating over updates of 4); here both definitions give the same number
  mean-negative   the images whose cosine is negative: the same; both definitions give 0, so this case fails
                  when either side loses its clamp
  mean-all        every image: |ours - mean(max(theirs_i, 0))|; torchmetrics' own clip_score() on this set
                  (their clamped mean) is written to the JSON beside it, not gated: it differs by definition
  long prompt     not gated: a prompt over 77 tokens. torchmetrics cuts the token ids at 77 and so loses the end
                  token the text model pools at; ours truncates as openai/CLIP's tokenize(truncate=True) does
                  (the end token kept: the score equals that of the prompt's first 75 tokens). Both in the JSON.
Bound (BOUND, every compared figure): 1e-4 on the 0..100 scale. The same float32 model on both sides, torchmetrics
padding the prompts to the longest and normalising in float32, ours padding to 77 and normalising in float64:
float32 rounding only (at most 1.5e-5 seen). Sanity bounds: the per-image scores spread over at least 1 point
and at least 4 cosines of each sign, so the comparison can fail.
Exit status 1, one line per figure outside its bound. Writes benchmarks/results/clip_score_check.json.
Not a test: CI has no torchmetrics checkout.
"""

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from official import RESULTS, ROOT, Gate, write_results

from diffrelay.evaluation import clip_score

BOUND = 1e-4
WORDS = ("a", "photo", "of", "red", "blue", "green", "circle", "square", "cat", "dog", "on", "the", "grass")
PROMPTS = ["a red circle", "a blue square", "a photo of a cat", "a green dog on the grass", "a photo of a red square",
           "the cat", "a dog", "green grass"]
COUNT = 24  # images; prompt i % 8 each
MODEL_SEED = 2  # a random CLIP whose cosines on these images take both signs (14 of 24 positive); the gate checks it


def tiny_clip(folder: Path, seed: int = MODEL_SEED) -> Path:
    """A CLIP BPE that spells every byte and knows WORDS whole, a seeded random CLIPModel and processor settings
    for 32 px: everything save_pretrained writes, as a local CLIP folder holds it (the tests' builder)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import textmodels

    return textmodels.clip_model(folder, WORDS, seed)


def noise_images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (int(rng.integers(24, 64)), int(rng.integers(24, 64)), 3), dtype=np.uint8)
            for _ in range(n)]


def import_torchmetrics(src: Path, extra: list[Path]):
    sys.path[:0] = [str(src / "src")]
    sys.path.extend(str(p) for p in extra)
    try:  # the module (the package's clip_score is the function of the same name)
        functional = importlib.import_module("torchmetrics.functional.multimodal.clip_score")
        from torchmetrics.multimodal.clip_score import CLIPScore
    except ModuleNotFoundError as e:
        raise SystemExit(f"check_clip_score: importing torchmetrics from {src}/src failed ({e}); torchmetrics needs "
                         "lightning_utilities: pass a checkout of Lightning-AI/utilities with --extra-path "
                         "<checkout>/src, or pip install lightning-utilities") from e
    return functional, CLIPScore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torchmetrics-src", type=Path, required=True)
    ap.add_argument("--extra-path", type=Path, action="append", default=[],
                    help="another folder for sys.path (e.g. lightning_utilities' src/); may repeat")
    ap.add_argument("--out", type=Path, default=RESULTS / "clip_score_check.json")
    args = ap.parse_args()
    functional, CLIPScore = import_torchmetrics(args.torchmetrics_src, args.extra_path)
    from transformers import CLIPProcessor

    with tempfile.TemporaryDirectory() as tmp:
        clip = clip_score.load(tiny_clip(Path(tmp) / "clip"), "cpu")
    processor = CLIPProcessor(image_processor=clip.image_processor, tokenizer=clip.tokenizer)
    model_and_processor = lambda: (clip.model, processor)  # noqa: E731 -- torchmetrics' callable model_name_or_path
    pics = noise_images(COUNT)
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(COUNT)]
    chw = [torch.from_numpy(p).permute(2, 0, 1).contiguous() for p in pics]

    def theirs(rows: list) -> tuple[float, float]:
        """torchmetrics' clip_score and its CLIPScore module (accumulating over updates of 4, as an evaluation
        loop does) on images `rows`."""
        module = CLIPScore(model_name_or_path=model_and_processor)
        with torch.no_grad():
            whole = functional.clip_score([chw[i] for i in rows], [texts[i] for i in rows], model_and_processor)
            for start in range(0, len(rows), 4):
                module.update([chw[i] for i in rows[start:start + 4]], [texts[i] for i in rows[start:start + 4]])
            return whole.item(), module.compute().item()

    ours = clip_score.score(clip, pics, texts, batch_size=5)
    with torch.no_grad():
        raw, n = functional._clip_score_update(chw, texts, clip.model, processor)
    raw = raw.double().tolist()
    g, cases = Gate(), {}
    per_image = float(np.max(np.abs(np.array(ours["per_image"]) - np.maximum(raw, 0))))
    cases["per-image"] = {"max_abs_diff": per_image, "images": n}
    g.at_most("per-image", per_image, BOUND)
    # Where every cosine has one sign, clamping each image or the mean gives the same number: compare the scores.
    for sign, rows in (("positive", [i for i, r in enumerate(raw) if r > 0]),
                       ("negative", [i for i, r in enumerate(raw) if r < 0])):
        mine = clip_score.score(clip, [pics[i] for i in rows], [texts[i] for i in rows])["clip_score"]
        for kind, value in zip(("functional", "module"), theirs(rows)):
            name = f"mean-{sign}-{kind}"
            cases[name] = {"ours": mine, "theirs": value, "abs_diff": abs(mine - value), "images": len(rows)}
            g.at_most(name, cases[name]["abs_diff"], BOUND)
    clamped_each = float(np.mean(np.maximum(raw, 0)))
    theirs_all = theirs(list(range(COUNT)))[0]
    cases["mean-all"] = {"ours": ours["clip_score"], "theirs_per_image_clamped_mean": clamped_each,
                         "abs_diff": abs(ours["clip_score"] - clamped_each), "images": COUNT,
                         "theirs_clip_score_not_gated": theirs_all}
    g.at_most("mean-all", cases["mean-all"]["abs_diff"], BOUND)
    g.at_least("spread-of-per-image-scores", max(raw) - min(raw), 1.0)
    g.at_least("positive-cosines", sum(r > 0 for r in raw), 4)
    g.at_least("negative-cosines", sum(r < 0 for r in raw), 4)
    for name, r in cases.items():
        diff = r.get("max_abs_diff", r.get("abs_diff"))
        print(f"{name:26s} |ours - torchmetrics| = {diff:.3g} (bound {BOUND:.0e}, {r['images']} images)")
    print(f"{'(not gated) all images':26s} ours {ours['clip_score']:.4f}, torchmetrics' clamped mean {theirs_all:.4f}")

    # Not gated: a prompt over 77 tokens. torchmetrics cuts the ids, so the end token the text model pools at is
    # gone; ours keeps it, as openai/CLIP's tokenize(truncate=True) does: the same as the prompt's first 75 tokens.
    long = " ".join(["a red circle on the grass"] * 20)
    cut = " ".join(long.split()[:75])
    with torch.no_grad():
        raw_long = functional._clip_score_update(chw, [long] * COUNT, clip.model, processor)[0].double().numpy()
    ours_long = clip_score.score(clip, pics, [long] * COUNT)
    ours_cut = clip_score.score(clip, pics, [cut] * COUNT)
    cases["long-prompt-not-gated"] = {
        "ours_vs_ours_first_75_tokens_max_abs_diff": float(np.max(np.abs(np.subtract(ours_long["per_image"],
                                                                                      ours_cut["per_image"])))),
        "ours_vs_theirs_clamped_max_abs_diff": float(np.max(np.abs(ours_long["per_image"] - np.maximum(raw_long, 0)))),
        "ours_truncated_prompts": ours_long["truncated"]}
    print(f"{'(not gated) long prompt':26s} ours = ours on its first 75 tokens to "
          f"{cases['long-prompt-not-gated']['ours_vs_ours_first_75_tokens_max_abs_diff']:.2g}; torchmetrics (ids cut "
          f"at 77) differs by {cases['long-prompt-not-gated']['ours_vs_theirs_clamped_max_abs_diff']:.3g}")
    torchmetrics_version = sys.modules["torchmetrics"].__version__
    import transformers

    write_results(args.out, "diffrelay evaluation.clip_score vs torchmetrics clip_score / CLIPScore / "
                  "_clip_score_update, same tiny random CLIP, processors, images and prompts",
                  torchmetrics=torchmetrics_version, transformers=transformers.__version__,
                  image_processor=type(clip.image_processor).__name__, per_image_theirs=raw,
                  per_image_ours=ours["per_image"], bound=BOUND, cases=cases, gate=g.to_json(), prompts=PROMPTS)
    g.finish("check_clip_score")


if __name__ == "__main__":
    main()
