"""train.lora: a peft adapter on a tiny SD pipeline's UNet trains alone (the base stays the pipeline's), K segments
equal one run bit for bit, checkpoints hold the adapter only, diffusers' load_lora_weights reads the exported file
to the same network output, and each misuse is one line (docs/pretrained.md, "LoRA"); a run without an EMA
(train.ema_decays: []) samples and exports its raw adapter, and the EMA update moves the adapter's tensors only.
Nothing is downloaded."""

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pipelines
from conftest import run_cli
from diffrelay import config
from diffrelay.errors import UserError
from diffrelay.pretrained import lora, weights
from diffrelay.training import checkpoint, train
from diffrelay.training.state import TrainState

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LORA = {"rank": 2, "alpha": 4.0}


def raw(work: Path, pipe, name="ft", **train_keys) -> dict:
    return {"run": {"name": name, "results": str(work / "results"), "resources": str(work / "resources"),
                    "device": "cpu"},
            "data": {"kind": "shapes", "count": 16, "resolution": 16, "captions": "auto", "val_fraction": 0.25},
            "model": {"pretrained": str(pipe)},
            "train": {"total_steps": 2, "segment_steps": 1, "batch_size": 4, "log_every": 1, "warmup_steps": 1,
                      "lr": 0.01, "lora": LORA} | train_keys,
            "sample": {"steps": 2, "batch_size": 4, "solver": "ddim"},
            "fid": {"extractor": "random", "batch_size": 16}}


def one_line(fn) -> str:
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-step run in one segment (its trained TrainState kept), the same in 2 segments, on one dataset."""
    import yaml

    work = tmp_path_factory.mktemp("lora")
    sd = pipelines.sd(work / "sd")
    d = config.validate(raw(work, sd))
    (work / "ft.yaml").write_text(yaml.safe_dump(d))
    run_cli("prepare", "--config", work / "ft.yaml", "--out", work / "dataset")
    built = []
    original = TrainState.build.__func__

    def keep(cls, *a, **k):
        built.append(original(cls, *a, **k))
        return built[-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(TrainState, "build", classmethod(keep))
    try:
        assert train.run(config.Config(d), until_step=2, dataset_dir=work / "dataset") == 0
        two = config.Config(config.validate(raw(work, sd, name="ft2")))
        for until in (1, 2):
            assert train.run(two, until_step=until, dataset_dir=work / "dataset") == 0
    finally:
        mp.undo()
    # The same without LoRA (every weight trains): one run, and two segments.
    assert train.run(config.Config(config.validate(raw(work, sd, name="full", lora=None))), until_step=2,
                     dataset_dir=work / "dataset") == 0
    for until in (1, 2):
        assert train.run(config.Config(config.validate(raw(work, sd, name="full2", lora=None))), until_step=until,
                         dataset_dir=work / "dataset") == 0
    return {"work": work, "sd": sd, "cfg": d, "state": built[0], "one": work / "results" / "ft",
            "two": work / "results" / "ft2", "full": work / "results" / "full", "full2": work / "results" / "full2"}


def test_config_fills_diffusers_defaults_and_needs_a_pipeline(run, tmp_path):
    spec = run["cfg"]["train"]["lora"]
    assert spec == {"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": ["to_k", "to_q", "to_v", "to_out.0"],
                    "kind": "lora", "quantize_base": None}
    assert config.validate(run["cfg"]) == run["cfg"]  # a recorded config reads back as itself
    d = raw(tmp_path, run["sd"], lora={})
    assert config.validate(d)["train"]["lora"]["alpha"] == 4  # alpha = rank
    del d["model"]["pretrained"]
    d["data"]["captions"] = "none"
    msg = one_line(lambda: config.validate(d, "ft.yaml"))
    assert msg.startswith("ft.yaml: train.lora: needs model.pretrained"), msg
    # Off, it is no part of the trajectory: runs from before train.lora keep their hash.
    off = raw(tmp_path, run["sd"], lora=None)
    assert "lora" not in config.trajectory(config.Config(config.validate(off)))["train"]


def test_only_the_adapter_trains_and_the_base_stays_the_pipelines(run):
    st = run["state"]
    model = weights.text_net(st.net)
    want = load_file(run["sd"] / "unet" / "diffusion_pytorch_model.safetensors")
    got = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if lora.MARK not in k}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    adapter = lora.only(model.state_dict())
    assert adapter and all(k.endswith(("lora_A.default.weight", "lora_B.default.weight")) for k in adapter)
    assert any(k.endswith("lora_B.default.weight") and v.abs().max() > 0 for k, v in adapter.items())  # B starts 0
    trainable = {id(p) for g in st.opt.param_groups for p in g["params"]}
    assert trainable == {id(p) for n, p in st.net.named_parameters() if lora.MARK in n}
    assert all(p.requires_grad == (lora.MARK in n) for n, p in st.net.named_parameters())


@pytest.mark.parametrize("one, two", [("one", "two"), ("full", "full2")], ids=["lora", "full"])
def test_two_segments_equal_one_run_bit_for_bit(run, one, two):
    """A LoRA run and a full fine-tune of the pipeline: the second segment resumes from the checkpoint, not from
    the folder's weights, and ends where one segment does."""
    a, _ = checkpoint.load_checkpoint(run[one] / "checkpoints" / "step_0000002")
    b, _ = checkpoint.load_checkpoint(run[two] / "checkpoints" / "step_0000002")
    for key in ("net", "ema"):
        left, right = (a[key], b[key]) if key == "net" else (a[key][0], b[key][0])
        assert set(left) == set(right) and left
        assert all(torch.equal(left[k], right[k]) for k in left), key
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa and all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    if one == "full":  # every weight trained: the folder's keys, and not the folder's values
        base = load_file(run["sd"] / "unet" / "diffusion_pytorch_model.safetensors")
        net = {k.removeprefix("net.model."): v for k, v in a["net"].items()}
        assert set(net) == set(base) and not all(torch.equal(net[k], base[k]) for k in base), sorted(a["net"])[:3]


