"""What synchronization costs: bytes moved and seconds spent."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

#: per thread: counters whose bytes go elsewhere while :meth:`CommStats.diverted` runs (by ``id``)
_diversions = threading.local()


@dataclass
class CommStats:
    """Bytes this rank sent and received since the last :meth:`reset`. Thread-safe (the comm thread adds to it)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, sent: int = 0, received: int = 0) -> None:
        target = getattr(_diversions, "targets", {}).get(id(self))
        if target is not None:
            target.add(sent, received)
            return
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    @contextmanager
    def diverted(self, target: CommStats) -> Iterator[None]:
        """Inside this context, the bytes this thread adds to this counter go to ``target`` instead (an exchange
        counted apart, to be booked to the step it belongs to)."""
        targets = _diversions.__dict__.setdefault("targets", {})
        targets[id(self)] = target
        try:
            yield
        finally:
            del targets[id(self)]

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def reset(self) -> tuple[int, int]:
        """Zero the counters and return the ``(sent, received)`` they held."""
        with self._lock:
            totals = (self.bytes_sent, self.bytes_received)
            self.bytes_sent = self.bytes_received = 0
            return totals


@dataclass
class SyncStats(CommStats):
    """A strategy's synchronization record: the running byte counters of :class:`CommStats` (every exchange of a
    step adds to them), and what the finished steps cost."""

    #: S, the bytes of one rank's gradient buckets (gradients plus one used-flag per parameter)
    bucket_bytes: int = 0
    #: ``(sent, received)`` bytes of gradient and weight traffic this rank moved for the last optimizer step
    last_step_bytes: tuple[int, int] = (0, 0)
    #: ``(sent, received)`` bytes of every closed step so far
    steps_bytes: tuple[int, int] = (0, 0)
    #: seconds of gradient / weight communication so far, and the part of it the training loop waited for (the
    #: rest ran hidden behind backward); an exchange counts from when its peers were there
    comm_seconds: float = 0.0
    exposed_comm_seconds: float = 0.0
    #: seconds exchanges spent waiting for slower peers before that (where the transport tells: shared memory; see
    #: :func:`lightning_dp.comm.execution.peers_arrived`)
    peer_wait_seconds: float = 0.0
    #: seconds of backward computation so far (without the wait for the gradient exchange at its end)
    backward_seconds: float = 0.0
    #: optimizer steps closed so far
    steps: int = 0

    def end_step(self, comm_seconds: float = 0.0, waited_seconds: float = 0.0, peer_wait_seconds: float = 0.0) -> None:
        """Close a step: its bytes become :attr:`last_step_bytes`; ``comm_seconds`` of communication ran, of which
        the training loop waited ``waited_seconds``, after ``peer_wait_seconds`` waiting for slower peers."""
        self.last_step_bytes = self.reset()
        self.steps_bytes = (
            self.steps_bytes[0] + self.last_step_bytes[0],
            self.steps_bytes[1] + self.last_step_bytes[1],
        )
        self.comm_seconds += comm_seconds
        self.exposed_comm_seconds += waited_seconds
        self.peer_wait_seconds += peer_wait_seconds
        self.steps += 1


def fastest_run(fn: Callable[[], None], group: dist.ProcessGroup | None, device: torch.device, repeats: int) -> float:
    """Seconds the fastest of ``repeats`` runs of ``fn`` takes when every rank of ``group`` starts it together (a
    barrier before each; on a CUDA ``device`` the device's work is waited for, not only the launches)."""
    best = float("inf")
    cuda = device.type == "cuda"
    for _ in range(repeats):
        dist.barrier(group=group)
        if cuda:  # NCCL returns before its kernels finish: time the device work, not the launches
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
