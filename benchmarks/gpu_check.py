"""The GPU check: one command for a machine with CUDA, in stages, ending with one summary line.

    python -m benchmarks.gpu_check                  # every stage, within --budget (450 s)
    python -m benchmarks.gpu_check --quick          # the smoke stage alone
    python -m benchmarks.gpu_check --resume         # a cut-off run: the stages it finished are kept
    python -m benchmarks.gpu_check --accelerator cpu   # the CPU stand-in: the same stages on CPU ranks

The stages, in order, each under a time limit of its own (:data:`STAGES`, seconds on one GPU with 16 cores):

1. ``smoke``: one step of every strategy (and of ``sharded_ps`` with two dedicated servers), two ranks sharing the
   GPU over gloo, all launched at once: every run finishes, and its replicas agree with each other and with one
   process stepping on the global batch.
2. ``collectives``, ``features``, ``dropin``, ``codecs``: the GPU tier, ``tests/test_gpu.py``, one group of tests
   after the other (its ``GROUPS``), launches at most ``LAUNCH_SLOTS`` at a time (a quarter of the cores).
3. ``end_to_end``: steps/s of every strategy against Lightning's ``ddp`` in the same run (ResNet-18 on fake 32x32
   images): one process on the GPU, and two ranks sharing it over gloo (``ddp`` over gloo too).

A stage past its limit (or past what is left of ``--budget``) is stopped and recorded as such. Results are written
after every stage to ``<out>/gpu_check.json`` and ``.md`` (``gpu_check_on_cpu`` for the stand-in), so a run cut
off from outside still leaves what it found; ``--resume`` reads them back, keeps every stage that finished and runs
the others. Exits non-zero when a stage failed or was stopped.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.end_to_end import STRATEGIES, median, worker_command
from benchmarks.report import command_line, save
from tests.helpers.distributed import free_port
from tests.helpers.launch import CLUSTER_VARIABLES, kill_process_tree, run_processes

REPO = Path(__file__).resolve().parents[1]
#: one test's outcome in pytest's ``-v`` output
TEST_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
#: every stage and its time limit in seconds on one GPU with 16 cores (see the module docstring)
STAGES = {"smoke": 60, "collectives": 60, "features": 90, "dropin": 180, "codecs": 60, "end_to_end": 150}
#: the stages that run the GPU tier's groups of tests (``tests/test_gpu.py``'s ``GROUPS``)
TEST_STAGES = ("collectives", "features", "dropin", "codecs")
#: the whole command's default budget: one call of a lent GPU machine (8 minutes) with time to spare
BUDGET_S = 450
#: a stage is not started with less than this left of the budget (it would only be stopped)
MIN_STAGE_S = 20
#: the strategies of the smoke stage: fit.py's arguments for each
SMOKE_RUNS = {
    "ring_allreduce": ["--strategy", "ring_allreduce"],
    "parameter_server": ["--strategy", "parameter_server"],
    "sharded_ps": ["--strategy", "sharded_ps"],
    "sharded_ps+servers": ["--strategy", "sharded_ps", "--num-servers", "2"],
}
#: how far a smoke run's weights may be from one process's after the step (the GPU against the CPU)
SMOKE_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
FINISHED = ("passed", "failed")


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


def tier_env(accelerator: str) -> dict:
    """The environment of the stages' subprocesses: the checkout importable, the stand-in's CPU ranks."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update({"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"})
    if accelerator == "cpu":
        env["LIGHTNING_DP_GPU_TIER_ACCELERATOR"] = "cpu"
    return env