def test_a_checkpoint_holds_the_adapter_only(run):
    path = run["one"] / "checkpoints" / "step_0000002"
    state, _ = checkpoint.load_checkpoint(path)
    keys = list(state["net"]) + [k for e in state["ema"] for k in e]
    assert keys and all(lora.MARK in k for k in keys)
    base = (run["sd"] / "unet" / "diffusion_pytorch_model.safetensors").stat().st_size
    size = (path / "state.pt").stat().st_size
    assert size * 4 < base, (size, base)  # net, EMA and two Adam moments of rank 2: a quarter of the base at most
    snap = load_file(run["one"] / "snapshots" / "step_0000002.safetensors")
    assert snap and all(lora.MARK in k for k in snap)


def test_diffusers_loads_the_exported_adapter_to_the_same_output(run):
    from diffusers import StableDiffusionPipeline

    snap = run["one"] / "snapshots" / "step_0000002.safetensors"
    net, _ = checkpoint.load_snapshot(snap, "ema", model_cfg=run["cfg"]["model"])
    mine = weights.text_net(net)
    exported = run["one"] / "lora" / "step_0000002"
    assert sorted(os.listdir(exported)) == [lora.WEIGHT_NAME, lora.RAW_NAME]
    pipe = StableDiffusionPipeline.from_pretrained(run["sd"], local_files_only=True, use_safetensors=True)
    pipe.load_lora_weights(exported)
    torch.manual_seed(0)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 77, 32)
    with torch.no_grad():
        want = pipe.unet(x, t, encoder_hidden_states=text).sample
        got = mine(x, t, encoder_hidden_states=text).sample
        base = StableDiffusionPipeline.from_pretrained(run["sd"], local_files_only=True,
                                                       use_safetensors=True).unet(x, t, encoder_hidden_states=text)
    assert not torch.allclose(base.sample, want, atol=1e-6)  # the adapter changes the output
    # The same modules and tensors in the same order of operations: equal up to float32 rounding.
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    # Beside it, the raw (trained, not averaged) adapter, for sample.weights: raw.
    raw_net, _ = checkpoint.load_snapshot(snap, "raw", model_cfg=run["cfg"]["model"])
    pipe = StableDiffusionPipeline.from_pretrained(run["sd"], local_files_only=True, use_safetensors=True)
    pipe.load_lora_weights(exported, weight_name=lora.RAW_NAME)
    with torch.no_grad():
        want_raw = pipe.unet(x, t, encoder_hidden_states=text).sample
        got_raw = weights.text_net(raw_net)(x, t, encoder_hidden_states=text).sample
    assert torch.allclose(got_raw, want_raw, rtol=0, atol=1e-6) and not torch.allclose(got_raw, got, atol=1e-6)


def test_sampling_against_another_base_is_one_line(run):
    other = pipelines.sd(run["work"] / "other", seed=1)
    d = config.validate(raw(run["work"], other))
    snap = run["one"] / "snapshots" / "step_0000002.safetensors"
    msg = one_line(lambda: checkpoint.load_snapshot(snap, "ema", model_cfg=d["model"]))
    assert "a LoRA adapter trained on another base pipeline (unet/diffusion_pytorch_model.safetensors" in msg, msg


def test_resuming_on_a_changed_base_pipeline_names_the_file_both_sha256s_and_the_fix(run):
    """The base pipeline's files are part of the run's identity, keyed by file names that hold dots: the refusal names
    the file and both sha256s (not `...sha256.unet/diffusion_pytorch_model.safetensors=None`) and no key to set."""
    import shutil

    from diffrelay.config import preflight

    other = shutil.copytree(run["sd"], run["work"] / "other-base")  # the same folder with another UNet
    unet = "unet/diffusion_pytorch_model.safetensors"
    shutil.copyfile(pipelines.sd(run["work"] / "seed-1", seed=1) / unet, other / unet)
    cfg = config.Config(config.validate(raw(run["work"], other)))  # run "ft", already trained on run["sd"]
    was = run["cfg"]["model"]["pretrained"]["sha256"]
    now = cfg.to_dict()["model"]["pretrained"]["sha256"]
    name = next(k for k in sorted(was) if was[k] != now[k])
    assert name == unet
    for fn in (lambda: preflight.check_run_folder(cfg, "ft.yaml"),
               lambda: train.run(cfg, until_step=2, dataset_dir=run["work"] / "dataset")):
        msg = one_line(fn)
        assert f"pipeline's {name} has sha256 {now[name][:12]}... now" in msg, msg
        assert f"made with {was[name][:12]}..." in msg and "restore the pipeline folder" in msg, msg
        assert "=None" not in msg and "set model" not in msg, msg


