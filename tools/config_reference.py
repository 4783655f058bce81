"""Render docs/config.md, the configuration reference, from src/diffrelay/config.schema.yaml.

  python tools/config_reference.py            # write docs/config.md
  python tools/config_reference.py --check    # exit 1 if docs/config.md is out of date

The schema is the one source: every key, type, default and description comes from it, so the page
cannot drift from what the code accepts (tests/test_config_reference.py runs the check).
"""

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "src" / "diffrelay" / "config.schema.yaml"
OUT = REPO / "docs" / "config.md"


def type_text(node: dict) -> str:
    """A short human form of a schema node's type: `integer ≥ 1`, `cpu | cuda | auto`, `list of number`."""
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    if "enum" in node:
        return " | ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    for key in ("oneOf", "anyOf"):
        if key in node:
            return " or ".join(type_text(alt) for alt in node[key])
    kind = node.get("type", "any")
    kind = " or ".join(kind) if isinstance(kind, list) else kind
    if kind == "array" and isinstance(node.get("items"), dict):
        kind = f"list of {type_text(node['items'])}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict) and "properties" not in node:
        kind = f"mapping to {type_text(node['additionalProperties'])}"
    bounds = [f"≥ {node['minimum']}" if "minimum" in node else "", f"> {node['exclusiveMinimum']}"
              if "exclusiveMinimum" in node else "", f"≤ {node['maximum']}" if "maximum" in node else "",
              f"< {node['exclusiveMaximum']}" if "exclusiveMaximum" in node else "",
              f"matching `{node['pattern']}`" if "pattern" in node else ""]
    return " ".join([kind, *[b for b in bounds if b]])


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def rows(node: dict, prefix: str):
    """(dotted key, node) for every property below `node`, depth first in schema order."""
    for key, child in node.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        yield path, child
        if child.get("type") == "object" and "properties" in child:
            yield from rows(child, path)


def render(schema: dict) -> str:
    lines = ["# Configuration reference", "",
             "Generated from `src/diffrelay/config.schema.yaml` by `python tools/config_reference.py`; do not edit "
             "by hand (a test fails when it is out of date). `config/config.yaml` is the commented demo config; "
             "[runs.md](runs.md) says how config files are layered.", ""]
    if schema.get("description"):
        lines += [cell(schema["description"]), ""]
    for section, node in schema["properties"].items():
        lines += [f"## {section}", ""]
        if node.get("description"):
            lines += [cell(node["description"]), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for path, child in rows(node, section):
            default = f"`{json.dumps(child['default'])}`" if "default" in child else "(required)"
            lines.append(f"| `{path}` | {cell(type_text(child))} | {cell(default)} | "
                         f"{cell(child.get('description', ''))} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/config.md differs from the schema's")
    args = ap.parse_args(argv)
    text = render(yaml.safe_load(SCHEMA.read_text()))
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"config_reference: {OUT.relative_to(REPO)} is out of date; run "
                  "`python tools/config_reference.py`", file=sys.stderr)
            return 1
        return 0
    sys.path.insert(0, str(REPO / "src"))
    from diffrelay import io

    io.write_text(OUT, text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
