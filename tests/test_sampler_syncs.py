"""The samplers' step loops never read a tensor back to the host (on CUDA each read waits for the queue to drain),
and they ask for each step's noise one draw ahead, without changing which numbers are drawn."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffrelay import objectives
from diffrelay.objectives import ddpm, draws, edm, flow
from diffrelay.sampling import sample
from diffrelay.training import checkpoint
from test_ddpm import ddpm_snapshot
from test_flow import flow_snapshot
from test_sample import make_snapshot

# What a read of a tensor's value becomes at the dispatcher: item(), float(), int() and bool() of a tensor (an `if`
# or a chained comparison on one) all end in _local_scalar_dense; equal() answers a Python bool. On CUDA each
# waits until the GPU has run everything queued before it.
READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item", "aten::equal", "aten::allclose"}
CHURN = edm.SamplerSettings(S_churn=40, S_min=0.05, S_max=50, S_noise=1.003)


class HostReads(TorchDispatchMode):
    """Counts host reads while `on`: the aten calls above, copies from a device to the CPU, and (patched, as on a
    CPU tensor they dispatch nothing) tolist(), numpy() and cpu(), which would copy a device tensor to the host."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.on, self.seen = False, []
        for name in ("tolist", "numpy", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))

    def _counted(self, name, real):
        def fn(t, *args, **kwargs):
            if self.on:
                self.seen.append(f"Tensor.{name}")
            return real(t, *args, **kwargs)
        return fn

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on and (func._schema.name in READS or _to_host(func._schema.name, args, kwargs)):
            self.seen.append(func._schema.name)
        return func(*args, **kwargs)


def _to_host(name, args, kwargs) -> bool:
    """A copy from a device's memory to the CPU's (x.cpu(), x.to("cpu"), cpu_buffer.copy_(x))."""
    if name == "aten::_to_copy":
        src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
    elif name == "aten::copy_":
        src, dst = args[1].device, args[0].device
    else:
        return False
    return src.type != "cpu" and dst.type == "cpu"


def opened_by_the_first_step(reads, net):
    """`net`, which opens the count at its first call: reads from then on happen inside the step loop (what a
    sampler prepares before its loop, as its schedule, is read once per batch). EDM's first gates come before
    it, but they are the code of every later step."""
    def fn(*args, **kwargs):
        reads.on = True
        return net(*args, **kwargs)
    return fn


def streams(rows, shape, seed=0):
    gens = [torch.Generator().manual_seed(seed + k) for k in range(rows)]
    return (torch.stack([torch.randn(shape, generator=g) for g in gens]),
            lambda size: torch.stack([torch.randn(size[1:], generator=g, dtype=torch.float64) for g in gens]))


def shrink(x, t, labels=None):
    return x * 0.9  # a closed-form stand-in for a network: no reads of its own


# Each stochastic sampler with a guidance interval (the gate of every step), as (sampler, kwargs).
SAMPLERS = {
    "edm-heun-churn": (edm.sample, dict(num_steps=6, solver="heun", settings=CHURN, interval=(0.3, 3.0))),
    "flow-sde": (flow.sample, dict(num_steps=6, solver="sde", interval=(0.0, 0.7))),
    "ddpm": (ddpm.sample, dict(num_steps=6, solver="ddpm", interval=(0.2, 5.0))),
    "ddim-eta": (ddpm.sample, dict(num_steps=6, solver="ddim", settings=ddpm.SamplerSettings(eta=0.5),
                                   interval=(0.2, 5.0))),
}


@pytest.mark.parametrize("name", SAMPLERS)
def test_the_step_loop_reads_nothing_back_to_the_host(name, monkeypatch):
    fn, kwargs = SAMPLERS[name]
    z, noise = streams(2, (3, 4, 4))
    reads = HostReads(monkeypatch)
    with torch.inference_mode(), reads:
        fn(opened_by_the_first_step(reads, shrink), z, None, noise=noise,
           unguided=opened_by_the_first_step(reads, shrink), **kwargs)
    assert reads.on and reads.seen == []


