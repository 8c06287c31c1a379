"""The parameter-server schemes: servers run the optimizer, every rank pulls the new weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_dp._lightning_compat import unwrap_optimizer
from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.consistency import StalenessRecord, check_staleness
from lightning_dp.comm.consistency.backup import check_backup_workers
from lightning_dp.comm.cost import Scheme
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.servers.members import message_bytes_from_environment
from lightning_dp.comm.servers.sharded_optimizer import Segment
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.engines import (
    BackupEngine,
    DedicatedEngine,
    RegroupingDedicatedEngine,
    StaleEngine,
    StepEngine,
)
from lightning_dp.strategies.inspection import gradient_readers
from lightning_dp.strategies.options import check_count, check_flag

#: optimizers that re-evaluate the closure within one step; a server cannot re-run the workers' forward passes
CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


class ParameterServerBase(DataParallelStrategy):
    """A parameter-server scheme: an ownership rule (who serves which part of the weights: the subclass) and a
    :class:`~lightning_dp.strategies.engines.StepEngine` for the consistency model, chosen here from the options.

    When nothing in the run reads gradients between backward and the step
    (:func:`~lightning_dp.strategies.inspection.gradient_readers`), only a server holds averaged gradients, and
    only for what it serves; ``param.grad`` elsewhere keeps the local gradient. Otherwise (:attr:`full_gradients`)
    the servers also send the averaged gradients back, so that every rank's hooks see and edit exactly what they
    would see under DDP, and the servers step with the edited gradients: the central server sends ``(N - 1) S``
    more bytes per step, a sharded server ``(N - 1) / N S``.

    A subclass provides the transport, :meth:`_synchronous_engine` and :meth:`_served_segments`.

    Args:
        staleness: the consistency model. ``0`` (default): synchronous, every step waits for every rank's
            gradients. ``k >= 1``: bounded staleness (SSP): a worker at step ``c`` uses weights holding every
            worker's updates of steps before ``c - k`` at least, and waits only when a slower worker would break
            that. ``None``: asynchronous, no bound. Each arriving gradient is applied alone, the learning rate
            scaled by :func:`~lightning_dp.comm.consistency.arrival_lr_scale` (``1 / N`` for SGD, ``1 / sqrt(N)``
            for adaptive optimizers such as Adam). CPU training (gloo) only.
        num_servers: dedicated server processes (``0``, default: the servers are training ranks). With ``k > 0``
            the servers are processes of their own, not Lightning ranks (``trainer.world_size`` counts trainers);
            how the weights are split over them is the subclass's (see :mod:`lightning_dp.comm.servers`).
            Synchronous only (``staleness=0``), uncompressed.
        start_servers: with ``num_servers > 0``, whether trainer 0 starts the servers on its own machine (default)
            or they are started elsewhere with ``python -m lightning_dp.server`` (on spare CPU machines).
        restart_lost_servers: with ``num_servers > 1``, ``start_servers`` and ``on_rank_loss="continue"``: how
            many times in each fit trainer 0 starts a server it started that died again (default ``0``); the new
            process joins the running job and takes its share back (see ``docs/faults.md``).
        overlap_pull: with the servers among the trainers and ``staleness=0`` (default ``True``): the step only
            starts the pull of the new weights, in the order the next forward uses them, and each module's forward
            waits for its own weights, so the pull runs behind the next forward (see
            :mod:`lightning_dp.comm.weight_pull`); every forward reads exactly the weights after the step. ``False``:
            every rank holds the new weights when the step returns. Callbacks reading weights between steps, validation
            and checkpoints see them complete either way (:mod:`~lightning_dp.strategies.weight_hooks`).
        backup_workers: ``b`` (default ``0``: every step waits for every rank). With ``b >= 1`` each synchronous
            step aggregates the first ``N - b`` gradients to reach the servers (their mean, under the optimizer's own
            learning rate) and drops the rest, counted in :attr:`late_gradients`; a rank whose step closed before it
            started skips it (:attr:`skipped_steps`), so a persistently slow rank keeps up, and every rank holds the
            same weights after every step (see :mod:`lightning_dp.comm.consistency.backup` and
            :class:`~lightning_dp.strategies.engines.BackupEngine` for what it refuses). CPU training (gloo) only;
            ``staleness=0``, no dedicated servers, no compression, ``balance="none"``.
        **kwargs: see :class:`~lightning_dp.strategies.base.DataParallelStrategy`.
    """

    _every_rank_steps = False

    #: with dedicated servers: whether the trainers serve a share too (the optimal split), or only the servers do
    _trainers_serve: ClassVar[bool] = True

    def __init__(
        self,
        staleness: int | None = 0,
        num_servers: int = 0,
        start_servers: bool = True,
        restart_lost_servers: int = 0,
        backup_workers: int = 0,
        overlap_pull: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.overlap_pull = check_flag("overlap_pull", overlap_pull)
        try:
            self.staleness = check_staleness(staleness)
        except ValueError as error:
            raise ConfigurationError(str(error)) from None
        self.num_servers = check_count("num_servers", num_servers, 0)
        self.start_servers = check_flag("start_servers", start_servers)
        self.restart_lost_servers = check_count("restart_lost_servers", restart_lost_servers, 0)
        if self.restart_lost_servers:
            loss = self.rank_loss.name
            required = {"num_servers": (self.num_servers, self.num_servers > 1, "> 1 (a lone server's loss ends the "
                                        "run: its state has no replica to come back from)"),
                      "start_servers": (self.start_servers, self.start_servers, "True"),
                      "on_rank_loss": (loss, loss == "continue", "'continue'")}  # fmt: skip
            for option, (value, kept, wanted) in required.items():
                if not kept:
                    raise ConfigurationError(
                        f"restart_lost_servers={self.restart_lost_servers} needs {option} {wanted} (trainer 0 starts "
                        f"again the dedicated servers it started, which join a job that goes on after a loss); got "
                        f"{option}={value!r}"
                    )
        try:
            self.backup_workers = check_backup_workers(backup_workers)
        except ValueError as error:
            raise ConfigurationError(str(error)) from None
        if self.backup_workers:
            other = {"staleness": (self.staleness, 0), "num_servers": (self.num_servers, 0),
                     "compression": (self.compression, "none"), "balance": (self.balance, "none")}  # fmt: skip
            for option, (value, needed) in other.items():
                if value != needed:
                    raise ConfigurationError(
                        f"backup_workers={self.backup_workers} needs {option}={needed!r} (each synchronous step of the "
                        f"servers among the trainers closes with the first N - b gradients); got {option}={value!r}"
                    )
        if not self.start_servers and not self.num_servers:
            raise ConfigurationError(
                "start_servers=False says the dedicated servers are started elsewhere, but num_servers=0 asks for "
                "none: set num_servers to the number of servers started with python -m lightning_dp.server, or leave "
                "start_servers=True"
            )
        if self.num_servers:
            try:
                message_bytes_from_environment()
            except ValueError as error:
                raise ConfigurationError(f"num_servers={self.num_servers}: {error}") from None
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
        if self.staleness != 0 and self.balance != "none":
            raise ConfigurationError(
                f"balance={self.balance!r} needs staleness=0: it sizes the ranks' shares of each synchronous step's "
                f"global batch, and with staleness={self.staleness!r} there is no such step; use balance='none'"
            )
        if self.staleness != 0 and self.compression != "none":
            raise ConfigurationError(
                f"compression={self.compression!r} needs staleness=0: with staleness={self.staleness!r} each "
                "worker's gradient travels alone and is not compressed; use compression='none'"
            )
        self.rank_loss.check_options(self)  # (again: the servers' options are known now)
        #: the consistency model's step, chosen once here
        self.engine: StepEngine = self._make_engine()

    @property
    def staleness_seen(self) -> StalenessRecord:
        """The staleness this rank saw at each of its steps (always 0 when synchronous)."""
        return self.engine.staleness_seen

    @property
    def late_gradients(self) -> int:
        """This rank's gradients dropped for reaching the servers after their step closed (``backup_workers``)."""
        return self.engine.late_gradients

    @property
    def skipped_steps(self) -> int:
        """Steps this rank skipped because they closed before it started them (``backup_workers``)."""
        return self.engine.skipped_steps

    def _make_engine(self) -> StepEngine:
        if self.backup_workers:
            return BackupEngine(self, self.backup_workers, self._served_segments)
        if self.num_servers and self.rank_loss.name == "continue":
            return RegroupingDedicatedEngine(self, self.num_servers, self.start_servers)
        if self.num_servers:
            return DedicatedEngine(self, self.num_servers, self.start_servers, trainers_serve=self._trainers_serve)
        if self.staleness != 0:
            return StaleEngine(self, self.staleness, self._served_segments)
        return self._synchronous_engine()

    def pull_overlap_refusal(self) -> str | None:
        """Why the weight pull cannot overlap the next forward in this run (``None``: it can), at set-up."""
        if not self.overlap_pull:
            return "overlap_pull=False"
        if self.rank_loss.name == "continue":
            return "on_rank_loss='continue': a loss during the pull is closed within its step"
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            return "manual optimization: training_step may read the weights right after optimizer.step()"
        if is_overridden("optimizer_step", module, pl.LightningModule):
            return f"{type(module).__name__}.optimizer_step may read or edit the weights right after the step"
        scripted = [name for name, m in module.named_modules() if isinstance(m, torch.jit.ScriptModule)]
        if scripted:
            return f"TorchScript modules ({', '.join(scripted)}) run no forward pre-hooks"
        if self._process_group_backend != "gloo":
            return (
                f"process_group_backend={self._process_group_backend!r}: the forward's own collectives (buffers, "
                "SyncBatchNorm) could interleave with the pull differently on each rank; the overlap needs gloo"
            )
        return None

    def _synchronous_engine(self) -> StepEngine:
        """The engine of ``staleness=0`` with the servers among the trainers (subclasses)."""
        raise NotImplementedError

    def _served_segments(self, buckets: list[GradientBucket]) -> list[list[Segment]]:
        """``[b][r]``: the range of bucket ``b``'s gradient region that rank ``r`` serves (subclasses)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ set-up
    @override
    def _check_world_size(self, world_size: int) -> None:
        super()._check_world_size(world_size)
        if world_size and self.backup_workers:
            try:
                check_backup_workers(self.backup_workers, world_size)
            except ValueError as error:
                raise ConfigurationError(str(error)) from None
        self.engine.check_devices(self.parallel_devices or [])

    @override
    def _needs_full_gradients(self, trainer: pl.Trainer) -> bool:
        assert self.lightning_module is not None
        return self.engine.full_gradients(trainer, gradient_readers(trainer, self.lightning_module))

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
        self.engine.check_optimizers([unwrap_optimizer(o) for o in self.optimizers])

    @override
    def _setup_gradient_sync(self) -> None:
        self._close_gradient_sync()
        self.engine.setup_gradient_sync()

    @override
    def _close_gradient_sync(self) -> None:
        self.engine.close_gradient_sync()
        super()._close_gradient_sync()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self.engine.setup_trainer(trainer)

    # ------------------------------------------------------------------ a lost rank (on_rank_loss="continue")
    @override
    def _after_reduce(self, bucket: GradientBucket) -> None:
        self.engine.after_reduce(bucket)

    @override
    def seal_exchange(self) -> None:
        self.engine.seal_exchange()

    @property
    @override
    def exchange_outcome_travels(self) -> bool:
        return self.engine.exchange_outcome_travels

    @override
    def point_completed(self, kind: str) -> None:
        self.engine.point_completed(kind)

    @override
    def rebuild_exchange(self) -> None:
        self.engine.rebuild_exchange()

    @override
    def after_recovery(self, lost: list[int]) -> None:
        self.engine.after_recovery(lost)

    @override
    def after_admission(self, joined: list[int]) -> bool:
        return self.engine.after_admission(joined)

    @override
    def _synchronized_buckets(self) -> list[GradientBucket]:
        return self.engine.synchronized_buckets()

    @override
    def predicted_step_bytes(self) -> tuple[float, float] | None:
        if self.rank_loss.name == "continue":  # the cost model does not count the replicas' forward
            return None
        return super().predicted_step_bytes()

    @override
    def cost_scheme(self) -> Scheme:
        scheme = self.engine.cost_scheme(super().cost_scheme())
        return dataclasses.replace(scheme, staleness=self.staleness, num_servers=self.num_servers)

    # ------------------------------------------------------------------ the step
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return self.engine.step(unwrap_optimizer(optimizer), closure, model or self.lightning_module, **kwargs)

    @override
    def _copies_back(self) -> bool:
        return self.engine.copies_back()

    @override
    def _exchange_weights(self) -> None:
        self.engine.exchange_weights()

    @override
    def measure_exchange_seconds(self, repeats: int = 3) -> float:
        self.engine.check_measurable()
        self.engine.complete_pull()
        return super().measure_exchange_seconds(repeats)

    # ------------------------------------------------------------------ Lightning's loop
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.engine.on_train_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.engine.training_step_context():
            return super().training_step(*args, **kwargs)

    @override
    def _before_backward(self) -> None:
        self.engine.complete_pull()  # backward writes gradients into the buckets the pull may still be using

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        self.engine.check_collective("Lightning's reduce (self.log(..., sync_dist=True))")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        self.engine.check_collective("Lightning's all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.engine.flush()  # validation runs on the freshest weights: every update of every rank so far

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.engine.on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.engine.flush()  # a checkpoint holds the servers' weights, every update included (every rank calls it)
        return super().lightning_module_state_dict()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.engine.on_exception(exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.engine.teardown()
        super().teardown()

    # ------------------------------------------------------------------ optimizer state, in torch's layout
    @override
    def _stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        return self.engine.stepping_optimizers()

    @override
    def optimizer_state(self, optimizer: Any) -> dict:
        """The full optimizer state on rank 0, from every server's share (collective: every rank calls it when
        checkpointing)."""
        return self.engine.optimizer_state(unwrap_optimizer(optimizer))

    @override
    def _load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        self.engine.load_optimizer_states(checkpoint)
