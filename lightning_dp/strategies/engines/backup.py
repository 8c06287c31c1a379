"""Backup workers: each synchronous step aggregates the first ``N - b`` gradients to arrive; a late one is dropped,
and a rank whose step closed without it skips that step."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_dp._lightning_compat import after_closure, skip_closure, unwrap_optimizer
from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.consistency import PushLayout, StalenessClient, StalenessServer, StopReason
from lightning_dp.comm.consistency.backup import BackupClient, BackupPushLayout, BackupServer, Hyperparameters
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.servers.sharded_optimizer import Segment, ShardedOptimizer, ShardLayout
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.engines.stale import StaleEngine


class BackupEngine(StaleEngine):
    """``backup_workers=b >= 1`` (:mod:`lightning_dp.comm.consistency.backup`): the servers serve from threads of their
    own as under staleness, but every step is synchronous: it closes with the first ``N - b`` gradients (their mean,
    the optimizer's own learning rate), every rank holds the same weights after every step, and a rank whose step
    closed before it started skips it (its training step does not run: Lightning counts the batch as skipped).

    What a skipping rank cannot take part in is refused: gradient accumulation, manual optimization, gradient
    clipping or hooks that read gradients (only the servers see the step's gradients), more than one optimizer,
    ``SyncBatchNorm``, and collectives inside the training step (``self.log(..., sync_dist=True)``, ``all_gather``).
    """

    #: pushes, replies, and the coordinator's decisions
    _num_groups: ClassVar[int] = 3
    _client_type: ClassVar[type[StalenessClient]] = BackupClient

    def __init__(
        self,
        strategy: DataParallelStrategy,
        backups: int,
        served_segments: Callable[[list[GradientBucket]], list[list[Segment]]],
    ) -> None:
        super().__init__(strategy, 0, served_segments)
        self.backups = backups
        self._in_step = False

    @property
    def option(self) -> str:
        return f"backup_workers={self.backups}"

    @property
    def late_gradients(self) -> int:
        """This rank's gradients that reached the servers after their step had closed (dropped)."""
        return self.client.late if isinstance(self.client, BackupClient) else 0

    @property
    def skipped_steps(self) -> int:
        """Steps this rank skipped because they had closed before it started them."""
        return self.client.skipped if isinstance(self.client, BackupClient) else 0

    # ------------------------------------------------------------------ set-up
    def check_devices(self, devices: list[torch.device]) -> None:
        if any(d.type != "cpu" for d in devices):
            raise ConfigurationError(
                f"strategy {self.name!r} with {self.option} runs on CPU devices only (accelerator='cpu'); got "
                f"{devices[0]}. Use backup_workers=0 on GPUs."
            )

    def check_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if len(optimizers) != 1:
            raise ConfigurationError(
                f"strategy {self.name!r} with {self.option} steps one optimizer per batch; this module configures "
                f"{len(optimizers)}. Use backup_workers=0 with several optimizers."
            )

    def full_gradients(self, trainer: pl.Trainer, readers: list[str]) -> bool:
        if readers:
            raise ConfigurationError(
                f"strategy {self.name!r} with {self.option}: only the servers see a step's gradients (the mean of the "
                f"first N - b to arrive), but gradients are read or edited before the optimizer step by "
                f"{', '.join(readers)}. Use backup_workers=0, or declare reads_gradients = False on a callback that "
                "only reads the clock in those hooks."
            )
        return False

    def setup_trainer(self, trainer: pl.Trainer) -> None:
        problems = []
        if trainer.accumulate_grad_batches != 1:
            problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}")
        if not trainer.lightning_module.automatic_optimization:
            problems.append("manual optimization")
        if trainer.gradient_clip_val:
            problems.append(f"gradient_clip_val={trainer.gradient_clip_val}")
        if any(isinstance(m, torch.nn.SyncBatchNorm) for m in trainer.lightning_module.modules()):
            problems.append("SyncBatchNorm")
        if problems:
            raise ConfigurationError(
                f"strategy {self.name!r} with {self.option} cannot run {', '.join(problems)}: a rank whose step "
                "closed without it skips the step, so it cannot accumulate, clip or synchronize inside it. Use "
                "backup_workers=0."
            )
        super().setup_trainer(trainer)

    def _push_layout(self, buckets: list[GradientBucket], segments: list[list[Segment]]) -> PushLayout:
        optimizer = unwrap_optimizer(self.strategy.optimizers[0])
        return BackupPushLayout(buckets, segments, self.strategy.world_size, Hyperparameters(optimizer))

    def _new_server(
        self,
        layout: ShardLayout,
        optimizers: list[ShardedOptimizer],
        push_layout: PushLayout,
        groups: tuple[dist.ProcessGroup, ...],
    ) -> StalenessServer:
        strategy = self.strategy
        assert isinstance(push_layout, BackupPushLayout)
        push_group, reply_group, decide_group = groups
        return BackupServer(layout, optimizers, push_layout, strategy.global_rank, strategy.world_size, self.backups,
                            push_group, reply_group, decide_group, strategy.sync_stats)  # fmt: skip

    def check_measurable(self) -> None:
        raise RuntimeError(
            f"measure_exchange_seconds times a synchronous exchange of every rank; strategy {self.name!r} runs with "
            f"{self.option}, whose steps close without the last b ranks (see sync_stats for their seconds)"
        )

    def check_collective(self, what: str) -> None:
        if self._in_step:
            raise ConfigurationError(
                f"strategy {self.name!r} with {self.option}: {what} inside the training step would wait for a rank "
                "that skips the step (its step closed without it). Log without sync_dist inside training_step (or "
                "reduce at the epoch's end), or use backup_workers=0."
            )

    # ------------------------------------------------------------------ the step
    @contextmanager
    def training_step_context(self) -> Generator[None, None, None]:
        self._in_step = True  # until the closure ends
        yield

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        """One step: skipped if it has closed already, else the closure, the hooks and the push of this rank's
        gradients (used if they are among the first ``N - b``), the weights after the step back."""
        strategy = self.strategy
        client = self.client
        assert isinstance(client, BackupClient)
        strategy.check_trainable_unchanged(optimizer)
        start = time.perf_counter()
        if client.step_is_closed:
            self._in_step = False
            client.skip()
            skip_closure(closure)
            strategy.end_step(blocking_seconds=time.perf_counter() - start)
            return None
        try:
            result = closure()
        finally:
            self._in_step = False
        after_closure(strategy.precision_plugin, model, optimizer)  # on_before_optimizer_step hooks
        with self._lock():
            for sharded in self.optimizers:
                sharded.follow_param_groups()
        grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = first_nonfinite(grads)
        if bad is not None:
            client.close(StopReason.NONFINITE)
            strategy.raise_nonfinite(bad)
        start = time.perf_counter()
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                bucket.fill(i, p.grad)
        assert isinstance(client.layout, BackupPushLayout)
        client.layout.set_hyperparameters(optimizer)
        client.push(0)
        strategy.end_step(blocking_seconds=time.perf_counter() - start)
        return result
