"""Tiny text encoders for the tests, written into a folder as transformers' save_pretrained writes them.

Nothing is downloaded: each vocabulary is written here (the words of the shapes captions, "a red circle top
left", plus "a", "photo", "of"), the weights are drawn from a seeded generator, and everything is saved with
safe_serialization=True. A few 10k parameters each: they build in well under a second.
"""

import json
from pathlib import Path

from diffrelay.text.demo import COLOURS, POSITIONS, SHAPES, WORDS, clip_text, clip_vocab  # noqa: F401


def t5_tokenizer(words=WORDS, max_length: int = 512):
    """A fast tokenizer of T5's conventions: <pad> 0, </s> 1, <unk> 2, an </s> after every text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def spiece_tokenizer(folder, words=WORDS, extra_ids: int = 100) -> Path:
    """A T5 tokenizer as PixArt's and HunyuanDiT's tokenizer folders hold it: a sentencepiece unigram model
    (spiece.model, trained here on the shapes' words; T5's ids: <pad> 0, </s> 1, <unk> 2, no <s>) and a
    tokenizer_config.json naming T5Tokenizer, with no tokenizer.json: transformers converts it when it loads."""
    import io

    import sentencepiece

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    unique = list(dict.fromkeys(words))
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([" ".join(unique[i:i + 6]) for i in range(0, len(unique), 3)] * 5), model_writer=model,
        vocab_size=60, hard_vocab_limit=False, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        num_threads=1, minloglevel=2)
    (folder / "spiece.model").write_bytes(model.getvalue())
    extra = [f"<extra_id_{i}>" for i in range(extra_ids)]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "T5Tokenizer", "extra_ids": extra_ids, "additional_special_tokens": extra, "legacy": True,
        "model_max_length": 512, "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "additional_special_tokens": extra, "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    return folder


def t5(folder, d_model: int = 32, layers: int = 2, heads: int = 4, words=WORDS, seed: int = 0,
       spiece: bool = False) -> Path:
    """A T5EncoderModel (T5 v1.1's gated-gelu) and a tokenizer.json in `folder`; spiece: the tokenizer as
    spiece.model alone (spiece_tokenizer), as the real T5 folders of PixArt and HunyuanDiT ship it."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    folder = Path(folder)
    if spiece:
        tokenizer = AutoTokenizer.from_pretrained(spiece_tokenizer(folder, words), local_files_only=True)
    else:
        tokenizer = t5_tokenizer(words)
    config = T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // heads, d_ff=2 * d_model,
                      num_layers=layers, num_heads=heads, relative_attention_num_buckets=8,
                      feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(seed)
    T5EncoderModel(config).save_pretrained(folder, safe_serialization=True)
    if not spiece:
        tokenizer.save_pretrained(folder)
    return folder


def pickled(folder, source) -> Path:
    """A copy of the model folder `source` whose weights are a pickled pytorch_model.bin only (a refusal test:
    the file holds a pickle that must never be read)."""
    import shutil

    folder = Path(folder)
    shutil.copytree(source, folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    # Not even torch.save's format: opening it would be a bug whatever it holds.
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    return folder


def clip_model(folder, words=WORDS, seed: int = 0) -> Path:
    """A tiny CLIPModel (32 px, patch 8), its tokenizer and image processor in `folder` (CLIP score's model)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab(words)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    # transformers 5 takes the vocabulary itself (vocab=, merges=); v4's vocab_file= would be silently ignored.
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges], model_max_length=77)
    assert len(tokenizer) == len(vocab) and tokenizer(words[-1])["input_ids"] == [
        vocab["<|startoftext|>"], vocab[words[-1] + "</w>"], vocab["<|endoftext|>"]]
    eos = vocab["<|endoftext|>"]
    text = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"], eos_token_id=eos, pad_token_id=eos)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    torch.manual_seed(seed)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(
        folder, safe_serialization=True)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder

