"""Prepare's cache of caption embeddings: what encoding gives, byte for byte whatever the process count, resumed
after a kill, and refused in one line when an array is cut short."""

import itertools
import logging

import numpy as np
import pytest
import torch

import textmodels as tm
from diffrelay import logs
from diffrelay.errors import UserError
from diffrelay.text import cache, encoders

TEXTS = [""] + [f"a {c} {s} {p}" for c, s, p in itertools.product(tm.COLOURS, tm.SHAPES, tm.POSITIONS)][:40]
NAMES = (cache.STATES, cache.MASK, cache.POOLED, cache.INFO)


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    clip, t5 = tm.clip_text(root / "clip", projection=True, hidden=16), tm.t5(root / "t5", d_model=24)
    return encoders.records([{"path": str(clip), "max_length": 8, "layer": "penultimate", "pooled": True},
                             {"path": str(t5), "max_length": 6, "layer": "last", "pooled": False}])


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 16 texts: 41 texts make 3 chunks (16, 16, 9)."""
    monkeypatch.setattr(cache, "CHUNK_BYTES", 1)


def made(entries, tmp_path, name, world=1, dtype="float32", skip=()):
    work, out = tmp_path / f"{name}.work", tmp_path / name
    out.mkdir()
    for rank in range(world):
        if rank not in skip:
            cache.build(TEXTS, entries, work, rank, world, "cpu", dtype)
    cache.join(work, out, TEXTS, entries, dtype, "cpu")
    return out, work


def test_the_cache_holds_what_encoding_gives(entries, tmp_path):
    assert cache.chunk_rows(entries) == 16
    out, work = made(entries, tmp_path, "one")
    opened = cache.open(out)
    assert opened.states.shape == (41, 14, 24) and opened.mask.shape == (41, 14) and opened.pooled.shape == (41, 16)
    assert opened.mask.dtype == np.uint8 and opened.records == entries and len(opened) == 41
    want = encoders.encode([encoders.load(e, "cpu") for e in entries], TEXTS, "cpu")
    ids = np.array([5, 0, 40, 5, 17])
    got = opened.take(ids, "cpu")
    assert torch.equal(got.states, want.states[ids]) and torch.equal(got.pooled, want.pooled[ids])
    assert torch.equal(got.mask, want.mask[ids]) and got.mask.dtype == torch.int64
    assert got.mask[1].tolist() == [1] * 8 + [1] + [0] * 5  # "": CLIP's 8 tokens, then T5's </s> alone
    cache.remove_work(work)
    assert not work.exists()
    for dtype, torch_dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        got = cache.open(made(entries, tmp_path, dtype, dtype=dtype)[0]).take(ids, "cpu")
        assert got.states.dtype == torch.float32
        assert torch.equal(got.states, want.states[ids].to(torch_dtype).float())
        assert torch.equal(got.pooled, want.pooled[ids].to(torch_dtype).float())


def test_two_processes_write_the_bytes_of_one(entries, tmp_path):
    one, _ = made(entries, tmp_path, "one")
    two, work = made(entries, tmp_path, "two", world=2)
    for name in NAMES:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    # Rank 1 of 2 wrote chunk 1 only; rank 0 chunks 0 and 2.
    work1 = tmp_path / "rank1"
    cache.build(TEXTS, entries, work1, 1, 2, "cpu", "float32")
    assert sorted(f.name for f in work1.iterdir()) == ["chunk_000001.safetensors"]
    with pytest.raises(UserError) as info:  # a rank's chunks missing at the join: one line
        cache.join(work1, tmp_path / "two", TEXTS, entries, "float32", "cpu")
    assert "chunk_000000.safetensors" in str(info.value) and "\n" not in str(info.value)


def test_a_killed_build_resumes_with_the_missing_chunks(entries, tmp_path, monkeypatch):
    one, _ = made(entries, tmp_path, "one")
    work = tmp_path / "killed.work"
    cache.build(TEXTS, entries, work, 0, 1, "cpu", "float32")
    (work / "chunk_000001.safetensors").unlink()
    whole = (work / "chunk_000002.safetensors").read_bytes()
    (work / "chunk_000002.safetensors").write_bytes(whole[:len(whole) // 2])  # cut short
    calls, encode = [], encoders.encode
    monkeypatch.setattr(encoders, "encode", lambda encs, prompts, device: calls.append(prompts) or
                        encode(encs, prompts, device))
    lines, handler = [], logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logs.get().addHandler(handler)
    level = logs.get().level
    logs.get().setLevel(logging.INFO)
    try:
        cache.build(TEXTS, entries, work, 0, 1, "cpu", "float32")
    finally:
        logs.get().removeHandler(handler)
        logs.get().setLevel(level)
    assert calls == [TEXTS[16:32], TEXTS[32:]]
    assert any("resumes: 1 of its 3 text chunks" in line for line in lines), lines
    # Other texts or another dtype: the chunks that differ are encoded anew, the others kept.
    calls.clear()
    changed = TEXTS[:20] + ["a photo of a blue square"] + TEXTS[21:]
    cache.build(changed, entries, work, 0, 1, "cpu", "float32")
    assert calls == [changed[16:32]]
    cache.build(TEXTS, entries, work, 0, 1, "cpu", "float32")
    out = tmp_path / "killed"
    out.mkdir()
    cache.join(work, out, TEXTS, entries, "float32", "cpu")
    for name in NAMES:
        assert (one / name).read_bytes() == (out / name).read_bytes(), name


def test_open_refuses_arrays_that_do_not_match_text_json(entries, tmp_path):
    assert cache.open(tmp_path) is None  # a dataset without a cache
    out, _ = made(entries, tmp_path, "one")
    states = (out / cache.STATES).read_bytes()
    (out / cache.STATES).write_bytes(states[:len(states) - 100])
    with pytest.raises(UserError) as info:
        cache.open(out)
    text = str(info.value)
    assert str(out / cache.STATES) in text and "rerun `diffrelay prepare" in text and "\n" not in text
    (out / cache.STATES).write_bytes(states)
    np.save(out / cache.MASK, np.zeros((41, 13), np.uint8))
    with pytest.raises(UserError) as info:
        cache.open(out)
    assert cache.MASK in str(info.value) and "(41, 14)" in str(info.value)
    (out / cache.INFO).write_text("{}")
    with pytest.raises(UserError) as info:
        cache.open(out)
    assert "not a diffrelay-text-cache/1 file" in str(info.value)


def test_size_of_a_cache():
    t5_xxl = {"class": "T5EncoderModel", "path": "t5", "sha256": "0", "max_length": None, "layer": "last",
              "pooled": False, "states_dim": 4096, "pooled_dim": None, "length": 256}
    per = cache.size_bytes(1, [t5_xxl], "float16")
    assert per == 256 * 4096 * 2 + 256 and 2.0e6 < per < 2.2e6  # about 2 MB a caption, as the docstring says
    assert cache.size_bytes(1000, [t5_xxl], "float32") == 1000 * (256 * 4096 * 4 + 256)


# ---------------------------------------------------------------------------------------------
# diffrelay prepare: the cache beside the images, on every rank


def text_config(tmp_path, entries, **data):
    import yaml

    d = {"run": {"name": "txt", "seed": 0, "device": "cpu", "results": str(tmp_path / "results"),
                 "resources": str(tmp_path / "resources")},
         "data": {"kind": "shapes", "resolution": 16, "count": 40, "seed": 0, "captions": "auto", "labels": "none",
                  "val_fraction": 0.1, "workers": 1, "text_encoders": [{k: e[k] for k in ("path", "max_length", "layer", "pooled")}
                                                         for e in entries]} | data,
         "model": {"arch": "pixart", "class_conditional": False},
         "train": {"total_steps": 6, "segment_steps": 3, "batch_size": 8},
         "sample": {"num_images": 8, "steps": 3, "batch_size": 8}, "fid": {"extractor": "random"}}
    path = tmp_path / f"config{len(list(tmp_path.glob('config*')))}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def plan_of(cfg):
    from diffrelay import config
    from diffrelay.data import datasets, prepare

    data = config.load([str(cfg)]).data
    return datasets.plan(data), prepare.with_text(datasets.plan(data), data)


@pytest.fixture(scope="module")
def prepared_once(entries, tmp_path_factory):
    """One `diffrelay prepare` of text_config on one rank: (its config, the dataset folder) for the tests below."""
    from conftest import run_cli

    root = tmp_path_factory.mktemp("prepared")
    cfg = text_config(root, entries)
    run_cli("prepare", "--config", cfg, "--out", root / "one")
    return cfg, root / "one"


@pytest.mark.slow
def test_prepare_caches_every_caption_and_rerunning_does_nothing(entries, prepared_once, tmp_path):
    import json
    import shutil

    from conftest import run_cli
    from diffrelay.data import prepare

    cfg, one = prepared_once
    assert not (one.parent / ".one.text").exists()  # the work folder is gone
    shutil.copytree(one, tmp_path / "ds")  # a copy, damaged below
    texts = json.loads((tmp_path / "ds/captions.json").read_text())["texts"]
    opened = cache.open(tmp_path / "ds")
    assert texts[0] == "" and len(opened) == len(texts) and opened.records == entries
    want = encoders.encode([encoders.load(e, "cpu") for e in entries], texts, "cpu")
    got = opened.take(np.arange(len(texts)), "cpu")
    assert torch.equal(got.states, want.states) and torch.equal(got.pooled, want.pooled)
    # The records and the dtype join the fingerprint; without a cache (data.text_cache false) it is the
    # captioned pixels'.
    pixels, plan = plan_of(cfg)
    assert plan.text == tuple(entries) and plan.fingerprint != pixels.fingerprint
    assert plan_of(text_config(tmp_path, entries, text_dtype="float16"))[1].fingerprint != plan.fingerprint
    assert plan_of(text_config(tmp_path, entries, text_cache=False))[1] == pixels
    # A cache array cut short: the dataset is not current.
    assert prepare.is_current(tmp_path / "ds", plan)
    states = (tmp_path / "ds" / cache.STATES).read_bytes()
    (tmp_path / "ds" / cache.STATES).write_bytes(states[:-10])
    assert not prepare.is_current(tmp_path / "ds", plan)
    (tmp_path / "ds" / cache.STATES).write_bytes(states)
    p = run_cli("prepare", "--config", cfg, "--out", tmp_path / "ds")
    assert "up to date" in p.stderr


@pytest.mark.slow
def test_prepare_under_two_ranks_writes_the_bytes_of_one(prepared_once, tmp_path):
    from conftest import run_cli

    # (One chunk here, which rank 0 encodes: several chunks over ranks are tested above, in one process.)
    cfg, one = prepared_once
    run_cli("prepare", "--config", cfg, "--out", tmp_path / "two", "--relaunch",
            "diffrelay launch --standalone --nproc-per-node 2 -m diffrelay")
    files = sorted(f.relative_to(one) for f in one.rglob("*") if f.is_file())
    assert len(files) >= 12
    for f in files:
        assert (one / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f


def test_a_damaged_text_encoder_is_one_line_before_any_image_and_leaves_no_work_folder(entries, tmp_path,
                                                                                      monkeypatch, capsys):
    """Weights whose header cannot be read are refused when the config is read (validate, prepare's start); weights
    that read but do not fit the model fail its load in one line, before any image is decoded; either way the
    refused prepare removes the work folders it made, and keeps one an earlier (killed) prepare left."""
    import shutil

    from safetensors.torch import save_file

    from diffrelay import cli
    from diffrelay.data import datasets

    def refusal(*argv) -> str:
        assert cli.main([*map(str, argv)]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("diffrelay: error:")]
        assert "Traceback" not in err and len(lines) == 1, err
        return lines[0]

    monkeypatch.setattr(datasets, "build", lambda *a, **k: pytest.fail("an image was decoded before the encoders"))
    clip = shutil.copytree(entries[0]["path"], tmp_path / "clip")
    weights = clip / "model.safetensors"
    whole = weights.read_bytes()
    cfg = text_config(tmp_path, [entries[0] | {"path": str(clip)}, entries[1]])
    for name, damage in (("truncated", lambda: weights.write_bytes(whole[:-100])),
                         ("header", lambda: weights.write_bytes(whole[:8] + b"#" * 16 + whole[24:])),
                         ("empty", lambda: weights.write_bytes(b"")),
                         ("loop", lambda: (weights.unlink(), (clip / "loop").symlink_to(weights),
                                           weights.symlink_to(clip / "loop")))):
        damage()
        for argv in (["validate", "--config", cfg], ["prepare", "--config", cfg, "--out", tmp_path / "ds"]):
            line = refusal(*argv)
            assert f"{weights}: data.text_encoders: " in line and "restore the file" in line, (name, line)
    (clip / "loop").unlink()
    weights.unlink()
    # A whole file of other tensors: read by its header, refused by the model's load, before the images.
    save_file({"text_model.embeddings.position_embedding.weight": torch.zeros(3, 5)}, weights)
    earlier = tmp_path / ".kept.text"  # a killed prepare's work folder, for --out kept
    earlier.mkdir()
    (earlier / "chunk_000000.safetensors").write_bytes(b"partial")
    for out in (tmp_path / "ds", tmp_path / "kept"):
        line = refusal("prepare", "--config", cfg, "--out", out)
        assert f"{clip}: data.text_encoders: cannot load the CLIPTextModel" in line, line
    assert not (tmp_path / ".ds.text").exists() and not (tmp_path / ".ds").exists()
    assert (earlier / "chunk_000000.safetensors").read_bytes() == b"partial"
