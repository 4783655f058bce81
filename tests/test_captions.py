"""Captioned datasets: caption sources, bad caption input, fingerprints, the held-out split, shapes captions, pick()."""

import colorsys
import json
import os

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from diffrelay import config
from diffrelay.data import captions, datasets, encoding, shapes
from diffrelay.errors import UserError

TEXT_KEYS = ("captions", "caption_column", "file_column", "caption_dropout", "val_fraction", "val_path",
             "text_encoders", "text_cache", "text_dtype")


def data(**kw):
    """A validated `data` section with these keys; the caption keys are set after validation, which would otherwise
    ask for text encoders (a run's check, not the dataset's)."""
    plain = {k: v for k, v in kw.items() if k not in TEXT_KEYS}
    model = {"class_conditional": False} if kw.get("labels") == "none" else {}
    d = config.validate({"data": plain, "model": model})
    d["data"].update({k: v for k, v in kw.items() if k in TEXT_KEYS})
    return config.Config(d).data


def plan(**kw):
    return datasets.plan(data(**kw))


def png(path, colour=(200, 30, 30), size=(6, 6)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def folder(root, names, captions_of=None):
    """PNGs named `names` under root, each a different colour, with the sidecars of `captions_of` {name: text}."""
    for k, name in enumerate(names):
        png(root / name, (10 * k % 256, 200, 40))
    for name, text in (captions_of or {}).items():
        (root / name).write_bytes(text.encode() if isinstance(text, str) else text)
    return root


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------- sources

def test_sidecars_txt_then_caption_one_caption_a_line(tmp_path):
    root = folder(tmp_path / "imgs", ["a.png", "b.png", "c.png", "d/e.JPG.png"], {
        "a.txt": "\ufeff  a cat \r\n\n a small cat\n", "b.caption": "a dog", "c.txt": "from txt",
        "c.caption": "not read", "d/e.JPG.txt": "nested"})
    p = plan(kind="folder", path=str(root), captions="auto")
    assert [f[0] for f in p.files] == ["a.png", "b.png", "c.png", "d/e.JPG.png"]
    assert p.texts == ("", "a cat", "a small cat", "a dog", "from txt", "nested")
    assert p.caption_rows == ((1, 2), (3,), (4,), (5,)) and p.caption_source == "sidecars"


def test_metadata_jsonl_wins_and_takes_strings_and_lists(tmp_path):
    root = folder(tmp_path / "imgs", ["a.png", "sub/b.png"], {"a.txt": "ignored: metadata.jsonl wins"})
    (root / "metadata.jsonl").write_text('{"file_name": "a.png", "text": " one "}\n\n'
                                         '{"file_name": "./sub/b.png", "text": ["two", "one"], "extra": 1}\n')
    p = plan(kind="folder", path=str(root), captions="auto")
    assert p.texts == ("", "one", "two") and p.caption_rows == ((1,), (2, 1)) and p.caption_source == "metadata.jsonl"


def test_csv_table_with_own_columns_quotes_and_repeated_files(tmp_path, monkeypatch):
    root = folder(tmp_path / "imgs", ["a.png", "b.png"])
    (tmp_path / "caps.csv").write_text('image,caption\nb.png,"red, on\ntwo lines"\na.png,first\nb.png,second\n')
    monkeypatch.chdir(tmp_path)  # a relative table path is read from the current folder
    p = plan(kind="folder", path=str(root), captions="caps.csv", file_column="image", caption_column="caption")
    assert p.texts == ("", "first", "red, on\ntwo lines", "second") and p.caption_rows == ((1,), (2, 3))
    assert p.caption_source == str(tmp_path / "caps.csv")


def test_parquet_table_with_strings_and_lists(tmp_path):
    root = folder(tmp_path / "imgs", ["a.png", "b.png"])
    pd.DataFrame({"file_name": ["a.png", "b.png"], "text": [["x", "y"], ["z"]]}).to_parquet(tmp_path / "c.parquet")
    assert plan(kind="folder", path=str(root), captions=str(tmp_path / "c.parquet")).caption_rows == ((1, 2), (3,))
    pd.DataFrame({"file_name": ["b.png", "a.png"], "text": ["b", "a"]}).to_parquet(tmp_path / "d.parquet")
    p = plan(kind="folder", path=str(root), captions=str(tmp_path / "d.parquet"))
    assert p.texts == ("", "a", "b") and p.caption_rows == ((1,), (2,))


def test_jsonl_table_with_a_file_in_several_rows(tmp_path):
    root = folder(tmp_path / "imgs", ["a.png", "b.png"])
    rows = [{"file_name": "a.png", "text": "x"}, {"file_name": "b.png", "text": "x"},
            {"file_name": "a.png", "text": "y"}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = plan(kind="folder", path=str(root), captions=str(tmp_path / "t.jsonl"))
    assert p.texts == ("", "x", "y") and p.caption_rows == ((1, 2), (1,))


# ---------------------------------------------------------------- bad input: one line, the file and the row

def _table(tmp_path, name, text):
    (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(tmp_path / name)


BAD = {  # case: (sidecars/metadata of a folder of a.png and b.png, or a table; what the one line must name)
    "no caption": ({"a.txt": "x"}, None, ["b.png", "b.txt", "b.caption", "no caption"]),
    "empty sidecar": ({"a.txt": "x", "b.caption": " \n\t\n"}, None, ["b.caption", "line 1", "empty caption"]),
    "not utf-8 sidecar": ({"a.txt": "x", "b.txt": b"ok\n\xffno"}, None, ["b.txt", "line 2", "byte offset 3", "UTF-8"]),
    "metadata misses an image": ({"metadata.jsonl": '{"file_name": "a.png", "text": "x"}\n'}, None,
                                 ["b.png", "metadata.jsonl", "no caption"]),
    "metadata not json": ({"metadata.jsonl": '{"file_name": "a.png", "text": "x"}\n{"file_name": "b.png",\n'}, None,
                          ["metadata.jsonl", "line 2", "not valid JSON"]),
    "metadata empty caption in a list": ({"metadata.jsonl": '{"file_name": "a.png", "text": ["x", "  "]}\n'}, None,
                                         ["metadata.jsonl", "line 1", "empty caption"]),
    "csv empty caption": ({}, ("t.csv", "file_name,text\na.png,x\nb.png,   \n"), ["t.csv", "line 3", "empty caption"]),
    "csv not utf-8": ({}, ("t.csv", b"file_name,text\na.png,caf\xe9\n"), ["t.csv", "line 2", "byte offset 24"]),
    "csv no caption column": ({}, ("t.csv", "file_name,caption\na.png,x\n"),
                              ["t.csv", "line 2", "no column 'text'", "file_name, caption", "data.caption_column"]),
    "csv no file column": ({}, ("t.csv", "image,text\na.png,x\n"), ["t.csv", "no column 'file_name'", "image, text"]),
    "csv unknown image": ({}, ("t.csv", "file_name,text\na.png,x\nb.png,y\nc.png,z\n"),
                          ["t.csv", "line 4", "'c.png' is not an image in"]),
    "csv unparsable": ({}, ("t.csv", 'file_name,text\na.png,x\nb.png,y,z\n'), ["t.csv", "line 3", "3 fields"]),
    "csv bad quote": ({}, ("t.csv", 'file_name,text\na.png,"x"y\n'), ["t.csv", "line 2", "not valid CSV"]),
    "jsonl unknown image": ({}, ("t.jsonl", '{"file_name": "a.png", "text": "x"}\n{"file_name": "zz.png", '
                                            '"text": "y"}'), ["t.jsonl", "line 2", "zz.png"]),
    "jsonl no caption column": ({}, ("t.jsonl", '{"file_name": "a.png", "caption": "x"}\n'),
                                ["t.jsonl", "line 1", "no column 'text'", "file_name, caption"]),
    "jsonl not an object": ({}, ("t.jsonl", '["a.png", "x"]\n'), ["t.jsonl", "line 1", "not a JSON object"]),
    "jsonl caption not text": ({}, ("t.jsonl", '{"file_name": "a.png", "text": 3}\n'),
                               ["t.jsonl", "line 1", "not text"]),
    "parquet unreadable": ({}, ("t.parquet", b"PAR1 not really"), ["t.parquet", "Parquet"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_caption_input_is_one_line_naming_file_and_row(tmp_path, case):
    sidecars, table, needles = BAD[case]
    root = folder(tmp_path / "imgs", ["a.png", "b.png"], sidecars)
    source = _table(tmp_path, *table) if table else "auto"
    with pytest.raises(UserError) as e:
        plan(kind="folder", path=str(root), captions=source)
    msg = one_line(e)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_captions_are_read_before_any_image_is_decoded(tmp_path):
    root = tmp_path / "imgs"
    root.mkdir()
    (root / "broken.png").write_bytes(b"not a png")  # decoding it would fail; the missing caption is found first
    with pytest.raises(UserError, match="broken.txt or broken.caption"):
        plan(kind="folder", path=str(root), captions="auto")
    (root / "broken.txt").write_text("fine")
    p = plan(kind="folder", path=str(root), captions="auto", on_corrupt="skip")
    assert p.texts == ("", "fine")


def test_skipped_images_take_their_captions_with_them(tmp_path):
    root = folder(tmp_path / "imgs", ["a.png", "c.png"], {"a.txt": "a", "b.txt": "b", "c.txt": "c"})
    (root / "b.png").write_bytes(b"not a png")  # hashed, then fails to decode: skipped while building
    info = datasets.build(plan(kind="folder", path=str(root), captions="auto", on_corrupt="skip"), tmp_path / "ds")
    ds = datasets.open_prepared(tmp_path / "ds")
    assert info["skipped"] == ["b.png"] and [ds.captions.of(r) for r in range(2)] == [["a"], ["c"]]


# ---------------------------------------------------------------- fingerprints

def test_fingerprint_follows_caption_text_not_mtimes(tmp_path):
    root = folder(tmp_path / "imgs", ["a.png", "b.png"], {"a.txt": "x", "b.txt": "y"})
    base = plan(kind="folder", path=str(root), captions="auto").fingerprint
    os.utime(root / "a.txt", (1e9, 1e9))
    assert plan(kind="folder", path=str(root), captions="auto").fingerprint == base
    (root / "a.txt").write_text("x edited")
    edited = plan(kind="folder", path=str(root), captions="auto").fingerprint
    assert edited != base
    assert plan(kind="folder", path=str(root), captions="auto", val_fraction=0.5).fingerprint != edited
    assert plan(kind="folder", path=str(root)).fingerprint not in (base, edited)


def test_captions_none_keeps_every_fingerprint(tmp_path):
    # Pinned before captions existed: datasets.plan of this shapes config.
    assert plan(kind="shapes", count=50, seed=2).fingerprint == \
        "5794356575b97187a3b5964e028cb098b464d1de7985663d28cf48d3b19af051"
    root = folder(tmp_path / "imgs", ["a/x.png", "b/y.png"], {"a/x.txt": "x", "b/y.txt": "y"})
    p = plan(kind="folder", path=str(root))
    files = datasets.hash_files(root)
    # The digest of the folder formula that predates captions: no caption key in it.
    assert p.fingerprint == datasets._digest({"format": "folder/1", "resolution": 32, "labels": "auto",
                                              "files": [list(f) for f in files]})
    assert p.texts == p.caption_rows == p.val_files == p.text == () and p.files == files
    info = datasets.build(p, tmp_path / "ds")
    assert "captions" not in info and not (tmp_path / "ds" / captions.FILE).exists()
    assert datasets.open_prepared(tmp_path / "ds").captions is None and datasets.open_val(tmp_path / "ds") is None


# ---------------------------------------------------------------- held-out split

def test_val_fraction_split_is_seeded_disjoint_and_built_apart(tmp_path):
    names = [f"{c}/{i}.png" for c in "ab" for i in range(6)]
    root = folder(tmp_path / "imgs", names, {n.replace(".png", ".txt"): f"image {n}" for n in names})
    p = plan(kind="folder", path=str(root), captions="auto", val_fraction=0.25, seed=7)
    assert p == plan(kind="folder", path=str(root), captions="auto", val_fraction=0.25, seed=7)
    train, held = [f[0] for f in p.files], [f[0] for f in p.val_files]
    assert len(held) == 3 and sorted(train + held) == sorted(names) and not set(train) & set(held)
    other = plan(kind="folder", path=str(root), captions="auto", val_fraction=0.25, seed=8)
    assert [f[0] for f in other.val_files] != held
    assert [p.val_texts[r[0]] for r in p.val_caption_rows] == [f"image {n}" for n in held]
    info = datasets.build(p, tmp_path / "ds", workers=2)
    assert info["count"] == 9 and info["captions"] == {"source": "sidecars", "texts": 10, "rows": 9, "val": 3}
    ds, val = datasets.open_prepared(tmp_path / "ds"), datasets.open_val(tmp_path / "ds")
    assert [ds.captions.of(r) for r in range(ds.count)] == [[f"image {n}"] for n in train]
    assert val.count == 3 and val.images.dtype == np.uint8 and val.images.shape == (3, 32, 32, 3)
    assert [val.captions.of(r) for r in range(3)] == [[f"image {n}"] for n in held]
    assert val.labels.tolist() == [ds.class_names.index(n[0]) for n in held] and ds.class_names == ("a", "b")
    colours = {tuple(ds.images[r, 0, 0]) for r in range(ds.count)}
    assert not colours & {tuple(val.images[r, 0, 0]) for r in range(3)}  # each file its own colour
    assert datasets.is_current(tmp_path / "ds", p)


def test_held_out_rule(tmp_path):
    names = [f"{i}.png" for i in range(40)]
    held = captions.held_out(names, 0.1, 0, "data.path")
    assert len(held) == 4 and held == captions.held_out(list(names), 0.1, 0, "data.path")
    # Names and the seed decide, not the listing: one more image moves at most one held-out image.
    more = captions.held_out(names + ["40.png"], 0.1, 0, "data.path")
    assert len(set(names[i] for i in held) - set((names + ["40.png"])[i] for i in more)) <= 1
    assert len(captions.held_out(names[:3], 0.01, 0, "k")) == 1 and len(captions.held_out(names[:2], 0.5, 0, "k")) == 1
    with pytest.raises(UserError, match="at least 2 images"):
        captions.held_out(names[:1], 0.2, 0, "data.path")


def test_val_path_is_a_separate_folder_with_the_training_classes(tmp_path):
    root = folder(tmp_path / "imgs", ["a/x.png", "b/y.png"], {"a/x.txt": "x", "b/y.txt": "y"})
    val = folder(tmp_path / "val", ["b/v.png", "a/w.png"], {"b/v.caption": "v", "a/w.txt": "w\nw2"})
    p = plan(kind="folder", path=str(root), captions="auto", val_path=str(val))
    assert [f[0] for f in p.files] == ["a/x.png", "b/y.png"] and [f[0] for f in p.val_files] == ["a/w.png", "b/v.png"]
    datasets.build(p, tmp_path / "ds")
    v = datasets.open_val(tmp_path / "ds")
    assert v.labels.tolist() == [0, 1] and v.captions.of(0) == ["w", "w2"] and v.captions.of(1) == ["v"]
    (val / "b" / "v.caption").write_text("v edited")
    assert plan(kind="folder", path=str(root), captions="auto", val_path=str(val)).fingerprint != p.fingerprint
    png(val / "c" / "z.png")
    (val / "c" / "z.txt").write_text("z")
    with pytest.raises(UserError) as e:
        plan(kind="folder", path=str(root), captions="auto", val_path=str(val))
    assert "z.png" in one_line(e) and "data.val_path" in str(e.value)
    with pytest.raises(UserError, match="overlaps data.path"):
        plan(kind="folder", path=str(root), captions="auto", val_path=str(root / "a"))
    with pytest.raises(UserError, match="data.val_path: folder not found"):
        plan(kind="folder", path=str(root), captions="auto", val_path=str(tmp_path / "nope"))


def test_holding_out_a_whole_class_is_refused(tmp_path):
    root = folder(tmp_path / "imgs", ["a/x.png", "a/y.png", "a/z.png", "b/only.png"],
                  {n: "c" for n in ("a/x.txt", "a/y.txt", "a/z.txt", "b/only.txt")})
    seed = next(s for s in range(200) if captions.held_out(["a/x.png", "a/y.png", "a/z.png", "b/only.png"], 0.25, s,
                                                         "k") == [3])
    with pytest.raises(UserError) as e:
        plan(kind="folder", path=str(root), captions="auto", val_fraction=0.25, seed=seed)
    assert "b/only.png" in one_line(e) and "class 'b'" in str(e.value)


def test_shapes_split_and_latent_plan_round_trip(tmp_path):
    p = plan(kind="shapes", count=20, seed=3, captions="auto", val_fraction=0.2)
    held = [f[0] for f in p.val_files]
    assert p.total == 16 and len(held) == 4 and not set(held) & {f[0] for f in p.files}
    assert len(p.caption_rows) == 16 and all(len(r) == 2 for r in p.caption_rows + p.val_caption_rows)
    # encoding.read_plan rebuilds the plan from JSON for the other ranks; the captions survive it.
    latent = dict(p.__dict__, latent={"encoder": "x", "channels": 4, "factor": 8})
    encoding.write_plan(tmp_path / "work", datasets.Plan(**latent), "cpu")
    assert encoding.read_plan(tmp_path / "work") == datasets.Plan(**latent)
    rows = list(datasets.source_rows(p, 1))
    assert [label for _, label, _ in rows] == [f[0] % 3 for f in p.files]
    datasets.build(p, tmp_path / "ds")
    val = datasets.open_val(tmp_path / "ds")
    assert np.array_equal(val.images[1], shapes.draw_shape(3, held[1], held[1] % 3, 32))
    assert val.captions.of(1) == shapes.captions(3, held[1], 32) and val.labels.tolist() == [i % 3 for i in held]


# ---------------------------------------------------------------- shapes captions

THIRDS = (("top left", "top", "top right"), ("left", "center", "right"), ("bottom left", "bottom", "bottom right"))


def test_shapes_captions_say_colour_shape_and_place_of_the_pixels():
    bounds = [0] + [b for b, _ in shapes.HUES]
    seen = set()
    for i in range(30):
        first, second = shapes.captions(5, i, 32)
        words = first.split(" ")
        colour, shape, where = words[1], words[2], " ".join(words[3:])
        assert first.startswith("a ") and second == f"{colour} {shape}, {where}" and shape == shapes.SHAPE_NAMES[i % 3]
        img = shapes.draw_shape(5, i, i % 3, 32)
        ys, xs = np.nonzero(img.max(-1) > 150)  # the bright shape on its dark background
        x, y = (xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2  # the middle of its bounding box
        # Its third of the frame, row then column; one pixel of slack at the lines between thirds.
        rows, cols = ({min(2, max(0, int(3 * (v + d) / 32))) for d in (-1, 0, 1)} for v in (y, x))
        assert where in {THIRDS[r][c] for r in rows for c in cols}, (i, first, x, y)
        hue = colorsys.rgb_to_hsv(*(img[int(y), int(x)] / 255.0))[0] * 360
        ok = [name for lo, (hi, name) in zip(bounds, shapes.HUES) if lo - 3 <= hue < hi + 3]
        assert colour in ok, (i, first, hue)
        seen.add(where)
    assert len(seen) >= 5


# ---------------------------------------------------------------- pick and captions.json

def test_pick_takes_floor_u_times_count_of_the_row(tmp_path):
    rows = [[3], [1, 2], [4, 5, 6], []]
    (tmp_path / "captions.json").write_text(json.dumps({"texts": ["", "a", "b", "c", "d", "e", "f"], "rows": rows}))
    c = captions.open_file(tmp_path / "captions.json", 4)
    assert c.starts.tolist() == [0, 1, 3, 6, 6] and c.ids.tolist() == [3, 1, 2, 4, 5, 6]
    r = np.array([0, 1, 1, 2, 2, 2, 2, 3])
    u = np.array([0.99, 0.49, 0.5, 0.0, 0.34, 0.67, np.nextafter(1.0, 0.0), 0.5])
    assert c.pick(r, u).tolist() == [3, 1, 2, 4, 5, 6, 6, 0]
    assert c.of(2) == ["d", "e", "f"]


@pytest.mark.parametrize("bad", [{"texts": ["a"], "rows": [[0]] * 3}, {"texts": ["", "a"], "rows": [[1]] * 2},
                                 {"texts": ["", "a"], "rows": [[2]] * 3}, {"texts": ["", "a"], "rows": [["1"]] * 3}])
def test_captions_json_must_match_the_dataset(tmp_path, bad):
    (tmp_path / "captions.json").write_text(json.dumps(bad))
    with pytest.raises(UserError) as e:
        captions.open_file(tmp_path / "captions.json", 3)
    assert "captions.json" in one_line(e) and "rerun `diffrelay prepare" in str(e.value)


def test_open_prepared_checks_captions_against_the_rows(tmp_path):
    datasets.build(plan(kind="shapes", count=6, captions="auto"), tmp_path / "ds")
    ds = datasets.open_prepared(tmp_path / "ds")
    assert ds.captions.texts[0] == "" and len(ds.captions.starts) == 7 and datasets.open_val(tmp_path / "ds") is None
    d = json.loads((tmp_path / "ds" / "captions.json").read_text())
    (tmp_path / "ds" / "captions.json").write_text(json.dumps(d | {"rows": d["rows"][:5]}))
    with pytest.raises(UserError, match="6 rows"):
        datasets.open_prepared(tmp_path / "ds")


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("section, key", [
    ({"kind": "shapes", "captions": "t.csv"}, "data.captions=t.csv"),
    ({"kind": "folder", "captions": "t.tsv"}, "data.captions=t.tsv"),
    ({"captions": "none", "val_fraction": 0.1}, "data.val_fraction"),
    ({"captions": "none", "val_path": "v"}, "data.val_path"),
    ({"captions": "none", "caption_dropout": 0.1}, "data.caption_dropout"),
    ({"captions": "none", "text_encoders": [{"path": "x"}]}, "data.text_encoders"),
    ({"kind": "folder", "captions": "auto", "val_fraction": 0.1, "val_path": "v"}, "data.val_fraction=0.1"),
])
def test_config_problems(section, key):
    assert [k for k, _ in captions.config_problems(section)] == [key]


def test_config_problems_accepts_sound_settings():
    for ok in ({"kind": "shapes", "captions": "auto", "val_fraction": 0.1}, {"kind": "folder", "captions": "a.PARQUET"},
               {"kind": "folder", "captions": "none"}, {"kind": "folder", "captions": "auto", "val_path": "v"}):
        assert captions.config_problems(ok) == []
