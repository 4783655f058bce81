"""`diffrelay demo-encoder`: the demo's random CLIP text encoder (text/demo.py) written into a folder; with
`--captions`, one whose tokenizer knows every word of one's own captions, read as `data.captions` reads them
(data/captions.py), so a from-scratch text run on them works offline (docs/text.md).

Imports the base modules, data (the captions) and text (the encoder).
"""

from pathlib import Path

from diffrelay.errors import UserError
from diffrelay.text.demo import (CAPTIONS_FIX, CAPTIONS_WIDTH, MAX_TOKENS, caption_words, check_words, clip_text,
                                 word_vocab)


def caption_texts(source, file_col: str = "file_name", cap_col: str = "text") -> list[str]:
    """Every caption of `source`, read as data.captions reads them: a folder as data.path with captions auto
    (name.txt or name.caption beside each image, or its metadata.jsonl), or a .csv, .parquet or .jsonl table, of
    which only the caption column is read (the words need no images)."""
    from diffrelay.data import captions, datasets

    path = Path(source).expanduser()
    if path.is_dir():
        files = [(rel, "") for rel, _ in datasets.list_images(path, "--captions")]
        return [c for caps in captions.folder(path, files, "auto", file_col, cap_col, "--captions")[1] for c in caps]
    if not path.exists() or path.suffix.lower() not in captions.TABLES:
        raise UserError(f"{path}: --captions: {'not found' if not path.exists() else 'not a caption table'}; "
                        f"{CAPTIONS_FIX}")
    texts = []
    for where, record in captions.records(path):
        if cap_col not in record:
            raise UserError(f"{path}: {where}: no column '{cap_col}' (columns: {', '.join(map(str, record))}); set "
                            "--caption-column (as data.caption_column) to the one that holds the captions")
        texts += captions.caption_list(record[cap_col], path, where, cap_col)
    if not texts:
        raise UserError(f"{path}: --captions: the table has no rows, so no words; write a row per image with its "
                        f"caption in column '{cap_col}', or give the image folder")
    return texts


def words_vocab(source, file_col: str, cap_col: str) -> tuple[list, tuple]:
    """(words, (vocab, merges)) of the captions of `source`; one line when they need more tokens than a CLIP has."""
    words = caption_words(caption_texts(source, file_col, cap_col))
    vocab = word_vocab(words) if len(words) <= MAX_TOKENS else None  # each word is a token at least
    if vocab is None or len(vocab[0]) > MAX_TOKENS:
        raise UserError(f"{source}: --captions: {len(words):,} distinct words, which need more than the "
                        f"{MAX_TOKENS:,} tokens of CLIP's vocabulary; a random encoder is for small caption sets: "
                        "name a pretrained text encoder's folder in data.text_encoders (docs/text.md)")
    return words, vocab


def main(args) -> int:
    from diffrelay import io, logs

    logs.setup()
    out = Path(args.out)
    words, vocab = words_vocab(args.captions, args.file_column, args.caption_column) if args.captions else ((), None)
    if (out / "config.json").is_file():
        if vocab is not None and (out / "vocab.json").is_file() and io.read_json(out / "vocab.json") != vocab[0]:
            raise UserError(f"{out}: --out: holds a text encoder of other words than {args.captions}'s; give another "
                            "--out, or remove the folder to write this one")
        logs.get().info(f"{out}: already holds a model; nothing to do")
        return 0
    width = args.width or (CAPTIONS_WIDTH if vocab else 64)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one line says what was written
    with io.atomic_dir(out, owned=lambda p: not any(Path(p).iterdir())) as tmp:  # replaces only an empty folder
        if vocab is None:
            clip_text(tmp, hidden=width, layers=2, heads=2, seed=args.seed)
        else:
            # Each word's own vector (std 1, not CLIP's 0.02: the layers' outputs would drown it), and padding that
            # adds nothing, so the padding positions' states are the caption's words mixed by attention and not a
            # constant every caption shares (docs/text.md has the cosines).
            clip_text(tmp, hidden=width, layers=2, heads=2, seed=args.seed, vocab=vocab, token_std=1.0,
                      zero_specials=True)
            check_words(tmp, words)
    what = "shapes vocabulary" if vocab is None else f"{len(words):,} caption words, {len(vocab[0]):,} tokens"
    logs.get().info(f"wrote the demo's text encoder (random CLIP, {width} wide, {what}) to {out}")
    return 0
