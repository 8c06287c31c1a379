"""Where the communication thread runs a bucket's exchange on a CUDA device, and how its time is measured, checked on
CPUs with ``torch.cuda``'s device, stream and event calls replaced by recorders that follow torch's own rules (a
thread starts on device 0; entering and leaving a stream context make the stream's device, then the thread's
previous one, current)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lightning_dp.comm import execution as execution_module
from lightning_dp.comm.buckets import BucketReducer
from lightning_dp.comm.execution import CudaExecution, HostExecution

pytestmark = pytest.mark.unit


class FakeCuda:
    """The calls of ``torch.cuda`` the exchange path makes, recorded as ``(thread name, call, device index)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self._local = threading.local()
        self.clock = 0.0
        fake = self

        class Stream:
            def __init__(self, device=None, index=None):
                self.device_index = _index(device) if device is not None else fake.current_device()
                self.stream_id = id(self)

            def wait_event(self, event):
                fake.note("wait_event", self.device_index)

        class Event:
            def __init__(self, enable_timing=False, **_):
                self.completed = True
                self.time = None

            def record(self, stream=None):
                device = stream.device_index if stream is not None else fake.current_device()
                fake.note("record", device)
                fake.clock += 1.0
                self.time = fake.clock

            def query(self):
                return self.completed

            def elapsed_time(self, end):
                assert self.completed and end.completed, "elapsed_time of an event that has not completed"
                return (end.time - self.time) * 1e3

        self.Stream, self.Event = Stream, Event
        self._default = {}

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def note(self, call: str, device: int) -> None:
        self.calls.append((threading.current_thread().name, call, device))

    def set_device(self, device) -> None:
        self.note("set_device", _index(device))
        self._local.device = _index(device)

    def current_stream(self, device=None):
        index = self.current_device() if device is None else _index(device)
        self.note("current_stream", index)
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        if index not in streams:
            streams[index] = self.Stream(index)
        return streams[index]

    def _set_stream(self, stream) -> None:
        # torch._C._cuda_setStream: makes the stream's device current, then the stream current on it
        self.note("set_stream", stream.device_index)
        self._local.device = stream.device_index
        self._local.streams[stream.device_index] = stream

    @contextmanager
    def stream(self, stream):
        # torch.cuda.StreamContext: the previous stream of the current device, and of the stream's device
        source = self.current_stream(None)
        destination = None
        if source.device_index != stream.device_index:
            destination = self.current_stream(stream.device_index)
        self._set_stream(stream)
        try:
            yield
        finally:
            if destination is not None:
                self._set_stream(destination)
            self._set_stream(source)

    def install(self, monkeypatch) -> None:
        for name in ("set_device", "current_stream", "stream", "Stream", "Event"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


def _index(device) -> int:
    return device if isinstance(device, int) else torch.device(device).index


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    return fake


def test_the_exchange_thread_names_only_the_ranks_device(fake_cuda):
    """A rank on device 1: its communication thread makes device 1 current before it touches a stream, and no call
    of the exchange path names device 0 (which would create a CUDA context on GPU 0)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    seen = []

    def exchange(bucket):
        seen.append(fake_cuda.current_device())  # NCCL and the staging copies use the current device

    fake_cuda.set_device(1)  # as Lightning does on the main thread
    reducer = BucketReducer(model.parameters(), exchange, bucket_cap_mb=1e-4, device=torch.device("cuda", 1))
    try:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            reducer.finish()
    finally:
        reducer.close()
    assert len(seen) == 2 * len(reducer.buckets) and set(seen) == {1}
    thread_calls = [(call, device) for thread, call, device in fake_cuda.calls if thread.startswith("lightning-dp")]
    assert thread_calls[0] == ("set_device", 1), thread_calls[:3]
    assert any(call == "set_stream" for call, _ in thread_calls)
    assert {device for _, _, device in fake_cuda.calls} == {1}, [c for c in fake_cuda.calls if c[2] != 1]


def test_device_time_counts_each_exchange_and_the_callers_wait_once_completed(fake_cuda, monkeypatch):
    """The caller's wait is the device's, from backward's own work done to the last exchange done: not the host's,
    which over gloo also waits for backward's kernels to finish (here 100 s of host clock count for nothing)."""
    execution = CudaExecution(torch.device("cuda", 0))
    clock = iter([0.0, 100.0, 200.0, 300.0])
    monkeypatch.setattr(execution_module.time, "perf_counter", lambda: next(clock))

    class Bucket:
        events: list = []

    def exchange(bucket):
        fake_cuda.clock += 5.0  # the exchange's device time; the event records add 1 s each

    execution.run(exchange, Bucket())
    execution.run(exchange, Bucket())
    _, last_done = execution._exchanges[-1]
    execution.begin_wait()  # backward's kernels are queued: the caller's stream waits from here
    execution.end_wait()
    execution.join()
    [(work_done, waited_for)] = execution._waits
    assert waited_for is last_done
    work_done.time = last_done.time - 4.0  # backward's own work ended 4 s before the last exchange did
    last_done.completed = False  # which is still running
    assert execution.take_timing() == (pytest.approx(6.0), 0.0, 0.0)  # the first exchange only; the wait unknown yet
    last_done.completed = True
    assert execution.take_timing() == (pytest.approx(6.0), pytest.approx(4.0), 0.0)
    assert execution.take_timing() == (0.0, 0.0, 0.0)
    # a caller whose own work ends after the exchanges waited for nothing (not a negative time)
    execution.run(exchange, Bucket())
    execution.begin_wait()
    execution.join()
    assert execution.take_timing() == (pytest.approx(6.0), 0.0, 0.0)


def test_communication_the_caller_runs_counts_as_exposed(fake_cuda, monkeypatch):
    """The servers' weight pull runs on the caller's stream: all of it is communication, all of it exposed; on a CUDA
    device its events are read once they completed."""
    execution = CudaExecution(torch.device("cuda", 0))
    with execution.blocking():
        fake_cuda.clock += 3.0
    [(_, end)] = execution._caller_spans
    end.completed = False
    assert execution.take_timing() == (0.0, 0.0, 0.0)
    end.completed = True
    assert execution.take_timing() == (pytest.approx(4.0), pytest.approx(4.0), 0.0)
    host = HostExecution()
    clock = iter([10.0, 12.5, 20.0, 21.0])
    monkeypatch.setattr(execution_module.time, "perf_counter", lambda: next(clock))
    with host.blocking():
        pass
    host.begin_wait()  # a wait while no exchange runs is not communication
    host.end_wait()
    assert host.take_timing() == (2.5, 2.5, 0.0)
    assert host.take_timing() == (0.0, 0.0, 0.0)


def test_on_the_host_the_wait_for_peers_is_apart_and_exposed_is_only_while_an_exchange_runs(monkeypatch):
    """Two exchanges on the host: the first hears from its peers 3 s after it starts (a slower rank's backward),
    the second at once (no mark); the caller waits from 14 to 30, of which the exchanges ran 14 to 18 and 25 to 27."""
    now = [0.0]
    monkeypatch.setattr(execution_module.time, "perf_counter", lambda: now[0])
    host = HostExecution()

    def exchange_after_peers(at: float, end: float):
        def exchange(bucket):
            now[0] = at
            execution_module.peers_arrived()
            execution_module.peers_arrived()  # only the first mark of an exchange counts
            now[0] = end

        return exchange

    now[0] = 10.0
    host.run(exchange_after_peers(13.0, 18.0), bucket=None)  # peers at 13: 3 s waiting for them, 5 s exchanging
    now[0] = 14.0
    host.begin_wait()

    def unmarked(bucket):
        now[0] = 27.0

    now[0] = 25.0
    host.run(unmarked, bucket=None)  # no mark: all of it is the exchange
    now[0] = 30.0
    host.end_wait()
    seconds, exposed, peer_wait = host.take_timing()
    assert (seconds, exposed, peer_wait) == (pytest.approx(7.0), pytest.approx(6.0), pytest.approx(3.0))
    assert exposed <= seconds
    execution_module.peers_arrived()  # outside an exchange: nothing
    assert host.take_timing() == (0.0, 0.0, 0.0)
