"""Kill-and-restart under torchrun's defaults: how many runs finish, and how many end with the uninterrupted weights.

    python -m benchmarks.restarts              # 10 runs per strategy, `ddp` as the baseline (about 15 minutes)
    python -m benchmarks.restarts --runs 3

Each run: ``torchrun --nproc-per-node 2 --max-restarts 1`` (its store shared by every attempt) of
``tests/scripts/midepoch.py`` (2 epochs of 8 steps, a checkpoint every 3 steps); on attempt 0 rank 1 SIGKILLs
itself after step 4, 5, ..., 14 (a different step each run), the restarted attempt resumes from the newest
checkpoint. "exact" counts the finished runs whose final weights equal, bit for bit, those of one uninterrupted run
of the same strategy (started by Lightning, no torchrun).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report import save
from tests.helpers.launch import kill_process_tree

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STRATEGIES = ["ddp", "ring_allreduce", "parameter_server", "sharded_ps"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _weights(out: Path) -> list[torch.Tensor] | None:
    files = [out / f"rank{r}.pt" for r in range(2)]
    return [torch.load(f)["weights"] for f in files] if all(f.exists() for f in files) else None


def _run_torchrun(args: list[str], timeout: float) -> tuple[int | None, str]:
    """``torchrun --nproc-per-node 2 --max-restarts 1 args``: its exit code (``None``: killed after ``timeout``
    seconds, with every process it started) and its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
               "--master-port", str(_free_port()), *args]  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        return None, proc.communicate()[0]
    return proc.returncode, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    parser.add_argument("--run-timeout", type=float, default=180.0, help="seconds before a run counts as hung")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    script = ["-m", "tests.scripts.midepoch"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies:
            reference = Path(tmp) / f"{strategy}-uninterrupted"
            subprocess.run([sys.executable, *script, "--strategy", strategy, "--out", str(reference)], cwd=REPO,
                           env=_env(), check=True, capture_output=True, timeout=600)  # fmt: skip
            want = _weights(reference)
            assert want is not None
            finished = exact = hung = 0
            seconds = 0.0
            for run in range(args.runs):
                out = Path(tmp) / f"{strategy}-{run}"
                start = time.perf_counter()
                code, output = _run_torchrun(
                    [*script, "--strategy", strategy, "--resume-from", "newest", "--kill-at-step", str(4 + run % 11),
                     "--out", str(out)], args.run_timeout,
                )  # fmt: skip
                seconds += time.perf_counter() - start
                got = _weights(out)
                if code == 0 and got is not None:
                    finished += 1
                    exact += all(torch.equal(a, b) for a, b in zip(got, want))
                else:
                    hung += code is None
                    errors = [line for line in output.splitlines() if "Error" in line and "Traceback" not in line]
                    print(f"{strategy} run {run}: {'hung' if code is None else f'exit {code}'}; "
                          f"{errors[-1][:300] if errors else output[-300:]}", file=sys.stderr, flush=True)  # fmt: skip
            rows.append({"strategy": strategy, "runs": args.runs, "finished": finished, "exact": exact, "hung": hung,
                         "seconds_per_run": seconds / args.runs})  # fmt: skip
            print(rows[-1], flush=True)
    save(args.out, "restarts", rows, report_lines)


def report_lines(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first)."""
    return [
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}; torchrun "
        "`--nproc-per-node 2 --max-restarts 1`, rank 1 SIGKILLed once per run.",
        "",
        "| strategy | runs | finished | exact (= uninterrupted weights) | hung (stopped after the run timeout) "
        "| seconds per run |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| `{r['strategy']}` | {r['runs']} | {r['finished']} | {r['exact']} | {r['hung']} "
            f"| {r['seconds_per_run']:.1f} |"
            for r in rows
        ),  # fmt: skip
    ]


if __name__ == "__main__":
    main()
