"""`diffrelay validate`: check a config, build its network once without training, print both."""

import json
from pathlib import Path

import yaml

from diffrelay import config
from diffrelay.errors import UserError


def expected_classes(d: dict) -> tuple[int, str]:
    """(classes the network will be built for, where that number comes from), before or after `prepare`."""
    if not d["model"]["class_conditional"]:
        return 0, "unconditional"
    info = Path(d["run"]["results"]) / d["run"]["name"] / "dataset" / "dataset.json"
    try:
        return int(json.loads(info.read_text())["num_classes"]), str(info)
    except (OSError, ValueError, KeyError):
        pass
    if d["data"]["kind"] == "shapes":
        from diffrelay.datasets import SHAPE_NAMES

        return len(SHAPE_NAMES), "the shapes dataset"
    root = Path(d["data"]["path"])
    subdirs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    return len(subdirs), f"subfolders of {root}"


def check_network(cfg: config.Config) -> tuple[int, int]:
    """(parameters, classes) of the configured network, built on the meta device and run once on a tiny
    batch; UserError with one line when it cannot be imported, built or run. The Snakefile calls this too."""
    from diffrelay.nets import registry

    d = cfg.to_dict()
    classes, _ = expected_classes(d)
    res = d["data"]["resolution"]
    return registry.check(d["model"], res, 3, classes if d["model"]["class_conditional"] else 0), classes


def main(args) -> int:
    cfg = config.load(args.config)
    try:
        params, classes = check_network(cfg)
    except UserError as e:
        raise UserError(f"{', '.join(map(str, args.config))}: {e}") from e
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    m, res = cfg.model, cfg.data.resolution
    # A YAML comment, so stdout stays a valid config.
    print(f"# network: {m.arch} {json.dumps(dict(m.to_dict()['kwargs']))} at {res}x{res}x3, {classes} classes: "
          f"{params:,} parameters ({params / 1e6:.1f} M)")
    return 0
