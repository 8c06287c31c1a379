"""A rank's serving thread under a staleness bound (see :mod:`lightning_dp.comm.consistency`)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.consistency.protocol import (
    HEADER_LEN,
    PushLayout,
    Reply,
    Request,
    StopReason,
    _Request,
    arrival_scale,
)
from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout
from lightning_dp.comm.stats import CommStats


class StalenessServer:
    """Serves this rank's share of the weights to ``size`` workers under a staleness bound (see the module
    docstring); apply, bound and flush logic on one serving thread.

    ``optimizers`` run on ``layout``'s own storage (the share of the weights this rank serves); each arriving
    gradient is one step of optimizer ``optimizer_index``, its hyperparameters scaled by :func:`arrival_scale`.
    ``lock`` guards
    the storage and the optimizers' state: hold it to read them from another thread (checkpoints).
    """

    def __init__(
        self,
        layout: ShardLayout,
        optimizers: Sequence[ShardedOptimizer],
        push_layout: PushLayout,
        rank: int,
        size: int,
        staleness: int | None,
        push_group: dist.ProcessGroup,
        reply_group: dist.ProcessGroup,
        stats: CommStats | None = None,
    ) -> None:
        self.layout = layout
        self.optimizers = list(optimizers)
        self.push_layout = push_layout
        self.rank, self.size = rank, size
        self.staleness = staleness
        self.push_group, self.reply_group = push_group, reply_group
        self.stats = stats
        self.lock = threading.Lock()
        self.clock = [0] * size
        self.inbox: queue.Queue[_Request] = queue.Queue()
        #: replies to this rank's own worker: ``(header, weights)``
        self.local_replies: queue.Queue[tuple[Tensor, Tensor]] = queue.Queue()
        self._pending: list[_Request] = []
        self._flushing: list[_Request] = []
        self._gone: set[int] = set()
        #: workers that said goodbye: all their updates are in, they hold nobody back
        self._finished: set[int] = set()
        self.failure: tuple[int, int] | None = None
        #: the exception that stopped this server itself (re-raised by its own worker)
        self.error: BaseException | None = None
        self._flag_at = [push_layout.flag_index(pc.bucket, pc.index_in_bucket, rank) for pc in layout.pieces]
        self._scales = [arrival_scale(o.optimizer, size) for o in self.optimizers]
        self._threads = [threading.Thread(target=self._receive, args=(w,), daemon=True, name=f"lddp-recv-{w}")
                         for w in range(size) if w != rank]  # fmt: skip
        self._serving = threading.Thread(target=self._serve, daemon=True, name="lddp-server")

    def start(self) -> None:
        for thread in self._threads:
            thread.start()
        self._serving.start()

    @property
    def serving(self) -> bool:
        """Whether the serving thread still runs."""
        return self._serving.is_alive()

    def join(self, timeout: float) -> bool:
        """Wait until every worker has said goodbye (or is gone); whether the threads ended in ``timeout``."""
        deadline = time.monotonic() + timeout
        for thread in [self._serving, *self._threads]:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in [self._serving, *self._threads])

    def submit(self, request: _Request) -> None:
        """A request of this rank's own worker (no message: it shares the process)."""
        self.inbox.put(request)

    # ------------------------------------------------------------------ threads
    def _receive(self, worker: int) -> None:
        """Receiving thread of one remote worker: its requests, in its order, into the inbox."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        size = self.push_layout.message_numel(self.rank)
        while True:
            try:
                dist.recv(header, group=self.push_group, group_src=worker)
                kind, clock, index, reason = (int(v) for v in header.tolist())
                payload = None
                if kind == Request.PUSH:
                    payload = torch.empty(size, dtype=self.push_layout.dtype)
                    dist.recv(payload, group=self.push_group, group_src=worker)
                    if self.stats is not None:
                        self.stats.add(received=payload.numel() * payload.element_size())
            except Exception:  # the worker's sockets closed: it died
                self.inbox.put(_Request(worker, Request.LOST, 0, reason=StopReason.LOST))
                return
            self.inbox.put(_Request(worker, kind, clock, index, reason, payload))
            if kind in (Request.BYE, Request.ABORT):
                return

    def _serve(self) -> None:
        while len(self._gone) < self.size:
            request = self.inbox.get()
            try:
                self._handle(request)
                self._answer()
            except Exception as error:  # noqa: BLE001 - a failed update stops the run on every rank, named
                self.error = self.error or error
                self.failure = self.failure or (self.rank, StopReason.ERROR)
                self._answer()

    def _handle(self, request: _Request) -> None:
        if request.kind == Request.PUSH:
            self.clock[request.worker] = request.clock
            self._pending.append(request)  # first: if the update fails, this request is answered with the failure
            if self.failure is None:
                assert request.payload is not None
                with self.lock:
                    self._apply(request.optimizer_index, request.payload)
        elif request.kind == Request.FLUSH:
            self._flushing.append(request)
        elif request.kind == Request.BYE:
            self._gone.add(request.worker)
            self._finished.add(request.worker)
        else:  # Request.ABORT, Request.LOST
            self._gone.add(request.worker)
            self.failure = self.failure or (request.worker, request.reason)

    def _apply(self, optimizer_index: int, payload: Tensor, values: list[dict] | None = None) -> None:
        """One arriving gradient: one step of its optimizer over this server's share, the learning rate scaled
        (``values``: the hyperparameters per group to use instead of this rank's optimizer's)."""
        sharded = self.optimizers[optimizer_index]
        pieces = {id(pc) for pc in sharded.pieces}
        for piece, flag_at in zip(self.layout.pieces, self._flag_at):
            if id(piece) in pieces:
                used = bool(payload[flag_at] != 0)
                n = piece.tensor.numel()
                grad = payload[piece.storage_start : piece.storage_start + n].view_as(piece.tensor)
                piece.tensor.grad = grad if used else None
        sharded.step(scale=self._scales[optimizer_index], values=values)

    def _answer(self) -> None:
        """Reply to every request the bound now allows (or every request, with the failure, once the run failed)."""
        if self.failure is not None:
            for request in self._pending + self._flushing:
                self._reply(request, None, 0)
            self._pending, self._flushing = [], []
            return
        active = [c for w, c in enumerate(self.clock) if w not in self._finished]
        slowest = min(active) if active else max(self.clock)
        ready = [r for r in self._pending if self.staleness is None or slowest >= r.clock - self.staleness]
        if ready:
            self._pending = [r for r in self._pending if r not in ready]
            with self.lock:
                weights = self.layout.storage.clone()
            for request in ready:
                self._reply(request, weights, request.clock - slowest)
        if self._flushing and len(self._flushing) == self.size - len(self._finished):  # all at the same point
            flushing, self._flushing = self._flushing, []
            with self.lock:
                weights = self.layout.storage.clone()
            for request in flushing:
                self._reply(request, weights, 0)

    def _reply(self, request: _Request, weights: Tensor | None, staleness: int) -> None:
        if weights is None:
            culprit, reason = self.failure or (self.rank, StopReason.ERROR)
            header = torch.tensor([Reply.FAILED, 0, culprit, reason], dtype=torch.int64)
            weights = torch.zeros(self.layout.storage.numel(), dtype=self.layout.storage.dtype)
        else:
            header = torch.tensor([Reply.OK, staleness, -1, 0], dtype=torch.int64)
        self._send(request, header, weights)

    def _send(self, request: _Request, header: Tensor, weights: Tensor) -> None:
        """Send a reply to ``request``'s worker (this rank's own: through :attr:`local_replies`)."""
        if request.worker == self.rank:
            self.local_replies.put((header, weights))
            return
        if request.worker in self._gone:
            return  # it said goodbye or stopped: nobody waits for the answer
        try:
            dist.send(header, group=self.reply_group, group_dst=request.worker)
            dist.send(weights, group=self.reply_group, group_dst=request.worker)
            if self.stats is not None:
                self.stats.add(sent=weights.numel() * weights.element_size())
        except Exception:  # the worker died while we answered
            self._gone.add(request.worker)
            self.failure = self.failure or (request.worker, StopReason.LOST)
