"""Datasets: shapes determinism and looks, folder loading of odd images, fingerprints, `diffrelay prepare`."""

import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from diffrelay import config, io
from diffrelay.data import datasets
from diffrelay.errors import UserError


def build(write_config, tmp_path, data: dict, out="ds", **overrides) -> tuple[dict, object]:
    """plan + build a dataset from a tiny config with these `data` overrides; returns (info, out folder)."""
    model = {"class_conditional": False} if data.get("labels") == "none" else {}
    cfg = config.load(write_config({"data": data, "model": model, **overrides}))
    folder = tmp_path / out
    folder.mkdir()
    return datasets.build(datasets.plan(cfg.data), folder), folder


def plan_of(write_config, data: dict):
    return datasets.plan(config.load(write_config({"data": data})).data)


def save(path, img: Image.Image, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kw)
    return path


def solid(size, colour=(200, 30, 30)):
    return Image.new("RGB", size, colour)


# ---------------------------------------------------------------- shapes

def test_same_seed_gives_identical_bytes_and_other_seed_differs(write_config, tmp_path):
    _, a = build(write_config, tmp_path, {"count": 12, "seed": 3}, out="a")
    _, b = build(write_config, tmp_path, {"count": 12, "seed": 3}, out="b")
    _, c = build(write_config, tmp_path, {"count": 12, "seed": 4}, out="c")
    assert (a / "images.npy").read_bytes() == (b / "images.npy").read_bytes()
    assert (a / "images.npy").read_bytes() != (c / "images.npy").read_bytes()
    assert json.loads((a / "dataset.json").read_text())["fingerprint"] != json.loads(
        (c / "dataset.json").read_text())["fingerprint"]


def test_shapes_image_does_not_depend_on_count(write_config, tmp_path):
    _, small = build(write_config, tmp_path, {"count": 5}, out="small")
    _, large = build(write_config, tmp_path, {"count": 9}, out="large")
    assert np.array_equal(np.load(small / "images.npy"), np.load(large / "images.npy")[:5])


def test_shapes_classes_are_balanced_and_named(write_config, tmp_path):
    info, folder = build(write_config, tmp_path, {"count": 30})
    labels = np.load(folder / "labels.npy")
    assert labels.dtype == np.int64 and labels.shape == (30,)
    assert np.bincount(labels).tolist() == [10, 10, 10]
    assert info["num_classes"] == 3 and info["class_names"] == ["circle", "square", "triangle"]
    images = np.load(folder / "images.npy")
    assert images.dtype == np.uint8 and images.shape == (30, 16, 16, 3)
    assert np.array_equal(images[7], datasets.draw_shape(0, 7, 7 % 3, 16))


def test_shapes_without_labels_are_all_class_zero(write_config, tmp_path):
    info, folder = build(write_config, tmp_path, {"count": 6, "labels": "none"})
    assert np.load(folder / "labels.npy").tolist() == [0] * 6
    assert info["num_classes"] == 0 and info["class_names"] == []


def test_shapes_are_large_inside_the_frame_and_contrasting():
    res, checked = 32, 0
    for i in range(60):
        img = datasets.draw_shape(0, i, i % 3, res).astype(int)
        corners = img[[0, 0, -1, -1], [0, -1, 0, -1]]
        if (corners != corners[0]).any():
            continue  # gradient background: no single background colour to compare with
        checked += 1
        shape = np.abs(img - corners[0]).max(axis=2) > 60
        rows, cols = np.flatnonzero(shape.any(axis=1)), np.flatnonzero(shape.any(axis=0))
        inside = rows[0] > 0 and cols[0] > 0 and rows[-1] < res - 1 and cols[-1] < res - 1
        assert inside, f"image {i} touches the border"
        side = max(rows[-1] - rows[0], cols[-1] - cols[0]) + 1
        assert 0.3 * res <= side <= 0.8 * res, f"image {i}: shape side {side}px"
        assert np.abs(img[shape] - corners[0]).max(axis=1).mean() > 100, f"image {i}: low contrast"
    assert checked >= 15


