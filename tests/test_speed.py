"""Speed switches: compile (with a cache shared by segments), TF32, fused Adam(W), channels_last."""

import copy
import subprocess
import sys
import os
import shutil

import pytest
import torch

from conftest import REPO, run_cli
from diffrelay import config
from diffrelay.runtime import speed
from diffrelay.sampling import images, sample
from diffrelay.training import optim
from diffrelay.errors import UserError
from test_sample import make_snapshot
from test_train import assert_tensors_equal, load_state

# Inductor builds C++ kernels on a CPU; without a compiler torch.compile cannot run at all.
HAS_CXX = shutil.which(os.environ.get("CXX", "g++")) is not None
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="torch.compile on a CPU needs a C++ compiler (g++); none found")

# Compiled and eager training agree to this max abs weight difference after 4 steps (measured: about 2e-7;
# fused kernels reorder float sums, and Adam turns tiny gradient differences into lr-sized steps only when
# a gradient is near 0, so the bound leaves room above rounding while a wrong graph differs by ~1e-2).
COMPILE_TOL = 1e-4


def prepared(write_config, overrides, name, cwd=None):
    cfg = write_config(overrides, name=f"{name}.yaml")
    run_cli("prepare", "--config", cfg, cwd=cwd)
    return cfg


def cache_files(resources):
    return sorted(p for p in (resources / "compile-cache").rglob("*") if p.is_file())


@needs_cxx
@pytest.mark.slow  # one cold compile of a small network's forward and backward
def test_compiled_segments_agree_with_eager_and_the_second_reuses_the_cache(write_config, tmp_path):
    # A user's two-convolution network (tests/fixtures): what is tested is the compile and its cache, and a
    # small graph keeps the cold compile short.
    shutil.copy(REPO / "tests" / "fixtures" / "diffrelay_test_net.py", tmp_path / "my_net.py")
    small = {"model": {"arch": "my_net:build", "kwargs": {"width": 8}}, "train": {"total_steps": 4, "segment_steps": 2}}
    eager = prepared(write_config, config_merge(small, {"run": {"name": "eager"}}), "eager", cwd=tmp_path)
    run_cli("train", "--config", eager, "--until-step", 4, cwd=tmp_path)
    comp = prepared(write_config, config_merge(small, {"run": {"name": "comp"}, "train": {"compile": True}}), "comp",
                    cwd=tmp_path)
    run_cli("train", "--config", comp, "--until-step", 2, cwd=tmp_path)
    resources = tmp_path / "resources"
    after_first = cache_files(resources)
    assert after_first, "segment 1 wrote nothing to <run.resources>/compile-cache"
    run_cli("train", "--config", comp, "--until-step", 4, cwd=tmp_path)
    assert cache_files(resources) == after_first, "segment 2 compiled again instead of reusing the cache"

    a = load_state(tmp_path / "results/eager/checkpoints/step_0000004")
    b = load_state(tmp_path / "results/comp/checkpoints/step_0000004")
    diff = max((a["net"][k] - b["net"][k]).abs().max().item() for k in a["net"])
    assert diff < COMPILE_TOL
    assert a["net"].keys() == b["net"].keys()  # no "_orig_mod." prefix: the raw module is saved


@needs_cxx
@pytest.mark.slow  # one cold compile of a small network's forward
def test_compiled_sampling_compiles_once_for_a_short_last_batch_and_matches_eager(tmp_path, monkeypatch):
    shutil.copy(REPO / "tests" / "fixtures" / "diffrelay_test_net.py", tmp_path / "my_net.py")
    monkeypatch.chdir(tmp_path)  # the user's network module beside the run, as a workflow keeps it
    mine = {"arch": "my_net:build", "kwargs": {"width": 8}}
    snap = make_snapshot(tmp_path / "step_0000040.safetensors", model=mine)
    mine = config.validate({"model": {"class_conditional": True, **mine}})["model"]  # the run config's section
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    torch._dynamo.reset()
    base = sample.default_settings(num_images=20, steps=2, batch_size=16)  # batches of 16 and 4 (padded)
    sample.run(snap, tmp_path / "eager", base, model_cfg=mine)
    sample.run(snap, tmp_path / "comp", sample.default_settings(**{**vars(base), "compile": True}),
               resources=tmp_path / "resources", model_cfg=mine)
    torch._dynamo.reset()
    for name in sorted(p.name for p in (tmp_path / "eager").glob("*.png")):
        x = images.read_png(tmp_path / "eager" / name).astype(int)
        y = images.read_png(tmp_path / "comp" / name).astype(int)
        assert abs(x - y).max() <= 1, name  # rounding may flip a pixel by one level, no more
    assert cache_files(tmp_path / "resources")


