"""Backup workers (Chen et al., "Revisiting Distributed Synchronous SGD", 2016): each synchronous step aggregates
the first ``N - b`` gradients to reach the servers and drops the rest.

A step ``s`` is *open* until the coordinating server (the lowest-ranked one) has received ``N - b`` pushes of step
``s``; those workers are the step's members, and the coordinator tells every other server who they are, so every
share of the weights is updated with the same members' gradients: their mean, under the optimizer's own learning
rate (the step is a synchronous step over a global batch ``(N - b) / N`` as large; no learning-rate scaling). The
members get the new weights ``w(s + 1)``.

A gradient of a closed step is *late*: it is dropped and counted, and its worker gets ``w(s + 1)`` all the same. A
worker that starts a step already closed does not compute it (*skips* it) and also gets ``w(s + 1)``, so every
worker holds, after its step ``s``, the weights every other worker holds after its step ``s``; a persistently slow
worker keeps up by skipping. Servers keep the last :data:`HISTORY` versions of their share for late workers; one
further behind gets the newest weights and skips up to them.

Messages ride the staleness protocol's groups (:mod:`lightning_dp.comm.consistency`): requests carry the step in
their clock field, replies ``[status, version, accepted, reason]`` where ``version`` counts the steps the server has
closed. The coordinator's decisions travel on a third group.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.consistency.client import StalenessClient
from lightning_dp.comm.consistency.protocol import PushLayout, Reply, Request, _Request
from lightning_dp.comm.consistency.server import StalenessServer
from lightning_dp.comm.servers.sharded_optimizer import Segment, ShardedOptimizer, ShardLayout, hyperparameters
from lightning_dp.comm.stats import CommStats

#: versions of its share a server keeps for workers that are behind
HISTORY = 8


def check_backup_workers(backups: object, workers: int | None = None) -> int:
    """An integer ``b >= 0``, below ``workers`` when given; raises ``ValueError`` otherwise."""
    if isinstance(backups, bool) or not isinstance(backups, int) or backups < 0:
        raise ValueError(f"backup_workers must be an integer >= 0, got {backups!r}")
    if workers is not None and backups >= workers:
        raise ValueError(
            f"backup_workers={backups} leaves no gradient to aggregate among {workers} workers: each step uses the "
            f"first N - b to arrive, so b must be below N ({workers})"
        )
    return backups


def _numeric(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Hyperparameters:
    """A user optimizer's numeric hyperparameters (``lr``, ``betas``, ``weight_decay``, ...) of every parameter
    group as float64 values, which every push carries: a server steps with those of the step's members, not with
    its own rank's optimizer, whose schedule a slow rank's loop may not have advanced yet. Which keys travel (and
    their tuple lengths) is read once from ``optimizer``; tensors and flags stay the server's own."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.template = [
            [(key, len(value) if isinstance(value, tuple) else 0, type(value[0] if isinstance(value, tuple) else value))
             for key, value in sorted(hyperparameters(group).items())
             if _numeric(value) or (isinstance(value, tuple) and value and all(map(_numeric, value)))]
            for group in optimizer.param_groups
        ]  # fmt: skip
        self.count = sum(max(1, n) for group in self.template for _, n, _ in group)

    def encode(self, optimizer: torch.optim.Optimizer) -> Tensor:
        values: list[float] = []
        for group, keys in zip(optimizer.param_groups, self.template):
            for key, n, _ in keys:
                values += [float(v) for v in group[key]] if n else [float(group[key])]
        return torch.tensor(values, dtype=torch.float64)

    def decode(self, values: Tensor) -> list[dict]:
        flat = values.tolist()
        groups, i = [], 0
        for keys in self.template:
            group: dict = {}
            for key, n, kind in keys:
                if n:
                    group[key] = tuple(kind(v) for v in flat[i : i + n])
                else:
                    group[key] = kind(flat[i])
                i += max(1, n)
            groups.append(group)
        return groups


