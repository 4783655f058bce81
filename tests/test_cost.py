"""Network cost (nets/cost.py): FLOPs against the formulas, GPU-hour arithmetic, and the line `diffrelay
validate` prints (exact parameter count; a network that refuses the meta device still validates)."""

import argparse
import textwrap

import pytest
import torch
import yaml
from torch import nn

from conftest import REPO
from diffrelay import config, nets, objectives
from diffrelay.config import preflight
from diffrelay.config import report as validate
from diffrelay.nets import cost, registry


class Call(nn.Module):
    """layers(x) under the contract's signature net(x, time, labels)."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, x, t, labels=None):
        return self.layers(x)


def test_forward_flops_of_a_linear_and_a_convolution_are_two_per_multiply_add():
    with torch.device("meta"):
        linear, conv = Call(nn.Linear(7, 5)), Call(nn.Conv2d(3, 8, 3, padding=1))
    assert cost.forward_flops(linear, (4, 7)) == 2 * 7 * 5  # one image, whatever the batch in x_shape
    assert cost.forward_flops(conv, (1, 3, 6, 6)) == 2 * 3 * 8 * 6 * 6 * 3 * 3
    assert cost.macs(cost.forward_flops(linear, (1, 7))) == 7 * 5


def test_training_flops_are_measured_not_three_times_the_forward():
    i, h, o = 7, 11, 5
    with torch.device("meta"):
        net = Call(nn.Linear(i, h), nn.SiLU(), nn.Linear(h, o))
    forward, total = cost.training_flops_per_image(net, (1, i))
    assert forward == 2 * (i * h + h * o) == cost.forward_flops(net, (1, i))
    # Backward: both weight gradients, and the input gradient of the second layer only (x needs none).
    assert total == forward + 2 * h * o + 2 * h * o + 2 * i * h
    assert forward < total < 3 * forward


def test_gpu_hours_and_sampling_arithmetic():
    assert cost.H100_BF16_PEAK == 989.4e12 and cost.DEFAULT_MFU == 0.40
    assert cost.gpu_hours(1e12, 3600, mfu=0.5, peak=1e12) == pytest.approx(2.0)
    assert cost.gpu_hours(989.4e12 * 0.4, 3600) == pytest.approx(1.0)
    assert [cost.nfe(s, 18) for s in ("heun", "euler", "sde", "ddpm", "ddim")] == [35, 18, 18, 18, 18]
    assert cost.sampling_flops(10.0, 100, 35, guided=False) == 35_000
    assert cost.sampling_flops(10.0, 100, 35, guided=True) == 70_000


def _validate(capsys, *files) -> str:
    """stdout of `diffrelay validate --config config/config.yaml FILES` run in this process; it stays YAML."""
    assert validate.main(argparse.Namespace(config=[str(REPO / "config/config.yaml"), *map(str, files)])) == 0
    out = capsys.readouterr().out
    assert isinstance(yaml.safe_load(out), dict)
    return [line for line in out.splitlines() if line.startswith("# network:")][-1]


def test_validate_prints_the_exact_parameter_count_and_forward_flops_of_the_demo(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the demo's relative results/ folder
    line = _validate(capsys)
    cfg = config.load(REPO / "config/config.yaml")
    channels, side = preflight.net_geometry(cfg)
    classes = preflight.num_classes(cfg)
    arch, kwargs = nets.arch_kwargs(cfg.to_dict()["model"])
    on_cpu = registry.build_network(arch, kwargs, side, channels, classes, "cpu")
    assert f" {registry.num_params(on_cpu):,} parameters " in line, line
    flops = cost.forward_flops(objectives.build(cfg.to_dict()["model"], side, classes, channels), (1, channels, side, side),
                               classes)
    assert f" {flops / 1e9:.4g} GFLOPs per forward " in line and f"at {side}x{side}x{channels}, {classes} classes" in line


REFUSES_META = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x, c_noise, labels=None):
            print("forward")  # must not reach validate's YAML on stdout
            return self.conv(x)

    def build(resolution, in_channels, num_classes):
        if torch.empty(0).device.type == "meta":
            raise RuntimeError("needs real weights")
        return Net(in_channels)
"""


def test_a_network_that_refuses_the_meta_device_validates_and_is_counted_on_the_cpu(tmp_path, monkeypatch, capsys):
    (tmp_path / "refuses_meta.py").write_text(textwrap.dedent(REFUSES_META))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    over = tmp_path / "over.yaml"
    over.write_text(yaml.safe_dump({"model": {"arch": "refuses_meta:build", "class_conditional": False}}))
    line = _validate(capsys, over)
    assert " 84 parameters (0.00 M), " in line, line  # 3 x 3 x 3 x 3 weights + 3 biases
    assert f" {2 * 3 * 3 * 9 * 16 * 16 / 1e9:.4g} GFLOPs per forward " in line, line

    monkeypatch.setattr(cost, "CPU_MAX_PARAMS", 10)  # too large for the CPU: one line, validation passes
    line = _validate(capsys, over)
    assert " 84 parameters (0.00 M), FLOPs not available: on meta: CodeError: " in line, line
    assert "needs real weights" in line and "not tried on the CPU: 0 M parameters" in line, line
