"""`diffrelay sample`: seeds, byte-identical PNGs across process counts and batch sizes, resume, finalizing."""

import json
import logging
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageFont

from conftest import BIN, run_cli
from diffrelay import cli, config, io, logs
from diffrelay.objectives import edm
from diffrelay.sampling import images, sample
from diffrelay.training import checkpoint
from diffrelay.errors import UserError

CLASS_NAMES = ["circle", "square", "triangle"]


def make_snapshot(path, conditional=True, num_classes=3, seed=0, model=None):
    """A tiny model whose weights are seeded noise, so its images depend on every input bit."""
    model = config.validate({"model": {"channels": 8, "channel_mult": [1, 2], "class_conditional": conditional,
                                       **(model or {})}})
    net = edm.build(model["model"], 16, num_classes)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    meta = {"step": 40, "model": model["model"], "image_shape": [3, 16, 16], "num_classes": num_classes,
            "class_names": CLASS_NAMES[:num_classes]}
    return checkpoint.save_snapshot(path, net.state_dict(), net.state_dict(), meta)


@pytest.fixture(autouse=True)
def _quiet_logger():
    """cli.main and logs.setup bind a handler to the stream of the moment; drop it after each test."""
    yield
    logging.getLogger(logs.LOGGER).handlers.clear()


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    return make_snapshot(tmp_path_factory.mktemp("snap") / "step_0000040.safetensors")


@pytest.fixture(scope="module")
def uncond_snap(tmp_path_factory):
    return make_snapshot(tmp_path_factory.mktemp("snap") / "uncond.safetensors", conditional=False, num_classes=0)


def settings(**over):
    return sample.default_settings(**{"num_images": 40, "steps": 3, "batch_size": 8} | over)


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


def sample_args(snapshot, out, *extra):
    return ["sample", "--snapshot", str(snapshot), "--out", str(out), *map(str, extra)]


# ---------------------------------------------------------------------------------------------
# Pure helpers


def test_rank_shares_cover_every_image_once():
    for world in range(1, 6):
        shares = [list(sample.rank_share(37, r, world)) for r in range(world)]
        assert sorted(sum(shares, [])) == list(range(37))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_latents_depend_only_on_their_own_seed():
    a = sample.latents([5, 6, 7], (3, 16, 16))
    b = sample.latents([7, 5], (3, 16, 16))
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1])


# ---------------------------------------------------------------------------------------------
# Byte identity


def test_pngs_are_byte_identical_for_any_process_count_and_batch_size(snap, tmp_path):
    one = tmp_path / "one"
    run_cli(*sample_args(snap, one, "--num-images", 40, "--steps", 3, "--batch-size", 8))
    two = tmp_path / "two"
    run_cli("torchrun", "--standalone", "--nproc-per-node", 2, "-m", "diffrelay",
            *sample_args(snap, two, "--num-images", 40, "--steps", 3, "--batch-size", 32))
    for batch in (32, 3):  # 3 images a batch still run as 16-row forwards
        sample.run(snap, tmp_path / f"b{batch}", settings(batch_size=batch))

    ref = folder_bytes(one)
    assert set(ref) == {f"{i:06d}.png" for i in range(40)} | {"grid.png"}
    assert folder_bytes(two) == ref
    assert folder_bytes(tmp_path / "b32") == ref
    assert folder_bytes(tmp_path / "b3") == ref
    assert json.loads((two / "manifest.json").read_text())["nproc"] == 2
    assert sorted(p.name for p in two.iterdir()) == sorted(ref) + ["manifest.json"]  # no markers or temp files
    assert not sample.work_dir(two).exists()


