"""`diffrelay validate`: check a config, build its network once without training, print both."""

import json

import yaml

from diffrelay import config, preflight
from diffrelay.errors import UserError


def check_network(cfg: config.Config) -> tuple[int, int]:
    """(parameters, classes) of the configured network, built on the meta device and run once on a tiny
    batch; UserError with one line when it cannot be imported, built or run. The Snakefile calls this too."""
    from diffrelay.nets import registry

    d = cfg.to_dict()
    classes = preflight.num_classes(cfg) if d["model"]["class_conditional"] else 0
    channels, side = preflight.net_geometry(cfg)
    return registry.check(d["model"], side, channels, classes, d["train"]["activation_checkpointing"]), classes


def main(args) -> int:
    cfg = config.load(args.config)
    preflight.check(cfg, ", ".join(args.config))
    try:
        params, classes = check_network(cfg)
    except UserError as e:
        raise UserError(f"{', '.join(map(str, args.config))}: {e}") from e
    print(f"# merged from {', '.join(args.config)} (later files win; schema defaults fill the rest)")
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    m, (channels, side) = cfg.model, preflight.net_geometry(cfg)
    # A YAML comment, so stdout stays a valid config.
    print(f"# network: {m.arch} {json.dumps(dict(m.to_dict()['kwargs']))} at {side}x{side}x{channels}, {classes} classes: "
          f"{params:,} parameters ({params / 1e6:.1f} M)")
    return 0
