"""Rules of the code base that a reader should be able to rely on, checked on the source itself."""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "diffrelay"
MODULES = sorted(SRC.rglob("*.py"))  # sub-packages (nets/) follow the same rules


def test_only_distributed_py_knows_about_ranks():
    for path in MODULES:
        if path.name == "distributed.py":
            continue
        text = path.read_text()
        assert not re.search(r"torch\.distributed\b(?!\w)", text.replace("DistributedDataParallel", "")), path.name
        assert not re.search(r"""environ(\.get)?\s*[\[(]\s*["'](RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR)""", text), \
            path.name


def test_every_torch_load_is_weights_only():
    for path in MODULES:
        for call in re.findall(r"torch\.load\([^)]*\)", path.read_text()):
            assert "weights_only=True" in call, f"{path.name}: {call}"
        assert "weights_only=False" not in path.read_text(), path.name


def test_layout_covers_the_networks_package():
    names = {p.relative_to(SRC).as_posix() for p in MODULES}
    assert {"nets/__init__.py", "nets/registry.py", "nets/unet.py", "nets/dit.py"} <= names


def test_modules_are_small_and_say_what_they_hold():
    for path in MODULES:
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.name} has no module docstring"
        assert len(path.read_text().splitlines()) <= 420, f"{path.name} is too long"


def test_no_bare_except():
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler):
                assert node.type is not None, f"{path.name}:{node.lineno}: bare except"


def test_no_collective_call_inside_a_rank_condition():
    """`if is_main(): ... barrier()/all_reduce...` is the hang this project exists to avoid."""
    collectives = {"barrier", "all_reduce_sum", "all_reduce", "broadcast"}
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and "is_main" in ast.unparse(node.test):
                for inner in ast.walk(ast.Module(body=node.body + node.orelse, type_ignores=[])):
                    if isinstance(inner, ast.Call):
                        name = ast.unparse(inner.func).rsplit(".", 1)[-1]
                        assert name not in collectives, f"{path.name}:{inner.lineno}: {name} under is_main()"
