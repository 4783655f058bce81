"""EDM's training as published: train.loss_reduction sum, the EMA half-life, inv_sqrt and the warm-up in images,
and EDM's augmentation pipe wired into training (exact on resume, the same draws on any process count); each
restated from NVlabs/edm and edm2's training loops, and each bad combination one line."""

import json
import math
import re
import shutil
import sys

import pytest
import torch

from conftest import run_cli
from test_loader import write_prepared
from test_train import TRAIN, assert_tensors_equal, load_state, read_trace, torchrun
from diffrelay import config, io, nets, objectives
from diffrelay.data import loader
from diffrelay.data.order import DataOrder
from diffrelay.errors import UserError
from diffrelay.evaluation import protocol
from diffrelay.nets import edm as edm_nets
from diffrelay.training import checkpoint, optim

SONG = {"model_channels": 16, "channel_mult": [1, 2], "num_blocks": 1, "attn_resolutions": [8], "dropout": 0.0}
DDPMPP = {"arch": "ddpmpp", "kwargs": SONG, "class_conditional": False}


def cfg_of(model: dict, **train) -> config.Config:
    sample = {"solver": "ddpm"} if model.get("objective") == "ddpm" else {}
    return config.Config(config.validate({"data": {"resolution": 8}, "model": model, "train": train,
                                          "sample": sample}))


def draws(batch=6, res=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, res, res, generator=g), torch.randn(batch, generator=g),
            torch.randn(batch, 3, res, res, generator=g))


# ---------------------------------------------------------------------------------------------------------------
# train.loss_reduction


def test_sum_reduction_is_each_samples_sum_averaged_over_the_batch():
    """EDM's loss restated: lambda(sigma) |D(y + sigma n) - y|^2 per element, summed over C x H x W per sample,
    averaged over the batch (training_loop.py:132); mean stays the mean over every element, bit for bit."""
    torch.manual_seed(0)
    mean_cfg, sum_cfg = cfg_of(DDPMPP), cfg_of(DDPMPP, loss_reduction="sum")
    net = objectives.build(mean_cfg.to_dict()["model"], 8, 0).eval()
    images, rnd, noise = draws()
    sigma = (rnd * 1.2 - 1.2).exp().reshape(-1, 1, 1, 1)
    weight = (sigma**2 + 0.5**2) / (sigma * 0.5) ** 2
    with torch.no_grad():
        per_element = weight * (net(images + noise * sigma, sigma) - images) ** 2
        mean = objectives.loss(mean_cfg, net, images, None, rnd, noise)
        total = objectives.loss(sum_cfg, net, images, None, rnd, noise)
    assert torch.equal(mean, per_element.mean())
    torch.testing.assert_close(total, per_element.sum(dim=(1, 2, 3)).mean(), rtol=1e-6, atol=0)
    assert total / mean == pytest.approx(3 * 8 * 8)


