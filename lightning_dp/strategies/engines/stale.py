"""Bounded staleness (SSP) and asynchrony: servers on threads of their own apply each worker's gradient alone."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dp._lightning_compat import (
    after_closure,
    replace_sigterm_notifier,
    replace_step_sigterm_broadcast,
    unwrap_optimizer,
)
from lightning_dp.comm.buckets import GradientBucket, assign_buckets
from lightning_dp.comm.consistency import (
    PushLayout,
    StalenessClient,
    StalenessServer,
    StopReason,
)
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.servers.sharded_optimizer import Segment, ShardedOptimizer, ShardLayout
from lightning_dp.comm.transports.broadcast import broadcast_tensors
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.engines.base import StepEngine

#: the timeout of the staleness process groups: without a deadline in practice, as a server waits for a worker's
#: next message and a flush for the slowest rank's remaining steps however long they take (a dead peer's closed
#: sockets end any wait at once); a push's own waits use the strategy's timeout
SERVER_IDLE_TIMEOUT = timedelta(days=7)


class StaleEngine(StepEngine):
    """``staleness != 0``: the servers apply each worker's gradient when it arrives and a worker waits only as its
    consistency model demands (:mod:`lightning_dp.comm.consistency`). The servers serve from threads of their own,
    every hook and gradient clipping see this rank's own gradient (that is what travels), and every rank gets the
    same weights, holding every update, before validation, at checkpoints and at the end of training.

    ``staleness``: the bound ``k >= 1``, or ``None`` (asynchronous). ``served_segments(buckets)[b][r]`` is the
    range of bucket ``b``'s gradient region rank ``r`` serves.
    """

    #: the protocol's process groups: pushes and replies
    _num_groups: ClassVar[int] = 2
    _client_type: ClassVar[type[StalenessClient]] = StalenessClient

    def __init__(
        self,
        strategy: DataParallelStrategy,
        staleness: int | None,
        served_segments: Callable[[list[GradientBucket]], list[list[Segment]]],
    ) -> None:
        super().__init__(strategy)
        self.staleness = staleness
        self.served_segments = served_segments
        self.buckets: list[GradientBucket] = []
        #: this rank's share of the weights, its own copy (empty on a rank that serves nothing)
        self.layout: ShardLayout | None = None
        #: one per user optimizer, over this rank's server copy of its share of the weights
        self.optimizers: list[ShardedOptimizer] = []
        self.client: StalenessClient | None = None
        self.server: StalenessServer | None = None
        self._groups: tuple[dist.ProcessGroup, ...] | None = None
        self._restore_sigterm: list[Callable[[], None]] = []

    def _lock(self) -> AbstractContextManager[Any]:
        return self.server.lock if self.server is not None else nullcontext()

    @property
    def _serving(self) -> bool:
        return self.client is not None and not self.client.closed

    # ------------------------------------------------------------------ set-up
    def check_devices(self, devices: list[torch.device]) -> None:
        if any(d.type != "cpu" for d in devices):
            raise ConfigurationError(
                f"strategy {self.name!r} with staleness={self.staleness!r} runs on CPU devices only "
                f"(accelerator='cpu'); got {devices[0]}. Use staleness=0 on GPUs."
            )

    def check_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            if any("lr" not in group for group in optimizer.param_groups):
                raise ConfigurationError(
                    f"strategy {self.name!r} with staleness={self.staleness!r} scales each arriving "
                    f"gradient's learning rate, but {type(optimizer).__name__} has no 'lr' in its parameter groups"
                )

    def full_gradients(self, trainer: pl.Trainer, readers: list[str]) -> bool:
        if readers:
            rank_zero_info(
                f"{self.name}: with staleness={self.staleness!r} each rank's gradient travels alone, so "
                f"{', '.join(readers)} see and edit this rank's own gradient (not the average of all ranks)"
            )
        return False

    def setup_gradient_sync(self) -> None:
        strategy = self.strategy
        assert strategy.model is not None
        params = [p for p in strategy.model.parameters() if p.requires_grad]
        if len({p.dtype for p in params}) > 1:
            raise ConfigurationError(
                f"strategy {self.name!r} with staleness={self.staleness!r} needs every trainable parameter "
                f"in one dtype, got {sorted(str(d) for d in {p.dtype for p in params})}"
            )
        cap = int(strategy.bucket_cap_mb * 1024 * 1024)
        buckets = [GradientBucket(i, [params[j] for j in group]) for i, group in enumerate(assign_buckets(params, cap))]
        segments = self.served_segments(buckets)
        if self._groups is None:  # collective: every rank creates them in the same order
            self._groups = self._new_groups()
        owner = f"strategy {self.name!r}"
        layout = ShardLayout(buckets, segments, strategy.global_rank, owner, own_storage=True)
        optimizers = [
            ShardedOptimizer(unwrap_optimizer(o), layout, strategy.gradient_group, owner) for o in strategy.optimizers
        ]
        push_layout = self._push_layout(buckets, segments)
        server, client = self._serve(layout, optimizers, push_layout, self._groups)
        self.buckets, self.layout, self.optimizers, self.client, self.server = (
            buckets, layout, optimizers, client, server
        )  # fmt: skip
        strategy.mark_synchronized(params)
        strategy.sync_stats.bucket_bytes = sum(b.nbytes for b in buckets)
        if server is not None:
            server.start()

    def _push_layout(self, buckets: list[GradientBucket], segments: list[list[Segment]]) -> PushLayout:
        """How a push lays out the buckets for each server."""
        return PushLayout(buckets, segments, self.strategy.world_size)

    def _new_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The protocol's process groups (collective)."""
        groups = tuple(dist.new_group(backend="gloo", timeout=SERVER_IDLE_TIMEOUT) for _ in range(self._num_groups))
        return groups  # type: ignore[return-value]

    def _new_server(
        self,
        layout: ShardLayout,
        optimizers: list[ShardedOptimizer],
        push_layout: PushLayout,
        groups: tuple[dist.ProcessGroup, ...],
    ) -> StalenessServer:
        """The server of this rank's share."""
        strategy = self.strategy
        return StalenessServer(layout, optimizers, push_layout, strategy.global_rank, strategy.world_size,
                               self.staleness, groups[0], groups[1], strategy.sync_stats)  # fmt: skip

    def _serve(
        self,
        layout: ShardLayout,
        optimizers: list[ShardedOptimizer],
        push_layout: PushLayout,
        groups: tuple[dist.ProcessGroup, ...],
    ) -> tuple[StalenessServer | None, StalenessClient]:
        """This rank's server (where it serves a share) and client."""
        strategy = self.strategy
        server = None
        if strategy.global_rank in push_layout.servers:
            server = self._new_server(layout, optimizers, push_layout, groups)
        client = self._client_type(push_layout, strategy.global_rank, groups[0], groups[1], server,
                                   strategy.timeout.total_seconds(), strategy.sync_stats)  # fmt: skip
        return server, client

    def setup_trainer(self, trainer: pl.Trainer) -> None:
        if self._serving:
            # Lightning's SIGTERM broadcasts (before every step, and in its signal handler, installed after set-up)
            # would make every step wait for rank 0: each rank checks its own flag instead, and a terminated rank
            # stops the others through the servers (on_exception)
            self._restore_sigterm = [
                replace_step_sigterm_broadcast(trainer, lambda: _raise_if_sigterm(trainer)),
                replace_sigterm_notifier(trainer),
            ]

    def synchronized_buckets(self) -> list[GradientBucket]:
        return self.buckets  # the reducer is closed: each worker pushes these buckets itself

    def check_measurable(self) -> None:
        raise RuntimeError(
            f"measure_exchange_seconds times a synchronous exchange; strategy {self.name!r} runs with "
            f"staleness={self.staleness!r}, whose workers exchange alone (see sync_stats for their seconds)"
        )

    # ------------------------------------------------------------------ the step
    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        """One step of a worker: its own gradient (hooks and clipping applied) to the servers, new weights back."""
        strategy = self.strategy
        assert self.client is not None
        strategy.check_trainable_unchanged(optimizer)
        result = closure()
        after_closure(strategy.precision_plugin, model, optimizer)  # on_before_optimizer_step hooks, clipping
        with self._lock():
            for sharded in self.optimizers:
                sharded.follow_param_groups()
        grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = first_nonfinite(grads)
        if bad is not None:
            self.client.close(StopReason.NONFINITE)
            strategy.raise_nonfinite(bad)
        start = time.perf_counter()
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                bucket.fill(i, p.grad)
        index = [unwrap_optimizer(o) for o in strategy.optimizers].index(optimizer)
        self.staleness_seen.add(self.client.push(index))
        strategy.end_step(blocking_seconds=time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------ Lightning's loop
    def flush(self) -> None:
        """Every rank gets the servers' weights, holding every update so far, and rank 0's buffers (collective; a no-op
        once the servers have stopped). Before the first push (the sanity check) the servers take rank 0's weights
        instead, so that edits made after set-up (``on_fit_start``) are kept."""
        strategy = self.strategy
        if not self._serving:
            return
        assert self.client is not None and strategy.lightning_module is not None and strategy.model is not None
        if strategy.lightning_module.trainer.state.status == TrainerStatus.INTERRUPTED:
            return  # a checkpoint on exception: the other ranks are not at this flush, and the run is stopping
        if self.client.clock == 0:
            self._resync_servers()
        else:
            self.client.flush()
        buffers = list(strategy.model.buffers())
        if strategy.broadcast_buffers and buffers:
            broadcast_tensors(buffers, src=0, group=strategy.gradient_group)

    def _resync_servers(self) -> None:
        """Every rank and every server takes rank 0's weights as they are now; returns when all have (collective)."""
        strategy = self.strategy
        assert self.layout is not None and strategy.model is not None
        broadcast_tensors([p.data for p in strategy.model.parameters()], src=0, group=strategy.gradient_group)
        with self._lock():
            self.layout.read_storage()
        dist.barrier(group=strategy.gradient_group)

    def on_train_start(self) -> None:
        if self._serving:
            # every rank starts from rank 0's weights as they are now (after on_fit_start / on_train_start hooks and
            # any restore), and no rank pushes before every server holds them and its restored state
            self._resync_servers()

    def on_train_end(self) -> None:
        self.flush()

    def on_exception(self, exception: BaseException) -> None:
        if self._serving:  # the others stop at their next request
            assert self.client is not None
            terminated = isinstance(exception, SIGTERMException)
            self.client.close(StopReason.TERMINATED if terminated else StopReason.ERROR)

    def teardown(self) -> None:
        """Stop serving; the servers' optimizers stay, so a checkpoint saved after ``fit`` still holds their state."""
        for restore in self._restore_sigterm:
            restore()
        self._restore_sigterm = []
        if self.client is not None:
            self.client.close(timeout=self.strategy.timeout.total_seconds())

    # ------------------------------------------------------------------ optimizer state
    def stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        return [s.shard for s in self.optimizers if s.serves_anything]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The servers' full optimizer state for ``optimizer``, consolidated on rank 0 (collective)."""
        strategy = self.strategy
        assert self.client is not None and strategy.lightning_module is not None
        sharded = next(o for o in self.optimizers if o.optimizer is optimizer)
        if strategy.lightning_module.trainer.state.status == TrainerStatus.INTERRUPTED:
            # a checkpoint on exception: the other ranks are not here to gather with; stop them first
            self.client.close(StopReason.ERROR)
            rank_zero_warn(
                f"strategy {self.name!r}: a checkpoint written while the run fails holds no optimizer state "
                "(the servers' state is spread over the ranks and cannot be gathered now); its weights are rank 0's"
            )
            return {"state": {}, "param_groups": sharded.optimizer.state_dict()["param_groups"]}
        with self._lock():
            sharded.consolidate_state_dict(to=0)
        return sharded.state_dict() if strategy.is_global_zero else {}

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Each server takes its share of a full (standard layout) optimizer state."""
        with self._lock():
            for sharded, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
                sharded.load_state_dict(saved)


def _raise_if_sigterm(trainer: pl.Trainer) -> None:
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()
