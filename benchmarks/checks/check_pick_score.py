"""Our PickScore (diffrelay.evaluation.pick_score) against the PickScore README's calc_probs, on the same tiny CLIP.

Usage (a checkout of github.com/yuvalkirstain/PickScore; only its README.md is read):
  python benchmarks/checks/check_pick_score.py --pickscore-src /tmp/PickScore

The reference is the README's own code: the `def calc_probs` of its "Inference with PickScore" block is cut out
of README.md at run time and executed as written, with the README's globals bound to this check's model:
`model` a tiny random CLIPModel (text and vision 32 wide, 2 layers, 32 px images, patch 8; logit_scale set to
log 100, PickScore_v1's learned value, so the scale is visible), `processor` a CLIPProcessor of the tokenizer and
the PIL image processor evaluation/clip_score.py loads from the same folder (PickScore's README loads the
processor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K; the check compares the formula, not two resizers), `device`
cpu; the model's get_*_features return the embedding tensor, as in the transformers 4.27 the README pins
(transformers 5 returns it as the output's pooler_output). calc_probs ends in a softmax over one prompt's images; its logits, the per-image PickScore, are read by
running it once more with a `torch` whose softmax returns its input.

Figures, over 24 images of 8 prompts (images 24-63 px of noise; prompt i % 8 each):
  per-image   max |ours_i - theirs_i|, theirs_i = calc_probs' scores (logit_scale.exp() * cos) of image i
  probs       max |softmax(ours over a prompt's images) - calc_probs(prompt, images)|
  mean        |ours' pick_score - mean(theirs_i)|
Bounds: 1e-4 on the scores (float32 inside calc_probs; ours takes the cosine in float64; scores lie in
[-100, 100]) and 1e-5 on the probabilities. Sanity: the scores spread at least 1 point, so a formula that dropped
the logit scale or the normalisation could not pass. Exit status 1, one line per figure outside its bound.
Writes benchmarks/results/pick_score_check.json.
"""

import argparse
import ast
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from official import RESULTS, ROOT, Gate, write_results

from diffrelay.evaluation import pick_score

BOUND, PROBS_BOUND = 1e-4, 1e-5
WORDS = ("a", "photo", "of", "red", "blue", "green", "circle", "square", "cat", "dog", "on", "the", "grass")
PROMPTS = ["a red circle", "a blue square", "a photo of a cat", "a green dog on the grass", "a photo of a red square",
           "the cat", "a dog", "green grass"]
COUNT = 24  # images; prompt i % 8 each
MODEL_SEED = 3


def tiny_pick(folder: Path) -> Path:
    """The tests' tiny CLIP folder (tests/textmodels.py clip_model), its logit_scale set to PickScore_v1's log 100."""
    sys.path.insert(0, str(ROOT / "tests"))
    import textmodels
    from transformers import CLIPModel

    textmodels.clip_model(folder, WORDS, MODEL_SEED)
    model = CLIPModel.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    with torch.no_grad():
        model.logit_scale.fill_(float(np.log(100.0)))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def noise_images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (int(rng.integers(24, 64)), int(rng.integers(24, 64)), 3), dtype=np.uint8)
            for _ in range(n)]


