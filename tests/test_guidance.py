"""Autoguidance (sample.guide, Karras et al. 2024): the formula restated, the guide's checks, its seeds and its
place in the workflow. benchmarks/checks/check_edm_sampler.py compares it with edm2's own edm_sampler(gnet=...)."""

import json

import pytest
import torch
import yaml

from conftest import run_cli
from diffrelay import io
from diffrelay.errors import UserError
from diffrelay.sampling import guidance, sample
from test_sample import folder_bytes, make_snapshot, sample_args, settings


def test_autoguidance_moves_from_the_guide_towards_the_network_by_the_scale():
    g = torch.Generator().manual_seed(0)
    x, sigma, labels = torch.randn(3, 2, 4, 4, generator=g), torch.rand(3, generator=g) + 0.1, torch.tensor([0, 1, 2])
    main = lambda x, s, y: x * 0.5 + s.reshape(-1, 1, 1, 1)  # noqa: E731
    weak = lambda x, s, y: x * 0.2 - y.reshape(-1, 1, 1, 1).float()  # noqa: E731  # sees the same labels
    got = guidance.autoguided(main, weak, 2.5)(x, sigma, labels)
    d_main, d_weak = main(x, sigma, labels).double(), weak(x, sigma, labels).double()
    torch.testing.assert_close(got.double(), d_weak + 2.5 * (d_main - d_weak), rtol=1e-6, atol=1e-6)


def test_a_guide_equal_to_the_network_gives_the_unguided_images_and_another_changes_them(tmp_path):
    """An unconditional network (no label dropout: the null class is not needed) guided by itself is the
    unguided sampler bit for bit; a weaker guide changes every image, is recorded, and is the same for any
    batch size and process count."""
    snap = make_snapshot(tmp_path / "step_0000040.safetensors", conditional=False)
    weak = make_snapshot(tmp_path / "weak.safetensors", conditional=False, seed=1)
    plain = sample.run(snap, tmp_path / "plain", settings(num_images=12))
    sample.run(snap, tmp_path / "self", settings(num_images=12, guidance=2.0, guide=str(snap)))
    auto = sample.run(snap, tmp_path / "auto", settings(num_images=12, guidance=2.0, guide=str(weak)))
    ref = {k: v for k, v in folder_bytes(tmp_path / "plain").items() if k != "grid.png"}
    assert {k: v for k, v in folder_bytes(tmp_path / "self").items() if k != "grid.png"} == ref
    got = folder_bytes(tmp_path / "auto")
    assert all(got[k] != v for k, v in ref.items())
    assert "guide_sha256" in auto and "guide_sha256" not in plain
    two = tmp_path / "two"
    run_cli("torchrun", "--standalone", "--nproc-per-node", 2, "-m", "diffrelay",
            *sample_args(snap, two, "--num-images", 12, "--steps", 3, "--batch-size", 5, "--guidance", 2,
                         "--guide", weak))
    assert folder_bytes(two) == got


def test_a_guide_of_another_kind_is_one_line_before_any_folder(tmp_path):
    snap = make_snapshot(tmp_path / "s.safetensors", num_classes=3)
    other = make_snapshot(tmp_path / "o.safetensors", num_classes=4)
    with pytest.raises(UserError, match=r"sample.guide=.*o.safetensors \(--guide\): classes is 4 there and 3"):
        sample.run(snap, tmp_path / "out", settings(guidance=2.0, guide=str(other)))
    from test_flow import flow_snapshot

    flow = flow_snapshot(tmp_path / "f.safetensors")
    with pytest.raises(UserError, match="model.objective is 'flow' there and 'edm'"):
        sample.run(snap, tmp_path / "out", settings(guidance=2.0, guide=str(flow)))
    assert not (tmp_path / "out").exists() and not sample.work_dir(tmp_path / "out").exists()



