"""What the check_*.py scripts share: this tree's diffrelay, writing their figures beside the versions they were
measured with, and the gate that makes each figure fail its script when it leaves its bound.

Every check script imports this module before diffrelay (tests/test_check_scripts.py holds them to it). Importing
it puts this checkout's src/ first on sys.path: the environment's editable install points at one checkout, and a
check run from a second checkout that shares the environment would otherwise compare the first one's diffrelay."""

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout this script belongs to (benchmarks/checks/official.py)
RESULTS = ROOT / "benchmarks" / "results"  # where each check writes its figures
if sys.path[:1] != [str(ROOT / "src")]:
    sys.path.insert(0, str(ROOT / "src"))


def script_command(doc: str, script: str, out: str):
    """The command line of a check against one of diffusers' examples/dreambooth scripts: (its arguments, the
    script's path: --script, else <--diffusers-src>/../examples/dreambooth/<script>)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--diffusers-src", type=Path, required=True, help="the src folder of a diffusers checkout")
    ap.add_argument("--script", type=Path, help=f"{script} (default <src>/../examples/dreambooth/)")
    ap.add_argument("--out", type=Path, default=RESULTS / out)
    a = ap.parse_args()
    return a, a.script or a.diffusers_src.resolve().parent / "examples" / "dreambooth" / script


def write_results(path: Path, what: str, **fields) -> None:
    """benchmarks/results/<name>.json: what was compared, torch, machine and date, then the script's fields."""
    import torch  # here, not at the top: importing this module stays cheap (its sys.path line is tested alone)

    out = {"what": what, "torch": torch.__version__, "machine": platform.machine(),
           "time": time.strftime("%Y-%m-%d"), **fields}
    part = Path(path).with_name(Path(path).name + ".part")  # atomic: a run cut short leaves the last file whole
    part.write_text(json.dumps(out, indent=2) + "\n")
    part.replace(path)
    print(f"wrote {path}")


class Gate:
    """Each compared figure against its bound, stated by the script per case.

    A check script prints figures and writes them to JSON; without a gate a wrong reference or a wrong diffrelay
    would still exit 0 (issue 38: one-line changes to the official code went unnoticed). Every figure goes
    through at_most / at_least / equal; finish() prints one line per figure outside its bound and exits 1.
    NaN is never within a bound."""

    def __init__(self):
        self.rows: list[dict] = []

    def at_most(self, case: str, value: float, bound: float) -> None:
        value = float(value)
        self.rows.append({"case": case, "value": value, "rule": "<=", "bound": bound,
                          "ok": not math.isnan(value) and value <= bound})

    def at_least(self, case: str, value: float, bound: float) -> None:
        """A figure that must be large: a sanity check that a comparison can tell things apart at all."""
        value = float(value)
        self.rows.append({"case": case, "value": value, "rule": ">=", "bound": bound,
                          "ok": not math.isnan(value) and value >= bound})

    def equal(self, case: str, value, expected) -> None:
        """Counts, names and flags: exactly equal."""
        self.rows.append({"case": case, "value": value, "rule": "==", "bound": expected, "ok": value == expected})

    def failures(self) -> list[str]:
        return [f"FAIL {r['case']}: {r['value']!r} not {r['rule']} {r['bound']!r}" for r in self.rows if not r["ok"]]

    def worst(self) -> dict[str, float]:
        """The largest figure of each kind of bounded case (the case name up to its first "/")."""
        out: dict[str, float] = {}
        for row in self.rows:
            if row["rule"] == "<=":
                key = row["case"].split("/")[0]
                out[key] = max(out.get(key, 0.0), row["value"])
        return out

    def to_json(self) -> dict:
        """What the results JSON records: every figure with its bound, and how many failed."""
        return {"failed": len(self.failures()), "checked": len(self.rows), "bounds": self.rows}

    def finish(self, script: str) -> None:
        """One line per failing figure and exit status 1, or one line saying every figure is within its bound.
        A run that compared nothing (every case left out or skipped) fails too: it showed nothing."""
        bad = self.failures()
        for line in bad:
            print(line)
        if bad or not self.rows:
            print(f"{script}: {len(bad)} of {len(self.rows)} figures outside their bounds" if self.rows
                  else f"{script}: nothing was compared")
            sys.exit(1)
        print(f"{script}: all {len(self.rows)} figures within their bounds")
