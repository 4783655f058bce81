"""CLIP score: how well each image matches the prompt it was sampled from, by a local CLIP model (fid.clip_model).

Formula (Hessel et al. 2021, "CLIPScore", Eq. 1, with the weight 100 that text-to-image papers and torchmetrics
use instead of their 2.5): per image, 100 * max(cos(E_image, E_text), 0), where E are CLIP's projected
embeddings; the score is the mean over the images. The clamp is per image, as Hessel et al. define it;
torchmetrics' clip_score clamps the mean instead (functional/multimodal/clip_score.py: max(mean(100 cos), 0)),
so the two differ only where some cosine is negative, which a real CLIP on images made from their own prompts
does not give (benchmarks/checks/check_clip_score.py compares them).

Inputs, as the model folder says: images through its image processor with the PIL backend
(CLIPImageProcessorPil: bicubic resize of the shortest side, centre crop, CLIP's mean and std, as openai/CLIP's
own preprocessing), prompts through its tokenizer, truncated to the text model's positions (77 for openai CLIP,
the end token kept) and padded to that length, so a prompt's embedding does not depend on the batch it is in.
Embeddings: CLIPModel.get_image_features / get_text_features (transformers 5 returns them as pooler_output).

The model is a local folder written by transformers' save_pretrained (e.g. a copy of
openai/clip-vit-large-patch14): nothing is downloaded, and only safetensors weights are read. The sha256 of the
weights goes with every score, so scores made with different CLIPs are never compared unknowingly.

Imports the base modules and evaluation.features (image decoding); torch and transformers when used.
"""

import dataclasses
import re
from pathlib import Path

from diffrelay import io, logs
from diffrelay.errors import UserError

PNG = re.compile(r"^\d{6}\.png\Z")  # a sample folder's numbered images (not grid.png)
MAX_PROMPT_BYTES = 1 << 20
PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
FIX = "set fid.clip_model to a local copy written by save_pretrained (e.g. of openai/clip-vit-large-patch14)"
# The other CLIPs read through this module (evaluation/pick_score.py): the config key and the copy each one names.
FIXES = {"fid.clip_model": FIX, "fid.pick_model": "set fid.pick_model to a local copy written by save_pretrained "
         "(e.g. of yuvalkirstain/PickScore_v1, with the processor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K)"}
log = logs.get()


@dataclasses.dataclass
class Clip:
    model: object  # transformers.CLIPModel, eval mode, on `device`
    tokenizer: object
    image_processor: object
    folder: str
    sha256: str  # of model.safetensors, or of the shard list with each shard's sha256
    device: object
    max_length: int  # tokens the text model sees (its position table)


def check(folder, images=None, key="fid.clip_model") -> tuple[dict, str]:
    """(config.json, weights' sha256) of a CLIP folder, and every PNG of `images` has its prompt beside it: the
    cheap checks, before any model or image is read (`diffrelay fid` makes them before its scoring child starts, so
    a bad fid.clip_model costs no FID pass). One UserError line each, naming `key` (the config key of the folder)."""
    folder, fix = Path(folder), FIXES[key]
    if not folder.is_dir():
        raise UserError(f"{folder}: CLIP model folder not found; nothing is downloaded: {fix}")
    config = _config(folder, fix)
    digest = weights_sha256(folder, fix)
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        raise UserError(f"{folder}: no tokenizer (tokenizer.json or vocab.json + merges.txt); save the CLIP's "
                        "processor there too (CLIPProcessor.save_pretrained)")
    if not any((folder / n).is_file() for n in ("preprocessor_config.json", "processor_config.json")):
        raise UserError(f"{folder}: no image processor (preprocessor_config.json); save the CLIP's processor there "
                        "too (CLIPProcessor.save_pretrained)")
    for png in sorted(Path(images).glob("[0-9]*.png")) if images is not None else []:
        if not png.with_suffix(".txt").is_file():
            raise UserError(f"{png}: no {png.with_suffix('.txt').name} beside it (the prompt it was sampled with); "
                            f"{key} scores a text run's samples (sample them again with diffrelay sample)")
    return config, digest


