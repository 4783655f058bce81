"""What the check_*.py scripts share: writing their figures beside the versions they were measured with."""

import json
import platform
import time
from pathlib import Path

import torch


def write_results(path: Path, what: str, **fields) -> None:
    """benchmarks/results/<name>.json: what was compared, torch, machine and date, then the script's fields."""
    out = {"what": what, "torch": torch.__version__, "machine": platform.machine(),
           "time": time.strftime("%Y-%m-%d"), **fields}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