class BackupPushLayout(PushLayout):
    """A push's layout with the worker's hyperparameters (:class:`Hyperparameters`) after the used-flags, as float64
    values seen as the buckets' dtype (set :meth:`set_hyperparameters` before each push)."""

    def __init__(
        self,
        buckets: Sequence[GradientBucket],
        segments: Sequence[Sequence[Segment]],
        size: int,
        hyper: Hyperparameters,
    ) -> None:
        super().__init__(buckets, segments, size)
        self.hyper = hyper
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self.words = hyper.count * 8 // itemsize
        self._values = torch.zeros(self.words, dtype=self.dtype)

    def message_numel(self, server: int) -> int:
        return super().message_numel(server) + self.words

    def gradients_for(self, server: int) -> Tensor:
        return torch.cat([super().gradients_for(server), self._values])

    def set_hyperparameters(self, optimizer: torch.optim.Optimizer) -> None:
        self._values = self.hyper.encode(optimizer).view(self.dtype)

    def hyperparameters_of(self, payload: Tensor) -> list[dict]:
        """The per-group hyperparameters a push carries."""
        return self.hyper.decode(payload[payload.numel() - self.words :].clone().view(torch.float64))


class BackupServer(StalenessServer):
    """Serves this rank's share with backup workers (see the module docstring): step ``version`` closes with the
    first ``size - backups`` pushes, as the server ``coordinator`` decides them.

    ``dropped``: the late gradients this server dropped, per worker."""

    def __init__(
        self,
        layout: ShardLayout,
        optimizers: Sequence[ShardedOptimizer],
        push_layout: BackupPushLayout,
        rank: int,
        size: int,
        backups: int,
        push_group: dist.ProcessGroup,
        reply_group: dist.ProcessGroup,
        decide_group: dist.ProcessGroup,
        stats: CommStats | None = None,
    ) -> None:
        super().__init__(layout, optimizers, push_layout, rank, size, 0, push_group, reply_group, stats)
        self.quorum = size - check_backup_workers(backups, size)
        self.coordinator = push_layout.servers[0]
        self.decide_group = decide_group
        #: steps closed so far
        self.version = 0
        self.history: dict[int, Tensor] = {}
        self.dropped = [0] * size
        self._scales = [{} for _ in self.optimizers]  # a step's mean steps under the optimizer's own hyperparameters
        self._candidates: dict[int, _Request] = {}  # pushes of the open step, in arrival order
        self._decisions: dict[int, set[int]] = {}  # step -> its members
        self._behind: list[_Request] = []  # late pushes and skips, answered once their step has closed here
        if rank != self.coordinator:
            self._threads.append(threading.Thread(target=self._receive_decisions, daemon=True, name="lddp-decide"))

    # ------------------------------------------------------------------ threads
    def _receive_decisions(self) -> None:
        message = torch.empty(1 + self.size, dtype=torch.int64)
        while True:
            try:
                dist.recv(message, group=self.decide_group, group_src=self.coordinator)
            except Exception:  # noqa: BLE001 - the coordinator is gone: its worker's receiving thread says so
                return
            if int(message[0]) < 0:
                return
            self.inbox.put(_Request(self.coordinator, Request.DECIDED, int(message[0]), payload=message.clone()))

    def _serve(self) -> None:
        super()._serve()
        if self.rank == self.coordinator:
            self._announce(-1, set())

    def _announce(self, version: int, members: set[int]) -> None:
        message = torch.tensor([version] + [int(w in members) for w in range(self.size)], dtype=torch.int64)
        for server in self.push_layout.servers:
            if server != self.rank:
                try:
                    dist.send(message, group=self.decide_group, group_dst=server)
                except Exception:  # noqa: BLE001, S112 - a server that is gone learns nothing more
                    continue

    # ------------------------------------------------------------------ requests
    def _handle(self, request: _Request) -> None:
        if request.kind == Request.PUSH:
            self._pending.append(request)  # answered when its step closes, or with the failure
            if request.clock < self.version:
                self._drop(request)
            elif request.clock == self.version:
                self._candidates[request.worker] = request
            else:
                raise RuntimeError(
                    f"rank {request.worker} pushed step {request.clock}, but step {self.version} is open"
                )
        elif request.kind == Request.SKIP:
            self._pending.append(request)
            self._behind.append(request)
        elif request.kind == Request.DECIDED:
            assert request.payload is not None
            self._decisions[request.clock] = {w for w in range(self.size) if int(request.payload[1 + w])}
        else:
            super()._handle(request)
            return
        if self.failure is None:
            self._progress()

    def _drop(self, request: _Request) -> None:
        self.dropped[request.worker] += 1
        self._behind.append(request)

    def _progress(self) -> None:
        """Close every step whose members' gradients are all in."""
        while True:
            if self.rank == self.coordinator and self.version not in self._decisions:
                if len(self._candidates) < self.quorum:
                    return
                members = set(list(self._candidates)[: self.quorum])
                self._decisions[self.version] = members
                self._announce(self.version, members)
            members = self._decisions.get(self.version, set())
            if not members:
                return
            for worker in [w for w in self._candidates if w not in members]:
                self._drop(self._candidates.pop(worker))
            if not members <= self._candidates.keys():
                return
            self._close([self._candidates.pop(w) for w in sorted(members)])

    def _close(self, members: list[_Request]) -> None:
        """The open step's update from its members' gradients (their mean), then their replies."""
        total = members[0].payload
        assert total is not None
        total = total.clone()
        for request in members[1:]:
            assert request.payload is not None
            total += request.payload
        numel = self.push_layout.numel[self.rank]
        total[:numel] /= len(members)  # the used-flags stay summed: a parameter any member used has a gradient
        assert isinstance(self.push_layout, BackupPushLayout)
        first = members[0].payload
        assert first is not None
        values = self.push_layout.hyperparameters_of(first)  # the step's, as its members hold them
        with self.lock:
            self._apply(members[0].optimizer_index, total, values)
            weights = self.layout.storage.clone()
        del self._decisions[self.version]
        self.version += 1
        self.history[self.version] = weights
        self.history.pop(self.version - HISTORY, None)
        for request in members:
            self._send_reply(request, weights, accepted=True)

    def _answer(self) -> None:
        if self.failure is not None:
            super()._answer()
            return
        for request in [r for r in self._behind if r.clock < self.version]:
            self._behind.remove(request)
            weights = self.history.get(request.clock + 1, self.history.get(self.version))
            assert weights is not None
            self._send_reply(request, weights, accepted=False)
        if self._flushing and len(self._flushing) == self.size - len(self._finished):  # all at the same step
            flushing, self._flushing = self._flushing, []
            with self.lock:
                weights = self.layout.storage.clone()
            for request in flushing:
                self._send_reply(request, weights, accepted=True)

    def _send_reply(self, request: _Request, weights: Tensor, accepted: bool) -> None:
        if request in self._pending:
            self._pending.remove(request)
        header = torch.tensor([Reply.OK, self.version, int(accepted), 0], dtype=torch.int64)
        self._send(request, header, weights)


