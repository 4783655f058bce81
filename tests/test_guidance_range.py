"""A guidance scale beyond what a float32 sampler holds (issue 38.8): one line at parse time, no folder made.

`--guidance 1e308 --guide ...` used to end in torch's "value cannot be converted to type float without overflow"
traceback (torch.lerp's weight) and leave `.out.partial/`; a huge finite scale gave NaN after the work folder
was made."""

import pytest

from diffrelay import cli, config
from diffrelay.errors import UserError
from test_sample import make_snapshot, sample_args


@pytest.mark.parametrize("scale", ["1e308", "1e39", "1e30", "101"])
def test_a_guidance_past_the_bound_is_one_line_before_any_folder(tmp_path, capsys, scale):
    snap = make_snapshot(tmp_path / "s.safetensors", conditional=False, num_classes=0)
    weak = make_snapshot(tmp_path / "w.safetensors", conditional=False, num_classes=0, seed=1)
    out = tmp_path / "samples" / "out"
    assert cli.main(sample_args(snap, out, "--num-images", 2, "--steps", 2, "--guidance", scale,
                                "--guide", weak)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--guidance={float(scale)}" in err[0] and "from 0 to 100" in err[0], err
    assert not (tmp_path / "samples").exists()  # neither out nor its .out.partial work folder


def test_the_config_refuses_a_guidance_past_the_bound_and_keeps_100():
    base = {"model": {"class_conditional": True}, "train": {"label_dropout": 0.1}}
    for scales in (1e308, [2.0, 1e30], 100.5):
        with pytest.raises(UserError, match=r"sample.guidance=.*: must be at most 100: far larger scales overflow"):
            config.validate(base | {"sample": {"guidance": scales}}, source="c.yaml")
    assert config.validate(base | {"sample": {"guidance": [1.5, 100]}})["sample"]["guidance"] == [1.5, 100]
