"""What a text encoder's tokenizer makes of a run's own text, checked before any job (`diffrelay validate`, Snakemake's
parse) and again when prepare loads the encoder (encoders.load). Read with the tokenizers package from
tokenizer.json, or from spiece.model (sentencepiece) or a BERT vocab.txt where a folder holds no tokenizer.json:
no transformers import, a few milliseconds.

Refused, one line naming the tokenizer's folder:
  - a vocabulary of special tokens only: it spells every text as its special tokens (transformers 5 makes such a
    CLIPTokenizer, silently, when given v4's vocab_file= and merges_file=);
  - a tokenizer that spells none of the run's texts it is shown (a sample of its prompts and captions) as anything
    but unknown and special tokens: every caption would embed alike.
A word that the vocabulary lacks is no refusal: the pipelines embed it as the unknown token too (a word-level T5
tokenizer that knows the run's words, and not "photo", works).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from diffrelay.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model")
SAMPLE = 64  # texts shown to each tokenizer: enough to tell a tokenizer that spells nothing
FIX = "give the folder the tokenizer saved with this encoder (tokenizer.save_pretrained(folder))"
# tokenizer_config.json / special_tokens_map.json keys that name special tokens (transformers 4 and 5)
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
LISTS = ("additional_special_tokens", "extra_special_tokens")
GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")  # classes that say nothing of the model


def tokenizer_folder(path: Path) -> Path:
    """The folder itself, else a diffusers pipeline's sibling: text_encoder_2/ -> tokenizer_2/."""
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        return path
    sibling = path.parent / path.name.replace("text_encoder", "tokenizer")
    if path.name.startswith("text_encoder") and any((sibling / f).is_file() for f in TOKENIZER_FILES):
        return sibling
    raise UserError(f"{path}: data.text_encoders: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the "
                    "encoder's tokenizer into the folder (tokenizer.save_pretrained(folder))")


def check_spiece(where: Path):
    """The sentencepiece processor of a tokenizer saved as spiece.model alone (PixArt's tokenizer/, HunyuanDiT's
    tokenizer_2/), which transformers converts when it loads; None when the folder has a tokenizer.json or no
    spiece.model. A damaged file is read first by sentencepiece itself: transformers 5 would make a tokenizer of
    its special tokens from it, silently."""
    model = where / "spiece.model"
    if not model.is_file() or (where / "tokenizer.json").is_file():
        return None
    try:
        import sentencepiece
    except ImportError:
        raise UserError(f"{model}: data.text_encoders: a T5 tokenizer saved as spiece.model is converted by the "
                        "sentencepiece package, which is not installed: pip install sentencepiece protobuf (both "
                        "are diffrelay dependencies)") from None
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(model))
    except (RuntimeError, OSError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{model}: data.text_encoders: not a sentencepiece model ({first}); it is damaged or cut "
                        "short: copy the tokenizer folder again from the pipeline") from e


@dataclass
class Vocabulary:
    folder: Path
    cls: str  # tokenizer_config.json's tokenizer_class, else the encoder's class
    tokens: dict | None  # token -> id, added tokens included; None: no vocabulary file diffrelay reads
    special: set  # the ids of the special and unknown tokens
    encode: object  # text -> ids without special tokens; None where it cannot be read without transformers

    def is_clip(self) -> bool:
        return self.cls.startswith("CLIP")

    def name(self) -> str:
        return f"{self.cls} tokenizer" if self.cls.endswith("'s") else f"tokenizer ({self.cls})" if self.cls \
            else "tokenizer"


def _json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: data.text_encoders: cannot read it ({e}); {FIX}") from e
    return d if isinstance(d, dict) else {}


def _named(folder: Path) -> tuple[dict, set]:
    """(tokenizer_config.json, the special tokens it and special_tokens_map.json name)."""
    c = _json(folder / "tokenizer_config.json")
    names = set()
    for d in (c, _json(folder / "special_tokens_map.json")):
        values = [d.get(k) for k in SPECIAL_KEYS] + [v for k in LISTS for v in (d.get(k) or [])]
        names.update(v["content"] if isinstance(v, dict) else v for v in values
                     if isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("content"), str)))
    return c, names