def test_changing_the_adapter_kind_on_resume_names_the_runs_kind_not_none(run):
    """Run "ft" trained with train.lora.kind left at its default, lora, which its record leaves out (issue 71):
    the refusal names lora, and the value to set back, never kind=None (null is refused by the schema)."""
    from diffrelay.config import preflight

    for kind in ("lokr", "dora"):
        cfg = config.Config(config.validate(raw(run["work"], run["sd"], lora=LORA | {"kind": kind})))
        msg = one_line(lambda: preflight.check_run_folder(cfg, "ft.yaml"))
        assert f"ft.yaml: train.lora.kind='{kind}', but " in msg and "made with train.lora.kind='lora'" in msg, msg
        assert msg.endswith("or set train.lora.kind back to 'lora'") and "None" not in msg, msg


@pytest.mark.parametrize("change", [{"kind": "lokr"}, {"rank": 4}, {"target_modules": ["to_q", "to_k"]}])
def test_init_from_another_adapter_names_the_key_that_differs_and_both_values(run, change):
    """--init from run "ft"'s checkpoint (a rank-2 LoRA on the default targets) into another adapter: one line naming
    the key that makes the tensors differ, not "rank and target_modules must match" (or a size-mismatch traceback)."""
    key, value = next(iter(change.items()))
    name = f"init-{key}"
    cfg = config.Config(config.validate(raw(run["work"], run["sd"], name=name, total_steps=3, lora=LORA | change)))
    init = run["one"] / "checkpoints" / "step_0000002"
    was = {"kind": "lora", "rank": 2, "target_modules": sorted(run["cfg"]["train"]["lora"]["target_modules"])}[key]
    msg = one_line(lambda: train.run(cfg, until_step=3, init=init, dataset_dir=run["work"] / "dataset"))
    assert msg.startswith(f"{init}: holds an adapter of train.lora.{key}={json.dumps(was)}, and this run has "
                          f"train.lora.{key}={json.dumps(sorted(value) if key == 'target_modules' else value)}; "
                          f"set train.lora.{key}: {json.dumps(was)} to start from it"), msg
    assert not (run["work"] / "results" / name / "checkpoints").exists() or not any(
        (run["work"] / "results" / name / "checkpoints").iterdir())


def test_a_target_module_that_matches_nothing_is_one_line(run):
    from diffrelay import objectives

    d = run["cfg"]
    net = objectives.build(d["model"], 8, 0, 4, text={"states": 32, "length": 77, "pooled": 0})
    spec = d["train"]["lora"] | {"target_modules": ["to_q", "to_qkv"]}
    msg = one_line(lambda: lora.attach(net, spec, 0))
    assert msg.startswith("train.lora.target_modules: 'to_qkv' matches no module of UNet2DConditionModel; use "
                          "module names it has, e.g. "), msg
    assert "to_q" in msg.split("e.g.")[1]
    # diffrelay validate (and the Snakefile, through validate.check_network) refuse it before any work.
    from diffrelay.config import report as validate

    bad = config.Config(config.validate(raw(run["work"], run["sd"], lora={"target_modules": ["to_qkv"]})))
    assert "'to_qkv' matches no module" in one_line(lambda: validate.check_network(bad))
    validate.check_network(config.Config(d))


def test_diffrelay_sample_draws_from_a_lora_snapshot(run):
    """The CLI end to end: the base from the config's pipeline, the adapter from the snapshot."""
    prompts = run["work"] / "prompts.txt"
    prompts.write_text("a red circle\n")
    out = run["work"] / "samples"
    run_cli("sample", "--config", run["work"] / "ft.yaml", "--snapshot",
            run["one"] / "snapshots" / "step_0000002.safetensors", "--out", out, "--prompts", prompts)
    assert len(list(out.glob("*.png"))) >= 1


def test_sample_guidance_reaches_the_prompt_file_check_for_a_pipeline_folder_and_a_run_snapshot(run, tmp_path):
    """--guidance 3 with a prompt file's negative prompt was refused ("sample.guidance is 1"): the flag came after the
    check. The issue's own commands: a pipeline folder with --resolution, and a run snapshot whose config has 1."""
    import json

    from diffrelay import cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square --n blurry\n")
    snap = run["one"] / "snapshots" / "step_0000002.safetensors"
    for name, given in (("pipe", ["--snapshot", str(run["sd"]), "--resolution", "16"]),
                        ("run", ["--config", str(run["work"] / "ft.yaml"), "--snapshot", str(snap)])):
        assert cli.main(["sample", *given, "--out", str(tmp_path / name), "--prompts", str(prompts), "--guidance", "3",
                         "--steps", "2", "--solver", "ddim"]) == 0
        assert json.loads((tmp_path / name / "manifest.json").read_text())["guidance"] == 3


def test_guidance_without_caption_dropout_is_refused_from_scratch_and_kept_for_a_pipeline(run, tmp_path):
    import textmodels
    from test_text_workflow import text_config

    # A pipeline's network learnt its unconditional model in pretraining: diffusers' scripts fine-tune without
    # caption dropout and validate with guidance, and so may a model.pretrained run.
    d = raw(tmp_path, run["sd"])
    d["sample"]["guidance"] = [1, 5]
    d = config.validate(d)
    assert d["data"]["caption_dropout"] == 0 and d["sample"]["guidance"] == [1, 5]
    textmodels.clip_text(tmp_path / "enc", hidden=32)
    scratch = text_config(tmp_path, data={"caption_dropout": 0})  # a text network trained here, from scratch
    msg = one_line(lambda: config.validate(scratch, "t2i.yaml"))
    assert msg.startswith("t2i.yaml: sample.guidance=2: the network is trained without caption dropout"), msg


