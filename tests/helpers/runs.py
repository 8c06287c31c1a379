"""One launch per strategy of a script that exercises many cases, started on first use and shared by a module's
tests: ``tests.scripts.features`` (:class:`FeatureRuns`) and ``tests.scripts.dropin`` (:class:`DropInRuns`), on CPUs
and, with ``env``, on GPUs."""

from __future__ import annotations

import time
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

    def main(self, strategy: str) -> list[dict]:
        key = (strategy, "main")
        if key not in self.results:
            out = self.root / f"{strategy}-main"
            run_script("features", *strategy_args(strategy), "--out", str(out), timeout=300, env=self.env)
            self.results[key] = load_ranks(out, 2)
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

    @property
    def checkpoint(self) -> Path:
        return self.root / "ddp-step3.ckpt"

    def case(self, strategy: str, case: str) -> list[dict]:
        if "ddp" not in self.done:
            run_script("dropin", "--strategy", "ddp", "--save-checkpoint", str(self.checkpoint),
                       "--out", str(self.root / "ddp"), timeout=400, env=self.env)  # fmt: skip
            self.done.add("ddp")
        if strategy not in self.done:
            args = ["--strategy", strategy, "--out", str(self.root / strategy)]
            if strategy.endswith("_spawn"):
                args += ["--cases", "hooks"]
            run_script("dropin", *args, "--resume-from", str(self.checkpoint), timeout=400, env=self.env)
            self.done.add(strategy)
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
