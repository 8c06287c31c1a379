"""One launch per strategy of a script that exercises many cases, started on first use and shared by a module's
tests: ``tests.scripts.features`` (:class:`FeatureRuns`) and ``tests.scripts.dropin`` (:class:`DropInRuns`), on CPUs
and, with ``env``, on GPUs. ``start`` launches them in the background, at most ``slots`` at a time, for a machine with
cores to spare (the GPU tiers); a test asking for a run waits for it and sees its failure."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from tests.helpers.launch import load_ranks, run_script
from tests.helpers.replicas import TOLERANCE, prefixed

STRATEGIES = ["ring_allreduce", "parameter_server", "sharded_ps"]
#: the feature matrix also runs ``sharded_ps`` with two dedicated server processes
WITH_SERVERS = "sharded_ps+servers"


def strategy_args(strategy: str) -> list[str]:
    """The feature script's arguments for ``strategy`` (a name, or :data:`WITH_SERVERS`)."""
    if strategy == WITH_SERVERS:
        return ["--strategy", "sharded_ps", "--num-servers", "2"]
    return ["--strategy", strategy]


class FeatureRuns:
    """Each (strategy, phase) run once per test session; results per rank."""

    def __init__(self, root: Path, env: dict | None = None) -> None:
        self.root = root
        self.env = env
        self.results: dict[tuple[str, str], object] = {}
        self._started: dict[str, Future] = {}

    def start(self, strategies: list[str], slots: int | None = None) -> None:
        """Launch the main phase of every one of ``strategies`` now, at most ``slots`` at a time (default: all)."""
        pool = ThreadPoolExecutor(max_workers=min(len(strategies), slots or len(strategies)))
        self._started.update({s: pool.submit(self._run_main, s) for s in strategies})
        pool.shutdown(wait=False)

    def _run_main(self, strategy: str) -> list[dict]:
        out = self.root / f"{strategy}-main"
        run_script("features", *strategy_args(strategy), "--out", str(out), timeout=300, env=self.env)
        return load_ranks(out, 2)

    def main(self, strategy: str) -> list[dict]:
        key = (strategy, "main")
        if key not in self.results:
            started = self._started.pop(strategy, None)
            self.results[key] = started.result() if started is not None else self._run_main(strategy)
        return self.results[key]

    def crash(self, strategy: str):
        """The crashed run: (exit code, output, seconds), then the resumed run's ranks."""
        key = (strategy, "crash")
        if key not in self.results:
            out = self.root / f"{strategy}-crash"
            start = time.monotonic()
            crashed = run_script("features", *strategy_args(strategy), "--phase", "crash", "--out", str(out),
                                 timeout=300, check=False)  # fmt: skip
            seconds = time.monotonic() - start
            run_script("features", *strategy_args(strategy), "--phase", "resume", "--out", str(out), timeout=300)
            self.results[key] = (crashed.returncode, crashed.stdout, seconds, load_ranks(out, 2))
        return self.results[key]


class DropInRuns:
    """One launch per strategy, started on first use and shared by the tests."""

    def __init__(self, root: Path, env: dict | None = None) -> None:
        self.root = root
        self.env = env
        self.done: set[str] = set()
        self._started: dict[str, Future] = {}

    @property
    def checkpoint(self) -> Path:
        return self.root / "ddp-step3.ckpt"

    def start(self, strategies: list[str], slots: int | None = None) -> None:
        """Launch ``ddp`` now, then, once it wrote the checkpoint they resume from, every one of ``strategies``, at
        most ``slots`` launches at a time (default: all)."""
        pool = ThreadPoolExecutor(max_workers=min(len(strategies) + 1, slots or len(strategies) + 1))
        ddp = pool.submit(self._run, "ddp")
        self._started["ddp"] = ddp
        self._started.update({s: pool.submit(self._run_after, ddp, s) for s in strategies})
        pool.shutdown(wait=False)

    def _run_after(self, ddp: Future, strategy: str) -> None:
        ddp.result()  # its checkpoint is what the strategies resume from
        self._run(strategy)

    def _run(self, strategy: str) -> None:
        if strategy == "ddp":
            run_script("dropin", "--strategy", "ddp", "--save-checkpoint", str(self.checkpoint),
                       "--out", str(self.root / "ddp"), timeout=400, env=self.env)  # fmt: skip
            return
        args = [*strategy_args(strategy), "--out", str(self.root / strategy)]
        if strategy.endswith("_spawn"):
            args += ["--cases", "hooks"]
        if strategy == WITH_SERVERS:  # the servers' own cases are the feature matrix's: here, resuming from ddp's
            args += ["--cases", "resume"]
        run_script("dropin", *args, "--resume-from", str(self.checkpoint), timeout=400, env=self.env)

    def _ensure(self, strategy: str) -> None:
        if strategy not in self.done:
            started = self._started.pop(strategy, None)
            started.result() if started is not None else self._run(strategy)
            self.done.add(strategy)

    def case(self, strategy: str, case: str) -> list[dict]:
        self._ensure("ddp")
        self._ensure(strategy)
        return load_ranks(self.root / strategy / case, 2)


def assert_follows_ddp(runs: DropInRuns, strategy: str, case: str, tolerance: dict | None = None) -> list[dict]:
    """``case`` under ``strategy``: weights after every step identical on both ranks and close to ``ddp``'s."""
    ranks, ddp = runs.case(strategy, case), runs.case("ddp", case)
    reference = ddp[0]["weights"]
    assert len(reference) >= 3 and len(ranks[0]["weights"]) == len(reference), case
    for step, want in enumerate(reference):
        got = ranks[0]["weights"][step]
        assert torch.equal(got, ranks[1]["weights"][step]), f"{case}: ranks differ after step {step + 1}"
        torch.testing.assert_close(got, want, **(tolerance or TOLERANCE), msg=prefixed(f"{case}, step {step + 1}"))
    assert not torch.equal(reference[-1], reference[0]), f"{case}: training did not move the weights"
    return ranks
