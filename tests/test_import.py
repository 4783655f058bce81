"""`diffrelay import` and a run that trains nothing: a published checkpoint in, samples and FID out.

The checkpoints here are written by the tests in DiT's own layout, as DiT's released DiT-XL-2-256x256.pt is: a
plain state dict. Their names, shapes and fixed pos_embed are restated below from facebookresearch/DiT's
models.py, not taken from diffrelay's DiT, so a wrong key mapping or position table in diffrelay fails here."""

import pickle
import re

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO, TINY, deep_merge, run_cli
from diffrelay.training import checkpoint

# time_scale 1: DiT's code embeds its time input as it is (import refuses a DiT checkpoint for another scale).
KW = {"patch": 4, "depth": 2, "hidden_size": 32, "num_heads": 2, "out_channels": 6, "time_scale": 1}
MODEL = {"arch": "dit", "kwargs": KW, "class_conditional": True}


def dit_shapes(classes=3, in_channels=3, resolution=16, patch=4, depth=2, hidden_size=32, out_channels=6,
               mlp_ratio=4.0, **_) -> dict:
    """DiT's models.py state dict, name -> shape: PatchEmbed's conv (x_embedder.proj), TimestepEmbedder's MLP on
    256 frequencies (t_embedder.mlp.0/.2), LabelEmbedder's table with its null row (class_dropout_prob > 0), the
    frozen pos_embed parameter, per block timm's Attention (qkv, proj) and Mlp (fc1, fc2) and adaLN_modulation.1,
    and FinalLayer's linear and adaLN_modulation.1. Its LayerNorms have no weights (elementwise_affine=False).
    classes 0 (no table) is diffrelay's unconditional network; DiT itself has none."""
    h, p, f, o = hidden_size, patch, int(hidden_size * mlp_ratio), patch * patch * out_channels
    shapes = {"pos_embed": (1, (resolution // p) ** 2, h),
              "x_embedder.proj.weight": (h, in_channels, p, p), "x_embedder.proj.bias": (h,),
              "t_embedder.mlp.0.weight": (h, 256), "t_embedder.mlp.0.bias": (h,),
              "t_embedder.mlp.2.weight": (h, h), "t_embedder.mlp.2.bias": (h,)}
    if classes:
        shapes["y_embedder.embedding_table.weight"] = (classes + 1, h)
    for i in range(depth):
        shapes |= {f"blocks.{i}.{k}": s for k, s in {
            "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,), "attn.proj.weight": (h, h),
            "attn.proj.bias": (h,), "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,), "mlp.fc2.weight": (h, f),
            "mlp.fc2.bias": (h,), "adaLN_modulation.1.weight": (6 * h, h), "adaLN_modulation.1.bias": (6 * h,)}.items()}
    return shapes | {"final_layer.linear.weight": (o, h), "final_layer.linear.bias": (o,),
                     "final_layer.adaLN_modulation.1.weight": (2 * h, h), "final_layer.adaLN_modulation.1.bias": (2 * h,)}


def dit_pos_embed(hidden: int, grid: int) -> torch.Tensor:
    """DiT's get_2d_sincos_pos_embed, tokens row by row: its meshgrid puts the width first, so the first half of
    the features encodes the token's column and the second its row, each sin then cos of pos x 10000^(-j/(D/4));
    float64 numpy, stored as float32."""
    quarter = hidden // 4
    omega = 1.0 / 10000 ** (np.arange(quarter, dtype=np.float64) / quarter)
    row, col = np.divmod(np.arange(grid * grid), grid)
    a, b = col[:, None] * omega, row[:, None] * omega
    return torch.from_numpy(np.concatenate([np.sin(a), np.cos(a), np.sin(b), np.cos(b)], axis=1)).float()[None]


def official_state(classes=3, seed=0, **kwargs) -> dict:
    """A tiny DiT's weights under DiT's names, every tensor random (so a wrong mapping shows)."""
    torch.manual_seed(seed)
    kw = KW | kwargs
    out = {k: torch.randn(s) for k, s in dit_shapes(classes, **kw).items()}
    out["pos_embed"] = dit_pos_embed(kw["hidden_size"], 16 // kw["patch"])
    return out


def setup_in(tmp_path):
    def write(state, name="DiT-tiny.pt", overrides=None):
        ckpt = tmp_path / name
        torch.save(state, ckpt)
        d = deep_merge(deep_merge(TINY, {"model": MODEL, "run": {"results": str(tmp_path / "results"),
                                                                  "resources": str(tmp_path / "res")}}),
                       overrides or {})
        cfg = tmp_path / "config.yaml"
        cfg.write_text(yaml.safe_dump(d, sort_keys=False))
        return ckpt, cfg

    return write


@pytest.fixture
def setup(tmp_path):
    return setup_in(tmp_path)


def test_import_keeps_every_weight_and_the_network_gives_dits_output(setup, tmp_path):
    state = official_state()
    ckpt, cfg = setup(state)
    out = tmp_path / "imported.safetensors"
    p = run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", out)
    assert "sample.snapshot" in p.stdout
    net, meta = checkpoint.load_snapshot(out, model_cfg=MODEL | {"sigma_data": 0.5, "objective": "edm"})
    assert meta["imported"]["layout"] == "dit" and meta["num_classes"] == 3 and meta["dit_layout"] == 2
    ours = net.net.state_dict()
    assert torch.equal(ours["blocks.1.qkv.weight"], state["blocks.1.attn.qkv.weight"])
    assert torch.equal(ours["class_emb.weight"], state["y_embedder.embedding_table.weight"])
    assert torch.equal(ours["out.weight"], state["final_layer.linear.weight"])
    assert torch.equal(net.net.pos, state["pos_embed"])  # the columns-first table is DiT's


def test_a_dit_training_checkpoint_gives_its_ema(setup, tmp_path):
    ema, model = official_state(seed=1), official_state(seed=2)
    ckpt, cfg = setup({"model": model, "ema": ema})
    out = tmp_path / "i.safetensors"
    run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", out)
    tensors, _ = checkpoint.read_snapshot(out)
    assert torch.equal(tensors["ema.net.blocks.0.ada.weight"], ema["blocks.0.adaLN_modulation.1.weight"])
    assert not any(k.startswith("raw.") for k in tensors)


def bad(setup, tmp_path, state=None, raw=None, overrides=None, name="x.pt"):
    ckpt, cfg = setup(state if state is not None else official_state(), name=name, overrides=overrides)
    if raw is not None:
        ckpt.write_bytes(raw)
    out = tmp_path / "o.safetensors"
    p = run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", out, check=False)
    assert p.returncode == 2 and not out.exists(), p.stderr
    line = p.stderr.strip()
    assert len(line.splitlines()) == 1 and str(ckpt) in line, line
    return line


def test_a_pickle_is_refused_unread(setup, tmp_path):
    marker = tmp_path / "ran"

    class Runs:  # what EDM's .pkl files are: objects whose unpickling calls code
        def __reduce__(self):
            return (open, (str(marker), "w"))

    line = bad(setup, tmp_path, raw=pickle.dumps({"ema": Runs()}), name="network-snapshot.pkl")
    assert "pickle" in line and "runs code" in line
    assert not marker.exists()


def test_objects_beyond_tensors_are_refused_with_one_line(setup, tmp_path):
    import argparse

    line = bad(setup, tmp_path, state={"ema": official_state(), "args": argparse.Namespace(lr=1)})
    assert "weights_only" in line and "state dict" in line


def test_missing_and_extra_keys_are_named(setup, tmp_path):
    state = official_state()
    del state["blocks.1.attn.qkv.weight"]
    state["vae.decoder.weight"] = torch.zeros(1)
    line = bad(setup, tmp_path, state=state)
    assert re.search(r"1 missing \(blocks\.1\.qkv\.weight\); 1 unexpected \(vae\.decoder\.weight\)", line), line


def test_a_checkpoint_of_another_size_is_named_with_the_fix(setup, tmp_path):
    line = bad(setup, tmp_path, state=official_state(hidden_size=48, num_heads=2))
    assert "another size" in line and "model.kwargs" in line


def test_another_class_count_is_named(setup, tmp_path):
    line = bad(setup, tmp_path, state=official_state(classes=1000))
    assert "class_emb.weight" in line and "3 classes" in line and "[1001, 32]" in line


def test_an_unconditional_checkpoint_imports(setup, tmp_path):
    state = {k: v for k, v in official_state(classes=0).items()}
    ckpt, cfg = setup(state, overrides={"model": {"class_conditional": False}})
    out = tmp_path / "u.safetensors"
    run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", out)
    assert checkpoint.read_signed_meta(out, checkpoint.SNAPSHOT_FORMAT, "snapshot")["num_classes"] == 0


def test_a_latent_checkpoint_is_named_as_one(setup, tmp_path):
    state = {k: torch.zeros(s) for k, s in dit_shapes(in_channels=4, **(KW | {"out_channels": 8})).items()}
    line = bad(setup, tmp_path, state=state)  # the same names, 4-channel shapes
    assert "a latent model (4 input channels" in line


def test_the_out_file_of_someone_else_is_not_overwritten(setup, tmp_path):
    ckpt, cfg = setup(official_state())
    out = tmp_path / "mine.safetensors"
    out.write_text("not yours")
    p = run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", out, check=False)
    assert p.returncode == 2 and out.read_text() == "not yours"


def snakemake(work, cfg, *args, check=True):
    return run_cli("snakemake", "--snakefile", REPO / "Snakefile", "--directory", work, "--cores", 2,
                   "--configfile", cfg, *args, check=check, timeout=900)


# DiT's own objective: eps over 1000 steps, its timesteps embedded as they are, its 250-step sampler (shortened)
DDPM = {"model": {"objective": "ddpm", "kwargs": KW | {"time_scale": 1}}, "sample": {"solver": "ddpm", "steps": 6}}


@pytest.mark.parametrize("overrides", [None, DDPM], ids=["edm", "ddpm"])
def test_a_run_naming_an_imported_snapshot_samples_and_scores_it_and_trains_nothing(setup, tmp_path, overrides):
    state = official_state()
    if overrides is not None:  # weights of DiT's scale, so the learned variance half stays near [-1, 1] as trained
        state = {k: v if k == "pos_embed" else v * 0.05 for k, v in state.items()}
    ckpt, cfg = setup(state, overrides=overrides)
    out = tmp_path / "imported.safetensors"
    run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", out, "--step", 7000)
    d = yaml.safe_load(cfg.read_text())
    d["sample"]["snapshot"] = str(out)
    cfg.write_text(yaml.safe_dump(d))
    p = snakemake(tmp_path, cfg)
    text = p.stdout + p.stderr
    ran = set(re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", text))
    assert "train_segment" not in ran and {"sample_snapshot", "compute_fid", "build_report"} <= ran, ran
    run = tmp_path / "results" / "tiny"
    rows = (run / "report" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("7000,"), rows
    assert not (run / "checkpoints").exists()
    assert len(list((run / "samples" / "step_0007000").glob("*.png"))) >= 8


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """official_state() imported once under the tiny config: the tests below change the config after the import."""
    tmp = tmp_path_factory.mktemp("imported")
    ckpt, cfg = setup_in(tmp)(official_state())
    run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", tmp / "imported.safetensors")
    return tmp / "imported.safetensors"


@pytest.mark.parametrize("change, words", [
    ({"data": {"resolution": 32}}, "data.resolution"),
    ({"model": {"kwargs": KW | {"depth": 3}}}, "model.kwargs"),
    ({"sample": {"phema": [0.1]}, "train": {"phema": {"every": 3}}}, "sample.phema"),
    ({"sample": {"guide": 3}}, "sample.guide names a step"),
    ({"sample": {"weights": "raw"}}, "sample.weights: ema"),
    ({"sample": {"ema_decay": 0.999}}, "sample.ema_decay [0.999]"),
    ({"sample": {"guidance": 1.5}, "train": {"label_dropout": 0.1}}, "train.label_dropout 0"),
    ("trained", "holds a trained run"),
])
def test_a_snapshot_that_does_not_fit_the_config_stops_the_run_before_any_job(setup, tmp_path, imported, change,
                                                                             words):
    _, cfg = setup(official_state())
    out = imported
    if change == "trained":
        (tmp_path / "results" / "tiny" / "checkpoints" / "step_0000003").mkdir(parents=True)
        change = {}
    d = deep_merge(yaml.safe_load(cfg.read_text()), change)
    d["sample"]["snapshot"] = str(out)
    cfg.write_text(yaml.safe_dump(d))
    p = snakemake(tmp_path, cfg, "--dry-run", check=False)
    assert p.returncode != 0
    line = [x for x in p.stderr.splitlines() if x.startswith("diffrelay: error:")]
    assert len(line) == 1 and "sample.snapshot" in line[0] and words in line[0], p.stderr[-800:]


def test_train_refuses_a_run_that_evaluates_a_snapshot(setup, tmp_path):
    ckpt, cfg = setup(official_state())
    d = yaml.safe_load(cfg.read_text())
    d["sample"]["snapshot"] = str(tmp_path / "any.safetensors")
    cfg.write_text(yaml.safe_dump(d))
    p = run_cli("train", "--config", cfg, "--until-step", 3, check=False)
    assert p.returncode == 2 and "trains nothing" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results" / "tiny" / "checkpoints").exists()


@pytest.mark.parametrize("cut", ["empty", "truncated"])
def test_an_empty_or_truncated_checkpoint_is_named_as_such_not_a_pickle(setup, tmp_path, cut):
    ckpt, _ = setup(official_state())
    whole = ckpt.read_bytes()
    line = bad(setup, tmp_path, raw=b"" if cut == "empty" else whole[:len(whole) // 2])
    assert "pickle" not in line and ("is empty" if cut == "empty" else "truncated") in line, line
    assert "download it again" in line or "save it again" in line, line


def test_a_step_past_the_largest_a_run_can_have_is_one_line(setup, tmp_path):
    ckpt, cfg = setup(official_state())
    out = tmp_path / "o.safetensors"
    p = run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", out, "--step", 99999999, check=False)
    line = p.stderr.strip()
    assert p.returncode == 2 and len(line.splitlines()) == 1 and not out.exists(), p.stderr
    assert "--step 99999999" in line and "at most 9999999" in line and str(cfg) in line, line
    run_cli("import", "--config", cfg, "--checkpoint", ckpt, "--out", out, "--step", 9999999)
    assert checkpoint.read_snapshot(out)[1]["step"] == 9999999
