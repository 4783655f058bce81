"""train.optimizer beyond torch's Adam(W): each from its library (training/optimizers.py), its steps the library's own
bits, its state resumed bit for bit, its refusals one line each, its memory as `validate` says it."""

import inspect
import io

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import REPO
from diffrelay import config
from diffrelay.errors import UserError
from diffrelay.nets import footprint
from diffrelay.training import fused_backward, optim, optimizers
from conftest import run_cli
from test_speed import config_merge, one_run_equals_two_segments, prepared
from test_train import assert_tensors_equal, load_state

LIBRARY = [n for n in optimizers.CHOICES if n not in optimizers.TORCH_ADAM]


def settings(name, **train):
    over = {"optimizer": name, "lr": 1.0 if name == "prodigy" else 1e-3, "warmup_steps": 0,
            "weight_decay": 0.01} | train
    if name == "schedulefree_adamw":  # its evaluation weights are the average: no EMA (optimizers.check_config)
        return config.Config(config.validate({"train": over | {"ema_decays": []}, "sample": {"ema_decay": None}})).train
    return config.Config(config.validate({"train": over})).train


def network():
    # a 256 x 256 weight: large enough, and a multiple of every block size, for the libraries' quantized states
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 3))


def steps(net, opt, sched, first, last):
    for i in range(first, last):
        g = torch.Generator().manual_seed(i)
        net(torch.randn(4, 256, generator=g)).square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)


def test_the_table_holds_the_libraries_signatures_and_the_schemas_names():
    schema = yaml.safe_load((REPO / "src/diffrelay/config/schema.yaml").read_text())
    assert set(optimizers.CHOICES) == set(schema["properties"]["train"]["properties"]["optimizer"]["enum"])
    assert config.validate({})["train"]["optimizer_args"] == {}
    for name in LIBRARY:
        cls = optimizers.optimizer_class(name)
        accepted = tuple(list(inspect.signature(cls.__init__).parameters)[2:])  # after self, params
        assert optimizers.CHOICES[name].args == accepted, name


@pytest.mark.parametrize("name", LIBRARY)
def test_steps_equal_the_librarys_bare_loop_and_a_saved_state_resumes_bit_for_bit(name):
    t = settings(name)
    choice = optimizers.CHOICES[name]
    # The bare loop: the library's class as its README builds it, stepped by hand, no schedule.
    bare_net = network()
    bare = optimizers.optimizer_class(name)(bare_net.parameters(), **optimizers.kwargs(t, choice))
    if name == "schedulefree_adamw":
        bare.train()
    steps(bare_net, bare, None, 0, 4)
    # diffrelay's: built, scheduled and stepped as training does, saved after 2 steps and resumed
    net = network()
    opt = optim.build_optimizer(net.parameters(), t)
    sched = optim.build_schedule(opt, t)
    steps(net, opt, sched, 0, 2)
    saved = {"optimizer": optimizers.plain_state(opt.state_dict()), "net": net.state_dict(),
             "schedule": sched.state_dict()}
    plain = [v for per in saved["optimizer"]["state"].values() for v in per.values()]
    assert all(type(v) is torch.Tensor or not isinstance(v, torch.Tensor) for v in plain), name
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    again = network()
    again.load_state_dict(saved["net"])
    opt2 = optim.build_optimizer(again.parameters(), t)
    sched2 = optim.build_schedule(opt2, t)
    optim.load_optimizer_state(opt2, saved["optimizer"])
    sched2.load_state_dict(saved["schedule"])
    kinds = {type(v).__name__ for per in opt2.state.values() for v in per.values()}
    if name.startswith("ao_"):  # rebuilt in its low-bit form, not as full fp32 moments
        assert kinds & {"OptimState8bit", "OptimState4bit", "OptimStateFp8"}, kinds
    steps(again, opt2, sched2, 2, 4)
    for a, b in zip(bare_net.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(network()[0].weight, again[0].weight)
    # what validate counts for it: the state's tensors, block scales and all (scalar counters aside)
    held = sum(_bytes(v) for per in opt2.state.values() for v in _tensors(per) if v.numel() > 1)
    said = optimizers.state_bytes(name, footprint.counts(again))
    assert abs(held - said) <= 0.02 * said + 4096, (name, held, said)


def _tensors(per):
    for v in per.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):  # bitsandbytes' quant-state entries
            yield from _tensors(v)


def _bytes(v) -> int:
    """A tensor's bytes; a tensor subclass's (torchao's low-bit state) those of the plain tensors it holds."""
    if type(v) is torch.Tensor:
        return v.numel() * v.element_size()
    return sum(_bytes(getattr(v, k)) for k in v.__tensor_flatten__()[0])