# ---------------------------------------------------------------------------------------------------------------
# train.ema_decays: [] (no EMA, as diffusers' LoRA scripts), and the EMA update of a LoRA run


@pytest.fixture(scope="module")
def no_ema(run):
    """A LoRA run that keeps no EMA: one run of 2 steps, and the same in 2 segments, on `run`'s pipeline and data."""
    import yaml

    work, sd = run["work"], run["sd"]
    d = config.validate(raw(work, sd, name="noema", ema_decays=[]))
    (work / "noema.yaml").write_text(yaml.safe_dump(d))
    assert train.run(config.Config(d), until_step=2, dataset_dir=work / "dataset") == 0
    two = config.Config(config.validate(raw(work, sd, name="noema2", ema_decays=[])))
    for until in (1, 2):
        assert train.run(two, until_step=until, dataset_dir=work / "dataset") == 0
    return {"cfg": d, "yaml": work / "noema.yaml", "one": work / "results" / "noema",
            "two": work / "results" / "noema2", "snap": work / "results" / "noema" / "snapshots" / "step_0000002.safetensors"}


def test_no_ema_is_allowed_and_an_ema_decay_beside_it_is_one_line(run, tmp_path):
    from diffrelay.evaluation import protocol

    d = config.validate(raw(tmp_path, run["sd"], ema_decays=[]))
    assert d["train"]["ema_decays"] == [] and d["train"]["ema_halflife_kimg"] is None
    assert protocol.ema_decays(d) == [None]  # the workflow samples each snapshot once, under its plain name
    for decay in (0.999, [0.999, 0.9999]):
        bad = raw(tmp_path, run["sd"], ema_decays=[])
        bad["sample"]["ema_decay"] = decay
        msg = one_line(lambda: config.validate(bad, "ft.yaml"))
        assert msg.startswith(f"ft.yaml: sample.ema_decay={decay}: train.ema_decays: [] keeps no EMA, so sampling "
                              "uses the raw weights; set sample.ema_decay: null"), msg


def test_a_run_without_ema_trains_two_segments_equal_to_one_bit_for_bit(no_ema):
    a, _ = checkpoint.load_checkpoint(no_ema["one"] / "checkpoints" / "step_0000002")
    b, _ = checkpoint.load_checkpoint(no_ema["two"] / "checkpoints" / "step_0000002")
    assert a["ema"] == [] == b["ema"]
    assert a["net"] and set(a["net"]) == set(b["net"]) and all(lora.MARK in k for k in a["net"])
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa and all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    # The snapshot holds the raw adapter, and nothing under an EMA's name.
    one, two = load_file(no_ema["snap"]), load_file(no_ema["two"] / "snapshots" / "step_0000002.safetensors")
    assert set(one) == {f"raw.{k}" for k in a["net"]} and set(one) == set(two)
    assert all(torch.equal(one[k], two[k]) and torch.equal(one[k], a["net"][k[4:]]) for k in one)


def test_a_run_without_ema_samples_and_exports_its_raw_weights(run, no_ema, tmp_path):
    import json

    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from diffrelay import cli

    snap, model_cfg = no_ema["snap"], no_ema["cfg"]["model"]
    net, _ = checkpoint.load_snapshot(snap, "ema", model_cfg=model_cfg)  # the default: the raw weights
    raw_net, _ = checkpoint.load_snapshot(snap, "raw", model_cfg=model_cfg)
    mine, theirs = net.state_dict(), raw_net.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    msg = one_line(lambda: checkpoint.load_snapshot(snap, "ema", model_cfg=model_cfg, decay=0.999))
    assert "was trained without an EMA (train.ema_decays: []), so its raw weights are sampled; drop " \
           "sample.ema_decay (--ema-decay)" in msg, msg
    # diffusers' folder: the one file its LoRA scripts write, the raw adapter, which load_lora_weights reads.
    exported = no_ema["one"] / "lora" / "step_0000002"
    assert os.listdir(exported) == [lora.WEIGHT_NAME]
    pipe = StableDiffusionPipeline.from_pretrained(run["sd"], local_files_only=True, use_safetensors=True)
    pipe.load_lora_weights(exported)
    torch.manual_seed(0)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 77, 32)
    with torch.no_grad():
        want = weights.text_net(raw_net)(x, t, encoder_hidden_states=text).sample
        assert torch.allclose(pipe.unet(x, t, encoder_hidden_states=text).sample, want, rtol=0, atol=1e-6)
    # diffrelay sample with the config's sample.weights (ema): the raw weights, said so.
    prompts, out = tmp_path / "prompts.txt", tmp_path / "samples"
    prompts.write_text("a red circle\n")
    assert cli.main(["sample", "--config", str(no_ema["yaml"]), "--snapshot", str(snap), "--out", str(out),
                     "--prompts", str(prompts)]) == 0
    assert list(out.glob("*.png")) and json.loads((out / "manifest.json").read_text())["weights"] == "raw"
    # diffrelay export (default --weights ema): the raw adapter fused into the pipeline's network.
    folder = tmp_path / "exported"
    assert cli.main(["export", "--config", str(no_ema["yaml"]), "--snapshot", str(snap), "--out", str(folder)]) == 0
    record = json.loads((folder / "diffrelay_export.json").read_text())
    assert record["weights"] == "raw" and record["lora_fused"], record
    with torch.no_grad():
        got = UNet2DConditionModel.from_pretrained(folder / "unet").eval()(x, t, encoder_hidden_states=text).sample
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()