# ---------------------------------------------------------------------------------------------------- smoke
def run_smoke(accelerator: str, limit_s: float) -> dict:
    """One step of every :data:`SMOKE_RUNS` entry, all launched at once, each checked against one process stepping
    on the global batch (``tests.scripts.fit``'s model leaves a branch unused on some ranks, which ``ddp`` refuses
    without ``find_unused_parameters``)."""
    import torch

    from tests.helpers.launch import BATCH, load_ranks, run_script
    from tests.scripts.models import reference_training

    env = {"LIGHTNING_DP_TEST_ACCELERATOR": accelerator, "LIGHTNING_DP_TEST_BACKEND": "gloo",
           "LIGHTNING_DP_TEST_NODES": "2"}  # fmt: skip
    outcomes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:

        def launch(name: str) -> list[dict]:
            out = Path(tmp) / name
            run_script("fit", *SMOKE_RUNS[name], "--devices", "2", "--batch-size", str(BATCH), "--steps", "1",
                       "--out", str(out), timeout=limit_s, env=env)  # fmt: skip
            return load_ranks(out, 2)

        with ThreadPoolExecutor(max_workers=len(SMOKE_RUNS)) as pool:
            started = {name: pool.submit(launch, name) for name in SMOKE_RUNS}
            [reference] = reference_training(BATCH * 2, 1, "sgd")
            for name, future in started.items():
                try:
                    ranks = future.result()
                except AssertionError as error:  # the launch failed, or was stopped at the limit
                    stopped = f"timed out after {limit_s}s" in str(error)
                    outcomes[name] = {"outcome": "STOPPED" if stopped else "FAILED", "detail": str(error)[-1500:]}
                    continue
                weights = [rank["weights"] for rank in ranks]
                if [len(w) for w in weights] != [1, 1]:
                    problem = f"steps recorded per rank: {[len(w) for w in weights]}, 1 expected"
                elif not torch.equal(weights[0][0], weights[1][0]):
                    problem = "the two ranks' weights differ after the step"
                elif not torch.allclose(weights[0][0], reference, **SMOKE_TOLERANCE):
                    gap = (weights[0][0] - reference).abs().max().item()
                    problem = f"weights {gap:.2e} away from one process's after the step"
                else:
                    problem = ""
                outcomes[name] = {"outcome": "FAILED" if problem else "PASSED", "detail": problem}
    found = {o["outcome"] for o in outcomes.values()}
    status = "failed" if "FAILED" in found else "stopped" if "STOPPED" in found else "passed"
    return {"status": status, "runs": outcomes}


# ---------------------------------------------------------------------------------------------------- the GPU tier
def run_test_group(group: str, accelerator: str, limit_s: float) -> dict:
    """One group of the GPU tier under pytest, stopped after ``limit_s``; every test's outcome as pytest reported it."""
    from tests.test_gpu import GROUPS

    command = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py",
               "-k", GROUPS[group]]  # fmt: skip
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=tier_env(accelerator), stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=limit_s)
            stopped = False
        except subprocess.TimeoutExpired:
            kill_process_tree(proc.pid)  # the ranks the tests started run in sessions of their own
            proc.wait()
            stopped = True
        log.seek(0)
        output = log.read()
    outcomes = {m.group(1): m.group(2) for m in map(TEST_LINE.match, output.splitlines()) if m}
    failed = proc.returncode not in (0, 5) or any(o in ("FAILED", "ERROR") for o in outcomes.values())
    return {
        "status": "stopped" if stopped else "failed" if failed else "passed",
        "command": " ".join(["python", *command[1:]]),
        "outcomes": outcomes,
        "failures": output[-6000:] if stopped or failed else "",
    }


# ---------------------------------------------------------------------------------------------------- end to end
def run_placement(model: str, strategy: str, nodes: int, accelerator: str, steps: int, warmup: int, tmp: Path,
                  limit_s: float) -> list[dict]:  # fmt: skip
    """One measurement: one process (``nodes == 1``), or ``nodes`` single-device nodes on this machine over gloo."""
    result_dir = tmp / f"{model}-{nodes}-{strategy}"
    backend = "gloo" if nodes > 1 else None
    command = worker_command(model, strategy, 1, steps, warmup, result_dir, nodes, accelerator, backend)
    env = tier_env(accelerator)
    port = str(free_port())
    envs = [
        {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(nodes), "NODE_RANK": str(n),
         "LOCAL_RANK": "0"} if nodes > 1 else env
        for n in range(nodes)
    ]  # fmt: skip
    codes, outputs, timed_out = run_processes(command, envs, timeout=limit_s)
    if timed_out or any(codes):
        what = f"was stopped after {limit_s:.0f} s" if timed_out else f"failed: exit codes {codes}"
        raise RuntimeError(f"{strategy} on {nodes} node(s) {what}; last output:\n{outputs[0][-1500:]}")
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(nodes)]


