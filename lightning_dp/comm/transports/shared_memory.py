"""The transports through one machine's shared memory (hierarchical across machines)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports.base import CodecTransport, Segment, Transport, balanced_shards, central_shards
from lightning_dp.comm.transports.hierarchical import HierarchicalAllReduce, NodeProbe, overlap
from lightning_dp.comm.transports.ring import ReduceOpName


class _SharedMemoryTransport(Transport):
    """Base of the transports whose ranks of one node exchange buckets through shared memory
    (:class:`~.hierarchical.HierarchicalAllReduce`). :meth:`bind` maps the node's segment and moves
    every bucket into this rank's input region there, so backward writes gradients straight into shared memory.
    ``bind`` is collective and raises :class:`~.shm.SharedMemoryUnavailable` on every rank when a
    node cannot share memory (the caller then picks a socket transport). ``node_key``: which ranks share a node
    (equal keys; default the host name); ``interrupt``: called while a rank waits for its peers, to end the wait
    by raising."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        node_key: object = None,
        timeout: float = 300.0,
        wait: str = "auto",
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(group, stats)
        self.node_key = node_key
        self.timeout = timeout
        self.wait = wait
        self.interrupt = interrupt
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
            [b.nbytes for b in buckets], self.group, self.node_key, self.timeout, self.stats, self.wait, self.interrupt
        )
        if self._across_nodes is not None and self.exchange.layout.num_nodes > 1:
            raise ValueError(f"{type(self).__name__} runs on one node; use {self._across_nodes} across nodes")
        for b in buckets:
            b.relocate(self.exchange.buffer(b.index, b.buffer.numel(), b.buffer.dtype))

    @property
    def crosses_network(self) -> bool:
        return self.exchange.layout.num_nodes > 1

    def measure_in_node(self) -> NodeProbe | None:
        return self.exchange.measure_in_node()

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None


class SharedMemoryTransport(_SharedMemoryTransport, CodecTransport):
    """The ring's contract (every rank holds the whole average after :meth:`reduce`) at memory speed inside a node:
    each local rank sums ``1/L`` of the bucket from every rank's input region and writes the sum back into all of
    them (:meth:`~.hierarchical.HierarchicalAllReduce.reduce_in_place`).
    Across nodes (hierarchical) local rank ``i`` of every node all-reduces its slice on a ring of its own, so a
    rank moves ``2 (M - 1) / M S / L`` bytes over the network for ``M`` nodes. Nodes must have equal rank counts."""

    def _reduce_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        op: ReduceOpName = "avg" if wire_dtype is None else "sum"
        self.exchange.reduce_in_place(bucket.buffer, bucket.index, op, wire_dtype, residual)

    def owned(self, bucket: GradientBucket) -> Segment:
        return (0, bucket.grad_numel)

    def _share_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        pass

    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        self.exchange.all_reduce(tensor, bucket.index, "avg")


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
        wait: str = "auto",
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(group, stats, node_key, timeout, wait, interrupt)
        self.server = server

    @property
    def is_server(self) -> bool:
        return self.rank == self.server

    def _reduce(self, bucket: GradientBucket) -> None:
        result = self.exchange.reduce_scatter(bucket.buffer, bucket.index, "avg")
        if self.is_server:  # it reads every slice; each other rank's slice is read by the server alone
            self.exchange.gather(bucket.buffer, bucket.index, result, [(0, bucket.buffer.numel())], sent=0)
        else:
            lo, hi = self.exchange.slice(bucket.buffer.numel())
            self.exchange.gather(bucket.buffer, bucket.index, result, [], sent=hi - lo)

    def owned(self, bucket: GradientBucket) -> Segment:
        return (0, bucket.grad_numel) if self.is_server else (0, 0)

    def _share(self, bucket: GradientBucket) -> None:
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

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        node_key: object = None,
        timeout: float = 300.0,
        wait: str = "auto",
        interrupt: Callable[[], None] | None = None,
        server: int | None = None,
    ) -> None:
        super().__init__(group, stats, node_key, timeout, wait, interrupt)
        #: the group rank that owns every bucket whole (:func:`central_shards`); ``None``: N balanced shards
        self.server = server

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:
        super()._bind(buckets)
        if self.server is None:
            self.segments = balanced_shards(buckets, self.size)
        else:
            self.segments = central_shards(buckets, self.size, self.server)

    def _reduce(self, bucket: GradientBucket) -> None:
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

    def _share(self, bucket: GradientBucket) -> None:
        region = self.exchange.share_region(bucket.index, bucket.buffer.numel(), bucket.buffer.dtype)
        start, end = self.owned(bucket)
        region[start:end].copy_(bucket.buffer[start:end])
        others = [(0, start), (end, bucket.grad_numel)]
        self.exchange.gather(bucket.buffer, bucket.index, region, others, written=(start, end))
