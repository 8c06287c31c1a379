"""Transports: how the averaged values of a gradient bucket reach the ranks.

A transport is one axis of a synchronization scheme (see ``docs/architecture.md``): the same buckets, codec and
consistency model can travel over any of them. Every transport offers two exchanges on a
:class:`~lightning_dp.comm.buckets.GradientBucket`:

- :meth:`Transport.reduce`: every gradient element of the bucket is averaged on the rank that owns it, and the
  used-flags are combined so that a flag is non-zero where any rank used the parameter (averaged with the
  gradients by the ring, the central server and every shared-memory transport; summed everywhere by the sharded
  servers over sockets).
  :meth:`Transport.owned` tells which gradient elements this rank owns afterwards.
- :meth:`Transport.share`: the owners send their elements to every rank. After ``reduce`` and ``share`` every
  rank holds the whole averaged bucket. A parameter-server scheme also uses ``share`` to send updated weights:
  owners pack their parameters into the bucket, ``share``, and everyone unpacks.

Both take an optional ``wire`` dtype (a codec's, see :mod:`lightning_dp.comm.codecs`): the bucket's values travel
rounded to it. ``reduce(bucket, wire)`` then expects each rank's values already divided by the group size and
exactly representable in ``wire`` and *sums* them, adding in the bucket's own dtype (float32) wherever a rank adds
what arrived: the servers add every contribution in float32; the ring's partial sums are rounded to ``wire`` at
each hop, because they travel. ``share(bucket, wire)`` rounds the owners' values to ``wire``, their own copies
included. Both take an optional ``residual`` (the bucket's shape) that gains what this rank's own roundings lost
(the ring's partial sums, the owners' rounded averages), for a codec's error feedback.
:meth:`Transport.all_reduce` averages any tensor no larger than a bucket (a low-rank codec's factors).

Every exchange counts its bytes in the :class:`~lightning_dp.comm.stats.CommStats` given at construction, and
every reduction is bit-identical on all ranks that hold its result. Buckets on a CUDA device travel over a gloo
group through pinned host copies (:mod:`lightning_dp.comm.staging`), chosen once by :meth:`Transport.bind`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.hierarchical import HierarchicalAllReduce, overlap
from lightning_dp.comm.parameter_server import pull_shards, pull_weights, push_gradients, push_shards
from lightning_dp.comm.ring import ReduceOpName, Ring, chunk_bounds, ring_allreduce
from lightning_dp.comm.staging import Staging, staging_for
from lightning_dp.comm.stats import CommStats

Segment = tuple[int, int]


def balanced_shards(buckets: Sequence[GradientBucket], size: int) -> list[list[Segment]]:
    """``[b][r]``: the range of bucket ``b``'s gradient region that rank ``r`` owns when every bucket is cut into
    ``size`` shards of equal length (at element granularity, so one huge tensor cannot unbalance them). Every
    bucket's exchange is then balanced (each rank sends and receives ``(N - 1) / N`` of it, so no rank's link
    finishes last), and so is the whole: each rank owns ``1 / N`` of every bucket."""
    return [chunk_bounds(b.grad_numel, size) for b in buckets]


class Transport(ABC):
    """One way of averaging and distributing buckets over the ranks of ``group``.

    The public exchanges stage each bucket where the group's messages can read it (:mod:`.staging`: in place, or
    through pinned host memory for device buckets over gloo) and run the kind's own ``_reduce``, ``_share`` and
    ``_all_reduce`` on it; a kind implements those."""

    #: whether the ranks of a node exchange through shared memory
    shared_memory: ClassVar[bool] = False

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None) -> None:
        self.ring = Ring(group)
        self.group = self.ring.group
        self.rank, self.size = self.ring.rank, self.ring.size
        self.stats = stats if stats is not None else CommStats()
        #: where the buckets' bytes are while they travel (chosen by :meth:`bind`)
        self.staging: Staging = Staging()

    def bind(self, buckets: Sequence[GradientBucket], staging: Staging | None = None) -> None:
        """Lay out the ownership of ``buckets`` (every rank passes the same buckets) and choose their ``staging``
        (by default :func:`~lightning_dp.comm.staging.staging_for` the group's backend); called once at set-up."""
        self._bind(buckets)
        self.staging = staging if staging is not None else self._default_staging(buckets)
        self.staging.bind(buckets)

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:  # noqa: B027 - most transports need no layout
        """The kind's own layout of ``buckets`` (see :meth:`bind`)."""

    def _default_staging(self, buckets: Sequence[GradientBucket]) -> Staging:
        return staging_for(dist.get_backend(self.group), buckets)

    def reduce(self, bucket: GradientBucket, wire: torch.dtype | None = None, residual: Tensor | None = None) -> None:
        """Average ``bucket.buffer`` over all ranks, at least on the elements this rank owns (with ``wire``: sum
        values already divided by the group size, see the module docstring)."""
        with self.staging.bucket(bucket, residual) as (staged, staged_residual):
            self._reduce(staged, wire, staged_residual)

    def share(self, bucket: GradientBucket, wire: torch.dtype | None = None, residual: Tensor | None = None) -> None:
        """Every rank receives the owners' values of ``bucket`` (those of :meth:`owned` on each rank), rounded to
        ``wire`` if given."""
        with self.staging.bucket(bucket, residual) as (staged, staged_residual):
            self._share(staged, wire, staged_residual)

    def all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        """Average the 1-D contiguous ``tensor`` (of ``bucket``'s dtype and at most its length) over all ranks, in
        place and bit-identical everywhere. May use ``bucket``'s memory: its contents are undefined afterwards."""
        with self.staging.tensor(tensor, bucket) as (staged, staged_bucket):
            self._all_reduce(staged, staged_bucket)

    @abstractmethod
    def _reduce(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        """:meth:`reduce` on the staged bucket."""

    @abstractmethod
    def _share(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        """:meth:`share` on the staged bucket."""

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        """:meth:`all_reduce` on the staged tensor and bucket."""

    @abstractmethod
    def owned(self, bucket: GradientBucket) -> Segment:
        """The ``(start, end)`` range of ``bucket``'s gradient region this rank holds averaged after :meth:`reduce`."""

    @property
    def crosses_network(self) -> bool:
        """Whether buckets leave the machine (so that a codec's smaller encoding saves anything): true for the
        socket transports with more than one rank, for shared memory only across nodes."""
        return self.size > 1

    def owns_all(self, bucket: GradientBucket) -> bool:
        """Whether this rank holds the whole averaged ``bucket`` after :meth:`reduce`."""
        return self.owned(bucket) == (0, bucket.grad_numel)

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release what :meth:`bind` set up (shared memory); the transport is not used afterwards."""


class RingTransport(Transport):
    """Ring all-reduce: every rank holds the whole average after :meth:`reduce`; :meth:`share` has nothing to do.
    Each rank moves ``2 (N - 1) / N S`` bytes per bucket of ``S`` bytes."""

    def _reduce(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        op: ReduceOpName = "avg" if wire is None else "sum"
        ring_allreduce(bucket.buffer, op=op, stats=self.stats, ring=self.ring, wire=wire, residual=residual)

    def owned(self, bucket: GradientBucket) -> Segment:
        return (0, bucket.grad_numel)

    def share(self, bucket: GradientBucket, wire: torch.dtype | None = None, residual: Tensor | None = None) -> None:
        pass  # nothing to stage either

    def _share(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        pass

    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        ring_allreduce(tensor, op="avg", stats=self.stats, ring=self.ring)


class CentralServerTransport(Transport):
    """One server rank: :meth:`reduce` is a fan-in to it (it averages in rank order), :meth:`share` a fan-out of
    its bucket, used-flags included. The server moves ``(N - 1) S`` bytes each way, a worker ``S``."""

    def __init__(self, server: int, group: dist.ProcessGroup | None = None, stats: CommStats | None = None) -> None:
        super().__init__(group, stats)
        self.server = server

    @property
    def is_server(self) -> bool:
        return self.rank == self.server

    def _reduce(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        push_gradients(bucket.buffer, self.server, self.group, self.stats, wire=wire)

    def owned(self, bucket: GradientBucket) -> Segment:
        return (0, bucket.grad_numel) if self.is_server else (0, 0)

    def _share(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        pull_weights(bucket.buffer, self.server, self.group, self.stats, wire=wire, residual=residual)

    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        push_gradients(tensor, self.server, self.group, self.stats)
        pull_weights(tensor, self.server, self.group, self.stats)


class ShardedServerTransport(Transport):
    """N servers, one per rank: every bucket is cut into N shards of equal length (:func:`balanced_shards`) and
    rank ``i`` owns shard ``i``. :meth:`reduce` pushes
    each shard to its owner, which averages it, and sums the used-flags everywhere (the P flags travel to every
    peer in the push's own message round); :meth:`share` sends every owner's shard to all. Each
    moves ``(N - 1) / N S`` bytes each way (plus ``(N - 1)`` times the flags); one message round per exchange."""

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None) -> None:
        super().__init__(group, stats)
        #: ``segments[b][r]``: the element range of bucket ``b``'s gradient region that rank ``r`` owns
        self.segments: list[list[Segment]] = []

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:
        self.segments = balanced_shards(buckets, self.size)

    def _reduce(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        gradients, segments = bucket.buffer[: bucket.grad_numel], self.segments[bucket.index]
        push_shards(gradients, segments, self.group, self.stats, wire, everywhere=bucket.flags)

    def owned(self, bucket: GradientBucket) -> Segment:
        start, end = self.segments[bucket.index][self.rank]
        return (start, end)

    def _share(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        lost = residual[: bucket.grad_numel] if residual is not None else None
        pull_shards(bucket.buffer[: bucket.grad_numel], self.segments[bucket.index], self.group, self.stats, wire, lost)

    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        segments = chunk_bounds(tensor.numel(), self.size)
        push_shards(tensor, segments, self.group, self.stats)
        pull_shards(tensor, segments, self.group, self.stats)


class _SharedMemoryTransport(Transport):
    """Base of the transports whose ranks of one node exchange buckets through shared memory
    (:class:`~lightning_dp.comm.hierarchical.HierarchicalAllReduce`). :meth:`bind` maps the node's segment and moves
    every bucket into this rank's input region there, so backward writes gradients straight into shared memory.
    ``bind`` is collective and raises :class:`~lightning_dp.comm.shm.SharedMemoryUnavailable` on every rank when a
    node cannot share memory (the caller then picks a socket transport). ``node_key``: which ranks share a node
    (equal keys; default the host name)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        node_key: object = None,
        timeout: float = 300.0,
    ) -> None:
        super().__init__(group, stats)
        self.node_key = node_key
        self.timeout = timeout
        self._exchange: HierarchicalAllReduce | None = None

    @property
    def exchange(self) -> HierarchicalAllReduce:
        assert self._exchange is not None, "bind() the buckets first"
        return self._exchange

    shared_memory = True
    #: the socket transport to use across nodes, for one that runs on a single node only
    _across_nodes: ClassVar[str | None] = None

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:
        self._exchange = HierarchicalAllReduce(
            [b.nbytes for b in buckets], self.group, self.node_key, self.timeout, self.stats
        )
        if self._across_nodes is not None and self.exchange.layout.num_nodes > 1:
            raise ValueError(f"{type(self).__name__} runs on one node; use {self._across_nodes} across nodes")
        for b in buckets:
            b.relocate(self.exchange.buffer(b.index, b.buffer.numel(), b.buffer.dtype))

    @property
    def crosses_network(self) -> bool:
        return self.exchange.layout.num_nodes > 1

    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        self.exchange.all_reduce(tensor, bucket.index, "avg")

    @staticmethod
    def _refuse_wire(wire: torch.dtype | None) -> None:
        if wire is not None:
            raise ValueError("inside one node buckets do not travel on a wire: use no codec (see crosses_network)")

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None


class SharedMemoryTransport(_SharedMemoryTransport):
    """The ring's contract (every rank holds the whole average after :meth:`reduce`) at memory speed inside a node:
    each local rank sums ``1/L`` of the bucket from every rank's input region, then every rank copies the result.
    Across nodes (hierarchical) local rank ``i`` of every node all-reduces its slice on a ring of its own, so a
    rank moves ``2 (M - 1) / M S / L`` bytes over the network for ``M`` nodes. Nodes must have equal rank counts."""

    def _reduce(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        op: ReduceOpName = "avg" if wire is None else "sum"
        result = self.exchange.reduce_scatter(bucket.buffer, bucket.index, op, wire, residual)
        self.exchange.gather(bucket.buffer, bucket.index, result)

    def owned(self, bucket: GradientBucket) -> Segment:
        return (0, bucket.grad_numel)

    def _share(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        pass


class SharedMemoryServerTransport(_SharedMemoryTransport):
    """The central server's contract on one node: :meth:`reduce` averages the bucket through shared memory and
    only the server takes the result; :meth:`share` lets every rank copy the server's bucket (used-flags
    included) from shared memory. The fan-in and fan-out of :class:`CentralServerTransport` become memory copies."""

    _across_nodes = "CentralServerTransport"

    def __init__(
        self,
        server: int,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        node_key: object = None,
        timeout: float = 300.0,
    ) -> None:
        super().__init__(group, stats, node_key, timeout)
        self.server = server

    @property
    def is_server(self) -> bool:
        return self.rank == self.server

    def _reduce(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        self._refuse_wire(wire)
        result = self.exchange.reduce_scatter(bucket.buffer, bucket.index, "avg")
        if self.is_server:  # it reads every slice; each other rank's slice is read by the server alone
            self.exchange.gather(bucket.buffer, bucket.index, result, [(0, bucket.buffer.numel())], sent=0)
        else:
            lo, hi = self.exchange.slice(bucket.buffer.numel())
            self.exchange.gather(bucket.buffer, bucket.index, result, [], sent=hi - lo)

    def owned(self, bucket: GradientBucket) -> Segment:
        return (0, bucket.grad_numel) if self.is_server else (0, 0)

    def _share(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        self._refuse_wire(wire)
        region = self.exchange.share_region(bucket.index, bucket.buffer.numel(), bucket.buffer.dtype)
        everything = (0, bucket.buffer.numel())
        if self.is_server:
            region.copy_(bucket.buffer)
            self.exchange.gather(bucket.buffer, bucket.index, region, [], written=everything)
        else:
            self.exchange.gather(bucket.buffer, bucket.index, region, [everything], written=(0, 0))


class SharedMemoryShardedTransport(_SharedMemoryTransport):
    """The sharded servers' contract on one node, with the shards of :class:`ShardedServerTransport`
    (:func:`balanced_shards`, ``segments`` alike): :meth:`reduce` sums the buckets in shared memory and each
    owner takes its shard (and every rank all used-flags), :meth:`share` lets every rank copy the owners' shards."""

    _across_nodes = "ShardedServerTransport"
    #: ``segments[b][r]``: the element range of bucket ``b``'s gradient region that rank ``r`` owns (set by bind)
    segments: list[list[Segment]]

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:
        super()._bind(buckets)
        self.segments = balanced_shards(buckets, self.size)

    def _reduce(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        self._refuse_wire(wire)
        result = self.exchange.reduce_scatter(bucket.buffer, bucket.index, "avg")
        numel = bucket.buffer.numel()
        flags = (bucket.grad_numel, numel)  # every rank reads every flag
        mine = self.exchange.slice(numel)
        read_by_peers = sum(overlap(s, mine) for r, s in enumerate(self.segments[bucket.index]) if r != self.rank)
        sent = read_by_peers + (self.size - 1) * overlap(flags, mine)
        self.exchange.gather(bucket.buffer, bucket.index, result, [self.owned(bucket), flags], sent=sent)

    def owned(self, bucket: GradientBucket) -> Segment:
        start, end = self.segments[bucket.index][self.rank]
        return (start, end)

    def _share(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        self._refuse_wire(wire)
        region = self.exchange.share_region(bucket.index, bucket.buffer.numel(), bucket.buffer.dtype)
        start, end = self.owned(bucket)
        region[start:end].copy_(bucket.buffer[start:end])
        others = [(0, start), (end, bucket.grad_numel)]
        self.exchange.gather(bucket.buffer, bucket.index, region, others, written=(start, end))
