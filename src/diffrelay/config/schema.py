"""The schema and loading: read YAML files, fill the schema's defaults, check every key and the rules across keys
(rules.py), freeze the result. Imports only yaml and jsonschema at module level, so the Snakefile can use it."""

import copy
import functools
import json
import math
from importlib import resources
from pathlib import Path

import jsonschema
import yaml

from diffrelay import pretrained
from diffrelay.config import rules
from diffrelay.yamlfile import read_yaml
from diffrelay.errors import UserError

SCHEMA_FILE = "schema.yaml"


@functools.cache  # parsed once a process, by libyaml where PyYAML has it (5 ms, not 55); callers only read it
def load_schema() -> dict:
    text = resources.files("diffrelay.config").joinpath(SCHEMA_FILE).read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


class Config:
    """A read-only view of a validated config dict: `cfg.train.batch_size`."""

    __slots__ = ("_d",)

    def __init__(self, d: dict):
        object.__setattr__(self, "_d", d)

    def __getattr__(self, key):
        try:
            v = self._d[key]
        except KeyError:
            raise AttributeError(key) from None
        return Config(v) if isinstance(v, dict) else (tuple(v) if isinstance(v, list) else v)

    def __setattr__(self, key, value):
        raise AttributeError("Config is read-only")

    def to_dict(self) -> dict:
        return copy.deepcopy(self._d)

    def __eq__(self, other):
        return isinstance(other, Config) and self._d == other._d

    def __repr__(self):
        return f"Config({json.dumps(self._d, sort_keys=True)})"


def _is_strict_integer(checker, instance) -> bool:
    # JSON Schema counts 6.0 as an integer; refuse it, since range() and step arithmetic need real ints.
    return isinstance(instance, int) and not isinstance(instance, bool)


@functools.cache
def _filling_validator():
    # Same idea as snakemake.utils.validate(set_default=True): fill each property's default, then descend.
    base = jsonschema.Draft202012Validator
    base = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", _is_strict_integer))

    def properties(validator, props, instance, schema):
        if isinstance(instance, dict):
            for key, sub in props.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from base.VALIDATORS["properties"](validator, props, instance, schema)

    return jsonschema.validators.extend(base, {"properties": properties})


def _key_path(err) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top level)"


def _explain(err) -> str:
    """One line for a jsonschema error: where, what was found, what is allowed."""
    if err.validator == "anyOf" and isinstance(err.instance, dict):  # a section or null (track.wandb): the section's
        err = next((e for e in err.context if e.validator != "type"), err)
    where = _key_path(err)
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        name = ".".join(filter(None, [where if where != "(top level)" else "", extra[0]]))
        return f"{name}: unknown key; allowed here: {', '.join(allowed)}"
    value = json.dumps(err.instance)
    if len(value) > 60:
        value = value[:57] + "..."
    if err.validator == "type":
        want = err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
        return f"{where}={value}: wrong type; expected {want}"
    if err.validator == "enum":
        return f"{where}={value}: not allowed; choose one of {', '.join(map(str, err.validator_value))}"
    if err.validator in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        words = {"minimum": "at least", "exclusiveMinimum": "greater than",
                 "maximum": "at most", "exclusiveMaximum": "less than"}[err.validator]
        return f"{where}={value}: must be {words} {err.validator_value}"
    if err.validator in ("minLength", "maxLength", "minItems", "maxItems"):
        if err.validator.startswith("min") and err.validator_value == 1:
            return f"{where}={value}: must not be empty"
        words = "at least" if err.validator.startswith("min") else "at most"
        unit = "characters" if err.validator.endswith("Length") else "items"
        return f"{where}={value}: must have {words} {err.validator_value} {unit}"
    if err.validator == "oneOf":
        return f"{where}={value}: not one of the allowed forms; see its description in config/config.yaml"
    if err.validator == "pattern":
        return (f"{where}={value}: must start with a letter or digit, then only letters, digits, '.', '_' and '-' "
                "(no spaces or shell characters)")
    return f"{where}={value}: {err.message}"



def non_finite(d, prefix="") -> str | None:
    """The first key holding NaN or an infinity (YAML's .nan, .inf), which every schema bound lets through."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        path = f"{prefix}.{k}" if prefix and isinstance(k, str) else f"{prefix}[{k}]" if prefix else str(k)
        if isinstance(v, float) and not math.isfinite(v):
            return f"{path}={v}"
        found = non_finite(v, path)
        if found:
            return found
    return None


def validate(raw: dict, source: str = "config") -> dict:
    """Return a new dict with defaults filled, or raise UserError naming the source, key, value and fix."""
    if not isinstance(raw, dict):
        raise UserError(f"{source}: the config must be a mapping of sections (run, data, model, train, sample, fid)")
    bad_number = non_finite(raw)
    if bad_number:
        raise UserError(f"{source}: {bad_number}: not a finite number; write a real number")
    d = copy.deepcopy(raw)
    errors = sorted(_filling_validator()(load_schema()).iter_errors(d), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        # Report the first problem only: one actionable line beats a wall of text.
        raise UserError(f"{source}: {_explain(errors[0])}")
    bad = pretrained.expand(d) or rules.check(d, load_schema())  # model.pretrained's keys first (docs/pretrained.md)
    if bad:
        key, msg = bad[0]
        raise UserError(f"{source}: {key}: {msg}")
    return d


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def merged(paths) -> dict:
    """One or more YAML files, later ones over earlier ones, as written (no defaults filled, not validated)."""
    out: dict = {}
    for p in [paths] if isinstance(paths, (str, Path)) else list(paths):
        d = read_yaml(p)
        if not isinstance(d, dict):
            raise UserError(f"{p}: the config must be a mapping of sections (run, data, model, train, sample, fid)")
        out = _merge(out, d)
    return out


def load(paths, overrides: dict | None = None) -> Config:
    """Read one or more YAML files (later ones override earlier ones), validate, freeze."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    merged_ = merged(paths)
    if overrides:
        merged_ = _merge(merged_, overrides)
    return Config(validate(merged_, source=", ".join(map(str, paths)) or "config"))


