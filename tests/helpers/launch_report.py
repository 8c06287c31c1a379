"""Per test file: tests run, launches (and how many of them the warm interpreter started), seconds — printed at the
end of every run, so that CI's log shows where its time goes and a budget per file can be held.

A launch is one job started from the test process: one call of :func:`tests.helpers.launch.run_processes`, of
``WARM.start`` outside it or of :func:`tests.helpers.distributed.run_distributed` (however many processes it
starts), or one Python, ``torchrun``, ``srun`` or ``sbatch`` command started directly (also inside an emulated host,
by ``ip netns exec``). The processes a launched job starts itself (Lightning's ranks, servers) are part of its
launch; a DataLoader's workers are none.
A warm launch is one whose first process :mod:`tests.helpers.warm` forked.
"""

from __future__ import annotations

import os
import subprocess
import threading
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
    warm: int = 0
    seconds: float = 0.0


class LaunchCounter:
    """Counts the launches of the test process; helpers that start several processes as one job count once."""

    def __init__(self) -> None:
        self.total = 0
        self.warm = 0
        self._lock = threading.Lock()
        self._inside = threading.local()  # launches may start from several threads of a test at once

    @contextmanager
    def one_launch(self) -> Iterator[None]:
        """Everything this thread starts inside is one launch."""
        depth = getattr(self._inside, "depth", 0)
        if depth == 0:
            self._count()
            self._inside.warm = False
        self._inside.depth = depth + 1
        try:
            yield
        finally:
            self._inside.depth = depth

    def started(self, command: object) -> None:
        """A process was started directly: a launch if it runs one of :data:`LAUNCH_COMMANDS`."""
        if getattr(self._inside, "depth", 0) == 0 and _is_launch(command):
            self._count()

    def _count(self) -> None:
        with self._lock:
            self.total += 1

    def started_warm(self) -> None:
        """A process of the launch this thread is in (counted once per launch) started from the warm interpreter."""
        if getattr(self._inside, "warm", False):
            return
        self._inside.warm = True
        with self._lock:
            self.warm += 1


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

    def install(self) -> None:
        popen_init = self._popen_init

        def counted_popen_init(popen, args, *rest, **kwargs):
            COUNTER.started(args)
            popen_init(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = counted_popen_init  # type: ignore[method-assign]

    def uninstall(self) -> None:
        subprocess.Popen.__init__ = self._popen_init  # type: ignore[method-assign]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        launches, warm, start = COUNTER.total, COUNTER.warm, time.monotonic()
        try:
            return (yield)
        finally:
            count = self.files.setdefault(item.location[0], FileCount())
            count.tests += 1
            count.launches += COUNTER.total - launches
            count.warm += COUNTER.warm - warm
            count.seconds += time.monotonic() - start

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._started = time.monotonic()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.files:
            return
        terminalreporter.section("launches and time per test file")
        width = max(len(name) for name in self.files)
        terminalreporter.write_line(f"{'file':<{width}}  {'tests':>5}  {'launches':>8}  {'warm':>5}  {'seconds':>8}")
        counts = self.files.values()
        total = FileCount(sum(c.tests for c in counts), sum(c.launches for c in counts), sum(c.warm for c in counts),
                          sum(c.seconds for c in counts))  # fmt: skip
        for name, count in [*sorted(self.files.items(), key=lambda item: -item[1].seconds), ("all", total)]:
            line = f"{name:<{width}}  {count.tests:>5}  {count.launches:>8}  {count.warm:>5}  {count.seconds:>8.1f}"
            terminalreporter.write_line(line)
        terminalreporter.write_line(f"wall clock {time.monotonic() - self._started:.1f} s")
        from tests.helpers.launch import WARM

        if WARM.cold_because:
            named = ", ".join(f"{name} ({count})" for name, count in sorted(WARM.cold_because.items()))
            terminalreporter.write_line(f"launches started cold for a variable the warm interpreter has not: {named}")
