"""Prompt files (data/prompts.py): every format, kohya's options, the seeds expand gives, and one line for
every bad input."""

import json

import pytest

from diffrelay.errors import UserError
from diffrelay.data import prompts
from diffrelay.data.prompts import Prompt


def write(tmp_path, name, text, binary=False):
    path = tmp_path / name
    path.write_bytes(text) if binary else path.write_text(text, encoding="utf-8")
    return path


def refused(path, *fragments):
    """read(path) raises one UserError line naming the file and holding every fragment."""
    with pytest.raises(UserError) as e:
        prompts.read(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


EXPECTED = [Prompt("a red circle", None, None, None, None),
            Prompt("a blue square", "blurry", 7, 4.5, 20, 3)]


def test_txt_skips_blank_and_comment_lines(tmp_path):
    path = write(tmp_path, "p.txt", "# my prompts\n\n  a red circle  \n   # indented comment\na blue square\r\n")
    assert prompts.read(path) == [Prompt("a red circle", None, None, None, None),
                                  Prompt("a blue square", None, None, None, None)]


def test_txt_kohya_options(tmp_path):
    # kohya-ss/sd-scripts train_util.line_to_prompt_dict: split at " --"; n negative, d seed, l scale, s steps.
    path = write(tmp_path, "p.txt", "a red circle\na blue square --n blurry --d 7 --l 4.5 --s 20\n"
                                    "a cat --N low quality, jpeg --S 5\n")
    got = prompts.read(path)
    assert got[:2] == [EXPECTED[0], Prompt("a blue square", "blurry", 7, 4.5, 20)]
    assert got[2] == Prompt("a cat", "low quality, jpeg", None, None, 5)


@pytest.mark.parametrize("line, fragments", [
    ("a cat --ss euler_a", ["line 1", "unknown option '--ss euler_a'", "--n negative prompt, --d seed"]),
    ("a cat --w 512", ["line 1", "width without height; give both"]),
    ("a cat -- digital art", ["unknown option", "YAML or JSON file"]),
    ("a cat --d 1 --d 2", ["option --d given twice"]),
    ("a cat --n", ["option --n has no value"]),
    ("a cat --d 1.5", ["seed '1.5' is not an integer", "from 0 to"]),
    ("a cat --l high", ["guidance 'high' is not a number", "from 0 to 100"]),
    ("a cat --s 0", ["steps 0 is out of range", "from 1 to 10000"]),
    ("a cat --d -1", ["seed -1 is out of range"]),
    ("   --n blurry", ["empty prompt"]),
])
def test_txt_bad_lines(tmp_path, line, fragments):
    refused(write(tmp_path, "p.txt", line + "\n"), *fragments)


def test_bad_line_is_named_by_its_number(tmp_path):
    refused(write(tmp_path, "p.txt", "# c\n\na cat\na dog --s x\n"), "line 4", "steps 'x'")


YAML = """\
- a red circle
- prompt: a blue square
  negative_prompt: blurry
  seed: 7
  guidance: 4.5
  steps: 20
  num_images: 3
"""


def test_yaml_list_and_mapping_forms(tmp_path):
    assert prompts.read(write(tmp_path, "p.yaml", YAML)) == EXPECTED
    nested = "prompts:\n" + "".join("  " + line + "\n" for line in YAML.splitlines())
    assert prompts.read(write(tmp_path, "p.yml", nested)) == EXPECTED


def test_yaml_string_entries_take_kohya_options(tmp_path):
    got = prompts.read(write(tmp_path, "p.yaml", "- a cat --d 3 --l 2\n"))
    assert got == [Prompt("a cat", None, 3, 2.0, None)]


def test_jsonl_and_json(tmp_path):
    lines = ['"a red circle"', "", json.dumps({"prompt": "a blue square", "negative_prompt": "blurry", "seed": 7,
                                                "guidance": 4.5, "steps": 20, "num_images": 3})]
    assert prompts.read(write(tmp_path, "p.jsonl", "\n".join(lines) + "\n")) == EXPECTED
    entries = ["a red circle", json.loads(lines[2])]
    assert prompts.read(write(tmp_path, "p.json", json.dumps(entries, indent=2))) == EXPECTED
    assert prompts.read(write(tmp_path, "q.json", json.dumps({"prompts": entries}))) == EXPECTED


def test_fingerprint_is_the_entries_not_the_format(tmp_path):
    a = prompts.fingerprint(prompts.read(write(tmp_path, "p.yaml", YAML)))
    b = prompts.fingerprint(prompts.read(write(tmp_path, "p.txt",
                                               "a red circle\na blue square --n blurry --d 7 --l 4.5 --s 20\n")))
    assert len(a) == 64 and a != b  # the .txt has no num_images 3
    assert a == prompts.fingerprint(EXPECTED)
    assert a != prompts.fingerprint([EXPECTED[0], Prompt("a blue square", "blurry", 8, 4.5, 20, 3)])


def test_expand_seeds():
    ps = [Prompt("a", None, None, None, None, 2), Prompt("b", "neg", 100, 3.0, 9, 3), Prompt("c", None, None, None, None)]
    items = prompts.expand(ps, first_seed=10)
    assert [(it.index, it.prompt_index, it.prompt, it.seed) for it in items] == [
        (0, 0, "a", 10), (1, 0, "a", 11), (2, 1, "b", 100), (3, 1, "b", 101), (4, 1, "b", 102), (5, 2, "c", 15)]
    assert (items[3].negative_prompt, items[3].guidance, items[3].steps) == ("neg", 3.0, 9)
    assert (items[0].negative_prompt, items[0].guidance, items[0].steps) == (None, None, None)
    assert prompts.expand(ps, first_seed=10) == items  # every checkpoint gets the same images
    assert [it.seed for it in prompts.expand(ps, 0)] == [0, 1, 100, 101, 102, 5]
    with pytest.raises(UserError, match="first seed"):
        prompts.expand(ps, -1)
    with pytest.raises(UserError, match="lower sample.first_seed"):
        prompts.expand(ps, 2**63 - 3)


@pytest.mark.parametrize("entry, fragments", [
    ({"prompt": "a", "negative": "x"}, ["unknown key 'negative'", "did you mean 'negative_prompt'",
                                        "prompt, negative_prompt, seed, guidance, steps, num_images"]),
    ({"prompt": "a", "cfg_scale": 7}, ["unknown key 'cfg_scale'", "did you mean 'guidance'"]),
    ({"prompt": "a", "sample_steps": 7}, ["did you mean 'steps'"]),
    ({"prompt": "a", "seeds": 7}, ["did you mean 'seed'"]),
    ({"prompt": "a", "size": 512}, ["unknown key 'size'; the keys are"]),
    ({"prompt": "a", "width": 512}, ["width without height; give both"]),
    ({"prompt": "a", "width": 512, "height": 8.5}, ["height 8.5", "from 8 to 16384"]),
    ({"negative_prompt": "x"}, ["no prompt; add prompt:"]),
    ({"prompt": ""}, ["empty prompt"]),
    ({"prompt": 5}, ["prompt is a integer"]),
    ({"prompt": "a", "negative_prompt": 3}, ["negative_prompt is a integer"]),
    ({"prompt": "a", "seed": -1}, ["seed -1", "from 0 to 9223372036854775807"]),
    ({"prompt": "a", "seed": 1.0}, ["seed 1.0", "not an integer"]),
    ({"prompt": "a", "seed": True}, ["seed True"]),
    ({"prompt": "a", "seed": 2**63 - 2, "num_images": 3}, ["passes"]),
    ({"prompt": "a", "guidance": -0.5}, ["guidance -0.5", "from 0 to 100"]),
    ({"prompt": "a", "guidance": 101}, ["guidance 101"]),
    ({"prompt": "a", "guidance": "7"}, ["guidance '7'", "not a number"]),
    ({"prompt": "a", "steps": 0}, ["steps 0", "from 1 to 10000"]),
    ({"prompt": "a", "steps": 2.5}, ["steps 2.5"]),
    ({"prompt": "a", "num_images": 0}, ["num_images 0", "from 1 to 10000"]),
    ({"prompt": "a", "num_images": 10001}, ["num_images 10001"]),
    (["a list"], ["a list, not a prompt"]),
])
def test_bad_entries(tmp_path, entry, fragments):
    refused(write(tmp_path, "p.json", json.dumps(["fine", entry])), "entry 2", *fragments)


def test_json_nan_guidance_refused(tmp_path):
    refused(write(tmp_path, "p.jsonl", '{"prompt": "a", "guidance": NaN}\n'), "line 1", "guidance nan")


def test_yaml_errors_name_the_line(tmp_path):
    refused(write(tmp_path, "p.yaml", "- a\n- prompt: b\n  sede: 3\n"), "entry 2 (line 2)", "did you mean 'seed'")
    refused(write(tmp_path, "p.yaml", "- a\n- prompt: [b\n"), "line 3", "not valid YAML")
    refused(write(tmp_path, "p.yaml", "- prompt: a\n  prompt: b\n"), "line 2", "key 'prompt' appears twice")
    refused(write(tmp_path, "p.yaml", "prompt: a\n"), "unknown top-level key 'prompt'", "did you mean 'prompts'")
    refused(write(tmp_path, "p.yaml", "prompts: a\n"), "must be a list")
    refused(write(tmp_path, "p.yaml", "just text\n"), "a str, not a list")
    refused(write(tmp_path, "p.yaml", "- a\n-\n"), "entry 2 (line 2)", "a null, not a prompt")


def test_syntax_errors(tmp_path):
    refused(write(tmp_path, "p.json", '[\n"a",\n"b"\n"c"]'), "line 4", "not valid JSON")
    refused(write(tmp_path, "p.jsonl", '"a"\n{"prompt": }\n'), "line 2", "not valid JSON")
    refused(write(tmp_path, "p.json", "5"), "a int, not a list")


@pytest.mark.parametrize("name, text", [("p.txt", "\n# only comments\n\n"), ("p.yaml", ""), ("p.yaml", "[]\n"),
                                        ("p.jsonl", "\n\n"), ("p.json", "[]")])
def test_empty_files(tmp_path, name, text):
    refused(write(tmp_path, name, text), "no prompts")


def test_file_problems(tmp_path):
    refused(tmp_path / "missing.txt", "prompt file not found")
    (tmp_path / "d.txt").mkdir()
    refused(tmp_path / "d.txt", "is a folder")
    refused(write(tmp_path, "p.csv", "a\n"), "unknown prompt file type '.csv'", ".txt, .yaml/.yml, .jsonl or .json")
    refused(write(tmp_path, "p.txt", b"a cat\na \xff dog\n", binary=True), "line 2", "not valid UTF-8", "0xff")


def test_utf8_byte_order_mark_and_unicode(tmp_path):
    path = write(tmp_path, "p.txt", "\ufeffune tasse de caf\u00e9\n\u732b\n".encode(), binary=True)
    assert [p.prompt for p in prompts.read(path)] == ["une tasse de caf\u00e9", "\u732b"]


def test_validate_says_how_many_images_a_prompt_file_gives_and_which_key_wins(tmp_path):
    """A prompt file's images (num_images per entry, 1 where unset) replace sample.num_images; validate says so."""
    from diffrelay import config
    from diffrelay.config import report

    f = tmp_path / "p.yaml"
    f.write_text("- a cat\n- {prompt: a dog, num_images: 3}\n")
    d = config.validate({"data": {"captions": "auto", "text_encoders": [{"path": str(tmp_path)}], "val_fraction": 0.1},
                         "model": {"arch": "diffusers-unet", "class_conditional": False},
                         "sample": {"prompts": str(f), "num_images": 256}})
    assert report.sample_line(config.Config(d)) == (
        f"# sample: {f}: 2 prompts, 1-3 images each, 4 images a checkpoint and guidance scale (a prompt's "
        "num_images, 1 where the file sets none); sample.num_images=256 applies only without a prompt file")
    d["sample"]["prompts"] = None
    assert "one image per held-out caption, at most sample.num_images=256" in report.sample_line(config.Config(d))


def test_prompts_longer_than_the_encoders_take_are_said_once_with_how_many_and_each_limit(tmp_path):
    """Nothing bounds a prompt's length: the encoders cut it (CLIP at 77 tokens, T5 at its max_length), as the
    pipelines do. One warning line says how many texts are cut and each encoder's limit; the encoders' own
    first-cut line is then not said again."""
    import logging

    import textmodels
    import torch
    from diffrelay import logs
    from diffrelay.text import demo, encoders

    clip = encoders.load({"path": str(demo.clip_text(tmp_path / "clip"))}, torch.device("cpu"))
    t5 = encoders.load({"path": str(textmodels.t5(tmp_path / "t5")), "max_length": 16}, torch.device("cpu"))
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logs.get().addHandler(handler)
    try:
        texts = ["a red circle", "a red circle " * 10, "a photo of " * 3_000, "a photo of " * 3_000, None]
        assert prompts.say_cut([clip, t5], texts) == 2
        assert prompts.say_cut([clip], ["a red circle"]) == 0
        encoders.encode([clip, t5], ["a photo of " * 3_000], torch.device("cpu"))  # its own line: said already
    finally:
        logs.get().removeHandler(handler)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("2 of 3 prompts are longer than a text encoder takes and are cut to its length")
    assert f"CLIPTextModel ({tmp_path / 'clip'}) 77 tokens: 1; T5EncoderModel ({tmp_path / 't5'}) 16 tokens: 2" \
        in lines[0], lines[0]
    assert clip.warned and t5.warned


def test_a_prompt_file_that_is_a_fifo_or_a_device_is_said_to_be_one_not_missing(tmp_path):
    """A FIFO or a link to /dev/zero was "no such file" when the config was checked; each is named for what it is,
    in one line, and never opened (reading either would block or never end)."""
    import os

    from diffrelay import config

    os.mkfifo(tmp_path / "fifo.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "folder.txt").mkdir()
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    text = {"captions": "auto", "text_encoders": [{"path": str(tmp_path)}], "val_fraction": 0.1}
    for name, what in (("fifo.txt", "a FIFO (named pipe), not a regular file"),
                       ("zero.txt", "a device, not a regular file"), ("folder.txt", "a folder, not a file"),
                       ("gone.txt", "a dangling symlink"), ("missing.txt", "no such file")):
        path = tmp_path / name
        with pytest.raises(UserError) as e:
            config.validate({"data": text, "model": {"arch": "diffusers-unet", "class_conditional": False},
                             "sample": {"prompts": str(path)}}, "c.yaml")
        assert str(e.value) == f"c.yaml: sample.prompts={path}: {what}; give a prompt file (one prompt a line, or " \
            "YAML/JSONL)", str(e.value)
    refused(tmp_path / "fifo.txt", "prompt file is not a regular file (a pipe, socket or device)")
