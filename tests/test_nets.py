"""Networks by name: built-in sizes, a network from outside the package, the config (not a file) choosing code."""

import dataclasses
import importlib
import inspect
import json
import os
import shutil
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import REPO, run_cli
from diffrelay import config, io
from diffrelay.data import augment
from diffrelay.objectives import edm
from diffrelay.sampling import sample
from diffrelay.training import checkpoint
from diffrelay.errors import UserError
from diffrelay import nets
from diffrelay.nets import dit, edm2, registry, unet
from diffrelay.nets import edm as edm_nets

FIXTURES = REPO / "tests" / "fixtures"
CUSTOM = {"arch": "diffrelay_test_net:build", "kwargs": {"width": 8}}
TINY_DIT = {"arch": "dit", "kwargs": {"patch": 4, "depth": 2, "hidden_size": 32, "num_heads": 2}}


@pytest.fixture
def fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")]))


# --- sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("size, paper", [("S", 33.0e6), ("B", 130.5e6), ("L", 458.0e6), ("XL", 675.1e6)])
def test_dit_parameter_counts_match_the_paper_within_one_percent(size, paper):
    # Table 1 of Peebles & Xie 2023: /2 patches of a 32x32x4 latent, 1000 classes (plus the null class).
    with torch.device("meta"):
        n = registry.num_params(dit.build(32, 4, 1000, size=size, patch=2))
    assert abs(n - paper) / paper < 0.01, (size, n)


@pytest.mark.parametrize("size, published", [("S", 32_963_360), ("B", 130_512_416), ("L", 458_102_816),
                                             ("XL", 675_129_632)])
def test_dit_with_learned_sigma_has_exactly_the_published_parameter_count(size, published):
    """DiT's count (its README: DiT-XL/2 675,129,632 at 4x32x32, 1000 classes) has the learned-sigma output (8
    channels) and the fixed position table, which DiT stores as a frozen parameter."""
    with torch.device("meta"):
        net = dit.build(32, 4, 1000, size=size, patch=2, out_channels=8)
    assert registry.num_params(net) == published
    assert registry.num_params(net) - sum(p.numel() for p in net.parameters()) == 256 * dit.SIZES[size][1]


