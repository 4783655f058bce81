"""sample.scheduler (issue 40, item 3): sampling with diffusers' schedulers as diffusers' pipelines sample.

The latents equal a tiny StableDiffusionPipeline's (and StableDiffusion3Pipeline's, for FlowMatchEuler) bit for bit,
for the same weights, prompts, negative prompts, seeds, steps, guidance and scheduler config
(benchmarks/checks/check_diffusers_sampling.py); the PNGs do not depend on the batch size or the process count,
stochastic and multistep schedulers included; a scheduler that does not fit the network is refused in one line,
before any folder; without sample.scheduler nothing changes (no key in the folder's manifest)."""

import dataclasses
import json

import pytest

from conftest import benchmark
from diffrelay import cli, config
from diffrelay.errors import UserError
from diffrelay.sampling import sample, settings as sample_settings
from test_ddpm import ddpm_snapshot
from test_flow import flow_snapshot
from test_sample import folder_bytes, make_snapshot, settings

REQUIRED = ("DPMSolverMultistepScheduler", "EulerAncestralDiscreteScheduler", "UniPCMultistepScheduler",
            "DDIMScheduler", "EulerDiscreteScheduler", "DDPMScheduler", "FlowMatchEulerDiscreteScheduler")


def _check_script():
    return benchmark("check_diffusers_sampling")


def test_latents_equal_the_diffusers_pipelines_bit_for_bit():
    import diffusers

    got = _check_script().run(diffusers, REQUIRED)
    # SD 1.5's config with each scheduler, v-prediction with zero terminal SNR, DPM-Solver++ SDE (noise in every
    # step, from each image's generator), DDIM with eta, and SD3's flow matching.
    assert {"sd/sd15/DPMSolverMultistepScheduler", "sd/vzsnr/UniPCMultistepScheduler",
            "sd/karras-sde/DPMSolverMultistepScheduler", "sd/ddim-eta/DDIMScheduler",
            "sd3/FlowMatchEulerDiscreteScheduler", "sd/sd15/EulerAncestralDiscreteScheduler"} <= set(got)
    assert all(diff == 0 and same for diff, same in got.values()), got


@pytest.mark.parametrize("name", ["EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler"])
def test_pngs_are_byte_identical_for_any_batch_size_and_process_count(tmp_path, name):
    snap = ddpm_snapshot(tmp_path / "step_0000040.safetensors")
    s = settings(num_images=5, steps=3, guidance=1.5, scheduler=name,
                 scheduler_kwargs={"use_karras_sigmas": True} if name.startswith("DPM") else {})
    one, two = tmp_path / "one", tmp_path / "two"
    sample.run(snap, one, dataclasses.replace(s, batch_size=1))
    # two processes, one image a batch against 3 (run one after the other: they share nothing)
    assert sample.run(snap, two, dataclasses.replace(s, batch_size=3), rank=0, world=2) is None
    manifest = sample.run(snap, two, dataclasses.replace(s, batch_size=3), rank=1, world=2)
    ref = folder_bytes(one)
    assert len(ref) == 6 and folder_bytes(two) == ref
    assert manifest["scheduler"]["class"] == name and manifest["scheduler"]["config"]["beta_schedule"] == "linear"
    # the objective's own sampler gives other pixels, and its folder's key has no scheduler in it
    plain = sample.run(snap, tmp_path / "plain", settings(num_images=5, steps=3, guidance=1.5, solver="ddpm"))
    assert "scheduler" not in plain and folder_bytes(tmp_path / "plain")["000000.png"] != ref["000000.png"]


def test_a_flow_network_samples_with_flow_match_euler(tmp_path):
    snap = flow_snapshot(tmp_path / "f.safetensors")
    s = settings(num_images=3, steps=3, guidance=1.5, batch_size=2, solver="euler",
                 scheduler="FlowMatchEulerDiscreteScheduler")
    m = sample.run(snap, tmp_path / "a", s)
    assert m["scheduler"]["config"]["shift"] == 1.0 and len(folder_bytes(tmp_path / "a")) == 4