def run_end_to_end(
    model: str, strategies: list[str], accelerator: str, steps: int, warmup: int, limit_s: float
) -> dict:
    """Every placement's rows, each strategy against ``ddp`` measured just before it; a placement whose launches
    run past ``limit_s`` is stopped."""
    rows: list[dict] = []
    deadline = time.monotonic() + limit_s
    stopped = False
    with tempfile.TemporaryDirectory() as tmp:
        for nodes, placement in ((1, "one process"), (2, "two ranks sharing the device over gloo")):
            baseline = None
            for strategy in strategies:
                row = {"model": model, "placement": placement, "world_size": nodes, "strategy": strategy}
                left = deadline - time.monotonic()
                if left < 5:
                    stopped = True
                    break
                try:
                    ranks = run_placement(model, strategy, nodes, accelerator, steps, warmup, Path(tmp), left)
                except RuntimeError as error:
                    row["error"] = str(error)
                    stopped = stopped or "was stopped" in str(error)
                    rows.append(row)
                    continue
                row["steps_per_s"] = median([r["steps_per_s"] for r in ranks])
                if strategy == "ddp":
                    baseline = row
                if baseline is not None:
                    row["vs_ddp"] = row["steps_per_s"] / baseline["steps_per_s"]
                print(json.dumps(row), flush=True)
                rows.append(row)
            if stopped:
                break
    failed = any("error" in r for r in rows)
    return {"status": "stopped" if stopped else "failed" if failed else "passed", "rows": rows}


# ---------------------------------------------------------------------------------------------------- the report
def report_lines(records: list[dict]) -> list[str]:
    """The report of the one record a run saves (``Machine: ...`` first)."""
    record = records[0]
    info = record["machine"]
    gpus = ", ".join(info["gpus"]) or "none (the CPU stand-in)"
    lines = [
        f"Machine: {info['cpus']} CPUs, GPUs: {gpus}; torch {info['torch']} (CUDA {info['cuda']}); {info['date']}",
        "",
        *stage_lines(records),
    ]
    stages = record["stages"]
    smoke = stages.get("smoke", {}).get("runs", {})
    if smoke:
        what = "Smoke: one step, two ranks sharing the device over gloo, against one process on the global batch."
        lines += ["", what, "",
                  "| run | outcome | detail |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {name} | {run['outcome']} | {run['detail']} |" for name, run in smoke.items()]
    tests = [(n, o) for name in TEST_STAGES for n, o in stages.get(name, {}).get("outcomes", {}).items()]
    if tests:
        lines += ["", "| test | outcome |", "|---|---|"]
        lines += [f"| `{name.split('::', 1)[1]}` | {outcome} |" for name, outcome in tests]
    rows = stages.get("end_to_end", {}).get("rows", [])
    if rows:
        lines += [
            "",
            f"End to end: {rows[0]['model']}, {record['steps']} timed steps after {record['warmup']} warm-up steps, "
            "steps/s (median over ranks) against `ddp` in the same run.",
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


def stage_lines(records: list[dict]) -> list[str]:
    """The table of a run's stages: status, seconds against the limit, what each found."""
    stages = records[0]["stages"]
    lines = ["| stage | status | seconds | limit (s) | what it found |", "|---|---|---|---|---|"]
    for name in STAGES:
        stage = stages.get(name)
        if stage is None:
            lines.append(f"| {name} | not run | | | |")
        else:
            lines.append(f"| {name} | {stage['status']} | {stage['seconds']:.0f} | {stage['limit_s']:.0f} | "
                         f"{_found(name, stage)} |")  # fmt: skip
    total = sum(stage["seconds"] for stage in stages.values())
    lines.append(f"| all | | {total:.0f} | {records[0].get('budget_s', BUDGET_S):.0f} | |")
    return lines


def _found(name: str, stage: dict) -> str:
    if name == "smoke":
        runs = stage.get("runs", {})
        return f"{sum(r['outcome'] == 'PASSED' for r in runs.values())} of {len(runs)} runs step as one process does"
    if name == "end_to_end":
        rows = stage.get("rows", [])
        return f"{sum('steps_per_s' in r for r in rows)} rows measured, {sum('error' in r for r in rows)} failed"
    return _counts(stage.get("outcomes", {}))


def _counts(outcomes: dict) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items())) or "no test ran"


