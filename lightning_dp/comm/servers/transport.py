"""The trainers' side of dedicated servers: a transport whose buckets travel to the servers, and control."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.servers.members import MemberGroup, Tag
from lightning_dp.comm.servers.plan import Control, _header
from lightning_dp.comm.servers.sharded_optimizer import (
    Segment,
)
from lightning_dp.comm.servers.split import member_segments
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports import Transport
from lightning_dp.comm.transports.shards import _average_in_rank_order
from lightning_dp.comm.transports.staging import Staging


class DedicatedServerTransport(Transport):
    """The trainers' side of dedicated servers (see the module docstring). ``group`` is the trainers' own gradient
    group (its ring carries the trainers' votes); the exchanges run on ``members``. :meth:`reduce` pushes each
    owner its share of the bucket (and the used-flags) and averages this trainer's own share; :meth:`share` brings
    back the averaged gradients (when the hooks read them); :meth:`share_weights` the new weights. GPU buckets are
    staged through pinned CPU memory (blocking copies on the communication thread's stream)."""

    def __init__(
        self,
        members: MemberGroup,
        shares: Sequence[float],
        whole_parameters: bool,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(group, stats)
        self.members = members
        self.me = members.rank
        self.shares = list(shares)
        self.whole_parameters = whole_parameters
        self.timeout = timeout
        self.segments: list[list[Segment]] = []
        #: synchronizations started so far (trainer 0 tells the servers how many a step follows)
        self.syncs = 0
        self._num_buckets = 0
        self._staging: dict[int, Tensor] = {}
        #: set around a step's backward when the servers update each bucket as it arrives (see :meth:`arm`)
        self._eager: dict[str, Any] | None = None
        self._sent: list[tuple[dist.Work | None, int, str]] = []
        self._buckets: list[GradientBucket] = []
        self._arriving: dict[int, tuple[list[tuple[dist.Work | None, int, str]], dict[int, tuple[Tensor, Tensor]]]]
        self._arriving = {}
        self._pending: list[tuple[dist.Work | None, int, GradientBucket, Segment, Tensor | None]] = []

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:
        self._buckets = list(buckets)
        self.segments = member_segments(buckets, self.shares, self.whole_parameters)
        self._num_buckets = len(buckets)
        for b in buckets:
            if b.buffer.is_cuda:
                self._staging[b.index] = torch.empty(b.buffer.shape, dtype=b.buffer.dtype, pin_memory=True)

    def _default_staging(self, buckets: Sequence[GradientBucket]) -> Staging:
        # the exchanges run on the member group and outlive one call (an armed backward's weights arrive later):
        # the transport keeps its own pinned host copies (``_staging``)
        return Staging()

    @property
    def crosses_network(self) -> bool:
        return True

    def owned(self, bucket: GradientBucket) -> Segment:
        start, end = self.segments[bucket.index][self.me]
        return (start, end)

    def _host(self, bucket: GradientBucket) -> Tensor:
        """The bucket's CPU copy (itself on CPU)."""
        return self._staging.get(bucket.index, bucket.buffer)

    def _to_host(self, bucket: GradientBucket) -> Tensor:
        host = self._host(bucket)
        if host is not bucket.buffer:
            host.copy_(bucket.buffer)  # blocking: ordered after the producing stream's work
        return host

    def _from_host(self, bucket: GradientBucket, ranges: Sequence[Segment]) -> None:
        host = self._host(bucket)
        if host is not bucket.buffer:
            for start, end in ranges:
                bucket.buffer[start:end].copy_(host[start:end])

    def _owners(self, bucket: GradientBucket) -> list[tuple[int, Segment]]:
        return [(m, (s, e)) for m, (s, e) in enumerate(self.segments[bucket.index]) if e > s]

    def arm(self, control: dict[str, Any]) -> None:
        """The next synchronization is a step's: the servers update each piece of their shares as soon as every
        trainer's copy of it is in, with ``control`` (trainer 0's: hyperparameters, clipping by value, step
        arguments), and send its new weights back at once, while later pieces are still being pushed;
        :meth:`finish_eager` collects them."""
        self._eager = control

    def disarm(self) -> None:
        self._eager = None

    def _reduce(self, bucket: GradientBucket) -> None:
        if bucket.index == 0:
            self.syncs += 1
            if self.me == 0:
                self._announce_sync()
        host = self._to_host(bucket)
        flags = host[bucket.grad_numel :]
        flags_out = flags.clone()  # this trainer's own flags, while its share's flags sum everyone's below
        if bucket.index == 0:  # this trainer's share of every bucket: announced before any of its pushes leaves
            self._arriving = {b.index: self._receive_share(b) for b in self._buckets}
        start, end = self.owned(bucket)
        works, received = self._arriving.pop(bucket.index, ([], {}))
        if self._eager is not None:  # the servers' new weights of this bucket, waited for after backward
            for owner, (s, e) in self._owners(bucket):
                if owner >= self.members.num_trainers:  # in pieces as the server steps them, then its status
                    self._pending.append(
                        (self.members.irecv(host[s:e], owner, Tag.WEIGHTS), owner, bucket, (s, e), None)
                    )
                    status = torch.zeros(1, dtype=torch.float64)
                    self._pending.append(
                        (self.members.irecv(status, owner, Tag.WEIGHTS), owner, bucket, (s, e), status)
                    )
        for owner, (s, e) in self._owners(bucket):  # after the receives are announced (see MemberGroup._pieces)
            if owner != self.me:  # not waited for here: the next bucket's push overlaps (see wait_sent)
                # the flags first: the owner steps each piece of the gradients as it arrives
                for tensor in (flags_out, host[s:e]):
                    self._sent.append((self.members.isend(tensor, owner, Tag.GRADIENTS), owner, "push gradients to"))
                self.stats.add(sent=(e - s + flags.numel()) * host.element_size())
        self.members.wait_all(works, self.timeout)
        if received:
            mine = host[start:end]
            parts = [mine if t == self.me else received[t][0] for t in self.members.trainers]
            _average_in_rank_order(parts, len(parts), mine)
            for _, their_flags in received.values():
                flags.add_(their_flags)
            self.stats.add(received=sum((g.numel() + f.numel()) * g.element_size() for g, f in received.values()))
            self._from_host(bucket, [(start, end), (bucket.grad_numel, bucket.buffer.numel())])

    def _announce_sync(self) -> None:
        """Trainer 0, as a synchronization starts: tell every server whether it steps in it (see :meth:`arm`)."""
        for server in self.members.servers:
            self.members.send_object(self._eager, server, self.timeout, Tag.GRADIENTS)

    def _receive_share(
        self, bucket: GradientBucket
    ) -> tuple[list[tuple[dist.Work | None, int, str]], dict[int, tuple[Tensor, Tensor]]]:
        """Start receiving every other trainer's gradients (and flags) of this trainer's share of ``bucket``."""
        start, end = self.owned(bucket)
        works: list[tuple[dist.Work | None, int, str]] = []
        received: dict[int, tuple[Tensor, Tensor]] = {}
        if end > start:
            flags = bucket.buffer[bucket.grad_numel :]
            for t in self.members.trainers:
                if t != self.me:
                    grads = torch.empty(end - start, dtype=bucket.buffer.dtype)
                    their_flags = torch.empty(flags.shape, dtype=flags.dtype)
                    for tensor in (their_flags, grads):  # the order they are sent in (see _reduce)
                        works.append((self.members.irecv(tensor, t, Tag.GRADIENTS), t, "receive gradients from"))
                    received[t] = (grads, their_flags)
        return works, received

    def _share(self, bucket: GradientBucket) -> None:
        """The owners' averaged gradients (and the combined used-flags, from the bucket's first owner)."""
        self._receive_shares(bucket, Tag.AVERAGED, with_flags=True)

    def share_weights(self, bucket: GradientBucket, from_servers: bool = True) -> None:
        """The owners' new weights of ``bucket`` into its gradient region (this trainer packed its own share); only
        the trainers' shares without ``from_servers`` (the servers' came during an armed backward)."""
        self._receive_shares(bucket, Tag.WEIGHTS, with_flags=False, from_servers=from_servers)

    def share_weights_all(self, buckets: Sequence[GradientBucket], from_servers: bool = True) -> None:
        """:meth:`share_weights` of every bucket at once (all messages in flight together)."""
        self.wait_sent()
        started = [(bucket, *self._start_share(bucket, Tag.WEIGHTS, False, from_servers, phase="receive"))
                   for bucket in buckets]  # fmt: skip
        for bucket, works, _ in started:  # every receive announced before any send (see MemberGroup._pieces)
            works += self._start_share(bucket, Tag.WEIGHTS, False, from_servers, phase="send")[0]
        for bucket, works, ranges in started:
            self.members.wait_all(works, self.timeout)
            self._from_host(bucket, ranges)

    def _receive_shares(self, bucket: GradientBucket, tag: int, with_flags: bool, from_servers: bool = True) -> None:
        self.wait_sent()
        works, ranges = self._start_share(bucket, tag, with_flags, from_servers)
        self.members.wait_all(works, self.timeout)
        self._from_host(bucket, ranges)

    def _start_share(
        self, bucket: GradientBucket, tag: int, with_flags: bool, from_servers: bool, phase: str = "both"
    ) -> tuple[list[tuple[dist.Work | None, int, str]], list[Segment]]:
        owners = [(m, seg) for m, seg in self._owners(bucket) if from_servers or m < self.members.num_trainers]
        if not owners:
            return [], []
        host = self._host(bucket)
        start, end = self.owned(bucket)
        if end > start and host is not bucket.buffer:
            host[start:end].copy_(bucket.buffer[start:end])
        works: list[tuple[dist.Work | None, int, str]] = []
        ranges: list[Segment] = []
        phases = {"both": (True, False), "receive": (True,), "send": (False,)}[phase]
        for receiving in phases:  # every receive announced before any send (see MemberGroup._pieces)
            for owner, (s, e) in owners:
                tensors = [host[s:e]] + ([host[bucket.grad_numel :]] if with_flags and owner == owners[0][0] else [])
                if owner == self.me and not receiving:
                    for t in self.members.trainers:
                        if t != self.me:
                            for tensor in tensors:
                                works.append((self.members.isend(tensor, t, tag), t, "send its share to"))
                                self.stats.add(sent=tensor.numel() * tensor.element_size())
                elif owner != self.me and receiving:
                    for tensor in tensors:
                        works.append((self.members.irecv(tensor, owner, tag), owner, "receive its share from"))
                        self.stats.add(received=tensor.numel() * tensor.element_size())
                    ranges.append((s, e))
        if with_flags and owners[0][0] != self.me and True in phases:
            ranges.append((bucket.grad_numel, bucket.buffer.numel()))
        return works, ranges

    def wait_sent(self) -> None:
        """Wait for the pushes still leaving (before anything rewrites the buckets)."""
        sent, self._sent = self._sent, []
        self.members.wait_all(sent, self.timeout)

    def finish_eager(self) -> list[int]:
        """After an armed backward: wait for the servers' new weights (into the buckets' gradient regions); the
        servers that found a non-finite gradient (they left each piece that held one as it was)."""
        self.wait_sent()
        bad = []
        pending, self._pending = self._pending, []
        for work, owner, bucket, (s, e), status in pending:
            self.members.wait(work, owner, "receive the new weights from", self.timeout)
            if status is not None:
                if float(status) != 0.0 and owner not in bad:
                    bad.append(owner)
            else:
                self.stats.add(received=(e - s) * bucket.buffer.element_size())
                self._from_host(bucket, [(s, e)])
        return bad

    # ------------------------------------------------------------------ trainer 0's control messages
    def control(self, kind: int, optimizer_index: int = 0, payload: Any = None) -> None:
        """Trainer 0: send every server a control message (with a pickled ``payload`` if given)."""
        header = _header(kind, optimizer_index, self.syncs)
        for server in self.members.servers:
            self.members.wait(self.members.isend(header, server, Tag.CONTROL), server, "send a control message to",
                              self.timeout)  # fmt: skip
            if kind in (Control.STEP, Control.LOAD, Control.ABORT):
                self.members.send_object(payload, server, self.timeout)

    def send_edited(self, buckets: Sequence[GradientBucket]) -> None:
        """Trainer 0: each server's share of the gradients of ``buckets``' parameters as ``param.grad`` holds them now
        (edited by the hooks; the buckets' contents are overwritten)."""
        self.wait_sent()
        works = []
        for bucket in buckets:
            for i, p in enumerate(bucket.params):
                bucket.fill(i, p.grad)
            host = self._to_host(bucket)
            for owner, (s, e) in self._owners(bucket):
                if owner >= self.members.num_trainers:
                    for tensor in (host[s:e], host[bucket.grad_numel :]):
                        works.append((self.members.isend(tensor, owner, Tag.EDITED), owner, "send gradients to"))
                        self.stats.add(sent=tensor.numel() * tensor.element_size())
        self.members.wait_all(works, self.timeout)

    def send_weights(self, buckets: Sequence[GradientBucket]) -> None:
        """Trainer 0: every server's share of the current parameters (at the start of training, after a restore)."""
        works = []
        for bucket in buckets:
            host = self._host(bucket)
            for owner, (s, e) in self._owners(bucket):
                if owner >= self.members.num_trainers:
                    values = bucket.read_params(s, e, torch.empty(e - s, dtype=host.dtype))
                    works.append((self.members.isend(values, owner, Tag.WEIGHTS), owner, "send weights to"))
        self.members.wait_all(works, self.timeout)

    def vote(self, squares: float, bad: bool) -> tuple[float, bool]:
        """:meth:`MemberGroup.vote` within the strategy's timeout."""
        return self.members.vote(squares, bad, self.timeout)

    def stop_servers(self) -> None:
        """Trainer 0: tell every server the run is over and wait until each has taken it in."""
        self.control(Control.STOP)
        for server in self.members.servers:
            self.members.recv_object(server, self.timeout)

    def server_states(self, optimizer_index: int) -> list:
        """Trainer 0: every server's pieces of optimizer ``optimizer_index``'s state."""
        self.control(Control.STATE, optimizer_index)
        return [self.members.recv_object(server, self.timeout) for server in self.members.servers]

    def close(self) -> None:
        self.members.close()


class RegroupingServerTransport(DedicatedServerTransport):
    """The trainers' side of :class:`~lightning_dp.comm.servers.regroup.RegroupingServer`: the servers hold every
    share (``segments``, where given: ``[b][m]`` as the servers serve them now, else cut by ``shares``); a
    synchronization is announced with ``SYNC`` and complete once every server replied (:meth:`wait_summed`), the vote
    is every server's reply (:meth:`vote_of`)."""

    def __init__(self, *args: Any, segments: list[list[Segment]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fixed_segments = segments
        self._summed = 0

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:
        super()._bind(buckets)
        if self._fixed_segments is not None:
            self.segments = [list(row) for row in self._fixed_segments]

    def _announce_sync(self) -> None:
        self.control(Control.SYNC)

    @property
    def unacknowledged(self) -> bool:
        """Whether a synchronization started whose servers' replies were not taken (:meth:`wait_summed`)."""
        return self.syncs > self._summed

    def _replies(self, numel: int) -> list[Tensor]:
        replies = [torch.zeros(numel, dtype=torch.float64) for _ in self.members.servers]
        works = [(self.members.irecv(reply, server, Tag.REPLY), server, "receive the reply of")
                 for reply, server in zip(replies, self.members.servers)]  # fmt: skip
        self.members.wait_all(works, self.timeout)
        return replies

    def wait_weights_taken(self) -> None:
        """Trainer 0, after :meth:`send_weights`: wait until every server (and each one's replica) holds them."""
        self._replies(1)

    def wait_summed(self) -> None:
        """Wait until every server has summed this synchronization's gradients (after the pushes left)."""
        self.wait_sent()
        self._replies(1)
        self._summed = self.syncs

    def vote_of(self, optimizer_index: int) -> tuple[float, bool]:
        """Every server's shares of optimizer ``optimizer_index``: the sum of their squared gradient norms (in server
        order: the same bits on every trainer) and whether any is not finite (trainer 0 asks, every trainer hears)."""
        if self.me == 0:
            self.control(Control.VOTE, optimizer_index)
        replies = self._replies(2)
        squares = 0.0
        for reply in replies:
            squares += float(reply[0])
        return squares, any(float(reply[1]) != 0.0 for reply in replies)
