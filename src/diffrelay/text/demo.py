"""The text-to-image demo's text encoder: a CLIP text model with a vocabulary of the shapes captions' words, written as
transformers' save_pretrained writes it (`diffrelay demo-encoder --out DIR`).

Its weights are random (seeded): nothing can be downloaded here, and the demo needs an encoder that gives every
caption its own embedding, not one that knows English. A real run names a pretrained encoder's local folder
instead (e.g. a copy of openai/clip-vit-large-patch14's text model). The tests build their tiny encoders with it.
"""

import json
from pathlib import Path

COLOURS = ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink")
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top", "bottom", "left", "right", "center")
WORDS = ("a", "photo", "of", *COLOURS, *SHAPES, *POSITIONS)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's and CLIP's map of bytes to printable characters (the alphabet of byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def clip_vocab(words=WORDS) -> tuple[dict, list]:
    """(vocab, merges) of a CLIP BPE that spells every byte and knows `words` as single tokens; the special
    tokens come last, as in openai/clip-vit-large-patch14 (<|startoftext|> 49406, <|endoftext|> 49407)."""
    alphabet = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(alphabet + [c + "</w>" for c in alphabet])}
    merges = []
    for word in words:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:  # left to right: "re" then "red</w>"
            pair = f"{parts[0]} {parts[1]}"
            if pair not in merges:
                merges.append(pair)
            parts = [parts[0] + parts[1], *parts[2:]]
            vocab.setdefault(parts[0], len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab, merges


def clip_text(folder, projection: bool = False, hidden: int = 32, layers: int = 2, heads: int = 2,
              vocab_words=WORDS, seed: int = 0, positions: int = 77, fast: bool = True) -> Path:
    """A CLIPTextModel (or CLIPTextModelWithProjection) and its tokenizer in `folder`."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab(vocab_words)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    # transformers 5 takes the vocabulary itself (vocab=, merges=); v4's vocab_file= would be ignored.
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges], model_max_length=positions)
    eos = vocab["<|endoftext|>"]
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=positions,
                            projection_dim=hidden, bos_token_id=vocab["<|startoftext|>"], eos_token_id=eos,
                            pad_token_id=eos)
    torch.manual_seed(seed)
    model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if not fast:  # only the vocab.json and merges.txt of a v4 slow tokenizer
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / name).unlink(missing_ok=True)
    return folder


def main(args) -> int:
    from diffrelay import io, logs

    logs.setup()
    out = Path(args.out)
    if (out / "config.json").is_file():
        logs.get().info(f"{out}: already holds a model; nothing to do")
        return 0
    with io.atomic_dir(out, owned=lambda p: not any(Path(p).iterdir())) as tmp:  # replaces only an empty folder
        clip_text(tmp, hidden=args.width, layers=2, heads=2, seed=args.seed)
    logs.get().info(f"wrote the demo's text encoder (random CLIP, {args.width} wide, shapes vocabulary) to {out}")
    return 0
