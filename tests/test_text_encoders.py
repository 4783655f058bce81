"""Text encoders: tiny CLIP, CLIP with projection and T5 loaded from local folders, tokenised and combined as
diffusers' pipelines do (SDXL, SD3, PixArt), checked against transformers' own calls; and every refusal."""

import hashlib
import itertools
import json
import logging
import shutil

import pytest
import torch

import textmodels as tm
from diffrelay import logs
from diffrelay.errors import UserError
from diffrelay.text import encoders

CAPTIONS = [f"a {c} {s} {p}" for c, s, p in itertools.product(tm.COLOURS, tm.SHAPES, tm.POSITIONS)]


def entry(path, **kw):
    return {"path": str(path), "max_length": None, "layer": "last", "pooled": False} | kw


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return {"clip": tm.clip_text(root / "clip"), "clip_p": tm.clip_text(root / "clip_p", projection=True, hidden=48,
                                                                       seed=1),
            "t5": tm.t5(root / "t5", d_model=96), "root": root}


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_records_read_config_json_and_hash_the_weights_without_loading(folders):
    recs = encoders.records([entry(folders["clip"]), entry(folders["clip_p"], layer="penultimate", pooled=True),
                             entry(folders["t5"])])
    sha = hashlib.sha256((folders["clip"] / "model.safetensors").read_bytes()).hexdigest()
    assert recs[0] == {"class": "CLIPTextModel", "path": str(folders["clip"]), "sha256": sha, "max_length": None,
                       "layer": "last", "pooled": False, "states_dim": 32, "pooled_dim": None, "length": 77,
                       "use_mask": True}
    assert recs[1]["class"] == "CLIPTextModelWithProjection" and recs[1]["pooled_dim"] == 48
    assert recs[2]["class"] == "T5EncoderModel" and recs[2]["length"] == encoders.T5_LENGTH == 256
    assert encoders.combined_dims(recs) == {"states": 96, "length": 77 + 256, "pooled": 48}
    loaded = encoders.load(entry(folders["clip"]), "cpu")
    assert encoders.record(loaded) == recs[0]


