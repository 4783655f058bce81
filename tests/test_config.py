"""Config: defaults, one-line errors for bad values, layering of files, `diffrelay validate`."""

import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import deep_merge, run_cli
from diffrelay import config
from diffrelay.config import identity, inputs, preflight
from diffrelay.errors import UserError


def test_empty_config_gets_every_default():
    cfg = config.Config(config.validate({}))
    assert cfg.run.name == "demo" and cfg.data.kind == "shapes" and cfg.data.resolution == 32
    assert cfg.model.channel_mult == (1, 2, 2) and cfg.train.betas == (0.9, 0.99)
    assert cfg.fid.extractor == "random" and cfg.sample.class_labels == "balanced"
    schema = config.load_schema()

    def check(spec, filled, where):
        for key, prop in spec["properties"].items():
            assert key in filled, f"{where}.{key} has no default"
            if "properties" in prop and filled[key] is not None:  # a nested group (fid.final): each of its keys
                check(prop, filled[key], f"{where}.{key}")  # has its own default (a group off by default: null)
            elif "default" in prop:
                assert filled[key] == prop["default"]

    for section, spec in schema["properties"].items():
        check(spec, cfg.to_dict()[section], section)


def test_given_values_win_over_defaults(write_config):
    cfg = config.load(write_config({"train": {"grad_clip": 0.5}}))
    assert cfg.train.grad_clip == 0.5 and cfg.train.batch_size == 8 and cfg.train.optimizer == "adam"
    assert config.run_dir(cfg).name == "tiny"


def test_config_is_read_only(write_config):
    cfg = config.load(write_config())
    with pytest.raises(AttributeError, match="read-only"):
        cfg.train.lr = 1.0
    d = cfg.to_dict()
    d["train"]["lr"] = 5.0
    assert cfg.train.lr == 0.002


BAD = [
    ({"trian": {}}, ["trian: unknown key", "allowed here: data, fid, model"]),
    ({"data": {"reslution": 32}}, ["data.reslution: unknown key", "resolution"]),
    ({"train": {"batch_size": "big"}}, ['train.batch_size="big": wrong type; expected integer']),
    ({"train": {"total_steps": 6.0}}, ["train.total_steps=6.0: wrong type; expected integer"]),
    ({"model": {"class_conditional": "yes"}}, ["model.class_conditional", "expected boolean"]),
    ({"data": {"kind": "pictures"}}, ['data.kind="pictures": not allowed; choose one of shapes, folder']),
    ({"train": {"batch_size": 0}}, ["train.batch_size=0: must be at least 1"]),
    ({"train": {"lr": -0.1}}, ["train.lr=-0.1: must be greater than 0"]),
    ({"model": {"dropout": 1}}, ["model.dropout=1: must be less than 1"]),
    ({"model": {"channel_mult": []}}, ["model.channel_mult=[]: must not be empty"]),
    ({"train": {"betas": [0.9]}}, ["train.betas=[0.9]: must have at least 2 items"]),
    ({"train": {"batch_size": 30, "grad_accum": 4}},
     ["train.batch_size=30: not divisible by processes x grad_accum = 4", "such as 32"]),
    ({"train": {"segment_steps": 10}}, ["train.segment_steps=10: longer than the run", "use at most 6"]),
    ({"train": {"snapshot_every": 2}}, ["train.snapshot_every=2: does not divide train.segment_steps=3"]),
    ({"data": {"resolution": 20}, "model": {"channel_mult": [1, 2, 2, 2]}},
     ["data.resolution=20: not supported by a UNet with 4 levels", "multiple of 8"]),
    ({"data": {"resolution": 8}, "model": {"channel_mult": [1, 2, 2]}}, ["data.resolution=8", "at least 16"]),
    ({"model": {"attn_resolutions": [12]}}, ["model.attn_resolutions=12: no UNet level", "[16, 8]"]),
    ({"data": {"kind": "folder"}}, ["data.path: required when data.kind is folder"]),
    ({"data": {"labels": "none"}}, ["model.class_conditional=true: needs class labels"]),
    ({"sample": {"class_labels": "all"}}, ['sample.class_labels="all": use balanced or a class index']),
    ({"run": {"name": "my run"}}, ['run.name="my run"', "no spaces or shell characters"]),
    ({"run": {"name": "a;rm -rf x"}}, ['run.name="a;rm -rf x"', "no spaces or shell characters"]),
    ({"run": {"name": "$(x)"}}, ['run.name="$(x)"', "no spaces or shell characters"]),
    ({"run": {"name": "../up"}}, ['run.name="../up"', "only letters, digits"]),
    ({"run": {"name": "x" * 101}}, ["run.name=", "must have at most 100 characters"]),
    ({"data": 5}, ["data=5: wrong type; expected object"]),
    ({"fid": {"pick_model": "models/pick"}}, ["fid.pick_model", "a text run's (data.captions)"]),
    ({"model": {"class_conditional": False}, "fid": {"classifier": "models/vit"}},
     ["fid.classifier", "a class-conditional run's (model.class_conditional) or a text run's"]),
]


