"""``parameter_server``: one rank aggregates gradients, runs the optimizer and sends the weights back."""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch
import torch.distributed as dist

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.parameter_server import pull_weights, push_gradients
from lightning_dp.strategies.base import ParameterServerBase, hyperparameters
from typing_extensions import override


class ParameterServerStrategy(ParameterServerBase):
    """Central parameter server, co-located with a worker: the server rank also trains on its own data shard.

    Every step each worker pushes its gradient buckets to the server during backward (fan-in); the server
    averages them, applies the user's optimizer (the only optimizer state in the job lives there) and sends
    the updated weights to every worker (fan-out). The server moves ``(N - 1) S`` bytes each way per step,
    a worker ``S``: the single-server bottleneck the sharded variant removes.

    Args:
        server_rank: global rank of the server, in ``[0, world_size)``.
        **kwargs: see :class:`~lightning_dp.strategies.base.DataParallelStrategy`.
    """

    strategy_name = "parameter_server"

    def __init__(self, server_rank: int = 0, **kwargs: Any) -> None:
        if isinstance(server_rank, bool) or not isinstance(server_rank, numbers.Integral) or server_rank < 0:
            raise ValueError(f"server_rank must be a rank in [0, world_size), got {server_rank!r}")
        super().__init__(**kwargs)
        self.server_rank = int(server_rank)

    def _check_world_size(self, world_size: int) -> None:
        if world_size and self.server_rank >= world_size:
            raise ValueError(
                f"server_rank={self.server_rank} is outside [0, {world_size}) for a run of {world_size} processes"
            )

    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._check_world_size(self.world_size)

    @property
    def is_server(self) -> bool:
        return self.global_rank == self.server_rank

    def _reduce_bucket(self, bucket: GradientBucket) -> None:
        push_gradients(bucket.buffer, self.server_rank, self.gradient_group, self.comm_stats)
        if self.full_gradients:  # the averaged gradients back to every worker, for their hooks
            pull_weights(bucket.buffer, self.server_rank, self.gradient_group, self.comm_stats)

    @override
    def _copies_back(self) -> bool:
        return self.full_gradients or self.is_server

    def _server_gradients(self, optimizer: torch.optim.Optimizer) -> list:
        if not self.is_server:
            return []
        return [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        if self.is_server:
            optimizer.step(**kwargs)

    def _pull(self, optimizer: torch.optim.Optimizer) -> None:
        for bucket in self._buckets_of(optimizer):
            if self.is_server:
                bucket.pack_params()
            pull_weights(bucket.buffer, self.server_rank, self.gradient_group, self.comm_stats)
            if not self.is_server:
                bucket.unpack_params()

    def _stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers] if self.is_server else []

    # ------------------------------------------------------------------ checkpoints: the server's state, in torch layout
    def optimizer_state(self, optimizer: Any) -> dict:
        """The server's full optimizer state on rank 0 (collective: every rank calls it when checkpointing)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        state = optimizer.state_dict() if self.is_server else None
        if self.server_rank == 0:
            return state if self.is_global_zero else {}
        gathered = [None] * self.world_size if self.is_global_zero else None
        dist.gather_object(state, gathered, dst=0)
        return gathered[self.server_rank] if self.is_global_zero else {}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The server loads the full state; workers take only the hyperparameters and stay without state."""
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            if self.is_server:
                optimizer.load_state_dict(saved)
            else:
                for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
                    group.update(hyperparameters(saved_group))

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        cls._register_variants(
            strategy_registry, cls.strategy_name, "Data parallel with a central parameter server holding the optimizer"
        )