class BackupClient(StalenessClient):
    """A worker's side with backup workers: :meth:`push` its step's gradients (accepted or late), :meth:`skip` a
    step already closed, :meth:`flush` as under staleness. :attr:`clock` counts the steps done, :attr:`closed_through`
    the steps every server has closed (a step below it is skipped)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        #: steps before this one are closed on every server
        self.closed_through = 0
        #: this worker's gradients that arrived late and were dropped, and the steps it skipped
        self.late = 0
        self.skipped = 0

    def push(self, optimizer_index: int = 0) -> int:
        """Send this step's gradients; the weights after the step into the parameters. Returns 1 if the step used
        them, 0 if they were late."""
        accepted = self._conclude_step(self._send_and_receive(Request.PUSH, optimizer_index))
        self.late += not accepted
        return int(accepted)

    def skip(self) -> None:
        """This step closed without this worker: take the weights after it."""
        self._conclude_step(self._send_and_receive(Request.SKIP, 0))
        self.skipped += 1

    @property
    def step_is_closed(self) -> bool:
        """Whether the step about to run has closed already (then :meth:`skip` it)."""
        return self.clock < self.closed_through

    def flush(self) -> None:
        replies = self._send_and_receive(Request.FLUSH, 0)
        self._conclude(replies)
        self.closed_through = min(int(header[1]) for header, _ in replies.values())

    def _conclude_step(self, replies: dict[int, tuple[Tensor, Tensor]]) -> bool:
        self._conclude(replies)  # raises a failure, writes the weights
        self.clock += 1
        self.closed_through = min(int(header[1]) for header, _ in replies.values())
        return all(int(header[2]) == 1 for header, _ in replies.values())
