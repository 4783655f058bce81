"""docs/config.md is generated from the schema and cannot drift from it."""

import copy
import importlib.util
import json

import yaml

from conftest import REPO

spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools" / "config_reference.py")
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)
SCHEMA = yaml.safe_load((REPO / "src" / "diffrelay" / "config.schema.yaml").read_text())


def every_key(node, prefix=""):
    """(dotted key, property) for every property of the schema, walked here on its own."""
    for key, child in node.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        yield path, child
        yield from every_key(child, path)


def test_docs_config_md_is_what_the_schema_renders():
    assert (REPO / "docs" / "config.md").read_text() == reference.render(SCHEMA), \
        "docs/config.md is out of date: run `python tools/config_reference.py`"
    assert reference.main(["--check"]) == 0


def test_every_key_appears_with_its_default_and_description():
    text = (REPO / "docs" / "config.md").read_text()
    keys = [(path, child) for path, child in every_key(SCHEMA) if "." in path]
    assert len(keys) > 60
    for path, child in keys:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row, path
        if "default" in child:
            assert f"`{json.dumps(child['default'])}`".replace("|", "\\|") in row, path
        assert " ".join(child.get("description", "").split())[:40].replace("|", "\\|") in row, path


def test_a_new_key_changes_the_page():
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["train"]["properties"]["brand_new"] = {"type": "integer", "default": 3,
                                                                "description": "A key added later."}
    page = reference.render(schema)
    assert page != reference.render(SCHEMA)
    assert "| `train.brand_new` | integer | `3` | A key added later. |" in page