def test_the_ema_update_walks_only_the_trainable_tensors(run, monkeypatch):
    """A LoRA network holds hundreds of frozen tensors beside its few adapter ones: the EMA finds the adapter's once,
    and each update moves those without walking the network (a walk of every parameter pair took 9.4 % of a step)."""
    from diffrelay.training import optim

    net = run["state"].net
    ema = optim.EMA(net, [0.9])
    trainable = [p for p in net.parameters() if p.requires_grad]
    pairs = ema.pairs[0]
    assert [id(p) for p in pairs.src] == [id(p) for p in trainable]
    assert 0 < len(trainable) * 4 < len(list(net.parameters()))
    with torch.no_grad():
        for a in pairs.avg:
            a.add_(1.0)  # away from the network's, so that the update moves them
    before = [a.clone() for a in pairs.avg]

    def walk(*args, **kwargs):
        raise AssertionError("the EMA update walked a network's tensors")

    for name in ("parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules",
                 "children", "named_children", "state_dict"):
        monkeypatch.setattr(torch.nn.Module, name, walk)
    ema.update(net, 50)
    monkeypatch.undo()
    d = min(0.9, 51 / 60)
    assert all(torch.equal(a, torch.lerp(b, p.detach(), 1 - d)) for a, b, p in zip(pairs.avg, before, trainable))
    frozen = {id(p) for p in net.parameters() if not p.requires_grad}
    assert frozen and frozen <= {id(p) for p in ema.nets[0].parameters()}  # shared, never copied nor moved


def test_an_int8_base_trains_the_adapter_and_resumes_bit_for_bit(run):
    """train.lora.quantize_base: int8 (torchao's weight-only int8 on the frozen base's linear layers): two segments
    end where one run does, bit for bit; the checkpoint holds the adapter only; the base is the pipeline's, quantized
    (the adapter differs from the fp32 base's run); with fsdp2 it is one line."""
    from torchao.utils import TorchAOBaseTensor

    work, dataset = run["work"], run["work"] / "dataset"
    spec = LORA | {"quantize_base": "int8"}
    d = config.validate(raw(work, run["sd"], name="int8", lora=spec))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train.run(config.Config(d), until_step=2, dataset_dir=dataset) == 0
    # peft's "TorchaoLoraLinear ... merge() / unmerge() will raise": nothing merges an adapter on a quantized base
    # (lora.attach's note), so it is not shown.
    assert not [w for w in caught if "TorchaoLoraLinear" in str(w.message)]
    for until in (1, 2):
        assert train.run(config.Config(config.validate(raw(work, run["sd"], name="int8-2", lora=spec))),
                         until_step=until, dataset_dir=dataset) == 0
    a, _ = checkpoint.load_checkpoint(work / "results" / "int8" / "checkpoints" / "step_0000002")
    b, _ = checkpoint.load_checkpoint(work / "results" / "int8-2" / "checkpoints" / "step_0000002")
    fp32, _ = checkpoint.load_checkpoint(run["one"] / "checkpoints" / "step_0000002")
    assert a["net"] and all(lora.MARK in k for k in a["net"]) and set(a["net"]) == set(fp32["net"])
    assert all(torch.equal(a["net"][k], b["net"][k]) and torch.equal(a["ema"][0][k], b["ema"][0][k]) for k in a["net"])
    assert all(torch.equal(a["optimizer"]["state"][i]["exp_avg"], b["optimizer"]["state"][i]["exp_avg"])
               for i in a["optimizer"]["state"])
    assert not all(torch.equal(a["net"][k], fp32["net"][k]) for k in a["net"])  # trained on the quantized base
    # In the run's identity when set (another trajectory than the fp32 base's run), absent when not.
    assert config.trajectory(config.Config(d))["train"]["lora"]["quantize_base"] == "int8"
    assert "quantize_base" not in config.trajectory(config.Config(run["cfg"]))["train"]["lora"]
    # The layers the base quantizes: every linear weight of the diffusers network, none of the convolutions.
    net, _ = checkpoint.load_snapshot(run["one"] / "snapshots" / "step_0000002.safetensors", "raw",
                                      model_cfg=run["cfg"]["model"])
    lora.quantize(net, "int8")
    model = weights.text_net(net)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linear and all(isinstance(m.weight, TorchAOBaseTensor) for m in linear)
    assert not any(isinstance(m.weight, TorchAOBaseTensor) for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    keys = raw(work, run["sd"], name="bad", lora=LORA | {"quantize_base": "int8"})
    keys["train"]["sharding"] = "fsdp2"
    assert "not sharded here" in one_line(lambda: config.validate(keys, "ft.yaml"))


def test_sample_quantize_base_int8_samples_the_base_as_training_holds_it_and_is_keyed_only_when_set(run, tmp_path):
    """sample.quantize_base: int8 quantizes the frozen base's linear layers before the adapter is attached (the
    adapter stays fp32), as train.lora.quantize_base does; its images differ from the unquantized base's only
    slightly; the folder's key names it only when set (null: the key as before); nf4 on a CPU and a run without
    train.lora are one line each."""
    import dataclasses

    import numpy as np
    from PIL import Image
    from torchao.utils import TorchAOBaseTensor

    from diffrelay.sampling import sample, settings

    d, snap = run["cfg"], run["one"] / "snapshots" / "step_0000002.safetensors"
    net, _ = checkpoint.load_snapshot(snap, "ema", model_cfg=d["model"], quantize=("int8", "fp32"))
    q = weights.text_net(net).down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q
    assert isinstance(q.base_layer.weight, TorchAOBaseTensor)
    assert not isinstance(q.lora_A["default"].weight, TorchAOBaseTensor) and q.lora_B["default"].weight.abs().sum() > 0
    fp32, _ = checkpoint.load_snapshot(snap, "ema", model_cfg=d["model"])
    torch.manual_seed(0)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 77, 32)
    with torch.no_grad():
        got, want = (weights.text_net(m)(x, t, encoder_hidden_states=text).sample for m in (net, fp32))
    assert 0 < (got - want).norm() / want.norm() < 5e-3  # measured: 1.3e-3 (max 1.5e-3 of outputs up to 1.2)
    (tmp_path / "prompts.txt").write_text("a red circle\na blue square\n")
    s = dataclasses.replace(settings.Settings.from_section(d["sample"]), steps=3, batch_size=2,
                            prompts=str(tmp_path / "prompts.txt"))
    where = {"model_cfg": d["model"], "data_cfg": d["data"], "resources": d["run"]["resources"]}
    plain = sample.run(snap, tmp_path / "plain", s, **where)
    int8 = sample.run(snap, tmp_path / "int8", dataclasses.replace(s, quantize_base="int8"), **where)
    assert "quantize_base" not in plain and int8.pop("quantize_base") == "int8"
    assert {k: v for k, v in plain.items() if k in sample.PIXEL_KEYS} == {k: v for k, v in int8.items()
                                                                          if k in sample.PIXEL_KEYS}
    a, b = (np.stack([np.asarray(Image.open(tmp_path / f / f"{i:06d}.png")).astype(int) for i in range(2)])
            for f in ("plain", "int8"))
    diff = np.abs(a - b)  # measured: at most 1 of 255, 24 of 1,536 values
    assert 0 < diff.max() <= 4 and diff.mean() < 0.1, (diff.max(), diff.mean())
    assert "bitsandbytes' 4-bit inference is sampled on CUDA" in one_line(  # before any weight is read
        lambda: sample.run(snap, tmp_path / "nf4", dataclasses.replace(s, quantize_base="nf4"), **where))
    bad = raw(run["work"], run["sd"], name="q", lora=None)
    bad["sample"]["quantize_base"] = "int8"
    assert "this run has no train.lora" in one_line(lambda: config.validate(bad, "q.yaml"))


