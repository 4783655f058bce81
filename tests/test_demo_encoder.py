"""`diffrelay demo-encoder --captions`: a random CLIP whose tokenizer knows every word of one's captions as one token
(text/demo.py; the command: data/caption_encoder.py); its words, its embeddings, and its one-line refusals."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from diffrelay import cli
from diffrelay.data import caption_encoder
from diffrelay.text import demo, encoders

CAPTIONS = {  # "even", "eve", "sevens" share pairs with "seven": left-to-right merge chains would split it
    "a.png": ["A photo of the digit SEVEN", "seven, even sevens"],
    "b.png": ["a photo of the digit eight", "eve's 42 naïve café"],
}


def images(folder, captions=CAPTIONS, sidecars=True):
    folder.mkdir(parents=True, exist_ok=True)
    for name, caps in captions.items():
        Image.new("RGB", (8, 8)).save(folder / name)
        if sidecars:
            (folder / name).with_suffix(".txt").write_text("\n".join(caps) + "\n")
    return folder


def write(folder, source, *extra):
    assert cli.main(["demo-encoder", "--captions", str(source), "--out", str(folder), "--width", "32", *extra]) == 0
    return folder


def refused(capsys, *args) -> str:
    capsys.readouterr()  # what came before
    assert cli.main(["demo-encoder", *map(str, args)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffrelay: error: ") and "\n" not in err, err
    return err


@pytest.fixture(scope="module")
def words_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return write(root / "enc", images(root / "images"))


def test_every_caption_word_is_one_token_and_decodes_to_itself(words_folder):
    from transformers import AutoTokenizer

    texts = [c for caps in CAPTIONS.values() for c in caps]
    words = demo.caption_words(texts)
    assert {"seven", "sevens", "even", "eve", "'s", "4", "2", ",", "naïve", "café"} <= set(words)
    assert "SEVEN" not in words  # lowercased, as CLIP's tokenizer does
    tok = AutoTokenizer.from_pretrained(words_folder, local_files_only=True)
    ids = tok(words, add_special_tokens=False)["input_ids"]
    assert all(len(i) == 1 for i in ids), [(w, i) for w, i in zip(words, ids) if len(i) != 1]
    assert [tok.decode(i).strip() for i in ids] == words
    assert len({i[0] for i in ids}) == len(words)
    # A caption is its words' tokens, between the start and end tokens.
    assert len(tok("A photo of the digit SEVEN")["input_ids"]) == 6 + 2
    # The left-to-right chains of clip_vocab (the shapes vocabulary's) would not do: "even"'s merges split "seven".
    vocab, merges = demo.clip_vocab(words)
    from transformers import CLIPTokenizer

    chains = CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges])
    assert any(len(i) > 1 for i in chains(words, add_special_tokens=False)["input_ids"])


def test_the_vocabulary_does_not_depend_on_the_caption_order(tmp_path):
    texts = [c for caps in CAPTIONS.values() for c in caps]
    assert demo.word_vocab(demo.caption_words(texts)) == demo.word_vocab(demo.caption_words(texts[::-1]))


def test_captions_differing_in_one_word_are_far_apart_where_the_network_looks(words_folder):
    enc = encoders.load({"path": str(words_folder), "max_length": None, "layer": "last", "pooled": False}, "cpu")
    prompts = ["a photo of the digit seven", "a photo of the digit eight"]
    states = encoders.encode([enc], prompts, "cpu").states  # (2, 77, 32)
    cos = torch.nn.functional.cosine_similarity(states[0], states[1], dim=-1)  # per position
    at = 6  # start, a, photo, of, the, digit: equal before it (causal attention)
    assert torch.allclose(states[0, :at], states[1, :at])
    assert cos[at] < 0.6, cos[at]  # the word itself
    # The padding after the caption carries it (its own embedding is zero): it differs too.
    assert (cos[at + 1:] < 0.99).all(), cos[at + 1:].max()
    flat = torch.nn.functional.cosine_similarity(states[0].flatten(), states[1].flatten(), dim=0)
    assert flat < 0.95, flat


def test_a_caption_table_and_metadata_jsonl_are_read_as_data_captions_reads_them(tmp_path, capsys):
    table = tmp_path / "captions.csv"
    table.write_text('file_name,caption\na.png,"a red fox, sleeping"\nb.png,a blue heron\n')
    folder = write(tmp_path / "from-csv", table, "--caption-column", "caption")
    vocab = json.loads((folder / "vocab.json").read_text())
    assert {"fox</w>", "heron</w>", ",</w>"} <= set(vocab)
    meta = images(tmp_path / "hf", sidecars=False)
    (meta / "metadata.jsonl").write_text("".join(json.dumps({"file_name": n, "text": c}) + "\n"
                                                 for n, c in (("a.png", ["a grey owl"]), ("b.png", "a wren"))))
    vocab = json.loads((write(tmp_path / "from-hf", meta) / "vocab.json").read_text())
    assert {"owl</w>", "wren</w>"} <= set(vocab)


def test_bad_captions_are_refused_in_one_line_naming_the_file_and_the_fix(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    missing = tmp_path / "nowhere"
    assert f"{missing}: --captions: not found; give the image folder" in refused(capsys, "--captions", missing,
                                                                                   "--out", out)
    other = tmp_path / "captions.txt"
    other.write_text("a cat\n")
    assert "not a caption table; give" in refused(capsys, "--captions", other, "--out", out)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty}: --captions: no images found" in refused(capsys, "--captions", empty, "--out", out)
    bare = images(tmp_path / "bare", sidecars=False)
    err = refused(capsys, "--captions", bare, "--out", out)
    assert f"{bare / 'a.png'}: no caption (a.txt or a.caption not found beside it; write one" in err
    header = tmp_path / "header.csv"
    header.write_text("file_name,text\n")
    assert f"{header}: --captions: the table has no rows" in refused(capsys, "--captions", header, "--out", out)
    column = tmp_path / "column.jsonl"
    column.write_text('{"file_name": "a.png", "caption": "a cat"}\n')
    err = refused(capsys, "--captions", column, "--out", out)
    assert f"{column}: line 1: no column 'text' (columns: file_name, caption); set --caption-column" in err
    blank = images(tmp_path / "blank", {"a.png": ["   "]})
    assert "empty caption" in refused(capsys, "--captions", blank, "--out", out)
    monkeypatch.setattr(caption_encoder, "MAX_TOKENS", 520)  # the byte alphabet's 512, two special tokens and a few words
    big = images(tmp_path / "big")
    err = refused(capsys, "--captions", big, "--out", out)
    assert f"{big}: --captions: 16 distinct words, which need more than the 520 tokens" in err
    assert "data.text_encoders" in err and not out.exists()


def test_an_encoder_of_other_words_is_not_replaced_nor_kept(tmp_path, capsys):
    out = write(tmp_path / "enc", images(tmp_path / "a", {"a.png": ["a cat"]}))
    before = (out / "model.safetensors").read_bytes()
    write(out, tmp_path / "a")  # the same words: nothing to do
    err = refused(capsys, "--captions", images(tmp_path / "b", {"a.png": ["a dog"]}), "--out", out)
    assert f"{out}: --out: holds a text encoder of other words" in err and "give another --out" in err
    assert (out / "model.safetensors").read_bytes() == before


def test_the_shapes_encoder_is_unchanged_without_captions(tmp_path):
    """No --captions: the demo's encoder as before (64 wide, the shapes words' vocabulary)."""
    assert cli.main(["demo-encoder", "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["hidden_size"] == 64
    assert json.loads((tmp_path / "a" / "vocab.json").read_text()) == demo.clip_vocab()[0]


def test_thousands_of_words_each_stay_one_token():
    """Many words sharing pairs in every order: a merge learnt late must not be lost (each word one token)."""
    from transformers import CLIPTokenizer

    rng = np.random.default_rng(0)
    words = sorted({"".join(rng.choice(list("abcdefgh"), rng.integers(1, 9))) for _ in range(3000)})
    vocab, merges = demo.word_vocab(words)
    tok = CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges])
    ids = tok(words, add_special_tokens=False)["input_ids"]
    assert [w for w, i in zip(words, ids) if len(i) != 1] == []
