"""Config rules for the keys that name files and folders (run.results, run.resources, data.path, data.val_path,
sample.guide, fid.reference, ...): values the schema's `string` lets through but a folder name or a command line cannot take.
Each problem is a (key, message) pair; config.validate reports the first. Also where a run's folder is (run_dir).

Imports nothing of diffrelay: the Snakefile reads it at parse time.
"""

import json
from pathlib import Path

# Keys whose string value is a path (sample.guide may be a step, fid.reference a mapping: only strings count).
PATH_KEYS = (("run", "results"), ("run", "resources"), ("data", "path"), ("data", "val_path"),
             ("data", "encoder_path"), ("sample", "snapshot"), ("sample", "guide"), ("fid", "extractor"))


def _paths(d: dict):
    """(key, value) of every string the config gives as a path."""
    for section, key in PATH_KEYS:
        yield f"{section}.{key}", d[section][key]
    fid = d["fid"]
    for name in fid["extractors"] or []:
        yield "fid.extractors", name
    ref = fid["reference"]
    for name, value in ref.items() if isinstance(ref, dict) else [(None, ref)]:
        yield "fid.reference" + (f".{name}" if name else ""), value


def check_paths(d: dict) -> list[tuple[str, str]]:
    """A control character anywhere, or a leading '-', in a path of the config (defaults filled)."""
    bad = []
    for key, value in _paths(d):
        if not isinstance(value, str):
            continue
        shown = f"{key}={json.dumps(value, ensure_ascii=False)}"  # escaped: the error stays one line
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            # A newline became part of the run's folder names and of every job's command.
            bad.append((shown, "holds a control character (a newline, a tab, ...), which would become part of "
                        "folder names and commands; remove it"))
        elif value.startswith("-"):
            # The workflow's jobs pass paths to diffrelay's commands, whose parser reads '-rf' as an option.
            bad.append((shown, f"starts with '-', which a command line reads as an option; write ./{value} "
                        "or an absolute path"))
    return bad


def run_dir(cfg) -> Path:
    return Path(cfg.run.results) / cfg.run.name


