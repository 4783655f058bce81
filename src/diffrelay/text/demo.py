"""The text-to-image demo's text encoder: a CLIP text model with a vocabulary of the shapes captions' words, written as
transformers' save_pretrained writes it (`diffrelay demo-encoder --out DIR`).

Its weights are random (seeded): nothing can be downloaded here, and the demo needs an encoder that gives every
caption its own embedding, not one that knows English. A real run names a pretrained encoder's local folder
instead (e.g. a copy of openai/clip-vit-large-patch14's text model). The tests build their tiny encoders with it.

`--captions PATH` (a data.path folder or a caption table, read as data.captions reads them) makes one for a
from-scratch run on one's own captions: every word of them one token (a word the shapes vocabulary lacks would
be spelt in characters, and captions differing in one such word embed alike), 128 wide, its token vectors of
std 1 and its start, end (= padding) and position embeddings zero (data/caption_encoder.py's main, the command,
says why; docs/text.md the numbers).
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


# ---------------------------------------------------------------- a vocabulary of one's own captions

MAX_TOKENS = 49408  # openai CLIP's vocabulary: a caption set needing more is not what a demo encoder is for
CAPTIONS_WIDTH = 128  # random word vectors' cosines spread as 1/sqrt(width): 128 keeps them near 0 (docs/text.md)
CAPTIONS_FIX = ("give the image folder (data.path: name.txt or name.caption beside each image, or metadata.jsonl) "
                "or a caption table (.csv, .parquet or .jsonl)")


def caption_words(texts) -> list[str]:
    """The words of `texts` as CLIP's fast tokenizer splits them (NFC, whitespace collapsed, lowercased; runs of
    letters, single digits, runs of punctuation; its own normalizer and pre-tokenizer): sorted, each once."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab(())
    backend = CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges]).backend_tokenizer
    words = set()
    for text in texts:
        norm = backend.normalizer.normalize_str(text)
        words.update(norm[a:b] for _, (a, b) in backend.pre_tokenizer.pre_tokenize_str(norm))
    return sorted(words)


def word_merges(words) -> list[tuple[str, str]]:
    """BPE merges, learnt on `words` (each once) until every word is one token: the most frequent pair first, ties
    to the smallest. A BPE tokenizer applies learnt merges in the order they were learnt, so it spells each of the
    words as one token (clip_vocab's left-to-right chains do not: "even"'s "e v" would split "seven"). The
    tokenizers package's trainer does the same but breaks ties by hash order: another vocabulary at each run."""
    import heapq

    segs = [[*w[:-1], w[-1] + "</w>"] for w in words]
    counts, where = {}, {}
    for i, seg in enumerate(segs):
        for pair in zip(seg, seg[1:]):
            counts[pair] = counts.get(pair, 0) + 1
            where.setdefault(pair, set()).add(i)
    heap = [(-n, pair) for pair, n in counts.items()]
    heapq.heapify(heap)
    merges = []
    while heap:
        n, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -n or n == 0:
            continue  # a stale entry: the count changed since it was pushed
        merges.append(pair)
        joined, touched = pair[0] + pair[1], set()
        for i in sorted(where.pop(pair)):
            seg, out, k = segs[i], [], 0
            for p in zip(seg, seg[1:]):
                counts[p] -= 1
                touched.add(p)  # its heap entry is stale now: pushed again below with its new count
            while k < len(seg):  # leftmost first, as the tokenizer merges "a a a"
                if k + 1 < len(seg) and (seg[k], seg[k + 1]) == pair:
                    out.append(joined)
                    k += 2
                else:
                    out.append(seg[k])
                    k += 1
            segs[i] = out
            for p in zip(out, out[1:]):
                counts[p] = counts.get(p, 0) + 1
                where.setdefault(p, set()).add(i)
                touched.add(p)
        for p in sorted(touched):
            if counts.get(p, 0) > 0:
                heapq.heappush(heap, (-counts[p], p))
    return merges


def word_vocab(words) -> tuple[dict, list]:
    """(vocab, merges) as clip_vocab's, every one of `words` (caption_words) a single token."""
    chars = _bytes_to_unicode()
    alphabet = list(chars.values())
    vocab = {c: i for i, c in enumerate(alphabet + [c + "</w>" for c in alphabet])}
    merges = word_merges(sorted({"".join(chars[b] for b in w.encode()) for w in words}))  # as BPE sees them
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab, [f"{a} {b}" for a, b in merges]


def clip_text(folder, projection: bool = False, hidden: int = 32, layers: int = 2, heads: int = 2,
              vocab_words=WORDS, seed: int = 0, positions: int = 77, fast: bool = True, vocab=None,
              token_std: float | None = None, zero_specials: bool = False) -> Path:
    """A CLIPTextModel (or CLIPTextModelWithProjection) and its tokenizer in `folder`; `vocab` a (vocab, merges)
    pair instead of clip_vocab(vocab_words); `token_std` the token embeddings' init (CLIP's: 0.02);
    `zero_specials` zeroes the start and end (= padding) tokens' and the position embeddings (see main)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
    from transformers.models.clip.modeling_clip import CLIPTextEmbeddings

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = vocab or clip_vocab(vocab_words)
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
    embeddings = next(m for m in model.modules() if isinstance(m, CLIPTextEmbeddings))
    with torch.no_grad():
        if token_std is not None:
            embeddings.token_embedding.weight.normal_(0, token_std)
        if zero_specials:
            embeddings.token_embedding.weight[[vocab["<|startoftext|>"], eos]] = 0
            embeddings.position_embedding.weight.zero_()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if not fast:  # only the vocab.json and merges.txt of a v4 slow tokenizer
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / name).unlink(missing_ok=True)
    return folder


def check_words(folder: Path, words) -> None:
    """Each word one token, read back as itself, by the tokenizer as saved (a wrong merge would split it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for word, ids in zip(words, tok(list(words), add_special_tokens=False)["input_ids"]):
        if len(ids) != 1 or tok.decode(ids).strip() != word:
            raise RuntimeError(f"the vocabulary spells {word!r} as {ids}: a bug in word_merges")