def test_the_counter_sees_the_reads_a_step_could_make(monkeypatch):
    """The counter itself: each way of reading a tensor is seen, and tensor arithmetic is not."""
    t = torch.tensor([0.5, 2.0], dtype=torch.float64)
    reads = HostReads(monkeypatch)
    with reads:
        reads.on = True
        _ = (t * 2 + 1).sqrt()[0] * 3
        assert reads.seen == []
        _ = bool(0.1 <= t[0] <= 1.0), t[1].item(), float(t[0]), t.tolist(), t.numpy(), t.cpu()
    assert reads.seen.count("aten::_local_scalar_dense") == 4
    assert reads.seen[-3:] == ["Tensor.tolist", "Tensor.numpy", "Tensor.cpu"]


@pytest.mark.parametrize("name", SAMPLERS)
def test_each_steps_noise_is_asked_for_a_step_ahead_and_the_draws_are_the_same(name):
    """When a step evaluates the network, the noise it needs and the next step's noise have been asked for (a
    caller's noise() that queues a copy has the next one on its way); the draws and the result do not change."""
    fn, kwargs = SAMPLERS[name]
    z, noise = streams(2, (3, 4, 4))
    asked, at_step = [], []

    def counted(size):
        asked.append(size)
        return noise(size)

    def net(x, t, labels=None):
        at_step.append(len(asked))
        return shrink(x, t)

    got = fn(net, z, None, noise=counted, unguided=net, **kwargs)
    steps = kwargs["num_steps"]
    # The draws each sampler makes, and how many it has used when step k first evaluates the network: EDM's churn
    # comes before the step's evaluations, the others' noise after.
    total, used = {"edm-heun-churn": (steps, lambda k: k + 1)}.get(name, (steps - 1, lambda k: k))
    first_evals = at_step[::2][:steps] if name == "edm-heun-churn" else at_step
    assert len(asked) == total and len(first_evals) == steps
    assert all(n >= min(total, used(k) + 1) for k, n in enumerate(first_evals)), first_evals
    # The same numbers as drawing each step's noise when it is used: the streams were asked in order.
    _, again = streams(2, (3, 4, 4))
    draws = iter([again(z.shape) for _ in range(total)])
    assert torch.equal(fn(net, z, None, noise=lambda size: next(draws), unguided=net, **kwargs), got)


def test_ahead_asks_for_exactly_count_draws_in_order():
    calls = []
    it = draws.ahead(lambda size: calls.append(size) or len(calls), (2,), 3)
    assert calls == [(2,)]  # the first before the loop
    assert next(it) == 1 and len(calls) == 2
    assert list(it) == [2, 3] and len(calls) == 3
    assert list(draws.ahead(None, (2,), 0)) == []  # a deterministic sampler asks for nothing


@pytest.mark.parametrize("kind, over", [
    ("edm", dict(steps=4, guidance=2.0, guidance_interval=(0.3, 3.0), edm=CHURN)),
    ("flow", dict(steps=4, solver="sde", guidance=1.5, guidance_interval=(0.0, 0.7))),
    ("ddpm", dict(steps=5, solver="ddpm", guidance=1.5, guidance_interval=(0.2, 5.0))),
])
def test_generate_reads_nothing_back_inside_the_sampler(kind, over, tmp_path, monkeypatch):
    """generate() with the snapshots' networks and guidance: its noise, the guided denoiser and the sampler read
    nothing back between the first network evaluation and the sampler's return (the pixels are read after)."""
    make = {"edm": make_snapshot, "flow": flow_snapshot, "ddpm": ddpm_snapshot}[kind]
    net, meta = checkpoint.load_snapshot(make(tmp_path / "s.safetensors"), "ema", "cpu", None)
    reads = HostReads(monkeypatch)
    real_sample = objectives.sample

    def sampler(model_cfg, denoise, *args, unguided=None, **kwargs):
        out = real_sample(model_cfg, opened_by_the_first_step(reads, denoise), *args,
                          unguided=opened_by_the_first_step(reads, unguided), **kwargs)
        reads.on = False
        return out

    monkeypatch.setattr(objectives, "sample", sampler)
    s = sample.default_settings(num_images=3, batch_size=8, **over)
    with reads:
        images = list(sample.generate(net, meta, range(3), s))
    assert len(images) == 3 and reads.seen == []
