"""The check scripts that compare diffrelay with the papers' code must be able to fail (issue 38).

The official checkouts cannot be fetched here, so each test writes a stand-in reference tree in tmp_path with
the module layout the script imports, holding only the one function the chosen case uses. Each function is
restated from the paper's formulas, not copied from the official code. The script runs as a user runs it and
must exit 0 against the stand-in, then exit non-zero with one FAIL line after a one-line change to it."""

import ast
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKS = REPO / "benchmarks" / "checks"

# Algorithm 2 of Karras et al. 2022 (EDM), deterministic and with churn, in float64: the interface edm's
# generate.py gives edm_sampler (net(x, sigma, labels); randn_like for the churn noise).
EDM_GENERATE = '''
def edm_sampler(net, latents, class_labels=None, randn_like=torch.randn_like, num_steps=18, sigma_min=0.002,
                sigma_max=80, rho=7, S_churn=0, S_min=0, S_max=float("inf"), S_noise=1):
    # Eq. 5: t_i = (sigma_max^(1/rho) + i / (N - 1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho, then t_N = 0.
    i = torch.arange(num_steps, dtype=torch.float64)
    a, b = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    t = torch.cat([(a + i / (num_steps - 1) * (b - a)) ** rho, torch.zeros(1, dtype=torch.float64)])
    x = latents.to(torch.float64) * t[0]
    for n in range(num_steps):
        gamma = min(S_churn / num_steps, 2 ** 0.5 - 1) if S_min <= t[n] <= S_max else 0.0
        t_hat = t[n] + gamma * t[n]
        x = x + (t_hat ** 2 - t[n] ** 2).sqrt() * S_noise * randn_like(x)
        d = (x - net(x, t_hat, class_labels).to(torch.float64)) / t_hat
        x_next = x + (t[n + 1] - t_hat) * d
        if n < num_steps - 1:
            d2 = (x_next - net(x_next, t[n + 1], class_labels).to(torch.float64)) / t[n + 1]
            x_next = x + (t[n + 1] - t_hat) * (0.5 * d + 0.5 * d2)
        x = x_next
    return x
'''
HEUN = "(0.5 * d + 0.5 * d2)"

# The 2-D sine/cosine position table of the transformer papers (DiT after MAE): width D, tokens row by row,
# the first D/2 features encode the token's column and the last D/2 its row, each as sin then cos of
# position x 10000^(-j / (D/4)).
DIT_MODELS = '''
import numpy as np


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    quarter = embed_dim // 4
    w = 1.0 / 10000 ** (np.arange(quarter) / quarter)
    row, col = np.divmod(np.arange(grid_size * grid_size), grid_size)
    col, row = col[:, None] * w, row[:, None] * w
    return np.concatenate([np.sin(col), np.cos(col), np.sin(row), np.cos(row)], axis=1)
'''
ROW_COL = "row, col = np.divmod("

# PickScore (Kirstain et al. 2023) as its README's "Inference with PickScore" block gives it: a function
# calc_probs(prompt, images) of the globals processor, model and device, returning the softmax over the images of
# logit_scale.exp() * cos(text, image). Restated: T exp(logit_scale) times the cosines, then the softmax.
PICKSCORE_README = """# PickScore (stand-in)

## Inference with PickScore
```python
def calc_probs(prompt, images):
    pixels = processor(images=images, return_tensors="pt").to(device)
    tokens = processor(text=prompt, padding=True, truncation=True, max_length=77, return_tensors="pt").to(device)
    with torch.no_grad():
        image, text = model.get_image_features(**pixels), model.get_text_features(**tokens)
        cos = (text / text.norm(dim=-1, keepdim=True)) @ (image / image.norm(dim=-1, keepdim=True)).T
        scores = model.logit_scale.exp() * cos[0]
        return torch.softmax(scores, dim=-1).cpu().tolist()
```
"""
TEMPERATURE = "model.logit_scale.exp() * cos[0]"


