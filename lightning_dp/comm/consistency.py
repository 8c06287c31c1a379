"""Bounded staleness (SSP) and asynchronous parameter servers: every worker pushes and pulls at its own pace.

The synchronous schemes make every step of every rank wait for every rank's gradients. Here a server applies each
worker's gradient as soon as it arrives, and a worker waits only for what its consistency model demands:

- ``staleness=k`` (Stale Synchronous Parallel, Ho et al. 2013): a worker about to compute its step ``c`` (its
  *clock*: the number of gradients it has pushed) reads weights that hold every worker's updates of steps
  ``0 .. c - k - 1`` at least; it blocks only when a slower worker would break that. ``k = 0`` is synchronous.
- ``staleness=None``: asynchronous; a worker never waits for another.

The staleness a worker sees at step ``c`` is ``c - m``, where ``m`` is the smallest clock among the workers whose
updates its weights hold (``m`` steps of every worker are in them); SSP keeps it at most ``k``.

Each arriving gradient is applied alone, as one step of the user's optimizer on a batch ``N`` times smaller than
the synchronous step's, with the learning rate scaled as the batch-size scaling rules say keeps the training the
same (:func:`arrival_lr_scale`): ``lr / N`` for SGD and the other optimizers linear in the gradient (the linear
scaling rule: ``N`` arrivals move the weights as far as one synchronous step of their average), ``lr / sqrt(N)``
for the adaptive ones (Adam, RMSprop, ...), whose step is normalized by the gradient's running RMS, which one
worker's smaller batch makes ``sqrt(N)`` times noisier (the square-root scaling rule for adaptive optimizers).
Decoupled weight decay (AdamW's) is scaled so that a round of ``N`` arrivals decays the weights as one synchronous
step does. No delay compensation is applied to stale gradients.

Roles (every rank is a worker; a rank that serves a share of the weights also runs a :class:`StalenessServer`):

- :class:`PushLayout`: which elements of the flat gradient buckets each server serves, and a message's layout:
  the served elements of every bucket in bucket order, then every bucket's used-flags.
- :class:`StalenessServer`: a serving thread with its own copy of its share of the weights and the optimizer
  state (a :class:`~lightning_dp.comm.sharded_optimizer.ShardedOptimizer` over a
  :class:`~lightning_dp.comm.sharded_optimizer.ShardLayout` with its own storage), fed by one receiving thread
  per remote worker, so it keeps serving while its rank trains.
- :class:`StalenessClient`: a worker's side: :meth:`~StalenessClient.push` sends the gradients to every server and
  returns once the new weights satisfying the bound are in the parameters; :meth:`~StalenessClient.flush` (every
  worker at the same clock, e.g. before validation or a checkpoint) gives every worker the same weights, holding
  every update.

Messages travel on two process groups of their own (gloo), ``push_group`` from workers to servers and
``reply_group`` back, both meant to be created with a long timeout: a server waits for a worker's next message
however long the worker validates, and a flush waits for the slowest worker's remaining steps; a push's own waits
are bounded by the client's ``timeout``. A dead peer's closed sockets end any wait at once. A worker that dies,
aborts or pushes a non-finite gradient makes every server answer every later request with a failure naming it, so
no worker waits for it; a worker that finished (said goodbye) holds nobody back any more.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.errors import NonFiniteGradientError, PeerUnreachableError
from lightning_dp.comm.peers import wait_naming_peer
from lightning_dp.comm.sharded_optimizer import Segment, ShardedOptimizer, ShardLayout
from lightning_dp.comm.stats import CommStats

# request kinds (worker -> server); LOST is a receiving thread's note that its worker is gone
PUSH, FLUSH, BYE, ABORT, LOST = 1, 2, 3, 4, 5
# reply status (server -> worker)
OK, FAILED = 0, 1
#: why a run stops, carried by ABORT requests and FAILED replies
REASON_LOST, REASON_NONFINITE, REASON_ERROR, REASON_TERMINATED = 1, 2, 3, 4
_REASONS = {REASON_LOST: "is unreachable (it died or its link is down)",
            REASON_NONFINITE: "pushed a non-finite (NaN or infinite) gradient",
            REASON_ERROR: "stopped with an error",
            REASON_TERMINATED: "was asked to terminate (SIGTERM)"}  # fmt: skip
#: ``[kind, clock, optimizer index, reason]`` and ``[status, staleness, culprit rank, reason]``
HEADER_LEN = 4

#: optimizers whose step is normalized by a running average of the squared gradient (see :func:`arrival_lr_scale`)
ADAPTIVE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Adafactor")
    if hasattr(torch.optim, name)
)


def arrival_lr_scale(optimizer: torch.optim.Optimizer, num_workers: int) -> float:
    """The factor on ``optimizer``'s learning rate for one worker's gradient applied alone among ``num_workers``:
    ``1 / sqrt(N)`` for :data:`ADAPTIVE_OPTIMIZERS`, ``1 / N`` otherwise (see the module docstring)."""
    if isinstance(optimizer, ADAPTIVE_OPTIMIZERS):
        return 1.0 / math.sqrt(num_workers)
    return 1.0 / num_workers


def arrival_scale(optimizer: torch.optim.Optimizer, num_workers: int) -> dict[str, float]:
    """Factors on ``optimizer``'s hyperparameters for one arriving gradient: the learning rate's
    (:func:`arrival_lr_scale`), and for decoupled weight decay (``lr * weight_decay`` per step: AdamW's, Adafactor's,
    Adam's with ``decoupled_weight_decay=True``) the one that
    makes ``N`` arrivals decay the weights by ``lr * weight_decay``, as one synchronous step."""
    lr = arrival_lr_scale(optimizer, num_workers)
    scale = {"lr": lr}
    decoupled_classes = tuple(getattr(torch.optim, n) for n in ("AdamW", "Adafactor") if hasattr(torch.optim, n))
    groups = [optimizer.defaults, *optimizer.param_groups]
    decoupled = isinstance(optimizer, decoupled_classes) or any(g.get("decoupled_weight_decay", False) for g in groups)
    if decoupled:
        scale["weight_decay"] = 1.0 / (num_workers * lr)
    return scale


def check_staleness(value: object) -> int | None:
    """``None`` (asynchronous) or an integer >= 0; raises ``ValueError`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"staleness must be an integer >= 0 or None (asynchronous), got {value!r}")
    return value


@dataclass
class StalenessRecord:
    """The staleness a worker saw at each of its steps: how many steps the slowest worker's updates in its weights
    lagged behind its own clock."""

    histogram: Counter[int] = field(default_factory=Counter)

    def add(self, staleness: int) -> None:
        self.histogram[staleness] += 1

    @property
    def max(self) -> int:
        return max(self.histogram, default=0)

    @property
    def steps(self) -> int:
        return sum(self.histogram.values())

    def mean(self) -> float:
        return sum(k * n for k, n in self.histogram.items()) / self.steps if self.steps else 0.0


class PushLayout:
    """Where server ``s``'s share lies in the buckets (``segments[b][s]``) and how its messages are laid out."""

    def __init__(self, buckets: Sequence[GradientBucket], segments: Sequence[Sequence[Segment]], size: int) -> None:
        self.buckets = list(buckets)
        self.segments = segments
        self.numel = [sum(end - start for start, end in (segments[b.index][s] for b in buckets)) for s in range(size)]
        #: the servers: ranks that serve any element
        self.servers = [s for s in range(size) if self.numel[s] > 0]
        self.flag_base: list[int] = []
        base = 0
        for bucket in self.buckets:
            self.flag_base.append(base)
            base += len(bucket.params)
        self.num_flags = base
        self.dtype = self.buckets[0].buffer.dtype if self.buckets else torch.float32

    def message_numel(self, server: int) -> int:
        return self.numel[server] + self.num_flags

    def gradients_for(self, server: int) -> Tensor:
        """Server ``server``'s message from the buckets' current contents (gradients and flags)."""
        parts = [b.buffer[slice(*self.segments[b.index][server])] for b in self.buckets]
        return torch.cat(parts + [b.flags for b in self.buckets])

    def write_weights(self, server: int, weights: Tensor) -> None:
        """Put server ``server``'s share of the weights (``weights``, laid out as its storage) into the parameters."""
        offset = 0
        for bucket in self.buckets:
            start, end = self.segments[bucket.index][server]
            if end > start:
                bucket.write_params(start, end, weights[offset : offset + end - start])
                offset += end - start

    def flag_index(self, bucket: GradientBucket, index_in_bucket: int, server: int) -> int:
        """Where a parameter's used-flag lies in a message to ``server``."""
        return self.numel[server] + self.flag_base[bucket.index] + index_in_bucket


@dataclass(eq=False)
class _Request:
    worker: int
    kind: int
    clock: int
    optimizer_index: int = 0
    reason: int = 0
    payload: Tensor | None = None


def _describe(culprit: int, reason: int) -> str:
    return f"rank {culprit} {_REASONS.get(reason, 'stopped')}"


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
                if kind == PUSH:
                    payload = torch.empty(size, dtype=self.push_layout.dtype)
                    dist.recv(payload, group=self.push_group, group_src=worker)
                    if self.stats is not None:
                        self.stats.add(received=payload.numel() * payload.element_size())
            except Exception:  # the worker's sockets closed: it died
                self.inbox.put(_Request(worker, LOST, 0, reason=REASON_LOST))
                return
            self.inbox.put(_Request(worker, kind, clock, index, reason, payload))
            if kind in (BYE, ABORT):
                return

    def _serve(self) -> None:
        while len(self._gone) < self.size:
            request = self.inbox.get()
            try:
                self._handle(request)
                self._answer()
            except Exception as error:  # noqa: BLE001 - a failed update stops the run on every rank, named
                self.error = self.error or error
                self.failure = self.failure or (self.rank, REASON_ERROR)
                self._answer()

    def _handle(self, request: _Request) -> None:
        if request.kind == PUSH:
            self.clock[request.worker] = request.clock
            self._pending.append(request)  # first: if the update fails, this request is answered with the failure
            if self.failure is None:
                assert request.payload is not None
                with self.lock:
                    self._apply(request.optimizer_index, request.payload)
        elif request.kind == FLUSH:
            self._flushing.append(request)
        elif request.kind == BYE:
            self._gone.add(request.worker)
            self._finished.add(request.worker)
        else:  # ABORT, LOST
            self._gone.add(request.worker)
            self.failure = self.failure or (request.worker, request.reason)

    def _apply(self, optimizer_index: int, payload: Tensor) -> None:
        """One arriving gradient: one step of its optimizer over this server's share, the learning rate scaled."""
        sharded = self.optimizers[optimizer_index]
        pieces = {id(pc) for pc in sharded.pieces}
        for piece, flag_at in zip(self.layout.pieces, self._flag_at):
            if id(piece) in pieces:
                used = bool(payload[flag_at] != 0)
                n = piece.tensor.numel()
                grad = payload[piece.storage_start : piece.storage_start + n].view_as(piece.tensor)
                piece.tensor.grad = grad if used else None
        sharded.step(scale=self._scales[optimizer_index])

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
            culprit, reason = self.failure or (self.rank, REASON_ERROR)
            header = torch.tensor([FAILED, 0, culprit, reason], dtype=torch.int64)
            weights = torch.zeros(self.layout.storage.numel(), dtype=self.layout.storage.dtype)
        else:
            header = torch.tensor([OK, staleness, -1, 0], dtype=torch.int64)
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
            self.failure = self.failure or (request.worker, REASON_LOST)


class StalenessClient:
    """A worker's side of the protocol (see the module docstring): push gradients, pull weights within the bound.

    ``layout``'s buckets hold the gradients to push (the caller fills them) and lay out the parameters; ``server`` is
    this rank's own :class:`StalenessServer` when it serves a share. ``timeout`` (seconds) bounds every wait of a
    push: for a message to leave and for the servers' answer, which the bound may hold back while a slower worker
    catches up (as a synchronous step waits for the slowest). A flush waits without a deadline, since the slowest
    rank may still have the rest of its epoch to run; a dead peer ends any wait at once (its sockets close), and
    the reply group's own timeout should be long.
    """

    def __init__(
        self,
        layout: PushLayout,
        rank: int,
        push_group: dist.ProcessGroup,
        reply_group: dist.ProcessGroup,
        server: StalenessServer | None,
        timeout: float,
        stats: CommStats | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.push_group, self.reply_group = push_group, reply_group
        self.server = server
        self.timeout = timeout
        self.stats = stats
        #: gradients pushed so far
        self.clock = 0
        self.closed = False

    def push(self, optimizer_index: int = 0) -> int:
        """Send the buckets' gradients to every server, then put the new weights into the parameters once the bound
        allows this worker's next step; returns the staleness of those weights."""
        self.clock += 1
        return self._exchange(PUSH, optimizer_index)

    def flush(self) -> None:
        """Collective (every worker at the same clock): every worker gets the same weights, holding every update."""
        self._exchange(FLUSH, 0)

    def _exchange(self, kind: int, optimizer_index: int) -> int:
        header = torch.tensor([kind, self.clock, optimizer_index, 0], dtype=torch.int64)
        sends, receives, local = [], {}, None
        for server in self.layout.servers:
            payload = self.layout.gradients_for(server) if kind == PUSH else None
            if server == self.rank:
                local = payload
                continue
            sends.append((server, dist.isend(header, group=self.push_group, group_dst=server)))
            if payload is not None:
                sends.append((server, dist.isend(payload, group=self.push_group, group_dst=server)))
                if self.stats is not None:
                    self.stats.add(sent=payload.numel() * payload.element_size())
            reply = torch.empty(HEADER_LEN, dtype=torch.int64)
            weights = torch.empty(self.layout.numel[server], dtype=self.layout.dtype)
            works = [dist.irecv(t, group=self.reply_group, group_src=server) for t in (reply, weights)]
            receives[server] = (reply, weights, works)
        replies: dict[int, tuple[Tensor, Tensor]] = {}
        if self.server is not None:
            self.server.submit(_Request(self.rank, kind, self.clock, optimizer_index, 0, local))
            replies[self.rank] = self._local_reply(self.timeout if kind == PUSH else None)
        deadline = timedelta(seconds=self.timeout) if kind == PUSH else None
        for server, work in sends:
            self._wait(work, server, "send its gradients to", timedelta(seconds=self.timeout))
        for server, (reply, weights, works) in receives.items():
            for work in works:
                self._wait(work, server, "receive the weights from", deadline)
            if self.stats is not None:
                self.stats.add(received=weights.numel() * weights.element_size())
            replies[server] = (reply, weights)
        staleness = 0
        for reply, _ in replies.values():
            status, seen, culprit, reason = (int(v) for v in reply.tolist())
            if status != OK:
                self._raise_failure(culprit, reason)
            staleness = max(staleness, seen)
        for server, (_, weights) in replies.items():
            self.layout.write_weights(server, weights)
        return staleness

    def _local_reply(self, timeout: float | None) -> tuple[Tensor, Tensor]:
        assert self.server is not None
        try:
            if timeout is None:  # no deadline, but a server that stopped serving ends the wait
                while True:
                    try:
                        return self.server.local_replies.get(timeout=1.0)
                    except queue.Empty:
                        if not self.server.serving:
                            raise
            return self.server.local_replies.get(timeout=timeout)
        except queue.Empty:
            slowest = min(self.server.clock)
            if timeout is None:
                raise PeerUnreachableError(
                    f"rank {self.rank}: its server stopped serving during a flush at step {self.clock}"
                ) from None
            raise PeerUnreachableError(
                f"rank {self.rank} waited {self.timeout:.0f} s for its step {self.clock} to be allowed by its server "
                f"(rank {self.rank}); the slowest worker there is at step {slowest} (clocks {self.server.clock}): a "
                "worker is far behind or hung. Raise the strategy's timeout if a worker is legitimately that slow."
            ) from None

    def _wait(self, work: dist.Work | None, server: int, action: str, timeout: timedelta | None = None) -> None:
        me = f"rank {self.rank}"
        wait_naming_peer(work, me, action, f"its server rank {server} at step {self.clock}", timeout)

    def _raise_failure(self, culprit: int, reason: int) -> None:
        if culprit == self.rank and self.server is not None and self.server.error is not None:
            raise self.server.error
        message = f"rank {self.rank} stops at step {self.clock}: {_describe(culprit, reason)}"
        if reason == REASON_NONFINITE:
            raise NonFiniteGradientError(message)
        raise PeerUnreachableError(message)

    def close(self, reason: int | None = None, timeout: float = 10.0) -> None:
        """Tell every server this worker is done (``reason=None``) or stops the run (an ABORT ``reason``), then wait
        for this rank's own server to finish serving the others. Never raises for a peer that is already gone."""
        if self.closed:
            return
        self.closed = True
        kind = BYE if reason is None else ABORT
        header = torch.tensor([kind, self.clock, 0, reason or 0], dtype=torch.int64)
        works = []
        for server in self.layout.servers:
            if server == self.rank:
                continue
            try:
                works.append(dist.isend(header, group=self.push_group, group_dst=server))
            except Exception:  # noqa: BLE001, S112 - the server is gone already
                continue
        for work in works:
            try:
                if work is not None:
                    work.wait(timedelta(seconds=timeout))
            except Exception:  # noqa: BLE001, S112
                continue
        if self.server is not None:
            self.server.submit(_Request(self.rank, kind, self.clock, reason=reason or 0))
            self.server.join(timeout)
