"""The ``on_rank_loss`` option: what a strategy does when a training rank is lost, one object per mode.

- :class:`StopOnRankLoss` (``"stop"``, the default): every rank stops with an error naming the lost peer; torchrun
  or SLURM may then restart the job from its last checkpoint.
- :class:`ContinueOnRankLoss` (``"continue"``): the survivors go on without a restart, through the job's
  :class:`~lightning_dp.comm.membership.Membership`. Every step's gradient exchange is committed on the
  membership; when one fails because a rank was lost, the survivors agree on the new members and on the last step
  each committed, form new groups, and close the step over their own gradients:

  - a survivor that committed that step already (it is one step ahead, its next exchange failed) exchanges the
    gradients of its step in flight again, over the survivors: that step trains the survivors' samples only (the
    lost rank's are counted as dropped);
  - a survivor that had not committed it takes the weights and optimizer state of one that had (the lowest), and
    its own update of that step is skipped; then it trains its next step as usual.

  From the first batch no loader has drawn yet, the lost rank's share of each global batch is dealt among the
  survivors (:meth:`~lightning_dp.comm.balance.ThroughputBalancer.exclude`), so every step is again the step of the
  whole global batch, with the same learning rate.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed import distributed_c10d

from lightning_dp._lightning_compat import replace_sigterm_notifier, replace_step_sigterm_broadcast, unwrap_optimizer
from lightning_dp.comm.cluster.rendezvous import local_address_towards
from lightning_dp.comm.errors import ConfigurationError, MembershipChange
from lightning_dp.comm.membership import Loss, Membership
from lightning_dp.comm.membership.agreement import Decision
from lightning_dp.comm.transports.broadcast import broadcast_tensors
from lightning_dp.strategies.options import check_choice, check_count, check_positive

if TYPE_CHECKING:
    from lightning_dp.comm.buckets import BucketReducer, GradientBucket
    from lightning_dp.strategies.base import DataParallelStrategy
    from lightning_dp.strategies.processes import ProcessGroupStrategy

#: values of the ``on_rank_loss`` option
ON_RANK_LOSS = ("stop", "continue")
#: the default ``heartbeat_timeout``: long enough for a loaded machine's scheduler, short enough to matter
DEFAULT_HEARTBEAT_SECONDS = 10.0


class StopOnRankLoss:
    """``on_rank_loss="stop"``: a lost rank ends the run (see the module docstring)."""

    name = "stop"
    #: the job's membership (``None``: not tracked)
    membership: Membership | None = None

    def __init__(self) -> None:
        #: what set-up changed in Lightning, undone by :meth:`close`
        self._undo: list[Callable[[], None]] = []

    def form_groups(self, strategy: ProcessGroupStrategy) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """The gradient group and the control group (``None``: the default group) of a strategy that has joined
        the default group (collective)."""
        group = dist.new_group(backend=strategy.process_group_backend, timeout=strategy.timeout)
        assert isinstance(group, dist.ProcessGroup)
        return group, None

    def check_options(self, strategy: ProcessGroupStrategy) -> None:
        """Refuse options that cannot survive a loss (at construction)."""

    def check_fit(self, strategy: DataParallelStrategy) -> None:
        """Refuse a model, optimizer or trainer setting that cannot survive a loss (at set-up)."""

    def setup_trainer(self, strategy: DataParallelStrategy, trainer: pl.Trainer) -> None:
        """After the strategy's set-up of a fit."""

    def save_gradients(self, bucket: GradientBucket) -> None:
        """``bucket`` is about to be exchanged (on the communication thread)."""

    def finish_gradient_sync(self, strategy: DataParallelStrategy, reducer: BucketReducer, copy_back: bool) -> None:
        """Complete the step's gradient exchange."""
        reducer.finish(copy_back=copy_back)

    def metrics(self) -> dict[str, Any]:
        """What the run lost (for ``CommMonitor`` and the app's metrics)."""
        return {}

    def close(self) -> None:
        """The strategy's end."""
        for undo in self._undo:
            undo()
        self._undo = []