def run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKS / script), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def mutate(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old  # one line changed, nothing else
    return text.replace(old, new)


def failing(p: subprocess.CompletedProcess) -> list[str]:
    return [line for line in p.stdout.splitlines() if line.startswith("FAIL ")]


@pytest.mark.slow
def test_check_edm_sampler_fails_when_heuns_weights_change(tmp_path):
    ref, out = tmp_path / "edm", tmp_path / "out.json"
    ref.mkdir()
    args = ("--edm-src", ref, "--cases", "ode-6-sigma-rho", "--out", out)
    (ref / "generate.py").write_text(EDM_GENERATE)
    p = run("check_edm_sampler.py", *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(out.read_text())["gate"]["bounds"] == [
        {"case": "ode-6-sigma-rho", "value": 0.0, "rule": "<=", "bound": 0.0, "ok": True}]

    (ref / "generate.py").write_text(mutate(EDM_GENERATE, HEUN, "(0.4 * d + 0.6 * d2)"))
    p = run("check_edm_sampler.py", *args)
    assert p.returncode == 1, p.stdout + p.stderr
    assert [line.split(":")[0] for line in failing(p)] == ["FAIL ode-6-sigma-rho"], p.stdout
    gate = json.loads(out.read_text())["gate"]
    assert gate["failed"] == 1 and gate["bounds"][0]["value"] > 1e-3


@pytest.mark.slow
def test_check_dit_equivalence_fails_when_the_position_table_swaps_rows_and_columns(tmp_path):
    ref, out = tmp_path / "DiT", tmp_path / "out.json"
    ref.mkdir()
    args = ("--dit-src", ref, "--cases", "position-table", "--out", out)
    (ref / "models.py").write_text(DIT_MODELS)
    p = run("check_dit_equivalence.py", *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(out.read_text())["gate"]["failed"] == 0

    (ref / "models.py").write_text(mutate(DIT_MODELS, ROW_COL, "col, row = np.divmod("))
    p = run("check_dit_equivalence.py", *args)
    assert p.returncode == 1, p.stdout + p.stderr
    assert [line.split(":")[0] for line in failing(p)] == ["FAIL position-table/max_abs_diff"], p.stdout
    assert json.loads(out.read_text())["gate"]["bounds"][0]["value"] > 0.1


@pytest.mark.slow
def test_check_pick_score_fails_when_the_readme_drops_the_logit_scale(tmp_path):
    ref, out = tmp_path / "PickScore", tmp_path / "out.json"
    ref.mkdir()
    (ref / "README.md").write_text(PICKSCORE_README)
    p = run("check_pick_score.py", "--pickscore-src", ref, "--out", out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(out.read_text())["gate"]["failed"] == 0

    (ref / "README.md").write_text(mutate(PICKSCORE_README, TEMPERATURE, "cos[0]"))
    p = run("check_pick_score.py", "--pickscore-src", ref, "--out", out)
    assert p.returncode == 1, p.stdout + p.stderr
    assert [line.split(":")[0] for line in failing(p)] == ["FAIL per-image", "FAIL probs", "FAIL mean"], p.stdout


def test_the_gate_fails_on_a_figure_past_its_bound_nan_and_nothing_compared(capsys):
    spec = importlib.util.spec_from_file_location("official", CHECKS / "official.py")
    official = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(official)
    Gate = official.Gate
    g = Gate()
    g.at_most("exact", 0.0, 0.0)
    g.at_most("noise", 3e-7, 1e-6)
    g.equal("count", 5, 5)
    g.finish("demo")
    assert "all 3 figures within their bounds" in capsys.readouterr().out
    for bad in (lambda g: g.at_most("x", 1e-6, 0.0), lambda g: g.at_most("x", float("nan"), 1.0),
                lambda g: g.at_least("x", 0.0, 0.1), lambda g: g.equal("x", 4, 5), lambda g: None):
        g = Gate()
        bad(g)
        with pytest.raises(SystemExit) as e:
            g.finish("demo")
        assert e.value.code == 1
        assert capsys.readouterr().out.splitlines()[0].startswith(("FAIL x:", "demo: nothing was compared"))


def test_every_check_script_imports_official_before_diffrelay():
    """official.py puts the script's own tree's src/ first on sys.path: each check imports it before diffrelay."""
    scripts = sorted(CHECKS.glob("check_*.py"))
    assert len(scripts) >= 15
    for path in scripts:
        tops = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
                for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert "official" in tops, path.name
        first = tops.index("official")
        assert not any(m.split(".")[0] in ("diffrelay", *(s.stem for s in scripts)) for m in tops[:first]), path.name


def test_a_check_script_imports_diffrelay_from_its_own_tree_not_the_environments(tmp_path):
    """A second checkout sharing the environment, whose editable install points at this one (issue 53): its
    checks must compare its own src/diffrelay. The copy holds official.py and a stand-in diffrelay package."""
    checks, package = tmp_path / "benchmarks" / "checks", tmp_path / "src" / "diffrelay"
    checks.mkdir(parents=True)
    package.mkdir(parents=True)
    shutil.copy(CHECKS / "official.py", checks / "official.py")
    (package / "__init__.py").write_text("")
    probe = "import diffrelay\nprint(diffrelay.__file__)\n"
    (checks / "check_probe.py").write_text("from official import Gate  # noqa: F401\n" + probe)
    (checks / "plain_probe.py").write_text(probe)  # without official: the environment's diffrelay

    def imported(script: str) -> Path:
        p = subprocess.run([sys.executable, str(checks / script)], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        return Path(p.stdout.strip()).resolve()

    assert imported("check_probe.py") == (package / "__init__.py").resolve()
    assert imported("plain_probe.py") != (package / "__init__.py").resolve()
