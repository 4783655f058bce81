"""data/sources.py: what a run's dataset was made from, and what changed in its source, said in words."""

import os
from types import SimpleNamespace

from diffrelay.data import sources


def plan(files, captions, text=("e1",), latent=None, fingerprint="f"):
    texts = ("",) + tuple(dict.fromkeys(captions.values()))
    return SimpleNamespace(fingerprint=fingerprint, files=tuple((k, v) for k, v in files.items()),
                           caption_rows=tuple((texts.index(captions[k]),) for k in files), texts=texts,
                           val_files=(), val_caption_rows=(), val_texts=(), text=tuple({"sha256": t} for t in text),
                           latent=latent)


def test_changes_name_each_image_and_caption_and_the_encoders():
    was = sources.record(plan({"a.png": "1" * 64, "b.png": "2" * 64, "c.png": "3" * 64},
                              {"a.png": "a cat", "b.png": "a dog", "c.png": "a cow"}))
    now = sources.record(plan({"a.png": "1" * 64, "b.png": "9" * 64, "d.png": "4" * 64},
                              {"a.png": "a black cat", "b.png": "a dog", "d.png": "a hen"}, text=("e2",)))
    assert sources.changes(was, now) == ("image b.png changed, image d.png added, image c.png removed, caption of "
                                         "a.png edited, the text encoders' weights changed (sha256 e1 -> e2)")
    many = sources.record(plan({f"{i}.png": "0" * 64 for i in range(5)}, {f"{i}.png": "x" for i in range(5)}))
    assert sources.changes(sources.record(plan({}, {})), many) == "5 images added (0.png, 1.png, 2.png, ... 2 more)"


def test_the_listing_sees_an_edit_in_the_folder_or_an_encoder_and_reads_no_file(tmp_path):
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "a" / "0.txt").write_text("a cat")
    (tmp_path / "enc").mkdir()
    (tmp_path / "enc" / "model.safetensors").write_bytes(b"x")
    data = {"path": str(tmp_path / "imgs"), "captions": "auto", "text_encoders": [{"path": str(tmp_path / "enc")}]}
    first = sources.listing(data)
    assert sources.listing(data) == first
    os.chmod(tmp_path / "imgs" / "a" / "0.txt", 0)  # names, sizes and mtimes only: an unreadable file is listed
    (tmp_path / "imgs" / "a" / "0.txt").write_text("a dog")  # same size, new mtime
    assert sources.listing(data) != first
    second = sources.listing(data)
    (tmp_path / "enc" / "model.safetensors").write_bytes(b"yy")
    assert sources.listing(data) != second


def test_a_run_says_what_changed_since_its_checkpoints_and_restoring_the_files_is_no_change(tmp_path, caplog):
    import json
    import logging

    import pytest

    from diffrelay.errors import UserError

    a = plan({"a.png": "1" * 64}, {"a.png": "a cat"}, fingerprint="A")
    b = plan({"a.png": "1" * 64}, {"a.png": "a dog"}, fingerprint="B")
    sources.write(tmp_path, a)
    sources.warn_if_changed(tmp_path, b, "data.path=x")  # nothing trained yet: nothing to say
    (tmp_path / "checkpoints" / "step_0000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_0000002" / "meta.json").write_text(json.dumps({"dataset_fingerprint": "A"}))
    with caplog.at_level(logging.WARNING, logger="diffrelay"):
        sources.warn_if_changed(tmp_path, b, "data.path=x")
        sources.write(tmp_path, b)
        sources.warn_if_changed(tmp_path, a, "data.path=x")  # the files restored: the trained dataset again
    assert [r.message.split(";")[0] for r in caplog.records] == [
        f"data.path=x: changed since {tmp_path.name} was trained on it: caption of a.png edited"]
    with pytest.raises(UserError, match=r"fingerprint A, but ds now has B \(images added, removed or changed, or "
                                        r"captions edited: caption of a.png edited\); restore them"):
        sources.check_trained_on("step_0000002", "A", SimpleNamespace(fingerprint="B", path="ds"), tmp_path)
    sources.check_trained_on("step_0000002", "A", SimpleNamespace(fingerprint="A", path="ds"), tmp_path)