class ContinueOnRankLoss(StopOnRankLoss):
    """``on_rank_loss="continue"``: the survivors of a loss go on (see the module docstring).

    ``heartbeat_timeout``: seconds of silence after which a rank is taken for lost; ``max_lost``: how many ranks the
    job may lose in all (``None``: as many as leave a strict majority of the ranks it started with)."""

    name = "continue"

    def __init__(self, heartbeat_timeout: float, max_lost: int | None) -> None:
        super().__init__()
        self.heartbeat_timeout = heartbeat_timeout
        self.max_lost = max_lost
        self.membership: Membership | None = None
        #: exchanges committed so far in this fit (the step counter the survivors agree on)
        self.committed = -1
        self._saved: dict[int, Tensor] = {}
        self._saved_this_round: set[int] = set()
        #: samples of global batches no survivor trained (the lost ranks' shares of steps in flight or drawn)
        self.dropped_samples = 0
        #: steps whose exchange ran again over the survivors, and steps whose own update this rank skipped to take a
        #: survivor's state instead
        self.redone_steps = 0
        self.caught_up_steps = 0
        self.recovery_seconds: list[float] = []
        self._losses: list[Loss] = []

    # ------------------------------------------------------------------ set-up
    def check_options(self, strategy: ProcessGroupStrategy) -> None:
        name = f"strategy {strategy.strategy_name!r}: on_rank_loss='continue'"
        unsupported = {
            "staleness": (getattr(strategy, "staleness", 0), 0),
            "num_servers": (getattr(strategy, "num_servers", 0), 0),
            "backup_workers": (getattr(strategy, "backup_workers", 0), 0),
            "compression": (getattr(strategy, "compression", "none"), "none"),
            "balance": (getattr(strategy, "balance", "none"), "none"),
            "intra_node": (getattr(strategy, "intra_node", "ring"), "ring"),
        }
        for option, (value, needed) in unsupported.items():
            if value != needed:
                raise ConfigurationError(
                    f"{name} needs {option}={needed!r}, got {option}={value!r}: the survivors of a loss cannot yet "
                    f"re-form that part of the exchange (see docs/faults.md)"
                )
        if strategy.strategy_name != "ring_allreduce":
            raise ConfigurationError(
                f"{name} is not available yet: the servers' state needs a replica on another rank first (see "
                "docs/faults.md); strategy='ring_allreduce' supports it"
            )
        if strategy.process_group_backend == "nccl":
            raise ConfigurationError(
                f"{name} needs process_group_backend='gloo': an NCCL communicator that lost a peer cannot be fenced "
                "and rebuilt here (see docs/faults.md)"
            )

    def form_groups(self, strategy: ProcessGroupStrategy) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        backend = strategy.process_group_backend
        if backend != "gloo":
            raise ConfigurationError(
                f"strategy {strategy.strategy_name!r}: on_rank_loss='continue' needs the gloo backend, got {backend!r}"
            )
        env = strategy.cluster_environment
        assert env is not None
        world = env.world_size()
        max_lost = self.max_lost if self.max_lost is not None else world
        if max_lost >= world:
            max_lost = world - 1
        scope = f"{strategy.job_scope or 'lightning_dp/external'}/membership/{_next_membership()}"
        self.membership = Membership(
            strategy.global_rank, list(range(world)), distributed_c10d._get_default_store(), scope,
            _group_address(env.main_address), self.heartbeat_timeout, max_lost, backend, strategy.timeout,
        )  # fmt: skip
        return self.membership.group("gradients"), self.membership.group("control")

    def check_fit(self, strategy: DataParallelStrategy) -> None:
        module = strategy.lightning_module
        assert module is not None
        name = f"strategy {strategy.strategy_name!r}: on_rank_loss='continue'"
        if not module.automatic_optimization:
            raise ConfigurationError(
                f"{name} needs automatic optimization: with manual optimization the step is the module's own, and a "
                "loss inside it cannot be closed over the survivors"
            )
        if any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules()):
            raise ConfigurationError(
                f"{name} cannot run SyncBatchNorm: its collectives run inside the forward, on the default group, "
                "which a lost rank leaves broken"
            )
        for optimizer in map(unwrap_optimizer, strategy.optimizers):
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ConfigurationError(
                    f"{name} cannot run {type(optimizer).__name__}: it evaluates the closure several times per step, "
                    "and a step closed over the survivors would evaluate a different loss each time"
                )

    def setup_trainer(self, strategy: DataParallelStrategy, trainer: pl.Trainer) -> None:
        # Lightning's SIGTERM broadcast before every step (and its signal handler's) run on the default group, which
        # a lost rank leaves broken: the same broadcast runs over the ranks training now
        self._undo = [
            replace_step_sigterm_broadcast(trainer, lambda: _broadcast_sigterm(strategy, trainer)),
            replace_sigterm_notifier(trainer),
        ]

    # ------------------------------------------------------------------ the step
    def save_gradients(self, bucket: GradientBucket) -> None:
        saved = self._saved.get(bucket.index)
        if saved is None:
            saved = self._saved[bucket.index] = torch.empty_like(bucket.buffer)
        saved.copy_(bucket.buffer)
        self._saved_this_round.add(bucket.index)

    def finish_gradient_sync(self, strategy: DataParallelStrategy, reducer: BucketReducer, copy_back: bool) -> None:
        membership = self.membership
        assert membership is not None
        resend = False
        while True:
            try:
                membership.check()
                if resend:
                    reducer.resend(copy_back=copy_back)
                else:
                    reducer.finish(copy_back=copy_back)
                membership.commit(self.committed + 1)
            except Exception as error:  # noqa: BLE001 - the membership says what it means
                change = membership.interpret(error)
                if change is error:
                    raise
                if not isinstance(change, MembershipChange):
                    raise change from error
                reducer.drain()
                behind = self._recover(strategy)
                if behind:
                    for p in reducer.params:  # this step's update is the donor's, taken already
                        p.grad = None
                    self._saved_this_round.clear()
                    return
                self._restore(reducer, strategy)
                resend = True
                self.redone_steps += 1
                continue
            self.committed += 1
            self._saved_this_round.clear()
            return

    def _restore(self, reducer: BucketReducer, strategy: DataParallelStrategy) -> None:
        """Put back this rank's own gradients into the buckets an abandoned exchange touched, weighed for the
        survivors."""
        factor = strategy.batches.reweigh_in_flight()
        for bucket in reducer.buckets:
            if bucket.index in self._saved_this_round:
                bucket.buffer.copy_(self._saved[bucket.index])
            if factor != 1.0:
                bucket.buffer[: bucket.grad_numel].mul_(factor)
        self._saved_this_round.clear()

    def _recover(self, strategy: DataParallelStrategy) -> bool:
        """Agree with the survivors, re-form the exchange over them, and bring every survivor to the last step any
        of them committed. Returns whether this rank was behind (its own update of the step in flight must be
        skipped)."""
        membership = self.membership
        assert membership is not None
        started = time.monotonic()
        decision = membership.recover()
        strategy.rebuild_exchange()
        latest = max(decision.committed.values())
        behind = self._catch_up(strategy, decision, latest)
        self.dropped_samples += strategy.batches.exclude(list(decision.lost), behind)
        self.recovery_seconds.append(time.monotonic() - started)
        lost = ", ".join(f"rank {loss.rank} ({loss.cause})" for loss in membership.losses[-len(decision.lost) :])
        rank_zero_warn(
            f"strategy {strategy.strategy_name!r}: lost {lost}; the job goes on with ranks "
            f"{list(decision.members)} from step {latest + 1} (on_rank_loss='continue')"
        )
        return behind

    def _catch_up(self, strategy: DataParallelStrategy, decision: Decision, latest: int) -> bool:
        """Every member that committed fewer steps than ``latest`` takes the weights and optimizer state of the
        lowest member that committed it (collective over the new gradient group)."""
        if all(step == latest for step in decision.committed.values()):
            return False
        donor = min(r for r, step in decision.committed.items() if step == latest)
        group = strategy.gradient_group
        assert group is not None and strategy.model is not None
        donor_rank = dist.get_group_rank(group, donor)
        broadcast_tensors([p.data for p in strategy.model.parameters()], src=donor_rank, group=group)
        for optimizer in map(unwrap_optimizer, strategy.optimizers):
            state = [optimizer.state_dict() if strategy.global_rank == donor else None]
            dist.broadcast_object_list(state, group=group, group_src=donor_rank)
            if self.committed < latest:
                assert state[0] is not None
                optimizer.load_state_dict(state[0])
        behind = self.committed < latest
        if behind:
            self.committed = latest
            self.caught_up_steps += 1
        return behind

    # ------------------------------------------------------------------ what the run lost
    @property
    def losses(self) -> list[Loss]:
        """Every rank this fit went on without."""
        return list(self.membership.losses) if self.membership is not None else self._losses

    def metrics(self) -> dict[str, Any]:
        return {
            "lost_ranks": [loss.rank for loss in self.losses],
            "loss_causes": [loss.cause for loss in self.losses],
            "loss_steps": [loss.step for loss in self.losses],
            "recovery_seconds": list(self.recovery_seconds),
            "dropped_samples": self.dropped_samples,
            "redone_steps": self.redone_steps,
            "caught_up_steps": self.caught_up_steps,
        }

    def close(self) -> None:
        super().close()
        if self.membership is not None:
            self._losses = list(self.membership.losses)
            self.membership.close()
            self.membership = None


