"""Feature extractors: the seeded random CNN, fetching/verifying Inception offline, and user TorchScript files."""

import os
from pathlib import Path
import warnings

import pytest
import torch
from conftest import run_cli
from torch import nn
from torch.nn import functional as F

from diffrelay import cli, io
from diffrelay.evaluation import extractor
from diffrelay.errors import UserError

DEAD_URL = "http://127.0.0.1:9/inception-2015-12-05.pt"  # the discard port: nothing listens, the connection is refused


class FakeTrunk(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.proj = nn.Conv2d(3, n, 1)

    def forward(self, x):
        return self.proj(F.adaptive_avg_pool2d(x, 1))  # (B, n, 1, 1), like Inception's pooled trunk


class FakeInception(nn.Module):
    """The interface clean-fid's InceptionV3W uses: a `layers` trunk and forward(img, return_features)."""

    def __init__(self, n: int = 2048):
        super().__init__()
        self.layers = FakeTrunk(n)

    def forward(self, img, return_features: bool = False):
        x = F.interpolate(img, size=(299, 299), mode="bilinear", align_corners=False)
        return self.layers((x - 128) / 128).flatten(1)


class ChannelStats(nn.Module):
    def forward(self, x):
        return torch.cat([x.mean(dim=(2, 3)), x.std(dim=(2, 3))], dim=1)


class NotFlat(nn.Module):
    def forward(self, x):
        return F.adaptive_avg_pool2d(x, 2)  # (B, 3, 2, 2): not (B, D)


def save_script(module, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(module.eval()), str(path))
    return path


def images(size=299, n=3, seed=0):
    return torch.rand((n, 3, size, size), generator=torch.Generator().manual_seed(seed)) * 255


def test_random_extractor_is_deterministic_for_a_seed(tmp_path):
    a = extractor.load(extractor.build_random(tmp_path / "a.pt", seed=0))
    b = extractor.load(extractor.build_random(tmp_path / "b.pt", seed=0))
    c = extractor.load(extractor.build_random(tmp_path / "c.pt", seed=1))
    x = images()
    with torch.no_grad():
        ya, yb, yc = a.fn(x), b.fn(x), c.fn(x)
    assert ya.shape == (3, extractor.RANDOM_DIM)
    assert torch.equal(ya, yb)
    assert not torch.allclose(ya, yc)
    assert (a.kind, a.label) == ("random", "FD (random features)")
    assert extractor.check(a) == extractor.RANDOM_DIM


def test_random_extractor_accepts_native_size_images_for_legacy_mode(tmp_path):
    ext = extractor.load(extractor.build_random(tmp_path / "r.pt"), mode="legacy_tensorflow")
    with torch.no_grad():
        assert ext.fn(images(size=16)).shape == (3, extractor.RANDOM_DIM)


def test_existing_random_extractor_is_kept_and_another_seed_is_refused(tmp_path):
    path = extractor.build_random(tmp_path / "r.pt", seed=0)
    before = (path.stat().st_mtime_ns, io.sha256_file(path))
    extractor.build_random(path, seed=0)
    assert (path.stat().st_mtime_ns, io.sha256_file(path)) == before
    with pytest.raises(UserError, match="seed=1"):
        extractor.build_random(path, seed=1)


def test_offline_inception_fetch_names_url_and_path_and_leaves_no_file(tmp_path):
    out = tmp_path / "extractors" / "inception-2015-12-05.pt"
    p = run_cli("fetch-extractor", "--extractor", "inception", "--out", out, check=False,
                env={**os.environ, "DIFFRELAY_INCEPTION_URL": DEAD_URL})
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("diffrelay: error:")
    assert DEAD_URL in lines[-1] and str(out.resolve()) in lines[-1]
    assert not any(line.startswith("Traceback") for line in lines)
    assert list(out.parent.iterdir()) == []  # no partial download, no temp file


def test_hand_placed_inception_file_is_used_as_is(tmp_path, monkeypatch, capsys):
    out = save_script(FakeInception(), tmp_path / "inception-2015-12-05.pt")
    before = (out.stat().st_mtime_ns, io.sha256_file(out))
    # A download attempt would fail against the dead URL, so success proves none was made.
    monkeypatch.setattr(extractor, "INCEPTION_URL", DEAD_URL)
    assert cli.main(["fetch-extractor", "--extractor", "inception", "--out", str(out)]) == 0
    assert before[1] in capsys.readouterr().out
    assert (out.stat().st_mtime_ns, io.sha256_file(out)) == before
    ext = extractor.load(out)
    assert (ext.kind, ext.label) == ("inception", "FID")
    with torch.no_grad():
        assert ext.fn(images()).shape == (3, 2048)
        assert extractor.load(out, mode="legacy_tensorflow").fn(images(size=16)).shape == (3, 2048)


def test_inception_file_with_wrong_feature_count_is_refused(tmp_path, monkeypatch, capsys):
    out = save_script(FakeInception(n=1000), tmp_path / "inception-2015-12-05.pt")
    monkeypatch.setattr(extractor, "INCEPTION_URL", DEAD_URL)
    assert cli.main(["fetch-extractor", "--extractor", "inception", "--out", str(out)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"diffrelay: error: {out}:") and "test batch" in line
    assert out.exists()  # a file the user placed is never deleted


def test_download_failure_in_process_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.setattr(extractor, "INCEPTION_URL", DEAD_URL)
    out = tmp_path / "inception.pt"
    with pytest.raises(UserError, match="place the file at"):
        extractor.fetch_inception(out)
    assert list(tmp_path.iterdir()) == []


def test_custom_extractor_is_checked_copied_and_labelled_by_name(tmp_path):
    src = save_script(ChannelStats(), tmp_path / "stats6.pt")
    out = tmp_path / "resources" / "stats6.pt"
    assert cli.main(["fetch-extractor", "--extractor", str(src), "--out", str(out)]) == 0
    assert io.sha256_file(out) == io.sha256_file(src)
    ext = extractor.load(out)
    assert (ext.kind, ext.label) == ("custom", "FD (stats6.pt)")
    assert extractor.check(ext) == 6


def test_extractor_without_flat_features_is_refused(tmp_path):
    src = save_script(NotFlat(), tmp_path / "notflat.pt")
    with pytest.raises(UserError, match=r"output=\(2, 3, 2, 2\)"):
        extractor.copy_custom(src, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_file_that_is_not_torchscript_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "weights.pt"
    bad.write_bytes(b"not a model" * 100)
    with pytest.raises(UserError, match="not a loadable TorchScript") as e:
        extractor.load(bad)
    assert "\n" not in str(e.value)


def test_unknown_extractor_name_is_refused(tmp_path, capsys):
    assert cli.main(["fetch-extractor", "--extractor", "inceptoin", "--out", str(tmp_path / "x.pt")]) == 2
    assert "--extractor=inceptoin" in capsys.readouterr().err


def test_test_batches_are_made_on_the_extractors_device():
    """On a GPU the extractor loads on cuda: a test batch made on the CPU would fail in the first conv
    (and be reported as a broken extractor). The meta device stands in for cuda here."""
    seen = []

    def fn(x):
        seen.append(x.device)
        return torch.zeros(x.shape[0], 4)

    ext = extractor.Extractor(fn, "custom", Path("mine.pt"), "0" * 64, "FD (mine.pt)", 299, device=torch.device("meta"))
    assert extractor.check(ext) == 4
    assert seen == [torch.device("meta")]
