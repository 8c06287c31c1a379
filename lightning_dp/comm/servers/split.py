"""The load split between trainers and dedicated servers: who serves which part of the buckets."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.cost import trainer_share
from lightning_dp.comm.servers.sharded_optimizer import (
    Segment,
)
from lightning_dp.comm.transports.shards import segments_at


def member_shares(num_trainers: int, num_servers: int, trainers_serve: bool) -> list[float]:
    """The fraction of the gradient bytes each member serves, trainers first: the optimal split
    (:func:`trainer_share`) when ``trainers_serve``, else ``1 / k`` per server and nothing on the trainers."""
    n, k = num_trainers, num_servers
    if not trainers_serve:
        if k == 0:
            raise ValueError("without dedicated servers the trainers must serve")
        return [0.0] * n + [1.0 / k] * k
    x = trainer_share(n, k)
    return [x] * n + ([(1.0 - n * x) / k] * k if k else [])


def member_segments(
    buckets: Sequence[GradientBucket], shares: Sequence[float], whole_parameters: bool
) -> list[list[Segment]]:
    """``[b][m]``: the range of bucket ``b``'s gradient region member ``m`` serves, ``shares`` being the fractions
    (summing to 1) each member serves. Every bucket is cut by ``shares`` on its own, so that each bucket's push and
    pull keep every member's link busy in both directions (BytePS's partitions); with ``whole_parameters`` the
    buckets are instead laid end to end in bytes and each cut moves to the nearest parameter boundary, so that every
    parameter is served whole by one member."""
    if not whole_parameters:
        return [_cut(b.grad_numel, shares) for b in buckets]
    sizes = [b.grad_numel for b in buckets]
    element_sizes = [b.buffer.element_size() for b in buckets]
    total = sum(n * e for n, e in zip(sizes, element_sizes))
    cuts = [cut for cut, _ in _cut(total, shares)] + [total]
    boundaries, base = [0], 0
    for bucket, esize in zip(buckets, element_sizes):
        boundaries += [base + hi * esize for _, hi in bucket.slices]
        base += bucket.grad_numel * esize
    cuts = [cuts[0]] + [_nearest(boundaries, c) for c in cuts[1:-1]] + [cuts[-1]]
    return segments_at(sizes, element_sizes, cuts)


def _cut(total: int, shares: Sequence[float]) -> list[Segment]:
    """``[0, total)`` cut into consecutive ranges of ``shares`` of it (rounded to whole units)."""
    cuts, acc = [0], 0.0
    for share in shares[:-1]:
        acc += share
        cuts.append(min(total, round(total * acc)))
    cuts.append(total)
    return list(zip(cuts, cuts[1:]))


def _nearest(boundaries: Sequence[int], cut: int) -> int:
    return min(boundaries, key=lambda b: (abs(b - cut), b))
