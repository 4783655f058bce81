"""Training memory said before it is spent (nets/footprint.py, `diffrelay validate`'s # memory lines): the
training state's bytes from the parameter count, activations measured on fake tensors equal to the bytes autograd
really saves on the CPU (fp32 and bf16 autocast), linear in the batch, lower with checkpointing, and the warning."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from conftest import REPO
from diffrelay import cli, config
from diffrelay.nets import footprint, memory, registry


def test_training_state_bytes_from_a_tiny_networks_parameter_count():
    net = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))  # 20 + 10 parameters; buffers 5 + 5 fp32, 1 int64
    n = footprint.counts(net)
    # Adafactor's factored state: 3 + 5 for the 5 x 3 weight, the three vectors whole
    assert n == {"params": 30, "trainable": 30, "bytes_per_param": 4, "buffer_bytes": 5 * 4 + 5 * 4 + 8,
                 "factored": 3 + 5 + 5 + 5 + 5, "small": 30, "largest": 15}
    state = footprint.state_bytes(**{k: v for k, v in n.items() if k not in ("factored", "small", "largest")}, emas=2)
    assert state == {"weights": 30 * 4 + 48, "gradients": 30 * 4, "optimizer": 30 * 8, "ema": 2 * (30 * 4 + 48)}
    net[0].requires_grad_(False)  # a frozen part (what a LoRA run passes as `trainable`): no gradient, no moments
    frozen = footprint.state_bytes(**{k: v for k, v in footprint.counts(net).items() if k not in ("factored", "small", "largest")}, emas=1)
    assert (frozen["gradients"], frozen["optimizer"], frozen["weights"]) == (10 * 4, 10 * 8, 30 * 4 + 48)
    assert frozen["ema"] == 10 * 4 + 48  # the EMA's copy shares the frozen weights (training.optim.EMA)
    # The full-SDXL figure: 2.6e9 parameters x (4 weights + 4 gradients + 8 Adam), before EMAs.
    assert sum(footprint.state_bytes(2_600_000_000, emas=0).values()) == 41_600_000_000


class Block(nn.Module):
    """Norm, convolution and attention (the CPU's fused kernel), optionally checkpointed (nets.memory.call)."""

    def __init__(self, c):
        super().__init__()
        self.norm, self.conv, self.proj = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1), nn.Linear(c, c)
        self.checkpointing = False

    def body(self, x):
        h = self.conv(F.silu(self.norm(x)))
        b, c, height, width = h.shape
        q = h.flatten(2).transpose(1, 2)[:, None]
        a = F.scaled_dot_product_attention(q, q, q)[:, 0]
        return x + self.proj(a).transpose(1, 2).reshape(b, c, height, width)

    def forward(self, x):
        return memory.call(self.checkpointing, self.body, x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 3, 1)
        self.blocks = nn.ModuleList([Block(16) for _ in range(2)])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def build(checkpointing=False):
    def make():
        net = Net()
        if checkpointing:
            memory.enable(net)
        return net
    return make


def run(net, n):
    x = torch.zeros(n, 3, 8, 8)
    return (net(x) - x).square().mean()


def real_saved(n, amp=None, checkpointing=False):
    """What autograd saves on the real CPU for a batch of n, the same loss as footprint measures."""
    net = build(checkpointing)()
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        return footprint.saved_bytes(net, lambda m: run(m, n))


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_activations_measured_on_fake_tensors_equal_the_bytes_autograd_saves_on_the_cpu(amp):
    measured, how = footprint.activation_bytes(build(), run, 2, amp, cpu=False)
    assert "fake tensors" in how, how
    real = real_saved(2, amp)
    # fp32: exact. bf16 autocast: within 1 %. Measured 64 bytes of 165,184 apart: group_norm's meta kernel gives the
    # saved mean and rstd the input's dtype (bf16), the CPU's kernel float32 (2 bytes more per sample and group).
    assert measured == real if amp is None else abs(measured - real) <= 0.01 * real, (measured, real)
    if amp is not None:  # mostly half precision: well below the fp32 figure
        assert measured < 0.9 * footprint.activation_bytes(build(), run, 2, None)[0]


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_activations_scale_linearly_with_the_batch_from_batch_one_and_two(amp):
    one, two = (footprint.activation_bytes(build(), run, b, amp)[0] for b in (1, 2))
    eight, how = footprint.activation_bytes(build(), run, 8, amp)
    assert eight == one + 7 * (two - one) and "scaled to 8" in how
    real = real_saved(8, amp)
    assert abs(eight - real) <= 0.01 * real, (eight, real)
    if amp is not None:  # the bf16 copies of the weights are saved once, not once per image
        assert eight < 4 * two


def test_checkpointing_lowers_the_activation_figure_to_what_autograd_then_saves():
    plain = footprint.activation_bytes(build(), run, 4)[0]
    checked = footprint.activation_bytes(build(checkpointing=True), run, 4)[0]
    assert checked < plain / 2
    assert checked == real_saved(4, checkpointing=True)  # the blocks' inputs, kept for the recomputation


