"""Reading a YAML config file safely: a size limit, YAML 1.2 numbers, repeated keys and alias bombs refused.

Imports the base modules only (errors, io).
"""

import re
from pathlib import Path

import yaml

from diffrelay.errors import UserError

MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML; anything bigger is a wrong path
MAX_CONFIG_VALUES = 100_000  # values after YAML aliases are expanded (a "billion laughs" file stops here)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with two YAML 1.2 habits: 1e-3 is a number, and a repeated key is an error.

    PyYAML follows YAML 1.1, which reads `lr: 1e-3` as a string and lets a repeated key silently replace
    the first one (a whole section can vanish that way)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line):
        super().__init__(f"key {key!r} appears twice (again at line {line})")
        self.key, self.line = key, line


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *defaults` may be overridden by the keys beside it
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise DuplicateKey(key, key_node.start_mark.line + 1)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _expanded_size(obj, memo=None) -> int:
    """How many values `obj` holds once shared (aliased) parts are counted every time they are used."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
    memo[id(obj)] = 1  # a self-referencing alias counts once instead of recursing forever
    memo[id(obj)] = 1 + sum(_expanded_size(v, memo) for v in items)
    return memo[id(obj)]


def read_yaml(path) -> dict:
    path = Path(path)
    from diffrelay import io  # io imports errors only; kept local so the Snakefile's import stays light

    io.check_regular_file(path, MAX_CONFIG_BYTES, what="config file", missing="pass an existing YAML file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read config ({e})") from e
    try:
        d = yaml.load(text, Loader=_Loader)  # noqa: S506 -- _Loader is a SafeLoader
    except DuplicateKey as e:
        raise UserError(f"{path}: {e}; YAML keeps only the last one, so delete or merge the duplicate") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML{where}; fix the syntax") from e
    if _expanded_size(d) > MAX_CONFIG_VALUES:
        raise UserError(f"{path}: YAML aliases expand to more than {MAX_CONFIG_VALUES} values; "
                        "write the settings out instead of nesting aliases")
    return {} if d is None else d
