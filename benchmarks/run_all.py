"""Run every benchmark in one go and collect the tables in results/.

    python -m benchmarks.run_all            # full: a few tens of minutes on 2 CPU cores
    python -m benchmarks.run_all --quick    # under 10 minutes; as root the emulated-host benchmarks add a few

The emulated-cluster, compression, dedicated-server, gloo-flow and advisor-validation benchmarks need root (network
namespaces); without it, they are skipped with a note. The accuracy parts of the compression and straggler
benchmarks (`python -m benchmarks.compression --accuracy`, `python -m benchmarks.straggler --accuracy`, about 10 and
6 minutes), the example app's spread (`python -m benchmarks.app_accuracy`, about 15 minutes) and its monitor's
prediction (`python -m benchmarks.monitor_model`, about 4 minutes) run on their own;
their tables are collected if present. Writing to the stored results, it then renders the documents' result
blocks again (``python -m benchmarks.tables``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    quick = ["--quick"] if args.quick else []
    modules = ["benchmarks.collectives", "benchmarks.end_to_end", "benchmarks.straggler", "benchmarks.scale_model"]
    if os.geteuid() == 0:
        modules += ["benchmarks.emulated_cluster", "benchmarks.compression", "benchmarks.dedicated_servers",
                    "benchmarks.gloo_flows", "benchmarks.advisor_validation"]  # fmt: skip
    else:
        print("not root: skipping benchmarks.emulated_cluster, benchmarks.compression, benchmarks.dedicated_servers, "
              "benchmarks.gloo_flows and benchmarks.advisor_validation (network namespaces)")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}  # the repository root, whatever the working directory
    runs = [[module] for module in modules]
    runs.insert(2, ["benchmarks.end_to_end", "--pull"])  # the servers' pull behind the forward: results/end_to_end_sgd
    for run in runs:
        print(f"== {' '.join(run)}", flush=True)
        subprocess.run([sys.executable, "-m", *run, *quick, "--out", args.out], check=True, env=env)
    names = ("collectives", "end_to_end", "end_to_end_sgd", "emulated_cluster", "compression", "compression_accuracy",
             "straggler", "straggler_accuracy", "app_accuracy", "dedicated_servers", "gloo_flows",
             "end_to_end_emulated", "advisor_validation", "monitor_model", "scale_model")  # fmt: skip
    tables = [Path(args.out) / f"{name}.md" for name in names]
    summary = "\n\n".join(t.read_text() for t in tables if t.exists())
    (Path(args.out) / "summary.md").write_text(summary)
    print(f"\nwrote {Path(args.out) / 'summary.md'}")
    if Path(args.out).resolve() == HERE / "results":  # the stored results changed: so do the documents' blocks
        subprocess.run([sys.executable, "-m", "benchmarks.tables"], check=True, env=env)


if __name__ == "__main__":
    main()
