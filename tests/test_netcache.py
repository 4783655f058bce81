"""`validate` and the Snakefile keep what building a run's network told them (config/netcache.py): a second check of the
same network reads the answer instead of building it (and importing diffusers) again, prints the same lines, and a
change to the config or to a file of a folder the network is read from is measured anew."""

import os
from types import SimpleNamespace

import pytest

from diffrelay import cli, config
from diffrelay.config import netcache
from diffrelay.config import report as validate
from diffrelay.nets import registry


def _refuse(*a, **k):
    raise AssertionError("the network was built again")


def test_a_second_check_reads_the_answer_and_a_changed_config_is_measured_again(write_config, monkeypatch, capsys):
    path = write_config()
    cfg = config.load([path])
    cold = validate.check_network(cfg)
    assert os.listdir(os.path.join(cfg.run.resources, "validate"))  # the answer, kept
    cli.main(["validate", "--config", str(path)])
    first = capsys.readouterr().out
    monkeypatch.setattr(registry, "check", _refuse)  # a hit builds nothing
    assert validate.check_network(cfg) == cold
    cli.main(["validate", "--config", str(path)])
    assert capsys.readouterr().out == first  # the same report, read back
    other = config.load([write_config({"model": {"channels": 16}}, name="other.yaml")])
    with pytest.raises(AssertionError, match="built again"):
        validate.check_network(other)  # another network: a miss, measured


def test_a_changed_file_of_a_named_folder_or_another_library_version_is_another_key(write_config, tmp_path,
                                                                                    monkeypatch):
    cfg = config.load([write_config()])
    folder = tmp_path / "pipe"
    (folder / "transformer").mkdir(parents=True)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"x" * 8)
    monkeypatch.setattr(netcache, "_paths", lambda v: [str(folder)] if isinstance(v, dict) and "arch" in v else [])
    before = netcache.key(cfg, "check")
    assert netcache.key(cfg, "check") == before
    os.utime(weights, ns=(1, 1))  # the same bytes, rewritten: measured again
    assert netcache.key(cfg, "check") != before
    touched = netcache.key(cfg, "check")
    monkeypatch.setattr(netcache, "_version", lambda name: "0.0" if name == "diffusers" else None)
    assert netcache.key(cfg, "check") != touched


def test_a_users_own_network_is_never_cached_and_an_unwritable_cache_changes_nothing(write_config, tmp_path):
    own = config.load([write_config()])
    fake = SimpleNamespace(to_dict=lambda: {**own.to_dict(), "model": {**own.to_dict()["model"], "arch": "mod:Net"}})
    assert netcache.key(fake, "check") is None
    (tmp_path / "resources").mkdir(exist_ok=True)
    (tmp_path / "resources" / "validate").write_text("a file where the cache folder would be")
    netcache.write(own, netcache.key(own, "check"), 123)  # skipped, no error
    assert netcache.read(own, netcache.key(own, "check")) is None
