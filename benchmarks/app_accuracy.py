"""The spread of the example app's test accuracy over repeated runs: ``python examples/train.py`` as the README shows
it, synchronous, bounded-staleness and asynchronous.

    python -m benchmarks.app_accuracy             # 6 runs per setting (about 20 minutes on 2 cores)
    python -m benchmarks.app_accuracy --runs 3

A synchronous run is the same from run to run; with ``staleness`` the order in which the servers apply the
workers' gradients follows the processes' timing, so the final accuracy varies. The rows hold every run's test
accuracy (rank 0, after the last epoch's flush) and the staleness it saw; the table gives the least, the median and
the most. ``tests/test_hydra_app.py`` asserts a bound under the least of them: results/app_accuracy.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.report import save
from tests.helpers.launch import kill_process_tree

REPO = Path(__file__).resolve().parent.parent
#: setting name -> the app's overrides (the README's commands)
SETTINGS = {
    "sync": ["strategy=sharded_ps", "trainer.devices=4"],
    "SSP k=4": ["strategy=sharded_ps", "strategy.staleness=4", "trainer.devices=4"],
    "async": ["strategy=sharded_ps", "strategy.staleness=null", "trainer.devices=4"],
}


def run_app(overrides: list[str], timeout: float) -> dict:
    """One run of ``examples/train.py overrides`` in a folder of its own; its ``metrics.json``."""
    with tempfile.TemporaryDirectory(prefix="lddp-app-") as tmp:
        command = [sys.executable, str(REPO / "examples" / "train.py"), *overrides, f"hydra.run.dir={tmp}/run"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            output = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            kill_process_tree(proc.pid)
            raise RuntimeError(f"{' '.join(overrides)} timed out after {timeout} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(overrides)} exited with {proc.returncode}:\n{output[-3000:]}")
        return json.loads((Path(tmp) / "run" / "metrics.json").read_text())


def app_machine(rows: list[dict], training: str, measured: str) -> str:
    """The ``Machine: ...`` line of a table of the app's repeated runs (``rows`` with a ``run`` index each):
    ``training`` says how the app trained, ``measured`` what the table holds."""
    runs = max(r["run"] for r in rows) + 1
    machine = f"{os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}"
    return (f"Machine: {machine}; `python examples/train.py` with the overrides below ({training}), {runs} runs per "
            f"setting; {measured}")  # fmt: skip


def report(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first)."""
    lines = [
        app_machine(
            rows, "reference CNN, Adam, 10 epochs on the bundled digits", "test accuracy on rank 0 after the last epoch"
        ),  # fmt: skip
        "",
        "| setting | overrides | runs | least | median | most | max staleness seen |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["setting"] for r in rows):
        of_setting = [r for r in rows if r["setting"] == name]
        accuracies = [r["test_acc"] for r in of_setting]
        staleness = max(r["staleness_max"] for r in of_setting)
        lines.append(
            f"| {name} | `{' '.join(of_setting[0]['overrides'])}` | {len(accuracies)} | "
            f"{100 * min(accuracies):.1f} % | "
            f"{100 * statistics.median(accuracies):.1f} % | {100 * max(accuracies):.1f} % | {staleness} |"
        )
    return lines


def app_runs(
    description: str, settings: dict[str, list[str]], default_runs: int
) -> tuple[argparse.Namespace, Iterator[tuple[str, list[str], int, dict]]]:
    """The command line of a benchmark that runs the app repeatedly (``--runs``, ``--timeout``, ``--out``), and its
    runs: ``(setting, overrides, run, metrics.json)``, the settings interleaved so that a slow period of the
    machine hits all alike."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", type=int, default=default_runs, help="runs per setting")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    runs = ((name, overrides, run, run_app(overrides, args.timeout)) for run in range(args.runs)
            for name, overrides in settings.items())  # fmt: skip
    return args, runs


def main() -> None:
    args, runs = app_runs(__doc__.split("\n\n")[0], SETTINGS, default_runs=6)
    rows = []
    for name, overrides, run, metrics in runs:
        seen = metrics.get("staleness_seen") or {"max": 0, "mean": 0.0}
        rows.append({"setting": name, "overrides": overrides, "run": run,
                     "test_acc": metrics["metrics"]["test_acc"], "staleness_max": seen["max"],
                     "staleness_mean": seen["mean"], "global_step": metrics["global_step"]})  # fmt: skip
        print(f"{name} run {run}: test accuracy {rows[-1]['test_acc']:.4f}, max staleness {seen['max']}")
    save(args.out, "app_accuracy", rows, report)


if __name__ == "__main__":
    main()
