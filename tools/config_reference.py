"""Render docs/config.md, the configuration reference, from src/diffrelay/config/schema.yaml.

  python tools/config_reference.py            # write docs/config.md (make docs)
  python tools/config_reference.py --check    # exit 1 if docs/config.md is out of date

The schema is the one source: every key, type, default and description comes from it, so the page
cannot drift from what the code accepts (tests/test_config_reference.py renders and compares).
"""

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
SCHEMA = SRC / "diffrelay" / "config" / "schema.yaml"
OUT = REPO / "docs" / "config.md"
COMMAND = "python tools/config_reference.py"


# --- one schema node as a short type: `integer in [1, 64]`, `"auto" | "cpu"`, `list of string (unique) or null`
def literal(value) -> str:
    return f"`{json.dumps(value)}`"


def number_range(node: dict) -> str:
    """`in [0, 1)`, `> 0`, `≤ 10`: the bounds of a number; an exclusive bound wins a tie with an inclusive one."""
    low, high = node.get("minimum"), node.get("maximum")
    low_open = "exclusiveMinimum" in node and (low is None or node["exclusiveMinimum"] >= low)
    high_open = "exclusiveMaximum" in node and (high is None or node["exclusiveMaximum"] <= high)
    low = node["exclusiveMinimum"] if low_open else low
    high = node["exclusiveMaximum"] if high_open else high
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '≥'} {low}"
    if high is not None:
        return f" {'<' if high_open else '≤'} {high}"
    return ""


def count(node: dict, low_key: str, high_key: str, unit: str) -> list[str]:
    """`1 to 8 items`, `at least 1 item`, `at most 32 items`: a length bound, if the node has one."""
    low, high = node.get(low_key), node.get(high_key)
    if low is not None and high is not None:
        text, n = (f"{low} to {high}", high) if low != high else (f"exactly {low}", low)
    elif low is not None:
        text, n = f"at least {low}", low
    elif high is not None:
        text, n = f"at most {high}", high
    else:
        return []
    return [f"{text} {unit}{'' if n == 1 else 's'}"]


def kind_text(kind: str, node: dict) -> str:
    """One JSON type of `node` with the keywords that apply to it (a nullable integer keeps its range)."""
    notes = []
    if kind in ("integer", "number"):
        text = kind + number_range(node)
    elif kind == "string":
        text = "string" + (f" matching `{node['pattern']}`" if "pattern" in node else "")
        notes = count(node, "minLength", "maxLength", "character")
        if notes == ["at least 1 character"]:
            text, notes = f"non-empty {text}", []
    elif kind == "array":
        text = f"list of {type_text(node['items'])}" if isinstance(node.get("items"), dict) else "list"
        notes = count(node, "minItems", "maxItems", "item") + (["unique"] if node.get("uniqueItems") else [])
    elif kind == "object" and isinstance(node.get("additionalProperties"), dict) and "properties" not in node:
        text = f"mapping to {type_text(node['additionalProperties'])}"
        notes = count(node, "minProperties", "maxProperties", "entry")
    else:
        text = kind
    return text + (f" ({', '.join(notes)})" if notes else "")


def type_text(node: dict) -> str:
    if "const" in node:
        return literal(node["const"])
    if "enum" in node:
        return " | ".join(literal(v) for v in node["enum"])
    for key in ("oneOf", "anyOf"):
        if key in node:
            return " or ".join(type_text(alt) for alt in node[key])
    kinds = node.get("type", "any")
    return " or ".join(kind_text(kind, node) for kind in (kinds if isinstance(kinds, list) else [kinds]))


# --- the page: one section per top-level key, one table row per key below it, in schema order
def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def rows(parent: dict, prefix: str):
    """(dotted key, node, required) for every property below `parent`, depth first in schema order.

    Properties inside oneOf/anyOf/allOf alternatives keep their parent's path; an array's items add `[]`."""
    for key, child in parent.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        yield path, child, key in parent.get("required", [])
        yield from nested(child, path)


def nested(node: dict, path: str):
    yield from rows(node, path)
    for key in ("oneOf", "anyOf", "allOf"):
        for alt in node.get(key, []):
            yield from nested(alt, path)
    if isinstance(node.get("items"), dict):
        yield from nested(node["items"], f"{path}[]")


def row(path: str, node: dict, required: bool) -> str:
    default = literal(node["default"]) if "default" in node else ("required" if required else "none")
    return f"| `{path}` | {cell(type_text(node))} | {cell(default)} | {cell(node.get('description', ''))} |"


def render(schema: dict) -> str:
    lines = ["# Configuration reference", "",
             f"Generated from `src/diffrelay/config/schema.yaml` by `{COMMAND}` (`make docs`); do not edit by "
             "hand, a test fails when it is out of date. `config/config.yaml` is the commented demo config; "
             "[runs.md](runs.md) says how config files are layered.", ""]
    if schema.get("description"):
        lines += [cell(schema["description"]), ""]
    for section, node in schema["properties"].items():
        lines += [f"## {section}", "", "| key | type | default | description |", "|---|---|---|---|",
                  row(section, node, section in schema.get("required", []))]
        lines += [row(*r) for r in nested(node, section)] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/config.md differs from what would be written")
    args = ap.parse_args(argv)
    text = render(yaml.safe_load(SCHEMA.read_text()))
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"config_reference: {OUT.relative_to(REPO)} is out of date; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))  # run as a script without the package installed
    from diffrelay import io  # temp file in docs/, fsync, os.replace: a reader never sees half a page

    io.write_text(OUT, text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