def test_dit_position_table_puts_the_column_first_as_dit_does():
    """Restated: token k = (row i, column j) of a g x g grid, omega_m = 10000^(-m / (D/4)); features
    [sin(j w), cos(j w), sin(i w), cos(i w)] (DiT's meshgrid puts the width coordinate first)."""
    g, d = 5, 16
    table = dit._sincos_2d(g, d).double()
    omega = 10000.0 ** (-torch.arange(d // 4, dtype=torch.float64) / (d // 4))
    for k in range(g * g):
        i, j = divmod(k, g)
        want = torch.cat([torch.sin(j * omega), torch.cos(j * omega), torch.sin(i * omega), torch.cos(i * omega)])
        torch.testing.assert_close(table[k], want.float().double(), rtol=0, atol=0)
    rows = dit._sincos_2d(g, d, columns_first=False)
    assert torch.equal(rows, torch.cat([table[:, d // 2:], table[:, :d // 2]], dim=1).float())


def test_dit_starts_as_dit_initialises():
    torch.manual_seed(0)
    net = dit.build(16, 3, 1000, depth=2, hidden_size=256, num_heads=4)
    assert 0.018 < float(net.class_emb.weight.detach().std()) < 0.022  # not nn.Embedding's N(0, 1)
    assert 0.018 < float(net.noise_emb.mlp[0].weight.detach().std()) < 0.022
    zero = [net.ada_out, net.out, *[b.ada for b in net.blocks]]
    assert all(not layer.weight.any() and not layer.bias.any() for layer in zero)
    fan = net.blocks[0].qkv.weight.shape
    bound = (6 / (fan[0] + fan[1])) ** 0.5  # xavier-uniform
    assert float(net.blocks[0].qkv.weight.detach().abs().max()) <= bound and not net.blocks[0].qkv.bias.any()
    assert float(net.blocks[0].qkv.weight.detach().abs().max()) > 0.9 * bound


def test_dit_learned_sigma_layout_returns_the_first_half_and_loads_dits_names():
    """out_channels 2C: the output layer's rows are (p, q, channel), channel fastest; dropping the rows of
    channels C..2C-1 gives the C-channel network, whose output is what the 2C one returns. DiT's own
    state-dict names (written out here) load through official_keys."""
    torch.manual_seed(0)
    big = dit.build(8, 3, 4, patch=2, depth=1, hidden_size=32, num_heads=2, out_channels=6)
    with torch.no_grad():
        for p in big.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    small = dit.build(8, 3, 4, patch=2, depth=1, hidden_size=32, num_heads=2)
    keep = torch.tensor([r for r in range(2 * 2 * 6) if r % 6 < 3])
    state = big.state_dict() | {"out.weight": big.out.weight[keep], "out.bias": big.out.bias[keep]}
    small.load_state_dict(state)
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([0.1, -0.4]), torch.tensor([1, 4])
    assert torch.equal(big(x, t, y), small(x, t, y)) and big(x, t, y).shape == (2, 3, 8, 8)
    rename = {"embed": "x_embedder.proj", "noise_emb.mlp": "t_embedder.mlp", "class_emb": "y_embedder.embedding_table",
              "out": "final_layer.linear", "ada_out": "final_layer.adaLN_modulation.1",
              "blocks.0.qkv": "blocks.0.attn.qkv", "blocks.0.proj": "blocks.0.attn.proj",
              "blocks.0.mlp.0": "blocks.0.mlp.fc1", "blocks.0.mlp.2": "blocks.0.mlp.fc2",
              "blocks.0.ada": "blocks.0.adaLN_modulation.1"}
    theirs = {"pos_embed": big.pos.clone()}
    for k, v in big.state_dict().items():
        prefix = max((p for p in rename if k.startswith(p + ".")), key=len)
        theirs[rename[prefix] + k[len(prefix):]] = v
    assert "blocks.0.attn.qkv.weight" in theirs and "y_embedder.embedding_table.weight" in theirs
    again = dit.build(8, 3, 4, patch=2, depth=1, hidden_size=32, num_heads=2, out_channels=6)
    again.load_state_dict(dit.official_keys(theirs))  # strict: every key, none left over
    assert torch.equal(again(x, t, y), big(x, t, y))
    with pytest.raises(ValueError, match="out_channels=5: 3 .* or 6"):
        dit.build(8, 3, 4, depth=1, hidden_size=32, num_heads=2, out_channels=5)


def test_a_dit_snapshot_from_before_dit_layout_2_samples_with_its_own_rows_first_table(tmp_path):
    """Snapshots record dit_layout; one without it was trained with the rows-first table and loads with it,
    so runs made before keep sampling what they trained. A DiT run's identity names its layout."""
    d = config.validate({"data": {"resolution": 16}, "model": TINY_DIT | {"class_conditional": True}})
    assert config.trajectory(d)["model"]["dit_layout"] == nets.DIT_LAYOUT
    assert "dit_layout" not in config.trajectory(config.validate({}))["model"]  # UNet runs keep their hash
    torch.manual_seed(0)
    net = edm.build(d["model"], 16, 3)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    meta = {"step": 1, "model": d["model"], "config": d, "image_shape": [3, 16, 16], "num_classes": 3,
            "class_names": ["a", "b", "c"]}
    old = checkpoint.save_snapshot(tmp_path / "old.safetensors", net.state_dict(), {}, meta)
    new = checkpoint.save_snapshot(tmp_path / "new.safetensors", net.state_dict(), {}, meta | {"dit_layout": 2})
    assert checkpoint.load_snapshot(new)[0].net.pos.equal(net.net.pos)
    legacy = checkpoint.load_snapshot(old)[0].net
    assert torch.equal(legacy.pos[0], dit._sincos_2d(4, 32, columns_first=False)) and not legacy.pos.equal(net.net.pos)


def test_unet_cifar10_preset_is_the_size_of_edms_cifar10_network():
    model = config.validate({"data": {"resolution": 32}, "model": {"kwargs": {"preset": "cifar10"},
                                                                   "class_conditional": True}})["model"]
    n = registry.check(model, 32, 3, 10)
    assert 35e6 <= n <= 60e6, n
    assert n == 55_088_387  # the figure README states


def test_dit_patch_changes_tokens_not_the_output_shape():
    for patch in (2, 4, 8):
        net = dit.build(16, 3, 5, patch=patch, depth=1, hidden_size=16, num_heads=2)
        out = net(torch.randn(2, 3, 16, 16), torch.zeros(2), torch.tensor([0, 5]))
        assert out.shape == (2, 3, 16, 16) and net.grid == 16 // patch


# --- bad input, one line each, before any job ---------------------------------------------------

@pytest.mark.parametrize("model, words", [
    ({"arch": "no_such_module_xyz:build"}, ["cannot import module 'no_such_module_xyz'", "PYTHONPATH"]),
    ({"arch": "diffrelay_test_net:not_a_module"}, ["not a torch.nn.Module"]),
    ({"arch": "diffrelay_test_net:wrong_shape"}, ["returned (2, 3, 8, 8)", "shaped like its input"]),
    ({"arch": "diffrelay_test_net:build", "kwargs": {"depth": 3}}, ["TypeError", "depth", "model.kwargs"]),
    ({"arch": "dit", "kwargs": {"patch": 3}}, ["model.kwargs.patch=3", "does not divide data.resolution=16"]),
    ({"arch": "just_a_module"}, ["package.module:callable"]),
])
def test_bad_network_is_one_line_from_validate(model, words, write_config, fixtures_on_path):
    p = run_cli("validate", "--config", write_config({"model": model}), check=False)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and "config.yaml" in err, err
    for w in words:
        assert w in err, (w, err)


def test_guidance_for_an_unconditional_network_is_refused_by_the_config():
    with pytest.raises(UserError, match="sample.guidance=2.*class-conditional"):
        config.validate({"model": {"class_conditional": False}, "sample": {"guidance": 2}})
    with pytest.raises(UserError, match="without label dropout"):
        config.validate({"model": {"class_conditional": True}, "sample": {"guidance": [1, 2]}})
    config.validate({"model": {"class_conditional": True}, "train": {"label_dropout": 0.1},
                     "sample": {"guidance": [1, 2]}})


def test_validate_prints_the_parameter_count(write_config, fixtures_on_path):
    p = run_cli("validate", "--config", write_config({"model": CUSTOM}))
    net = registry.build_network("diffrelay_test_net:build", {"width": 8}, 16, 3, 3)
    assert f"{registry.num_params(net):,} parameters" in p.stdout


# --- the user's code: imported, built and run as user code, its failures one line naming its file --

# A tiny network under the contract; a module's source is NET plus what each test adds.
NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, in_channels, num_classes, rows=None):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, in_channels, 3, padding=1)
        self.emb = nn.Embedding(num_classes + 1 if rows is None else rows, in_channels) if num_classes else None

    def forward(self, x, c_noise, labels=None):
        h = self.conv(x)
        if self.emb is not None:
            h = h + self.emb(labels)[:, :, None, None]
        return h


def build(resolution, in_channels, num_classes):
    return Net(in_channels, num_classes)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """user_module(name, source) -> (path, line of the `# <- here` marker) of a module importable by name,
    in this process (sys.path) and in the CLI's (PYTHONPATH); forgotten again afterwards."""
    folder, names = tmp_path / "mods", []
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))

    def write(name, source):
        path = folder / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        lines = path.read_text().splitlines()
        here = [i + 1 for i, line in enumerate(lines) if "# <- here" in line]
        names.append(name)
        sys.modules.pop(name, None)
        importlib.invalidate_caches()
        return path, here[0] if here else None

    yield write
    for name in names:
        sys.modules.pop(name, None)


def _one_line_error(arch, classes=0, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        registry.check({"arch": arch, "kwargs": kwargs}, 8, 3, classes)
    message = str(e.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("source", [
    "import sys\nsys.exit(2)  # <- here\n",
    "import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--data', required=True)\n"
    "args = parser.parse_args()  # <- here\n",
], ids=["sys-exit", "argparse"])
def test_module_that_exits_or_parses_arguments_at_import_is_one_line_naming_its_line(source, user_module, capsys):
    path, line = user_module("net_exits_at_import", source + NET)
    argv = list(sys.argv)
    message = _one_line_error("net_exits_at_import:build")
    assert f"{path}:{line}: called sys.exit(2) while being imported" in message, message
    assert "a network module must not parse arguments or exit at import" in message
    assert sys.argv == argv
    out, err = capsys.readouterr()
    assert out == "" and "usage" not in err, (out, err)  # argparse's usage message is not ours to print


def test_validate_fails_with_exit_2_when_the_network_module_exits_0_at_import(user_module, write_config):
    path, line = user_module("net_exits_0", "import sys\nsys.exit()  # <- here\n" + NET)
    p = run_cli("validate", "--config", write_config({"model": {"arch": "net_exits_0:build"}}), check=False)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and p.stdout == "", (p.stdout, err)
    assert f"{path}:{line}: called sys.exit() while being imported" in err, err


def test_snakemake_stops_with_one_line_when_the_network_module_parses_arguments(user_module, write_config, tmp_path):
    path, line = user_module("net_parses_argv", "import argparse\nparser = argparse.ArgumentParser()\n"
                             "parser.add_argument('--data', required=True)\nparser.parse_args()  # <- here\n" + NET)
    cfg = write_config({"model": {"arch": "net_parses_argv:build"}})
    p = run_cli("snakemake", "--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--cores", 1, "-n",
                "--configfile", cfg, check=False)
    errors = [x for x in p.stderr.splitlines() if x.startswith("diffrelay: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stdout + p.stderr
    assert f"{path}:{line}: called sys.exit(2) while being imported" in errors[0], errors[0]
    assert "usage: snakemake" not in p.stdout + p.stderr and "Traceback" not in p.stderr


def test_what_the_network_module_prints_keeps_off_validates_stdout(user_module, write_config):
    user_module("net_prints", "print('loading my network')\n" + NET)
    p = run_cli("validate", "--config", write_config({"model": {"arch": "net_prints:build"}}))
    assert config.validate(__import__("yaml").safe_load(p.stdout))["model"]["arch"] == "net_prints:build"
    assert "loading my network" in p.stderr


BUILD_WITH = NET + """

def faulty(resolution, in_channels, num_classes, width=8):
    {line}  # <- here
    return Net(in_channels, num_classes)
"""
FORWARD_WITH = NET + """

class Faulty(Net):
    def forward(self, x, c_noise, labels=None):
        {line}  # <- here


def faulty(resolution, in_channels, num_classes):
    return Faulty(in_channels, num_classes)
"""


@pytest.mark.parametrize("source, words", [
    ("raise RuntimeError('no GPU found')  # <- here\n" + NET, ["RuntimeError: no GPU found", "while being imported"]),
    ("from torch import no_such_name  # <- here\n" + NET, ["ImportError", "no_such_name", "while being imported"]),
    ("def faulty(resolution, in_channels, num_classes:  # <- here\n    pass\n" + NET, ["SyntaxError"]),
    (BUILD_WITH.format(line="assert width % 16 == 0"), ["AssertionError", "assert width % 16 == 0", "faulty()"]),
    (BUILD_WITH.format(line="nn.Conv2d(in_channels, in_channels, 3, bias=bais)"), ["NameError", "bais"]),
    (BUILD_WITH.format(line="nn.Conv2d(in_channels, in_channels, '3' + 1)"), ["TypeError", "concatenate"]),
    (FORWARD_WITH.format(line="return self.conv(x) + self.no_such_layer"), ["AttributeError", "forward()"]),
    (FORWARD_WITH.format(line="return self.conv(x.flatten(1))"), ["RuntimeError", "forward()"]),
], ids=["raise-at-import", "bad-import-inside", "syntax-error", "assert-in-build", "name-error-in-build",
        "type-error-inside-build", "error-in-forward", "torch-raises-in-forward"])
def test_failure_of_the_users_code_is_one_line_naming_its_file_and_line(source, words, user_module):
    path, line = user_module("net_faulty", source)
    message = _one_line_error("net_faulty:faulty")
    assert f"{path}:{line}" in message, message
    for w in words:
        assert w in message, (w, message)
    assert "model.kwargs" not in message, message  # the keywords were fine; the code was not


def test_model_kwargs_are_blamed_only_when_the_builders_signature_refuses_them(user_module):
    user_module("net_signature", NET + "\n\ndef needs_width(resolution, in_channels, num_classes, width):\n"
                "    return Net(in_channels, num_classes)\n")
    message = _one_line_error("net_signature:build", depht=3)
    assert "model.kwargs" in message and "unexpected keyword argument 'depht'" in message, message
    message = _one_line_error("net_signature:needs_width")
    assert "model.kwargs" in message and "missing a required argument: 'width'" in message, message
    message = _one_line_error("net_signature:build", resolution=3)
    assert "model.kwargs.resolution: set by diffrelay itself" in message, message


@pytest.mark.parametrize("old, new, classes", [
    ("h = self.conv(x)", "if (labels == self.emb.num_embeddings - 1).all():\n            return self.conv(x)\n"
     "        h = self.conv(x)", 5),  # data-dependent Python on the labels
    ("h = self.conv(x)", "labels = torch.unique(labels, return_inverse=True)[1]\n        h = self.conv(x)", 5),
    ("def build(resolution, in_channels, num_classes):",
     "def build(resolution, in_channels, num_classes):\n    scale = torch.ones(1).item()", 0),  # .item() in build
], ids=["data-dependent-python", "op-without-meta-kernel", "item-in-build"])
def test_network_the_meta_device_cannot_run_passes_the_check(old, new, classes, user_module):
    user_module("net_not_meta", NET.replace(old, new))
    params = 3 * 3 * 9 + 3 + (classes + 1) * 3 * bool(classes)
    assert registry.check({"arch": "net_not_meta:build", "kwargs": {}}, 8, 3, classes) == params


def test_class_embedding_without_the_null_row_is_refused_naming_label_k(user_module):
    embed = "h = h + self.emb(labels)[:, :, None, None]"
    source = NET.replace(embed, embed + "  # <- here")
    path, line = user_module("net_k_rows", source + "\n\ndef k_rows(resolution, in_channels, num_classes):\n"
                             "    return Net(in_channels, num_classes, rows=num_classes)\n")
    assert registry.check({"arch": "net_k_rows:build", "kwargs": {}}, 8, 3, 10)  # num_classes + 1 rows: fine
    message = _one_line_error("net_k_rows:k_rows", classes=10)
    for w in (f"{path}:{line}", "fails on label 10 = num_classes, the null class", "IndexError",
              "must accept label num_classes as \"no class\"", "nn.Embedding(num_classes + 1, dim)"):
        assert w in message, (w, message)


# A parameter forward never uses: DDP's first step stopped with 44 lines of "Expected to have finished reduction".
UNUSED = NET.replace("self.conv = nn.Conv2d(in_channels, in_channels, 3, padding=1)",
                     "self.conv = nn.Conv2d(in_channels, in_channels, 3, padding=1)\n"
                     "        self.extra = nn.Linear(4, 4)  # made, never called") + """

def frozen(resolution, in_channels, num_classes):
    net = Net(in_channels, num_classes)
    net.extra.requires_grad_(False)  # DDP leaves a frozen parameter alone
    return net
"""


@pytest.mark.parametrize("classes, device", [(0, "cpu"), (3, "cpu"), (0, "meta")])
def test_a_parameter_forward_never_uses_is_named_in_one_line(classes, device, user_module, monkeypatch):
    user_module("net_unused", UNUSED)
    if device == "meta":  # a network too big for a real pass is checked on the meta device
        monkeypatch.setattr(registry, "CPU_CHECK_MAX_PARAM_PIXELS", 0)
    message = _one_line_error("net_unused:build", classes=classes)
    for w in ("model.arch=net_unused:build", "2 parameter(s)", "extra.bias, extra.weight", "no gradient",
              "forward", "DDP", "requires_grad_(False)"):
        assert w in message, (w, message)
    assert "conv." not in message and "emb." not in message, message
    assert registry.check({"arch": "net_unused:frozen", "kwargs": {}}, 8, 3, classes)


def test_validate_names_a_parameter_forward_never_uses(user_module, write_config):
    user_module("net_unused_cli", UNUSED)
    p = run_cli("validate", "--config", write_config({"model": {"arch": "net_unused_cli:build"}}), check=False)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and p.stdout == "", (p.stdout, err)
    assert "config.yaml" in err and "extra.bias, extra.weight" in err, err


# --- built-in networks: model.kwargs checked without torch ---------------------------------------

@pytest.mark.parametrize("arch, cls, extra, less", [
    ("unet", unet.UNet, {"preset"}, set()), ("dit", dit.DiT, set(), set()),
    ("sit", dit.SiT, set(), {"time_scale", "pos_order"}), ("edm2", edm2.EDM2UNet, {"preset"}, set()),
    ("ddpmpp", edm_nets.SongUNet, set(), set()), ("ncsnpp", edm_nets.SongUNet, set(), set()),
    ("adm", edm_nets.DhariwalUNet, set(), set())])
def test_builtin_kwargs_list_is_what_the_builder_takes(arch, cls, extra, less):
    builder = registry.BUILDERS[arch]
    takes = set(inspect.signature(builder).parameters) | set(inspect.signature(cls).parameters)
    takes = takes - {"kwargs", *nets.CONTRACT} - less | extra
    assert set(nets.BUILTIN_KWARGS[arch]) == takes
    assert set(registry.BUILDERS) == set(nets.BUILTIN)
    assert nets.EDM2_SIZES == tuple(edm2.PRESETS)


@pytest.mark.parametrize("model, key, words", [
    ({"arch": "dit", "kwargs": {"patch": 4, "hiden_size": 32}}, "model.kwargs.hiden_size",
     ["built-in dit network", "did you mean hidden_size?", "it takes size, patch, depth, hidden_size, num_heads"]),
    ({"arch": "unet", "kwargs": {"preset": "cifar10", "chanels": 64}}, "model.kwargs.chanels",
     ["built-in unet network", "did you mean channels?", "it takes preset, channels, channel_mult"]),
    ({"arch": "unet", "kwargs": {"num_classes": 10}}, "model.kwargs.num_classes", ["set by diffrelay itself"]),
    ({"arch": "dit", "kwargs": {"patch": 4, "size": "S"}}, None, []),
])
def test_builtin_kwargs_typo_is_named_without_torch(model, key, words):
    # nets is torch-free: config validation can run this at Snakefile parse time (the CLI rows are in test_bad_inputs).
    bad = nets.check_kwargs(model)
    assert [k for k, _ in bad] == ([key] if key else [])
    for w in words:
        assert w in bad[0][1], (w, bad)


# --- the config, not the snapshot, names the network -------------------------------------------

def _snapshot(path, model, label_dropout=0.0):
    d = config.validate({"data": {"resolution": 16}, "model": model | {"class_conditional": True},
                         "train": {"label_dropout": label_dropout}})
    torch.manual_seed(0)
    net = edm.build(d["model"], 16, 3)
    meta = {"step": 1, "model": d["model"], "config": d, "image_shape": [3, 16, 16], "num_classes": 3,
            "class_names": ["a", "b", "c"]}
    checkpoint.save_snapshot(path, net.state_dict(), net.state_dict(), meta)
    return d


def test_snapshot_of_another_arch_is_refused(tmp_path, fixtures_on_path):
    snap = tmp_path / "s.safetensors"
    d = _snapshot(snap, dict(TINY_DIT))
    other = config.validate({"model": {"class_conditional": True}})["model"]  # the built-in UNet
    with pytest.raises(UserError, match=r"different network \(model.arch=\"dit\" in the snapshot, \"unet\""):
        checkpoint.load_snapshot(snap, model_cfg=other)
    changed = json.loads(json.dumps(d["model"]))
    changed["kwargs"]["depth"] = 3
    with pytest.raises(UserError, match="model.kwargs"):
        checkpoint.load_snapshot(snap, model_cfg=changed)
    net, _ = checkpoint.load_snapshot(snap, model_cfg=d["model"])
    assert isinstance(net.net, dit.DiT)


def test_custom_arch_snapshot_needs_the_config_and_never_imports_by_itself(tmp_path, fixtures_on_path):
    snap = tmp_path / "s.safetensors"
    d = _snapshot(snap, dict(CUSTOM))
    sys.modules.pop("diffrelay_test_net", None)
    with pytest.raises(UserError, match="not built in; pass the run's config with --config"):
        checkpoint.load_snapshot(snap)
    assert "diffrelay_test_net" not in sys.modules  # refused before anything was imported
    net, _ = checkpoint.load_snapshot(snap, model_cfg=d["model"])
    assert type(net.net).__name__ == "TinyNet"


# --- guidance -----------------------------------------------------------------------------------

def test_guidance_one_is_plain_sampling_bit_for_bit_and_other_scales_differ(tmp_path):
    snap = tmp_path / "s.safetensors"
    d = _snapshot(snap, {"channels": 8, "channel_mult": [1, 2]}, label_dropout=0.1)
    net, meta = checkpoint.load_snapshot(snap, model_cfg=d["model"])
    with torch.no_grad():  # random weights, so every output bit depends on the path taken
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    s = sample.default_settings(num_images=16, steps=3, batch_size=16)
    x = sample.latents(range(16), (3, 16, 16))
    labels = torch.tensor(sample.class_labels(range(16), meta, "balanced"))
    plain = edm.sample(net, x, labels, num_steps=3)
    plain = (plain * 127.5 + 128).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    one = np.stack([px for _, px in sample.generate(net, meta, list(range(16)), s)])
    assert np.array_equal(one, plain)
    two = np.stack([px for _, px in sample.generate(net, meta, list(range(16)), dataclasses.replace(s, guidance=2.0))])
    assert not np.array_equal(two, plain)


def test_guidance_without_label_dropout_is_refused_at_sampling(tmp_path):
    snap = tmp_path / "s.safetensors"
    d = _snapshot(snap, {"channels": 8, "channel_mult": [1, 2]}, label_dropout=0.0)
    s = sample.default_settings(num_images=4, steps=2, guidance=1.5)
    with pytest.raises(UserError, match="trained without train.label_dropout"):
        sample.run(snap, tmp_path / "out", s, model_cfg=d["model"])


# --- per-sample draws ---------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_dropout_and_flip_draws_do_not_depend_on_the_process_count(world):
    whole = augment.masks(7, 5, 16, 0, 1, 0.3, 0.5)
    for which in (0, 1):
        parts = [augment.masks(7, 5, 16, r, world, 0.3, 0.5)[which] for r in range(world)]
        rebuilt = np.empty(16, dtype=bool)
        for r in range(world):
            rebuilt[r::world] = parts[r]
        assert np.array_equal(rebuilt, whole[which])
    assert whole[0].any() and whole[1].any() and not np.array_equal(whole[0], whole[1])
    assert not np.array_equal(whole[1], augment.masks(7, 6, 16, 0, 1, 0.3, 0.5)[1])  # a new draw each step


def test_flip_mirrors_only_the_chosen_rows_and_drop_sets_the_null_class():
    x = torch.arange(2 * 1 * 2 * 3, dtype=torch.float32).reshape(2, 1, 2, 3)
    y, labels = augment.apply(x, torch.tensor([1, 2]), np.array([False, True]), np.array([True, False]), null=3)
    assert torch.equal(y[0], x[0].flip(-1)) and torch.equal(y[1], x[1])
    assert labels.tolist() == [1, 3]


# --- training: K segments == one run, for a network from outside the package and for DiT ---------

TRAIN = [sys.executable, "-m", "diffrelay", "train"]


def _train_twice(tmp_path, model, extra=None):
    """(state after one 6-step run, state after two 3-step segments) of the same config, one process."""
    from test_train import load_state

    base = {"run": {"name": "r", "device": "cpu", "resources": str(tmp_path / "resources")},
            "data": {"kind": "shapes", "resolution": 16, "count": 20, "seed": 0, "xflip": 0.5},
            "model": model | {"class_conditional": True},
            "train": {"total_steps": 6, "segment_steps": 3, "batch_size": 8, "lr": 0.002, "warmup_steps": 2,
                      "log_every": 1, "label_dropout": 0.25}}
    base = json.loads(json.dumps(base))
    for k, v in (extra or {}).items():
        base[k].update(v)
    states = []
    for name, stops in (("one", [6]), ("two", [3, 6])):
        d = json.loads(json.dumps(base))
        d["run"]["results"] = str(tmp_path / name)
        cfg = tmp_path / f"{name}.yaml"
        io.write_json(cfg, d)
        if name == "one":
            run_cli("prepare", "--config", cfg)
        else:
            shutil.copytree(tmp_path / "one" / "r" / "dataset", tmp_path / "two" / "r" / "dataset")
        for until in stops:
            run_cli(*TRAIN, "--config", cfg, "--until-step", until)
        states.append(load_state(tmp_path / name / "r" / "checkpoints" / "step_0000006"))
    return states


TINY_EDM2 = {"arch": "edm2", "kwargs": {"model_channels": 16, "channel_mult": [1, 2], "num_blocks": 1,
                                        "attn_resolutions": [8], "channels_per_head": 16, "dropout": 0.1}}
TINY_SIT = {"arch": "sit", "objective": "flow", "kwargs": {"patch": 4, "depth": 2, "hidden_size": 32, "num_heads": 2}}


TINY_DDPMPP = {"arch": "ddpmpp", "kwargs": {"model_channels": 16, "channel_mult": [1, 2], "num_blocks": 1,
                                            "attn_resolutions": [8]}}  # EDM's augment_dim 9, dropout 0.13


@pytest.mark.parametrize("model", [CUSTOM, TINY_DIT, TINY_EDM2, TINY_SIT, TINY_DDPMPP],
                         ids=["custom", "dit", "edm2", "sit", "ddpmpp"])
def test_two_segments_match_one_run_with_flips_and_label_dropout(tmp_path, fixtures_on_path, model):
    from test_train import assert_tensors_equal

    one, two = _train_twice(tmp_path, dict(model))
    for key in ("net", "ema", "optimizer", "order", "step"):
        assert_tensors_equal(one[key], two[key], key)


def test_flips_and_label_dropout_do_not_depend_on_the_process_count(tmp_path, fixtures_on_path):
    from test_train import load_state

    states = {}
    for name, nproc, xflip in (("p1", 1, 0.5), ("p2", 2, 0.5), ("noflip", 1, 0.0)):
        d = {"run": {"name": "r", "device": "cpu", "results": str(tmp_path / name),
                     "resources": str(tmp_path / "resources")},
             "data": {"kind": "shapes", "resolution": 16, "count": 20, "seed": 0, "xflip": xflip},
             "model": CUSTOM | {"class_conditional": True},
             "train": {"total_steps": 4, "segment_steps": 4, "batch_size": 8, "nproc_per_node": nproc,
                       "lr": 0.002, "warmup_steps": 1, "label_dropout": 0.25}}
        cfg = tmp_path / f"{name}.yaml"
        io.write_json(cfg, d)
        run_cli("prepare", "--config", cfg)
        launch = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", *TRAIN[1:]] if nproc > 1 else TRAIN
        run_cli(*launch, "--config", cfg, "--until-step", 4)
        states[name] = load_state(tmp_path / name / "r" / "checkpoints" / "step_0000004")["net"]
    for k in states["p1"]:
        torch.testing.assert_close(states["p1"][k], states["p2"][k], rtol=1e-4, atol=1e-5)
    assert any(not torch.allclose(states["p1"][k], states["noflip"][k]) for k in states["p1"])


@pytest.mark.parametrize("model, res, words", [
    ({"arch": "sit"}, 16, "model.arch=sit: SiT's network predicts SiT's velocity; set model.objective: flow"),
    ({"arch": "edm2", "objective": "flow"}, 16, "model.arch=edm2: edm2's network is trained with EDM's objective"),
    ({"arch": "edm2", "kwargs": {"preset": "XL"}}, 64, "model.kwargs.preset=\"XL\": choose one of xs, s, m, l, xl"),
    ({"arch": "adm"}, 36, "data.resolution=36: adm's UNet with 4 levels halves it 3 times; use a multiple of 8"),
    ({"arch": "ddpmpp", "kwargs": {"channel_mult": [1, 2, 2]}}, 18, "data.resolution=18: ddpmpp's UNet with 3 levels"),
    ({"arch": "ncsnpp"}, 32, None),
])
def test_the_papers_networks_are_checked_when_the_config_is_read(model, res, words):
    d = {"data": {"resolution": res}, "model": model}
    if words is None:
        assert config.validate(d)["model"]["arch"] == model["arch"]
        return
    with pytest.raises(UserError) as e:
        config.validate(d)
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1