@pytest.mark.parametrize("overrides, expect", BAD, ids=[f"{i:02d}" for i in range(len(BAD))])
def test_bad_config_gives_one_line_naming_file_key_and_fix(write_config, overrides, expect):
    path = write_config(overrides)
    with pytest.raises(UserError) as e:
        config.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ")
    for part in expect:
        assert part in msg


def test_later_files_override_earlier_ones(write_config, tmp_path):
    base = write_config({"train": {"lr": 0.01, "grad_clip": 2.0}})
    over = tmp_path / "over.yaml"
    over.write_text("train:\n  lr: 0.05\ndata:\n  count: 7\n")
    cfg = config.load([base, over])
    assert cfg.train.lr == 0.05 and cfg.train.grad_clip == 2.0 and cfg.data.count == 7 and cfg.data.resolution == 16
    reverse = config.load([over, base])
    assert reverse.train.lr == 0.01


def test_error_in_layered_files_names_both(write_config, tmp_path):
    over = tmp_path / "over.yaml"
    over.write_text("train:\n  batch_size: 0\n")
    with pytest.raises(UserError, match=r"config\.yaml, .*over\.yaml: train\.batch_size=0"):
        config.load([write_config(), over])


def test_validate_cli_prints_the_filled_config_as_yaml(write_config, tmp_path):
    base = write_config()
    over = tmp_path / "over.yaml"
    over.write_text("train: {lr: 0.05}\n")
    p = run_cli("validate", "--config", base, "--config", over)
    printed = yaml.safe_load(p.stdout)
    assert printed == config.load([base, over]).to_dict()
    assert printed["train"]["lr"] == 0.05 and printed["train"]["optimizer"] == "adam"


def test_bad_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("run:\n  name: x\ndata: [1, 2\ntrain: {}\n")
    with pytest.raises(UserError, match=r"broken\.yaml: not valid YAML at line \d+; fix the syntax"):
        config.load(path)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(UserError, match=r"nope\.yaml: config file not found"):
        config.load(tmp_path / "nope.yaml")


def test_config_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match=r"list\.yaml: the config must be a mapping"):
        config.load(path)


def test_segment_ends_and_snapshot_steps(write_config):
    cfg = config.load(write_config({"train": {"total_steps": 10, "segment_steps": 4, "snapshot_every": 2}}))
    assert config.segment_ends(cfg) == [4, 8, 10]
    assert config.snapshot_steps(cfg, 4, 8) == [6, 8]
    assert config.snapshot_steps(cfg, 8, 10) == [10]


def test_section_hash_follows_only_its_sections(write_config):
    a = config.load(write_config({"train": {"lr": 0.01}}))
    b = config.load(write_config({"train": {"lr": 0.02}}))
    assert config.section_hash(a, "data") == config.section_hash(b, "data")
    assert config.section_hash(a, "train") != config.section_hash(b, "train")


def test_trajectory_hash_ignores_launch_settings_and_run_length_unless_cosine():
    from diffrelay import config

    base = {"train": {"total_steps": 100, "segment_steps": 50}}
    h = config.trajectory_hash(config.Config(config.validate(base)))
    relaunched = {"train": {"total_steps": 200, "segment_steps": 20, "nproc_per_node": 4, "batch_size": 64,
                            "log_every": 7, "threads": 2}}
    assert config.trajectory_hash(config.Config(config.validate(relaunched))) == h
    assert config.trajectory_hash(config.Config(config.validate({"train": {"lr": 0.5}}))) != h
    cos = {"train": {"lr_schedule": "cosine", "total_steps": 100, "segment_steps": 50}}
    longer = {"train": {"lr_schedule": "cosine", "total_steps": 200, "segment_steps": 50}}
    assert config.trajectory_hash(config.Config(config.validate(cos))) != config.trajectory_hash(
        config.Config(config.validate(longer)))


