"""Every bad input through the real CLI: exit code 2 and exactly one line `diffrelay: error: ...` on stderr.

To add a row, append a Case to CASES:
  setup(tmp_path, write_config) -> ctx   makes the files (ctx is anything argv needs, usually a config path)
  argv(ctx) -> list                      the `diffrelay` arguments
  expect                                 substrings the error line must contain: the file, the key, the fix
"""

import os
from dataclasses import dataclass
from typing import Callable

import pytest
from PIL import Image

from conftest import run_cli


@dataclass(frozen=True)
class Case:
    id: str
    setup: Callable
    argv: Callable
    expect: tuple


def config_with(overrides):
    """setup for a config row: write the tiny config with these overrides."""
    return lambda tmp_path, write_config: write_config(overrides)


def prepare(cfg):
    return ["prepare", "--config", cfg]


def validate(cfg):
    return ["validate", "--config", cfg]


def raw_config(text, name="config.yaml"):
    def setup(tmp_path, write_config):
        path = tmp_path / name
        path.write_text(text)
        return path
    return setup


def image_folder(fill, **data):
    """setup for a data row: run `fill(folder)` on tmp_path/imgs, then point a folder config at it."""
    def setup(tmp_path, write_config):
        folder = tmp_path / "imgs"
        fill(folder)
        return write_config({"data": {"kind": "folder", "path": str(folder), **data}})
    return setup


def with_files(*names, bad=()):
    """Good 8x8 PNGs for `names`, garbage bytes for `bad`."""
    def fill(folder):
        folder.mkdir(parents=True)
        for n in names:
            (folder / n).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (255, 0, 0)).save(folder / n)
        for n in bad:
            (folder / n).write_bytes(b"this is not an image")
    return fill


def dangling(folder):
    with_files("ok.png")(folder)
    os.symlink(folder / "missing-target.png", folder / "ghost.png")


CASES = [
    # ---- config
    Case("unknown-top-key", config_with({"trian": {"lr": 0.1}}), prepare,
         ("config.yaml", "trian", "unknown key", "allowed here")),
    Case("unknown-nested-key", config_with({"data": {"reslution": 32}}), prepare,
         ("config.yaml", "data.reslution", "unknown key", "resolution")),
    Case("wrong-type", config_with({"train": {"batch_size": "lots"}}), prepare,
         ("config.yaml", "train.batch_size", "wrong type", "expected integer")),
    Case("float-steps", config_with({"train": {"total_steps": 6.0}}), validate,
         ("config.yaml", "train.total_steps=6.0", "expected integer")),
    Case("zero-batch", config_with({"train": {"batch_size": 0}}), prepare,
         ("config.yaml", "train.batch_size=0", "at least 1")),
    Case("negative-resolution", config_with({"data": {"resolution": -16}}), prepare,
         ("config.yaml", "data.resolution=-16", "at least 8")),
    Case("negative-lr", config_with({"train": {"lr": -0.001}}), validate,
         ("config.yaml", "train.lr=-0.001", "greater than 0")),
    Case("bad-enum", config_with({"data": {"kind": "photos"}}), prepare,
         ("config.yaml", "data.kind", "choose one of", "shapes", "folder")),
    Case("indivisible-batch", config_with({"train": {"batch_size": 30, "grad_accum": 4}}), prepare,
         ("config.yaml", "train.batch_size=30", "not divisible", "32")),
    Case("segment-longer-than-run", config_with({"train": {"segment_steps": 7}}), prepare,
         ("config.yaml", "train.segment_steps=7", "longer than the run", "at most 6")),
    Case("snapshot-not-dividing", config_with({"train": {"snapshot_every": 2}}), validate,
         ("config.yaml", "train.snapshot_every=2", "does not divide", "divisor")),
    Case("resolution-unsupported", config_with({"data": {"resolution": 20}, "model": {"channel_mult": [1, 2, 2, 2]}}),
         prepare, ("config.yaml", "data.resolution=20", "model.channel_mult", "multiple of 8")),
    Case("attn-not-a-level", config_with({"model": {"attn_resolutions": [5]}}), prepare,
         ("config.yaml", "model.attn_resolutions=5", "choose from")),
    Case("run-name-semicolon", config_with({"run": {"name": "a;rm -rf x"}}), prepare,
         ("config.yaml", "run.name", "shell characters")),
    Case("run-name-subshell", config_with({"run": {"name": "$(x)"}}), prepare,
         ("config.yaml", "run.name", "shell characters")),
    Case("run-name-space", config_with({"run": {"name": "my run"}}), validate,
         ("config.yaml", "run.name", "no spaces")),
    Case("folder-without-path", config_with({"data": {"kind": "folder"}}), prepare,
         ("config.yaml", "data.path", "required")),
    Case("results-starts-with-dash", config_with({"run": {"results": "-rf"}}), validate,
         ("config.yaml", 'run.results="-rf"', "reads as an option", "./-rf")),
    Case("resources-with-newline", config_with({"run": {"resources": "res\nx"}}), validate,
         ("config.yaml", 'run.resources="res\\nx"', "control character", "remove it")),
    Case("guide-step-without-snapshot", config_with({"sample": {"guide": 4}}), validate,
         ("config.yaml", "sample.guide=4", "writes no snapshot at that step", "[3, 6]", "train.snapshot_every")),
    Case("dit-kwargs-typo", config_with({"model": {"arch": "dit", "kwargs": {"patch": 4, "hiden_size": 32}}}), validate,
         ("config.yaml", "model.kwargs.hiden_size", "did you mean hidden_size?", "num_heads")),
    Case("unet-kwargs-typo", config_with({"model": {"kwargs": {"chanels": 16}}}), validate,
         ("config.yaml", "model.kwargs.chanels", "did you mean channels?", "channel_mult")),
    Case("kwargs-sets-resolution", config_with({"model": {"arch": "dit", "kwargs": {"resolution": 32}}}), validate,
         ("config.yaml", "model.kwargs.resolution", "set by diffrelay itself", "remove it")),
    Case("edm-sigma-order", config_with({"sample": {"edm": {"sigma_min": 100}}}), validate,
         ("config.yaml", "sample.edm.sigma_min=100", "below sample.edm.sigma_max=80")),
    Case("yaml-syntax", raw_config("run:\n  name: x\ntrain: {lr: 0.1\n"), prepare,
         ("config.yaml", "not valid YAML at line", "fix the syntax")),
    Case("yaml-not-mapping", raw_config("- just\n- a list\n"), validate,
         ("config.yaml", "must be a mapping")),
    Case("missing-config", lambda tmp_path, wc: tmp_path / "nope.yaml", prepare,
         ("nope.yaml", "config file not found")),
    # ---- data
    Case("dataset-path-missing", image_folder(lambda f: None), prepare,
         ("imgs", "data.path", "folder not found")),
    Case("dataset-path-is-file", image_folder(lambda f: f.write_text("x")), prepare,
         ("imgs", "data.path", "not a folder")),
    Case("dataset-empty", image_folder(lambda f: f.mkdir()), prepare,
         ("imgs", "no images found", ".png", ".webp")),
    Case("dataset-only-other-files", image_folder(lambda f: (f.mkdir(), (f / "notes.txt").write_text("x"))), prepare,
         ("imgs", "no images found")),
    Case("corrupt-image", image_folder(with_files("a/ok.png", "b/ok.png", bad=["a/broken.png"])), prepare,
         ("broken.png", "corrupt", "data.on_corrupt: skip")),
    Case("unreadable-file", image_folder(dangling), prepare,
         ("ghost.png", "cannot open", "dangling symlink", "data.on_corrupt: skip")),
    Case("all-images-skipped", image_folder(with_files(bad=["x.png", "y.jpg"]), on_corrupt="skip"), prepare,
         ("imgs", "none of the 2 images could be read")),
    Case("image-past-max-pixels", image_folder(with_files("a.png", "b.png"), max_image_pixels=32), prepare,
         ("a.png", "8x8 = 64 pixels", "data.max_image_pixels=32", "data.on_corrupt: skip")),
]