def test_an_unconditional_guide_of_a_conditional_network_is_edm2s_guidance_and_never_sees_the_labels(tmp_path):
    """edm2's guided ImageNet numbers guide the conditional network with a separately trained unconditional one
    (generate_images.py:48): guide(x) + scale (net(x, y) - guide(x)). The guide is called without labels."""
    snap = make_snapshot(tmp_path / "s.safetensors", num_classes=3)
    uncond = make_snapshot(tmp_path / "u.safetensors", conditional=False, seed=1)
    from diffrelay.training import checkpoint

    _, meta = checkpoint.read_snapshot(snap)
    guide = guidance.load_guide(uncond, meta, "ema", "cpu")
    raw, _ = checkpoint.load_snapshot(uncond, "ema", "cpu", dict(checkpoint.read_snapshot(uncond)[1]["model"]))
    g = torch.Generator().manual_seed(0)
    x, sigma = torch.randn(2, 3, 16, 16, generator=g), torch.tensor([0.5, 2.0])
    with torch.no_grad():
        torch.testing.assert_close(guide(x, sigma, torch.tensor([0, 2])), raw(x, sigma, None), rtol=0, atol=0)
    a = sample.run(snap, tmp_path / "a", settings(num_images=6, guidance=1.4, guide=str(uncond)))
    assert "guide_sha256" in a and len(list((tmp_path / "a").glob("*.png"))) >= 6

@pytest.mark.slow
def test_the_guide_is_an_input_of_guided_sampling_jobs_only_and_checked_at_parse_time(tmp_path, write_config):
    """A tiny run with guidance [1, 2] and an own guide: only the guided jobs get --guide and the file as an
    input, so a new guide resamples those and nothing else; a missing guide is one line before any job."""
    from test_workflow import finished_rules, job_counts, snakemake

    guide = make_snapshot(tmp_path / "guide.safetensors", num_classes=3)
    cfg = write_config({"sample": {"guidance": [1, 2], "guide": str(guide)}})
    out = snakemake(tmp_path, "--configfile", cfg)
    ran = finished_rules(out.stdout + out.stderr)
    assert ran["train_segment"] == 2 and ran["sample_snapshot"] == 4, ran
    logs = {p.name: p.read_text().splitlines()[0] for p in (tmp_path / "logs/tiny/sample_snapshot").glob("*.log")}
    assert sorted(name for name, c in logs.items() if f"--guide {guide}" in c) == ["step_0000003_g2.log",
                                                                                  "step_0000006_g2.log"], logs
    manifest = json.loads((tmp_path / "results/tiny/samples/step_0000006_g2/manifest.json").read_text())
    assert manifest["guide_sha256"] == io.sha256_file(guide) and "guide_sha256" not in json.loads(
        (tmp_path / "results/tiny/samples/step_0000006/manifest.json").read_text())
    make_snapshot(guide, num_classes=3, seed=5)  # another guide: only the guided evaluations are redone
    plan = job_counts(snakemake(tmp_path, "-n", "--configfile", cfg).stdout)
    assert plan.get("sample_snapshot") == 2 and plan.get("compute_fid") == 2 and "train_segment" not in plan, plan
    d = yaml.safe_load(cfg.read_text())
    d["sample"]["guide"] = str(tmp_path / "missing.safetensors")
    cfg.write_text(yaml.safe_dump(d))
    p = snakemake(tmp_path, "-n", "--configfile", cfg, check=False)
    line = [x for x in (p.stdout + p.stderr).splitlines() if x.startswith("diffrelay: error:")]
    assert p.returncode != 0 and len(line) == 1 and "sample.guide=" in line[0] and "not found" in line[0], p.stderr


def test_autoguidance_needs_no_label_dropout_but_classifier_free_guidance_does():
    from diffrelay import config

    config.validate({"model": {"class_conditional": False}, "sample": {"guidance": 2, "guide": "g.safetensors"}})
    with pytest.raises(UserError, match="sample.guidance=2"):
        config.validate({"model": {"class_conditional": False}, "sample": {"guidance": 2}})