def test_shapes_edges_are_anti_aliased():
    img = datasets.draw_shape(0, 0, 0, 32)  # a circle: its edge must have in-between values
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 10


# ---------------------------------------------------------------- folders

def test_odd_modes_and_sizes_become_rgb_squares(write_config, tmp_path):
    src = tmp_path / "imgs"
    save(src / "a_grey.png", Image.new("L", (40, 25), 90))
    rgba = Image.new("RGBA", (30, 30), (255, 0, 0, 0))  # fully transparent red -> white
    save(src / "b_rgba.png", rgba)
    pal = solid((20, 50), (10, 200, 10)).convert("P", palette=Image.Palette.ADAPTIVE)
    save(src / "c_pal.png", pal)
    save(src / "d_16bit.png", Image.fromarray(np.full((20, 20), 128 * 257, np.uint16)))
    save(src / "e_cmyk.JPG", Image.new("CMYK", (24, 18), (0, 0, 0, 0)), quality=95)
    save(src / "f_tiny.webp", solid((5, 7)), lossless=True)
    save(src / "g_la.png", Image.new("LA", (9, 9), (0, 0)))
    info, folder = build(write_config, tmp_path, {"kind": "folder", "path": str(src)})
    images = np.load(folder / "images.npy")
    assert info["count"] == 7 and images.shape == (7, 16, 16, 3) and images.dtype == np.uint8
    grey, rgba_px, pal_px, deep, cmyk, webp, la = (images[i].astype(int) for i in range(7))
    assert (grey == 90).all()
    assert (rgba_px == 255).all() and (la == 255).all()
    assert (abs(pal_px - [10, 200, 10]) <= 2).all()
    assert (deep == 128).all()  # 16-bit mid-grey stays mid-grey instead of being clipped to white
    assert (cmyk >= 250).all()  # CMYK (0,0,0,0) is paper white
    assert (abs(webp - [200, 30, 30]) <= 1).all()
    assert info["num_classes"] == 0 and np.load(folder / "labels.npy").tolist() == [0] * 7


def test_wide_image_is_centre_cropped(write_config, tmp_path):
    a = np.zeros((20, 40, 3), np.uint8)
    a[:, :10] = (255, 0, 0)
    a[:, 10:30] = (0, 255, 0)
    a[:, 30:] = (0, 0, 255)
    save(tmp_path / "imgs" / "wide.png", Image.fromarray(a))
    tall = np.ascontiguousarray(a.transpose(1, 0, 2))
    save(tmp_path / "imgs" / "tall.png", Image.fromarray(tall))
    _, folder = build(write_config, tmp_path, {"kind": "folder", "path": str(tmp_path / "imgs")})
    for img in np.load(folder / "images.npy"):
        assert (abs(img.astype(int) - [0, 255, 0]) <= 1).all()


def test_corrupt_image_is_named_in_the_error(write_config, tmp_path):
    save(tmp_path / "imgs" / "ok.png", solid((8, 8)))
    (tmp_path / "imgs" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(UserError, match=r"broken\.png: corrupt.*on_corrupt: skip"):
        build(write_config, tmp_path, {"kind": "folder", "path": str(tmp_path / "imgs")})


def test_truncated_jpeg_is_refused(write_config, tmp_path):
    good = save(tmp_path / "x.jpg", solid((64, 64)))
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "cut.jpg").write_bytes(good.read_bytes()[:200])
    with pytest.raises(UserError, match=r"cut\.jpg"):
        build(write_config, tmp_path, {"kind": "folder", "path": str(tmp_path / "imgs")})


def test_skip_mode_counts_and_lists_bad_files(write_config, tmp_path, caplog):
    src = tmp_path / "imgs"
    save(src / "a.png", solid((8, 8)))
    (src / "b.jpg").write_bytes(b"garbage")
    os.symlink(src / "nowhere.png", src / "c.png")
    save(src / "d.png", solid((8, 8), (0, 0, 255)))
    info, folder = build(write_config, tmp_path, {"kind": "folder", "path": str(src), "on_corrupt": "skip"})
    assert info["count"] == 2 and info["skipped"] == ["b.jpg", "c.png"]
    assert np.load(folder / "images.npy").shape[0] == 2
    assert json.loads((folder / "dataset.json").read_text())["skipped"] == ["b.jpg", "c.png"]
    assert any("skipped 2 unreadable" in r.getMessage() for r in caplog.records)


