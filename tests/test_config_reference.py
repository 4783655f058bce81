"""docs/config.md is generated from the schema (tools/config_reference.py) and cannot drift from it."""

import copy
import importlib.util
import json
import re

import yaml

from conftest import REPO

spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools" / "config_reference.py")
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)
SCHEMA = yaml.safe_load((REPO / "src" / "diffrelay" / "config" / "schema.yaml").read_text())
PAGE = REPO / "docs" / "config.md"


def every_key(node, prefix=""):
    """(dotted key, property) for every property anywhere in the schema, walked here on its own: inside
    oneOf/anyOf/allOf alternatives (same path) and array items (path + `[]`) too, so a key the generator
    does not reach fails the test below instead of vanishing from the page."""
    for key, child in node.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        yield path, child
        yield from every_key(child, path)
    for combinator in ("oneOf", "anyOf", "allOf"):
        for alt in node.get(combinator, []):
            yield from every_key(alt, prefix)
    if isinstance(node.get("items"), dict):
        yield from every_key(node["items"], f"{prefix}[]")


def table_rows(text):
    """The dotted key of each table row of the page, mapped to the row."""
    return {line.split("`")[1]: line for line in text.splitlines() if line.startswith("| `")}


def cells(row):
    """key, type, default and description of a table row, with `\\|` turned back into `|`."""
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_docs_config_md_is_what_the_schema_renders():
    assert PAGE.read_text() == reference.render(SCHEMA), \
        "docs/config.md is out of date: run `python tools/config_reference.py`"
    assert reference.render(SCHEMA) == reference.render(copy.deepcopy(SCHEMA))  # same bytes every time
    assert reference.main(["--check"]) == 0


def test_every_key_appears_with_its_default_and_description():
    text = PAGE.read_text()
    rows = table_rows(text)
    keys = list(every_key(SCHEMA))
    assert len(keys) > 60 and len(rows) == len(keys), sorted(set(rows) ^ {path for path, _ in keys})
    assert text.startswith("# Configuration reference\n\nGenerated from `src/diffrelay/config/schema.yaml` by "
                           "`python tools/config_reference.py`")
    for path, child in keys:
        assert path in rows, f"{path} is missing from docs/config.md"
        _, type_cell, default_cell, description_cell = cells(rows[path])
        if "default" in child:
            assert default_cell == f"`{json.dumps(child['default'])}`", path
        assert description_cell == " ".join(child.get("description", "").split()), path
        for word in child.get("enum", []):
            assert json.dumps(word) in type_cell, path
        for bounds in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):  # the stricter one shows
            if any(bound in child for bound in bounds):
                assert any(str(child[bound]) in type_cell for bound in bounds if bound in child), (path, bounds)
        if "pattern" in child:
            assert child["pattern"] in type_cell, path
    for section in SCHEMA["properties"]:
        assert f"\n## {section}\n" in text, section


def test_a_new_key_changes_the_page():
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["fid"]["properties"]["final"]["properties"]["brand_new"] = {
        "type": "integer", "minimum": 1, "maximum": 9, "default": 3, "description": "A key added later."}
    page = reference.render(schema)
    assert page != reference.render(SCHEMA)
    assert "| `fid.final.brand_new` | integer in [1, 9] | `3` | A key added later. |" in page


def test_check_names_the_stale_page_and_the_command_in_one_line(tmp_path, monkeypatch, capsys):
    page = tmp_path / "docs" / "config.md"
    monkeypatch.setattr(reference, "REPO", tmp_path)
    monkeypatch.setattr(reference, "OUT", page)
    assert reference.main(["--check"]) == 1  # missing
    page.parent.mkdir()
    page.write_text(reference.render(SCHEMA).replace("| `run.seed` |", "| `run.sed` |"))  # edited by hand
    capsys.readouterr()
    assert reference.main(["--check"]) == 1
    assert capsys.readouterr().err == ("config_reference: docs/config.md is out of date; "
                                       "run `python tools/config_reference.py`\n")
    assert reference.main([]) == 0 and reference.main(["--check"]) == 0
    assert page.read_text() == reference.render(SCHEMA)
    assert [p.name for p in page.parent.iterdir()] == ["config.md"]  # the temp file was renamed, not left
