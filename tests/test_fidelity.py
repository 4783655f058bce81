"""Fidelity to the papers' code that a config cannot show by itself (issue 38): a DiT checkpoint imported under
a time_scale its code never used, and a papers' network trained with another loss reduction than its paper's."""

import pytest
import torch

from diffrelay import config
from diffrelay.config import report as validate
from diffrelay.errors import UserError
from diffrelay.training import convert
from test_import import KW, official_state

DIT = {"arch": "dit", "kwargs": {k: v for k, v in KW.items() if k != "time_scale"}, "class_conditional": True}


@pytest.mark.parametrize("objective, sample", [("edm", {}), ("flow", {"solver": "euler"})])
def test_a_dit_checkpoint_is_refused_under_another_time_scale_than_dits(write_config, tmp_path, objective, sample):
    ckpt, out = tmp_path / "DiT-tiny.pt", tmp_path / "o.safetensors"
    torch.save(official_state(), ckpt)
    # time_scale left at its default (1000): DiT's code embeds t as it is, so these weights would compute another
    # function (0.09 on the probe) and nothing would say so.
    cfg = config.load(write_config({"model": DIT | {"objective": objective}, "sample": sample}))
    with pytest.raises(UserError) as e:
        convert.convert(cfg, ckpt, out)
    line = str(e.value)
    assert len(line.splitlines()) == 1 and not out.exists(), line
    assert "model.kwargs.time_scale=1000" in line and "set model.kwargs.time_scale: 1" in line, line
    assert str(ckpt) in line and f"model.objective {objective}" in line, line

    fixed = config.load(write_config({"model": DIT | {"objective": objective, "kwargs": KW}, "sample": sample}))
    assert convert.convert(fixed, ckpt, out)["model"]["kwargs"]["time_scale"] == 1  # DiT's convention imports


EDM_NET = {"arch": "ddpmpp", "objective": "edm", "class_conditional": False,
           "kwargs": {"model_channels": 8, "channel_mult": [1, 2], "num_blocks": 1, "attn_resolutions": []}}


@pytest.mark.parametrize("model, train, note", [
    (EDM_NET, {}, "EDM trains model.arch ddpmpp with sum (training/training_loop.py:132)"),
    (EDM_NET, {"loss_reduction": "sum"}, None),
    (EDM_NET | {"arch": "unet", "kwargs": {}}, {}, None),  # diffrelay's own UNet: no paper to differ from
])
def test_validate_notes_a_loss_reduction_other_than_the_papers(write_config, capsys, model, train, note):
    path = write_config({"model": model, "train": train})
    assert validate.main(type("Args", (), {"config": [str(path)]})) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("# note:")]
    if note is None:
        assert not notes, notes
        return
    assert len(notes) == 1 and note in notes[0] and "set train.loss_reduction: sum" in notes[0], out[-600:]
    assert "train.loss_reduction is mean" in notes[0]
