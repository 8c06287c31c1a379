"""The seam between a parameter-server strategy and its consistency model."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.consistency import StalenessRecord
from lightning_dp.comm.cost import Scheme
from lightning_dp.comm.transports.ring import Ring
from lightning_dp.comm.transports.shards import any_rank
from lightning_dp.strategies.base import DataParallelStrategy


class StepEngine:
    """How a :class:`~lightning_dp.strategies.parameter_server_base.ParameterServerBase` strategy (``strategy``) runs
    a step, chosen once at construction from its options: one engine per consistency model (servers among the
    trainers, dedicated server processes, bounded staleness / asynchrony). The strategy forwards Lightning's hooks
    here and never asks which model runs; the engine owns the step, the optimizer state for checkpoints and its own
    close.

    The defaults are those of a synchronous run whose servers are training ranks.
    """

    def __init__(self, strategy: DataParallelStrategy) -> None:
        self.strategy = strategy
        #: the staleness this rank saw at each of its steps (always 0 when synchronous)
        self.staleness_seen = StalenessRecord()

    @property
    def name(self) -> str:
        """The strategy's name, for messages."""
        return self.strategy.strategy_name

    # ------------------------------------------------------------------ set-up
    def check_devices(self, devices: list[torch.device]) -> None:
        """Refuse devices the engine cannot run on (before any process starts)."""

    def check_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Refuse optimizers the engine cannot run (at set-up)."""

    def full_gradients(self, trainer: pl.Trainer, readers: list[str]) -> bool:
        """Whether every rank must hold the averaged gradients after backward: when any rank's run reads them
        (``readers``: this rank's readers); every rank must send the same messages, so one rank decides for all."""
        strategy = self.strategy
        assert strategy.gradient_group is not None
        anyone = any_rank(bool(readers), Ring(strategy.gradient_group), strategy.root_device)
        if readers:
            rank_zero_info(
                f"{self.name}: every rank receives the averaged gradients after backward (more traffic per "
                f"step) because gradients are read or edited before the optimizer step by: {', '.join(readers)}"
            )
        return anyone

    def setup_gradient_sync(self) -> None:
        """Lay out the buckets and the servers for the model and optimizers of this fit."""
        raise NotImplementedError

    def setup_trainer(self, trainer: pl.Trainer) -> None:
        """After Lightning's set-up of ``trainer``."""

    def synchronized_buckets(self) -> list[GradientBucket]:
        """The gradient buckets this run synchronizes."""
        assert self.strategy.reducer is not None, "call it while fitting"
        return self.strategy.reducer.buckets

    def cost_scheme(self, scheme: Scheme) -> Scheme:
        """``scheme`` as this engine runs it (the cost model's view)."""
        return scheme

    # ------------------------------------------------------------------ the step
    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        """One optimizer step: the closure (forward and backward), the hooks and clipping, the servers' update and
        the new weights on every rank. Returns the closure's result."""
        raise NotImplementedError

    def copies_back(self) -> bool:
        """Whether this rank takes the reduced gradients into ``param.grad`` right after backward."""
        return self.strategy.full_gradients

    def exchange_weights(self) -> None:
        """The weight traffic of a step after the gradient exchange (timing a synchronization)."""

    def check_measurable(self) -> None:
        """Raise where a synchronous exchange cannot be timed on its own."""

    def check_collective(self, what: str) -> None:
        """Raise where Lightning's collective ``what`` (a reduce, an all-gather) cannot run now."""

    @property
    def late_gradients(self) -> int:
        """This rank's gradients dropped for arriving after their step closed (backup workers)."""
        return 0

    @property
    def skipped_steps(self) -> int:
        """Steps this rank skipped because they closed without it (backup workers)."""
        return 0

    # ------------------------------------------------------------------ a lost rank (on_rank_loss="continue")
    def after_reduce(self, bucket: GradientBucket) -> None:
        """``bucket`` was exchanged (on the communication thread)."""

    def seal_exchange(self) -> None:
        """See :meth:`~lightning_dp.strategies.base.DataParallelStrategy.seal_exchange`."""

    @property
    def exchange_outcome_travels(self) -> bool:
        """See :attr:`~lightning_dp.strategies.base.DataParallelStrategy.exchange_outcome_travels`."""
        return True

    def point_completed(self, kind: str) -> None:
        """See :meth:`~lightning_dp.strategies.base.DataParallelStrategy.point_completed`."""

    def rebuild_exchange(self) -> None:
        """See :meth:`~lightning_dp.strategies.base.DataParallelStrategy.rebuild_exchange`."""
        self.strategy.rebuild_groups()
        self.strategy.rebuild_transport()

    def after_recovery(self, lost: list[int]) -> None:
        """See :meth:`~lightning_dp.strategies.base.DataParallelStrategy.after_recovery`."""

    def after_admission(self, joined: list[int]) -> bool:
        """See :meth:`~lightning_dp.strategies.base.DataParallelStrategy.after_admission`."""
        return False

    # ------------------------------------------------------------------ Lightning's loop
    @contextmanager
    def training_step_context(self) -> Generator[None, None, None]:
        """Around the module's training step (inside the optimizer's closure): the forward, whose weights may still
        be arriving."""
        yield

    def complete_pull(self) -> None:
        """Every rank's parameters hold the weights of every step so far; nothing of a step is in flight on the
        gradient group (before anything between steps reads the weights or uses that group; not collective)."""

    def on_train_start(self) -> None:
        """Every server takes the weights as they are now (after ``on_fit_start``, a restore)."""

    def flush(self) -> None:
        """Every rank holds weights with every update so far (before validation, checkpoints, the end of training;
        collective)."""

    def on_train_end(self) -> None:
        """The end of training (collective)."""

    def on_exception(self, exception: BaseException) -> None:
        """The run fails on this rank: tell whoever would otherwise wait for it. Never raises."""

    def close_gradient_sync(self) -> None:
        """Stop the exchange set up by :meth:`setup_gradient_sync` (before the strategy closes its reducer)."""

    def teardown(self) -> None:
        """The end of the strategy's use (before its own teardown)."""

    # ------------------------------------------------------------------ optimizer state
    def stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers that run (and hold state) on this rank."""
        raise NotImplementedError

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s full state in torch's layout on rank 0 (collective: every rank calls it)."""
        raise NotImplementedError

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Take the optimizer states of a checkpoint, each server its own share."""
        raise NotImplementedError
