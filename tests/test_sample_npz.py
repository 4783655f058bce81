"""sample.npz: samples.npz (arr_0 images, arr_1 labels) beside the PNGs, recorded in the manifest, added or
removed on a finished folder without sampling its images again."""
# ruff: noqa: F811 (the fixtures snap and uncond_snap come from test_sample, as arguments they redefine the import)

import json

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from test_sample import _quiet_logger, folder_bytes, sample_args, settings, snap, uncond_snap  # noqa: F401 (fixtures)
from diffrelay import cli, config, io, logs
from diffrelay.evaluation import features
from diffrelay.sampling import folder, sample
from diffrelay.sampling import settings as sample_settings

N = 6


def npz_settings(**over):
    return settings(**{"num_images": N} | over)


def decoded_pngs(out):
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sample.image_files(out)])


def load(out) -> dict:
    with np.load(out / "samples.npz", allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def png_stats(out) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in sample.image_files(out)}


def manifest(out) -> dict:
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("class_labels", ["balanced", 1])
def test_npz_holds_the_pngs_and_the_labels_and_the_manifest_records_it(snap, tmp_path, class_labels):
    out = tmp_path / "out"
    m = sample.run(snap, out, npz_settings(npz=True, class_labels=class_labels))
    arrays = load(out)
    assert sorted(arrays) == ["arr_0", "arr_1"]
    images, labels = arrays["arr_0"], arrays["arr_1"]
    assert images.dtype == np.uint8 and images.shape == (N, 16, 16, 3)
    assert np.array_equal(images, decoded_pngs(out))
    assert labels.dtype == np.int64 and labels.shape == (N,)
    want = [i % 3 for i in range(N)] if class_labels == "balanced" else [1] * N
    assert labels.tolist() == want == sample.class_labels(range(N), {"model": {"class_conditional": True},
                                                                    "num_classes": 3}, class_labels)
    assert m["files"]["samples.npz"] == {"bytes": (out / "samples.npz").stat().st_size,
                                         "sha256": io.sha256_file(out / "samples.npz")}
    assert manifest(out) == m
    assert sorted(p.name for p in out.iterdir()) == sorted([*folder_bytes(out), "manifest.json", "samples.npz"])
    # FID reads the numbered PNGs only
    assert [p.name for p in features.image_files(out)] == [f"{i:06d}.png" for i in range(N)]


def test_unconditional_npz_has_no_labels(uncond_snap, tmp_path):
    out = tmp_path / "out"
    sample.run(uncond_snap, out, npz_settings(npz=True))
    arrays = load(out)
    assert list(arrays) == ["arr_0"]
    assert np.array_equal(arrays["arr_0"], decoded_pngs(out))


def test_pngs_are_the_same_bytes_with_npz_on_and_off(snap, tmp_path):
    sample.run(snap, tmp_path / "off", npz_settings())
    sample.run(snap, tmp_path / "on", npz_settings(npz=True))
    assert folder_bytes(tmp_path / "on") == folder_bytes(tmp_path / "off")  # the images and grid.png
    assert not (tmp_path / "off" / "samples.npz").exists()
    assert "samples.npz" not in manifest(tmp_path / "off")["files"]


def test_switching_npz_on_and_off_for_a_finished_folder_keeps_the_images(snap, tmp_path, capsys):
    out = tmp_path / "out"
    sample.run(snap, out, npz_settings())
    pngs = png_stats(out)
    logs.setup(main=True)

    m = sample.run(snap, out, npz_settings(npz=True))
    assert "adding samples.npz" in capsys.readouterr().err
    assert png_stats(out) == pngs  # not made again: the same files (mtime, inode, bytes)
    assert m["generated"] == 0 and "samples.npz" in m["files"]
    assert np.array_equal(load(out)["arr_0"], decoded_pngs(out))
    assert not sample.work_dir(out).exists() and not list(out.glob(".*"))
    assert sorted(p.name for p in out.iterdir()) == sorted([*folder_bytes(out), "manifest.json", "samples.npz"])

    before = (out / "manifest.json").read_bytes()
    assert sample.run(snap, out, npz_settings(npz=True)) == m  # up to date: nothing written
    assert (out / "manifest.json").read_bytes() == before and "up to date" in capsys.readouterr().err

    # Off: the npz (made by diffrelay sample, as the manifest shows) is removed; the images stay.
    m = sample.run(snap, out, npz_settings())
    assert "removing samples.npz" in capsys.readouterr().err
    assert not (out / "samples.npz").exists() and "samples.npz" not in m["files"]
    assert png_stats(out) == pngs and m["generated"] == 0


@pytest.mark.parametrize("damage", ["delete", "corrupt", "truncate"])
def test_damaged_npz_is_made_again_and_only_it(snap, tmp_path, damage):
    out = tmp_path / "out"
    first = sample.run(snap, out, npz_settings(npz=True))
    pngs, arrays = png_stats(out), load(out)
    npz = out / "samples.npz"
    if damage == "delete":
        npz.unlink()
    elif damage == "corrupt":  # same size, other bytes
        data = bytearray(npz.read_bytes())
        data[len(data) // 2] ^= 0xFF
        npz.write_bytes(bytes(data))
    else:
        npz.write_bytes(npz.read_bytes()[:-100])
    assert folder.damaged_files(out, first) == ["samples.npz"]
    m = sample.run(snap, out, npz_settings(npz=True))
    assert png_stats(out) == pngs and m["generated"] == 0
    again = load(out)
    assert all(np.array_equal(again[k], arrays[k]) for k in arrays) and sorted(again) == sorted(arrays)
    assert folder.damaged_files(out, m) == [] and m["files"]["samples.npz"]["sha256"] == io.sha256_file(npz)


def test_a_damaged_npz_with_npz_off_is_removed_not_remade(snap, tmp_path):
    out = tmp_path / "out"
    sample.run(snap, out, npz_settings(npz=True))
    (out / "samples.npz").write_bytes(b"broken")
    m = sample.run(snap, out, npz_settings())
    assert not (out / "samples.npz").exists() and "samples.npz" not in m["files"]


def test_a_work_folder_holding_an_npz_is_ours(tmp_path):
    """A finalize killed after writing the npz leaves it in the work folder; the rerun may clear that folder."""
    (tmp_path / "000000.png").write_bytes(b"")
    (tmp_path / "samples.npz").write_bytes(b"")
    assert folder._is_work_folder(tmp_path)


def test_npz_flag_and_its_config_default(snap, tmp_path, write_config):
    def parsed(*extra, cfg=None):
        args = cli.build_parser().parse_args(sample_args(snap, tmp_path / "o", *extra))
        d = config.load([cfg]).to_dict() if cfg else config.validate({})
        return sample_settings.from_args(args, d, config.validate)[0].npz

    on = write_config({"sample": {"npz": True}})
    assert not parsed() and parsed("--npz", "true") and parsed("--npz", "True")
    assert parsed(cfg=on) and not parsed("--npz", "false", cfg=on)
    with pytest.raises(SystemExit):
        parsed("--npz", "yes")
    assert config.validate({})["sample"]["npz"] is False
    out = tmp_path / "cli"
    run_cli(*sample_args(snap, out, "--config", on, "--num-images", 3, "--steps", 2))
    assert load(out)["arr_0"].shape == (3, 16, 16, 3)