def test_patterns_do_not_let_a_trailing_newline_through():
    """Python's `$` also matches before a final newline, so "name\\n" passed `^...$` (jsonschema searches
    with `re`); every pattern of the schema must be anchored at the very end."""
    def patterns(node):
        if isinstance(node, dict):
            yield from ([node["pattern"]] if isinstance(node.get("pattern"), str) else [])
            for v in node.values():
                yield from patterns(v)
        elif isinstance(node, list):
            for v in node:
                yield from patterns(v)

    found = list(patterns(config.load_schema()))
    assert found
    for p in found:
        assert p.endswith((r"(?!\n)$", r"\Z")), p
    with pytest.raises(UserError, match="run.name"):
        config.validate({"run": {"name": "nl\n"}})
    assert config.validate({"run": {"name": "ok.name-1"}})["run"]["name"] == "ok.name-1"


def test_tensorboard_without_the_package_is_refused_when_the_config_is_read(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(UserError, match="train.tensorboard=true: the tensorboard package is not installed"):
        config.validate({"train": {"tensorboard": True}})
    assert config.validate({"train": {"tensorboard": False}})["train"]["tensorboard"] is False


@pytest.mark.parametrize("base, change, same", [
    # Keys a run does not use: a UNet setting in a DiT run or one the UNet's kwargs/preset sets again; a
    # generator setting (count, seed) in a folder run; a folder setting in a generated run.
    ({"model": {"arch": "dit"}}, {"model": {"channels": 64, "dropout": 0.1}}, True),
    ({"model": {"kwargs": {"preset": "cifar10"}}}, {"model": {"channels": 64, "channel_mult": [1, 2]}}, True),
    ({"model": {"kwargs": {"channels": 16}}}, {"model": {"channels": 64}}, True),
    ({"data": {"kind": "folder", "path": "imgs"}}, {"data": {"count": 10, "seed": 3}}, True),
    ({}, {"data": {"path": "imgs", "on_corrupt": "skip"}}, True),
    # Keys it does use.
    ({}, {"model": {"channels": 64}}, False),
    ({"model": {"kwargs": {"channels": 16}}}, {"model": {"dropout": 0.1}}, False),
    ({}, {"data": {"count": 10}}, False),
    ({"data": {"kind": "folder", "path": "imgs"}}, {"data": {"path": "other"}}, False),
    ({"model": {"arch": "dit"}}, {"model": {"kwargs": {"depth": 3}}}, False),
])
def test_only_settings_that_change_the_run_are_its_identity(base, change, same):
    a = config.Config(config.validate(base))
    b = config.Config(config.validate(deep_merge(base, change)))
    assert (config.trajectory_hash(a) == config.trajectory_hash(b)) is same
    assert (config.data_hash(a) == config.data_hash(b)) is (same or "data" not in change)


def test_a_run_that_sets_no_unused_key_keeps_the_hash_every_key_gave():
    """The hash written by earlier versions (every key as given) is unchanged for a run that never set a key
    it does not use, so such runs keep their identity with no help; others are matched by run_hash."""
    for over in ({}, {"model": {"arch": "dit"}}, {"data": {"kind": "folder", "path": "x"}},
                 {"model": {"kwargs": {"preset": "cifar10"}}}):
        d = config.validate(over)
        assert config.trajectory_hash(config.Config(d)) == identity.digest(identity.trajectory_of(d))
    d = config.validate({"model": {"arch": "dit", "channels": 64}})
    old = {"trajectory": identity.digest(identity.trajectory_of(d)), "config": d}
    assert old["trajectory"] != config.trajectory_hash(config.Config(d))
    assert config.is_same_run(old, config.trajectory_hash(config.Config(config.validate({"model": {"arch": "dit"}}))))
    assert not config.is_same_run(old, config.trajectory_hash(config.Config(config.validate({}))))


def test_the_packages_own_anchored_patterns_end_at_the_very_end():
    """The same mistake in code: re.compile("^...$") with .match accepts "step_0000040\\n" (a --pool id, a
    checkpoint folder, a PNG name). YAML's float resolver is PyYAML's own rule and reads plain scalars only."""
    import re
    from pathlib import Path

    src = Path(config.__file__).parents[1]
    found = []
    for path in src.rglob("*.py"):
        for m in re.finditer(r"re\.compile\(r?f?\"(\^[^\"]*)\"", path.read_text()):
            if path.name != "yamlfile.py":
                found.append((path.name, m.group(1)))
    assert len(found) >= 8
    assert [f for f in found if not f[1].endswith(r"\Z")] == []
    from diffrelay.runtime import gpus
    from diffrelay.training import checkpoint

    assert checkpoint.STEP_DIR.match("step_0000040") and not checkpoint.STEP_DIR.match("step_0000040\n")
    assert not gpus.UUID.match("GPU-abc\n")


@pytest.mark.parametrize("over, key", [
    ({"run": {"results": "-rf"}}, "run.results"), ({"run": {"resources": "-x"}}, "run.resources"),
    ({"data": {"kind": "folder", "path": "-imgs"}}, "data.path"),
    ({"data": {"encoder": "sd-vae", "encoder_path": "-vae"}}, "data.encoder_path"),
    ({"sample": {"snapshot": "-s.safetensors"}}, "sample.snapshot"), ({"sample": {"guide": "-g"}}, "sample.guide"),
    ({"fid": {"extractor": "-e.pt"}}, "fid.extractor"), ({"fid": {"extractors": ["random", "-e.pt"]}}, "fid.extractors"),
    ({"fid": {"reference": "-r.npz"}}, "fid.reference"), ({"fid": {"reference": {"random": "-r.npz"}}}, "fid.reference.random"),
    ({"run": {"results": "res\nults"}}, "run.results"), ({"run": {"resources": "a\tb"}}, "run.resources"),
    ({"data": {"kind": "folder", "path": "imgs\r"}}, "data.path"), ({"fid": {"reference": "r\x7f.npz"}}, "fid.reference"),
    ({"data": {"kind": "folder", "path": "i", "captions": "auto", "val_path": "held\nout"}}, "data.val_path"),
])
def test_a_path_starting_with_a_dash_or_holding_a_control_character_is_one_line(over, key):
    """'-rf' passed validation and failed inside Snakemake as an argparse error; a newline made folder names."""
    with pytest.raises(UserError) as e:
        config.validate(over)
    line = str(e.value)
    assert "\n" not in line and f"config: {key}=" in line, line
    assert ("reads as an option" in line and "./-" in line) or "control character" in line, line
    assert config.validate({"run": {"results": "./-rf", "resources": "out/re-sources"}})


# ---- the held-out split and the image counts the later stages need, when the config is read ------------------

def images(folder, n):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(folder / f"{i:03d}.png")
    return folder


def text_run(tmp_path, data=None, fid=None, **over):
    """A text run's config (the encoder folder is not read by these checks) over a 16-image folder."""
    d = {"run": {"name": "t", "device": "cpu", "results": str(tmp_path / "results")},
         "data": {"kind": "folder", "path": str(images(tmp_path / "imgs", 16)), "resolution": 16, "labels": "none",
                  "captions": "auto", "text_encoders": [{"path": str(tmp_path / "enc")}], **(data or {})},
         "model": {"arch": "diffusers-unet", "class_conditional": False},
         "fid": {"extractor": "random", "ref_images": 0, **(fid or {})}, **over}
    return config.Config(config.validate(d, source="c.yaml"))


def refused(cfg) -> str:
    with pytest.raises(UserError) as e:
        preflight.check_inputs(cfg, "c.yaml")  # where data.path is checked: validate, prepare and the Snakefile's parse
    line = str(e.value)
    assert "\n" not in line and (line.startswith("c.yaml: ") or ".yaml: " in line), line
    return line


@pytest.mark.parametrize("data, fid, expect", [
    # the hostile pass's case: one held-out image, and fid-ref refused it after segment 1 had trained
    ({"val_fraction": 0.01}, {"metrics": ["fid", "val_loss"]},
     ["data.val_fraction=0.01: holds out 1 of the 16 images of data.path", "(fid-ref) need at least 2",
      "raise data.val_fraction to 0.1 or more", "data.val_path"]),
    ({"val_fraction": 0.15}, {"metrics": ["fid", "precision"]},
     ["holds out 2 of the 16", "need at least 4 (precision/recall", "raise data.val_fraction to 0.22"]),
    ({"val_path": "one"}, {}, ["data.val_path=", "1 image, and the held-out images' reference statistics",
                               "put at least 2 images in data.val_path"]),
    ({"val_path": "one"}, {"metrics": ["fid", "recall"]}, ["1 image", "at least 4"]),
])
def test_a_held_out_split_too_small_for_its_users_is_refused_when_the_config_is_read(tmp_path, data, fid, expect):
    images(tmp_path / "one", 1)
    if data.get("val_path"):
        data = data | {"val_path": str(tmp_path / data["val_path"])}
    line = refused(text_run(tmp_path, data, fid))
    for part in expect:
        assert part in line, (part, line)
    if "val_fraction" in data:  # the fix it names is enough
        least = float(line.split("raise data.val_fraction to ")[1].split(" ")[0])
        preflight.check_inputs(text_run(tmp_path, {"val_fraction": least}, fid), "c.yaml")


def test_every_count_a_later_stage_needs_is_checked_when_the_config_is_read(tmp_path):
    shapes = {"kind": "shapes", "count": 8, "captions": "auto", "val_fraction": 0.01}
    del_path = {"path": None}
    line = refused(text_run(tmp_path, {**shapes, **del_path}))
    assert "holds out 1 of the 8 images of data.count" in line and "raise data.count" in line, line
    assert "fid.ref_images=1: FID needs at least 2" in refused(text_run(tmp_path, {"val_fraction": 0.5},
                                                                         {"ref_images": 1}))
    line = refused(text_run(tmp_path, {"val_fraction": 0.5}, {"metrics": ["fid", "precision"]},
                            sample={"num_images": 3}))
    assert "sample.num_images=3: FID needs at least 4 images (precision/recall" in line, line
    (tmp_path / "p.yaml").write_text("- {prompt: a red circle}\n")
    line = refused(text_run(tmp_path, {"val_fraction": 0.5}, sample={"prompts": str(tmp_path / "p.yaml")}))
    assert line.startswith(f"{tmp_path / 'p.yaml'}: 1 image in all") and "sample.prompts" in line, line
    # enough everywhere: 4 of 16 held out for precision's 4
    preflight.check_inputs(text_run(tmp_path, {"val_fraction": 0.25}, {"metrics": ["fid", "precision"]}), "c.yaml")


@pytest.mark.parametrize("case, expect", [("missing", "folder not found"), ("file", "is not a folder"),
                                          ("empty", "no images found")])
def test_a_mistyped_or_empty_val_path_is_refused_when_the_config_is_read(tmp_path, case, expect):
    """It passed validate and snakemake -n (validate warned of a 0-image reference); only prepare refused."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    line = refused(text_run(tmp_path, {"val_path": str(tmp_path / case)}))
    assert f"data.val_path={tmp_path / case}: {expect}" in line, line


def test_validate_counts_only_the_images_data_on_corrupt_skip_will_write(tmp_path):
    """It said 31 images where prepare wrote 24: the note counts what prepare decodes and says what it skips."""
    from diffrelay.evaluation import refsize

    root = images(tmp_path / "imgs", 5)
    (root / "garbage.png").write_bytes(b"not an image")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(tmp_path / "n.png")
    (root / "half.png").write_bytes((tmp_path / "n.png").read_bytes()[:400])  # its header whole, its pixels cut
    d = {"run": {"name": "t", "device": "cpu", "results": str(tmp_path / "results")},
         "data": {"kind": "folder", "path": str(root), "resolution": 16, "labels": "none", "on_corrupt": "skip"},
         "model": {"class_conditional": False}, "fid": {"extractor": "random"}}
    cfg = config.Config(config.validate(d))
    count, said = inputs.reference_counter(cfg)
    notes = refsize.config_notes(cfg.to_dict(), count, tmp_path / "results" / "t" / "dataset")
    assert len(notes) == 1 and "has 5 images for its 128 features" in notes[0], notes
    [line] = said(notes)
    assert f"{root}: 2 of its 7 image files will be skipped" in line and "garbage.png" in line, line
    assert "the counts above are of the 5 prepare can decode" in line
    plain = config.Config(config.validate(deep_merge(d, {"data": {"on_corrupt": "error"}})))
    assert inputs.reference_counter(plain)[0] is inputs.count_images  # error: prepare refuses them anyway