def read(folder: Path, encoder_class: str = "") -> Vocabulary:
    """The vocabulary of the tokenizer in `folder` (tokenizer_folder's) and how it spells a text."""
    c, names = _named(folder)
    cls = str(c.get("tokenizer_class") or "")
    if cls in GENERIC or not cls:  # transformers 5 saves a tokenizer built from a tokenizers object so
        cls = f"{encoder_class}'s" if encoder_class else cls
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 -- the Rust side raises plain Exception for a bad file
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise UserError(f"{folder / 'tokenizer.json'}: data.text_encoders: not a tokenizer ({first}); {FIX}") from e
        tokens, unk = tok.get_vocab(with_added_tokens=True), getattr(tok.model, "unk_token", None)
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        special |= {tokens[n] for n in names | {unk} if n in tokens}
        if type(tok.model).__name__ == "Unigram":  # (sentencepiece's model: its unknown token by id)
            special |= {json.loads(tok.model.__getstate__()).get("unk_id")} - {None}
        return Vocabulary(folder, cls, tokens, special, lambda text: tok.encode(text, add_special_tokens=False).ids)
    sp = check_spiece(folder)
    if sp is not None:
        tokens = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        special = {i for i in tokens.values() if sp.is_control(i) or sp.is_unknown(i)}
        special |= {tokens[n] for n in names if n in tokens}
        return Vocabulary(folder, cls, tokens, special, sp.encode)
    if (folder / "vocab.txt").is_file():  # BERT's WordPiece (HunyuanDiT's tokenizer/)
        from tokenizers.implementations import BertWordPieceTokenizer

        try:
            tok = BertWordPieceTokenizer(str(folder / "vocab.txt"), lowercase=bool(c.get("do_lower_case", True)))
        except Exception as e:  # noqa: BLE001 -- as above
            raise UserError(f"{folder / 'vocab.txt'}: data.text_encoders: not a WordPiece vocabulary ({e}); "
                            f"{FIX}") from e
        tokens = tok.get_vocab(with_added_tokens=True)
        special = {tokens[n] for n in names | {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"} if n in tokens}
        return Vocabulary(folder, cls, tokens, special, lambda text: tok.encode(text, add_special_tokens=False).ids)
    if not (folder / "vocab.json").is_file():  # no vocabulary diffrelay can read (ByT5 has none): transformers'
        return Vocabulary(folder, cls, None, set(), None)
    # vocab.json (and merges.txt): a byte-level BPE, which spells any text its byte alphabet holds; its vocabulary
    # alone is checked.
    tokens = _json(folder / "vocab.json")
    tokens = {k: v for k, v in tokens.items() if isinstance(v, int)}
    return Vocabulary(folder, cls, tokens, {tokens[n] for n in names if n in tokens}, None)


def _cause(vocab: Vocabulary) -> str:
    if not vocab.is_clip():
        return ""
    return (" (transformers 5 makes such a CLIPTokenizer, silently, from v4's vocab_file= and merges_file=: pass "
            "vocab= and merges= instead, or copy the pipeline's own tokenizer folder)")


def _shown(vocab: Vocabulary, ids) -> str:
    back = {i: t for t, i in vocab.tokens.items()}
    return "[" + ", ".join(repr(back.get(i, i)) for i in list(ids)[:8]) + (", ..." if len(ids) > 8 else "") + "]"


def check(folder: Path, encoder_class: str = "", texts=()) -> Vocabulary:
    """The tokenizer in `folder` holds more than special tokens, and spells at least one of `texts` (the first
    SAMPLE; none: the vocabulary alone is checked) as more than unknown and special tokens; one line if not."""
    vocab = read(folder, encoder_class)
    if vocab.tokens is None:
        return vocab
    if set(vocab.tokens.values()) <= vocab.special:
        names = sorted(vocab.tokens, key=vocab.tokens.get)
        raise UserError(f"{folder}: data.text_encoders: the {vocab.name()} holds only its special tokens "
                        f"({', '.join(names[:6]) or 'none at all'}): it would spell every caption alike"
                        f"{_cause(vocab)}; {FIX}")
    texts = [t for t in list(texts)[:SAMPLE] if isinstance(t, str) and t.strip()]
    if vocab.encode is None or not texts:
        return vocab
    spelled = [vocab.encode(t) for t in texts]
    if all(set(ids) <= vocab.special for ids in spelled):
        raise UserError(f"{folder}: data.text_encoders: the {vocab.name()} spells none of this run's prompts and "
                        f"captions ({len(texts)} shown) as more than unknown or special tokens (the first, "
                        f"{_start(texts[0])}, as {_shown(vocab, spelled[0])}): every caption would embed alike"
                        f"{_cause(vocab)}; {FIX}")
    return vocab


def check_entries(entries, texts) -> None:
    """check() of each data.text_encoders entry's tokenizer, against the run's texts (a list, read once)."""
    texts = list(texts)
    for e in entries:
        path = Path(e["path"]).expanduser()
        if path.is_dir():  # (a missing folder is encoders.records' to say)
            try:
                arch = (_json(path / "config.json").get("architectures") or [""])[0]
            except UserError:  # (config.json's own problem is encoders.records' to say)
                arch = ""
            check(tokenizer_folder(path), arch if isinstance(arch, str) else "", texts)


def _start(text: str, n: int = 60) -> str:
    return repr(text) if len(text) <= n else repr(text[:n]) + "..."