def test_sum_reduction_applies_to_flow_and_ddpm_and_accumulation_keeps_it_per_global_batch():
    images, rnd, noise = draws(batch=8)
    for objective in ("flow", "ddpm"):
        model = {"objective": objective, "channels": 8, "channel_mult": [1, 2], "num_blocks": 1,
                 "class_conditional": False}
        torch.manual_seed(0)
        net = objectives.build(cfg_of(model).to_dict()["model"], 8, 0).eval()
        with torch.no_grad():
            mean = objectives.loss(cfg_of(model), net, images, None, rnd, noise)
            total = objectives.loss(cfg_of(model, loss_reduction="sum"), net, images, None, rnd, noise)
        assert torch.equal(total, mean * (3 * 8 * 8)), objective
    # The loop divides each round's loss by train.grad_accum (and DDP averages the ranks): two rounds of half the
    # batch give the loss of the whole global batch, a sum per sample averaged over all of it.
    cfg = cfg_of(DDPMPP, loss_reduction="sum")
    torch.manual_seed(0)
    net = objectives.build(cfg.to_dict()["model"], 8, 0).eval()
    with torch.no_grad():
        whole = objectives.loss(cfg, net, images, None, rnd, noise)
        halves = [x.tensor_split(2) for x in (images, rnd, noise)]
        rounds = sum(objectives.loss(cfg, net, halves[0][k], None, halves[1][k], halves[2][k]) / 2 for k in range(2))
    torch.testing.assert_close(rounds, whole, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# The EMA half-life


def test_ema_half_life_is_edms_beta_applied_by_hand():
    """NVlabs/edm training_loop.py:143-148 restated: half-life in images, capped by rampup x images trained before
    the update, beta = 0.5 ^ (batch / half-life), ema <- lerp(ema, net, 1 - beta). Step 0 has beta 0."""
    batch, kimg = 64, 0.5
    for ratio in (0.05, None):
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        ema = optim.EMA(net, [], kimg, ratio, batch)
        assert len(ema.nets) == 1
        by_hand, betas = [p.detach().clone() for p in net.parameters()], []
        for step in range(8):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(torch.randn_like(p))
            ema.update(net, step)
            nimg = step * batch
            halflife = kimg * 1000 if ratio is None else min(kimg * 1000, nimg * ratio)
            beta = 0.5 ** (batch / max(halflife, 1e-8))
            betas.append(beta)
            by_hand = [torch.lerp(e, p.detach(), 1 - beta) for e, p in zip(by_hand, net.parameters())]
            if step == 0 and ratio is not None:
                assert beta == 0 and all(torch.equal(e, p) for e, p in zip(ema.nets[0].parameters(),
                                                                          net.parameters()))
            for e, h in zip(ema.nets[0].parameters(), by_hand):
                assert torch.equal(e, h), (ratio, step)
        if ratio is None:
            assert betas == [0.5 ** (64 / 500)] * 8
        else:  # the cap: 3.2 images a step, so beta = 0.5 ^ (64 / (3.2 step)) = 0.5 ^ (20 / step)
            assert betas[1:] == pytest.approx([0.5 ** (20 / s) for s in range(1, 8)], rel=1e-12)


def test_ema_decays_keep_their_exact_arithmetic():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    ema = optim.EMA(net, [0.9, 0.99])
    by_hand = [[p.detach().clone() for p in net.parameters()] for _ in range(2)]
    for step in range(5):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema.update(net, step)
        for i, decay in enumerate((0.9, 0.99)):
            d = min(decay, (1 + step) / (10 + step))
            by_hand[i] = [torch.lerp(e, p.detach(), 1 - d) for e, p in zip(by_hand[i], net.parameters())]
    for avg, hand in zip(ema.nets, by_hand):
        assert all(torch.equal(a, h) for a, h in zip(avg.parameters(), hand))


# ---------------------------------------------------------------------------------------------------------------
# inv_sqrt and the warm-up in images


def _old_lr_factor(step, warmup, total, schedule):  # lr_factor before inv_sqrt and warmup_kimg
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def test_inv_sqrt_and_the_kimg_warm_up_are_edm2s_and_edms_formulas():
    batch, ref, kimg = 32, 100, 0.8  # the warm-up ends after 800 images: 25 steps
    for step in (0, 1, 7, 24, 25, 99, 100, 101, 400, 12345):
        nimg = step * batch  # images trained before the update
        inv = 1 / math.sqrt(max(nimg / (ref * batch), 1))  # edm2 training_loop.py:50
        ramp = min(nimg / (kimg * 1000), 1)  # EDM training_loop.py:136, edm2 training_loop.py:52
        assert optim.lr_factor(step, 0, 1000, "inv_sqrt", batch, None, ref) == pytest.approx(inv, rel=1e-15)
        assert optim.lr_factor(step, 0, 1000, "inv_sqrt", batch, kimg, ref) == pytest.approx(inv * ramp, rel=1e-15)
        assert optim.lr_factor(step, 0, 1000, "constant", batch, kimg) == pytest.approx(ramp, rel=1e-15)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / 1000)))
        assert optim.lr_factor(step, 0, 1000, "cosine", batch, kimg) == pytest.approx(cosine * ramp, rel=1e-15)
        for warmup in (0, 10):
            for schedule in ("constant", "cosine"):  # the schedules as they were, bit for bit
                assert optim.lr_factor(step, warmup, 1000, schedule, batch) == _old_lr_factor(step, warmup, 1000,
                                                                                            schedule)
    assert optim.lr_factor(0, 0, 1000, "constant", batch, kimg) == 0  # the first update has rate 0
    # Through the scheduler the optimizer sees: step s's update runs at lr x factor(s).
    t = cfg_of(DDPMPP, lr=0.01, batch_size=batch, warmup_steps=0, warmup_kimg=kimg, lr_schedule="inv_sqrt",
               lr_ref_batches=ref).train
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = optim.build_schedule(opt, t)
    for step in range(30):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * min(step * batch / 800, 1), rel=1e-12, abs=0)
        opt.step()
        sched.step()


# ---------------------------------------------------------------------------------------------------------------
# The augmentation pipe