def test_a_network_that_runs_nowhere_is_not_measured_and_the_total_says_so():
    def refuses():
        raise RuntimeError("needs real weights")

    act, how = footprint.activation_bytes(refuses, run, 4, cpu=False)
    assert act is None and how.startswith("not measured (on fake tensors: RuntimeError: needs real weights")
    est = footprint.Estimate(footprint.state_bytes(10), act, how)
    out, warning = footprint.lines(est, footprint.counts(nn.Linear(3, 2)) | {"params": 10}, 1, "adam", "fp32", None,
                                   "no GPU found to compare with")
    assert "activations not measured" in out[1] and "without activations" in out[2] and warning is None


def test_gpu_memory_override_run_device_cpu_and_no_gpu():
    assert footprint.gpu_memory("cuda", None, 80) == (80 * 2**30, "the 80 GiB given by --gpu-memory-gib")
    assert footprint.gpu_memory("cpu", None)[0] is None
    if not torch.cuda.is_available():
        capacity, why = footprint.gpu_memory("auto", [0, 1])
        assert capacity is None and why.startswith("no GPU found to compare with")


def test_validate_prints_the_memory_lines_and_warns_only_when_the_gpu_is_smaller(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the demo's relative results/ folder
    demo = str(REPO / "config/config.yaml")
    assert cli.main(["validate", "--config", demo, "--gpu-memory-gib", "0.001"]) == 0
    out, err = capsys.readouterr()
    assert isinstance(yaml.safe_load(out), dict)  # the lines are YAML comments
    lines = [line for line in out.splitlines() if line.startswith("# memory:")]
    assert len(lines) == 4, lines
    assert "adam state 4.4 MiB (2 moments, fp32)" in lines[0] and "(1 fp32 copy)" in lines[0]
    cfg = config.load(demo)
    # The demo's network is small: measured on the real CPU (no FakeTensorMode, whose import of torch._dynamo is
    # most of validate's start-up), the figure the fake pass gives (test below).
    assert f"{cfg.train.batch_size} image(s) a process" in lines[1] and "measured on the CPU" in lines[1]
    assert "EXCEEDS the 0.001 GiB given by --gpu-memory-gib" in lines[2]
    warnings = [line for line in err.splitlines() if line.startswith("diffrelay: warning:")]
    assert len(warnings) == 1 and "train.activation_checkpointing: true" in warnings[0], err
    assert "train.optimizer: adamw8bit (its state 1.22 MiB against 4.4 MiB)" in warnings[0], err
    # The total under each optimizer the run could take, and which fit: this one's is the total above; 8-bit moments
    # keep about 2 of Adam's 8 bytes a parameter (576,843 parameters: 3.2 MiB less); schedule-free is left out, as
    # the demo keeps an EMA; none fit 1 MiB.
    by = dict(part.rsplit(" ", 2)[0:1] + [" ".join(part.rsplit(" ", 2)[1:])] for part in
              lines[3].split(": ", 2)[2].split("; ")[0].split(", "))
    total = lines[2].split("total ")[1].split(" a process")[0]
    assert by["adam"] == total and by["adamw8bit"] == "58.4 MiB" and "schedulefree_adamw" not in by, lines[3]
    assert lines[3].endswith("fit 1.02 MiB: none"), lines[3]

    from diffrelay.config import memory as validate_memory

    classes = 3  # the demo's shapes
    lines, warning = validate_memory.lines(cfg, 0, classes, gpu_memory_gib=1000)
    assert warning is None and "fits the 1000 GiB given by --gpu-memory-gib" in lines[2]
    # The state line's bytes are the arithmetic of the network's own parameter count.
    with registry.on_device("meta"):
        n = footprint.counts(validate_memory._builder(cfg, classes, None)[0]())
    assert f"({n['params']:,} parameters, fp32" in lines[0]


def test_a_small_network_measured_on_the_cpu_first_gets_the_fake_figure_and_validate_imports_no_dynamo(tmp_path):
    for batch in (1, 4):
        fake, how_fake = footprint.activation_bytes(build(), run, batch, cpu=False)
        real, how_real = footprint.activation_bytes(build(), run, batch, cpu=False, cpu_first=True)
        assert fake == real and "fake tensors" in how_fake and "on the CPU" in how_real, (fake, real)

    def fails_on_cpu():
        if torch.empty(0).device.type == "cpu" and not torch.empty(0).is_meta:
            raise RuntimeError("not here")
        return Net()

    act, how = footprint.activation_bytes(fails_on_cpu, run, 2, cpu_first=True)  # then the fake pass
    assert act == footprint.activation_bytes(build(), run, 2, cpu=False)[0] and "fake tensors" in how, how
    code = ("import sys; from diffrelay import cli; cli.main(['validate', '--config', sys.argv[1]]); "
            "print('torch._dynamo' in sys.modules, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, str(REPO / "config/config.yaml")], capture_output=True,
                       text=True, cwd=tmp_path, check=True)
    assert "measured on the CPU" in p.stdout and p.stderr.splitlines()[-1] == "False", p.stderr[-2000:]
