"""The GPU check: one command for a machine with CUDA, sized for 8 minutes, ending with one summary line.

    python -m benchmarks.gpu_check

1. The GPU test tiers, ``python -m pytest -m gpu tests/test_gpu.py``: two ranks sharing GPU 0 over gloo (always),
   and NCCL with one rank per GPU (with two GPUs or more; reported as not run otherwise).
2. End to end on the GPU, steps/s of every strategy against Lightning's ``ddp`` in the same run (ResNet-18 on
   fake 32x32 images): one process on the GPU, and two ranks sharing it over gloo, started as two single-device
   nodes (``MASTER_ADDR``, ``NODE_RANK``; ``ddp`` over gloo too).

Writes results/gpu_check.{json,md}: the machine, the date, every test's outcome and the end-to-end rows. Exits
non-zero when a test failed or a run did not finish. ``--accelerator cpu --skip-tests`` runs the end-to-end part on
CPUs (a check of the launches, not a GPU result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.end_to_end import STRATEGIES, median, worker_command
from benchmarks.report import save
from tests.helpers.distributed import free_port
from tests.helpers.launch import CLUSTER_VARIABLES, kill_process_tree, run_processes

REPO = Path(__file__).resolve().parents[1]
#: one test's outcome in pytest's ``-v`` output
TEST_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
#: the tier's share of the 8 minutes; a tier still running then is stopped and reported as such
TESTS_BUDGET_S = 330


def machine(accelerator: str) -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if accelerator == "gpu" else []
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def run_tests(budget_s: float) -> dict:
    """The GPU tiers under pytest, stopped after ``budget_s``; every test's outcome as pytest reported it."""
    command = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=budget_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_process_tree(proc.pid)  # the ranks the tests started run in sessions of their own
            proc.wait()
            timed_out = True
        log.seek(0)
        output = log.read()
    outcomes = {m.group(1): m.group(2) for m in map(TEST_LINE.match, output.splitlines()) if m}
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {
        "command": " ".join(["python", *command[1:]]),
        "seconds": round(time.monotonic() - start, 1),
        "timed_out": timed_out,
        "exit_code": proc.returncode,
        "counts": counts,
        "outcomes": outcomes,
        "failures": output[-6000:] if proc.returncode not in (0, None) else "",
    }