def test_the_pipes_images_and_labels_do_not_depend_on_the_process_count_or_accumulation(tmp_path):
    """What the loop trains on: each step's augmented images and 9 labels, rebuilt as the global batch from every
    rank's rounds, bit for bit the same on 1 or 2 processes with 1 or 2 accumulation rounds."""
    data = write_prepared(tmp_path / "d", n=20, res=8)

    def global_batches(world, accum, steps=3, batch=8):
        order = DataOrder(0, data.count, batch)
        makers = [loader.BatchMaker(data, 0, batch, rank=r, world=world, grad_accum=accum, device="cpu", augment=1.0)
                  for r in range(world)]
        out = []
        for step in range(steps):
            indices = order.next_batch()[0]
            per_rank = []
            for m in makers:
                b = m.make(step, indices)
                rounds = [b.augmented(k, r[0]) for k, r in enumerate(b.rounds)]
                per_rank.append([torch.cat(x) for x in zip(*rounds)])
            whole = []
            for field in range(2):
                w = torch.empty((batch, *per_rank[0][field].shape[1:]))
                for r, part in enumerate(per_rank):
                    w[r::world] = part[field]
                whole.append(w)
            out.append(whole)
        return out

    reference = global_batches(1, 1)
    for world, accum in ((2, 1), (1, 2), (2, 2)):
        for a, b in zip(reference, global_batches(world, accum)):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (world, accum)
    images, labels = reference[0]
    assert labels.shape == (8, 9) and (labels != 0).any(dim=1).all()  # p = 1: every image is transformed
    plain = loader.BatchMaker(data, 0, 8, rank=0, world=1, grad_accum=1, device="cpu")
    batch = plain.make(0, DataOrder(0, data.count, 8).next_batch()[0])
    assert batch.augmented(0, batch.rounds[0][0])[1] is None and batch.pipe is None  # off: no labels at all
    assert not torch.equal(images, batch.rounds[0][0])


def test_edms_networks_take_the_pipes_labels_as_their_presets_say():
    assert {arch: preset["augment_dim"] for arch, preset in edm_nets.PRESETS.items()} == nets.EDM_AUGMENT_DIM


SPY = """
import json, sys
from diffrelay import config
from diffrelay.nets import edm
from diffrelay.training import train

seen = {"labelled": 0, "nonzero": 0, "shapes": []}
real = edm.SongUNet.forward

def forward(self, x, c_noise, labels=None, augment_labels=None):
    if augment_labels is not None:
        seen["labelled"] += 1
        seen["nonzero"] += int(bool((augment_labels != 0).any(dim=1).all()))
        seen["shapes"].append(list(augment_labels.shape))
    return real(self, x, c_noise, labels, augment_labels)

edm.SongUNet.forward = forward
assert train.run(config.load(sys.argv[1]), until_step=int(sys.argv[2]), trace=sys.argv[3]) == 0
print(json.dumps(seen))
"""

RUN = {
    "run": {"name": "r", "seed": 0, "device": "cpu"},
    "data": {"kind": "shapes", "resolution": 8, "count": 20, "seed": 0},  # 20 images: epochs end mid-batch
    "model": DDPMPP | {"class_conditional": True},
    # Every setting of this page at once: EDM's EMA, warm-up in images (2 steps), inv_sqrt from step 2.
    "train": {"total_steps": 4, "segment_steps": 2, "batch_size": 8, "lr": 0.002, "log_every": 1,
              "augment": 1.0, "loss_reduction": "sum", "ema_decays": [], "ema_halflife_kimg": 0.05,
              "warmup_steps": 0, "warmup_kimg": 0.016, "lr_schedule": "inv_sqrt", "lr_ref_batches": 2},
}


@pytest.fixture(scope="module")
def augmented_runs(tmp_path_factory):
    """The same 4 steps three ways: one process in one segment (the network spied on), one process in two
    segments (each its own process), two processes (torchrun) in one segment."""
    root = tmp_path_factory.mktemp("edm")
    cfgs = {}
    for name, nproc in (("one", 1), ("two", 1), ("ddp", 2)):
        d = json.loads(json.dumps(RUN))
        d["run"].update(results=str(root / name), resources=str(root / "resources"))
        d["train"]["nproc_per_node"] = nproc
        cfgs[name] = root / f"{name}.yaml"
        io.write_json(cfgs[name], d)  # JSON is valid YAML
    run_cli("prepare", "--config", cfgs["one"])
    for name in ("two", "ddp"):
        shutil.copytree(root / "one/r/dataset", root / name / "r/dataset")
    p = run_cli(sys.executable, "-c", SPY, cfgs["one"], 4, root / "one.trace")
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    run_cli(sys.executable, *TRAIN, "--config", cfgs["two"], "--until-step", 2)
    run_cli(sys.executable, *TRAIN, "--config", cfgs["two"], "--until-step", 4)
    torchrun(2, "--config", cfgs["ddp"], "--until-step", 4, "--trace", root / "ddp.trace")
    return root, seen


