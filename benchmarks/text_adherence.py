"""Prompt adherence of a from-scratch text run on captions the demo encoder has never seen, against the class run.

  OMP_NUM_THREADS=1 python benchmarks/text_adherence.py OUT [--steps 1200] [--runs class,text-words,text-demo]

scikit-learn's digits (1,797 images, 8 x 8, 0..16) upscaled to the demo's 16 x 16 (bicubic, RGB) into
OUT/digits/<digit>/NNNN.png, each with NNNN.txt holding two captions ("a photo of the digit seven",
"a handwritten seven"), one picked per training step. Three runs of the workflow on them (snakemake --cores 1,
results in OUT/results/), one checkpoint at --steps, sampled at guidance 1, 2 and 4:
  class       the demo's class-conditional UNet (config/config.yaml), label dropout 0.1, 20 images per digit
  text-words  the text demo's UNet (config/examples/text-shapes.yaml) with `diffrelay demo-encoder --captions
              OUT/digits`: a random CLIP whose tokenizer knows every caption word as one token
  text-demo   the same with the plain `diffrelay demo-encoder` (the shapes vocabulary: other words are spelt in
              characters)
  text-words-clipinit  (not run by default) text-words' vocabulary and width with CLIP's own init: token and
              position embeddings of std 0.02, the start and end tokens' too
The text runs sample OUT/prompts.jsonl: "a photo of the digit zero" ... "nine", 20 images each.
Adherence: an SVM (scikit-learn SVC, gamma 0.001) fit on 80 % of the original 8 x 8 digits reads each sample
box-filtered back to 8 x 8; its accuracy on the other 20 % (upscaled and downscaled as the samples are) is
printed first. Writes OUT/adherence.json and prints a Markdown table (run, guidance, adherence %).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
RES = 16
GUIDANCE = (1, 2, 4)
PER_PROMPT = 20
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def make_dataset(out: Path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    folder = out / "digits"
    if (folder / "done").is_file():
        return digits
    for i, (img, label) in enumerate(zip(digits.images, digits.target)):
        d = folder / str(label)
        d.mkdir(parents=True, exist_ok=True)
        px = Image.fromarray((img * 255 / 16).round().astype(np.uint8)).resize((RES, RES), Image.BICUBIC)
        px.convert("RGB").save(d / f"{i:04d}.png")
        word = WORDS[label]
        (d / f"{i:04d}.txt").write_text(f"a photo of the digit {word}\na handwritten {word}\n")
    (folder / "done").write_text("")
    return digits


def to8(png: Path) -> np.ndarray:
    """A sample as the classifier reads it: grey, box-filtered to 8 x 8, 0..16."""
    img = Image.open(png).convert("L").resize((8, 8), Image.BOX)
    return np.asarray(img, dtype=np.float64).ravel() * 16 / 255


def classifier(digits, out: Path):
    from sklearn.svm import SVC

    rng = np.random.default_rng(0)
    order = rng.permutation(len(digits.target))
    fit, test = order[:int(0.8 * len(order))], order[int(0.8 * len(order)):]
    clf = SVC(gamma=0.001).fit(digits.data[fit], digits.target[fit])
    # The held-out originals through the same round trip as the samples (PNG at 16 px, back to 8).
    x = np.stack([to8(out / "digits" / str(digits.target[i]) / f"{i:04d}.png") for i in test])
    return clf, float((clf.predict(x) == digits.target[test]).mean())


def configs(out: Path, steps: int) -> dict:
    common = {
        "run": {"results": str(out / "results"), "device": "cpu"},
        "train": {"total_steps": steps, "segment_steps": steps, "threads": 1, "log_every": 100},
        "sample": {"guidance": list(GUIDANCE), "threads": 1, "nproc": 1},
        "fid": {"extractor": "random", "ref_images": 200, "threads": 1},
    }
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a photo of the digit {w}", "num_images": PER_PROMPT}) + "\n"
                               for w in WORDS))
    text = {  # the text demo's network and optimiser (config/examples/text-shapes.yaml), on the digits
        "data": {"kind": "folder", "path": str(out / "digits"), "resolution": RES, "labels": "none",
                 "captions": "auto", "caption_dropout": 0.1, "val_fraction": 0.05},
        "model": {"arch": "diffusers-unet", "class_conditional": False, "kwargs": {
            "block_out_channels": [24, 48], "layers_per_block": 1, "attention_head_dim": 8, "norm_num_groups": 8,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"]}},
        "train": {"batch_size": 16, "lr": 0.002, "warmup_steps": 100, "ema_decays": [0.998]},
        "sample": {"prompts": str(prompts)},
    }
    runs = {
        "class": {"data": {"kind": "folder", "path": str(out / "digits"), "resolution": RES, "labels": "auto"},
                  "train": {"label_dropout": 0.1}, "sample": {"num_images": 10 * PER_PROMPT}},
        "text-words": _merge(text, {"data": {"text_encoders": [{"path": str(out / "encoders" / "words")}]}}),
        "text-demo": _merge(text, {"data": {"text_encoders": [{"path": str(out / "encoders" / "demo")}]}}),
        "text-words-clipinit": _merge(text, {"data": {"text_encoders": [
            {"path": str(out / "encoders" / "words-clipinit")}]}}),
    }
    return {name: _merge(_merge(common, cfg), {"run": {"name": f"digits-{name}"}}) for name, cfg in runs.items()}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def train(out: Path, name: str, cfg: dict) -> float:
    import yaml

    path = out / f"config-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    encoders = {"text-words": ["--captions", str(out / "digits")], "text-demo": []}
    if name in encoders:
        subprocess.run([BIN / "diffrelay", "demo-encoder", *encoders[name], "--out", str(out / "encoders" /
                        name.removeprefix("text-"))], check=True)
    elif name == "text-words-clipinit":  # the same vocabulary and width with CLIP's own init (std 0.02)
        from diffrelay.data import caption_encoder
        from diffrelay.text import demo

        if not (out / "encoders" / "words-clipinit" / "config.json").is_file():
            vocab = demo.word_vocab(demo.caption_words(caption_encoder.caption_texts(out / "digits")))
            demo.clip_text(out / "encoders" / "words-clipinit", hidden=demo.CAPTIONS_WIDTH, vocab=vocab)
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    t = time.time()
    with open(out / f"snakemake-{name}.log", "w") as log:
        subprocess.run([BIN / "snakemake", "--cores", "1", "--configfile", str(path)], cwd=ROOT, env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.time() - t


def cosines(folder: Path) -> dict:
    """Pairwise cosines of the 10 prompts' embeddings as a text run gives them to the network (layer last: all
    77 x D states), mean and max over the 45 pairs: of all the states, and of the states at the subject word's
    first token (where the prompts first differ; before it, CLIP's causal attention makes them equal)."""
    import torch

    from diffrelay.text import encoders

    torch.set_num_threads(1)
    prompts = [f"a photo of the digit {w}" for w in WORDS]
    enc = encoders.load({"path": str(folder), "max_length": None, "layer": "last", "pooled": False}, "cpu")
    states = encoders.encode([enc], prompts, "cpu").states
    at = len(enc.tokenizer("a photo of the digit", add_special_tokens=True)["input_ids"]) - 1  # before its eos
    off = ~torch.eye(len(prompts), dtype=torch.bool)

    def pairs(x):
        x = torch.nn.functional.normalize(x.flatten(1), dim=1)
        c = (x @ x.T)[off]
        return {"mean": round(c.mean().item(), 3), "max": round(c.max().item(), 3)}

    ids = enc.tokenizer(prompts)["input_ids"]
    return {"tokens": [len(i) for i in ids], "all_states": pairs(states), "subject_token": pairs(states[:, at])}


def score(out: Path, name: str, steps: int, clf) -> dict:
    rows = {}
    for g in GUIDANCE:
        folder = out / "results" / f"digits-{name}" / "samples" / (f"step_{steps:07d}" + (f"_g{g}" if g != 1 else ""))
        pngs = sorted(folder.glob("[0-9]*.png"))
        if name == "class":  # balanced: image i is class i mod 10, the folders' sorted names 0..9
            want = [i % 10 for i in range(len(pngs))]
        else:
            want = [WORDS.index(p.with_suffix(".txt").read_text().split()[-1]) for p in pngs]
        got = clf.predict(np.stack([to8(p) for p in pngs])) if pngs else np.array([])
        hits = int((got == np.array(want)).sum())
        rows[str(g)] = {"folder": str(folder), "n": len(pngs), "hits": hits,
                        "adherence": hits / len(pngs) if pngs else None,
                        "predicted_counts": np.bincount(got.astype(int), minlength=10).tolist() if pngs else []}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output folder (dataset, encoders, runs, adherence.json)")
    ap.add_argument("--steps", type=int, default=1200, help="training steps of each run [1200]")
    ap.add_argument("--runs", default="class,text-words,text-demo", help="which runs, comma-separated")
    ap.add_argument("--score-only", action="store_true", help="score the runs' samples already there")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    digits = make_dataset(out)
    clf, acc = classifier(digits, out)
    print(f"classifier: {100 * acc:.1f} % on held-out original digits (through the 16 px round trip)")
    cfgs = configs(out, a.steps)
    result_path = out / "adherence.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    result["classifier_accuracy"] = acc
    for name in a.runs.split(","):
        entry = result.setdefault(name, {})
        if not a.score_only:
            entry["seconds"] = round(train(out, name, cfgs[name]), 1)
        entry["steps"], entry["guidance"] = a.steps, score(out, name, a.steps, clf)
        if name != "class":
            entry["cosines"] = cosines(out / "encoders" / name.removeprefix("text-"))
            print(f"{name}: prompts' cosines {entry['cosines']}")
        result_path.write_text(json.dumps(result, indent=1))
    print("| run | guidance | adherence |\n|---|---|---|")
    for name in ("class", "text-words", "text-words-clipinit", "text-demo"):
        for g, r in result.get(name, {}).get("guidance", {}).items():
            if r["adherence"] is not None:
                print(f"| {name} | {g} | {100 * r['adherence']:.0f} % ({r['hits']}/{r['n']}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
