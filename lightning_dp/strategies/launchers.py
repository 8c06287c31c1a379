"""Lightning's launchers, handing the ranks they start their launch, and the ranks' ties to their launcher."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.process
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_dp._lightning_compat import (
    _ChildProcessObserver,
    _MultiProcessingLauncher,
    _set_num_threads_if_needed,
    _SubprocessScriptLauncher,
    recording_rank_starts,
)
from lightning_dp.comm.cluster.rendezvous import LAUNCH_VARIABLE, die_with_parent, launcher_pid, new_launch, set_launch

log = logging.getLogger(__name__)

#: seconds the other ranks get to fail on their own (and name the peer they lost) once one rank has died
EXIT_GRACE_SECONDS = 5.0
#: set in a process :class:`ScriptLauncher` started again in a lost rank's place: how many it started so far
RESTART_VARIABLE = "LIGHTNING_DP_RESTART"


def wait_for_exit(processes: list[Any], seconds: float) -> None:
    """Wait until each of ``processes`` (``subprocess.Popen`` or ``multiprocessing`` processes) has exited, for
    ``seconds`` at most in all."""
    deadline = time.monotonic() + seconds
    for process in processes:
        left = max(0.0, deadline - time.monotonic())
        if isinstance(process, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(left)
        elif isinstance(process, multiprocessing.process.BaseProcess):
            process.join(left)


@contextmanager
def launch_variable_for_children() -> Iterator[None]:
    """While this process starts ranks: a fresh launch (:func:`~lightning_dp.comm.cluster.rendezvous.new_launch`) in the
    environment they inherit, and only theirs (torchrun, srun or Ray runs started later from this process must not
    see it)."""
    before = os.environ.get(LAUNCH_VARIABLE)
    os.environ[LAUNCH_VARIABLE] = new_launch()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAUNCH_VARIABLE, None)
        else:
            os.environ[LAUNCH_VARIABLE] = before


class ScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher, handing the ranks it starts their launch (this process, rank 0, keeps it),
    with an observer that lets the surviving ranks report why they fail before it kills them."""

    #: whether the job goes on when one of the ranks this launcher started dies (``on_rank_loss="continue"``): then
    #: no observer kills the others
    survives_rank_loss = False
    #: how many times in all a rank this launcher started that dies is started again (``restart_lost_ranks``)
    restarts = 0

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            if not self.survives_rank_loss:
                GracefulObserver(main_pid=os.getpid(), child_processes=self.procs).start()
            elif self.restarts:
                self.restarter = RankRestarter(self.procs, self._started, self._popen, self.restarts)
                self.restarter.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        self._started: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        with launch_variable_for_children(), recording_rank_starts(self._started) as popen:
            super()._call_children_scripts()
        self._popen = popen

    def stop_restarting(self) -> None:
        """Start no rank again from now on (the fit ended)."""
        restarter = getattr(self, "restarter", None)
        if restarter is not None:
            restarter.stop()


class RankRestarter(threading.Thread):
    """In the process that started a machine's other ranks: start a rank that dies (a non-zero exit, a signal) again,
    with the same command and environment (``started``: each one's ``popen`` arguments), ``restarts`` times in all;
    the new process joins the running job in the lost rank's place (``on_rank_loss="continue"``). ``processes`` is
    the launcher's list, updated in place."""

    def __init__(
        self,
        processes: list[Any],
        started: list[tuple[tuple[Any, ...], dict[str, Any]]],
        popen: Callable[..., Any],
        restarts: int,
    ) -> None:
        super().__init__(name="lddp-restarter", daemon=True)
        self.processes, self.started, self.popen, self.left = processes, started, popen, restarts
        self.count = 0
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Start no rank again. The thread itself runs on until the process exits: the kernel's parent-death signal of
        the processes it started fires when the thread that started them ends."""
        self._stopped.set()

    def run(self) -> None:
        while True:
            time.sleep(0.2)
            for i, process in enumerate(self.processes):
                code = process.poll()
                if not code or self.left <= 0 or self._stopped.is_set():
                    continue
                self.left -= 1
                self.count += 1
                args, kwargs = self.started[i]
                env = {**(kwargs.get("env") or os.environ), RESTART_VARIABLE: str(self.count)}
                log.warning("local rank %d exited with %d: starting it again to join the job (%d restart(s) left)",
                            i + 1, code, self.left)  # fmt: skip
                self.processes[i] = self.popen(*args, **{**kwargs, "env": env})


class GracefulObserver(_ChildProcessObserver):
    """Lightning's observer of the ranks rank 0 started: when one dies, the others (rank 0 included) get
    :data:`EXIT_GRACE_SECONDS` to fail on their own and say which peer they lost, then all are killed."""

    @override
    def _terminate_all(self) -> None:
        deadline = time.monotonic() + EXIT_GRACE_SECONDS
        wait_for_exit(self._child_processes, EXIT_GRACE_SECONDS)
        time.sleep(max(0.0, deadline - time.monotonic()))  # rank 0, this process, reports meanwhile
        super()._terminate_all()


class ProcessLauncher(_MultiProcessingLauncher):
    """Lightning's ``spawn`` / ``fork`` / ``forkserver`` launcher, handing the ranks it starts their launch: as an
    attribute of the launcher they receive, not through the environment (a fork server keeps the environment it
    started with)."""

    launch_of_ranks: str | None = None

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.launch_of_ranks = new_launch()
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            set_launch(None)  # this process is not a rank of it

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        set_launch(self.launch_of_ranks)
        super()._wrapping_function(process_idx, *args, **kwargs)


def die_with_launcher() -> None:
    """In a rank that Lightning's launcher started (popen: another rank's process; spawn / fork: the main process):
    die with the launcher, even when it gets SIGKILL. Otherwise such ranks outlive a failed launch and wait, then
    join whatever job next serves their port."""
    parent = launcher_pid()
    if parent is not None and parent != os.getpid():
        die_with_parent(parent)