def _broadcast_sigterm(strategy: DataParallelStrategy, trainer: pl.Trainer) -> None:
    """Lightning's broadcast of rank 0's SIGTERM flag before a step, over the ranks training now (from the lowest):
    a terminated job stops on every rank at the same step."""
    flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0])
    group = strategy.control_group
    try:
        dist.broadcast(flag, group=group, group_src=0)
    except Exception:  # noqa: BLE001 - as Lightning's: a failed broadcast (a rank just lost) is no signal
        flag.zero_()
    if flag.item() == 1:
        with contextlib.suppress(Exception):
            dist.barrier(group=group)
        raise SIGTERMException()


def make_rank_loss(on_rank_loss: Any, heartbeat_timeout: Any, max_lost_ranks: Any) -> StopOnRankLoss:
    """The object of the ``on_rank_loss`` mode, its options checked."""
    check_choice("on_rank_loss", on_rank_loss, ON_RANK_LOSS)
    heartbeat = check_positive("heartbeat_timeout", heartbeat_timeout)
    max_lost = None if max_lost_ranks is None else check_count("max_lost_ranks", max_lost_ranks, 0)
    if on_rank_loss == "stop":
        if max_lost_ranks is not None:
            raise ConfigurationError("max_lost_ranks applies to on_rank_loss='continue'; it is set with 'stop'")
        return StopOnRankLoss()
    return ContinueOnRankLoss(heartbeat, max_lost)


_memberships = [0]


def _next_membership() -> int:
    """A number no earlier membership of this process used (every rank creates them in the same order)."""
    _memberships[0] += 1
    return _memberships[0]


def _group_address(main_address: str) -> str:
    """The address this rank's process groups use: the one towards the main address."""
    try:
        return local_address_towards(main_address)
    except OSError:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")
