"""Per test file: tests run, launches, seconds — printed at the end of every run, so that CI's log shows where its
time goes and a budget per file can be held. Under pytest-xdist each worker counts its own and the controller adds
them up; the seconds of a file are its tests' own, side by side with other files' in another worker.

A launch is one job started from the test process: one call of :func:`tests.helpers.launch.run_processes` or of
:func:`tests.helpers.distributed.run_distributed` (however many processes it starts), or one Python, ``torchrun``,
``srun`` or ``sbatch`` command started directly (also inside an emulated host, by ``ip netns exec``). The processes
a launched job starts itself (Lightning's ranks, servers) are part of its launch.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

#: commands that start a job when the test process runs them directly
LAUNCH_COMMANDS = ("python", "torchrun", "srun", "sbatch")


@dataclass
class FileCount:
    tests: int = 0
    launches: int = 0
    seconds: float = 0.0


class LaunchCounter:
    """Counts the launches of the test process; helpers that start several processes as one job count once."""

    def __init__(self) -> None:
        self.total = 0
        self._depth = 0

    @contextmanager
    def one_launch(self) -> Iterator[None]:
        """Everything started inside is one launch."""
        if self._depth == 0:
            self.total += 1
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def started(self, command: object) -> None:
        """A process was started directly: a launch if it runs one of :data:`LAUNCH_COMMANDS`."""
        if self._depth == 0 and _is_launch(command):
            self.total += 1


def _is_launch(command: object) -> bool:
    if isinstance(command, (str, bytes, os.PathLike)):
        first = os.fsdecode(command).split()[0] if os.fsdecode(command).strip() else ""
    elif isinstance(command, (list, tuple)) and command:
        words = [os.fsdecode(word) for word in command]
        if words[:3] == ["ip", "netns", "exec"] and len(words) > 4:  # a command run inside an emulated host
            words = words[4:]
        first = words[0]
    else:
        return False
    return os.path.basename(first).startswith(LAUNCH_COMMANDS)


COUNTER = LaunchCounter()


class LaunchReport:
    """The pytest plugin: counts each test's launches and time by file; prints the table at the end."""

    def __init__(self) -> None:
        self.files: dict[str, FileCount] = {}
        self._started = time.monotonic()
        self._popen_init = subprocess.Popen.__init__
        self._process_start = multiprocessing.process.BaseProcess.start

    def install(self) -> None:
        popen_init, process_start = self._popen_init, self._process_start

        def counted_popen_init(popen, args, *rest, **kwargs):
            COUNTER.started(args)
            popen_init(popen, args, *rest, **kwargs)

        def counted_process_start(process):
            COUNTER.started(["python"])
            process_start(process)

        subprocess.Popen.__init__ = counted_popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = counted_process_start  # type: ignore[method-assign]

    def uninstall(self) -> None:
        subprocess.Popen.__init__ = self._popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = self._process_start  # type: ignore[method-assign]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        launches, start = COUNTER.total, time.monotonic()
        try:
            return (yield)
        finally:
            count = self.files.setdefault(item.location[0], FileCount())
            count.tests += 1
            count.launches += COUNTER.total - launches
            count.seconds += time.monotonic() - start

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._started = time.monotonic()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """A pytest-xdist worker hands its counts to the controller."""
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput["launch_report"] = {name: vars(count) for name, count in self.files.items()}

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        """The controller adds up a worker's counts."""
        for name, got in getattr(node, "workeroutput", {}).get("launch_report", {}).items():
            count = self.files.setdefault(name, FileCount())
            count.tests += got["tests"]
            count.launches += got["launches"]
            count.seconds += got["seconds"]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.files:
            return
        terminalreporter.section("launches and time per test file")
        width = max(len(name) for name in self.files)
        terminalreporter.write_line(f"{'file':<{width}}  {'tests':>5}  {'launches':>8}  {'seconds':>8}")
        for name, count in sorted(self.files.items(), key=lambda item: -item[1].seconds):
            line = f"{name:<{width}}  {count.tests:>5}  {count.launches:>8}  {count.seconds:>8.1f}"
            terminalreporter.write_line(line)
        total = FileCount(sum(c.tests for c in self.files.values()), sum(c.launches for c in self.files.values()),
                          sum(c.seconds for c in self.files.values()))  # fmt: skip
        terminalreporter.write_line(f"{'all':<{width}}  {total.tests:>5}  {total.launches:>8}  {total.seconds:>8.1f}")
        workers = getattr(terminalreporter.config.option, "numprocesses", None) or 0
        terminalreporter.write_line(
            f"wall clock {time.monotonic() - self._started:.1f} s, "
            + (f"tests in {workers} pytest-xdist workers" if workers else "tests in this process")
        )
