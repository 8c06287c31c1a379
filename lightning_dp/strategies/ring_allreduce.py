"""``ring_allreduce``: every rank averages gradients with the hand-written ring, bucket by bucket."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dp.comm.transports import RingTransport, SharedMemoryTransport, Transport
from lightning_dp.strategies.base import DataParallelStrategy


class RingAllReduceStrategy(DataParallelStrategy):
    """Data parallelism with a bandwidth-optimal ring all-reduce of gradient buckets, overlapped with backward.

    Every rank holds the full model and optimizer; after each backward every rank holds the same averaged
    gradients, so every replica takes the same optimizer step. The ranks of one machine reduce through shared
    memory, and across machines the ring is hierarchical (``intra_node="shm"``, the default). As under
    ``DistributedDataParallel(gradient_as_bucket_view=True)``, ``param.grad`` is a view into its bucket. Options:
    see :class:`DataParallelStrategy`.
    """

    strategy_name = "ring_allreduce"
    _gradient_as_bucket_view = True

    @override
    def _make_transport(self, shared_memory: bool) -> Transport:
        if shared_memory:
            return SharedMemoryTransport(self.gradient_group, self.sync_stats, **self._shared_memory_kwargs())
        if self.intra_node == "shm" and self.root_device.type != "cpu" and not self.single_node:
            rank_zero_info(
                f"{self.strategy_name}: intra_node='shm' applies to CPU tensors only; on these GPUs the ring is one "
                f"flat ring over all {self.world_size} ranks, not a ring per machine joined across machines"
            )
        return RingTransport(self.gradient_group, self.sync_stats)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        cls._register_variants(
            strategy_registry, cls.strategy_name, "Data parallel with a hand-written bucketed ring all-reduce"
        )