@pytest.mark.parametrize("kind", ["dora", "lokr", "loha"])
def test_each_adapter_kind_trains_alone_and_is_written_where_its_loader_reads_it(run, kind):
    """train.lora.kind through peft's own configs: only the adapter's tensors train and are checkpointed; DoRA's
    file loads with diffusers' load_lora_weights, LoKr's and LoHa's as peft saves them (adapter_config.json and
    adapter_model.safetensors, read back by peft), each giving diffrelay's network output."""
    import json as json_

    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict

    work, spec = run["work"], LORA | {"kind": kind}
    d = config.validate(raw(work, run["sd"], name=kind, total_steps=1, lora=spec))
    assert train.run(config.Config(d), until_step=1, dataset_dir=work / "dataset") == 0
    state, _ = checkpoint.load_checkpoint(work / "results" / kind / "checkpoints" / "step_0000001")
    marks = {"dora": "lora_magnitude_vector", "lokr": "lokr_w1", "loha": "hada_w1_a"}
    assert state["net"] and all(lora.is_adapter(k) for k in state["net"])
    assert any(marks[kind] in k for k in state["net"])
    assert config.trajectory(config.Config(d))["train"]["lora"]["kind"] == kind
    snap = work / "results" / kind / "snapshots" / "step_0000001.safetensors"
    net, _ = checkpoint.load_snapshot(snap, "raw", model_cfg=d["model"])
    mine = weights.text_net(net)
    folder = work / "results" / kind / "lora" / "step_0000001"
    torch.manual_seed(0)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 77, 32)
    if kind == "dora":
        pipe = StableDiffusionPipeline.from_pretrained(run["sd"], local_files_only=True, use_safetensors=True)
        pipe.load_lora_weights(folder, weight_name=lora.RAW_NAME)
        theirs = pipe.unet
    else:
        assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors",
                                              "adapter_model_raw.safetensors"]
        assert json_.loads((folder / "adapter_config.json").read_text())["peft_type"] == kind.upper()
        theirs = UNet2DConditionModel.from_pretrained(run["sd"] / "unet", local_files_only=True, use_safetensors=True)
        inject_adapter_in_model(PeftConfig.from_pretrained(folder), theirs)
        set_peft_model_state_dict(theirs, load_file(folder / "adapter_model_raw.safetensors"))
    base = UNet2DConditionModel.from_pretrained(run["sd"] / "unet", local_files_only=True, use_safetensors=True)
    with torch.no_grad():
        got, want, plain = (m(x, t, encoder_hidden_states=text).sample for m in (mine, theirs, base))
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    assert not torch.allclose(plain, want, atol=1e-6)  # the trained adapter changes the output


