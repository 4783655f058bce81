"""`diffrelay validate`: check a config and print it with defaults filled in."""

import yaml

from diffrelay import config, preflight


def main(args) -> int:
    cfg = config.load(args.config)
    preflight.check(cfg, ", ".join(args.config))
    print(f"# merged from {', '.join(args.config)} (later files win; schema defaults fill the rest)")
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0