def reference(folder, cls, prompts, length, layer="last", mask=False):
    """transformers' own call, as the pipelines make it."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = getattr(transformers, cls).from_pretrained(folder, local_files_only=True, use_safetensors=True).eval()
    t = tok(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model(t.input_ids, attention_mask=t.attention_mask if mask else None, output_hidden_states=True)
    states = out.last_hidden_state if layer == "last" else out.hidden_states[-2]
    return states, t.attention_mask, out


def test_each_encoder_gives_what_transformers_gives(folders):
    prompts = CAPTIONS[:encoders.ROWS]  # one call of ROWS captions, as transformers is called here
    got = encoders.encode([encoders.load(entry(folders["clip"], pooled=True), "cpu")], prompts, "cpu")
    states, _, out = reference(folders["clip"], "CLIPTextModel", prompts, 77)
    assert torch.equal(got.states, states) and torch.equal(got.pooled, out.pooler_output)
    assert got.mask.dtype == torch.int64 and bool((got.mask == 1).all())  # the UNets attend to all 77 tokens
    got = encoders.encode([encoders.load(entry(folders["clip_p"], layer="penultimate", pooled=True), "cpu")],
                          prompts, "cpu")
    states, _, out = reference(folders["clip_p"], "CLIPTextModelWithProjection", prompts, 77, "penultimate")
    assert torch.equal(got.states, states) and torch.equal(got.pooled, out.text_embeds)
    assert not torch.equal(states, out.last_hidden_state)  # the final layer norm is left out
    got = encoders.encode([encoders.load(entry(folders["t5"], max_length=12), "cpu")], prompts, "cpu")
    states, mask, _ = reference(folders["t5"], "T5EncoderModel", prompts, 12, mask=True)
    assert torch.equal(got.states, states) and torch.equal(got.mask, mask) and got.pooled is None
    assert got.mask[0].tolist() == [1] * 5 + [0] * 7  # "a red circle top" and </s>, then padding
    # Fewer captions than a call: the same numbers up to rounding.
    few = encoders.encode([encoders.load(entry(folders["t5"], max_length=12), "cpu")], prompts[:3], "cpu")
    torch.testing.assert_close(few.states, states[:3])


def test_use_mask_false_calls_the_t5_without_its_mask_as_sd3_does(folders):
    """SD3's _get_t5_prompt_embeds calls the T5 with no attention mask (its padding attended) and its transformer
    takes no mask; PixArt's encode_prompt passes the mask (use_mask true, the default)."""
    prompts = CAPTIONS[:encoders.ROWS - 1] + [""]  # the empty caption too: all padding after its </s>
    sd3 = encoders.encode([encoders.load(entry(folders["t5"], max_length=12, use_mask=False), "cpu")], prompts, "cpu")
    states, mask, _ = reference(folders["t5"], "T5EncoderModel", prompts, 12, mask=False)
    assert torch.equal(sd3.states, states)
    assert sd3.mask.dtype == torch.int64 and bool((sd3.mask == 1).all()) and not bool((mask == 1).all())
    pixart = encoders.encode([encoders.load(entry(folders["t5"], max_length=12), "cpu")], prompts, "cpu")
    masked, _, _ = reference(folders["t5"], "T5EncoderModel", prompts, 12, mask=True)
    assert torch.equal(pixart.states, masked) and torch.equal(pixart.mask, mask)
    # The two differ (at every real token: the padding reaches them through attention), so the setting matters.
    assert (sd3.states[0, :5] - pixart.states[0, :5]).abs().amax(-1).min() > 1e-3
    # Combined as SD3 combines them: the CLIP block's ones, then the T5's ones.
    clip_p = encoders.load(entry(folders["clip_p"], layer="penultimate", pooled=True), "cpu")
    both = encoders.encode([clip_p, encoders.load(entry(folders["t5"], max_length=12, use_mask=False), "cpu")],
                           prompts[:3], "cpu")
    assert both.mask.shape == (3, 77 + 12) and bool((both.mask == 1).all())
    assert torch.equal(both.states[:, 77:], sd3.states[:3])


def test_use_mask_is_in_the_record_and_the_fingerprint(folders):
    t5 = encoders.records([entry(folders["t5"])])[0]
    unmasked = encoders.records([entry(folders["t5"], use_mask=False)])[0]
    assert t5["use_mask"] is True and unmasked["use_mask"] is False and "use_mask" in encoders.RECORD_KEYS
    assert encoders.fingerprint_part([unmasked]) != encoders.fingerprint_part([t5])
    assert encoders.fingerprint_part([unmasked])[0]["use_mask"] is False
    # true is what diffrelay did before the setting: those datasets keep their fingerprints, and a record stored
    # then (no use_mask key) reads as true.
    before = {k: v for k, v in t5.items() if k != "use_mask"}
    assert encoders.fingerprint_part([t5]) == encoders.fingerprint_part([before]) == [
        {k: t5[k] for k in encoders.RECORD_KEYS if k != "use_mask"}]
    assert encoders.record(encoders.load(before | {"max_length": 12}, "cpu"))["use_mask"] is True
    # A record (as snapshots and prepare's plan keep them) loads with its own setting.
    assert encoders.load(unmasked, "cpu").record["use_mask"] is False