def test_the_comfyui_export_is_kohyas_layout_and_diffusers_converter_reads_it_to_the_same_output(run, tmp_path):
    """`diffrelay export --lora-format comfyui`: lora_unet_<module>.lora_down/lora_up/alpha, read back by diffusers'
    own converter of kohya files (load_lora_weights of a non-diffusers file) to diffrelay's UNet output; it
    replaces only a file it wrote."""
    from diffusers import StableDiffusionPipeline
    from safetensors import safe_open

    snap = run["one"] / "snapshots" / "step_0000002.safetensors"
    (tmp_path / "ft.yaml").write_text(__import__("yaml").safe_dump(run["cfg"]))
    out = tmp_path / "my-lora.safetensors"
    from diffrelay import cli
    from diffrelay.training import export

    def in_process(*argv):  # the command's own parse and main, without a new interpreter's imports
        return export.main(cli.build_parser().parse_args(["export", "--config", str(tmp_path / "ft.yaml"),
                                                          "--snapshot", str(snap), *map(str, argv)]))

    assert in_process("--out", out, "--weights", "raw", "--lora-format", "comfyui") == 0
    keys = load_file(out)
    assert keys and all(k.startswith("lora_unet_") and k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha"))
                        for k in keys)
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_out_0.alpha" in keys
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["ss_network_dim"] == "2"
    net, _ = checkpoint.load_snapshot(snap, "raw", model_cfg=run["cfg"]["model"])
    pipe = StableDiffusionPipeline.from_pretrained(run["sd"], local_files_only=True, use_safetensors=True)
    pipe.load_lora_weights(str(out))
    torch.manual_seed(0)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 77, 32)
    with torch.no_grad():
        got, want = (m(x, t, encoder_hidden_states=text).sample for m in (weights.text_net(net), pipe.unet))
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    assert in_process("--out", out, "--lora-format", "comfyui") == 0  # its own earlier file is replaced
    theirs = tmp_path / "theirs.safetensors"
    theirs.write_bytes(b"someone's file")
    p = run_cli("export", "--config", tmp_path / "ft.yaml", "--snapshot", snap, "--out", theirs, "--lora-format",
                "comfyui", check=False)
    assert p.returncode == 2 and "is not a file `diffrelay export --lora-format comfyui` wrote" in p.stderr
    assert theirs.read_bytes() == b"someone's file" and len(p.stderr.strip().splitlines()) == 1


def test_an_export_takes_the_weights_the_run_scored_and_says_which(run, tmp_path, capsys):
    """sample.weights: raw (the LoRA recipes'): every sample, val_loss and best pick use the raw adapter, and the
    export wrote the EMA by default without a word. Each export format, and <run>/lora/'s default file, now hold the
    weights sample.weights scores unless --weights says otherwise, and the export says which in one line."""
    import yaml
    from peft.utils import get_peft_model_state_dict

    from diffrelay import cli
    from diffrelay.pretrained import comfyui
    from diffrelay.training import export

    d = run["cfg"] | {"sample": run["cfg"]["sample"] | {"weights": "raw"}}
    (tmp_path / "raw.yaml").write_text(yaml.safe_dump(d))
    snap = run["one"] / "snapshots" / "step_0000002.safetensors"
    adapter = {w: get_peft_model_state_dict(weights.text_net(checkpoint.load_snapshot(snap, w, model_cfg=d["model"])[0]))
               for w in ("raw", "ema")}
    assert not all(torch.equal(adapter["raw"][k], adapter["ema"][k]) for k in adapter["raw"])

    def exported(*flags) -> tuple[dict, str]:
        out = tmp_path / "lora.safetensors"
        assert export.main(cli.build_parser().parse_args(["export", "--config", str(tmp_path / "raw.yaml"), "--snapshot",
                                                          str(snap), "--out", str(out), "--lora-format", "comfyui",
                                                          *flags])) == 0
        return load_file(out), capsys.readouterr().out

    def same(a: dict, b: dict) -> bool:
        return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    kohya = {w: comfyui.kohya_keys(adapter[w], d["train"]["lora"]["alpha"]) for w in adapter}
    got, said = exported()
    assert same(got, kohya["raw"]) and not same(got, kohya["ema"])
    assert said.splitlines()[0] == f"diffrelay: exporting the raw weights (sample.weights of {tmp_path / 'raw.yaml'}) " \
        f"of {snap}, step 2"
    assert "checked: it reads back with the same tensors" in said and "none of them run here" in said
    got, said = exported("--weights", "ema")
    assert same(got, kohya["ema"]) and "exporting the EMA weights (--weights)" in said
    assert "--ema-decay=0.999: the raw weights are exported (sample.weights of" in one_line(
        lambda: exported("--ema-decay", "0.999"))
    # The pipeline folder: the raw adapter fused
    assert cli.main(["export", "--config", str(tmp_path / "raw.yaml"), "--snapshot", str(snap), "--out",
                     str(tmp_path / "pipe")]) == 0
    assert json.loads((tmp_path / "pipe" / "diffrelay_export.json").read_text())["weights"] == "raw"
    assert capsys.readouterr().out.startswith("diffrelay: exporting the raw weights (sample.weights of")
    # <run>/lora/step_N/: the scored (raw) adapter where load_lora_weights(folder) looks, the EMA's beside it;
    # the same files as the ema run's, under each other's names
    run["state"].snapshot(tmp_path / "run" / "snapshots" / "step_0000002.safetensors", {"step": 2},
                          config.Config(config.validate(d)))
    mine, theirs = tmp_path / "run" / "lora" / "step_0000002", run["one"] / "lora" / "step_0000002"
    assert sorted(os.listdir(mine)) == [lora.WEIGHT_NAME, lora.EMA_NAME]
    assert same(load_file(mine / lora.WEIGHT_NAME), load_file(theirs / lora.RAW_NAME))
    assert same(load_file(mine / lora.EMA_NAME), load_file(theirs / lora.WEIGHT_NAME))