def load(folder, device="cpu", key="fid.clip_model") -> Clip:
    """The CLIP of a local save_pretrained folder; one UserError line when it is missing, incomplete or pickled."""
    folder = Path(folder)
    config, digest = check(folder, key=key)
    import torch
    import transformers

    # PIL, as openai/CLIP preprocesses; transformers 5's default CLIPImageProcessor resizes with torchvision instead.
    processor_class = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    try:
        model = transformers.CLIPModel.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                       dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        image_processor = processor_class.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{folder}: cannot load the CLIP model ({first}); {FIXES[key]}") from e
    text = model.config.text_config
    _check_tokenizer(folder, tokenizer, text)
    max_length = min(int(text.max_position_embeddings), int(getattr(tokenizer, "model_max_length", 1 << 30)))
    model = model.to(device).eval().requires_grad_(False)
    log.info("CLIP %s (%s, sha256 %s...)", folder, (config.get("architectures") or ["CLIPModel"])[0], digest[:12])
    return Clip(model, tokenizer, image_processor, str(folder), digest, device, max_length)


def score(clip: Clip, images, prompts, batch_size: int = 32) -> dict:
    """CLIP score of `images` (a sequence of (H, W, 3) uint8 arrays, read one batch at a time) against
    `prompts` (one string per image): {"clip_score", "count", "per_image", "model", "sha256", "truncated"}."""
    import numpy as np

    cos, truncated = cosines(clip, images, prompts, batch_size)
    per_image = (100 * np.maximum(cos, 0)).tolist()  # Hessel et al.: max(cos, 0) per image
    return {"clip_score": float(np.mean(per_image)), "count": len(per_image), "per_image": per_image,
            "model": clip.folder, "sha256": clip.sha256, "truncated": truncated}


def cosines(clip: Clip, images, prompts, batch_size: int = 32, what: str = "CLIP score"):
    """(cos(E_image, E_text) of each image and its prompt as float64 numpy, prompts truncated): what the CLIP
    score and PickScore (evaluation/pick_score.py) are made of, with one preprocessing for both."""
    import numpy as np
    import torch

    n = len(images)
    if n != len(prompts):
        raise ValueError(f"{n} images but {len(prompts)} prompts")
    if n == 0:
        raise ValueError("no images to score")
    if batch_size < 1:
        raise ValueError(f"batch_size {batch_size} < 1")
    unique = list(dict.fromkeys(prompts))  # images of one prompt share its embedding
    truncated = _truncated(clip, unique, what)
    text = _text_embeddings(clip, unique, batch_size)
    row = {p: k for k, p in enumerate(unique)}
    out = []
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            batch = [rgb_array(images[i], i) for i in range(start, min(start + batch_size, n))]
            pixels = clip.image_processor(images=batch, return_tensors="pt", input_data_format="channels_last")
            e = _embedding(clip.model.get_image_features(pixel_values=pixels["pixel_values"].to(clip.device)))
            t = text[[row[prompts[i]] for i in range(start, start + len(batch))]]
            out.extend((_normalised(e) * t).sum(-1).tolist())
    return np.array(out, dtype=np.float64), truncated


def score_folder(folder, clip: Clip, batch_size: int = 32, scorer=None) -> dict:
    """CLIP score (or `scorer`'s, e.g. pick_score.score) of a sample folder: each NNNNNN.png against the prompt in
    NNNNNN.txt beside it (UTF-8, the prompt exactly). Every prompt is read before any image is scored."""
    from diffrelay.evaluation import features

    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: sample folder not found; sample the checkpoint first")
    files = sorted(p for p in folder.iterdir() if PNG.match(p.name))
    if not files:
        raise UserError(f"{folder}: no numbered images (000000.png ...); sample the checkpoint with prompts first")
    prompts = [prompt_of(png) for png in files]
    empty = [png.with_suffix(".txt") for png, p in zip(files, prompts) if not p.strip()]
    if empty:  # a prompt file emptied by hand, or an empty caption: the score would compare with no text at all
        log.warning(f"{empty[0]}: empty prompt ({len(empty)} of {len(files)} images' prompt files are empty or "
                    "blank); those images are scored against the empty text: if the files were emptied by "
                    "mistake, sample the folder again (diffrelay sample writes each image's prompt)")
    result = (scorer or score)(clip, Lazy(files, features.decode), prompts, batch_size)
    return {**result, "folder": str(folder)}


# ---------------------------------------------------------------------------- helpers

class Lazy:
    """Image i decoded when the batch that holds it is scored, so a folder never sits in memory whole."""

    def __init__(self, files, decode):
        self.files, self.decode = files, decode

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        return self.decode(self.files[i])