def test_sdxl_and_sd3_combinations(folders):
    clip, clip_p, t5 = (encoders.load(e, "cpu") for e in (
        entry(folders["clip"], layer="penultimate"), entry(folders["clip_p"], layer="penultimate", pooled=True),
        entry(folders["t5"], max_length=10)))
    prompts = CAPTIONS[:5]
    alone = {k: encoders.encode([e], prompts, "cpu") for k, e in (("clip", clip), ("clip_p", clip_p), ("t5", t5))}
    # SDXL: the CLIPs' features side by side, the second's pooled embedding.
    sdxl = encoders.encode([clip, clip_p], prompts, "cpu")
    assert sdxl.states.shape == (5, 77, 80) and sdxl.pooled.shape == (5, 48)
    assert torch.equal(sdxl.states, torch.cat([alone["clip"].states, alone["clip_p"].states], -1))
    assert torch.equal(sdxl.pooled, alone["clip_p"].pooled)
    # SD3: then the T5 along the tokens, the CLIP block zero-padded to its width; pooled of both CLIPs.
    clip.record["pooled"], clip.record["pooled_dim"] = True, 32
    sd3 = encoders.encode([clip, clip_p, t5], prompts, "cpu")
    assert sd3.states.shape == (5, 87, 96) and sd3.mask.shape == (5, 87) and sd3.pooled.shape == (5, 80)
    assert torch.equal(sd3.states[:, :77, :80], sdxl.states) and not sd3.states[:, :77, 80:].any()
    assert torch.equal(sd3.states[:, 77:], alone["t5"].states)
    assert torch.equal(sd3.mask, torch.cat([torch.ones(5, 77, dtype=torch.int64), alone["t5"].mask], 1))
    assert torch.equal(sd3.pooled[:, 32:], alone["clip_p"].pooled)
    empty = encoders.encode([clip, clip_p, t5], [], "cpu")
    assert empty.states.shape == (0, 87, 96) and empty.pooled.shape == (0, 80)


