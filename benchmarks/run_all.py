"""Run every benchmark in one go and collect the tables in results/.

    python benchmarks/run_all.py            # full: a few tens of minutes on 2 CPU cores
    python benchmarks/run_all.py --quick    # under 5 minutes

The emulated-cluster benchmark needs root (network namespaces); without it, it is skipped with a note.
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
    scripts = ["collectives.py", "end_to_end.py"]
    if os.geteuid() == 0:
        scripts.append("emulated_cluster.py")
    else:
        print("not root: skipping emulated_cluster.py (it creates network namespaces)")
    for script in scripts:
        print(f"== {script}", flush=True)
        subprocess.run([sys.executable, str(HERE / script), *quick, "--out", args.out], check=True)
    tables = [Path(args.out) / f"{name}.md" for name in ("collectives", "end_to_end", "emulated_cluster")]
    summary = "\n\n".join(t.read_text() for t in tables if t.exists())
    (Path(args.out) / "summary.md").write_text(summary)
    print(f"\nwrote {Path(args.out) / 'summary.md'}")


if __name__ == "__main__":
    main()