FUSED = ["adam", "adamw8bit", "ao_adamw4bit", "adafactor"]


def train_steps(net, opt, sched, first, last, fused: bool):
    """Forward, backward and update as training runs them (the hooks step under fused_backward); the grad norms."""
    norms = []
    for i in range(first, last):
        g = torch.Generator().manual_seed(i)
        net(torch.randn(4, 256, generator=g)).square().mean().backward()
        if fused:
            assert all(p.grad is None for p in net.parameters())  # each freed as soon as it stepped
            norms.append(opt.grad_norm())
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), float("inf")))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return norms


@pytest.mark.parametrize("name", FUSED)
def test_fused_backward_steps_the_same_bits_and_its_checkpoint_resumes_unfused(name):
    t = settings(name)
    plain, fused = network(), network()
    a = optim.build_optimizer(plain.parameters(), t)
    b = fused_backward.PerParameter(fused.parameters(), lambda one: optim.build_optimizer(one, t))
    sa, sb = optim.build_schedule(a, t), optim.build_schedule(b, t)
    norms_a, norms_b = train_steps(plain, a, sa, 0, 2, False), train_steps(fused, b, sb, 0, 2, True)
    assert [x.item() for x in norms_a] == [x.item() for x in norms_b]
    assert all(torch.equal(x, y) for x, y in zip(plain.parameters(), fused.parameters(), strict=True))
    # The same checkpoint format: the fused run's state, saved, resumes an unfused optimizer, and the reverse.
    sd_a, sd_b = optimizers.plain_state(a.state_dict()), optimizers.plain_state(b.state_dict())
    assert_tensors_equal(sd_a["state"], sd_b["state"], "state")
    assert {k: v for k, v in sd_a["param_groups"][0].items() if k != "lr"} == \
        {k: v for k, v in sd_b["param_groups"][0].items() if k != "lr"}
    assert float(sd_a["param_groups"][0]["lr"]) == float(sd_b["param_groups"][0]["lr"])
    c = optim.build_optimizer(fused.parameters(), t)
    optim.load_optimizer_state(c, sd_b)
    d = fused_backward.PerParameter(plain.parameters(), lambda one: optim.build_optimizer(one, t))
    d.load_state_dict(sd_a)
    sc, sd = optim.build_schedule(c, t), optim.build_schedule(d, t)
    sc.load_state_dict(sb.state_dict())
    sd.load_state_dict(sa.state_dict())
    train_steps(fused, c, sc, 2, 4, False)
    train_steps(plain, d, sd, 2, 4, True)
    assert all(torch.equal(x, y) for x, y in zip(plain.parameters(), fused.parameters(), strict=True))


@pytest.mark.parametrize("train, key, fix", [
    ({"fused_backward": True}, "train.grad_clip=1.0", "set train.grad_clip: 0"),
    ({"fused_backward": True, "grad_clip": 0, "grad_accum": 2, "batch_size": 64}, "train.grad_accum=2",
     "set train.grad_accum: 1"),
    ({"fused_backward": True, "grad_clip": 0, "optimizer": "prodigy"}, "train.optimizer=prodigy",
     "couples the parameters"),
    ({"fused_backward": True, "grad_clip": 0, "nproc_per_node": 2}, "train.nproc_per_node=2", "one process"),
    ({"activation_checkpointing": "offload", "compile": True}, "train.activation_checkpointing=offload",
     "set train.compile: false"),
    ({"optimizer": "prodigy", "optimizer_args": {"d_coeff": 2}}, "train.optimizer_args.d_coeff", "it takes beta3"),
    ({"optimizer": "adamw8bit", "optimizer_args": {"lr": 1}}, "train.optimizer_args.lr", "set that instead"),
    ({"optimizer": "adamw", "optimizer_args": {"eps": 1e-6}}, "train.optimizer_args.eps", "takes no optimizer_args"),
    ({"optimizer": "lion8bit", "fused_optimizer": True}, "train.fused_optimizer=true", "set train.fused_optimizer"),
    ({"optimizer": "adamw8bit", "sharding": "fsdp2", "precision": "bf16"}, "train.optimizer=adamw8bit",
     "use adam, adamw, or train.sharding: ddp"),
    ({"optimizer": "schedulefree_adamw"}, "train.ema_decays", "set train.ema_decays: []"),
    ({"optimizer": "schedulefree_adamw", "ema_decays": [], "lr_schedule": "cosine"}, "train.lr_schedule=cosine",
     "set train.lr_schedule: constant"),
    ({"block_swap": 4}, "train.block_swap=4", "set train.lora, or train.block_swap: 0"),
])
def test_what_an_optimizer_cannot_take_is_refused_in_one_line_when_the_config_is_read(train, key, fix):
    d = {"train": train} | ({"sample": {"ema_decay": None}} if train.get("ema_decays") == [] else {})
    with pytest.raises(UserError) as e:
        config.validate(d)
    line = str(e.value)
    assert key in line and fix in line and "\n" not in line.strip(), line