def test_a_captions_embedding_does_not_depend_on_the_others_in_its_list(folders):
    encs = [encoders.load(entry(folders["clip_p"], layer="penultimate", pooled=True), "cpu"),
            encoders.load(entry(folders["t5"], max_length=10), "cpu")]
    everything = encoders.encode(encs, CAPTIONS[:37], "cpu")
    order = torch.randperm(37, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = encoders.encode(encs, [CAPTIONS[i] for i in order], "cpu")
    assert torch.equal(shuffled.states, everything.states[order]) and torch.equal(shuffled.pooled,
                                                                                  everything.pooled[order])
    for rows in ([20], [3, 30, 17], list(range(16, 37))):
        part = encoders.encode(encs, [CAPTIONS[i] for i in rows], "cpu")
        assert torch.equal(part.states, everything.states[rows]) and torch.equal(part.mask, everything.mask[rows])


@pytest.fixture
def warnings():
    got, handler = [], logging.Handler()
    handler.emit = lambda record: got.append(record.getMessage())
    logs.get().addHandler(handler)
    level = logs.get().level
    logs.get().setLevel(logging.INFO)
    yield got
    logs.get().removeHandler(handler)
    logs.get().setLevel(level)


def test_a_long_caption_is_cut_and_said_once_per_encoder(folders, warnings):
    long = "a photo of a red circle top left " * 4
    t5 = encoders.load(entry(folders["t5"], max_length=8), "cpu")
    cut = encoders.encode([t5], ["a red circle", long], "cpu")
    assert cut.mask[1].tolist() == [1] * 8
    assert len(warnings) == 1 and "8 tokens" in warnings[0] and "'a photo of a red circle top left a photo" in \
        warnings[0] and str(folders["t5"]) in warnings[0]
    encoders.encode([t5], [long, long + "blue"], "cpu")
    clip = encoders.load(entry(folders["clip"], max_length=6), "cpu")
    encoders.encode([clip], ["a red circle", long], "cpu")
    encoders.encode([clip], [long], "cpu")
    assert len(warnings) == 2 and "6 tokens" in warnings[1] and str(folders["clip"]) in warnings[1]
    encoders.encode([encoders.load(entry(folders["t5"], max_length=40), "cpu")], [long], "cpu")
    assert len(warnings) == 2


def copy(folders, name, to):
    return shutil.copytree(folders[name], folders["root"] / to)


def test_refusals_name_the_folder_and_the_fix_in_one_line(folders, tmp_path):
    def refused(e, *words):
        with pytest.raises(UserError) as info:
            encoders.load(e, "cpu") if isinstance(e, dict) else encoders.records(e)
        text = one_line(info)
        assert all(w in text for w in words), text

    refused(entry(tmp_path / "nowhere"), str(tmp_path / "nowhere"), "local folders only", "nothing is downloaded")
    (tmp_path / "file").write_text("x")
    refused(entry(tmp_path / "file"), "is a file")
    bare = shutil.copytree(folders["clip"], tmp_path / "bare")
    (bare / "config.json").unlink()
    refused(entry(bare), str(bare / "config.json"), "no config.json")
    # Pickled weights: refused before the file is opened (it is not even a valid pickle).
    pickled = tm.pickled(tmp_path / "pickled", folders["clip"])
    refused(entry(pickled), str(pickled / "pytorch_model.bin"), "safetensors", "never loaded")
    empty = shutil.copytree(folders["clip"], tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    refused(entry(empty), "no *.safetensors")
    roberta = shutil.copytree(folders["clip"], tmp_path / "roberta")
    config = json.loads((roberta / "config.json").read_text())
    (roberta / "config.json").write_text(json.dumps(config | {"architectures": ["RobertaModel"]}))
    refused(entry(roberta), str(roberta), "RobertaModel",
            "CLIPTextModel, CLIPTextModelWithProjection, BertModel, T5EncoderModel")
    refused(entry(folders["t5"], pooled=True), str(folders["t5"]), "no pooled")
    refused(entry(folders["clip"], max_length=78), "77 positions")
    refused(entry(folders["t5"], max_length=1), str(folders["t5"]), "max_length 1 leaves no token", "at least 2")
    refused(entry(folders["clip"], max_length=2), "max_length 2 leaves no token", "at least 3")
    notok = shutil.copytree(folders["clip"], tmp_path / "notok")
    for name in encoders.TOKENIZER_FILES + ("merges.txt",):
        (notok / name).unlink(missing_ok=True)
    refused(entry(notok), str(notok), "no tokenizer")
    small = shutil.copytree(folders["clip"], tmp_path / "small")
    (small / "config.json").write_text(json.dumps(config | {"vocab_size": 100}))
    refused(entry(small), str(small), "585 tokens", "100", "not a pair")


def test_the_combination_rules(folders):
    clip, t5, clip_p = entry(folders["clip"]), entry(folders["t5"]), entry(folders["clip_p"])
    for entries, words in (([t5, clip], "CLIP encoders first"), ([t5, t5], "at most one T5"),
                           ([clip | {"max_length": 20}, clip_p], "one length"), ([], "empty")):
        with pytest.raises(UserError) as info:
            encoders.records(entries)
        assert words in one_line(info)
    with pytest.raises(UserError) as info:
        encoders.layout([{**encoders.records([clip])[0], "states_dim": 200}, encoders.records([t5])[0]])
    assert "zero-padded" in one_line(info)


def test_tokenizers_that_do_not_belong_are_refused(folders, tmp_path):
    from transformers import CLIPTokenizer

    # transformers 5 ignores v4's vocab_file=/merges_file= and makes a tokenizer of 3 special tokens, silently.
    broken = shutil.copytree(folders["clip"], tmp_path / "broken")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (broken / name).unlink()
    CLIPTokenizer(vocab_file=str(folders["clip"] / "vocab.json"),
                  merges_file=str(folders["clip"] / "merges.txt")).save_pretrained(broken)
    with pytest.raises(UserError) as info:
        encoders.load(entry(broken), "cpu")
    assert str(broken) in one_line(info) and "only its special tokens" in one_line(info) and "vocab_file" in one_line(
        info)
    # A T5 tokenizer without a pad token.
    nopad = shutil.copytree(folders["t5"], tmp_path / "nopad")
    tok = tm.t5_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(nopad)
    with pytest.raises(UserError) as info:
        encoders.load(entry(nopad), "cpu")
    assert "pad token id is None" in one_line(info)
    # A T5 tokenizer as PixArt's tokenizer/ folder holds it (spiece.model, no tokenizer.json), damaged.
    spiece = tm.spiece_tokenizer(tmp_path / "spiece")
    shutil.copy(folders["t5"] / "config.json", spiece)
    shutil.copy(folders["t5"] / "model.safetensors", spiece)
    (spiece / "spiece.model").write_bytes(b"\n\x00")
    with pytest.raises(UserError) as info:
        encoders.load(entry(spiece), "cpu")
    assert one_line(info).startswith(str(spiece / "spiece.model")) and "not a sentencepiece model" in one_line(info)
    # A CLIP pooled where its tokenizer's eos is not.
    other = shutil.copytree(folders["clip"], tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"eos_token_id": 5}))
    encoders.load(entry(other), "cpu")  # the states do not depend on it
    with pytest.raises(UserError) as info:
        encoders.load(entry(other, pooled=True), "cpu")
    assert "pools" in one_line(info)


