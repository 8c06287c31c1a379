"""Transports: how the averaged values of a gradient bucket reach the ranks.

A transport is one axis of a synchronization scheme (see ``docs/architecture.md``): the same buckets, codec and
consistency model can travel over any of them. Every :class:`Transport` offers two exchanges on a
:class:`~lightning_dp.comm.buckets.GradientBucket`:

- :meth:`Transport.reduce`: every gradient element of the bucket is averaged on the rank that owns it, and the
  used-flags are combined so that a flag is non-zero where any rank used the parameter (averaged with the
  gradients by the ring, the central server and every shared-memory transport; summed everywhere by the sharded
  servers over sockets). :meth:`Transport.owned` tells which gradient elements this rank owns afterwards.
- :meth:`Transport.share`: the owners send their elements to every rank. After ``reduce`` and ``share`` every
  rank holds the whole averaged bucket. A parameter-server scheme also uses ``share`` to send updated weights:
  owners pack their parameters into the bucket, ``share``, and everyone unpacks.

A :class:`CodecTransport` also carries a compressing codec's encoded buckets (:mod:`lightning_dp.comm.codecs`):
its ``reduce_encoded`` and ``share_encoded`` take a ``wire_dtype`` the values travel rounded to.
``reduce_encoded`` expects each rank's values already divided by the group size and exactly representable in
``wire_dtype`` and *sums* them, adding in the bucket's own dtype (float32) wherever a rank adds what arrived: the
servers add every contribution in float32; the ring's partial sums are rounded to ``wire_dtype`` at each hop,
because they travel. ``share_encoded`` rounds the owners' values to ``wire_dtype``, their own copies included.
Both take an optional ``residual`` (the bucket's shape) that gains what this rank's own roundings lost (the ring's
partial sums, the owners' rounded averages), for a codec's error feedback. :meth:`CodecTransport.all_reduce`
averages any tensor no larger than a bucket (a low-rank codec's factors). The transports that carry full-precision
buckets only (shared memory inside one machine, dedicated servers) are plain :class:`Transport` kinds, and a
compressing codec refuses them when it is bound.

Every exchange counts its bytes in the :class:`~lightning_dp.comm.stats.CommStats` given at construction, and
every reduction is bit-identical on all ranks that hold its result. Buckets on a CUDA device travel over a gloo
group through pinned host copies (:mod:`lightning_dp.comm.transports.staging`), chosen once by :meth:`Transport.bind`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports.ring import Ring, chunk_bounds
from lightning_dp.comm.transports.staging import Staging, staging_for

if TYPE_CHECKING:
    from lightning_dp.comm.transports.hierarchical import NodeProbe

Segment = tuple[int, int]


def balanced_shards(buckets: Sequence[GradientBucket], size: int) -> list[list[Segment]]:
    """``[b][r]``: the range of bucket ``b``'s gradient region that rank ``r`` owns when every bucket is cut into
    ``size`` shards of equal length (at element granularity, so one huge tensor cannot unbalance them). Every
    bucket's exchange is then balanced (each rank sends and receives ``(N - 1) / N`` of it, so no rank's link
    finishes last), and so is the whole: each rank owns ``1 / N`` of every bucket."""
    return [chunk_bounds(b.grad_numel, size) for b in buckets]


def central_shards(buckets: Sequence[GradientBucket], size: int, server: int) -> list[list[Segment]]:
    """``[b][r]``: every bucket's whole gradient region owned by rank ``server``, none by the others (the central
    server cut as shards)."""
    return [[(0, b.grad_numel) if r == server else (0, 0) for r in range(size)] for b in buckets]


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
        (by default :func:`~.staging.staging_for` the group's backend); called once at set-up."""
        self._bind(buckets)
        self.staging = staging if staging is not None else self._default_staging(buckets)
        self.staging.bind(buckets)

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:  # noqa: B027 - most transports need no layout
        """The kind's own layout of ``buckets`` (see :meth:`bind`)."""

    def _default_staging(self, buckets: Sequence[GradientBucket]) -> Staging:
        return staging_for(dist.get_backend(self.group), buckets)

    def reduce(self, bucket: GradientBucket) -> None:
        """Average ``bucket.buffer`` over all ranks, at least on the elements this rank owns."""
        with self.staging.bucket(bucket, None) as (staged, _):
            self._reduce(staged)

    def share(self, bucket: GradientBucket) -> None:
        """Every rank receives the owners' values of ``bucket`` (those of :meth:`owned` on each rank)."""
        with self.staging.bucket(bucket, None) as (staged, _):
            self._share(staged)

    @abstractmethod
    def _reduce(self, bucket: GradientBucket) -> None:
        """:meth:`reduce` on the staged bucket."""

    @abstractmethod
    def _share(self, bucket: GradientBucket) -> None:
        """:meth:`share` on the staged bucket."""

    @abstractmethod
    def owned(self, bucket: GradientBucket) -> Segment:
        """The ``(start, end)`` range of ``bucket``'s gradient region this rank holds averaged after :meth:`reduce`."""

    @property
    def crosses_network(self) -> bool:
        """Whether buckets leave the machine (so that a codec's smaller encoding saves anything): true for the
        socket transports with more than one rank, for shared memory only across nodes."""
        return self.size > 1

    def measure_in_node(self) -> NodeProbe | None:
        """Collective: the barrier and the reduction rate of the node's shared-memory exchange, for the cost model's
        ``Link.local_latency`` and ``local_bandwidth``; ``None`` for a transport whose ranks of a node exchange over
        sockets like any others (the link probe measures those) and on a node of one rank."""
        return None

    def owns_all(self, bucket: GradientBucket) -> bool:
        """Whether this rank holds the whole averaged ``bucket`` after :meth:`reduce`."""
        return self.owned(bucket) == (0, bucket.grad_numel)

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release what :meth:`bind` set up (shared memory); the transport is not used afterwards."""


class CodecTransport(Transport):
    """A transport a compressing codec can run over: its exchanges also carry buckets rounded to a codec's
    ``wire_dtype`` (see the module docstring), and it averages any tensor no larger than a bucket (a low-rank codec's
    factors). A kind implements ``_reduce_encoded``, ``_share_encoded`` and ``_all_reduce``; its plain exchanges are
    the encoded ones without a ``wire_dtype``."""

    def reduce_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        """:meth:`reduce` of values rounded to ``wire_dtype``: each rank's values, already divided by the group size
        and exactly representable in ``wire_dtype``, are *summed*; ``residual`` gains what this rank's own roundings
        lost."""
        with self.staging.bucket(bucket, residual) as (staged, staged_residual):
            self._reduce_encoded(staged, wire_dtype, staged_residual)

    def share_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        """:meth:`share` of the owners' values rounded to ``wire_dtype`` (their own copies included); ``residual``
        gains what the rounding lost."""
        with self.staging.bucket(bucket, residual) as (staged, staged_residual):
            self._share_encoded(staged, wire_dtype, staged_residual)

    def all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        """Average the 1-D contiguous ``tensor`` (of ``bucket``'s dtype and at most its length) over all ranks, in
        place and bit-identical everywhere. May use ``bucket``'s memory: its contents are undefined afterwards."""
        with self.staging.tensor(tensor, bucket) as (staged, staged_bucket):
            self._all_reduce(staged, staged_bucket)

    def _reduce(self, bucket: GradientBucket) -> None:
        self._reduce_encoded(bucket, None, None)

    def _share(self, bucket: GradientBucket) -> None:
        self._share_encoded(bucket, None, None)

    @abstractmethod
    def _reduce_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        """:meth:`reduce_encoded` on the staged bucket."""

    @abstractmethod
    def _share_encoded(self, bucket: GradientBucket, wire_dtype: torch.dtype | None, residual: Tensor | None) -> None:
        """:meth:`share_encoded` on the staged bucket."""

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, bucket: GradientBucket) -> None:
        """:meth:`all_reduce` on the staged tensor and bucket."""
