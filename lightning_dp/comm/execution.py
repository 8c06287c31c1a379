"""Where the communication thread runs a bucket's exchange, and how long it took.

:class:`HostExecution` (CPU buckets): the exchange runs on the thread, and the host clock times it. A transport
that can tell marks when an exchange's peers were all there (:func:`peers_arrived`; shared memory: its first
barrier passed, one barrier's latency after the last peer arrived); the time before is this rank waiting for slower
peers (their backward still running), counted apart from the exchange, which runs from then to its end. Over
sockets no receive tells when every peer started (the first one to arrive carries a transfer, and in a ring only
the left neighbour's lateness), so there the wait stays inside the exchange. The caller's wait counts as exposed
only while an exchange runs, so the exposed seconds never exceed the exchange's.

:class:`CudaExecution` (buckets on a CUDA device), the ordering DDP's reducer uses:

- the thread makes the rank's device its current one before anything else (:meth:`CudaExecution.thread_started`):
  a thread starts on device 0, and entering or leaving a stream context on it would create a CUDA context on
  GPU 0 for every rank of the machine (half a GiB each, and an error where GPUs run in exclusive-process mode);
- every gradient copied into a bucket is recorded by one event per producing stream
  (:meth:`~lightning_dp.comm.buckets.GradientBucket.seal`), which the communication stream waits for;
- the exchange runs on the communication stream; the caller's stream waits for every exchange
  (:meth:`CudaExecution.join`) before anything reads the buckets, without blocking the host;
- the time is the device's: CUDA events around each exchange on the communication stream (under NCCL the host
  only enqueues, so a host clock would measure the launches), and the time from backward's own work done on the
  caller's stream to the last exchange done (the host's wait would also count backward's kernels still running);
  communication the caller runs itself (:meth:`HostExecution.blocking`, the servers' weight pull) between events on
  the caller's stream. Events are read once they completed
  (:meth:`CudaExecution.take_timing` never blocks); one still running counts at a later call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_dp.comm.buckets import GradientBucket

#: ``(start, end)`` events around a span of device time
EventPair = tuple[torch.cuda.Event, torch.cuda.Event]

#: per thread: ``arrived`` is ``None`` while an exchange runs whose peers have not been heard from yet, then the time
#: they were; absent (or a number) outside an exchange
_exchange = threading.local()


def peers_arrived() -> None:
    """Mark that every peer of the exchange running on this thread has arrived (shared memory: its first barrier
    passed). Only the first call of an exchange counts; outside one (a caller's own communication, a benchmark) it
    does nothing."""
    if getattr(_exchange, "arrived", 0.0) is None:
        _exchange.arrived = time.perf_counter()


class HostExecution:
    """Exchanges of CPU buckets: run as they come, timed by the host clock (see the module docstring)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._peer_wait = 0.0
        self._blocking = 0.0
        self._waited = 0.0
        self._wait_started = 0.0
        #: the round's exchanges, each from its peers' arrival to its end (appended by the communication thread)
        self._spans: list[tuple[float, float]] = []
        #: guards what the communication thread adds while the caller reads and resets it (an exchange may still run
        #: when the caller takes the timing: the servers' pull behind the next forward)
        self._lock = threading.Lock()

    def thread_started(self) -> None:
        """Prepare the communication thread (once, before its first exchange)."""

    def run(self, exchange: Callable[[GradientBucket], None], bucket: GradientBucket) -> None:
        """Run ``exchange(bucket)`` on the communication thread, after the bucket's gradients were written."""
        start = time.perf_counter()
        _exchange.arrived = None
        try:
            exchange(bucket)
        finally:
            end, arrived = time.perf_counter(), _exchange.arrived
            _exchange.arrived = 0.0
            arrived = start if arrived is None else arrived  # a transport that never marked: no wait told apart
            with self._lock:
                self._peer_wait += arrived - start
                self._seconds += end - arrived
                self._spans.append((arrived, end))

    def begin_wait(self) -> None:
        """The caller starts waiting for the round's exchanges: backward's own work is queued."""
        self._wait_started = time.perf_counter()

    def end_wait(self) -> None:
        """The caller's wait for the exchanges returned (or failed): the part of it an exchange ran is exposed."""
        start, end = self._wait_started, time.perf_counter()
        with self._lock:
            spans, self._spans = self._spans, []
        self._waited += sum(max(0.0, min(end, done) - max(start, arrived)) for arrived, done in spans)

    def join(self) -> None:
        """After every exchange of a round returned: make what reads the buckets next wait for them."""

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """Time communication the caller runs itself (a weight pull after the step): all of it is exposed."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._blocking += time.perf_counter() - start

    def take_timing(self) -> tuple[float, float, float]:
        """``(communication seconds, seconds of them the caller waited for, seconds exchanges waited for slower
        peers)`` since the last call, as far as they are known: the exchanges on the communication thread (from
        their peers' arrival) and the caller's waits while they ran, and :meth:`blocking` communication (counted in
        the first two)."""
        with self._lock:
            seconds, peer_wait = self._seconds, self._peer_wait
            self._seconds = self._peer_wait = 0.0
        blocking, waited = self._blocking, self._waited
        self._blocking = self._waited = 0.0
        return seconds + blocking, waited + blocking, peer_wait


class CudaExecution(HostExecution):
    """Exchanges of buckets on CUDA ``device``, on a stream of their own (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device)
        #: recorded on the communication stream after each exchange of the current round
        self._done: list[torch.cuda.Event] = []
        #: ``(start, end)`` event pairs not yet read: each exchange, each wait of the caller's stream, and each
        #: communication the caller ran itself
        self._exchanges: list[EventPair] = []
        self._waits: list[EventPair] = []
        self._caller_spans: list[EventPair] = []
        #: recorded on the caller's stream by :meth:`begin_wait`
        self._work_done: torch.cuda.Event | None = None

    def thread_started(self) -> None:
        torch.cuda.set_device(self.device)

    def run(self, exchange: Callable[[GradientBucket], None], bucket: GradientBucket) -> None:
        with torch.cuda.stream(self.stream):
            for event in bucket.events:
                self.stream.wait_event(event)
            start = _timing_event(self.stream)
            exchange(bucket)
            done = _timing_event(self.stream)
        with self._lock:
            self._done.append(done)
            self._exchanges.append((start, done))

    def begin_wait(self) -> None:
        # where the caller's stream stands once backward's kernels are queued: what it then waits for is exposed
        self._work_done = _timing_event(torch.cuda.current_stream(self.device))

    def end_wait(self) -> None:
        pass  # the host's wait is not the device's: over gloo it also waits for backward's kernels to finish

    def join(self) -> None:
        with self._lock:  # exchanges posted later may be finishing on the communication thread meanwhile
            done, self._done = self._done, []
        if not done:
            return
        caller = torch.cuda.current_stream(self.device)
        for event in done:
            caller.wait_event(event)
        work_done = self._work_done if self._work_done is not None else _timing_event(caller)
        self._waits.append((work_done, done[-1]))
        self._work_done = None

    @contextmanager
    def blocking(self) -> Iterator[None]:
        caller = torch.cuda.current_stream(self.device)
        start = _timing_event(caller)
        try:
            yield
        finally:
            self._caller_spans.append((start, _timing_event(caller)))

    def take_timing(self) -> tuple[float, float, float]:
        # the device's clock cannot see when peers arrived: their wait stays inside the exchanges
        with self._lock:
            self._exchanges, exchanges = _split_completed(self._exchanges)
        self._waits, waits = _split_completed(self._waits)
        self._caller_spans, spans = _split_completed(self._caller_spans)
        seconds = sum(start.elapsed_time(end) for start, end in exchanges) / 1e3
        waited = sum(max(0.0, start.elapsed_time(end)) for start, end in waits) / 1e3
        blocking = sum(start.elapsed_time(end) for start, end in spans) / 1e3
        return seconds + blocking, waited + blocking, 0.0


def execution_for(device: torch.device) -> HostExecution:
    """:class:`CudaExecution` for a CUDA ``device``, else :class:`HostExecution`."""
    return CudaExecution(device) if device.type == "cuda" else HostExecution()


def _timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _split_completed(pairs: list[EventPair]) -> tuple[list[EventPair], list[EventPair]]:
    """``(pending, completed)``: the pairs with an event not completed yet, and those whose both completed."""
    pending: list[EventPair] = []
    completed: list[EventPair] = []
    for pair in pairs:
        (completed if pair[0].query() and pair[1].query() else pending).append(pair)
    return pending, completed
