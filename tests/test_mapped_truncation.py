"""A memory-mapped file truncated while it is read is one line naming it, not a SIGBUS (issue 38, item 3).

`fid-ref` died of "Bus error" (exit 135, an empty log) when the dataset's images.npy was cut short while it
read it; training already checked each batch. Every reader of a mapped dataset now checks the file's size against
the mapping before each read (runtime/mapped.py). On code without the check these tests die of SIGBUS.
"""

import numpy as np
import pytest

from diffrelay import io
from diffrelay.errors import UserError
from diffrelay.evaluation import extractor, features, fid


def _dataset(folder, n=8, side=16):
    folder.mkdir()
    rng = np.random.default_rng(0)
    np.save(folder / "images.npy", rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8))  # 6 KB: two pages
    np.save(folder / "labels.npy", np.zeros(n, np.int64))
    io.write_json(folder / "dataset.json", {"format": "diffrelay-dataset/1", "count": n, "resolution": side,
                                            "num_classes": 0, "class_names": [], "fingerprint": "f" * 64})
    return folder


def _truncate(path, size=1000):
    with open(path, "r+b") as f:
        f.truncate(size)


def test_fid_ref_of_a_dataset_truncated_while_it_reads_is_one_line_naming_the_file(tmp_path, monkeypatch):
    from diffrelay.data import datasets

    ext = extractor.build_random(tmp_path / "random.pt", seed=0)
    opened = datasets.open_prepared

    def open_then_truncate(path):  # the file is cut short after fid-ref mapped it, as by a concurrent rewrite
        prepared = opened(path)
        _truncate(path / "images.npy")
        return prepared

    monkeypatch.setattr(datasets, "open_prepared", open_then_truncate)
    for workers in (1, 2):  # read here, and by reading threads
        dataset = _dataset(tmp_path / f"dataset{workers}")
        with pytest.raises(UserError, match=rf"{dataset / 'images.npy'}: 1000 bytes, 6272 expected: the file was "
                                            "truncated or replaced while its images were read; make it again"):
            fid.make_ref(dataset, ext, tmp_path / "ref.npz", workers=workers)
    assert not (tmp_path / "ref.npz").exists()


def test_an_adm_batch_or_any_mapped_rows_are_checked_before_each_read(tmp_path):
    np.save(tmp_path / "arr_0.npy", np.zeros((8, 16, 16, 3), np.uint8))
    images = np.load(tmp_path / "arr_0.npy", mmap_mode="r")
    items = features.array_images(images, np.arange(8), [features.NATIVE])
    _truncate(tmp_path / "arr_0.npy")
    with pytest.raises(UserError, match=r"arr_0.npy: 1000 bytes"):
        items[7]  # noqa: B018 -- reading the row is the test


def test_a_view_of_some_rows_is_checked_against_its_whole_mapping(tmp_path):
    from diffrelay.runtime import mapped

    np.save(tmp_path / "a.npy", np.zeros((8, 16, 16, 3), np.uint8))
    rows = np.load(tmp_path / "a.npy", mmap_mode="r")[6:8]  # offset and nbytes of a view describe no file range
    _truncate(tmp_path / "a.npy")
    with pytest.raises(UserError, match="a.npy: 1000 bytes, 6272 expected"):
        mapped.check_intact(rows, "a test ran", "rerun")
    mapped.check_intact(np.zeros(3), "a test ran", "rerun")  # an array with no file: nothing to check


def test_the_text_embedding_cache_truncated_while_training_reads_it_is_one_line(tmp_path):
    from diffrelay.text import cache

    np.save(tmp_path / cache.STATES, np.zeros((8, 4, 64), np.float32))  # 8 KB
    np.save(tmp_path / cache.MASK, np.ones((8, 4), np.uint8))
    states, mask = (np.load(tmp_path / name, mmap_mode="r") for name in (cache.STATES, cache.MASK))
    c = cache.Cache(tmp_path, {"count": 8}, states, mask, None)
    assert c.take([7], "cpu").states.shape == (1, 4, 64)
    _truncate(tmp_path / cache.STATES, 200)
    with pytest.raises(UserError, match=rf"{cache.STATES}: 200 bytes, \d+ expected: .* while its captions' "
                                        "embeddings were read; rerun `diffrelay prepare"):
        c.take([7], "cpu")