@pytest.mark.parametrize("snapshot, over, words", [
    ("ddpm", {"scheduler": "FlowMatchEulerDiscreteScheduler"}, ["does not fit model.objective ddpm",
                                                                "DPMSolverMultistepScheduler"]),
    ("ddpm", {"scheduler": "DPMSolverMultistepSchedular"}, ["not a scheduler", "UniPCMultistepScheduler"]),
    ("flow", {"scheduler": "DDIMScheduler", "solver": "euler"}, ["model.objective flow",
                                                                 "FlowMatchEulerDiscreteScheduler"]),
    ("edm", {"scheduler": "EulerDiscreteScheduler"}, ["model.objective edm has no diffusers scheduler"]),
    ("ddpm", {"scheduler": "UniPCMultistepScheduler", "scheduler_kwargs": {"solver_type": "nope"}},
     ["sample.scheduler_kwargs", "solver_type"]),
    ("ddpm", {"scheduler": "DDIMScheduler", "scheduler_kwargs": {"no_such_key": 1}}, ["no_such_key"]),
    ("ddpm", {"scheduler": "DDPMScheduler", "scheduler_kwargs": {"beta_schedule": "linear"}},
     ["sample.scheduler_kwargs.beta_schedule", "model.ddpm"]),
])
def test_a_scheduler_that_does_not_fit_is_one_line_before_any_folder(tmp_path, snapshot, over, words):
    snap = {"ddpm": ddpm_snapshot, "flow": flow_snapshot, "edm": make_snapshot}[snapshot](tmp_path / "s.safetensors")
    with pytest.raises(UserError) as err:
        sample.run(snap, tmp_path / "out", settings(**{"num_images": 2, "steps": 3, "solver": "ddpm"} | over))
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("raw, words", [
    ({"model": {"objective": "ddpm"}, "sample": {"scheduler": "FlowMatchEulerDiscreteScheduler"}},
     ["sample.scheduler=FlowMatchEulerDiscreteScheduler", "DDPMScheduler"]),
    ({"model": {"objective": "flow"}, "sample": {"scheduler": "EulerAncestralDiscreteScheduler"}},
     ["model.objective flow", "FlowMatchEulerDiscreteScheduler"]),
    ({"sample": {"scheduler": "DDIMScheduler"}}, ["model.objective edm"]),
    ({"model": {"objective": "ddpm"}, "sample": {"scheduler": "Foo"}}, ["sample.scheduler=Foo", "UniPC"]),
    ({"model": {"objective": "ddpm"}, "sample": {"scheduler": "UniPCMultistepScheduler",
                                                 "scheduler_kwargs": {"prediction_type": "v_prediction"}}},
     ["sample.scheduler_kwargs.prediction_type", "model.ddpm"]),
    ({"model": {"objective": "ddpm"}, "sample": {"scheduler": "UniPCMultistepScheduler", "ddpm": {"eta": 0.5}}},
     ["sample.ddpm.eta=0.5", "DDIMScheduler"]),
    ({"sample": {"scheduler_kwargs": {"use_karras_sigmas": True}}}, ["sample.scheduler_kwargs", "sample.scheduler"]),
])
def test_config_mistakes_are_one_line_at_parse_time(raw, words):
    with pytest.raises(UserError) as err:
        config.validate(raw)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_a_scheduler_replaces_the_solver_and_the_flags_reach_the_settings():
    # a ddpm run needs no ddpm solver when a scheduler samples it, and DDIMScheduler takes sample.ddpm.eta
    d = config.validate({"model": {"objective": "ddpm"}, "sample": {"scheduler": "DDIMScheduler",
                                                                    "ddpm": {"eta": 0.5}}})
    assert d["sample"]["scheduler"] == "DDIMScheduler" and d["sample"]["scheduler_kwargs"] == {}
    parse = cli.build_parser().parse_args
    args = parse(["sample", "--snapshot", "s", "--out", "o", "--scheduler", "UniPCMultistepScheduler",
                  "--scheduler-kwargs", json.dumps({"use_karras_sigmas": True})])
    s, _ = sample_settings.from_args(args, config.validate({}), config.validate)
    assert s.scheduler == "UniPCMultistepScheduler" and s.scheduler_kwargs == {"use_karras_sigmas": True}
    with pytest.raises(UserError, match="--scheduler-kwargs=.*not a JSON object"):
        sample_settings.from_args(parse(["sample", "--snapshot", "s", "--out", "o", "--scheduler-kwargs", "[1]"]),
                                  config.validate({}), config.validate)
