"""Sampling a text run: which prompt and seed each image gets, the one-line refusals, the guidance groups."""

import json

import pytest

from diffrelay.errors import UserError
from diffrelay.data import prompts
from diffrelay.sampling import prompted


def items(*entries, first_seed=0):
    return prompts.expand([prompts.Prompt(**({"negative_prompt": None, "seed": None, "guidance": None,
                                               "steps": None} | e)) for e in entries], first_seed)


def test_a_text_network_without_prompts_and_prompts_for_a_class_network_are_refused():
    with pytest.raises(UserError, match="a text-conditional network; give it prompts"):
        prompted.refuse_mismatch({"text": {"encoders": []}}, False, "snap.safetensors")
    with pytest.raises(UserError, match="is not text-conditional"):
        prompted.refuse_mismatch({}, True, "snap.safetensors")
    prompted.refuse_mismatch({"text": {}}, True, "s")
    prompted.refuse_mismatch({}, False, "s")


def test_guidance_needs_caption_dropout_and_a_negative_prompt_at_guidance_1_is_said_unused():
    import logging

    from diffrelay import logs

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log, level = logs.get(), logs.get().level
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # as logs.setup sets it in a stage; a test run alone has not called it
    try:
        trained = {"config": {"data": {"caption_dropout": 0.1}}}
        prompted.check(trained, items({"prompt": "a red circle", "negative_prompt": "blue"}), 2.0, "s")
        assert not said
        # The unguided images of a sweep [1, 4.5]: the negative prompt is not used, and that is said.
        prompted.check(trained, items({"prompt": "a red circle", "negative_prompt": "blue"}), 1.0, "s")
        assert said == ["1 prompt(s) with a negative prompt at guidance 1 (e.g. prompt 1): unguided, the negative "
                        "prompt is not used"]
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    # An entry's own guidance counts, not only sample.guidance.
    prompted.check(trained, items({"prompt": "a", "negative_prompt": "b", "guidance": 3.0}), 1.0, "s")
    with pytest.raises(UserError, match="trained without data.caption_dropout"):
        prompted.check({"config": {"data": {}}}, items({"prompt": "a red circle"}), 2.0, "snap")
    prompted.check({"config": {"data": {}}}, items({"prompt": "a red circle"}), 1.0, "snap")


def test_groups_share_guidance_steps_and_size_and_keep_every_index_once():
    chosen = items({"prompt": "a"}, {"prompt": "b", "guidance": 3.0}, {"prompt": "c", "steps": 5},
                   {"prompt": "d", "num_images": 2}, {"prompt": "e", "width": 24, "height": 16})
    out = list(prompted.groups(chosen, range(len(chosen)), 2.0, 8))
    assert sorted(i for _, _, _, part in out for i in part) == list(range(6))
    knobs = {(g, n, z): part for g, n, z, part in out}
    assert knobs == {(2.0, 8, None): [0, 3, 4], (3.0, 8, None): [1], (2.0, 5, None): [2], (2.0, 8, (24, 16)): [5]}
    # A process's share (round robin) groups the same way; an entry without a size takes the folder's.
    assert [part for _, _, _, part in prompted.groups(chosen, [1, 3], 2.0, 8)] == [[3], [1]]
    assert [z for _, _, z, _ in prompted.groups(chosen, [3, 5], 2.0, 8, (16, 24))] == [(16, 24), (24, 16)]


def test_the_seed_of_each_image_and_the_fingerprint_of_the_items():
    chosen = items({"prompt": "a", "num_images": 2}, {"prompt": "b", "seed": 40, "num_images": 2}, first_seed=10)
    assert [(it.prompt, it.seed) for it in chosen] == [("a", 10), ("a", 11), ("b", 40), ("b", 41)]
    again = items({"prompt": "a", "num_images": 2}, {"prompt": "b", "seed": 40, "num_images": 2}, first_seed=10)
    assert prompted.fingerprint(chosen) == prompted.fingerprint(again)
    edited = items({"prompt": "a", "num_images": 2}, {"prompt": "b!", "seed": 40, "num_images": 2}, first_seed=10)
    assert prompted.fingerprint(chosen) != prompted.fingerprint(edited)


def test_the_held_out_captions_are_one_image_each(tmp_path):
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "captions.json").write_text(json.dumps(
        {"texts": ["", "a red circle", "red circle", "a blue square"], "rows": [[1, 2], [3]]}))
    chosen = prompted.held_out(tmp_path, 5)
    assert [(it.prompt, it.seed) for it in chosen] == [("a red circle", 5), ("a blue square", 6)]
    assert len(prompted.held_out(tmp_path, 0, limit=1)) == 1
    with pytest.raises(UserError, match="no held-out captions"):
        prompted.held_out(tmp_path / "nowhere", 0)
    with pytest.raises(UserError, match="without --config and without --prompts"):
        prompted.held_out(None, 0)


def test_a_text_runs_work_folder_with_prompt_files_is_its_own_and_can_be_resumed(tmp_path):
    """A killed text sampling job leaves NNNNNN.txt beside its PNGs: the rerun must take the folder as its own."""
    from diffrelay.sampling import folder

    out = tmp_path / "step_0000004"
    work = folder.work_dir(out)
    work.mkdir()
    for name in ("settings.json", "000000.png", "000000.txt", "000001.txt", "done-0-of-2.json"):
        (work / name).write_bytes(b"x")
    folder.check_out(out)  # no refusal
    (work / "notes.md").write_text("mine")
    with pytest.raises(UserError, match="not a sample work folder"):
        folder.check_out(out)


def test_a_checkpoint_resumes_only_with_the_text_encoders_it_was_trained_with():
    from diffrelay.text import source

    rec = {"class": "CLIPTextModel", "sha256": "a" * 64, "length": 77, "layer": "last", "pooled": False,
           "states_dim": 32, "pooled_dim": 0, "use_mask": True}
    same = source.TextSource([dict(rec)], {"states": 32, "length": 77, "pooled": 0})
    meta = {"text": {"encoders": [dict(rec)]}}
    source.check_resume("ckpt", meta, same)
    source.check_resume("ckpt", {}, None)
    with pytest.raises(UserError, match="ckpt: trained with other text encoders \\(sha256 differs"):
        source.check_resume("ckpt", meta, source.TextSource([rec | {"sha256": "b" * 64}], same.dims))
    with pytest.raises(UserError, match="encoder 1: layer='last'"):
        source.check_resume("ckpt", meta, source.TextSource([rec | {"layer": "penultimate"}], same.dims))
    with pytest.raises(UserError, match="trained with text encoders; this config is not a text run"):
        source.check_resume("ckpt", meta, None)
    with pytest.raises(UserError, match="trained without text encoders; this config is a text run"):
        source.check_resume("ckpt", {}, same)
