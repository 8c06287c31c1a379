"""``ring_allreduce``: every rank averages gradients with the hand-written ring, bucket by bucket."""

from __future__ import annotations

from typing import Any

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.ring import Ring, ring_allreduce
from lightning_dp.strategies.base import DataParallelStrategy


class RingAllReduceStrategy(DataParallelStrategy):
    """Data parallelism with a bandwidth-optimal ring all-reduce of gradient buckets, overlapped with backward.

    Every rank holds the full model and optimizer; after each backward every rank holds the same averaged
    gradients, so every replica takes the same optimizer step. Options: see :class:`DataParallelStrategy`.
    """

    strategy_name = "ring_allreduce"

    def _setup_gradient_sync(self) -> None:
        self._ring = Ring(self.gradient_group)
        super()._setup_gradient_sync()

    def _reduce_bucket(self, bucket: GradientBucket) -> None:
        ring_allreduce(bucket.buffer, op="avg", stats=self.comm_stats, ring=self._ring)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        cls._register_variants(
            strategy_registry, cls.strategy_name, "Data parallel with a hand-written bucketed ring all-reduce"
        )
