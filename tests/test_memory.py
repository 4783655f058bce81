"""Activation checkpointing (train.activation_checkpointing, nets/memory.py): the same bits, less kept memory."""

import json
import os

import pytest
import torch

from conftest import REPO, run_cli
from diffrelay import io
from diffrelay.errors import UserError
from diffrelay.nets import memory, registry

FIXTURES = REPO / "tests" / "fixtures"
NETWORKS = {
    "unet": ("unet", {"channels": 16, "channel_mult": [1, 2], "num_blocks": 1, "attn_resolutions": [8],
                      "dropout": 0.3}),
    "dit": ("dit", {"patch": 4, "depth": 2, "hidden_size": 32, "num_heads": 2}),
}


def _grads(arch, kwargs, checkpointing: bool):
    """Gradients and output of one forward/backward in train mode, with the same weights and dropout seed."""
    torch.manual_seed(0)
    net = registry.build_network(arch, kwargs, 16, 3, 10).train()
    if checkpointing:
        assert memory.enable(net) > 0
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(4, 3, 16, 16, generator=g), torch.randn(4, generator=g)
    for p in net.parameters():  # zero-initialised output layers would make most gradients zero
        p.data.add_(torch.randn(p.shape, generator=g) * 0.05)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(2)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = net(x, c, torch.tensor([0, 3, 9, 10]))
    out.square().sum().backward()
    return out.detach(), {n: p.grad for n, p in net.named_parameters()}, sum(saved)


@pytest.mark.parametrize("name", NETWORKS)
def test_checkpointing_gives_the_same_bits_and_keeps_less(name):
    arch, kwargs = NETWORKS[name]
    out0, grads0, kept0 = _grads(arch, kwargs, False)
    out1, grads1, kept1 = _grads(arch, kwargs, True)
    assert torch.equal(out0, out1)
    assert grads0.keys() == grads1.keys()
    for n in grads0:
        assert torch.equal(grads0[n], grads1[n]), n
    assert kept1 < kept0 / 2, (kept0, kept1)  # only the blocks' inputs stay for the backward pass


def test_checkpointing_is_off_by_default_and_unused_without_gradients(monkeypatch):
    net = registry.build_network(*NETWORKS["dit"], 16, 3, 0)
    assert net.checkpointing is False
    memory.enable(net)
    calls = []
    monkeypatch.setattr(memory, "checkpoint", lambda *a, **k: calls.append(1) or a[0](*a[1:]))
    with torch.no_grad():  # sampling: nothing to recompute, the plain forward
        net(torch.ones(1, 3, 16, 16), torch.zeros(1))
    assert calls == []
    net(torch.ones(1, 3, 16, 16), torch.zeros(1))  # training: every block through torch's checkpoint
    assert len(calls) == len(net.blocks)


def test_training_with_and_without_it_gives_bitwise_equal_checkpoints(tmp_path):
    from test_train import assert_tensors_equal, load_state

    base = {"run": {"name": "r", "device": "cpu", "resources": str(tmp_path / "resources")},
            "data": {"kind": "shapes", "resolution": 16, "count": 16, "seed": 0},
            "model": {"arch": "unet", "class_conditional": True, "kwargs": NETWORKS["unet"][1]},
            "train": {"total_steps": 3, "segment_steps": 3, "batch_size": 4, "lr": 0.002, "log_every": 1,
                      "label_dropout": 0.25}}
    states = []
    for on in (False, True):
        d = json.loads(json.dumps(base))
        d["run"]["results"] = str(tmp_path / str(on))
        d["train"]["activation_checkpointing"] = on
        cfg = tmp_path / f"{on}.yaml"
        io.write_json(cfg, d)
        run_cli("prepare", "--config", cfg)
        run_cli("train", "--config", cfg, "--until-step", 3)
        states.append(load_state(tmp_path / str(on) / "r" / "checkpoints" / "step_0000003"))
    for key in ("net", "ema", "optimizer"):
        assert_tensors_equal(states[0][key], states[1][key], key)


def test_a_network_without_checkpointing_is_one_line(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")]))
    model = {"arch": "diffrelay_test_net:build", "kwargs": {"width": 8}}
    assert registry.check(model, 8, 3, 0) > 0
    with pytest.raises(UserError, match=r"train.activation_checkpointing: model.arch=diffrelay_test_net:build .*"
                                        r"memory.call"):
        registry.check(model, 8, 3, 0, checkpointing=True)
