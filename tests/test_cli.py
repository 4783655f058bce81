"""The command line itself: `--version`, and `--help` examples that name files the demo really makes."""

import re

import pytest
import tomllib

from conftest import REPO, run_cli
from diffrelay import __version__, cli, config
from diffrelay.evaluation import protocol


def test_version_is_the_package_version():
    p = run_cli("--version")
    assert p.stdout.strip() == f"diffrelay {__version__}"
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == __version__


def output_patterns() -> list[re.Pattern]:
    """The run-folder paths the workflow's rules write, as regexes (steps are 7 digits, variants optional)."""
    out = []
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        for pattern in re.findall(r'f"\{RUN_DIR\}/([^"]+)"', smk.read_text()):
            rx = re.escape(pattern).replace(r"\{STEP\}", r"(?P<step>\d{7})").replace(r"\{VARIANT\}", r"(_[\w.]+)?")
            out.append(re.compile(re.sub(r"\\\{\\\{\w+\\\}\\\}", r"[^/]+", rx) + r"\Z"))
    return out


def test_help_examples_name_files_the_demo_makes():
    cfg = config.load([REPO / "config" / "config.yaml"])
    run = f"{cfg.run.results}/{cfg.run.name}/"
    steps = set(config.segment_ends(cfg))
    extractors = {protocol.extractor_file(n, cfg.run.seed, cfg.run.resources)
                  for n in protocol.extractor_names(cfg.to_dict()["fid"])}
    patterns = output_patterns()
    paths = re.findall(r"(?:config|results|resources)/[\w./-]+", cli.__doc__)
    assert len(paths) >= 6
    for path in paths:
        if path.startswith("config/"):
            assert (REPO / path).is_file(), path
        elif path.startswith(run):
            rest = path[len(run):]
            match = next((m for p in patterns if (m := p.match(rest))), None)
            assert match, f"{path}: the workflow writes no such file"
            if "step" in match.groupdict():
                assert int(match["step"]) in steps, f"{path}: the demo has no checkpoint at that step"
        else:
            assert path in extractors, f"{path}: the demo's extractor is {sorted(extractors)}"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_fid_timeout_must_be_a_finite_number_of_minutes_above_zero(tmp_path, value):
    p = run_cli("fid", "--images", tmp_path, "--ref", tmp_path / "r.npz", "--extractor", tmp_path / "e.pt",
                "--timeout-minutes", value, "--out", tmp_path / "r.json", check=False)
    assert p.returncode == 2 and "--timeout-minutes" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_export_help_names_every_pipeline_kohyas_keys_are_written_for_and_the_default_weights(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "UNet pipelines: SD, SDXL; and FLUX.1" in text
    assert "the ones the run samples and scores, sample.weights of --config" in text
