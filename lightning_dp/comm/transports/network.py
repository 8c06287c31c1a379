"""The transports over a process group's sockets: the ring, a central server, sharded servers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports.base import CodecTransport, Segment, balanced_shards, central_shards
from lightning_dp.comm.transports.ring import ReduceOpName, chunk_bounds, ring_allreduce
from lightning_dp.comm.transports.shards import pull_shards, pull_weights, push_gradients, push_shards


class RingTransport(CodecTransport):
    """Ring all-reduce: every rank holds the whole average after :meth:`reduce`; :meth:`share` has nothing to do.
    Each rank moves ``2 (N - 1) / N S`` bytes per bucket of ``S`` bytes."""

    def _reduce_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        op: ReduceOpName = "avg" if wire_dtype is None else "sum"
        ring_allreduce(bucket.buffer, op=op, stats=self.stats, ring=self.ring, wire_dtype=wire_dtype, residual=residual)

    def owned(self, bucket: GradientBucket) -> Segment:
        return (0, bucket.grad_numel)

    def share(self, bucket: GradientBucket) -> None:
        pass  # nothing to stage either

    def share_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        pass

    def _share_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        pass

    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        ring_allreduce(tensor, op="avg", stats=self.stats, ring=self.ring)


class CentralServerTransport(CodecTransport):
    """One server rank: :meth:`reduce` is a fan-in to it (it averages in rank order), :meth:`share` a fan-out of
    its bucket, used-flags included. The server moves ``(N - 1) S`` bytes each way, a worker ``S``."""

    def __init__(self, server: int, group: dist.ProcessGroup | None = None, stats: CommStats | None = None) -> None:
        super().__init__(group, stats)
        self.server = server

    @property
    def is_server(self) -> bool:
        return self.rank == self.server

    def _reduce_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        push_gradients(bucket.buffer, self.server, self.group, self.stats, wire_dtype=wire_dtype)

    def owned(self, bucket: GradientBucket) -> Segment:
        return (0, bucket.grad_numel) if self.is_server else (0, 0)

    def _share_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        pull_weights(bucket.buffer, self.server, self.group, self.stats, wire_dtype=wire_dtype, residual=residual)

    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        push_gradients(tensor, self.server, self.group, self.stats)
        pull_weights(tensor, self.server, self.group, self.stats)


class ShardedServerTransport(CodecTransport):
    """N servers, one per rank: every bucket is cut into N shards of equal length (:func:`balanced_shards`) and
    rank ``i`` owns shard ``i``. :meth:`reduce` pushes
    each shard to its owner, which averages it, and sums the used-flags everywhere (the P flags travel to every
    peer in the push's own message round); :meth:`share` sends every owner's shard to all. Each
    moves ``(N - 1) / N S`` bytes each way (plus ``(N - 1)`` times the flags); one message round per exchange."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None, server: int | None = None
    ) -> None:
        super().__init__(group, stats)
        #: ``segments[b][r]``: the element range of bucket ``b``'s gradient region that rank ``r`` owns
        self.segments: list[list[Segment]] = []
        #: the group rank that owns every bucket whole (:func:`central_shards`); ``None``: N balanced shards
        self.server = server

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:
        if self.server is None:
            self.segments = balanced_shards(buckets, self.size)
        else:
            self.segments = central_shards(buckets, self.size, self.server)

    def _reduce_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        gradients, segments = bucket.buffer[: bucket.grad_numel], self.segments[bucket.index]
        push_shards(gradients, segments, self.group, self.stats, wire_dtype, summed=bucket.flags)

    def owned(self, bucket: GradientBucket) -> Segment:
        start, end = self.segments[bucket.index][self.rank]
        return (start, end)

    def _share_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        gradients, segments = bucket.buffer[: bucket.grad_numel], self.segments[bucket.index]
        gradient_residual = residual[: bucket.grad_numel] if residual is not None else None
        pull_shards(gradients, segments, self.group, self.stats, wire_dtype, gradient_residual)

    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        segments = chunk_bounds(tensor.numel(), self.size)
        push_shards(tensor, segments, self.group, self.stats)
        pull_shards(tensor, segments, self.group, self.stats)