def altered_checkpoint(tmp_path, write_config):
    """A prepared tiny run plus a checkpoint folder whose state.pt no longer matches its manifest."""
    import torch

    from diffrelay.training import checkpoint

    cfg = write_config()
    run_cli("prepare", "--config", cfg)
    ck = checkpoint.save_checkpoint(tmp_path / "step_0000003", {"w": torch.ones(4)}, {"step": 3})
    blob = bytearray((ck / "state.pt").read_bytes())
    blob[-3] ^= 0xFF
    (ck / "state.pt").write_bytes(bytes(blob))
    return cfg, ck


def garbage(name):
    def setup(tmp_path, write_config):
        (tmp_path / name).write_bytes(b"\x00garbage" * 10)
        return tmp_path / name
    return setup


def samples_and_garbage_ref(tmp_path, write_config):
    with_files("000000.png", "000001.png")(tmp_path / "samples")
    (tmp_path / "samples" / "ref.npz").write_bytes(b"\x00garbage" * 10)
    return tmp_path / "samples" / "ref.npz"


CASES += [
    # ---- checkpoints, snapshots, extractors, statistics
    Case("until-step-beyond-run", config_with({}), lambda cfg: ["train", "--config", cfg, "--until-step", 999],
         ("--until-step 999", "train.total_steps=6")),
    Case("checkpoint-altered", altered_checkpoint,
         lambda ctx: ["train", "--config", ctx[0], "--until-step", 6, "--init", ctx[1]],
         ("step_0000003/state.pt", "sha256 does not match", "delete")),
    Case("snapshot-corrupt", garbage("s.safetensors"),
         lambda snap: ["sample", "--snapshot", snap, "--out", snap.parent / "out"],
         ("s.safetensors", "unreadable snapshot", "rerun training")),
    Case("extractor-missing", lambda tmp_path, wc: tmp_path,
         lambda d: ["fetch-extractor", "--extractor", d / "nope.pt", "--out", d / "x.pt"],
         ("nope.pt",)),
    Case("reference-stats-corrupt", samples_and_garbage_ref,
         lambda ref: ["fid", "--images", ref.parent, "--ref", ref, "--extractor", ref.parent / "x.pt",
                      "--out", ref.parent / "fid.json"],
         ("ref.npz",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gives_exit_2_and_one_error_line(case, tmp_path, write_config):
    ctx = case.setup(tmp_path, write_config)
    p = run_cli(*case.argv(ctx), check=False, timeout=120)
    lines = p.stderr.splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("diffrelay: error: "), p.stderr
    for part in case.expect:
        assert part in lines[0], f"{part!r} missing from: {lines[0]}"


def test_case_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)