def readme_calc_probs(readme: Path) -> str:
    """The source of calc_probs in README.md's python block under "Inference with PickScore"."""
    if not readme.is_file():
        raise SystemExit(f"check_pick_score: {readme} not found; pass a checkout of yuvalkirstain/PickScore")
    text = readme.read_text(encoding="utf-8")
    section = text.split("## Inference with PickScore", 1)[-1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    for block in blocks:
        tree = ast.parse(block)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "calc_probs":
                return ast.get_source_segment(block, node)
    raise SystemExit(f"check_pick_score: no `def calc_probs` in a python block of {readme}'s Inference section")


class LogitsTorch:
    """torch for calc_probs, except that softmax returns its input: the scores calc_probs computes before it."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def softmax(x, dim=-1):
        return x


class V4Features:
    """The model as transformers 4 (the README pins 4.27.3) gives it: get_image_features and get_text_features
    return the projected embedding itself; transformers 5 wraps it in an output's pooler_output."""

    def __init__(self, model):
        self.model, self.logit_scale = model, model.logit_scale

    def get_image_features(self, **kwargs):
        out = self.model.get_image_features(**kwargs)
        return getattr(out, "pooler_output", out)

    def get_text_features(self, **kwargs):
        out = self.model.get_text_features(**kwargs)
        return getattr(out, "pooler_output", out)


def reference(source: str, model, processor, torch_module):
    namespace = {"torch": torch_module, "model": V4Features(model), "processor": processor, "device": "cpu"}
    exec(compile(source, "PickScore/README.md:calc_probs", "exec"), namespace)
    return namespace["calc_probs"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pickscore-src", type=Path, required=True, help="a checkout of yuvalkirstain/PickScore")
    ap.add_argument("--out", type=Path, default=RESULTS / "pick_score_check.json")
    args = ap.parse_args()
    source = readme_calc_probs(args.pickscore_src / "README.md")
    from PIL import Image
    from transformers import CLIPProcessor

    with tempfile.TemporaryDirectory() as tmp:
        clip = pick_score.load(tiny_pick(Path(tmp) / "pick"), "cpu")
    processor = CLIPProcessor(image_processor=clip.image_processor, tokenizer=clip.tokenizer)
    logits_of, probs_of = (reference(source, clip.model, processor, t) for t in (LogitsTorch(), torch))
    pics = noise_images(COUNT)
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(COUNT)]
    ours = pick_score.score(clip, pics, texts, batch_size=5)
    mine = np.array(ours["per_image"])
    theirs = np.zeros(COUNT)
    probs_diff = 0.0
    for k, prompt in enumerate(PROMPTS):  # calc_probs scores one prompt against a list of images
        rows = [i for i in range(COUNT) if i % len(PROMPTS) == k]
        images = [Image.fromarray(pics[i]) for i in rows]
        theirs[rows] = logits_of(prompt, images)
        want = torch.softmax(torch.tensor(mine[rows]), dim=-1).numpy()
        probs_diff = max(probs_diff, float(np.max(np.abs(want - np.array(probs_of(prompt, images))))))
    g = Gate()
    per_image = float(np.max(np.abs(mine - theirs)))
    mean = abs(ours["pick_score"] - float(np.mean(theirs)))
    g.at_most("per-image", per_image, BOUND)
    g.at_most("probs", probs_diff, PROBS_BOUND)
    g.at_most("mean", mean, BOUND)
    g.at_least("spread-of-per-image-scores", float(mine.max() - mine.min()), 1.0)
    g.at_most("logit_scale-is-100", abs(ours["logit_scale"] - 100.0), 1e-4)  # exp of float32 log(100)
    print(f"{'per-image':12s} max |ours - calc_probs' scores| = {per_image:.3g} (bound {BOUND:.0e}, {COUNT} images)")
    print(f"{'probs':12s} max |softmax(ours) - calc_probs| = {probs_diff:.3g} (bound {PROBS_BOUND:.0e})")
    print(f"{'mean':12s} ours {ours['pick_score']:.4f}, theirs {np.mean(theirs):.4f}, |diff| {mean:.3g}")
    import transformers

    write_results(args.out, "diffrelay evaluation.pick_score vs the PickScore README's calc_probs (its logits and "
                  "probabilities), same tiny random CLIP, processor, images and prompts",
                  transformers=transformers.__version__, reference="yuvalkirstain/PickScore README.md calc_probs",
                  image_processor=type(clip.image_processor).__name__, per_image_ours=mine.tolist(),
                  per_image_theirs=theirs.tolist(), bounds={"scores": BOUND, "probs": PROBS_BOUND},
                  cases={"per-image": per_image, "probs": probs_diff, "mean": mean}, gate=g.to_json(),
                  prompts=PROMPTS)
    g.finish("check_pick_score")


if __name__ == "__main__":
    main()