def test_all_files_skipped_is_an_error(write_config, tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "bad.png").write_bytes(b"nope")
    with pytest.raises(UserError, match="none of the 1 images could be read"):
        build(write_config, tmp_path, {"kind": "folder", "path": str(tmp_path / "imgs"), "on_corrupt": "skip"})


def test_dangling_symlink_is_named_in_the_error(write_config, tmp_path):
    (tmp_path / "imgs").mkdir()
    os.symlink(tmp_path / "gone.png", tmp_path / "imgs" / "ghost.png")
    with pytest.raises(UserError, match=r"ghost\.png: cannot open image file \(dangling symlink\)"):
        plan_of(write_config, {"kind": "folder", "path": str(tmp_path / "imgs")})


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "no images found"),
    (lambda p: None, "folder not found"),
    (lambda p: p.write_text("x"), "is a file, not a folder"),
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("x"), (p / ".hidden.png").write_text("x")), "no images found"),
])
def test_unusable_data_path_is_refused(write_config, tmp_path, make, message):
    make(tmp_path / "imgs")
    with pytest.raises(UserError, match=message) as e:
        plan_of(write_config, {"kind": "folder", "path": str(tmp_path / "imgs")})
    assert "imgs" in str(e.value) and "data.path" in str(e.value)


def test_first_level_subfolders_become_classes(write_config, tmp_path):
    src = tmp_path / "imgs"
    save(src / "dogs" / "x.png", solid((8, 8)))
    save(src / "cats" / "deep" / "nested" / "y.png", solid((8, 8)))
    save(src / "cats" / "z.PNG", solid((8, 8)))
    info, folder = build(write_config, tmp_path, {"kind": "folder", "path": str(src)})
    assert info["class_names"] == ["cats", "dogs"] and info["num_classes"] == 2
    # Sorted by relative path: cats/deep/nested/y.png, cats/z.PNG, dogs/x.png.
    assert np.load(folder / "labels.npy").tolist() == [0, 0, 1]


@pytest.mark.parametrize("layout", [["a/x.png", "top.png"], ["only/x.png", "only/y.png"], ["x.png", "y.png"]])
def test_folder_without_a_clear_class_layout_is_unlabelled(layout):
    labels, names = datasets.folder_labels(layout)
    assert labels == [0] * len(layout) and names == []


def test_labels_none_ignores_subfolders(write_config, tmp_path):
    save(tmp_path / "imgs" / "a" / "x.png", solid((8, 8)))
    save(tmp_path / "imgs" / "b" / "y.png", solid((8, 8)))
    info, _ = build(write_config, tmp_path, {"kind": "folder", "path": str(tmp_path / "imgs"), "labels": "none"})
    assert info["num_classes"] == 0 and info["class_names"] == []


def test_fingerprint_survives_copy_and_touch_but_not_a_changed_byte(write_config, tmp_path):
    src = tmp_path / "imgs"
    save(src / "a" / "x.png", solid((8, 8)))
    save(src / "b" / "y.png", solid((9, 9), (1, 2, 3)))
    before = plan_of(write_config, {"kind": "folder", "path": str(src)}).fingerprint
    copy = shutil.copytree(src, tmp_path / "elsewhere" / "copy")
    for f in copy.rglob("*.png"):
        os.utime(f, (1e9, 1e9))
    assert plan_of(write_config, {"kind": "folder", "path": str(copy)}).fingerprint == before
    save(copy / "b" / "y.png", solid((9, 9), (1, 2, 4)))
    assert plan_of(write_config, {"kind": "folder", "path": str(copy)}).fingerprint != before
    assert plan_of(write_config, {"kind": "folder", "path": str(src), "resolution": 32}).fingerprint != before