def test_a_t5_tokenizer_saved_as_spiece_model_alone_tokenizes_as_sentencepiece(tmp_path):
    """PixArt's and HunyuanDiT's T5 tokenizer folders hold spiece.model and no tokenizer.json: the sentencepiece
    package (a dependency) converts it, and the ids are sentencepiece's own, case and punctuation kept."""
    import sentencepiece

    folder = tm.t5(tmp_path / "t5", spiece=True)
    assert not (folder / "tokenizer.json").exists()
    enc = encoders.load(entry(folder), "cpu")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    for text in ("a red circle top left", "A Red circle, #42!"):
        assert enc.tokenizer(text)["input_ids"] == sp.encode(text) + [sp.eos_id()]
    assert enc.tokenizer("A red")["input_ids"] != enc.tokenizer("a red")["input_ids"]
    assert not (folder / "tokenizer.json").exists()  # loading wrote nothing into the folder


def test_a_diffusers_pipeline_layout_and_a_tokenizer_without_tokenizer_json(folders, tmp_path):
    """SD's tokenizer/ folders hold vocab.json, merges.txt and tokenizer_config.json, beside text_encoder/."""
    encoder = shutil.copytree(folders["clip"], tmp_path / "pipe/text_encoder_2")
    tokenizer = tmp_path / "pipe/tokenizer_2"
    tokenizer.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json"):
        (encoder / name).rename(tokenizer / name)
    (tokenizer / "tokenizer.json").unlink()
    want = encoders.encode([encoders.load(entry(folders["clip"]), "cpu")], CAPTIONS[:4], "cpu")
    got = encoders.encode([encoders.load(entry(encoder), "cpu")], CAPTIONS[:4], "cpu")
    assert torch.equal(got.states, want.states)


# ---------------------------------------------------------------------------------------------
# The tokenizer against the run's own text, at validate (text/tokens.py, data/texts.py)


def tokenizer_config(tmp_path, folder, **data):
    """A shapes text run (its captions "a red circle top left", ...) whose one text encoder is `folder`."""
    from diffrelay import config

    d = {"run": {"name": "tok", "device": "cpu", "results": str(tmp_path / "results"),
                 "resources": str(tmp_path / "resources")},
         "data": {"kind": "shapes", "resolution": 16, "count": 16, "captions": "auto", "labels": "none",
                  "val_fraction": 0.25, "text_encoders": [{"path": str(folder)}]} | data,
         "model": {"arch": "pixart", "class_conditional": False},
         "train": {"total_steps": 2, "segment_steps": 2, "batch_size": 4}, "fid": {"extractor": "random"}}
    return config.Config(config.validate(d, "tok.yaml"))


def preflight_refusal(cfg) -> str:
    from diffrelay.config import preflight

    with pytest.raises(UserError) as info:
        preflight.check(cfg, "tok.yaml", credentials=False)
    return one_line(info)


def test_a_word_level_t5_tokenizer_that_spells_the_runs_words_is_accepted(tmp_path):
    """FluxPipeline renders with a word-level T5 whose vocabulary knows the run's words and not "photo": it was
    refused at prepare, because 'a photo' came back as 'a' (issue 65)."""
    from diffrelay.config import preflight

    folder = tm.t5(tmp_path / "t5", words=[w for w in tm.WORDS if w != "photo"])
    assert tm.t5_tokenizer([w for w in tm.WORDS if w != "photo"])("a photo")["input_ids"] == [3, 2, 1]  # the case
    enc = encoders.load(entry(folder), "cpu")
    assert enc.tokenizer("a red circle")["input_ids"][-1] == 1
    preflight.check(tokenizer_config(tmp_path, folder), "tok.yaml", credentials=False)


