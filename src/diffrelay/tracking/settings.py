"""The `track` section: whether a tracker is configured, the parse-time check of W&B credentials, the run's
stable tracker id and display name, and the config a tracker is sent (private by default).

Plain Python (no wandb, no mlflow, no torch): preflight reads it at Snakefile parse time.
"""

import configparser
import hashlib
import json
import netrc
import os
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

TRACKERS = ("wandb", "mlflow")
# Versions recorded in the run's config (read from the installed distributions: nothing is imported).
VERSIONS = ("diffrelay", "torch", "torchvision", "diffusers", "transformers", "numpy", "clean-fid", "snakemake")


def trackers(d: dict) -> list[str]:
    """The configured trackers, in a fixed order (W&B first)."""
    track = d.get("track") or {}
    return [t for t in TRACKERS if track.get(t) is not None]


def wandb_base_url() -> str:
    """WANDB_BASE_URL, else base_url of wandb's settings file (what `wandb login --host` writes), else W&B's."""
    if os.environ.get("WANDB_BASE_URL"):
        return os.environ["WANDB_BASE_URL"]
    folder = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(folder / "settings")
        return parser.get("default", "base_url", fallback="") or "https://api.wandb.ai"
    except (OSError, configparser.Error):
        return "https://api.wandb.ai"


def wandb_host() -> str:
    return urlparse(wandb_base_url()).hostname or "api.wandb.ai"


def has_wandb_credentials() -> bool:
    """WANDB_API_KEY, or a ~/.netrc (or $NETRC) entry for the W&B host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return netrc.netrc(str(path)).authenticators(wandb_host()) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_config(d: dict) -> list[tuple[str, str]]:
    """(key, message) pairs: an online W&B run needs credentials on the machine that publishes (the submit host)."""
    w = (d.get("track") or {}).get("wandb")
    if w is not None and w.get("mode") == "online" and not has_wandb_credentials():
        return [("track.wandb.mode=online", f"no W&B credentials here (WANDB_API_KEY is unset and ~/.netrc has no "
                 f"{wandb_host()} entry); run `wandb login` on this machine, or use mode: offline and "
                 "`wandb sync` the run later (docs/runs.md)")]
    return []


def run_id(name: str, trajectory: str, created: str = "") -> str:
    """One tracker run per run folder: derived from its name, trajectory and run.json's creation time
    (`created`), the same in every job of the folder; a new folder (deleted and started again, or another
    user's copy of the same config) is a new tracker run."""
    return hashlib.sha256(f"diffrelay:{name}:{trajectory}:{created}".encode()).hexdigest()[:16]


def section_digest(d: dict) -> str:
    """Digest of the track section: a param of the track rules, so changing it reruns them (cheap: the ledger
    sends only what the new settings have not had)."""
    return hashlib.sha256(json.dumps(d.get("track"), sort_keys=True).encode()).hexdigest()[:16]


def created(run_dir: Path) -> str:
    """run.json's `created` time (preflight.write_run_record), '' before the run folder has one."""
    try:
        value = json.loads((Path(run_dir) / "run.json").read_text()).get("created")
    except (OSError, ValueError, AttributeError):
        return ""
    return repr(value) if value is not None else ""


def destination(name: str, cfg: dict) -> str:
    """Digest of where tracker `name` sends (W&B: entity, project, mode; MLflow: tracking URI, experiment):
    a ledger entry holds only for the destination it was sent to."""
    if name == "wandb":
        where = [cfg.get("entity"), cfg.get("project") or "diffrelay", cfg.get("mode") or "offline"]
    else:
        where = [cfg.get("tracking_uri") or "sqlite:///mlflow.db", cfg.get("experiment") or "diffrelay"]
    return hashlib.sha256(json.dumps([name, *where]).encode()).hexdigest()[:16]


def display_name(d: dict, rid: str) -> str:
    """run.name with track.send_names, else a name that says nothing about the run's folder."""
    return d["run"]["name"] if d["track"].get("send_names") else f"diffrelay-{rid[:8]}"


def _looks_like_path(value: str) -> bool:
    return "/" in value or "\\" in value or value.startswith(("~", "."))


def _private(obj):
    """obj without path-like strings (dropped from mappings and lists alike)."""
    if isinstance(obj, dict):
        return {k: _private(v) for k, v in obj.items() if not (isinstance(v, str) and _looks_like_path(v))}
    if isinstance(obj, list):
        return [_private(v) for v in obj if not (isinstance(v, str) and _looks_like_path(v))]
    return obj


def versions() -> dict:
    out = {}
    for dist in VERSIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def run_config(d: dict, trajectory: str, snapshots: dict) -> dict:
    """What a tracker records as the run's config: the resolved config, the trajectory hash, the snapshots'
    sha256 by step and the versions. Without track.send_names no run.name and no path (results, data, extractor
    and reference files ...); the track section itself is never sent (a tracking URI may hold a password)."""
    cfg = {k: v for k, v in d.items() if k != "track"}
    if not d["track"].get("send_names"):
        cfg = _private(cfg)
        cfg["run"] = {k: v for k, v in cfg["run"].items() if k not in ("name", "results", "resources")}
    return {"config": cfg, "trajectory": trajectory, "snapshots_sha256": {str(k): v for k, v in snapshots.items()},
            "versions": versions()}
