"""A worker's side of the staleness protocol (see :mod:`lightning_dp.comm.consistency`)."""

from __future__ import annotations

import queue
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.cluster.peers import wait_naming_peer
from lightning_dp.comm.consistency.protocol import (
    HEADER_LEN,
    PushLayout,
    Reply,
    Request,
    StopReason,
    _describe,
    _Request,
)
from lightning_dp.comm.consistency.server import StalenessServer
from lightning_dp.comm.errors import NonFiniteGradientError, PeerUnreachableError
from lightning_dp.comm.stats import CommStats


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
        return self._exchange(Request.PUSH, optimizer_index)

    def flush(self) -> None:
        """Collective (every worker at the same clock): every worker gets the same weights, holding every update."""
        self._exchange(Request.FLUSH, 0)

    def _exchange(self, kind: int, optimizer_index: int) -> int:
        return self._conclude(self._send_and_receive(kind, optimizer_index))

    def _send_and_receive(self, kind: int, optimizer_index: int) -> dict[int, tuple[Tensor, Tensor]]:
        """Send a request of ``kind`` (with the buckets' gradients for a push) to every server; every server's
        ``(reply header, weights)``."""
        header = torch.tensor([kind, self.clock, optimizer_index, 0], dtype=torch.int64)
        sends, receives, local = [], {}, None
        for server in self.layout.servers:
            payload = self.layout.gradients_for(server) if kind == Request.PUSH else None
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
            replies[self.rank] = self._local_reply(self.timeout if kind == Request.PUSH else None)
        deadline = timedelta(seconds=self.timeout) if kind == Request.PUSH else None
        for server, work in sends:
            self._wait(work, server, "send its gradients to", timedelta(seconds=self.timeout))
        for server, (reply, weights, works) in receives.items():
            for work in works:
                self._wait(work, server, "receive the weights from", deadline)
            if self.stats is not None:
                self.stats.add(received=weights.numel() * weights.element_size())
            replies[server] = (reply, weights)
        return replies

    def _conclude(self, replies: dict[int, tuple[Tensor, Tensor]]) -> int:
        """Raise a failure any server reported, else put the weights into the parameters and return the staleness
        of those weights."""
        staleness = 0
        for reply, _ in replies.values():
            status, seen, culprit, reason = (int(v) for v in reply.tolist())
            if status != Reply.OK:
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
        if reason == StopReason.NONFINITE:
            raise NonFiniteGradientError(message)
        raise PeerUnreachableError(message)

    def close(self, reason: int | None = None, timeout: float = 10.0) -> None:
        """Tell every server this worker is done (``reason=None``) or stops the run (a :class:`StopReason`), then
        wait for this rank's own server to finish serving the others. Never raises for a peer that is already gone."""
        if self.closed:
            return
        self.closed = True
        kind = Request.BYE if reason is None else Request.ABORT
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
