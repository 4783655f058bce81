"""Rules of the code base that a reader should be able to rely on, checked on the source itself."""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "diffrelay"
MODULES = sorted(SRC.rglob("*.py"))  # sub-packages (nets/) follow the same rules


# torch's sharding engine itself (fully_shard, DTensor, torch.distributed.checkpoint): they call its APIs, and still
# take ranks and the world size from distributed.py.
SHARDING = {"training/sharding.py", "training/sharded_checkpoint.py"}


def test_only_distributed_py_knows_about_ranks():
    for path in MODULES:
        if path.name == "distributed.py" or path.relative_to(SRC).as_posix() in SHARDING:
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


# What each package may import besides the base modules and itself (its __init__ says the same). Library
# code never reads the config: only a stage's entry module (one with `main`) imports the config package.
BASE = {"errors", "io", "logs"}
ALLOWED = {
    "runtime": set(),
    "text": {"runtime"},
    "families": set(),  # one module a pipeline family; the rest asks them (families/__init__.py)
    "nets": {"text", "families"},
    "objectives": {"nets", "text"},
    "data": {"runtime", "nets", "objectives", "text"},
    "evaluation": {"runtime", "data", "text"},
    "pretrained": {"families", "nets", "objectives", "text"},
    "training": {"runtime", "families", "nets", "objectives", "data", "text", "pretrained"},
    "sampling": {"runtime", "families", "nets", "objectives", "data", "training", "text", "pretrained"},
    "tracking": {"runtime", "evaluation"},
}
# The config package is the front: its rules call each concern's own checks, so it may import every library
# package (and the YAML reader); no library package imports it (FRONT), and it imports no torch at module level
# outside `memory.py` (test_the_config_package_imports_no_torch_at_module_level).
ALLOWED["config"] = set(ALLOWED) | {"yamlfile"}
FRONT = {"config"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """diffrelay modules `path` imports anywhere in the file (in functions too), relative to the package."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "diffrelay":
            base = node.module.removeprefix("diffrelay").lstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}".lstrip(".")
                out.add(sub if sub in known else base)
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("diffrelay.") for a in node.names if a.name.startswith("diffrelay.")}
    return {m for m in out if m}


def import_graph() -> dict[str, set[str]]:
    known = {module_name(p) for p in MODULES}
    return {module_name(p): imports_of(p, known) - {module_name(p)} for p in MODULES}


def test_no_import_circles():
    graph, done, stack = import_graph(), set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_each_package_imports_only_what_its_folder_allows():
    known = {module_name(p) for p in MODULES}  # import_graph()'s keys, without parsing every module per module
    for path in MODULES:
        name = module_name(path)
        package = name.split(".")[0]
        imported = {m.split(".")[0] for m in imports_of(path, known)} - {package}
        if name in BASE:
            assert imported <= BASE, f"{name} is a base module and imports {imported - BASE}"
        if package not in ALLOWED:
            continue
        is_stage = "def main(" in path.read_text()
        allowed = BASE | ALLOWED[package] | (FRONT if is_stage else set())
        assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}; {package}/ may import {sorted(allowed)}"


def test_the_config_package_imports_no_torch_at_module_level():
    """The Snakefile reads the config at parse time: `diffrelay validate`'s memory lines alone need torch."""
    for path in sorted((SRC / "config").glob("*.py")):
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        if path.name != "memory.py":
            assert not any(n.split(".")[0] == "torch" for n in names), path.name


def test_every_package_says_what_it_may_import():
    for package in ALLOWED:
        doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text()))
        assert doc and "Imports" in doc, package


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


PENDING: set = set()  # (file, what) pairs allowed for now; none


def test_no_module_imports_another_modules_underscore_names():
    """If another module needs a name, it is public: no `from diffrelay.x import _y`, no `x._y` on a diffrelay
    module (dunder names such as __version__ aside)."""
    known = {"diffrelay." + module_name(p) if module_name(p) else "diffrelay" for p in MODULES} | {"diffrelay"}

    def private(name):
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found = set()
    for path in MODULES:
        rel, me = path.relative_to(SRC).as_posix(), ".".join(["diffrelay", module_name(path)]).rstrip(".")
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        tree, aliases = ast.parse(path.read_text()), {}  # local name -> diffrelay module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..data import y
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != "diffrelay":
                    continue
                for a in node.names:
                    if private(a.name):
                        found.add((rel, f"from {base} import {a.name}"))
                    if f"{base}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "diffrelay":
                        aliases[a.asname or "diffrelay"] = a.name if a.asname else "diffrelay"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                chain = ast.unparse(node.value).split(".")  # diffrelay.sampling.folder, folder, ...
                if chain[0] in aliases and all(part.isidentifier() for part in chain):
                    module = ".".join([aliases[chain[0]], *chain[1:]])
                    if module in known and module != me:
                        found.add((rel, f"{chain[-1]}.{node.attr}"))
    assert not found - PENDING, "underscore names used across modules (make them public, or move the work " \
        f"into the module that owns them): {sorted(found - PENDING)}"