def test_a_tokenizer_of_special_tokens_only_is_refused_at_validate_in_one_line(folders, tmp_path):
    from transformers import CLIPTokenizer

    t5 = shutil.copytree(folders["t5"], tmp_path / "t5")
    tm.t5_tokenizer(words=[]).save_pretrained(t5)  # <pad>, </s> and <unk>
    text = preflight_refusal(tokenizer_config(tmp_path, t5))
    assert text.startswith(f"{t5}: data.text_encoders: ") and "only its special tokens (<pad>, </s>, <unk>)" in text
    assert "CLIP" not in text and "vocab_file" not in text, text  # the CLIP cause is named for a CLIP only
    # transformers 5 ignores v4's vocab_file=/merges_file= and makes a CLIP tokenizer of its special tokens.
    clip = shutil.copytree(folders["clip"], tmp_path / "clip")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (clip / name).unlink()
    CLIPTokenizer(vocab_file=str(folders["clip"] / "vocab.json"),
                  merges_file=str(folders["clip"] / "merges.txt")).save_pretrained(clip)
    text = preflight_refusal(tokenizer_config(tmp_path, clip))
    assert text.startswith(f"{clip}: data.text_encoders: ") and "only its special tokens" in text
    assert "vocab_file" in text, text


def test_a_tokenizer_that_spells_none_of_the_runs_text_is_refused_and_one_that_spells_some_is_not(tmp_path):
    """Captions and prompt files (a sample of them) are shown to each tokenizer: refused only when all of them come
    out as unknown and special tokens."""
    folder = tm.t5(tmp_path / "t5", words=["zebra", "giraffe"])
    text = preflight_refusal(tokenizer_config(tmp_path, folder))
    assert text.startswith(f"{folder}: data.text_encoders: the T5EncoderModel's tokenizer spells none of this run's ") \
        and "'<unk>'" in text
    assert "CLIP" not in text, text
    from diffrelay.data import texts

    (tmp_path / "prompts.txt").write_text("a zebra\n")  # one prompt it spells: the run's text is not all unknown
    d = tokenizer_config(tmp_path, folder).to_dict()
    d["sample"]["prompts"] = str(tmp_path / "prompts.txt")
    from diffrelay.data import shapes

    assert texts.sample(d)[:3] == ["a zebra", *shapes.captions(d["data"]["seed"], 0, 16)]
    texts.check_tokenizers(d)


def test_the_runs_text_sample_reads_sidecars_and_tables_and_skips_what_it_cannot_read(tmp_path):
    from diffrelay.data import texts

    root = tmp_path / "imgs"
    (root / "sub").mkdir(parents=True)
    for rel, caption in (("b.png", "second"), ("a.png", "first\nfirst again"), ("sub/c.jpg", None)):
        (root / rel).write_bytes(b"")
        if caption:
            (root / rel).with_suffix(".txt").write_text(caption)
    (root / "bad.png").write_bytes(b"")
    (root / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    d = {"data": {"kind": "folder", "path": str(root), "captions": "auto", "val_path": None,
                  "caption_column": "text", "file_column": "file_name"}, "sample": {"prompts": None}}
    assert sorted(texts.sample(d)) == ["first", "first again", "second"]
    (root / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "from the table"}\nnot json\n'
                                         '{"file_name": "b.png", "text": ["one", "two"]}\n')
    assert texts.sample(d) == ["from the table", "one", "two"]
    (tmp_path / "t.csv").write_text("file_name,text\na.png,a csv caption\n")
    assert texts.sample(d | {"data": d["data"] | {"captions": str(tmp_path / "t.csv")}}) == ["a csv caption"]