def test_the_network_is_given_the_pipes_labels_in_training(augmented_runs):
    _, seen = augmented_runs
    assert seen["labelled"] == 4 and seen["nonzero"] == 4 and seen["shapes"] == [[8, 9]] * 4, seen


def test_two_segments_equal_one_run_bit_for_bit_with_augmentation_and_sum_reduction(augmented_runs):
    root, _ = augmented_runs
    one, two = (load_state(root / f"{n}/r/checkpoints/step_0000004") for n in ("one", "two"))
    for key in ("net", "ema", "optimizer", "schedule", "scaler", "order", "step"):
        assert_tensors_equal(one[key], two[key], key)
    assert len(one["ema"]) == 1  # EDM's one EMA


def test_two_processes_train_the_same_batches_and_draws_as_one(augmented_runs):
    """Two processes see the global batches, noise and augmentation of one process (positions r::2, the last
    test bit for bit); the weights differ only by the order of floating-point sums (docs/reproducibility.md)."""
    root, _ = augmented_runs
    assert read_trace(root / "one.trace", 1) == read_trace(root / "ddp.trace", 2)
    one, ddp = (load_state(root / f"{n}/r/checkpoints/step_0000004") for n in ("one", "ddp"))
    assert one["order"] == ddp["order"] and one["schedule"] == ddp["schedule"]
    for a, b in ((one["net"], ddp["net"]), (one["ema"][0], ddp["ema"][0])):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_a_half_life_runs_snapshot_holds_its_one_ema_sampled_by_default(augmented_runs):
    root, _ = augmented_runs
    snap = root / "one/r/snapshots/step_0000004.safetensors"
    tensors, meta = checkpoint.read_snapshot(snap)
    assert {k.split(".")[0] for k in tensors} == {"ema", "raw"}
    net, _ = checkpoint.load_snapshot(snap)
    assert_tensors_equal(net.state_dict(), load_state(root / "one/r/checkpoints/step_0000004")["ema"][0])
    with pytest.raises(UserError, match=re.escape("was trained with one EMA (train.ema_halflife_kimg=0.05); "
                                                  "sample it without sample.ema_decay")):
        checkpoint.load_snapshot(snap, decay=0.999)
    assert protocol.ema_decays(meta["config"]) == [None]


# ---------------------------------------------------------------------------------------------------------------
# Identity and config errors


def test_runs_that_set_none_of_the_new_keys_keep_their_hash_and_each_key_set_changes_it():
    assert config.trajectory_hash(config.Config(config.validate({}))) == "87ee92ae704009a1"
    defaults = {"loss_reduction": "mean", "ema_halflife_kimg": None, "ema_rampup_ratio": 0.5, "augment": 0.0,
                "warmup_kimg": None, "lr_ref_batches": None}  # rampup read only with a half-life
    assert config.trajectory_hash(config.Config(config.validate({"train": defaults}))) == "87ee92ae704009a1"
    edm_net = {"arch": "ddpmpp"}
    base = {"model": edm_net, "train": {"ema_decays": [], "ema_halflife_kimg": 500, "warmup_steps": 0}}
    hashes = {config.trajectory_hash(config.Config(config.validate(d))) for d in (
        {}, {"train": {"loss_reduction": "sum"}}, {"train": {"augment": 0.12}, "model": edm_net},
        {"train": {"warmup_kimg": 10, "warmup_steps": 0}}, {"train": {"lr_schedule": "inv_sqrt", "lr_ref_batches": 7}},
        {"train": {"lr_schedule": "inv_sqrt", "lr_ref_batches": 8}}, base,
        {**base, "train": {**base["train"], "ema_rampup_ratio": None}},
        {**base, "train": {**base["train"], "ema_halflife_kimg": 600}})}
    assert len(hashes) == 9