COMPILE_ONCE = """
import sys, torch
from diffrelay import cli
from diffrelay.errors import UserError
from diffrelay.runtime import speed
torch.manual_seed(0)
model = speed.compile_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), True, sys.argv[1])
try:
    print(model(torch.ones(2, 4)).sum().item())
except UserError as e:
    sys.exit(f"diffrelay: {e}")
"""


@needs_cxx
def test_a_damaged_compile_cache_is_one_line_naming_the_folder_and_deleting_it_fixes_it(tmp_path):
    """A cache entry damaged after it was written (torch.compile fails the same way on every retry)."""
    import subprocess
    import sys

    script, resources = tmp_path / "once.py", tmp_path / "resources"
    script.write_text(COMPILE_ONCE)
    run = lambda: subprocess.run([sys.executable, script, resources], capture_output=True, text=True, timeout=600)  # noqa: E731
    good = run()
    assert good.returncode == 0, good.stderr
    cache = (resources / "compile-cache").resolve()
    for f in cache.rglob("*"):
        if f.is_file() and f.suffix != ".lock":
            f.write_text("garbage\n")
    bad = run()
    # torch's own logger may warn with its traceback (lines prefixed "W..."); no traceback of ours escapes
    assert bad.returncode != 0 and not any(x.startswith("Traceback") for x in bad.stderr.splitlines()), bad.stderr
    line = bad.stderr.strip().splitlines()[-1]
    assert "torch.compile failed" in line and f"compile cache {cache} may be damaged" in line, bad.stderr
    shutil.rmtree(cache)  # what the line says to do
    again = run()
    assert again.returncode == 0 and again.stdout == good.stdout, again.stderr


