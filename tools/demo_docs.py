"""Regenerate the demo's figures and table in the docs from a real demo run, so README's numbers are
the numbers a fresh clone gets.

  make demo && .venv/bin/python tools/demo_docs.py          # from results/demo of a finished demo
  .venv/bin/python tools/demo_docs.py --run                 # run the demo first (snakemake --cores 2)

Writes docs/demo-metrics.csv, docs/demo-fid.png and docs/demo-grid.png (the last step's grid, titled with
its step, guidance and EMA), and the table between README's demo-table markers.
"""

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from diffrelay import io

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- demo-table:start -->", "<!-- demo-table:end -->"


def table(metrics: pd.DataFrame, seconds: float | None) -> str:
    """README's demo table: one row per checkpoint of the first pass."""
    rows = metrics[metrics["phema"].isna()] if "phema" in metrics else metrics
    metric = rows["metric"].iloc[0]
    lines = [f"| step | {metric} | KID | mean train loss |", "|---:|---:|---:|---:|"]
    for r in rows.sort_values("step").itertuples():
        lines.append(f"| {r.step} | {r.fid:.3f} | {r.kid:.5f} | {r.train_loss_mean:.3f} |")
    if seconds is not None:
        lines += ["", f"Measured by `tools/demo_docs.py --run`: the demo took {seconds / 60:.1f} min end to end "
                      "(`snakemake --cores 2`) on this project's 2-core CPU machine."]
    return "\n".join(lines)


def replace_between(text: str, body: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"demo_docs: README.md: no {START} ... {END} markers; put them around the demo table")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{body}\n{END}{rest.split(END, 1)[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run the demo workflow first (snakemake --cores 2)")
    ap.add_argument("--run-dir", default=str(REPO / "results" / "demo"), help="a finished demo run folder")
    args = ap.parse_args(argv)
    seconds = None
    if args.run:
        t0 = time.time()
        snakemake = shutil.which("snakemake") or str(Path(sys.executable).parent / "snakemake")
        subprocess.run([snakemake, "--cores", "2"], cwd=REPO, check=True)
        seconds = time.time() - t0
    run_dir = Path(args.run_dir)
    report = run_dir / "report"
    if not (report / "metrics.csv").is_file():
        raise SystemExit(f"demo_docs: {report / 'metrics.csv'}: not found; run `make demo` first (or pass --run)")
    metrics = pd.read_csv(report / "metrics.csv")
    last = int(metrics["step"].max())
    grid = run_dir / "samples" / f"step_{last:07d}" / "grid.png"
    docs = REPO / "docs"
    io.write_bytes(docs / "demo-metrics.csv", (report / "metrics.csv").read_bytes())
    io.write_bytes(docs / "demo-fid.png", (report / "fid.png").read_bytes())
    io.write_bytes(docs / "demo-grid.png", grid.read_bytes())
    readme = REPO / "README.md"
    text = readme.read_text()
    body = table(metrics, seconds)
    if seconds is None and START in text:  # keep the last measured duration: only --run measures one
        kept = [line for line in text.split(START, 1)[1].split(END, 1)[0].splitlines() if line.startswith("Measured by")]
        body += "".join(f"\n\n{line}" for line in kept)
    io.write_text(readme, replace_between(text, body))
    print(f"demo_docs: docs/demo-metrics.csv, docs/demo-fid.png, docs/demo-grid.png (step {last}) and README's table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