def test_images_match_generate_and_differ_between_seeds(snap, tmp_path):
    net, meta = checkpoint.load_snapshot(snap)
    out = tmp_path / "out"
    sample.run(snap, out, settings(num_images=6, first_seed=100))
    made = dict(sample.generate(net, meta, [3, 5], settings(first_seed=100)))
    for i in (3, 5):
        assert np.array_equal(np.asarray(Image.open(out / f"{i:06d}.png")), made[i])
    made = dict(sample.generate(net, meta, [3, 5], settings(first_seed=100, class_labels=0)))
    shifted = dict(sample.generate(net, meta, [2], settings(first_seed=101, class_labels=0)))
    assert np.array_equal(shifted[2], made[3])  # image i uses seed first_seed + i
    assert not np.array_equal(made[3], made[5])


# ---------------------------------------------------------------------------------------------
# Resume, up to date, replace


def test_two_runs_into_one_out_both_succeed_and_leave_no_work_folder(snap, tmp_path):
    """Two `sample` runs started into one --out share its work folder; whichever finishes first publishes
    it, and the other, whose next write finds the folder gone, must end well instead of recreating it."""
    args = ["--num-images", 8, "--steps", 30, "--batch-size", 2]
    out = tmp_path / "out"
    cmd = [str(BIN / "diffrelay"), *map(str, sample_args(snap, out, *args))]
    # Started together, each finds no image yet and makes all of them: one finishes while the other still writes.
    first, second = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for _ in range(2))
    results = [(p.wait(timeout=300), p.stderr.read()) for p in (first, second)]
    assert [code for code, _ in results] == [0, 0], results
    assert not any("Traceback" in err for _, err in results), results
    ref = tmp_path / "ref"
    sample.run(snap, ref, settings(num_images=8, steps=30, batch_size=2))
    assert folder_bytes(out) == folder_bytes(ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]  # no .out.partial, no stale folder


