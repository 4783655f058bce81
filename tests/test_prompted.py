"""Sampling a text run: which prompt and seed each image gets, the one-line refusals, the guidance groups."""

import json

import pytest

from diffrelay.errors import UserError
from diffrelay.sampling import prompted, prompts


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


def test_guidance_needs_caption_dropout_and_a_negative_prompt_needs_guidance():
    trained = {"config": {"data": {"caption_dropout": 0.1}}}
    prompted.check(trained, items({"prompt": "a red circle", "negative_prompt": "blue"}), 2.0, "s")
    with pytest.raises(UserError, match="prompt 1 .*negative prompt without guidance"):
        prompted.check(trained, items({"prompt": "a red circle", "negative_prompt": "blue"}), 1.0, "s")
    # An entry's own guidance counts, not only sample.guidance.
    prompted.check(trained, items({"prompt": "a", "negative_prompt": "b", "guidance": 3.0}), 1.0, "s")
    with pytest.raises(UserError, match="trained without data.caption_dropout"):
        prompted.check({"config": {"data": {}}}, items({"prompt": "a red circle"}), 2.0, "snap")
    prompted.check({"config": {"data": {}}}, items({"prompt": "a red circle"}), 1.0, "snap")


def test_groups_share_guidance_and_steps_and_keep_every_index_once():
    chosen = items({"prompt": "a"}, {"prompt": "b", "guidance": 3.0}, {"prompt": "c", "steps": 5},
                   {"prompt": "d", "num_images": 2})
    out = list(prompted.groups(chosen, range(len(chosen)), 2.0, 8))
    assert sorted(i for _, _, part in out for i in part) == list(range(5))
    knobs = {(g, n): part for g, n, part in out}
    assert knobs == {(2.0, 8): [0, 3, 4], (3.0, 8): [1], (2.0, 5): [2]}
    # A process's share (round robin) groups the same way.
    assert [part for _, _, part in prompted.groups(chosen, [1, 3], 2.0, 8)] == [[3], [1]]


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
