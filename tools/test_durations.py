"""Record how long each test took, for the test scheduler in tests/conftest.py and for `make test-fast`.

  .venv/bin/pytest -n 2 --dist loadgroup --junitxml=/tmp/tests.xml      # make test's run, with a report
  python tools/test_durations.py /tmp/tests.xml                          # write tests/durations.json
  python tools/test_durations.py /tmp/tests.xml --table                  # also print seconds per test file
  python tools/test_durations.py /tmp/tests.xml /tmp/slurm.xml           # several reports (make test's two runs)

tests/durations.json maps each test's node id to its seconds (setup, call and teardown) in that run. The
conftest hands the longest tests out first and marks those at SLOW_SECONDS or more `slow`, which
`make test-fast` leaves out. A test missing from the file counts as fast, so a new test runs in test-fast
until the file is written again; nothing fails when the file is stale.
"""

import argparse
import collections
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "durations.json"


def read_junit(path) -> dict[str, float]:
    """{node id: seconds} of every test case in a pytest --junitxml report (its default "total" durations)."""
    out = {}
    for case in ET.parse(path).iter("testcase"):
        module, name = case.get("classname", "").replace(".", "/"), case.get("name", "")
        if name.rfind("@") > name.rfind("]"):  # --dist loadgroup's "@group" suffix
            name = name[:name.rfind("@")]
        out[f"{module}.py::{name}"] = round(float(case.get("time") or 0), 1)
    return out


def by_file(durations: dict[str, float]) -> dict[str, float]:
    files = collections.Counter()
    for node, seconds in durations.items():
        files[node.partition("::")[0]] += seconds
    return dict(files.most_common())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("junit", nargs="+", help="pytest --junitxml reports")
    p.add_argument("--out", default=str(OUT), help=f"JSON to write [{OUT.relative_to(REPO)}]")
    p.add_argument("--table", action="store_true", help="print a markdown table of seconds per test file")
    args = p.parse_args(argv)
    durations = dict(sorted({k: v for path in args.junit for k, v in read_junit(path).items()}.items()))
    if not durations:
        print(f"{' '.join(args.junit)}: no test cases", file=sys.stderr)
        return 1
    tmp = Path(args.out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(durations, indent=0) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(durations)} tests, {sum(durations.values()):.0f} s in all")
    if args.table:
        print("| file | tests | seconds |\n|---|---:|---:|")
        count = collections.Counter(node.partition("::")[0] for node in durations)
        for name, seconds in by_file(durations).items():
            print(f"| `{name}` | {count[name]} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
