"""``parameter_server``: one rank aggregates gradients, runs the optimizer and sends the weights back."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.transports import (
    CentralServerTransport,
    ShardedServerTransport,
    SharedMemoryServerTransport,
    SharedMemoryShardedTransport,
    Transport,
)
from lightning_dp.strategies.engines import CentralServerEngine, StepEngine
from lightning_dp.strategies.engines.replicated import ReplicatedShardedEngine
from lightning_dp.strategies.options import check_rank
from lightning_dp.strategies.parameter_server_base import ParameterServerBase, Segment


class ParameterServerStrategy(ParameterServerBase):
    """Central parameter server, co-located with a worker: the server rank also trains on its own data shard; or,
    with ``num_servers=k``, ``k`` server processes of their own, each serving an equal part of every gradient bucket
    (a set of whole parameters, balanced by bytes, for an optimizer that is not element-wise) with the optimizer the
    LightningModule configured.

    Every step each worker pushes its gradient buckets to the server during backward (fan-in); the server
    averages them, applies the user's optimizer (the only optimizer state in the job lives there) and sends
    the updated weights to every worker (fan-out). The server moves ``(N - 1) S`` bytes each way per step,
    a worker ``S``: the single-server bottleneck the sharded variant removes.

    Args:
        server_rank: global rank of the server, in ``[0, world_size)`` (with ``num_servers=0``).
        **kwargs: ``staleness``, ``num_servers``, ``start_servers`` (see
            :class:`~.parameter_server_base.ParameterServerBase`) and the options of
            :class:`~lightning_dp.strategies.base.DataParallelStrategy`.
    """

    strategy_name = "parameter_server"
    _trainers_serve = False

    def __init__(self, server_rank: int = 0, **kwargs: Any) -> None:
        self.server_rank = check_rank("server_rank", server_rank)
        super().__init__(**kwargs)
        if self.num_servers and self.server_rank != 0:
            raise ConfigurationError(
                f"server_rank={self.server_rank} names a training rank as the server, but num_servers="
                f"{self.num_servers} puts the servers in processes of their own: leave server_rank at 0"
            )

    @override
    def _check_world_size(self, world_size: int) -> None:
        super()._check_world_size(world_size)
        if world_size and self.server_rank >= world_size:
            raise ConfigurationError(
                f"server_rank={self.server_rank} is outside [0, {world_size}) for a run of {world_size} processes"
            )

    @property
    def serving_rank(self) -> int:
        """The global rank of the (co-located) server: ``server_rank``, or after its loss the lowest rank training
        now (``on_rank_loss="continue"``)."""
        return self.source_rank(self.server_rank)

    @property
    def is_server(self) -> bool:
        """Whether this training rank is the (co-located) server."""
        return self.num_servers == 0 and self.global_rank == self.serving_rank

    @override
    def _make_transport(self, shared_memory: bool) -> Transport:
        kwargs = self._shared_memory_kwargs() if shared_memory and self.single_node else None
        if self.rank_loss.name == "continue":  # the server's state replicated as a shard's: everything is one shard
            assert self.gradient_group is not None
            server = dist.get_group_rank(self.gradient_group, self.serving_rank)
            if kwargs is not None:
                return SharedMemoryShardedTransport(self.gradient_group, self.sync_stats, **kwargs, server=server)
            return ShardedServerTransport(self.gradient_group, self.sync_stats, server=server)
        # the gradient group spans every rank in global order: its rank of the server is the global one
        if kwargs is not None:
            return SharedMemoryServerTransport(self.server_rank, self.gradient_group, self.sync_stats, **kwargs)
        return CentralServerTransport(self.server_rank, self.gradient_group, self.sync_stats)

    @override
    def _synchronous_engine(self) -> StepEngine:
        if self.rank_loss.name == "continue":  # the server's state replicated on the next rank
            return ReplicatedShardedEngine(self)
        return CentralServerEngine(self, self.server_rank)

    @override
    def _served_segments(self, buckets: list[GradientBucket]) -> list[list[Segment]]:
        return [
            [(0, b.grad_numel) if r == self.server_rank else (0, 0) for r in range(self.world_size)] for b in buckets
        ]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        cls._register_variants(
            strategy_registry, cls.strategy_name, "Data parallel with a central parameter server holding the optimizer"
        )
