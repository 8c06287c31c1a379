"""The step of the parameter-server schemes: servers run the optimizer, every rank pulls the new weights."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_dp._lightning_compat import (
    after_closure,
    replace_sigterm_notifier,
    replace_step_sigterm_broadcast,
    unwrap_optimizer,
)
from lightning_dp.comm.broadcast import broadcast_tensors
from lightning_dp.comm.buckets import BucketReducer, GradientBucket, assign_buckets
from lightning_dp.comm.consistency import (
    REASON_ERROR,
    REASON_NONFINITE,
    REASON_TERMINATED,
    PushLayout,
    StalenessClient,
    StalenessRecord,
    StalenessServer,
    check_staleness,
)
from lightning_dp.comm.cost import Scheme
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.ring import Ring, any_rank
from lightning_dp.comm.sharded_optimizer import Segment, ShardedOptimizer, ShardLayout
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.dedicated_servers import DedicatedServers, next_run_key
from lightning_dp.strategies.inspection import gradient_readers
from lightning_dp.strategies.options import check_count, check_flag

#: the timeout of the staleness process groups: without a deadline in practice, as a server waits for a worker's
#: next message and a flush for the slowest rank's remaining steps however long they take (a dead peer's closed
#: sockets end any wait at once); a push's own waits use the strategy's timeout
SERVER_IDLE_TIMEOUT = timedelta(days=7)

#: optimizers that re-evaluate the closure within one step; a server cannot re-run the workers' forward passes
CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


@dataclass
class _StaleSync:
    """The pieces of a run with ``staleness != 0`` (see :mod:`lightning_dp.comm.consistency`)."""

    buckets: list[GradientBucket]
    #: this rank's share of the weights, its own copy (empty on a rank that serves nothing)
    layout: ShardLayout
    #: one per user optimizer, over this rank's server copy of its share of the weights
    optimizers: list[ShardedOptimizer]
    client: StalenessClient
    server: StalenessServer | None

    def lock(self) -> AbstractContextManager[Any]:
        return self.server.lock if self.server is not None else nullcontext()


class ParameterServerBase(DataParallelStrategy):
    """Shared step logic of the parameter-server schemes: servers run the optimizer, every rank pulls weights.

    A step is: the closure (forward, backward; gradients are pushed to their servers bucket by bucket during
    backward), Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, a vote on NaN/inf, then
    :meth:`_server_update` and the pull of the new weights over the transport. Ranks that serve nothing never
    call the optimizer, so they hold no optimizer state.

    When nothing in the run reads gradients between backward and the step
    (:func:`~lightning_dp.strategies.inspection.gradient_readers`), only a server holds averaged gradients, and
    only for what it serves; ``param.grad`` elsewhere keeps the local gradient. Otherwise (:attr:`full_gradients`)
    the servers also send the averaged gradients back, so that every rank's hooks see and edit exactly what they
    would see under DDP, and the servers step with the edited gradients: the central server sends ``(N - 1) S``
    more bytes per step, a sharded server ``(N - 1) / N S``.

    With ``staleness != 0`` the servers apply each worker's gradient when it arrives and a worker waits only as
    its consistency model demands (:mod:`lightning_dp.comm.consistency`): the servers serve from threads of their
    own, every hook and gradient clipping see this rank's own gradient (that is what travels), and every rank
    gets the same weights, holding every update, before validation, at checkpoints and at the end of training.

    A subclass provides the transport, :meth:`_server_gradients` and :meth:`_server_update`, and may take the
    averaged gradients into the server's optimizer in :meth:`_gradients_before_hooks` /
    :meth:`_gradients_after_hooks`; for ``staleness != 0`` :meth:`_served_segments`.

    Args:
        staleness: the consistency model. ``0`` (default): synchronous, every step waits for every rank's
            gradients. ``k >= 1``: bounded staleness (SSP): a worker at step ``c`` uses weights holding every
            worker's updates of steps before ``c - k`` at least, and waits only when a slower worker would break
            that. ``None``: asynchronous, no bound. Each arriving gradient is applied alone, the learning rate
            scaled by :func:`~lightning_dp.comm.consistency.arrival_lr_scale` (``1 / N`` for SGD, ``1 / sqrt(N)``
            for adaptive optimizers such as Adam). CPU training (gloo) only.
        num_servers: dedicated server processes (``0``, default: the servers are training ranks). With ``k > 0``
            the servers are processes of their own, not Lightning ranks (``trainer.world_size`` counts trainers);
            how the weights are split over them is the subclass's (see :mod:`lightning_dp.comm.dedicated`).
            Synchronous only (``staleness=0``), uncompressed.
        start_servers: with ``num_servers > 0``, whether trainer 0 starts the servers on its own machine (default)
            or they are started elsewhere with ``python -m lightning_dp.server`` (on spare CPU machines).
        **kwargs: see :class:`~lightning_dp.strategies.base.DataParallelStrategy`.
    """

    _every_rank_steps = False

    #: with dedicated servers: whether the trainers serve a share too (the optimal split), or only the servers do,
    #: each a set of whole parameters
    _trainers_serve: ClassVar[bool] = True

    def __init__(
        self,
        *args: Any,
        staleness: int | None = 0,
        num_servers: int = 0,
        start_servers: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        try:
            self.staleness = check_staleness(staleness)
        except ValueError as error:
            raise ConfigurationError(str(error)) from None
        self.num_servers = check_count("num_servers", num_servers, 0)
        self.start_servers = check_flag("start_servers", start_servers)
        if self.num_servers and self.staleness != 0:
            raise ConfigurationError(
                f"num_servers={self.num_servers} needs staleness=0 (dedicated servers run the synchronous step); got "
                f"staleness={self.staleness!r}. Use num_servers=0 for bounded staleness or asynchrony."
            )
        if self.num_servers and self.compression != "none":
            raise ConfigurationError(
                f"num_servers={self.num_servers} needs compression='none' (dedicated servers exchange full-precision "
                f"buckets); got compression={self.compression!r}"
            )
        self._dedicated: DedicatedServers | None = None
        if self.staleness != 0 and self.compression != "none":
            raise ConfigurationError(
                f"compression={self.compression!r} needs staleness=0: with staleness={self.staleness!r} each "
                "worker's gradient travels alone and is not compressed; use compression='none'"
            )
        #: the staleness this rank saw at each of its steps (always 0 when synchronous)
        self.staleness_seen = StalenessRecord()
        self._stale: _StaleSync | None = None
        self._restore_sigterm: list[Callable[[], None]] = []
        self._stale_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None

    @override
    def _check_world_size(self, world_size: int) -> None:
        super()._check_world_size(world_size)
        devices = self.parallel_devices or []
        if self.staleness != 0 and any(d.type != "cpu" for d in devices):
            raise ConfigurationError(
                f"strategy {self.strategy_name!r} with staleness={self.staleness!r} runs on CPU devices only "
                f"(accelerator='cpu'); got {devices[0]}. Use staleness=0 on GPUs."
            )

    @override
    def _gradients_everywhere(self, trainer: pl.Trainer) -> bool:
        assert self.lightning_module is not None and self.gradient_group is not None
        readers = gradient_readers(trainer, self.lightning_module)
        if self.staleness != 0:
            if readers:
                rank_zero_info(
                    f"{self.strategy_name}: with staleness={self.staleness!r} each rank's gradient travels alone, so "
                    f"{', '.join(readers)} see and edit this rank's own gradient (not the average of all ranks)"
                )
            return False
        # every rank must send the same messages: one rank's reader (a callback added on rank 0 only) decides for all
        anyone = any_rank(bool(readers), Ring(self.gradient_group), self.root_device)
        if readers:
            rank_zero_info(
                f"{self.strategy_name}: every rank receives the averaged gradients after backward (more traffic per "
                f"step) because gradients are read or edited before the optimizer step by: {', '.join(readers)}"
            )
        return anyone

    @override
    def _check_optimizers(self) -> None:
        for optimizer in map(unwrap_optimizer, self.optimizers):
            if isinstance(optimizer, CLOSURE_OPTIMIZERS):
                raise ConfigurationError(
                    f"strategy {self.strategy_name!r} cannot run optimizer {type(optimizer).__name__}: it "
                    "re-evaluates the closure several times per step, which only the rank running forward can do. "
                    "Use a per-parameter optimizer (SGD, Adam, AdamW, ...) or strategy='ring_allreduce'."
                )
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ConfigurationError(
                f"strategy {self.strategy_name!r} does not support precision='16-mixed' (its gradient scaler "
                "would need to run on the servers); use precision='bf16-mixed' or '32-true'."
            )
        if self.staleness != 0:
            for optimizer in map(unwrap_optimizer, self.optimizers):
                if any("lr" not in group for group in optimizer.param_groups):
                    raise ConfigurationError(
                        f"strategy {self.strategy_name!r} with staleness={self.staleness!r} scales each arriving "
                        f"gradient's learning rate, but {type(optimizer).__name__} has no 'lr' in its parameter groups"
                    )

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.staleness != 0:
            return self._stale_step(optimizer, closure, model)
        if self._dedicated is not None:
            self._check_trainable_unchanged(unwrap_optimizer(optimizer))
            return self._dedicated.step(unwrap_optimizer(optimizer), closure, model or self.lightning_module, **kwargs)
        model = model or self.lightning_module
        optimizer = unwrap_optimizer(optimizer)
        self._check_trainable_unchanged(optimizer)
        result = closure()
        self._gradients_before_hooks(optimizer)
        after_closure(self.precision_plugin, model, optimizer)  # on_before_optimizer_step hooks, clipping
        self._gradients_after_hooks(optimizer)
        self._check_server_gradients(optimizer)
        assert self.transport is not None
        for bucket in self._buckets_of(optimizer):  # a codec may keep the owners' weights apart (16-bit replicas)
            self.codec.before_update(bucket, self.transport)
        self._server_update(optimizer, **kwargs)
        start = time.perf_counter()
        self._pull(optimizer)
        self._end_step(blocking_seconds=time.perf_counter() - start)
        self.staleness_seen.add(0)
        return result

    @override
    def _synchronized_buckets(self) -> list[GradientBucket]:
        if self._stale is not None:  # the reducer is closed: each worker pushes these buckets itself
            return self._stale.buckets
        return super()._synchronized_buckets()

    @override
    def cost_scheme(self) -> Scheme:
        scheme = super().cost_scheme()
        if self._dedicated is not None:
            scheme = dataclasses.replace(scheme, intra_node="ring")
        return dataclasses.replace(scheme, staleness=self.staleness, num_servers=self.num_servers)

    def _gradients_before_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand the averaged gradients to the servers' update before ``on_before_optimizer_step`` (subclasses)."""

    def _gradients_after_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Or after it and clipping, when the servers must step with gradients the hooks edited (subclasses)."""

    def _server_gradients(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
        """``(parameter, averaged gradient)`` pairs this rank serves for ``optimizer``'s step."""
        raise NotImplementedError

    def _check_server_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Only servers see averaged gradients: they vote (one tiny all-reduce) so every rank decides alike."""
        assert self.transport is not None
        bad = first_nonfinite(self._server_gradients(optimizer))
        if any_rank(bad is not None, self.transport.ring, self.root_device):
            self._raise_nonfinite(bad)

    def _server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """Run the servers' optimizer step for ``optimizer`` on this rank (if it serves any of its parameters)."""
        raise NotImplementedError

    def _pull(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank receives the new weights of ``optimizer``'s parameters from their servers."""
        assert self.transport is not None
        for bucket in self._buckets_of(optimizer):
            start, end = self.transport.owned(bucket)
            bucket.pack_params(start, end)
            self.codec.share_weights(bucket, self.transport)
            if self.codec.rewrites_weights or not self.transport.owns_all(bucket):
                bucket.unpack_params()

    @override
    def _exchange_weights(self) -> None:
        if self._dedicated is not None:
            assert self.reducer is not None
            self._dedicated.exchange_weights(self.reducer.buckets)
            return
        for optimizer in self.optimizers:
            self._pull(unwrap_optimizer(optimizer))

    def _buckets_of(self, optimizer: torch.optim.Optimizer) -> list[GradientBucket]:
        """The buckets holding any parameter of ``optimizer`` (only those need new weights after its step)."""
        assert self.reducer is not None
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [b for b in self.reducer.buckets if any(id(p) in ids for p in b.params)]

    # ------------------------------------------------------------------ staleness != 0: servers on threads of their own
    def _served_segments(self, buckets: list[GradientBucket]) -> list[list[Segment]]:
        """``[b][r]``: the range of bucket ``b``'s gradient region that rank ``r`` serves (subclasses)."""
        raise NotImplementedError

    def _setup_dedicated_servers(self) -> None:
        """Buckets as usual, travelling to the dedicated servers (see :mod:`.dedicated_servers`)."""
        self._close_gradient_sync()
        assert self.model is not None
        self._dedicated = DedicatedServers(self, next_run_key(self.job_scope))
        self._dedicated.check_optimizers([unwrap_optimizer(o) for o in self.optimizers])
        self.reducer = BucketReducer(
            self.model.parameters(), self._run_on_device(self._reduce_bucket), self.bucket_cap_mb,
            overlap=self._may_overlap_backward(),
        )  # fmt: skip
        if self.intra_node == "shm" and self.ranks_on_this_node > 1:
            rank_zero_info(f"{self.strategy_name}: with num_servers={self.num_servers} buckets travel through sockets "
                           "(intra_node='shm' applies to num_servers=0)")  # fmt: skip
        self.transport = self._dedicated.setup(self.reducer)
        self._synced_params = {id(p) for p in self.reducer.params}
        self.sync_stats.bucket_bytes = sum(b.nbytes for b in self.reducer.buckets)
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = self._dedicated.clip_request("norm")  # type: ignore[method-assign,assignment]
        plugin.clip_grad_by_value = self._dedicated.clip_request("value")  # type: ignore[method-assign,assignment]

    @override
    def _close_gradient_sync(self) -> None:
        if self._dedicated is not None:
            self._dedicated.close()
            self.transport = None  # closed with the servers
        super()._close_gradient_sync()

    @override
    def _setup_gradient_sync(self) -> None:
        if self.num_servers:
            self._setup_dedicated_servers()
            return
        if self.staleness == 0:
            super()._setup_gradient_sync()
            return
        self._close_gradient_sync()
        assert self.model is not None and self._timeout is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        if len({p.dtype for p in params}) > 1:
            raise ConfigurationError(
                f"strategy {self.strategy_name!r} with staleness={self.staleness!r} needs every trainable parameter "
                f"in one dtype, got {sorted(str(d) for d in {p.dtype for p in params})}"
            )
        cap = int(self.bucket_cap_mb * 1024 * 1024)
        buckets = [GradientBucket(i, [params[j] for j in group]) for i, group in enumerate(assign_buckets(params, cap))]
        segments = self._served_segments(buckets)
        if self._stale_groups is None:  # collective: every rank creates them in the same order
            push_group = dist.new_group(backend="gloo", timeout=SERVER_IDLE_TIMEOUT)
            reply_group = dist.new_group(backend="gloo", timeout=SERVER_IDLE_TIMEOUT)
            self._stale_groups = (push_group, reply_group)  # type: ignore[assignment]
        assert self._stale_groups is not None
        push_group, reply_group = self._stale_groups
        owner = f"strategy {self.strategy_name!r}"
        layout = ShardLayout(buckets, segments, self.global_rank, owner, own_storage=True)
        optimizers = [
            ShardedOptimizer(unwrap_optimizer(o), layout, self.gradient_group, owner) for o in self.optimizers
        ]
        push_layout = PushLayout(buckets, segments, self.world_size)
        server = None
        if self.global_rank in push_layout.servers:
            server = StalenessServer(layout, optimizers, push_layout, self.global_rank, self.world_size, self.staleness,
                                     push_group, reply_group, self.sync_stats)  # fmt: skip
        client = StalenessClient(push_layout, self.global_rank, push_group, reply_group, server,
                                 self._timeout.total_seconds(), self.sync_stats)  # fmt: skip
        self._stale = _StaleSync(buckets, layout, optimizers, client, server)
        self._synced_params = {id(p) for p in params}
        self.sync_stats.bucket_bytes = sum(b.nbytes for b in buckets)
        if server is not None:
            server.start()

    @override
    def measure_exchange_seconds(self, repeats: int = 3) -> float:
        if self.staleness != 0:
            raise RuntimeError(
                f"measure_exchange_seconds times a synchronous exchange; strategy {self.strategy_name!r} runs with "
                f"staleness={self.staleness!r}, whose workers exchange alone (see sync_stats for their seconds)"
            )
        return super().measure_exchange_seconds(repeats)

    def _stale_step(self, optimizer: Any, closure: Callable[[], Any], model: Any) -> Any:
        """One step of a worker: its own gradient (hooks and clipping applied) to the servers, new weights back."""
        assert self._stale is not None
        model = model or self.lightning_module
        optimizer = unwrap_optimizer(optimizer)
        self._check_trainable_unchanged(optimizer)
        result = closure()
        after_closure(self.precision_plugin, model, optimizer)  # on_before_optimizer_step hooks, clipping
        with self._stale.lock():
            for sharded in self._stale.optimizers:
                sharded.follow_param_groups()
        grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = first_nonfinite(grads)
        if bad is not None:
            self._stale.client.close(REASON_NONFINITE)
            self._raise_nonfinite(bad)
        start = time.perf_counter()
        for bucket in self._stale.buckets:
            for i, p in enumerate(bucket.params):
                bucket.fill(i, p.grad)
        index = [unwrap_optimizer(o) for o in self.optimizers].index(optimizer)
        self.staleness_seen.add(self._stale.client.push(index))
        self._end_step(blocking_seconds=time.perf_counter() - start)
        return result

    def _flush(self) -> None:
        """Every rank gets the servers' weights, holding every update so far, and rank 0's buffers (collective; a no-op
        once the servers have stopped). Before the first push (the sanity check) the servers take rank 0's weights
        instead, so that edits made after set-up (``on_fit_start``) are kept."""
        if self._stale is None or self._stale.client.closed:
            return
        assert self.lightning_module is not None and self.model is not None
        if self.lightning_module.trainer.state.status == TrainerStatus.INTERRUPTED:
            return  # a checkpoint on exception: the other ranks are not at this flush, and the run is stopping
        if self._stale.client.clock == 0:
            self._resync_servers()
        else:
            self._stale.client.flush()
        buffers = list(self.model.buffers())
        if self.broadcast_buffers and buffers:
            broadcast_tensors(buffers, src=0, group=self.gradient_group)

    def _resync_servers(self) -> None:
        """Every rank and every server takes rank 0's weights as they are now; returns when all have (collective)."""
        assert self._stale is not None and self.model is not None
        broadcast_tensors([p.data for p in self.model.parameters()], src=0, group=self.gradient_group)
        with self._stale.lock():
            self._stale.layout.read_storage()
        dist.barrier(group=self.gradient_group)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self._stale is not None and not self._stale.client.closed:
            # Lightning's SIGTERM broadcasts (before every step, and in its signal handler, installed after set-up)
            # would make every step wait for rank 0: each rank checks its own flag instead, and a terminated rank
            # stops the others through the servers (on_exception)
            self._restore_sigterm = [
                replace_step_sigterm_broadcast(trainer, lambda: _raise_if_sigterm(trainer)),
                replace_sigterm_notifier(trainer),
            ]

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._dedicated is not None and not self._dedicated.closed:
            assert self.reducer is not None  # every server takes the weights as they are now (after on_fit_start, ...)
            self._dedicated.send_weights(self.reducer.buckets)
        if self._stale is not None and not self._stale.client.closed:
            # every rank starts from rank 0's weights as they are now (after on_fit_start / on_train_start hooks and
            # any restore), and no rank pushes before every server holds them and its restored state
            self._resync_servers()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._flush()  # validation runs on the freshest weights: every update of every rank so far

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._flush()
        if self._dedicated is not None and not self._dedicated.closed:
            self._dedicated.finish()  # the servers' optimizer state kept for checkpoints saved after fit

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._flush()  # a checkpoint holds the servers' weights, every update included (every rank calls it)
        return super().lightning_module_state_dict()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._dedicated is not None:
            self._dedicated.abort(f"{type(exception).__name__}: {exception}")
        if self._stale is not None and not self._stale.client.closed:  # the others stop at their next request
            terminated = isinstance(exception, SIGTERMException)
            self._stale.client.close(REASON_TERMINATED if terminated else REASON_ERROR)
        super().on_exception(exception)

    def _close_stale_sync(self) -> None:
        """Stop serving; the servers' optimizers stay, so a checkpoint saved after ``fit`` still holds their state."""
        for restore in self._restore_sigterm:
            restore()
        self._restore_sigterm = []
        if self._stale is not None:
            assert self._timeout is not None
            self._stale.client.close(timeout=self._timeout.total_seconds())

    @override
    def teardown(self) -> None:
        self._close_stale_sync()
        super().teardown()

    def _stale_sharded(self, optimizer: Any) -> ShardedOptimizer:
        assert self._stale is not None
        optimizer = unwrap_optimizer(optimizer)
        return next(s for s in self._stale.optimizers if s.optimizer is optimizer)

    def _stale_optimizer_state(self, optimizer: Any) -> dict:
        """The servers' full optimizer state for ``optimizer``, consolidated on rank 0 (collective)."""
        assert self._stale is not None and self.lightning_module is not None
        sharded = self._stale_sharded(optimizer)
        if self.lightning_module.trainer.state.status == TrainerStatus.INTERRUPTED:
            # a checkpoint on exception: the other ranks are not here to gather with; stop them first
            self._stale.client.close(REASON_ERROR)
            rank_zero_warn(
                f"strategy {self.strategy_name!r}: a checkpoint written while the run fails holds no optimizer state "
                "(the servers' state is spread over the ranks and cannot be gathered now); its weights are rank 0's"
            )
            return {"state": {}, "param_groups": sharded.optimizer.state_dict()["param_groups"]}
        with self._stale.lock():
            sharded.consolidate_state_dict(to=0)
        return sharded.state_dict() if self.is_global_zero else {}

    def _load_stale_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Each server takes its share of a full (standard layout) optimizer state."""
        assert self._stale is not None
        with self._stale.lock():
            for sharded, saved in zip(self._stale.optimizers, checkpoint["optimizer_states"]):
                sharded.load_state_dict(saved)


def _raise_if_sigterm(trainer: pl.Trainer) -> None:
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()