def one_run_equals_two_segments(write_config, tmp_path, over: dict, steps: int):
    """Run "one" trained to `steps` at once and run "two" in two segments, with the config `over`, their last
    checkpoints' states asserted equal bit for bit: (run one's state, run two's config file)."""
    one = prepared(write_config, config_merge(over, {"run": {"name": "one"}}), "one")
    run_cli("train", "--config", one, "--until-step", steps)
    two = prepared(write_config, config_merge(over, {"run": {"name": "two"}}), "two")
    run_cli("train", "--config", two, "--until-step", steps // 2)
    run_cli("train", "--config", two, "--until-step", steps)
    a = load_state(tmp_path / f"results/one/checkpoints/step_{steps:07d}")
    b = load_state(tmp_path / f"results/two/checkpoints/step_{steps:07d}")
    for key in ("net", "ema", "optimizer", "schedule", "order", "step"):
        assert_tensors_equal(a[key], b[key], key)
    return a, two


def test_channels_last_trains_and_resumes_bitwise(write_config, tmp_path):
    over = {"train": {"channels_last": True}}
    a, two = one_run_equals_two_segments(write_config, tmp_path, over, 6)
    convs = [v for v in a["net"].values() if v.dim() == 4 and v.shape[-1] > 1]
    assert convs and all(v.is_contiguous(memory_format=torch.channels_last) for v in convs)
    # The snapshot is plain row-major and samples in a process that knows nothing of the switch.
    out = tmp_path / "samples"
    run_cli("sample", "--config", two, "--snapshot", tmp_path / "results/two/snapshots/step_0000006.safetensors",
            "--out", out)
    assert len(sample.image_files(out)) == 8


def _adamw(params, fused):
    t = config.Config(config.validate({"train": {"optimizer": "adamw", "lr": 0.01}})).train
    return optim.build_optimizer(params, t, fused=fused)


@pytest.mark.parametrize("first, second", [(False, True), (True, False)])
def test_optimizer_state_resumes_across_the_fused_switch_and_keeps_the_chosen_kernel(first, second):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    grads = [torch.randn(16, 8) for _ in range(3)]
    a = _adamw([w], first)
    for g in grads[:2]:
        w.grad = g.clone()
        a.step()
    saved = copy.deepcopy(a.state_dict())  # as read from a checkpoint: shares no tensor with `a`
    w2 = torch.nn.Parameter(w.detach().clone())
    b = _adamw([w2], second)
    optim.load_optimizer_state(b, saved)
    assert bool(b.param_groups[0]["fused"]) is second  # not the checkpoint's flag
    assert b.state_dict()["state"][0].keys() == saved["state"][0].keys()
    w.grad, w2.grad = grads[2].clone(), grads[2].clone()
    a.step()
    b.step()
    assert torch.allclose(w, w2, atol=1e-6)
    assert b.state_dict()["state"][0]["step"].item() == 3


def test_tf32_switch_sets_both_matmul_and_convolution_precision():
    cpu = torch.device("cpu")
    try:
        speed.set_backends(cpu, tf32=True)
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "tf32"
        speed.set_backends(cpu, tf32=False)  # off is strict fp32 for convolutions too (PyTorch's default is not)
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "ieee"
    finally:
        speed.set_backends(cpu, tf32=False)


def test_fused_auto_means_cuda_only():
    assert speed.use_fused("auto", torch.device("cuda", 0)) is True
    assert speed.use_fused("auto", torch.device("cpu")) is False
    assert speed.use_fused(True, torch.device("cpu")) is True


def test_speed_keys_default_off_and_do_not_change_the_trajectory():
    d = config.validate({})
    assert (d["train"]["compile"], d["train"]["tf32"], d["train"]["channels_last"]) == (False, False, False)
    assert d["train"]["fused_optimizer"] == "auto" and d["sample"]["compile"] is False
    fast = config.Config(config.validate({"train": {"compile": True, "tf32": True, "channels_last": True,
                                                    "fused_optimizer": True}}))
    assert config.trajectory_hash(fast) == config.trajectory_hash(config.Config(config.validate({})))
    with pytest.raises(UserError, match="fused_optimizer"):
        config.validate({"train": {"fused_optimizer": "yes"}})


def config_merge(a, b):
    from conftest import deep_merge

    return deep_merge(a, b)


def test_adam_moments_follow_the_parameters_layout_after_a_channels_last_switch():
    """A checkpoint's exp_avg/exp_avg_sq keep the strides they were saved with; a fused kernel then reads
    them against channels_last parameters element by element in another order (on CUDA it refuses)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
    grads = [torch.randn(8, 4, 3, 3) for _ in range(3)]
    a = _adamw([w], True)
    for g in grads[:2]:
        w.grad = g.clone()
        a.step()
    saved = copy.deepcopy(a.state_dict())
    w2 = torch.nn.Parameter(w.detach().clone().to(memory_format=torch.channels_last))
    b = _adamw([w2], True)
    optim.load_optimizer_state(b, saved)
    for key in ("exp_avg", "exp_avg_sq"):
        assert b.state[w2][key].stride() == w2.stride(), key
    w.grad, w2.grad = grads[2].clone(), grads[2].clone().to(memory_format=torch.channels_last)
    a.step()
    b.step()
    assert (w - w2).abs().max() < 1e-6


def test_switching_channels_last_between_fused_segments_matches_a_run_without_the_switch(write_config, tmp_path):
    fused = {"train": {"fused_optimizer": True}}
    straight = prepared(write_config, config_merge(fused, {"run": {"name": "straight"}}), "straight")
    run_cli("train", "--config", straight, "--until-step", 6)
    before = prepared(write_config, config_merge(fused, {"run": {"name": "switch"}}), "switch1")
    run_cli("train", "--config", before, "--until-step", 3)
    after = write_config(config_merge(fused, {"run": {"name": "switch"}, "train": {"channels_last": True}}),
                         name="switch2.yaml")
    run_cli("train", "--config", after, "--until-step", 6)
    a = load_state(tmp_path / "results/straight/checkpoints/step_0000006")
    b = load_state(tmp_path / "results/switch/checkpoints/step_0000006")
    for name, v in a["net"].items():
        assert torch.allclose(v, b["net"][name], atol=1e-5), name


def test_a_compile_failure_in_the_lazily_lowered_backward_is_the_same_one_line(tmp_path):
    """Inductor lowers the backward graph at the first backward, outside the forward; a damaged cache entry
    of the backward raises there. A stand-in backward raises inductor's error type."""
    import torch._inductor.exc

    from diffrelay.errors import UserError
    from diffrelay.runtime import speed

    class Damaged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise torch._inductor.exc.InductorError(RuntimeError("bad cache entry"), None)

    model = speed.CompileErrors(lambda x: Damaged.apply(x), tmp_path / "compile-cache")
    loss = model(torch.ones(3, requires_grad=True)).sum()  # the forward passes
    with pytest.raises(UserError, match=rf"torch.compile failed .*compile cache {tmp_path / 'compile-cache'} may be"):
        with speed.backward_errors(model):
            loss.backward()
    with speed.backward_errors(lambda x: x):  # no compile: nothing to name
        pass


def test_determinism_off_imports_no_compiler_and_on_is_set():
    # torch.use_deterministic_algorithms imports torch._inductor (about 1 s per segment) to store its flag.
    code = ("import sys, torch; from diffrelay.runtime import speed; cpu = torch.device('cpu'); "
            "speed.set_determinism(cpu, False); a = torch.are_deterministic_algorithms_enabled(); "
            "lazy = 'torch._inductor.config' in sys.modules; speed.set_determinism(cpu, True); "
            "b = torch.are_deterministic_algorithms_enabled(); speed.set_determinism(cpu, False); "
            "print(a, lazy, b, torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True", "False", "False"]


def test_reading_the_config_of_a_new_run_does_not_import_torch(tmp_path):
    # Every snakemake call reads the config (common.smk -> preflight.check); torch's import is 1.3 s of it.
    code = (f"import sys; from pathlib import Path; from diffrelay.config import preflight; "
            f"print(preflight._recorded(Path({str(tmp_path)!r})), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["None", "False"]


EAGER = """
import copy, sys, torch
from diffrelay import config
from diffrelay.training import optim
for name in ("adam", "adamw"):
    for fused in (False, True):
        t = config.Config(config.validate({"train": {"optimizer": name, "lr": 0.01, "weight_decay": 0.1}})).train
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SiLU(), torch.nn.Linear(8, 4))
        twin = copy.deepcopy(net)
        opt = optim.build_optimizer(net.parameters(), t, fused=fused)
        sched = optim.build_schedule(opt, t)
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        plain = cls(twin.parameters(), lr=0.01, betas=tuple(t.betas), weight_decay=0.1, foreach=False,
                    fused=fused or None)
        plain_sched = optim.build_schedule(plain, t)
        calls = []
        opt.register_step_pre_hook(lambda *a: calls.append("pre"))
        opt.register_step_post_hook(lambda *a: calls.append("post"))
        for k in range(5):
            x = torch.randn(3, 4)
            for m, o, s in ((net, opt, sched), (twin, plain, plain_sched)):
                m(x).square().sum().backward()
                o.step()
                s.step()
                o.zero_grad(set_to_none=True)
            if k == 2:  # a resume in the middle: the state round-trips
                optim.load_optimizer_state(opt, copy.deepcopy(opt.state_dict()))
        same = all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters()))
        print(name, fused, same, calls == ["pre", "post"] * 5, torch.is_grad_enabled())
print("dynamo", "torch._dynamo" in sys.modules)
"""


def test_the_optimizer_of_a_process_that_compiles_nothing_imports_no_dynamo_and_updates_the_same_bits():
    # torch's optimizers import torch._dynamo on first use (1.35 s of each training job); training/eager.py
    # keeps it out. The plain optimizer beside it is built after: the comparison is against torch's own step.
    out = subprocess.run([sys.executable, "-c", EAGER], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[:4] == [f"{n} {f} True True True" for n in ("adam", "adamw") for f in (False, True)], out
    assert lines[4] == "dynamo True"  # the plain optimizers imported it: the check can see the import
    code = EAGER.replace("plain = cls(", "plain = None and cls(").replace(
        "for m, o, s in ((net, opt, sched), (twin, plain, plain_sched)):", "for m, o, s in ((net, opt, sched),):")
    code = code.replace("plain_sched = optim.build_schedule(plain, t)", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "dynamo False", out


def test_a_compiled_run_keeps_torchs_own_optimizer_step():
    from diffrelay.training import eager

    t = config.Config(config.validate({"train": {"compile": True}})).train
    opt = optim.build_optimizer(torch.nn.Linear(2, 2).parameters(), t)
    assert "step" not in vars(opt)  # the class's step: graph breaks where torch.compile needs them
    t = config.Config(config.validate({})).train
    opt = optim.build_optimizer(torch.nn.Linear(2, 2).parameters(), t)
    assert "step" in vars(opt) and eager.eager_step(opt)
