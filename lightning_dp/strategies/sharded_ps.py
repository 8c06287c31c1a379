"""``sharded_ps``: every rank serves 1/N of the parameters and holds 1/N of the optimizer state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dp._lightning_compat import unwrap_optimizer
from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.sharded_optimizer import ShardedOptimizer, ShardLayout, check_shardable
from lightning_dp.comm.transports import (
    ShardedServerTransport,
    SharedMemoryShardedTransport,
    Transport,
    balanced_shards,
)
from lightning_dp.strategies.parameter_server_base import ParameterServerBase, Segment


class ShardedParameterServerStrategy(ParameterServerBase):
    """Parameter server sharded over all ranks.

    Every gradient bucket is cut into N shards of equal length at element granularity, so one huge tensor
    cannot unbalance them; rank ``i`` serves shard ``i`` of every bucket. During backward every rank pushes
    shard ``i`` of each finished bucket to rank ``i``, which averages it. At the step, rank ``i`` runs the
    user's optimizer on its shard only (a :class:`~lightning_dp.comm.sharded_optimizer.ShardedOptimizer`: the
    same class and hyperparameters over views of the parameters, so its state is 1/N of the total), then every
    rank sends its updated shard to all others. Each rank moves ``2 (N - 1) / N S`` bytes per step, like the ring.

    Gradient clipping by norm uses the global norm, summed across shards. Only element-wise optimizers
    (:data:`~lightning_dp.comm.sharded_optimizer.ELEMENTWISE_OPTIMIZERS`) can run on slices of tensors; others
    are refused at set-up. Checkpoints hold the optimizer state in torch's standard, unsharded layout.

    With ``num_servers=k`` dedicated server processes take part of the shards: the trainers keep the share that
    balances every machine's traffic, ``(n - k) / (n² + k n - 2 k)`` each, and the servers the rest, which makes a
    step's exchange ``2 n (n - 1) / (n² + k n - 2 k) · S / B`` (see :mod:`lightning_dp.comm.dedicated`).

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
    def _setup_gradient_sync(self) -> None:
        super()._setup_gradient_sync()
        if self.staleness != 0 or self.num_servers:  # servers on threads or in processes of their own
            return
        assert self.reducer is not None and isinstance(
            self.transport, (ShardedServerTransport, SharedMemoryShardedTransport)
        )
        owner = f"strategy {self.strategy_name!r}"
        self.layout = ShardLayout(self.reducer.buckets, self.transport.segments, self.transport.rank, owner)
        self.sharded_optimizers = [
            ShardedOptimizer(unwrap_optimizer(o), self.layout, self.gradient_group, owner) for o in self.optimizers
        ]
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = self._clip_grad_by_value  # type: ignore[method-assign]

    def _sharded(self, optimizer: Any) -> ShardedOptimizer:
        optimizer = unwrap_optimizer(optimizer)
        for sharded in self.sharded_optimizers:
            if sharded.optimizer is optimizer:
                return sharded
        raise KeyError("optimizer is not one of the strategy's optimizers")

    # ------------------------------------------------------------------ the servers' step
    @override
    def _gradients_before_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.reducer is not None
        self._sharded(optimizer).follow_param_groups()
        # once per synchronization, for every optimizer's pieces: the pull after this step overwrites the buckets,
        # and a step without a backward (nothing fresh) keeps no gradient
        if not self.full_gradients and self.reducer.consume():
            self.layout.take_bucket_gradients()

    @override
    def _gradients_after_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        # every rank holds the averaged gradients in param.grad, as edited by the hooks and clipped
        if self.full_gradients:
            self._sharded(optimizer).take_param_gradients()

    @override
    def _server_gradients(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
        return self._sharded(optimizer).gradients()

    @override
    def _server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        self._sharded(optimizer).step(**kwargs)

    def _clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if self.full_gradients:  # param.grad holds the averaged gradients everywhere: clip them as Lightning does
            type(self.precision_plugin).clip_grad_by_value(self.precision_plugin, optimizer, clip_val)
        else:
            self._sharded(optimizer).clip_grad_value_(clip_val)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if self.full_gradients:
            type(self.precision_plugin).clip_grad_by_norm(self.precision_plugin, optimizer, clip_val)
        else:
            self._sharded(optimizer).clip_grad_norm_(clip_val)

    @override
    def _stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        if self._dedicated is not None:
            return [s.shard for s in self._dedicated.optimizers if s.serves_anything]
        optimizers = self._stale.optimizers if self._stale is not None else self.sharded_optimizers
        return [s.shard for s in optimizers if s.serves_anything]

    # ------------------------------------------------------------------ checkpoints in the standard torch layout
    @override
    def optimizer_state(self, optimizer: Any) -> dict:
        """The full optimizer state, consolidated from every shard, on rank 0 (every rank must call it)."""
        if self._stale is not None:
            return self._stale_optimizer_state(optimizer)
        if self._dedicated is not None:
            return self._dedicated.optimizer_state(unwrap_optimizer(optimizer))
        sharded = self._sharded(optimizer)
        sharded.consolidate_state_dict(to=0)
        return sharded.state_dict() if self.is_global_zero else {}

    @override
    def _load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank takes its shard's slice of a full (standard layout) optimizer state."""
        if self._stale is not None:
            self._load_stale_optimizer_states(checkpoint)
            return
        if self._dedicated is not None:
            self._dedicated.load_optimizer_states(checkpoint)
            return
        for sharded, saved in zip(self.sharded_optimizers, checkpoint["optimizer_states"]):
            sharded.load_state_dict(saved)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = "Data parallel with a parameter server sharded over all ranks (1/N of the optimizer state each)"
        cls._register_variants(strategy_registry, cls.strategy_name, description)
        cls._register_variants(strategy_registry, "sharded_parameter_server", description)
