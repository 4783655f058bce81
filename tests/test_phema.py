"""Post-hoc EMA: the profile math, K segments = one run with the profiles, reconstruction, config keys."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

from conftest import run_cli
from diffrelay import config
from diffrelay.training import checkpoint, phema, profiles
from diffrelay.errors import UserError


def integrate(f, t_max, n=400_000):
    """Midpoint rule on (0, t_max]: plain numerics, independent of profiles.inner's closed form."""
    tau = (np.arange(n) + 0.5) * (t_max / n)
    return f(tau).sum() * (t_max / n)


# ---------------------------------------------------------------------------------------------
# The math


@pytest.mark.parametrize("sigma_rel", [0.01, 0.05, 0.08, 0.10, 0.2, 0.28])
def test_sigma_rel_and_gamma_round_trip_and_match_the_profiles_spread(sigma_rel):
    gamma = profiles.sigma_to_gamma(sigma_rel)
    assert gamma > 0
    assert profiles.gamma_to_sigma(gamma) == pytest.approx(sigma_rel, rel=1e-12)
    # The definition itself: standard deviation of p(tau) over its length t.
    t = 1000.0
    mean = integrate(lambda u: u * profiles.profile(t, gamma, u), t)
    var = integrate(lambda u: (u - mean) ** 2 * profiles.profile(t, gamma, u), t)
    assert np.sqrt(var) / t == pytest.approx(sigma_rel, rel=1e-3)


def test_out_of_range_sigma_rel_is_refused():
    for bad in (0.0, -0.1, 0.29, 1.0):
        with pytest.raises(ValueError):
            profiles.sigma_to_gamma(bad)


@pytest.mark.parametrize("t_a,s_a,t_b,s_b", [(400, 0.05, 1000, 0.10), (1000, 0.05, 400, 0.10),
                                             (700, 0.08, 700, 0.08), (50, 0.2, 900, 0.05)])
def test_inner_product_matches_numerical_integration(t_a, s_a, t_b, s_b):
    g_a, g_b = profiles.sigma_to_gamma(s_a), profiles.sigma_to_gamma(s_b)
    numeric = integrate(lambda u: profiles.profile(t_a, g_a, u) * profiles.profile(t_b, g_b, u), max(t_a, t_b))
    assert float(profiles.inner(t_a, g_a, t_b, g_b)) == pytest.approx(numeric, rel=1e-3)