def test_killed_run_resumes_with_same_files_and_skips_done_images(snap, tmp_path):
    # 4 forward batches of 59 network calls each: slow enough to kill between two of them
    args = ["--num-images", 8, "--steps", 30, "--batch-size", 2]
    out = tmp_path / "out"
    work = sample.work_dir(out)
    proc = subprocess.Popen([str(BIN / "diffrelay"), *map(str, sample_args(snap, out, *args))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (work / "000000.png").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no image appeared"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    early = (work / "000000.png").stat()
    kept = len(sample.image_files(work))
    assert 0 < kept < 8, "the kill came too late to test resuming"
    assert not out.exists()

    p = run_cli(*sample_args(snap, out, *args))
    assert f"resuming: {kept} of 8 images" in p.stderr
    after = (out / "000000.png").stat()
    assert (after.st_ino, after.st_mtime_ns) == (early.st_ino, early.st_mtime_ns)

    ref = tmp_path / "ref"
    sample.run(snap, ref, settings(num_images=8, steps=30, batch_size=2))
    assert folder_bytes(out) == folder_bytes(ref)
    assert not list(out.glob(".*"))


def test_second_run_with_same_settings_is_up_to_date_and_writes_nothing(snap, tmp_path, capsys):
    out = tmp_path / "out"
    first = sample.run(snap, out, settings(num_images=4))
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    logs.setup(main=True)
    # batch size and threads do not change the pixels, so they do not make the folder stale
    again = sample.run(snap, out, settings(num_images=4, batch_size=2, threads=2))
    assert "up to date" in capsys.readouterr().err
    assert again == first
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before
    assert not sample.work_dir(out).exists()


def test_changed_settings_replace_an_older_folder(snap, tmp_path):
    out = tmp_path / "out"
    sample.run(snap, out, settings(num_images=6))
    old = folder_bytes(out)
    m = sample.run(snap, out, settings(num_images=3, steps=2))
    assert (m["num_images"], m["steps"]) == (3, 2)
    assert json.loads((out / "manifest.json").read_text())["steps"] == 2
    assert sorted(p.name for p in sample.image_files(out)) == ["000000.png", "000001.png", "000002.png"]
    assert folder_bytes(out)["000000.png"] != old["000000.png"]
    assert not [p for p in tmp_path.iterdir() if p.name != "out"]  # nothing left beside it


def test_partial_folder_of_other_settings_is_not_reused(snap, tmp_path):
    out = tmp_path / "out"
    work = sample.work_dir(out)
    work.mkdir()
    (work / "settings.json").write_text(json.dumps({"steps": 99}))
    bogus = np.zeros((16, 16, 3), np.uint8)
    Image.fromarray(bogus).save(work / "000000.png")
    sample.run(snap, out, settings(num_images=2))
    ref = tmp_path / "ref"
    sample.run(snap, ref, settings(num_images=2))
    assert folder_bytes(out) == folder_bytes(ref)


def test_corrupt_image_in_partial_folder_is_made_again(snap, tmp_path):
    out = tmp_path / "out"
    s = settings(num_images=3)
    ref = tmp_path / "ref"
    sample.run(snap, ref, s)
    # a work folder as a killed run leaves it: settings written, one good image, one truncated
    work = sample.work_dir(out)
    key = {k: getattr(s, k) for k in sample.PIXEL_KEYS} | {
        "snapshot_sha256": json.loads((ref / "manifest.json").read_text())["snapshot_sha256"],
        "image_shape": [3, 16, 16]}
    work.mkdir()
    (work / "settings.json").write_text(json.dumps(key))
    (work / "000000.png").write_bytes((ref / "000000.png").read_bytes())
    (work / "000001.png").write_bytes((ref / "000001.png").read_bytes()[:40])
    sample.run(snap, out, s)
    assert folder_bytes(out) == folder_bytes(ref)


# ---------------------------------------------------------------------------------------------
# Classes and grid


def test_balanced_labels_cycle_through_classes(snap):
    net, meta = checkpoint.load_snapshot(snap)
    assert sample.class_labels(range(7), meta, "balanced") == [0, 1, 2, 0, 1, 2, 0]
    balanced = dict(sample.generate(net, meta, range(6), settings()))
    fixed1 = dict(sample.generate(net, meta, range(6), settings(class_labels=1)))
    for i in range(6):
        assert np.array_equal(balanced[i], fixed1[i]) == (i % 3 == 1)


def test_class_label_out_of_range_is_one_line_error(snap, tmp_path, capsys):
    assert cli.main(sample_args(snap, tmp_path / "out", "--class-labels", 3)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--class-labels" in err and "0..2" in err
    assert cli.main(sample_args(snap, tmp_path / "out", "--class-labels", "many")) == 2
    assert "--class-labels=many" in capsys.readouterr().err
    assert cli.main(sample_args(snap, tmp_path / "out", "--num-images", 0)) == 2
    assert "--num-images=0: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not sample.work_dir(tmp_path / "out").exists()


def test_fixed_label_on_unconditional_model_is_refused(uncond_snap, tmp_path):
    with pytest.raises(UserError, match="unconditional"):
        sample.run(uncond_snap, tmp_path / "out", settings(class_labels=0))


def test_grid_has_eight_columns_with_class_names_under_enlarged_tiles(snap, uncond_snap, tmp_path):
    sample.run(snap, tmp_path / "cond", settings(num_images=20))
    top = images.TITLE_PX  # a title line, then 3 rows of 64 px tiles + 12 px names
    with Image.open(tmp_path / "cond" / "grid.png") as im:
        assert im.size == (8 * 64, top + 3 * (64 + images.LABEL_PX))
        grid = np.asarray(im.convert("RGB"))
    first = np.asarray(Image.open(tmp_path / "cond" / "000009.png"))  # row 1, column 1
    assert np.array_equal(grid[top + 76:top + 140:4, 64:128:4], first)
    assert (grid[top + 64:top + 76, 0:64] < 128).any()  # a name is written under the first tile
    assert (grid[:top] < 128).any()  # the title

    m = sample.run(uncond_snap, tmp_path / "uncond", settings(num_images=5))
    assert m["num_classes"] == 0
    with Image.open(tmp_path / "uncond" / "grid.png") as im:
        assert im.size == (5 * 64, top + 64)


def test_sample_ema_decay_picks_one_of_the_runs_emas_and_is_recorded(tmp_path, capsys):
    """A snapshot of train.ema_decays [0.9, 0.99] whose two EMAs are different networks: --ema-decay 0.99 gives
    exactly the images of a snapshot holding that EMA alone; the default (and 0.9) the first's."""
    model = config.validate({"model": {"channels": 8, "channel_mult": [1, 2], "class_conditional": True}})["model"]
    nets = [edm.build(model, 16, 3) for _ in range(2)]
    for seed, net in enumerate(nets):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    meta = {"step": 40, "model": model, "image_shape": [3, 16, 16], "num_classes": 3, "class_names": CLASS_NAMES,
            "config": {"train": {"ema_decays": [0.9, 0.99]}}}
    both = checkpoint.save_snapshot(tmp_path / "both.safetensors", nets[0].state_dict(), nets[0].state_dict(), meta,
                                    [nets[1].state_dict()])
    second = checkpoint.save_snapshot(tmp_path / "second.safetensors", nets[1].state_dict(), {}, meta)
    m = sample.run(both, tmp_path / "d99", settings(num_images=8, ema_decay=0.99))
    sample.run(second, tmp_path / "alone", settings(num_images=8))
    first = sample.run(both, tmp_path / "first", settings(num_images=8))
    pngs = {k: {n: b for n, b in folder_bytes(tmp_path / k).items() if n != "grid.png"} for k in ("d99", "alone", "first")}
    assert pngs["d99"] == pngs["alone"] != pngs["first"]  # the grids differ in their titles (EMA 0.99, EMA 0.9)
    assert m["ema_decay"] == 0.99 and "ema_decay" not in first
    assert sample.grid_title(meta, settings(ema_decay=0.99)).endswith("| EMA 0.99")
    assert cli.main(sample_args(both, tmp_path / "raw", "--weights", "raw", "--ema-decay", 0.99)) == 2
    assert "--ema-decay=0.99: with --weights raw there is no EMA" in capsys.readouterr().err
    assert cli.main(sample_args(both, tmp_path / "raw", "--ema-decay", 0.5)) == 2
    assert "train.ema_decays=[0.9, 0.99]; choose one of those" in capsys.readouterr().err
    assert not (tmp_path / "raw").exists() and not sample.work_dir(tmp_path / "raw").exists()


def test_grid_title_names_the_step_guidance_and_weights():
    s = sample.default_settings(guidance=1.5)
    meta = {"step": 400, "config": {"train": {"ema_decays": [0.999, 0.9999]}}}
    assert sample.grid_title(meta, s) == "step 400 | guidance 1.5 | EMA 0.999"
    assert sample.grid_title({"step": 6, "phema": {"sigma_rel": 0.08}}, s).endswith("post-hoc EMA sigma_rel 0.08")
    assert sample.grid_title(meta, sample.default_settings(weights="raw")) == "step 400 | guidance 1 | raw weights"
    # The title is drawn: two grids that differ only in their titles differ in pixels.
    tiles = [np.zeros((8, 8, 3), np.uint8)] * 2
    a, b = (np.asarray(sample.make_grid(tiles, None, t)) for t in ("step 1", "step 2"))
    assert a.shape == b.shape and not np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# Fresh process, config, errors


def test_snapshot_samples_in_fresh_process_without_dataset(snap, write_config, tmp_path):
    cfg = write_config({"sample": {"num_images": 5, "steps": 2, "class_labels": 2, "precision": "bf16"}})
    empty = tmp_path / "cwd"
    empty.mkdir()
    out = tmp_path / "samples"
    run_cli(*sample_args(snap, out, "--config", cfg, "--first-seed", 7), cwd=empty)
    m = json.loads((out / "manifest.json").read_text())
    assert (m["num_images"], m["steps"], m["class_labels"], m["precision"], m["first_seed"]) == (5, 2, 2, "bf16", 7)
    assert m["snapshot_sha256"] == io.sha256_file(snap) and m["step"] == 40
    assert set(m) >= {"weights", "solver", "batch_size", "nproc", "image_shape", "seconds", "images_per_s",
                      "started", "finished", "snapshot"}
    assert len(m["class_names"]) == m["num_classes"] > 2  # what class_accuracy names each image's class by
    assert len(sample.image_files(out)) == 5
    assert not (tmp_path / "results").exists() and not list(empty.iterdir())


def test_corrupt_snapshot_exits_2_with_one_line_naming_the_file(snap, tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    blob = bytearray(snap.read_bytes())
    blob[-100] ^= 0xFF
    bad.write_bytes(bytes(blob))
    assert cli.main(sample_args(bad, tmp_path / "out")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"diffrelay: error: {bad}:")
    assert not (tmp_path / "out").exists()


def test_non_finite_samples_are_an_error_naming_the_snapshot_and_seeds_and_nothing_is_written(snap, tmp_path,
                                                                                               monkeypatch):
    """NaN would be cast to black pixels and scored as images (seen with guidance 1e308 and a network that is
    NaN only in eval mode). Here the sampler's output is made NaN: all of it, then one row."""
    real, rows = edm.sample, slice(None)

    def nan_rows(*args, **kwargs):
        x = real(*args, **kwargs)
        x[rows] = float("nan")
        return x

    monkeypatch.setattr(edm, "sample", nan_rows)
    with pytest.raises(UserError, match=r"step_0000040\.safetensors: sampling gave NaN or inf for seed\(s\) "
                                        r"0, 1, 2, 3, 4 \.\.\. \(guidance 1"):
        sample.run(snap, tmp_path / "all", settings())
    assert not list(tmp_path.rglob("*.png"))
    rows = 3
    with pytest.raises(UserError, match=r"seed\(s\) 3 \("):
        sample.run(snap, tmp_path / "one", settings(num_images=8))
    assert not list(tmp_path.rglob("000003.png"))


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_guidance_that_is_not_a_finite_non_negative_number_is_refused(snap, tmp_path, value):
    p = run_cli(*sample_args(snap, tmp_path / "out", "--guidance", value), check=False)
    assert p.returncode == 2 and "--guidance" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_first_seed_past_the_largest_is_one_line_and_leaves_no_folder(snap, tmp_path):
    out = tmp_path / "out"
    p = run_cli(*sample_args(snap, out, "--first-seed", 2**64), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "--first-seed=18446744073709551616" in p.stderr
    assert list(tmp_path.iterdir()) == []


def test_sample_tf32_sets_the_backends_and_is_recorded(snap, tmp_path, monkeypatch):
    """sample.tf32 (--tf32): fp32 matmuls and convolutions on TF32 or strict (PyTorch's default leaves cuDNN
    convolutions on TF32), as train.tf32; the manifest records it, and on a CPU it changes no pixel."""
    seen = []
    real = sample.speed.set_backends
    monkeypatch.setattr(sample.speed, "set_backends", lambda d, tf32, key: (seen.append((tf32, key)),
                                                                             real(d, tf32, key)))
    assert cli.main(sample_args(snap, tmp_path / "on", "--num-images", 4, "--steps", 2, "--tf32")) == 0
    assert seen == [(True, "sample.tf32")]
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert cli.main(sample_args(snap, tmp_path / "off", "--num-images", 4, "--steps", 2)) == 0
    assert seen[-1] == (False, "sample.tf32")  # the schema's default: strict, as train.tf32
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    on, off = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("on", "off"))
    assert (on["tf32"], off["tf32"]) == (True, False)
    # On a CPU the key is the one a folder had before sample.tf32: the folder is up to date either way.
    assert sample.run(snap, tmp_path / "on", settings(num_images=4, steps=2))["tf32"] is True
    assert folder_bytes(tmp_path / "on") == folder_bytes(tmp_path / "off")
    with pytest.raises(SystemExit):
        cli.main(sample_args(snap, tmp_path / "x", "--tf32", "maybe"))


def test_a_grid_shows_every_prompt_or_class_once_where_its_cells_allow():
    """A prompt file ordered by prompt (20 images of each of 10) shows all 10 prompts, grouped, and says so; a
    balanced class run's first images hold every class and stay the grid; more keys than cells are said."""
    by_prompt = [f"prompt {i // 20}" for i in range(200)]
    picks, note = images.grid_picks(by_prompt)
    assert len(picks) == 64 and {by_prompt[i] for i in picks} == set(by_prompt)
    assert picks[:7] == [0, 1, 2, 3, 4, 5, 6] and picks[7] == 20  # 6 or 7 of each, a prompt's images together
    assert note == "64 of 200 images: every one of the 10"
    assert images.grid_picks([i % 3 for i in range(20)]) == (list(range(20)), None)
    assert images.grid_picks([i % 100 for i in range(300)]) == (list(range(64)),
                                                                "64 of 300 images: the first 64 of the 100")


def test_a_10000_character_label_and_title_fit_in_a_few_measurements(monkeypatch):
    """make_grid cut a label one character per measurement: a 10,000-character prompt took minutes in grid.png.
    The cut is a binary search on the prefix: the longest prefix that fits, in O(log n) measurements."""
    from PIL import ImageDraw

    measure, calls, drawn = ImageDraw.ImageDraw.textlength, [], []
    monkeypatch.setattr(ImageDraw.ImageDraw, "textlength",
                        lambda self, text, *a, **k: calls.append(len(text)) or measure(self, text, *a, **k))
    write = ImageDraw.ImageDraw.text
    monkeypatch.setattr(ImageDraw.ImageDraw, "text",
                        lambda self, xy, text, *a, **k: drawn.append(text) or write(self, xy, text, *a, **k))
    name, title = "a watercolour fox " * 556, "step 1 | " + "x" * 10_000  # 10,008 and 10,009 characters
    tiles = [np.zeros((64, 64, 3), np.uint8)] * 2
    images.make_grid(tiles, [name, "a cat\non a mat"], title, tile_px=128)
    assert len(calls) <= 2 * 3 * 16, len(calls)  # three texts, each at most ~2 log2(10,000) measurements
    font, draw = ImageFont.load_default(), ImageDraw.Draw(Image.new("RGB", (8, 8)))
    label_title, label, short = drawn
    for text, width, full in ((label_title, 2 * 128 - 2, title), (label, 128 - 2, name)):
        assert 0 < len(text) < len(full) and full.startswith(text)
        assert measure(draw, text, font=font) <= width < measure(draw, full[:len(text) + 1], font=font)
    assert short == "a cat on a mat"  # a line break in a prompt is a space on its one line


def test_a_snapshot_that_is_a_folder_but_no_pipeline_says_so_not_train_first(tmp_path, capsys):
    """An existing folder without model_index.json was "snapshot not found; train to that step first"; a FIFO too."""
    import os

    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo.safetensors")
    for path, what in ((tmp_path / "folder", "a folder, and neither a diffusers pipeline folder (no "
                                             "model_index.json in it) nor a snapshot file"),
                       (tmp_path / "fifo.safetensors", "not a regular file (a pipe, socket or device)")):
        assert cli.main(sample_args(path, tmp_path / "out")) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"diffrelay: error: {path}: {what}; pass --snapshot a "
                                                       "snapshot file (<run>/snapshots/step_XXXXXXX.safetensors)"), lines
        assert "train to that step" not in lines[0]
    assert not (tmp_path / "out").exists()


def test_sample_flags_override_the_config_before_any_rule_reads_it(tmp_path):
    """--guidance 3 over a config's guidance 1 was refused for a prompt file's negative prompt ("sample.guidance is
    1"): the flags were applied after the config was checked. Every flag that sets a config key is in the config
    its rules check (a flag can mend a file's value, and a flag's value meets the rules); a --guidance of the file's
    sweep (the workflow's job of it) keeps the sweep; the plan's own rules (the second pass's count) are not one
    job's."""
    import yaml

    (tmp_path / "p.txt").write_text("a cat\na dog --n blurry\n")
    text = {"data": {"captions": "auto", "text_encoders": [{"path": str(tmp_path)}], "val_fraction": 0.1,
                     "caption_dropout": 0.1},
            "model": {"arch": "diffusers-unet", "class_conditional": False}}

    def configured(d: dict, *flags):
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
        return sample.configured(cli.build_parser().parse_args(
            ["sample", "--config", str(tmp_path / "c.yaml"), "--snapshot", str(tmp_path / "s.safetensors"), "--out",
             str(tmp_path / "out"), *flags]))

    def refused(d: dict, *flags) -> str:
        with pytest.raises(UserError) as e:
            configured(d, *flags)
        assert "\n" not in str(e.value)
        return str(e.value)

    prompts = ["--prompts", str(tmp_path / "p.txt")]
    own = text | {"sample": {"prompts": str(tmp_path / "p.txt")}}  # the run's config names the file
    for d, flags in ((own, []), (text, prompts)):
        assert "prompt 2 has a negative prompt, and sample.guidance is 1" in refused(d, *flags)
        assert configured(d, *flags, "--guidance", "3")[2].guidance == 3
    sweep = text | {"sample": {"guidance": [1, 4.5]}}
    assert configured(sweep, *prompts, "--guidance", "1")[2].guidance == 1  # the sweep's unguided job
    assert configured(sweep, *prompts, "--guidance", "1")[0]["sample"]["guidance"] == 1
    assert "prompt 2 has a negative prompt, and sample.guidance is 1" in refused(
        text | {"sample": {"guidance": 3}}, *prompts, "--guidance", "1")
    assert "sample.true_cfg_scale=2.0: FluxPipeline's true classifier-free guidance, for FLUX.1 networks" in refused(
        text, *prompts, "--guidance", "3", "--true-cfg-scale", "2")
    # A class run: --solver mends a file's solver; --weights raw drops the file's EMA choice; --num-images of the
    # second pass (fid.final.num_images) is the plan's, not refused as "not more than sample.num_images".
    plain = {"model": {"class_conditional": True}, "train": {"label_dropout": 0.1, "ema_decays": [0.99, 0.999]},
             "sample": {"solver": "ddim", "ema_decay": 0.999, "num_images": 16},
             "fid": {"final": {"best": 1, "num_images": 64}}}
    assert "sample.solver=ddim: a sampler of model.objective: ddpm" in refused(plain)
    _, _, s, _ = configured(plain, "--solver", "heun", "--weights", "raw", "--num-images", "64")
    assert (s.solver, s.weights, s.ema_decay, s.num_images) == ("heun", "raw", None, 64)
    assert "sample.ema_decay=0.5: not one of train.ema_decays" in refused(plain, "--solver", "heun", "--ema-decay",
                                                                          "0.5")
    # --solver replaces a file's scheduler and its whole scheduler_kwargs (not merged into them)
    scheduled = plain | {"sample": plain["sample"] | {"solver": "heun", "scheduler": "EulerDiscreteScheduler",
                                                      "scheduler_kwargs": {"use_karras_sigmas": True}}}
    cfg, _, s, _ = configured(scheduled, "--solver", "euler")
    assert (s.scheduler, s.scheduler_kwargs, cfg["sample"]["scheduler_kwargs"]) == (None, {}, {})