def test_step_0_is_the_pipeline_as_it_came_and_samples_as_its_own_call(run, tmp_path):
    """sample.baseline (on for model.pretrained): the first segment writes the network before any update as step 0;
    sampled, it gives the pipeline's own call's images for each prompt and seed, and so does the folder itself
    sampled with no run."""
    import dataclasses

    import numpy as np
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    from diffrelay.sampling import sample, settings

    for name in ("one", "two", "full", "full2"):  # every run of a pipeline, LoRA or full, from its first segment
        assert (run[name] / "snapshots" / "step_0000000.safetensors").is_file(), name
    snap = run["one"] / "snapshots" / "step_0000000.safetensors"
    net, meta = checkpoint.load_snapshot(snap, "ema", model_cfg=run["cfg"]["model"])
    pipe = StableDiffusionPipeline.from_pretrained(run["sd"], local_files_only=True, use_safetensors=True)
    torch.manual_seed(0)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 77, 32)
    with torch.no_grad():
        assert torch.equal(weights.text_net(net)(x, t, encoder_hidden_states=text).sample,
                           pipe.unet(x, t, encoder_hidden_states=text).sample)  # the adapter starts as a no-op
    assert meta["step"] == 0
    prompts = [{"prompt": "a red circle", "seed": 3}, {"prompt": "a blue square", "seed": 11}]
    (tmp_path / "prompts.yaml").write_text(__import__("yaml").safe_dump(prompts))
    d = run["cfg"]
    s = dataclasses.replace(settings.Settings.from_section(d["sample"]), guidance=4.0, steps=3, batch_size=2,
                            prompts=str(tmp_path / "prompts.yaml"), scheduler="pipeline")
    sample.run(snap, tmp_path / "ours", s, model_cfg=d["model"], data_cfg=d["data"], resources=d["run"]["resources"])
    ours = np.stack([np.asarray(Image.open(tmp_path / "ours" / f"{i:06d}.png")) for i in range(2)])
    pipe.set_progress_bar_config(disable=True)
    theirs = np.concatenate([pipe(prompt=p["prompt"], generator=[torch.Generator().manual_seed(p["seed"])],
                                  num_inference_steps=3, guidance_scale=4.0, height=16, width=16,
                                  output_type="np").images for p in prompts])
    diff = np.abs(ours.astype(int) - (theirs * 255).round().astype(int))
    assert ours.shape == (2, 16, 16, 3) and diff.max() <= 1, diff.max()
    # The pipeline folder itself, with no run: `diffrelay sample --snapshot <folder>` gives the same images.
    run_cli("sample", "--snapshot", run["sd"], "--resolution", "16", "--out", tmp_path / "folder", "--steps", "3",
            "--guidance", "4", "--batch-size", "2", "--prompts", tmp_path / "prompts.yaml")
    folder = np.stack([np.asarray(Image.open(tmp_path / "folder" / f"{i:06d}.png")) for i in range(2)])
    assert np.array_equal(folder, ours)
    p = run_cli("sample", "--snapshot", run["sd"], "--out", tmp_path / "none", "--prompts", tmp_path / "prompts.yaml",
                check=False)  # no --resolution and no config: one line, before any weight is read
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "give --resolution" in p.stderr, p.stderr


def test_val_loss_is_the_same_on_a_rerun_and_moves_after_one_training_step(run):
    """fid.metrics val_loss: the held-out images' loss with the same noise and noise levels at every checkpoint."""
    from diffrelay.sampling import val_loss

    cfg = config.Config(config.validate(raw(run["work"], run["sd"], name="ft2")))
    snaps = run["two"] / "snapshots"
    first = val_loss.compute(cfg, snaps / "step_0000000.safetensors", run["work"] / "dataset", batch_size=2)
    again = val_loss.compute(cfg, snaps / "step_0000000.safetensors", run["work"] / "dataset", batch_size=2)
    after = val_loss.compute(cfg, snaps / "step_0000001.safetensors", run["work"] / "dataset", batch_size=2)
    keys = [*val_loss.COLUMNS, "levels"]
    assert {k: first[k] for k in keys} == {k: again[k] for k in keys}  # bit for bit
    assert first["count"] == 4 and len(first["levels"]) == val_loss.LEVELS  # 16 images, val_fraction 0.25
    assert all(after[k] != first[k] for k in val_loss.COLUMNS), (first, after)
    # The buckets are the thirds of the levels; the whole is their mean.
    assert first["val_loss"] == pytest.approx(sum(first["levels"]) / val_loss.LEVELS)
    assert first["val_loss_low"] == pytest.approx(sum(first["levels"][:2]) / 2)
    # --out replaces only its own earlier result, refused before any work.
    other = run["work"] / "someone_elses.json"
    other.write_text('{"fid": 1.0}')
    p = run_cli("val-loss", "--config", run["work"] / "ft.yaml", "--snapshot", snaps / "step_0000000.safetensors",
                "--out", other, check=False)
    assert p.returncode == 2 and "is not a result written by `diffrelay val-loss`" in p.stderr, p.stderr
    assert other.read_text() == '{"fid": 1.0}'
    # A run without a held-out split: one line naming the key and the fix, at config time.
    d = raw(run["work"], run["sd"])
    d["data"]["val_fraction"], d["fid"]["metrics"] = 0.0, ["fid", "val_loss"]
    assert "data.val_fraction" in one_line(lambda: config.validate(d, "ft.yaml"))