def test_shapes_fingerprint_follows_its_inputs(write_config):
    base = plan_of(write_config, {"seed": 1}).fingerprint
    assert plan_of(write_config, {"seed": 1}).fingerprint == base
    assert len(base) == 64 and int(base, 16) >= 0
    for change in ({"seed": 2}, {"seed": 1, "count": 97}, {"seed": 1, "resolution": 32}):
        assert plan_of(write_config, change).fingerprint != base


# ---------------------------------------------------------------- prepare CLI and open_prepared

def test_prepare_cli_builds_once_then_is_up_to_date(write_config, tmp_path):
    cfg = write_config({"data": {"count": 9}})
    first = run_cli("prepare", "--config", cfg)
    out = tmp_path / "results" / "tiny" / "dataset"
    assert "wrote 9 images" in first.stderr
    assert sorted(p.name for p in out.iterdir()) == ["dataset.json", "images.npy", "labels.npy"]  # no PNG copies
    stamp = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    second = run_cli("prepare", "--config", cfg)
    assert "up to date" in second.stderr
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == stamp
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folders left behind
    # Another dataset under the same run name is refused (the run folder records what it was made from);
    # a new run name builds it.
    refused = run_cli("prepare", "--config", write_config({"data": {"count": 12}}), check=False)
    assert refused.returncode == 2 and "data.count=12" in refused.stderr and "new run.name" in refused.stderr
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == stamp
    run_cli("prepare", "--config", write_config({"run": {"name": "other"}, "data": {"count": 12}}))
    assert datasets.open_prepared(out.parent.parent / "other" / "dataset").count == 12


def test_prepare_cli_writes_to_out(write_config, tmp_path):
    p = run_cli("prepare", "--config", write_config({"data": {"count": 4}}), "--out", tmp_path / "mine",
                "--workers", "2")
    assert p.returncode == 0
    assert re.search(r"prepare: 4/4 images \| \d+ img/s \| decoded in \d+s", p.stderr)
    ds = datasets.open_prepared(tmp_path / "mine")
    assert ds.count == 4 and ds.images.shape == (4, 16, 16, 3) and ds.num_classes == 3
    assert ds.class_names == ("circle", "square", "triangle") and ds.resolution == 16
    assert isinstance(ds.images, np.memmap) and ds.labels.dtype == np.int64


def test_skipped_build_is_not_current_for_an_error_config(write_config, tmp_path):
    save(tmp_path / "imgs" / "a.png", solid((8, 8)))
    (tmp_path / "imgs" / "b.png").write_bytes(b"bad")
    data = {"kind": "folder", "path": str(tmp_path / "imgs")}
    _, folder = build(write_config, tmp_path, {**data, "on_corrupt": "skip"})
    assert datasets.is_current(folder, plan_of(write_config, {**data, "on_corrupt": "skip"}))
    assert not datasets.is_current(folder, plan_of(write_config, data))


def test_open_prepared_on_missing_folder_says_run_prepare(tmp_path):
    with pytest.raises(UserError, match=r"nothing_here: no prepared dataset \(dataset.json missing\); "
                                        r"run `diffrelay prepare --config"):
        datasets.open_prepared(tmp_path / "nothing_here")


def test_open_prepared_refuses_arrays_that_disagree_with_dataset_json(write_config, tmp_path):
    _, folder = build(write_config, tmp_path, {"count": 6})
    np.save(folder / "images.npy", np.zeros((5, 16, 16, 3), np.uint8))
    with pytest.raises(UserError, match=r"images\.npy: shape \(5, 16, 16, 3\).*does not match dataset.json"):
        datasets.open_prepared(folder)
    (folder / "images.npy").unlink()
    with pytest.raises(UserError, match="images.npy or labels.npy missing"):
        datasets.open_prepared(folder)
    (folder / "dataset.json").write_text('{"format": "diffrelay-dataset/1", "count": 6}')
    with pytest.raises(UserError, match=r"dataset\.json: incomplete"):
        datasets.open_prepared(folder)
    assert not datasets.is_current(folder, plan_of(write_config, {"count": 6}))