@pytest.mark.slow
def test_a_later_snapshot_of_the_run_guides_and_each_ema_decay_is_its_own_evaluation(tmp_path, write_config):
    """sample.guide: 6 (a step) guides with this run's own step-6 snapshot, which the step-3 evaluation waits
    for; sample.ema_decay [0.999, 0.3] samples both EMAs of every snapshot, the second under _decay0.3, and the
    report has a row for each (0.3: below the warm-up's 7/16 at step 6, so the two EMAs differ). A step the run writes no snapshot at is one line at parse time."""
    from test_workflow import finished_rules, snakemake

    cfg = write_config({"train": {"ema_decays": [0.999, 0.3]},
                        "sample": {"guidance": 2, "guide": 6, "ema_decay": [0.999, 0.3]}})
    out = snakemake(tmp_path, "--configfile", cfg)
    ran = finished_rules(out.stdout + out.stderr)
    assert ran["train_segment"] == 2 and ran["sample_snapshot"] == 4, ran
    guide = tmp_path / "results/tiny/snapshots/step_0000006.safetensors"
    logs = {p.stem: p.read_text().splitlines()[0] for p in (tmp_path / "logs/tiny/sample_snapshot").glob("*.log")}
    assert sorted(logs) == ["step_0000003_decay0.3_g2", "step_0000003_g2", "step_0000006_decay0.3_g2",
                            "step_0000006_g2"], logs
    assert all(f"--guide {guide}" in c or f"--guide {guide.relative_to(tmp_path)}" in c for c in logs.values())
    assert sorted(k for k, c in logs.items() if "--ema-decay 0.3 " in c) == sorted(k for k in logs if "decay" in k)
    samples = tmp_path / "results/tiny/samples"
    m = {k: json.loads((samples / k / "manifest.json").read_text()) for k in logs}
    assert m["step_0000003_decay0.3_g2"]["ema_decay"] == 0.3 and "ema_decay" not in m["step_0000003_g2"]
    assert m["step_0000003_g2"]["guide_sha256"] == io.sha256_file(guide)
    pngs = {k: sorted((samples / k).glob("0*.png")) for k in logs}
    assert [p.read_bytes() for p in pngs["step_0000006_g2"]] != [p.read_bytes() for p in pngs["step_0000006_decay0.3_g2"]]
    import csv

    rows = list(csv.DictReader((tmp_path / "results/tiny/report/metrics.csv").open()))
    assert sorted((r["step"], r["ema_decay"]) for r in rows) == [("3", ""), ("3", "0.3"), ("6", ""), ("6", "0.3")]
    d = yaml.safe_load(cfg.read_text())
    d["sample"]["guide"] = 5
    cfg.write_text(yaml.safe_dump(d))
    p = snakemake(tmp_path, "-n", "--configfile", cfg, check=False)
    line = [x for x in (p.stdout + p.stderr).splitlines() if x.startswith("diffrelay: error:")]
    assert p.returncode != 0 and len(line) == 1 and "sample.guide=5: this run writes no snapshot" in line[0], p.stderr


def test_an_ema_decay_the_run_does_not_train_or_a_guide_step_past_the_end_is_one_line():
    from diffrelay import config

    with pytest.raises(UserError, match=r"sample.ema_decay=0.99: not one of train.ema_decays=\[0.999\]"):
        config.validate({"sample": {"ema_decay": [0.999, 0.99]}})
    with pytest.raises(UserError, match="sample.ema_decay=0.9999999: more than 6 significant digits"):
        config.validate({"train": {"ema_decays": [0.999, 0.9999999]}, "sample": {"ema_decay": [0.9999999]}})
    with pytest.raises(UserError, match="sample.ema_decay=0.999: sample.weights is raw"):
        config.validate({"sample": {"ema_decay": 0.999, "weights": "raw"}})
    with pytest.raises(UserError, match="sample.guide=99999999: a step past train.total_steps"):
        config.validate({"sample": {"guide": 99999999}})
    assert config.validate({"train": {"ema_decays": [0.9, 0.99]}, "sample": {"ema_decay": 0.99}})


def test_validate_refuses_a_guide_step_the_run_writes_no_snapshot_at_as_the_workflow_plans_them(write_config):
    """sample.guide: 4 passed validate and was refused only by Snakemake. The steps are planned as the workflow
    plans them: segment ends already trained stay ends when train.segment_steps changes."""
    from diffrelay import config

    from diffrelay.config import preflight
    def check(guide, **train):
        cfg = config.load(write_config({"train": train, "sample": {"guide": guide}}))
        preflight.check(cfg, "config.yaml")
        return cfg

    with pytest.raises(UserError, match=r"^config.yaml: sample.guide=4: this run writes no snapshot at that step; "
                       r"use one of \[3, 6\] \(segment ends and train.snapshot_every\), or a snapshot file$"):
        check(4)
    check(3), check(4, snapshot_every=1)
    with pytest.raises(UserError, match=r"sample.guide=2: .*\[3, 6\]"):
        check(2)
    cfg = check(3)  # a segment of 2 steps trained before segment_steps became 3: ends 2, 5, 6
    done = config.run_dir(cfg) / "checkpoints" / "step_0000002"
    done.mkdir(parents=True)
    (done / "manifest.json").write_text("{}")
    (done / "meta.json").write_text(json.dumps({"trajectory": config.trajectory_hash(cfg)}))
    assert preflight.run_snapshot_steps(cfg) == [2, 5, 6]
    check(2), check(5)
    with pytest.raises(UserError, match=r"sample.guide=3: .*\[2, 5, 6\]"):
        check(3)