EDM_ERRORS = [
    ({"train": {"ema_halflife_kimg": 500}},
     "train.ema_halflife_kimg=500: EDM's one EMA replaces those of train.ema_decays=[0.999]; "
     "set train.ema_decays: []"),
    ({"train": {"ema_decays": []}, "sample": {"ema_decay": 0.999}},
     "sample.ema_decay=0.999: train.ema_decays: [] keeps no EMA, so sampling uses the raw weights; "
     "set sample.ema_decay: null"),
    ({"train": {"ema_halflife_kimg": 500, "ema_decays": []}, "sample": {"ema_decay": 0.999}},
     "sample.ema_decay=0.999: train.ema_halflife_kimg=500 trains one EMA, which is sampled by default; "
     "set sample.ema_decay: null"),
    ({"train": {"warmup_kimg": 10}},
     "train.warmup_kimg=10: and train.warmup_steps=100 are two warm-ups; set train.warmup_steps: 0"),
    ({"train": {"lr_schedule": "inv_sqrt"}}, "train.lr_schedule=inv_sqrt: needs train.lr_ref_batches"),
    ({"train": {"lr_ref_batches": 70000, "lr_schedule": "cosine"}},
     "train.lr_ref_batches=70000: applies to train.lr_schedule: inv_sqrt only (this run's is cosine)"),
    ({"train": {"augment": 0.12}, "model": {"arch": "dit"}},
     "train.augment=0.12: model.arch=dit takes no augmentation labels; use ddpmpp or ncsnpp"),
    ({"train": {"augment": 0.12}}, "train.augment=0.12: model.arch=unet takes no augmentation labels"),
    ({"train": {"augment": 0.12}, "model": {"arch": "adm"}, "data": {"resolution": 64}},
     "train.augment=0.12: gives 9 augmentation labels to model.arch=adm with augment_dim 0; "
     "set model.kwargs.augment_dim: 9"),
    ({"train": {"augment": 0.12}, "model": {"arch": "ncsnpp", "kwargs": {"augment_dim": 0}}},
     "train.augment=0.12: gives 9 augmentation labels to model.arch=ncsnpp with augment_dim 0"),
    ({"train": {"augment": 0.12}, "model": {"arch": "ddpmpp"}, "data": {"encoder": "sd-vae", "resolution": 64}},
     "train.augment=0.12: EDM's augmentation pipe transforms pixels, and data.encoder=sd-vae trains on latents"),
    ({"train": {"augment": 0.12}, "model": {"arch": "ddpmpp", "objective": "flow"}},
     "train.augment=0.12: EDM's augmentation labels condition EDM's networks, and model.objective is flow"),
]


@pytest.mark.parametrize("over, message", EDM_ERRORS, ids=[
    "half-life-with-decays", "ema-decay-without-ema", "ema-decay-with-half-life", "two-warm-ups", "inv-sqrt-without-ref",
    "ref-without-inv-sqrt", "augment-dit", "augment-unet", "augment-adm-dim-0", "augment-ncsnpp-dim-0",
    "augment-latent", "augment-flow"])
def test_each_bad_combination_is_one_line_naming_the_key_and_the_fix(over, message):
    with pytest.raises(UserError) as e:
        config.validate(over)
    assert str(e.value).startswith(f"config: {message}") and "\n" not in str(e.value)


def test_what_does_fit_validates():
    for d in ({"train": {"augment": 0.12}, "model": {"arch": "ddpmpp"}, "data": {"xflip": 0.5}},  # xflip too: fine
              {"train": {"augment": 1}, "model": {"arch": "adm", "kwargs": {"augment_dim": 9}}, "data": {"resolution": 64}},
              {"train": {"ema_halflife_kimg": 500, "ema_decays": [], "ema_rampup_ratio": None,
                         "warmup_kimg": 10000, "warmup_steps": 0, "lr_schedule": "inv_sqrt", "lr_ref_batches": 70000,
                         "loss_reduction": "sum"}}):
        config.validate(d)
    assert protocol.ema_decays(config.validate({"train": {"ema_halflife_kimg": 500, "ema_decays": []}})) == [None]


def test_fp16_with_the_sum_starts_its_loss_scale_lower_by_the_elements_per_sample():
    """The sum makes gradients C x H x W times the mean's; fp16's first scale is lowered by that (to a power of two),
    so edm2's recipe does not spend its first steps halving torch's 2^16 (14 skipped steps on an H200)."""
    from diffrelay.training.state import _first_scale

    mean, total = cfg_of(DDPMPP).train, cfg_of(DDPMPP, loss_reduction="sum").train
    assert _first_scale(mean, (4, 64, 64)) == torch.amp.GradScaler("cpu").get_scale() == 2.0**16
    assert _first_scale(total, (4, 64, 64)) == 2.0**16 / 4 / 64 / 64  # 16,384 elements: a power of two
    assert _first_scale(total, (3, 32, 32)) == 2.0**16 / 4096  # 3,072 rounds up to 4,096
