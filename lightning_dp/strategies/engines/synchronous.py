"""The synchronous step with the servers among the trainers: one central server rank, or every rank a shard."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_dp._lightning_compat import after_closure, replace_clipping, unwrap_optimizer
from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.host import to_host
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout, hyperparameters
from lightning_dp.comm.transports import ShardedServerTransport, SharedMemoryShardedTransport
from lightning_dp.comm.transports.ring import Ring
from lightning_dp.comm.transports.shards import any_rank
from lightning_dp.comm.weight_pull import BlockingPull, OverlappedPull, ReadProbe
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.engines.base import StepEngine
from lightning_dp.strategies.weight_hooks import CompleteWeightsBefore, weight_readers

if TYPE_CHECKING:
    from lightning_dp.strategies.parameter_server_base import ParameterServerBase


class SynchronousEngine(StepEngine):
    """Every step waits for every rank's gradients; the servers are training ranks.

    A step is: the closure (forward, backward; gradients are pushed to their servers bucket by bucket during
    backward), Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, a vote on NaN/inf, the servers'
    update and the pull of the new weights over the transport. Ranks that serve nothing never call the optimizer,
    so they hold no optimizer state. A subclass says who serves what.

    With the strategy's ``overlap_pull`` the step only posts the pull, and each module's forward waits for its own
    weights (:class:`~lightning_dp.comm.weight_pull.OverlappedPull`); whatever else reads the weights between steps
    completes the pull first (:meth:`complete_pull`): backward, validation, checkpoints, the end of training, and
    the hooks of callbacks that may read them (:mod:`~lightning_dp.strategies.weight_hooks`).
    """

    def __init__(self, strategy: DataParallelStrategy) -> None:
        super().__init__(strategy)
        #: the weights' way down after the servers' update: one object per mode, chosen at set-up
        self.weights: BlockingPull | None = None
        self._probe: ReadProbe | None = None
        self._weight_hooks: CompleteWeightsBefore | None = None

    def setup_gradient_sync(self) -> None:
        self.strategy.setup_bucket_exchange()
        self.weights = self._make_weight_pull()

    def _make_weight_pull(self) -> BlockingPull:
        strategy = cast("ParameterServerBase", self.strategy)
        assert strategy.reducer is not None and strategy.model is not None
        refusal = strategy.pull_overlap_refusal()
        if refusal is not None:
            if strategy.overlap_pull:
                rank_zero_info(f"{self.name}: the weight pull runs at the end of each step ({refusal})")
            return BlockingPull(self._pull_bucket, self._unpack, strategy.reducer)
        pull = OverlappedPull(self._pull_bucket, self._unpack, strategy.reducer, strategy.model, self._needs_unpack,
                              strategy.sync_stats)  # fmt: skip
        self._probe = ReadProbe(pull, {id(p): name for name, p in strategy.model.named_parameters()})
        return pull

    def _needs_unpack(self, bucket: GradientBucket) -> bool:
        """Whether this rank takes ``bucket``'s weights from the pull (an owner of all of it holds them already)."""
        strategy = self.strategy
        assert strategy.transport is not None
        return strategy.codec.rewrites_weights or not strategy.transport.owns_all(bucket)

    def _pull_bucket(self, bucket: GradientBucket) -> None:
        """The owners pack their new weights of ``bucket``, and the codec shares them over the transport."""
        strategy = self.strategy
        assert strategy.transport is not None
        start, end = strategy.transport.owned(bucket)
        bucket.pack_params(start, end)
        strategy.codec.share_weights(bucket, strategy.transport)

    def _unpack(self, bucket: GradientBucket) -> None:
        strategy = self.strategy
        assert strategy.transport is not None
        if strategy.codec.rewrites_weights:  # every rank, owners included, takes the weights as they travelled
            bucket.unpack_params()
        elif not strategy.transport.owns_all(bucket):  # an owner's own range holds its updated weights already
            bucket.unpack_params(keep=strategy.transport.owned(bucket))

    def setup_trainer(self, trainer: pl.Trainer) -> None:
        if self.weights is None or not self.weights.overlapped:
            return
        assert self.strategy.lightning_module is not None
        readers = weight_readers(trainer, self.strategy.lightning_module)
        self._weight_hooks = CompleteWeightsBefore(self.complete_pull, readers)
        self._weight_hooks.install(trainer)
        if readers:
            named = ", ".join(f"{who}.{hook}" for hook, whos in readers.items() for who in whos)
            rank_zero_info(
                f"{self.name}: the weight pull completes before {named}, which may read the weights between steps "
                "(a callback that does not declares reads_weights = False)"
            )

    def complete_pull(self) -> None:
        if self.weights is not None:
            self.weights.complete()

    @contextmanager
    def training_step_context(self) -> Generator[None, None, None]:
        if self._probe is not None and self._probe.watched:
            self._decide_overlap(self._probe)
        pull = self.weights
        if not isinstance(pull, OverlappedPull):
            yield
            return
        root = self.strategy.lightning_module
        assert root is not None
        pull.wait_for(pull.buckets_holding(root.parameters(recurse=False)))  # training_step may read them itself
        if self._probe is None or pull.pending:
            yield
            return
        with self._probe:
            self._probe.current.update(pull.buckets_holding(root.parameters(recurse=False)))
            yield

    def _decide_overlap(self, probe: ReadProbe) -> None:
        """After the first forward under the probe, every rank keeps the overlap (posting in the order rank 0's
        forward asked for the buckets), or every rank runs the pull at the end of each step from now on. Collective,
        on the default group: the gradient group may carry the pull."""
        strategy = self.strategy
        self._probe = None
        assert isinstance(self.weights, OverlappedPull) and strategy.reducer is not None
        if not any_rank(bool(probe.early_reads), Ring(None), strategy.root_device):
            order = [self.weights.forward_order]
            dist.broadcast_object_list(order, src=0)
            self.weights.agree_order(order[0])
            return
        self.weights.complete()
        self.weights.close()
        self.weights = BlockingPull(self._pull_bucket, self._unpack, strategy.reducer)
        if probe.early_reads:
            warnings.warn(
                f"{self.name}: the training step on rank {strategy.global_rank} reads {', '.join(probe.early_reads)} "
                "before a module holding them runs its forward, so the weight pull cannot overlap the forward: every "
                "rank runs it at the end of each step from now on (overlap_pull=False says so up front)",
                stacklevel=2,
            )
        else:
            rank_zero_info(
                f"{self.name}: another rank's training step reads weights before a module holding them runs its "
                "forward (it warns, naming them): every rank runs the weight pull at the end of each step from now on"
            )

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        strategy = self.strategy
        strategy.check_trainable_unchanged(optimizer)
        result = closure()
        self.complete_pull()  # a closure without backward, or a second optimizer's step after the first one's pull
        if self._probe is not None and self._probe.watched:  # the closure ran the first forward: nothing in flight
            self._decide_overlap(self._probe)
        self.gradients_before_hooks(optimizer)
        after_closure(strategy.precision_plugin, model, optimizer)  # on_before_optimizer_step hooks, clipping
        self.gradients_after_hooks(optimizer)
        self.check_server_gradients(optimizer)
        assert strategy.transport is not None and self.weights is not None
        for bucket in strategy.buckets_of(optimizer):  # a codec may keep the owners' weights apart (16-bit replicas)
            strategy.codec.before_update(bucket, strategy.transport)
        self.server_update(optimizer, **kwargs)
        self.pull_weights(optimizer)
        strategy.end_step()
        self.staleness_seen.add(0)
        return result

    def pull_weights(self, optimizer: torch.optim.Optimizer) -> None:
        """The servers' new weights of ``optimizer``'s buckets to every rank (posted, where the pull overlaps)."""
        assert self.weights is not None
        self.weights.post(self.strategy.buckets_of(optimizer))

    def gradients_before_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand the averaged gradients to the servers' update before ``on_before_optimizer_step``."""

    def gradients_after_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Or after it and clipping, when the servers must step with gradients the hooks edited."""

    def server_gradients(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
        """``(parameter, averaged gradient)`` pairs this rank serves for ``optimizer``'s step."""
        raise NotImplementedError

    def server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """Run the servers' optimizer step for ``optimizer`` on this rank (if it serves any of its parameters)."""
        raise NotImplementedError

    def check_server_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Only servers see averaged gradients: they vote (one tiny all-reduce) so every rank decides alike."""
        strategy = self.strategy
        assert strategy.transport is not None
        bad = first_nonfinite(self.server_gradients(optimizer))
        if any_rank(bad is not None, strategy.transport.ring, strategy.root_device):
            strategy.raise_nonfinite(bad)

    def exchange_weights(self) -> None:
        self.complete_pull()
        for optimizer in self.strategy.optimizers:
            for bucket in self.strategy.buckets_of(unwrap_optimizer(optimizer)):
                self._pull_bucket(bucket)
                self._unpack(bucket)

    def flush(self) -> None:
        self.complete_pull()

    def on_train_end(self) -> None:
        self.complete_pull()

    def on_exception(self, exception: BaseException) -> None:
        if self.weights is not None:
            self.weights.discard()

    def close_gradient_sync(self) -> None:
        if self.weights is not None:
            self.weights.discard()
            self.weights.close()
            self.weights = None
        self._probe = None
        if self._weight_hooks is not None:
            self._weight_hooks.remove()
            self._weight_hooks = None


class CentralServerEngine(SynchronousEngine):
    """One training rank, ``server_rank``, holds the optimizer and its whole state."""

    def __init__(self, strategy: DataParallelStrategy, server_rank: int) -> None:
        super().__init__(strategy)
        self.server_rank = server_rank

    @property
    def is_server(self) -> bool:
        return self.strategy.global_rank == self.server_rank

    def copies_back(self) -> bool:
        return self.strategy.full_gradients or self.is_server

    def server_gradients(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
        if not self.is_server:
            return []
        return [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        if self.is_server:
            optimizer.step(**kwargs)

    def stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        return [unwrap_optimizer(o) for o in self.strategy.optimizers] if self.is_server else []

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        strategy = self.strategy
        self.complete_pull()
        state = optimizer.state_dict() if self.is_server else {}
        if self.server_rank == 0:
            return state
        gathered: list[dict] | None = [{} for _ in range(strategy.world_size)] if strategy.is_global_zero else None
        dist.gather_object(to_host(state), gathered, dst=0)  # rank 0 must not rebuild it on the server's GPU
        return gathered[self.server_rank] if gathered is not None else {}

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """The server loads the full state; workers take only the hyperparameters and stay without state."""
        for optimizer, saved in zip(self.strategy.optimizers, checkpoint["optimizer_states"]):
            optimizer = unwrap_optimizer(optimizer)
            if self.is_server:
                optimizer.load_state_dict(saved)
            else:
                for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
                    group.update(hyperparameters(saved_group))


class ShardedServerEngine(SynchronousEngine):
    """Every rank serves its shard of every bucket with a
    :class:`~lightning_dp.comm.servers.ShardedOptimizer` (1/N of the optimizer state each); clipping by norm
    uses the global norm, summed across shards."""

    def __init__(self, strategy: DataParallelStrategy) -> None:
        super().__init__(strategy)
        self.layout: ShardLayout | None = None
        self.sharded_optimizers: list[ShardedOptimizer] = []
        self._restore_clipping: Callable[[], None] | None = None

    def setup_gradient_sync(self) -> None:
        super().setup_gradient_sync()
        strategy = self.strategy
        assert strategy.reducer is not None
        assert isinstance(strategy.transport, (ShardedServerTransport, SharedMemoryShardedTransport))
        self.build_layout()
        self._restore_clipping = replace_clipping(
            strategy.precision_plugin, self._clip_grad_by_norm, self._clip_grad_by_value
        )

    def build_layout(self) -> None:
        """This rank's shard of every bucket (the transport's segments) and a sharded optimizer per optimizer."""
        strategy = self.strategy
        assert strategy.reducer is not None
        assert isinstance(strategy.transport, (ShardedServerTransport, SharedMemoryShardedTransport))
        owner = f"strategy {self.name!r}"
        self.layout = ShardLayout(strategy.reducer.buckets, strategy.transport.segments, strategy.transport.rank, owner)
        self.sharded_optimizers = [
            ShardedOptimizer(unwrap_optimizer(o), self.layout, strategy.gradient_group, owner)
            for o in strategy.optimizers
        ]

    def close_gradient_sync(self) -> None:
        super().close_gradient_sync()
        if self._restore_clipping is not None:
            self._restore_clipping()
            self._restore_clipping = None

    def _sharded(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        for sharded in self.sharded_optimizers:
            if sharded.optimizer is optimizer:
                return sharded
        raise KeyError("optimizer is not one of the strategy's optimizers")

    def gradients_before_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = self.strategy
        assert strategy.reducer is not None and self.layout is not None
        self._sharded(optimizer).follow_param_groups()
        # once per synchronization, for every optimizer's pieces: the pull after this step overwrites the buckets,
        # and a step without a backward (nothing fresh) keeps no gradient
        if not strategy.full_gradients and strategy.reducer.consume():
            self.layout.take_bucket_gradients()

    def gradients_after_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        # every rank holds the averaged gradients in param.grad, as edited by the hooks and clipped
        if self.strategy.full_gradients:
            self._sharded(optimizer).take_param_gradients()

    def server_gradients(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
        return self._sharded(optimizer).gradients()

    def server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        self._sharded(optimizer).step(**kwargs)

    def _clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        plugin = self.strategy.precision_plugin
        if self.strategy.full_gradients:  # param.grad holds the averaged gradients everywhere: clip as Lightning does
            type(plugin).clip_grad_by_value(plugin, optimizer, clip_val)
        else:
            self._sharded(unwrap_optimizer(optimizer)).clip_grad_value_(clip_val)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        plugin = self.strategy.precision_plugin
        if self.strategy.full_gradients:
            type(plugin).clip_grad_by_norm(plugin, optimizer, clip_val)
        else:
            self._sharded(unwrap_optimizer(optimizer)).clip_grad_norm_(clip_val)

    def stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        return [s.shard for s in self.sharded_optimizers if s.serves_anything]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        self.complete_pull()
        sharded = self._sharded(optimizer)
        sharded.consolidate_state_dict(to=0)
        return sharded.state_dict() if self.strategy.is_global_zero else {}

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank takes its shard's slice of a full (standard layout) optimizer state."""
        for sharded, saved in zip(self.sharded_optimizers, checkpoint["optimizer_states"]):
            sharded.load_state_dict(saved)
