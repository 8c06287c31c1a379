"""``sharded_ps``: every rank serves 1/N of the parameters and holds 1/N of the optimizer state."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_dp._lightning_compat import unwrap_optimizer
from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.servers.sharded_optimizer import check_shardable
from lightning_dp.comm.transports import (
    ShardedServerTransport,
    SharedMemoryShardedTransport,
    Transport,
    balanced_shards,
)
from lightning_dp.strategies.engines import ShardedServerEngine, StepEngine
from lightning_dp.strategies.engines.replicated import ReplicatedShardedEngine
from lightning_dp.strategies.parameter_server_base import ParameterServerBase, Segment


class ShardedParameterServerStrategy(ParameterServerBase):
    """Parameter server sharded over all ranks.

    Every gradient bucket is cut into N shards of equal length at element granularity, so one huge tensor
    cannot unbalance them; rank ``i`` serves shard ``i`` of every bucket. During backward every rank pushes
    shard ``i`` of each finished bucket to rank ``i``, which averages it. At the step, rank ``i`` runs the
    user's optimizer on its shard only (a :class:`~lightning_dp.comm.servers.sharded_optimizer.ShardedOptimizer`: the
    same class and hyperparameters over views of the parameters, so its state is 1/N of the total), then every
    rank sends its updated shard to all others. Each rank moves ``2 (N - 1) / N S`` bytes per step, like the ring.

    Gradient clipping by norm uses the global norm, summed across shards. Only element-wise optimizers
    (:data:`~lightning_dp.comm.servers.sharded_optimizer.ELEMENTWISE_OPTIMIZERS`) can run on slices of tensors; others
    are refused at set-up. Checkpoints hold the optimizer state in torch's standard, unsharded layout.

    With ``num_servers=k`` dedicated server processes take part of the shards: the trainers keep the share that
    balances every machine's traffic, ``(n - k) / (n² + k n - 2 k)`` each, and the servers the rest, which makes a
    step's exchange ``2 n (n - 1) / (n² + k n - 2 k) · S / B`` (see :mod:`lightning_dp.comm.servers`).

    Args: ``staleness``, ``num_servers``, ``start_servers`` (see
        :class:`~.parameter_server_base.ParameterServerBase`) and the options of
        :class:`~lightning_dp.strategies.base.DataParallelStrategy`.
    """

    strategy_name = "sharded_ps"

    @override
    def _check_optimizers(self) -> None:
        super()._check_optimizers()
        for optimizer in map(unwrap_optimizer, self.optimizers):
            try:
                check_shardable(optimizer)
            except ConfigurationError as error:
                raise ConfigurationError(
                    f"strategy {self.strategy_name!r} {error}. "
                    "Use strategy='parameter_server' or 'ring_allreduce' for this optimizer."
                ) from None

    @override
    def _make_transport(self, shared_memory: bool) -> Transport:
        if shared_memory and self.single_node:
            return SharedMemoryShardedTransport(self.gradient_group, self.sync_stats, **self._shared_memory_kwargs())
        return ShardedServerTransport(self.gradient_group, self.sync_stats)

    @override
    def _served_segments(self, buckets: list[GradientBucket]) -> list[list[Segment]]:
        return balanced_shards(buckets, self.world_size)

    @override
    def _synchronous_engine(self) -> StepEngine:
        if self.rank_loss.name == "continue":  # every shard's state replicated on the next rank
            return ReplicatedShardedEngine(self)
        return ShardedServerEngine(self)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = "Data parallel with a parameter server sharded over all ranks (1/N of the optimizer state each)"
        cls._register_variants(strategy_registry, cls.strategy_name, description)
        cls._register_variants(strategy_registry, "sharded_parameter_server", description)