def test_running_average_weighs_past_steps_as_the_power_profile():
    # Weights e_tau at step tau: the average's entries are the weight it gives each step.
    steps, sigma_rel = 300, 0.10
    net = torch.nn.Linear(steps, 1, bias=False).double()
    avg = phema.PowerEMA(net, [sigma_rel])
    for step in range(steps):
        with torch.no_grad():
            net.weight.zero_()
            net.weight[0, step] = 1.0
        avg.update(net, step)
    w = avg.nets[0].weight[0].numpy()
    gamma, tau = avg.gammas[0], np.arange(1, steps + 1, dtype=np.float64)
    assert w.sum() == pytest.approx(1.0, abs=1e-12)
    # Step tau's weight is the profile's mass over (tau - 1, tau]: here integrated numerically.
    per_step = np.array([integrate(lambda u, t=t: profiles.profile(steps, gamma, t - 1 + u), 1.0, n=2000)
                         for t in tau])
    np.testing.assert_allclose(w, per_step, rtol=1e-5)
    assert w[-1] > w[steps // 2] > w[steps // 4]  # recent weights count most


def test_solve_is_one_hot_for_a_stored_profile_and_fits_another_one():
    stored = [(s, sig) for s in range(100, 1001, 100) for sig in (0.05, 0.10)]
    steps, gammas = [s for s, _ in stored], [profiles.sigma_to_gamma(sig) for _, sig in stored]
    x = profiles.solve(steps, gammas, 1000, profiles.sigma_to_gamma(0.10))
    np.testing.assert_allclose(x, np.eye(len(stored))[stored.index((1000, 0.10))], atol=1e-6)

    target = profiles.sigma_to_gamma(0.08)
    x = profiles.solve(steps, gammas, 1000, target)
    assert x.sum() == pytest.approx(1.0)

    def error(coefs):
        def residual_sq(u):
            made = sum(c * profiles.profile(s, g, u) for c, s, g in zip(coefs, steps, gammas))
            return (made - profiles.profile(1000, target, u)) ** 2
        return np.sqrt(integrate(residual_sq, 1000, n=200_000))

    norm = np.sqrt(integrate(lambda u: profiles.profile(1000, target, u) ** 2, 1000, n=200_000))
    assert error(x) / norm < 0.05  # edm2's two profiles span the widths between them closely
    # Least squares: no stored profile alone, nor a nudge of the solution, fits better.
    assert all(error(np.eye(len(stored))[i]) > error(x) for i in range(len(stored)))
    rng = np.random.default_rng(0)
    for _ in range(3):
        d = rng.normal(size=len(x)) * 0.01
        assert error(x + d - d.mean()) > error(x)


# ---------------------------------------------------------------------------------------------
# Config


def test_phema_off_leaves_the_trajectory_hash_of_existing_configs_alone():
    d = config.validate({})
    old = json.loads(json.dumps(d))
    del old["train"]["phema"], old["sample"]["phema"]  # a config from before the keys existed
    assert config.trajectory_hash(config.Config(d)) == config.trajectory_hash(config.Config(old))
    assert config.trajectory(config.Config(d)) == config.trajectory(old)

    on = config.validate({"train": {"phema": {"every": 100}}})
    other_every = config.validate({"train": {"phema": {"every": 200}}})
    other_profiles = config.validate({"train": {"phema": {"every": 100, "profiles": [0.05, 0.12]}}})
    h = [config.trajectory_hash(config.Config(x)) for x in (d, on, other_every, other_profiles)]
    assert h[1] != h[0]  # the checkpoints then hold the profiles
    assert h[2] == h[1]  # how often they are stored does not change them
    assert h[3] != h[1]
    assert config.first_difference(config.trajectory(config.Config(on)),
                                   config.trajectory(config.Config(other_profiles))) == "train.phema.profiles"


@pytest.mark.parametrize("over,words", [
    ({"train": {"phema": {"every": 300}}}, "train.phema.every=300: does not divide train.segment_steps=400"),
    ({"sample": {"phema": [0.08]}}, "sample.phema=[0.08]: needs the stored EMA profiles; set train.phema.every"),
    ({"train": {"phema": {"every": 100}}, "sample": {"phema": [0.08], "weights": "raw"}},
     "set sample.weights: ema"),
    ({"train": {"phema": {"every": 100, "profiles": [0.3]}}}, "train.phema.profiles.0=0.3: must be less than"),
])
def test_bad_phema_settings_are_one_line_errors(over, words):
    with pytest.raises(UserError) as e:
        config.validate(over, source="c.yaml")
    assert str(e.value).startswith("c.yaml: ") and words in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Training and reconstruction


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The same 6-step run as three 2-step segments and straight through, both storing the profiles."""
    root = tmp_path_factory.mktemp("phema")
    base = {
        "run": {"name": "r", "device": "cpu", "resources": str(root / "resources")},
        "data": {"kind": "shapes", "resolution": 16, "count": 20, "seed": 0},
        "model": {"channels": 8, "channel_mult": [1, 2], "num_blocks": 1, "class_conditional": True},
        "train": {"total_steps": 6, "segment_steps": 2, "batch_size": 8, "lr": 0.002, "warmup_steps": 2,
                  "log_every": 1, "phema": {"every": 2, "profiles": [0.05, 0.10]}},
        "sample": {"phema": [0.08]},
    }
    dirs = {}
    for name in ("split", "straight"):
        d = json.loads(json.dumps(base))
        d["run"]["results"] = str(root / name)
        cfg = root / f"{name}.yaml"
        cfg.write_text(json.dumps(d))
        if name == "split":
            run_cli("prepare", "--config", cfg)
        else:
            shutil.copytree(root / "split/r/dataset", root / "straight/r/dataset")
        ends = (2, 4, 6) if name == "split" else (6,)
        for end in ends:
            run_cli("train", "--config", cfg, "--until-step", end)
        dirs[name] = root / name / "r"
    return dirs


def test_segments_equal_one_run_bitwise_with_the_profiles(trained):
    from test_train import assert_tensors_equal, load_state

    a = load_state(trained["split"] / "checkpoints/step_0000006")
    b = load_state(trained["straight"] / "checkpoints/step_0000006")
    assert a["phema"]["sigma_rel"] == [0.05, 0.10] and len(a["phema"]["nets"]) == 2
    assert_tensors_equal(a, b)
    for step in (2, 4, 6):
        name = f"phema/step_{step:07d}.safetensors"
        (ta, ma), (tb, mb) = phema.read(trained["split"] / name), phema.read(trained["straight"] / name)
        assert_tensors_equal(ta, tb, name)
        assert ma["step"] == mb["step"] == step and ma["trajectory"] == mb["trajectory"]
    # The stored file is the checkpoint's profile state, and the profiles differ from the fixed EMA.
    tensors, meta = phema.read(trained["split"] / "phema/step_0000006.safetensors")
    assert meta["step"] == 6 and meta["sigma_rel"] == [0.05, 0.10]
    for i in (0, 1):
        for k, v in a["phema"]["nets"][i].items():
            assert torch.equal(tensors[f"p{i}.{k}"], v)
    k = next(k for k, v in a["ema"][0].items() if v.is_floating_point())
    assert not torch.equal(a["phema"]["nets"][0][k], a["ema"][0][k])
    assert not torch.equal(a["phema"]["nets"][0][k], a["phema"]["nets"][1][k])


def test_reconstruction_of_a_stored_width_gives_back_its_weights_and_samples(trained, tmp_path):
    rd = trained["split"]
    out = tmp_path / "snap.safetensors"
    run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.10, "--until-step", 6, "--out", out)
    stored, _ = phema.read(rd / "phema/step_0000006.safetensors")
    made, meta = checkpoint.read_snapshot(out)
    assert meta["phema"] == {"sigma_rel": 0.10, "gamma": profiles.sigma_to_gamma(0.10), "step": 6, "error": 0.0}
    assert meta["step"] == 6 and meta["model"]["channels"] == 8
    keys = {k[3:] for k in stored if k.startswith("p1.")}
    assert {k[4:] for k in made} == keys and all(k.startswith("ema.") for k in made)
    for k in keys:
        torch.testing.assert_close(made[f"ema.{k}"], stored[f"p1.{k}"], rtol=1e-4, atol=1e-6)
    # An in-between width is a real blend: neither stored profile.
    mid = tmp_path / "mid.safetensors"
    run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.08, "--until-step", 6, "--out", mid)
    blend, _ = checkpoint.read_snapshot(mid)
    k = sorted(keys)[0]
    assert not torch.allclose(blend[f"ema.{k}"], stored[f"p0.{k}"])
    assert not torch.allclose(blend[f"ema.{k}"], stored[f"p1.{k}"])
    # `diffrelay sample` takes it like any snapshot; raw weights are not in it.
    run_cli("sample", "--snapshot", mid, "--out", tmp_path / "s", "--num-images", 2, "--steps", 2)
    assert len(list((tmp_path / "s").glob("*.png"))) >= 2
    with pytest.raises(UserError, match="holds no raw weights"):
        checkpoint.load_snapshot(mid, weights="raw")


def test_damaged_or_missing_phema_file_is_a_one_line_error_naming_it(trained, tmp_path):
    rd = tmp_path / "r"
    shutil.copytree(trained["split"] / "phema", rd / "phema")
    p = run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.08, "--until-step", 5, check=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "phema/step_0000005.safetensors: post-hoc EMA file not found" in p.stderr
    bad = rd / "phema/step_0000004.safetensors"
    blob = bytearray(bad.read_bytes())
    blob[-3] ^= 0x01
    bad.write_bytes(bytes(blob))
    p = run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.08, "--until-step", 6, "--out", tmp_path / "x",
                check=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"{bad}: sha256 of the weights does not match" in p.stderr
    bad.write_bytes(bytes(blob[:100]))  # truncated
    p = run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.08, "--until-step", 6, "--out", tmp_path / "x",
                check=False)
    assert p.returncode == 2 and f"{bad}: unreadable post-hoc EMA file" in p.stderr
    assert not (tmp_path / "x").exists()


def test_workflow_reconstructs_each_requested_width_after_the_last_segment(tmp_path, write_config):
    from test_workflow import job_counts, snakemake

    cfg = write_config({"train": {"phema": {"every": 3}}, "sample": {"phema": [0.08, 0.125]}})
    p = snakemake(tmp_path, "-n", "--configfile", cfg)
    assert job_counts(p.stdout)["reconstruct_phema"] == 2
    assert job_counts(p.stdout)["train_segment"] == 2
    for sigma in ("0.08", "0.125"):
        assert re.search(rf"diffrelay phema --run-dir \S+/results/tiny --sigma-rel {sigma} --until-step 6 "
                         rf"--out \S+/snapshots/phema/step_0000006_ema{sigma}\.safetensors", p.stdout), p.stdout
    p = snakemake(tmp_path, "-n", "--configfile", write_config({"train": {"phema": {"every": 3}}}))
    assert "reconstruct_phema" not in job_counts(p.stdout)


def test_ema_and_power_ema_update_all_tensors_in_one_foreach_call(monkeypatch):
    """One kernel launch per average and step, not one per tensor (393 for the cifar10 UNet on a GPU);
    the result equals the per-tensor lerp exactly."""
    from diffrelay.training import optim

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    ema, power = optim.EMA(net, [0.9, 0.99]), phema.PowerEMA(net, [0.05, 0.10])
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
        net[1].running_mean.add_(1.0)
    want = [[pe.detach().clone().lerp_(p.detach(), 1 - min(d, 1 / 10)) for pe, p in zip(e.parameters(), net.parameters())]
            for d, e in zip(ema.decays, ema.nets)]
    calls = []
    real = torch._foreach_lerp_
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a: calls.append(len(a[0])) or real(*a))
    ema.update(net, 0)
    power.update(net, 0)
    n = len(list(net.parameters()))
    assert calls == [n] * 4
    for got, exp in zip(ema.nets, want):
        assert all(torch.equal(a, b) for a, b in zip(got.parameters(), exp))
        assert all(torch.equal(a, b) for a, b in zip(got.buffers(), net.buffers()))


def test_phema_out_never_overwrites_a_checkpoint_a_training_snapshot_or_a_users_file(trained, tmp_path):
    rd = trained["split"]
    user = tmp_path / "notes.safetensors"
    user.write_bytes(b"mine")
    for target in (user, rd / "checkpoints/step_0000006/state.pt", rd / "snapshots/step_0000006.safetensors"):
        before = target.read_bytes()
        p = run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.08, "--until-step", 6, "--out", target, check=False)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert f"{target}: exists and is not a post-hoc EMA snapshot" in p.stderr
        assert target.read_bytes() == before
    # Its own earlier result is replaced (another width, same name).
    out = tmp_path / "ema.safetensors"
    run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.08, "--until-step", 6, "--out", out)
    run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.10, "--until-step", 6, "--out", out)
    assert checkpoint.read_snapshot(out)[1]["phema"]["sigma_rel"] == 0.10


def test_reconstruction_error_restated_numerically_and_bad_widths_refused_at_parse_time():
    """The closed-form error equals a midpoint-rule integral of (sum x_i p_i - p)^2; widths the stored
    profiles cannot represent are refused when the config is read, before any training."""
    steps, gammas = [2.0, 4.0, 6.0, 2.0, 4.0, 6.0], [profiles.sigma_to_gamma(s) for s in [0.05] * 3 + [0.10] * 3]
    for width in (0.03, 0.08, 0.2):
        g = profiles.sigma_to_gamma(width)
        x = profiles.solve(steps, gammas, 6, g)
        rebuilt = lambda u: sum(c * profiles.profile(t, gi, u) for c, t, gi in zip(x, steps, gammas))  # noqa: E731
        num = integrate(lambda u: (rebuilt(u) - profiles.profile(6, g, u)) ** 2, 6)
        den = integrate(lambda u: profiles.profile(6, g, u) ** 2, 6)
        assert profiles.error(steps, gammas, 6, g, x) == pytest.approx(np.sqrt(num / den), rel=1e-3, abs=1e-4)
    base = {"train": {"total_steps": 6, "segment_steps": 2, "phema": {"every": 2}}}
    for width in (1e-6, 0.001, 0.01, 0.28):
        with pytest.raises(UserError, match=rf"sample.phema={width}: the stored profiles \[0.05, 0.1\] rebuild"):
            config.validate({**base, "sample": {"phema": [width]}})
    assert config.validate({**base, "sample": {"phema": [0.08]}})["sample"]["phema"] == [0.08]


def test_the_error_is_refused_by_diffrelay_phema_and_recorded_in_the_snapshot(trained, tmp_path):
    rd = trained["split"]
    p = run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.01, "--until-step", 6, "--out", tmp_path / "x",
                check=False)
    assert p.returncode == 2 and "--sigma-rel 0.01: the stored profiles" in p.stderr and "off" in p.stderr
    assert not (tmp_path / "x").exists()
    run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.08, "--until-step", 6, "--out", tmp_path / "y")
    err = checkpoint.read_snapshot(tmp_path / "y")[1]["phema"]["error"]
    assert 0 < err < profiles.MAX_ERROR
    assert err == pytest.approx(profiles.stored_error([2, 4, 6], [0.05, 0.10], 6, 0.08), abs=1e-6)


def test_a_lost_last_profile_file_is_stored_again_from_the_final_checkpoint(trained, tmp_path):
    """Training is done and phema/step_0000006 is gone: the final checkpoint holds the same profiles, so
    reconstruction writes the file again instead of asking to train to that step."""
    rd = tmp_path / "r"
    shutil.copytree(trained["split"], rd)
    original = phema.read(rd / "phema/step_0000006.safetensors")[0]
    (rd / "phema/step_0000006.safetensors").unlink()
    run_cli("phema", "--run-dir", rd, "--sigma-rel", 0.08, "--until-step", 6, "--out", tmp_path / "a.safetensors")
    again = phema.read(rd / "phema/step_0000006.safetensors")[0]
    assert again.keys() == original.keys() and all(torch.equal(again[k], original[k]) for k in original)
    run_cli("phema", "--run-dir", trained["split"], "--sigma-rel", 0.08, "--until-step", 6,
            "--out", tmp_path / "b.safetensors")
    a, b = checkpoint.read_snapshot(tmp_path / "a.safetensors")[0], checkpoint.read_snapshot(tmp_path / "b.safetensors")[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