def run_placement(model: str, strategy: str, nodes: int, accelerator: str, steps: int, warmup: int, tmp: Path):
    """One measurement: one process (``nodes == 1``), or ``nodes`` single-device nodes on this machine over gloo."""
    result_dir = tmp / f"{model}-{nodes}-{strategy}"
    backend = "gloo" if nodes > 1 else None
    command = worker_command(model, strategy, 1, steps, warmup, result_dir, nodes, accelerator, backend)
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update({"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)})
    port = str(free_port())
    envs = [
        {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(nodes), "NODE_RANK": str(n),
         "LOCAL_RANK": "0"} if nodes > 1 else env
        for n in range(nodes)
    ]  # fmt: skip
    codes, outputs, timed_out = run_processes(command, envs, timeout=300)
    if timed_out or any(codes):
        what = "timed out after 300 s" if timed_out else f"failed: exit codes {codes}"
        raise RuntimeError(f"{strategy} on {nodes} node(s) {what}; last output:\n{outputs[0][-1500:]}")
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(nodes)]


def run_end_to_end(model: str, strategies: list[str], accelerator: str, steps: int, warmup: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nodes, placement in ((1, "one process"), (2, "two ranks sharing the device over gloo")):
            baseline = None
            for strategy in strategies:
                row = {"model": model, "placement": placement, "world_size": nodes, "strategy": strategy}
                try:
                    ranks = run_placement(model, strategy, nodes, accelerator, steps, warmup, Path(tmp))
                except RuntimeError as error:
                    row["error"] = str(error)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                row["steps_per_s"] = median([r["steps_per_s"] for r in ranks])
                if strategy == "ddp":
                    baseline = row
                if baseline is not None:
                    row["vs_ddp"] = row["steps_per_s"] / baseline["steps_per_s"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def report_lines(records: list[dict]) -> list[str]:
    """The report of the one record a run saves (``Machine: ...`` first)."""
    record = records[0]
    return report(record["machine"], record["tests"], record["end_to_end"], record["steps"], record["warmup"])


def report(info: dict, tests: dict | None, rows: list[dict], steps: int, warmup: int) -> list[str]:
    gpus = ", ".join(info["gpus"]) or "none (CPU run)"
    lines = [
        f"Machine: {info['cpus']} CPUs, GPUs: {gpus}; torch {info['torch']} (CUDA {info['cuda']}); {info['date']}",
        "",
    ]
    if tests is not None:
        counts = _counts(tests)
        stopped = f", stopped after {TESTS_BUDGET_S} s" if tests["timed_out"] else ""
        lines += [f"Tests (`{tests['command']}`, {tests['seconds']:.0f} s{stopped}): {counts}", ""]
        lines += ["| test | outcome |", "|---|---|"]
        lines += [f"| `{name.split('::', 1)[1]}` | {outcome} |" for name, outcome in tests["outcomes"].items()]
        lines.append("")
    lines += [
        f"End to end: {rows[0]['model'] if rows else ''}, {steps} timed steps after {warmup} warm-up steps, steps/s "
        "(median over ranks) against `ddp` in the same run.",
        "",
        "| placement | strategy | steps/s | vs ddp |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['placement']} | {r['strategy']} | failed | |")
        else:
            ratio = f"{r['vs_ddp']:.2f}" if "vs_ddp" in r else ""
            lines.append(f"| {r['placement']} | {r['strategy']} | {r['steps_per_s']:.2f} | {ratio} |")
    return lines


def _counts(tests: dict) -> str:
    return ", ".join(f"{n} {k.lower()}" for k, n in sorted(tests["counts"].items())) or "no test ran"


def _ratio(row: dict) -> str:
    if "error" in row:
        return f"{row['strategy']} failed"
    if "vs_ddp" not in row:
        return f"{row['strategy']} {row['steps_per_s']:.2f} steps/s (no ddp baseline: it failed)"
    return f"{row['strategy']} {row['vs_ddp']:.2f}x"


def summary(tests: dict | None, rows: list[dict], seconds: float) -> str:
    parts = []
    if tests is not None:
        parts.append(f"tests: {_counts(tests)}{' (stopped: over budget)' if tests['timed_out'] else ''}")
    shared = [r for r in rows if r["world_size"] == 2 and r["strategy"] != "ddp"]
    ratios = ", ".join(_ratio(r) for r in shared)
    if shared:
        parts.append(f"two ranks sharing the device, steps/s vs ddp: {ratios}")
    return f"gpu_check: {'; '.join(parts)}; {seconds:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--skip-tests", action="store_true", help="only the end-to-end part")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    import torch

    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was run (--accelerator cpu checks the launches on CPUs)")
        sys.exit(2)
    start = time.monotonic()
    info = machine(args.accelerator)
    tests = None if args.skip_tests else run_tests(TESTS_BUDGET_S)
    rows = run_end_to_end(args.model, args.strategies, args.accelerator, args.steps, args.warmup)
    seconds = time.monotonic() - start
    record = {"machine": info, "tests": tests, "end_to_end": rows, "seconds": round(seconds, 1), "steps": args.steps,
              "warmup": args.warmup}  # fmt: skip
    name = "gpu_check" if args.accelerator == "gpu" else "gpu_check_on_cpu"
    save(args.out, name, [record], report_lines)
    print(summary(tests, rows, seconds))
    failed = tests is not None and (tests["timed_out"] or tests["exit_code"] not in (0, 5))
    sys.exit(1 if failed or any("error" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