def test_the_optimizer_args_of_a_run_enter_its_identity_and_none_keeps_the_old_hash():
    plain = config.trajectory_hash(config.Config(config.validate({})))
    named = {"train": {"optimizer": "prodigy", "lr": 1.0}}
    base = config.trajectory_hash(config.Config(config.validate(named)))
    other = config.trajectory_hash(config.Config(config.validate(config_merge(
        named, {"train": {"optimizer_args": {"d_coef": 0.5}}}))))
    assert len({plain, base, other}) == 3
    assert "optimizer_args" not in config.trajectory(config.Config(config.validate({})))["train"]


@pytest.mark.slow
def test_two_schedule_free_segments_equal_one_run_and_the_snapshot_holds_its_evaluation_weights(write_config, tmp_path):
    """Through `diffrelay train`: the checkpoint's state (schedule-free's y and z, its own warm-up's counters) resumes
    bit for bit (the other libraries' states: the in-process test above), and the snapshot holds
    x = lerp(y, z, 1 - 1/beta1), not y (optimizers.eval_weights)."""
    over = {"train": {"optimizer": "schedulefree_adamw", "warmup_steps": 2, "ema_decays": []},
            "sample": {"ema_decay": None}}
    a, _ = one_run_equals_two_segments(write_config, tmp_path, over, 4)
    snap = load_file(tmp_path / "results/two/snapshots/step_0000004.safetensors")
    group = a["optimizer"]["param_groups"][0]
    beta1, moved = group["betas"][0], 0
    names = [k for k in a["net"] if f"raw.{k}" in snap]
    assert len(names) == len(a["net"]) and len(group["params"]) <= len(names)
    shapes = iter(names)  # the parameters in state_dict order (the optimizer's), the buffers among them skipped
    for pid in group["params"]:
        z = a["optimizer"]["state"][pid]["z"]
        key = next(k for k in shapes if a["net"][k].shape == z.shape and a["net"][k].is_floating_point())
        x = torch.lerp(a["net"][key], z, 1 - 1 / beta1)
        assert torch.equal(snap[f"raw.{key}"], x), key
        moved += not torch.equal(x, a["net"][key])
    assert moved, "x is y: the snapshot would hold the trained weights"


@pytest.mark.slow
def test_fused_backward_trains_the_unfused_bits_across_a_switch_and_a_non_finite_step_stops_in_one_line(
        write_config, tmp_path):
    """Through `diffrelay train`: run one fused from the start (and its checkpointed activations offloaded: the same
    bits too), run two unfused for 2 steps then fused: the same checkpoint bit for bit. A non-finite step cannot be
    skipped once the hooks stepped: one line, no checkpoint."""
    fused = {"train": {"fused_backward": True, "grad_clip": 0}}
    plain = {"train": {"grad_clip": 0}}
    offload = {"train": {"activation_checkpointing": "offload"}}
    one = prepared(write_config, config_merge(config_merge(fused, offload), {"run": {"name": "one"}}), "one")
    run_cli("train", "--config", one, "--until-step", 4)
    two = prepared(write_config, config_merge(plain, {"run": {"name": "two"}}), "two")
    run_cli("train", "--config", two, "--until-step", 2)
    two_fused = write_config(config_merge(fused, {"run": {"name": "two"}}), name="two-fused.yaml")
    run_cli("train", "--config", two_fused, "--until-step", 4)
    a = load_state(tmp_path / "results/one/checkpoints/step_0000004")
    b = load_state(tmp_path / "results/two/checkpoints/step_0000004")
    for key in ("net", "ema", "optimizer", "schedule", "order", "step"):
        assert_tensors_equal(a[key], b[key], key)
    bad = prepared(write_config, config_merge(fused, {"run": {"name": "bad"}, "train": {"p_mean": 800.0}}), "bad")
    p = run_cli("train", "--config", bad, "--until-step", 3, check=False)
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert "step 0: non-finite loss or gradient under train.fused_backward" in line and "cannot be skipped" in line
    assert not list((tmp_path / "results/bad").rglob("step_*")), "nothing written of non-finite weights"