def prompt_of(png: Path) -> str:
    txt = png.with_suffix(".txt")
    if not txt.exists():
        raise UserError(f"{png}: no {txt.name} beside it (the prompt it was sampled with); sample this folder "
                        "again from a prompt file, or write each image's prompt to its NNNNNN.txt")
    io.check_regular_file(txt, MAX_PROMPT_BYTES, what="prompt file", missing="write the image's prompt there")
    try:
        return txt.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{txt}: not valid UTF-8 (byte {e.start}); write the prompt as UTF-8") from e


def _config(folder: Path, fix: str = FIX) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{folder}: no config.json, not a transformers model folder; {fix}")
    config = io.read_json(path, max_bytes=1 << 22)
    if not isinstance(config, dict) or config.get("model_type") != "clip":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise UserError(f"{path}: model_type {kind!r}, not 'clip'; a CLIPModel is needed here; {fix}")
    return config


def weights_sha256(folder: Path, fix: str = FIX, cls: str = "CLIPModel") -> str:
    """sha256 of model.safetensors; of a sharded model, of the lines 'shard sha256' of its shards, sorted.
    Pickled weights (.bin, .pt) are refused before anything reads them: unpickling can run code."""
    from diffrelay.text.encoders import weights_sha256  # the text encoders' rule, so one folder has one sha256

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return weights_sha256([single])
    if index.is_file():
        shards = sorted(set(io.read_json(index, max_bytes=1 << 26).get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if not shards or missing:
            raise UserError(f"{index}: shard {missing[0] if missing else '(none listed)'} missing; copy the "
                            "whole model folder")
        return weights_sha256([folder / s for s in shards])
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_WEIGHTS)
    if pickled:
        raise UserError(f"{folder}: only pickled weights ({', '.join(pickled[:3])}), which are never loaded here "
                        "(unpickling can run code); convert them once where you trust the file: "
                        f"{cls}.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)")
    raise UserError(f"{folder}: no model.safetensors; {fix}")


def _check_tokenizer(folder: Path, tokenizer, text) -> None:
    """The text model pools at the end token; a tokenizer that is not the model's (transformers 5 ignores a v4
    vocab_file= and builds a 3-token vocabulary) would give embeddings of the wrong tokens without an error."""
    size, vocab = len(tokenizer), int(text.vocab_size)
    eos = tokenizer.eos_token_id
    if size > vocab or eos is None or eos >= vocab:
        raise UserError(f"{folder}: the tokenizer has {size} tokens (end token {eos}) but the text model {vocab}; "
                        "save the model's own tokenizer there (CLIPProcessor.save_pretrained)")
    # transformers' CLIP pools the first end token, or (legacy configs with eos_token_id 2) the largest id.
    if text.eos_token_id not in (2, eos) or (text.eos_token_id == 2 and eos != max(tokenizer.get_vocab().values())):
        raise UserError(f"{folder}: the tokenizer's end token is {eos} but the text model pools at "
                        f"{text.eos_token_id}; save the model's own tokenizer there (CLIPProcessor.save_pretrained)")


def _text_embeddings(clip: Clip, texts: list, batch_size: int):
    import torch

    out = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            tokens = clip.tokenizer(texts[start:start + batch_size], padding="max_length", truncation=True,
                                    max_length=clip.max_length, return_tensors="pt")
            e = clip.model.get_text_features(input_ids=tokens["input_ids"].to(clip.device),
                                             attention_mask=tokens["attention_mask"].to(clip.device))
            out.append(_normalised(_embedding(e)))
    return torch.cat(out)


def _truncated(clip: Clip, texts: list, what: str = "CLIP score") -> int:
    """How many prompts are longer than the text model sees; said once per score."""
    lengths = [len(ids) for ids in clip.tokenizer(texts, truncation=False, verbose=False)["input_ids"]]
    long = sum(n > clip.max_length for n in lengths)
    if long:
        log.warning("%s: %d of %d prompts are longer than CLIP's %d tokens; their first %d tokens are "
                    "scored (CLIP's limit)", what, long, len(texts), clip.max_length, clip.max_length - 2)
    return long


def _embedding(out):
    """transformers 5 returns the projected embedding as the output's pooler_output; 4 returned the tensor."""
    pooled = getattr(out, "pooler_output", None)
    return out if pooled is None else pooled


def _normalised(e):
    e = e.double()  # the cosine in float64: the score's last digits do not depend on the batch's reduction order
    return e / e.norm(dim=-1, keepdim=True)


def rgb_array(image, i: int):
    import numpy as np

    a = np.asarray(image)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
        raise ValueError(f"image {i}: {a.dtype} {a.shape}, not (H, W, 3) uint8")
    return a
