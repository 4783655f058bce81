"""Run every benchmark in turn; each prints its table and writes benchmarks/results/<name>.json."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["bench_train.py", "bench_scale.py", "bench_sample.py", "bench_fid.py", "bench_workflow.py"]

if __name__ == "__main__":
    failed = []
    for name in SCRIPTS:
        print(f"== {name}", flush=True)
        if subprocess.run([sys.executable, str(HERE / name)]).returncode:
            failed.append(name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