def summary(stages: dict, seconds: float) -> str:
    parts = [f"{name} {stage['status']}" for name, stage in stages.items()]
    shared = [
        r for r in stages.get("end_to_end", {}).get("rows", []) if r["world_size"] == 2 and r["strategy"] != "ddp"
    ]
    if shared:
        ratios = ", ".join(f"{r['strategy']} {r['vs_ddp']:.2f}x" if "vs_ddp" in r else f"{r['strategy']} failed"
                           for r in shared)  # fmt: skip
        parts.append(f"two ranks sharing the device, steps/s vs ddp: {ratios}")
    return f"gpu_check: {'; '.join(parts) or 'nothing ran'}; {seconds:.0f} s"


# ---------------------------------------------------------------------------------------------------- the command
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--quick", action="store_true", help="the smoke stage alone")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), help="these stages only (in the usual order)")
    parser.add_argument("--resume", action="store_true", help="keep the stages the stored results say finished")
    parser.add_argument("--budget", type=float, default=None, help=f"seconds for the whole command ({BUDGET_S})")
    parser.add_argument(
        "--slack",
        type=float,
        default=1.0,
        help="every time limit times this (a slower machine: the CPU stand-in on few cores)",
    )
    parser.add_argument("--model", default=None, help="end to end: resnet18 on GPUs, reference_cnn on CPUs")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    import torch

    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was run (--accelerator cpu runs the CPU stand-in)")
        sys.exit(2)
    model = args.model or ("resnet18" if args.accelerator == "gpu" else "reference_cnn")
    chosen = ["smoke"] if args.quick else [s for s in STAGES if args.stages is None or s in args.stages]
    name = "gpu_check" if args.accelerator == "gpu" else "gpu_check_on_cpu"
    stored = Path(args.out) / f"{name}.json"
    stages: dict[str, dict] = {}
    if args.resume and stored.exists():
        previous = json.loads(stored.read_text())["rows"][0]["stages"]
        stages = {s: stage for s, stage in previous.items() if stage["status"] in FINISHED}
    budget = args.budget if args.budget is not None else BUDGET_S * args.slack
    start = time.monotonic()
    record = {"machine": machine(args.accelerator), "stages": stages, "steps": args.steps, "warmup": args.warmup,
              "budget_s": budget}  # fmt: skip
    runners: dict[str, Callable[[float], dict]] = {
        "smoke": lambda limit: run_smoke(args.accelerator, limit),
        "end_to_end": lambda limit: run_end_to_end(
            model, args.strategies, args.accelerator, args.steps, args.warmup, limit
        ),  # fmt: skip
        **{group: (lambda limit, group=group: run_test_group(group, args.accelerator, limit)) for group in TEST_STAGES},
    }
    for stage in chosen:
        if stage in stages:
            print(f"gpu_check: {stage} kept from the stored results ({stages[stage]['status']})", flush=True)
            continue
        left = budget - (time.monotonic() - start)
        if left < MIN_STAGE_S:
            print(f"gpu_check: {stage} not started: {left:.0f} s left of the budget", flush=True)
            break
        limit = min(STAGES[stage] * args.slack, left)
        began = time.monotonic()
        result = runners[stage](limit)
        stages[stage] = {**result, "seconds": round(time.monotonic() - began, 1), "limit_s": limit,
                         "date": record["machine"]["date"], "gpus": record["machine"]["gpus"]}  # fmt: skip
        print(f"gpu_check: {stage} {result['status']} in {stages[stage]['seconds']:.0f} s", flush=True)
        save(args.out, name, [record], report_lines, command=command_line())
    seconds = time.monotonic() - start
    print(summary(stages, seconds))
    done = all(stages.get(s, {}).get("status") == "passed" for s in chosen)
    sys.exit(0 if done else 1)


if __name__ == "__main__":
    main()
