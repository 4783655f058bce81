"""Caption tags at training time: data.shuffle_caption, data.keep_tokens, data.keep_tokens_separator and
data.caption_tag_dropout (docs/data.md, "Caption tags"), as kohya sd-scripts' train_util process_caption treats a
caption: split at ",", the first keep_tokens tags (or everything before keep_tokens_separator) kept in place, each of
the others dropped at the tag dropout rate, the rest shuffled, joined with ", ".

Every row's draws come from a generator seeded by (seed, step, its position in the global batch), so a caption is the
same for any process count and on resume. A new caption each step cannot use one cached embedding a caption: these
keys need data.text_cache: false (the training job encodes each batch), as kohya refuses shuffle_caption with
cache_text_encoder_outputs.
"""

import numpy as np

from diffrelay.data.order import derive_seed

TAGS = 0x7A65  # the draws' tag, apart from the other per-sample draws (augment.py)
SEPARATOR = ","


def on(data: dict) -> bool:
    return bool(data.get("shuffle_caption") or data.get("caption_tag_dropout", 0.0) > 0)


def check_config(d: dict) -> list[tuple[str, str]]:
    data = d["data"]
    if not on(data) and not data.get("keep_tokens") and not data.get("keep_tokens_separator"):
        return []
    key = next(f"data.{k}={data[k]}" for k in ("shuffle_caption", "caption_tag_dropout", "keep_tokens",
                                               "keep_tokens_separator") if data.get(k))
    if data.get("captions", "none") == "none":
        return [(key, "processes captions; this run has none (data.captions: none): set data.captions, or drop it")]
    if not on(data):
        return [(key, "says which tags stay in place when they are shuffled or dropped; set data.shuffle_caption: "
                 "true or data.caption_tag_dropout, or drop it")]
    if data.get("text_cache", True):
        return [(key, "makes a new caption each step, and data.text_cache keeps one embedding a caption; set "
                 "data.text_cache: false (the training job then loads the text encoders and encodes each batch)")]
    return []


def process(caption: str, rng: np.random.Generator, shuffle: bool, keep: int, keep_separator: str,
            dropout: float) -> str:
    """One caption's tags, kept, dropped and shuffled (the module docstring)."""
    if not caption:
        return caption
    if keep_separator and keep_separator in caption:
        fixed, flex = caption.split(keep_separator, 1)
        fixed, flex = _split(fixed), _split(flex)
    else:
        tokens = _split(caption)
        fixed, flex = tokens[:keep], tokens[keep:]
    if dropout > 0:
        flex = [t for t, u in zip(flex, rng.random(len(flex))) if u >= dropout]
    if shuffle:
        flex = [flex[i] for i in rng.permutation(len(flex))]
    return ", ".join(fixed + flex)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(SEPARATOR) if t.strip()]


def rows(texts: list[str], seed: int, step: int, positions: np.ndarray, data) -> list[str]:
    """The processed caption of each row; `positions` the rows' places in the step's global batch."""
    out = []
    for text, pos in zip(texts, positions):
        rng = np.random.Generator(np.random.PCG64(derive_seed(seed, TAGS, step, int(pos))))
        out.append(process(text, rng, bool(data.shuffle_caption), int(data.keep_tokens),
                           data.keep_tokens_separator, float(data.caption_tag_dropout)))
    return out