# ---------------------------------------------------------------- parallel decoding

def odd_folder(root):
    """Two classes, sizes and formats that need cropping and resizing, and one unreadable file."""
    rng = np.random.default_rng(0)
    for i in range(7):
        a = rng.integers(0, 256, (20 + i, 30 - i, 3), dtype=np.uint8)
        save(root / ("cats" if i % 2 else "dogs") / f"{i}.png", Image.fromarray(a))
    save(root / "cats" / "q.jpg", Image.fromarray(rng.integers(0, 256, (40, 24, 3), dtype=np.uint8)), quality=90)
    (root / "dogs" / "broken.png").write_bytes(b"not an image")
    return root


@pytest.mark.parametrize("kind", ["shapes", "folder"])
def test_one_and_two_workers_write_identical_bytes(write_config, tmp_path, kind):
    data = {"count": 23}
    if kind == "folder":
        data = {"kind": "folder", "path": str(odd_folder(tmp_path / "imgs")), "on_corrupt": "skip"}
    cfg = config.load(write_config({"data": data}))
    plan = datasets.plan(cfg.data)
    folders = []
    for workers in (1, 2):
        folders.append(tmp_path / f"w{workers}")
        datasets.build(plan, folders[-1], workers=workers)
    for name in ("images.npy", "labels.npy", "dataset.json"):
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
    ds = datasets.open_prepared(folders[1])
    assert ds.count == (23 if kind == "shapes" else 8)
    assert len(np.unique(ds.images.reshape(ds.count, -1), axis=0)) == ds.count  # every row filled, none repeated
    if kind == "folder":
        assert ds.class_names == ("cats", "dogs") and io.read_json(folders[1] / "dataset.json")["skipped"] == [
            "dogs/broken.png"]
    assert multiprocessing.active_children() == []  # the workers are gone


def test_bad_file_found_by_a_worker_is_named_and_workers_stop(write_config, tmp_path):
    cfg = config.load(write_config({"data": {"kind": "folder", "path": str(odd_folder(tmp_path / "imgs"))}}))
    with pytest.raises(UserError, match=r"dogs/broken\.png: corrupt or unsupported image.*on_corrupt: skip"):
        datasets.build(datasets.plan(cfg.data), tmp_path / "out", workers=2)
    assert multiprocessing.active_children() == []


def test_progress_line_shows_images_per_second_and_eta(write_config, tmp_path, monkeypatch, caplog):
    from diffrelay import logs

    monkeypatch.setattr(logs, "PROGRESS_SECONDS", 0)  # datasets.Progress is logs.Progress
    caplog.set_level(logging.INFO, logger="diffrelay")
    build(write_config, tmp_path, {"count": 5})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepare: ")]
    assert re.fullmatch(r"prepare: 1/5 images \| \d+ img/s \| eta \d+s", lines[0]), lines
    assert re.fullmatch(r"prepare: 5/5 images \| \d+ img/s \| decoded in \d+s", lines[-1]), lines


def test_workers_setting_rebuilds_and_retrains_nothing(write_config):
    one, many = (config.load(write_config({"data": {"workers": n}})) for n in (1, 8))
    assert config.data_hash(one) == config.data_hash(many)
    assert config.trajectory_hash(one) == config.trajectory_hash(many)
    other = config.load(write_config({"data": {"workers": 1, "seed": 5}}))
    assert config.data_hash(other) != config.data_hash(one)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_prepare_leaves_no_decoding_worker(write_config, tmp_path):
    from test_data_safety import children

    cfg = write_config({"data": {"count": 20000, "resolution": 64}})
    parent = subprocess.Popen([sys.executable, "-m", "diffrelay", "prepare", "--config", str(cfg), "--workers", "2",
                               "--out", str(tmp_path / "ds")], stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while len(workers := children(parent.pid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert len(workers) == 2, "the decoding workers never started"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while any(running(w) for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if running(w)]
    assert not (tmp_path / "ds").exists()  # only a hidden temp folder can be left, never a dataset
