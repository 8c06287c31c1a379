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
    its own update of that step is skipped; then it trains its next step as usual. Under the parameter servers
    (whose exchange completes only once every rank holds its part of it,
    :class:`~lightning_dp.strategies.engines.replicated.ReplicatedShardedEngine`) it keeps its own part instead,
    and after their weight pull, a sync point of its own, it takes the weights only.

  From the first batch no loader has drawn yet, the lost rank's share of each global batch is dealt among the
  survivors (:meth:`~lightning_dp.comm.balance.ThroughputBalancer.exclude`), so every step is again the step of the
  whole global batch, with the same learning rate.

  A new process started in a lost rank's place (the same command) joins at a step boundary. It runs Lightning's
  set-up alone, then asks the members to join; at every step boundary the members learn which new processes every
  one of them hears, deal each such process a share from the first batch no loader has drawn
  (:meth:`~lightning_dp.comm.balance.ThroughputBalancer.include`), and at the boundary before that batch admit it
  (:meth:`~lightning_dp.comm.membership.Membership.admit`) and hand it the job's state from live peers, chunked
  across them (:mod:`~lightning_dp.comm.membership.handover`): Lightning's checkpoint in memory, which it restores as
  a loaded checkpoint, and where the members stand. Its first step is the members' next.

  A member leaves on purpose (a host drained before maintenance) when it receives :data:`LEAVE_SIGNAL` or calls
  :meth:`~lightning_dp.strategies.base.DataParallelStrategy.leave`: at the next step boundary the members deal its
  share among themselves from the first batch no loader has drawn (it trains every batch before), and at the boundary
  before that batch let it go (:meth:`~lightning_dp.comm.membership.Membership.let_go`), as left, not lost; the
  others' state is theirs already (a server shard it served is cut again from its replica). Its process then ends
  with exit code 0, after Lightning's teardown.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed import distributed_c10d
from torch.utils.data import DistributedSampler
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_dp._lightning_compat import (
    _update_dataloader,
    dump_checkpoint,
    loaders_state,
    next_training_batch,
    replace_sigterm_notifier,
    replace_step_sigterm_broadcast,
    reset_evaluation_data,
    set_loaded_checkpoint,
    set_loaders_state,
    trainer_of,
    unwrap_optimizer,
)
from lightning_dp.comm.cluster.rendezvous import (
    DIRECTORY_KEY,
    job_store,
    local_address_towards,
    proof_of,
    reach_job_store,
    replaces_lost_rank,
)
from lightning_dp.comm.codecs import make_codec
from lightning_dp.comm.errors import ConfigurationError, JoinAbandonedError, MembershipChange
from lightning_dp.comm.membership import Join, Leave, Loss, Membership, form_group
from lightning_dp.comm.membership.agreement import Decision
from lightning_dp.comm.membership.handover import Path, hand_over
from lightning_dp.comm.transports import RingTransport
from lightning_dp.comm.transports.broadcast import broadcast_tensors
from lightning_dp.strategies.options import check_choice, check_count, check_positive

if TYPE_CHECKING:
    from lightning_dp.comm.buckets import BucketReducer, GradientBucket
    from lightning_dp.strategies.base import DataParallelStrategy
    from lightning_dp.strategies.processes import ProcessGroupStrategy

T = TypeVar("T")
log = logging.getLogger(__name__)

#: values of the ``on_rank_loss`` option
ON_RANK_LOSS = ("stop", "continue")
#: the kinds of sync point: the gradient exchange, a collective of the loop's or of Lightning's on the control group,
#: the servers' weight pull
EXCHANGE, COLLECTIVE, PULL = "exchange", "collective", "pull"
#: :meth:`ContinueOnRankLoss._recover`'s answer where this rank's sync point runs again over the survivors
_REDO = object()
#: the strategies that survive a loss
SURVIVING = ("ring_allreduce", "parameter_server", "sharded_ps")
#: the default ``heartbeat_timeout``: long enough for a loaded machine's scheduler, short enough to matter
DEFAULT_HEARTBEAT_SECONDS = 10.0
#: where the handed-over checkpoint keeps where the members stand (popped before Lightning restores it)
JOIN_KEY = "lightning_dp_join"
#: ranks a step boundary's offer can name (one bit each of an int64)
MAX_JOIN_RANK = 62
#: the signal that asks a rank to leave the job at its next step boundary (``on_rank_loss="continue"``)
LEAVE_SIGNAL = signal.SIGUSR2
#: the columns of a step boundary's row: SIGTERM received, the new processes heard, the new processes dealt a share and
#: their first batch, the members asking to leave, the members dealt away and their last batch's successor, then the
#: batches' own (:meth:`~lightning_dp.strategies.balance.EqualBatches.boundary_row`)
_SIGTERM, _OFFERED, _JOINING, _ASKED, _LEAVING, _DRAWN = 0, 1, slice(2, 5), 5, slice(6, 9), 9


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

    @property
    def interrupt(self) -> Callable[[], None] | None:
        """What a shared-memory wait calls at every poll, to end it by raising (``None``: nothing)."""
        return None

    @property
    def members(self) -> tuple[int, ...] | None:
        """The global ranks training now (``None``: all of them, not tracked)."""
        return None

    @property
    def started(self) -> tuple[int, ...] | None:
        """The global ranks the fit started with (``None``: not tracked)."""
        return None

    def on_exception(self) -> None:
        """The run fails on this rank (before teardown)."""

    @property
    def newcomer(self) -> bool:
        """Whether this process joined a running job and has not trained a step with its members yet."""
        return False

    @property
    def restores_after_setup(self) -> bool:
        """Whether Lightning restores a checkpoint after the strategy's set-up (a new process's handed-over state)."""
        return False

    def live_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint handed over to a new process by the members, until its first step (``None``: none)."""
        return None

    def check_fit(self, strategy: DataParallelStrategy) -> None:
        """Refuse a model, optimizer or trainer setting that cannot survive a loss (at set-up)."""

    def setup_trainer(self, strategy: DataParallelStrategy, trainer: pl.Trainer) -> None:
        """After the strategy's set-up of a fit."""

    def setup_stage(self, strategy: DataParallelStrategy, module: torch.nn.Module) -> None:
        """At the strategy's set-up of every stage, its module on its device."""

    def evaluation_loader(self, trainer: pl.Trainer, dataloader: Any) -> Any | None:
        """The loader to use instead of an evaluation ``dataloader`` (``None``: keep it)."""
        return None

    def save_gradients(self, bucket: GradientBucket) -> None:
        """``bucket`` is about to be exchanged (on the communication thread)."""

    def discard_saved(self) -> None:
        """Forget the gradients saved for an exchange that is no step's (a timed synchronization)."""

    def finish_gradient_sync(self, strategy: DataParallelStrategy, reducer: BucketReducer, copy_back: bool) -> None:
        """Complete the step's gradient exchange."""
        reducer.finish(copy_back=copy_back)

    def collective(self, strategy: ProcessGroupStrategy, run: Callable[[dist.ProcessGroup | None], T]) -> T:
        """Run ``run(group)``, a collective of the training loop or of Lightning's, on the control group."""
        return run(strategy.control_group)

    def setup_collective(self, strategy: ProcessGroupStrategy, run: Callable[[dist.ProcessGroup | None], T]) -> T:
        """Run ``run(group)``, a collective of a stage's set-up, on the gradient group."""
        return run(strategy.gradient_group)

    def weight_pull(self, strategy: DataParallelStrategy, pull: Callable[[], None]) -> None:
        """Run ``pull``, the servers' weight pull of a step."""
        pull()

    def after_point(self, strategy: DataParallelStrategy, kind: str, run: Callable[[], None]) -> None:
        """Run ``run``, the strategy's own collectives right after a sync point of ``kind`` (the servers cutting their
        state again)."""
        run()

    def reducible(self, tensor: Tensor) -> Tensor:
        """The tensor an in-place collective may overwrite: the caller's own."""
        return tensor

    def broadcast_object(self, strategy: ProcessGroupStrategy, obj: T, src: int) -> T:
        """Global rank ``src``'s ``obj`` on every rank (Lightning's broadcast; collective)."""
        container = [obj]
        dist.broadcast_object_list(container, src, group=strategy.control_group)
        return container[0]

    def broadcast_buffers(self, strategy: ProcessGroupStrategy, buffers: list[Tensor]) -> None:
        """Overwrite ``buffers`` with global rank 0's (before a training step; collective)."""
        broadcast_tensors(buffers, src=0, group=strategy.control_group)

    def request_leave(self, strategy: DataParallelStrategy, why: str) -> None:
        """Leave the running job at the next step boundary (``why``: who asked); raises
        :class:`~lightning_dp.comm.errors.ConfigurationError` where this rank cannot."""
        raise ConfigurationError(
            f"strategy {strategy.strategy_name!r}: a rank leaves a running job with on_rank_loss='continue' only, got "
            f"on_rank_loss={self.name!r}"
        )

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
    job may lose in all (``None``: as many as leave a strict majority of the ranks it started with); ``max_ranks``:
    how many ranks the job may grow to by new processes joining it (``None``: as many as it started with)."""

    name = "continue"

    def __init__(self, heartbeat_timeout: float, max_lost: int | None, max_ranks: int | None = None) -> None:
        super().__init__()
        self.heartbeat_timeout = heartbeat_timeout
        self.max_lost = max_lost
        self.max_ranks = max_ranks
        self.membership: Membership | None = None
        #: the membership this strategy's stages used last (its first stage counts the losses from there)
        self._attached: Membership | None = None
        #: a new process, until its first step: where its collectives run alone (``None``: a member's)
        self._newcomer: _Newcomer | None = None
        #: the new processes dealt a share of the batches, and the batch it starts at (admitted at its boundary)
        self._pending: tuple[list[int], tuple[int, int]] | None = None
        #: admitted new members not handed the job's state yet
        self._welcoming: set[int] = set()
        #: the change that was to admit the new processes dealt a share did not
        self._refused = False
        #: the members whose shares were dealt away, and the batch from which they have none (they leave at its
        #: boundary)
        self._leaving: tuple[list[int], tuple[int, int]] | None = None
        #: who asked this rank to leave (``None``: nobody); it asks at every boundary while its share is not dealt away
        self._leave_asked: str | None = None
        #: a rank that left: the group of itself alone, where what Lightning still runs after (its teardown) runs
        self._departed: dist.ProcessGroup | None = None
        #: called at every step boundary before the members' row is gathered: where a change that loses no rank is
        #: requested (a lost dedicated server started again), so that it happens at a sync point, not mid-checkpoint
        self.boundary_hooks: list[Callable[[], None]] = []
        self._reset()
        self._reset_counters()

    def _reset(self) -> None:
        """A stage (fit, validate, test) starts: its sync points are counted from 0."""
        #: the ranks training now, kept after the stage ends (``None`` before a stage)
        self._members: tuple[int, ...] | None = None
        self._started: tuple[int, ...] | None = None
        #: exchanges committed so far in this stage
        self.committed = 0
        #: sync points (exchanges and collectives) this rank completed in this stage, and the last one's outcome
        self.position = 0
        self._last: tuple[str, Any] = (COLLECTIVE, None)
        self._saved: dict[int, Tensor] = {}
        self._saved_this_round: set[int] = set()

    def _reset_counters(self) -> None:
        """A fit starts: what an earlier one lost is no longer counted, and a change planned in it is dropped (its
        schedule of shares is gone; a new process asks again, a member asked to leave asks again)."""
        self._pending, self._refused, self._leaving = None, False, None
        self._batches: Any = None
        #: steps whose exchange ran again over the survivors, and steps whose own update this rank skipped to take a
        #: survivor's state instead
        self.redone_steps = 0
        self.caught_up_steps = 0
        #: per lost rank: the seconds from the change to the survivors going on, and the exchanges committed with it
        self.recovery_seconds: list[float] = []
        self.loss_steps: list[int] = []
        self._losses: list[Loss] = []
        #: dedicated servers lost (their indices at set-up), and the seconds from the first failure seen to the
        #: trainers going on
        self.lost_servers: list[int] = []
        self._joins: list[Join] = []
        self.server_recovery_seconds: list[float] = []
        #: dedicated servers a process started again for serves again, the seconds from its claim on the run's store
        #: to the trainers going on with it (the leader's clock), and the global step it served again from
        self.returned_servers: list[int] = []
        self.server_return_seconds: list[float] = []
        self.server_return_steps: list[int] = []
        #: lost ranks whose error-feedback residual (the codec's rounding not yet sent) was lost with them
        self.lost_residuals: list[int] = []
        #: per admission: the seconds the members paused for it (from the admission to the state handed over), and
        #: the bytes this rank moved in its handover; a new process's seconds from asking to join to its state
        self.join_pause_seconds: list[float] = []
        self.handover_bytes: list[int] = []
        #: per admission, the exchanges this fit had committed before the new member's first
        self.join_steps: list[int] = []
        self.join_seconds: float | None = None
        #: per leave: the exchanges committed before it, and the seconds the members paused for it
        self.leave_steps: list[int] = []
        self.leave_pause_seconds: list[float] = []
        #: the membership's losses and joins before this fit (a membership lives from one stage to the next)
        self._losses_before = len(self.membership.losses) if self.membership is not None else 0
        self._joins_before = len(self.membership.joins) if self.membership is not None else 0
        self._leaves_before = len(self.membership.leaves) if self.membership is not None else 0
        self._leaves: list[Leave] = []

    # ------------------------------------------------------------------ set-up
    def check_options(self, strategy: ProcessGroupStrategy) -> None:
        name = f"strategy {strategy.strategy_name!r}: on_rank_loss='continue'"
        unsupported = {
            "staleness": (getattr(strategy, "staleness", 0), 0),
            "backup_workers": (getattr(strategy, "backup_workers", 0), 0),
        }
        for option, (value, needed) in unsupported.items():
            if value != needed:
                raise ConfigurationError(
                    f"{name} needs {option}={needed!r}, got {option}={value!r}: the survivors of a loss cannot yet "
                    f"re-form that part of the exchange (see docs/faults.md)"
                )
        if strategy.strategy_name not in SURVIVING:
            raise ConfigurationError(
                f"{name} is not supported by this strategy; strategy={' or '.join(map(repr, SURVIVING))} supports it"
            )
        compression = getattr(strategy, "compression", "none")
        if compression != "none" and strategy.strategy_name != "ring_allreduce":
            raise ConfigurationError(
                f"{name} needs compression='none' with the parameter servers, got compression={compression!r}: the "
                "codec's full-precision weights on each server have no replica yet (strategy='ring_allreduce' "
                "compresses with a loss; see docs/faults.md)"
            )
        if compression != "none" and not make_codec(compression).survives_rank_loss:
            raise ConfigurationError(
                f"{name} cannot run compression={compression!r}: its low-rank factors must agree on every rank, which "
                "a rank one exchange behind at a loss would not have; use compression='fp16' or 'bf16' (see "
                "docs/faults.md)"
            )
        if strategy.process_group_backend == "nccl":
            raise ConfigurationError(
                f"{name} needs process_group_backend='gloo': an NCCL communicator that lost a peer cannot be fenced "
                "and rebuilt here (see docs/faults.md)"
            )
        servers = getattr(strategy, "num_servers", 0)
        if self.max_ranks is not None and servers:
            raise ConfigurationError(
                f"max_ranks={self.max_ranks} cannot be kept: strategy={strategy.strategy_name!r} with "
                f"num_servers={servers} takes new trainers only in lost ones' places (a job grows past its starting "
                "ranks with the servers among the trainers, num_servers=0)"
            )

    @property
    def interrupt(self) -> Callable[[], None] | None:
        return self._check_membership

    def _check_membership(self) -> None:
        if self.membership is not None:
            self.membership.check()

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
        # one membership per job and default group, kept from one stage (fit, validate, test) to the next
        scope = strategy.job_scope or "lightning_dp/external"
        job = f"{scope}@{id(dist.group.WORLD)}"  # (this process's key only: the scope is what every rank shares)
        self._reset()
        membership = _live.get(job)
        store = job_store(strategy.job_scope)
        reach = None  # (the job's store, served again by a new process in rank 0's place)
        if store is not None and strategy.job_scope is not None:
            reach = partial(reach_job_store, strategy.job_scope, env.main_address, env.main_port)
        if membership is None and replaces_lost_rank(strategy.job_scope):
            assert store is not None
            if strategy.global_rank > MAX_JOIN_RANK:
                raise ConfigurationError(
                    f"rank {strategy.global_rank}: a new process joins a running job as rank {MAX_JOIN_RANK} at most"
                )
            address = _group_address(env.main_address)
            membership = Membership.join(strategy.global_rank, store, DIRECTORY_KEY, address, self.heartbeat_timeout,
                                         backend, strategy.timeout, proof_of(scope), reach)  # fmt: skip
            _keep_live(job, membership)
            self._newcomer = _Newcomer(strategy.global_rank, strategy.timeout)
        elif membership is None:
            membership = Membership(
                strategy.global_rank, list(range(world)), store or distributed_c10d._get_default_store(),
                f"{scope}/membership/{_next_membership()}", _group_address(env.main_address), self.heartbeat_timeout,
                max_lost, backend, strategy.timeout, proof_of(scope), DIRECTORY_KEY if store is not None else None,
                places=self.max_ranks, reach_store=reach,
            )  # fmt: skip
            _keep_live(job, membership)
        if self._attached is not membership:  # this strategy's first stage: the losses before it are not its own
            self._losses_before = len(membership.losses)
            self._joins_before = len(membership.joins) if self._newcomer is None else 0
            self._leaves_before = len(membership.leaves)
            self._attached = membership
        if self._newcomer is not None:  # alone until the members admit it (at the end of its set-up)
            self.membership = membership
            self._members, self._started = membership.members, membership.original
            return self._newcomer.group, self._newcomer.group
        self.membership = membership
        groups = self._stage_groups(strategy)
        self._members, self._started = membership.members, membership.original
        return groups

    def _stage_groups(self, strategy: ProcessGroupStrategy) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """The groups of the ranks training now, for a stage that starts; a change under way (a rank lost between two
        stages) is agreed on first. The stage's sync points count on from the last one committed."""
        membership = self.membership
        assert membership is not None
        while True:
            try:
                if membership.agreement.changing:
                    membership.recover()
                groups = membership.group("gradients"), membership.group("control")
                break
            except Exception as error:  # noqa: BLE001 - the membership says what it means
                change = membership.interpret(error)
                if not isinstance(change, MembershipChange):
                    if change is error:
                        raise
                    raise change from error
        _lead(strategy, membership)
        self.position = membership.agreement.committed
        return groups

    @property
    def newcomer(self) -> bool:
        return self._newcomer is not None

    @property
    def restores_after_setup(self) -> bool:
        return self._newcomer is not None

    def live_checkpoint(self) -> dict[str, Any] | None:
        return self._newcomer.checkpoint if self._newcomer is not None else None

    @property
    def members(self) -> tuple[int, ...] | None:
        return self.membership.members if self.membership is not None else self._members

    @property
    def started(self) -> tuple[int, ...] | None:
        return self._started

    def on_exception(self) -> None:
        if self.membership is not None:  # the others see this rank lost, not finished
            self._close(farewell=False)

    def check_fit(self, strategy: DataParallelStrategy) -> None:
        self._reset_counters()
        module = strategy.lightning_module
        assert module is not None
        name = f"strategy {strategy.strategy_name!r}: on_rank_loss='continue'"
        if not module.automatic_optimization:
            raise ConfigurationError(
                f"{name} needs automatic optimization: with manual optimization the step is the module's own, and a "
                "loss inside it cannot be closed over the survivors"
            )
        if strategy._uses_shared_memory() and not strategy.single_node:
            raise ConfigurationError(
                f"{name} with intra_node='shm' runs on one machine only: across machines the hierarchical ring's "
                "groups cannot be re-formed over the survivors yet; use intra_node='ring'"
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
        self._batches = strategy.batches
        # Lightning's SIGTERM broadcast before every step (and its signal handler's) run on the default group, which
        # a lost rank leaves broken: the flag is combined over the ranks training now instead
        self._undo += [
            replace_step_sigterm_broadcast(trainer, lambda: self._at_boundary(strategy, trainer)),
            replace_sigterm_notifier(trainer),
            self._listen_for_leave(strategy),
        ]
        if self._newcomer is not None:
            self._join(strategy, trainer)

    def _listen_for_leave(self, strategy: DataParallelStrategy) -> Callable[[], None]:
        """:data:`LEAVE_SIGNAL` asks this rank to leave, where the process has no handler of its own for it (and this
        is its main thread); returns a function that stops listening."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        if signal.getsignal(LEAVE_SIGNAL) not in (signal.SIG_DFL, None, _on_leave_signal):
            log.warning(
                "strategy %r: %s has a handler of the program's own, so it does not ask rank %d to leave; call "
                "trainer.strategy.leave() instead", strategy.strategy_name, LEAVE_SIGNAL.name, strategy.global_rank,
            )  # fmt: skip
            return lambda: None
        signal.signal(LEAVE_SIGNAL, _on_leave_signal)
        _leave_listener[0] = weakref.ref(self)

        def stop() -> None:
            if _leave_listener[0] is not None and _leave_listener[0]() is self:
                _leave_listener[0] = None

        return stop

    def request_leave(self, strategy: DataParallelStrategy, why: str) -> None:
        refusal = self._leave_refusal(strategy)
        if refusal is not None:
            raise ConfigurationError(refusal)
        self._leave_asked = why

    def _leave_refusal(self, strategy: DataParallelStrategy) -> str | None:
        """Why this rank cannot leave the running job (``None``: it can)."""
        name = f"strategy {strategy.strategy_name!r}: rank {strategy.global_rank} cannot leave the running job"
        membership = self.membership
        if membership is not None and membership.leader == strategy.global_rank:
            return (f"{name}: it leads the members (it serves their store and the job's directory); another rank "
                    "may leave")  # fmt: skip
        if getattr(getattr(strategy, "_launcher", None), "procs", None):
            return (f"{name}: it started the other ranks of its machine (the strategy's own launcher), which end "
                    "with it; another rank may leave")  # fmt: skip
        if strategy.global_rank > MAX_JOIN_RANK:
            return f"{name}: a step boundary names ranks 0 to {MAX_JOIN_RANK} only"
        return None

    def setup_stage(self, strategy: DataParallelStrategy, module: torch.nn.Module) -> None:
        # a torchmetrics metric syncs on the default group, which a lost rank leaves broken: it syncs over the ranks
        # training now instead, as a sync point (unless it was given a group or a sync function of its own)
        for metric in module.modules():
            if isinstance(metric, Metric) and metric.dist_sync_fn is None and metric.process_group is None:
                metric.dist_sync_fn = MembersGather(strategy)
                self._undo.append(partial(setattr, metric, "dist_sync_fn", None))

    def evaluation_loader(self, trainer: pl.Trainer, dataloader: Any) -> Any | None:
        # validation and testing shard their data over the ranks that train now, not over those the job started with
        sampler = getattr(dataloader, "sampler", None)
        if trainer.state.stage == RunningStage.TRAINING or type(sampler) is not DistributedSampler:
            return None
        assert self.membership is not None
        return _update_dataloader(dataloader, MembersSampler(sampler, self.membership), mode=trainer.state.stage)

    # ------------------------------------------------------------------ sync points: the exchange and collectives
    def save_gradients(self, bucket: GradientBucket) -> None:
        saved = self._saved.get(bucket.index)
        if saved is None:
            saved = self._saved[bucket.index] = torch.empty_like(bucket.buffer)
        saved.copy_(bucket.buffer)
        self._saved_this_round.add(bucket.index)

    def discard_saved(self) -> None:
        self._saved_this_round.clear()

    def finish_gradient_sync(self, strategy: DataParallelStrategy, reducer: BucketReducer, copy_back: bool) -> None:
        exchange = reducer.finish
        finished = [False]

        def run() -> None:
            finished[0] = False
            exchange(copy_back)  # noqa: B023 - run at once
            finished[0] = True
            strategy.seal_exchange()

        while True:
            try:
                self._run_point(run, EXCHANGE)
            except MembershipChange:
                if not finished[0]:
                    reducer.abandon()
                outcome, factor = self._recover(strategy, EXCHANGE)
                if outcome is not _REDO and strategy.exchange_outcome_travels:
                    # the step's update is the donor's, taken already: this rank's is skipped
                    for p in reducer.params:
                        p.grad = None
                    self.caught_up_steps += 1
                elif outcome is not _REDO and not finished[0]:
                    raise RuntimeError(
                        f"strategy {strategy.strategy_name!r}, on_rank_loss='continue': rank {strategy.global_rank}'s "
                        "gradient exchange did not complete where another survivor's did, so the step cannot be closed "
                        "over the survivors; restart the run from its last checkpoint"
                    ) from None
                if outcome is not _REDO:  # (servers: this rank's part of the exchange is in its buckets already)
                    self._saved_this_round.clear()
                    self._exchange_done(strategy)
                    return
                self._restore(reducer, factor)
                exchange = reducer.resend
                self.redone_steps += 1
                continue
            self._saved_this_round.clear()
            self._exchange_done(strategy)
            return

    def collective(self, strategy: ProcessGroupStrategy, run: Callable[[dist.ProcessGroup | None], T]) -> T:
        if self._newcomer is not None:  # a new process before its first step: alone (see the module docstring)
            return run(self._newcomer.group)
        if self._departed is not None:  # a rank that left, in Lightning's teardown: alone
            return run(self._departed)
        if self.membership is None:  # after the fit (a checkpoint saved later): over the last members, as they are
            return run(strategy.control_group)
        while True:
            try:
                return self._run_point(lambda: run(strategy.control_group), COLLECTIVE)
            except MembershipChange:
                outcome, _ = self._recover(cast("DataParallelStrategy", strategy), COLLECTIVE)
                if outcome is not _REDO:
                    return cast(T, outcome)

    def setup_collective(self, strategy: ProcessGroupStrategy, run: Callable[[dist.ProcessGroup | None], T]) -> T:
        # a sync point like any other (a rank lost since the last stage is noticed here), sealed by a barrier so that
        # no rank completes it before every member reached it (a broadcast's receivers would)
        def sealed(group: dist.ProcessGroup | None) -> T:
            result = run(group)
            dist.barrier(group=group)
            return result

        return self.collective(strategy, sealed)

    def weight_pull(self, strategy: DataParallelStrategy, pull: Callable[[], None]) -> None:
        while True:
            try:
                self._run_point(pull, PULL)
                break
            except MembershipChange:
                outcome, _ = self._recover(strategy, PULL)
                if outcome is not _REDO:  # the weights of a survivor that completed it, taken already
                    break
        strategy.point_completed(PULL)

    def after_point(self, strategy: DataParallelStrategy, kind: str, run: Callable[[], None]) -> None:
        # a loss meanwhile is recovered from as at that point: the recovery does what ``run`` does (after_recovery)
        try:
            run()
        except Exception as error:  # noqa: BLE001 - the membership says what it means
            assert self.membership is not None
            change = self.membership.interpret(error)
            if not isinstance(change, MembershipChange):
                if change is error:
                    raise
                raise change from error
            self._recover(strategy, kind)

    def reducible(self, tensor: Tensor) -> Tensor:
        # a copy: an attempt a lost rank interrupts may leave partial sums in what it reduced, and it runs again
        return tensor.clone()

    def broadcast_object(self, strategy: ProcessGroupStrategy, obj: T, src: int) -> T:
        if self._newcomer is not None or self._departed is not None:  # alone: its own
            return obj

        # an all-gather, not a broadcast: no rank completes it before every rank has reached it (see _recover)
        def run(group: dist.ProcessGroup | None) -> T:
            everyone: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, obj if strategy.global_rank == src else None, group=group)
            return cast(T, everyone[dist.get_group_rank(group, src)] if group is not None else everyone[src])

        return self.collective(strategy, run)

    def broadcast_buffers(self, strategy: ProcessGroupStrategy, buffers: list[Tensor]) -> None:
        if self._newcomer is not None or self._departed is not None:
            return
        source = strategy.source_rank(0)

        def run(group: dist.ProcessGroup | None) -> list[Tensor]:
            flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers]) if buffers else torch.empty(0)
            everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, flat, group=group)
            return [everyone[dist.get_group_rank(group, source) if group is not None else source]]

        (values,) = self.collective(strategy, run)
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(values[offset : offset + b.numel()].view_as(b).to(b.dtype))
                offset += b.numel()

    def _run_point(self, run: Callable[[], T], kind: str) -> T:
        """Run the next sync point, of ``kind``, and commit it on the membership (a collective's result kept for a
        member one point behind); a change of membership (now, or behind a transport error) raises
        :class:`MembershipChange`."""
        membership = self.membership
        assert membership is not None
        point = self.position + 1
        try:
            membership.check()
            result = run()
            membership.commit(point)
        except Exception as error:  # noqa: BLE001 - the membership says what it means
            change = membership.interpret(error)
            if isinstance(change, MembershipChange):
                raise change from error
            if change is error:
                raise
            raise change from error
        self.position = point
        self._last = (kind, result if kind == COLLECTIVE else None)
        return result

    def _exchange_done(self, strategy: DataParallelStrategy) -> None:
        self.committed += 1
        strategy.batches.exchange_committed()
        strategy.point_completed(EXCHANGE)

    def _restore(self, reducer: BucketReducer, factor: float) -> None:
        """Put back this rank's own gradients into the buckets an abandoned exchange touched, times ``factor`` (their
        weight among the survivors over the weight they were computed with). A codec's state stays as the abandoned
        attempt left it: a residual then holds that attempt's roundings instead of what it carried into the attempt
        (a few 16-bit roundings of the bucket, not a copy kept every step for a rare redo)."""
        for bucket in reducer.buckets:
            if bucket.index in self._saved_this_round:
                bucket.buffer.copy_(self._saved[bucket.index])
            if factor != 1.0:
                bucket.buffer[: bucket.grad_numel].mul_(factor)
        self._saved_this_round.clear()

    def _recover(self, strategy: DataParallelStrategy, kind: str) -> tuple[Any, float]:
        """Agree with the survivors on the new membership, re-form the exchange over them, and bring every member to
        the same sync point; this rank is at a point of ``kind``. Returns the outcome (:data:`_REDO` where this rank's
        point must run again over the survivors, else its outcome as a member that completed it had it: a
        collective's result; for the ring's exchange its update, taken with the weights and optimizer state; for the
        servers' pull the weights) and the factor from the weight of the batch in flight's gradient to its weight among
        the survivors.

        A point completes on a rank only once every member has reached it, so after a loss every member has completed
        the same points, or one more (its last messages arrived where others' did not): those one point behind take
        that point's outcome from the lowest member that completed it. Another loss during all this starts it
        again."""
        membership = self.membership
        assert membership is not None
        started, before = time.monotonic(), membership.generation
        residuals = strategy.codec.keeps_residuals  # (a single survivor's codec is the identity afterwards)
        outcome: Any = _REDO  # a catch-up taken in a pass that another loss interrupted still counts
        # a new process waits for its admission as long as a peer may stay silent
        wait = strategy.timeout.total_seconds() if self._newcomer is not None else None
        admitted: set[int] = set()
        while True:
            try:
                decision = membership.recover(wait)
                if strategy.global_rank in decision.left:
                    raise _Departed(decision)
                admitted |= set(decision.joined)
                self._note_admission(decision)
                leave_ended = self._note_leave(decision)
                strategy.rebuild_exchange()
                aligned = self._align(strategy, decision, kind)
                if aligned is not _REDO:
                    outcome = aligned
                lost = [loss for loss in membership.losses if loss.generation > before]
                left = [leave for leave in membership.leaves if leave.generation > before]
                if lost:  # (a rank already dealt out again: no change)
                    strategy.batches.exclude([loss.rank for loss in lost])
                    if self._pending is not None:  # its share, from the batch it starts at, dealt again
                        strategy.batches.keep_included(*self._pending)
                    if self._leaving is not None:  # their shares, from the batch they have none, dealt away again
                        strategy.batches.keep_excluded(*self._leaving)
                # (the shares of the members that left were dealt away already, from the batch that comes next)
                strategy.after_recovery([loss.rank for loss in lost] + [leave.rank for leave in left])
                if admitted & set(membership.members):
                    self._welcoming = admitted & set(membership.members)
                    try:
                        self._welcome(strategy)
                    finally:
                        self._welcoming = set()
                    if self._newcomer is None:
                        self.join_steps.append(self.committed)
                        self.join_pause_seconds.append(time.monotonic() - (membership.change_began or started))
                        _announce(
                            trainer_of(strategy.lightning_module),
                            f"strategy {strategy.strategy_name!r}: a new process joined as rank(s) "
                            f"{sorted(admitted)} after {self.committed} steps; the members paused "
                            f"{self.join_pause_seconds[-1]:.3f} s for its admission and the handover of the job's "
                            "state",
                        )
                if left:
                    pause = time.monotonic() - (membership.change_began or started)
                    self.leave_steps += [self.committed] * len(left)
                    self.leave_pause_seconds += [pause] * len(left)
                    _announce(
                        trainer_of(strategy.lightning_module),
                        f"strategy {strategy.strategy_name!r}: rank(s) {[leave.rank for leave in left]} left the job "
                        f"after {self.committed} steps; the members paused {pause:.3f} s",
                    )
                if admitted or left or leave_ended:  # (measurements start afresh, whoever stayed or went)
                    strategy.batches.admitted()
                break
            except Exception as error:  # noqa: BLE001 - a loss during recovery starts it again
                change = membership.interpret(error)
                if self._newcomer is not None and isinstance(change, MembershipChange):
                    raise JoinAbandonedError(
                        f"rank {strategy.global_rank}: the job changed while this process joined it ({change}); it "
                        "leaves without having joined, and may be started again"
                    ) from error
                if not isinstance(change, MembershipChange):
                    if change is error:
                        raise
                    raise change from error
        factor = strategy.batches.reweigh_in_flight()
        trainer = trainer_of(strategy.lightning_module)
        if trainer is not None:
            reset_evaluation_data(trainer)
        self._members = membership.members
        _lead(strategy, membership)
        seconds = time.monotonic() - started
        committed = self.committed + (1 if outcome is not _REDO and kind == EXCHANGE else 0)
        self.recovery_seconds += [seconds] * len(lost)
        self.loss_steps += [committed] * len(lost)
        if residuals:
            self.lost_residuals += [loss.rank for loss in lost]
        if lost:  # (a change that lost no rank: the strategy says what changed)
            rank_zero_warn(
                f"strategy {strategy.strategy_name!r}: lost {', '.join(f'rank {x.rank} ({x.cause})' for x in lost)}; "
                f"the job goes on with ranks {list(decision.members)} (on_rank_loss='continue')"
            )
        return outcome, factor

    def _align(self, strategy: DataParallelStrategy, decision: Decision, kind: str) -> Any:
        """Bring every member to the same sync point (see :meth:`_recover`); this rank's outcome."""
        positions = decision.committed
        latest = max(positions.values())
        if min(positions.values()) < latest - 1:
            raise RuntimeError(
                f"after the loss of rank(s) {list(decision.lost)} the survivors stopped "
                f"{latest - min(positions.values())} sync points apart ({positions}), which a collective outside the "
                "strategy's (on the default group, or on a group of the module's own) can cause: the run cannot go on "
                "exactly; restart it from its last checkpoint"
            )
        if all(p == latest for p in positions.values()):
            return _REDO
        return self._take_from_donor(strategy, decision, latest, kind)

    def _take_from_donor(self, strategy: DataParallelStrategy, decision: Decision, latest: int, kind: str) -> Any:
        """The lowest member that completed sync point ``latest`` sends its outcome to the members one point behind
        (collective over the new gradient group): a collective's result, after the ring's exchange its weights and
        optimizer state, after the servers' pull its weights (after the servers' exchange nothing: each member holds
        its part). Returns this rank's outcome (:data:`_REDO` where it completed the point itself)."""
        donor = min(r for r, p in decision.committed.items() if p == latest)
        group = strategy.gradient_group
        assert group is not None and strategy.model is not None
        donor_rank = dist.get_group_rank(group, donor)
        last: list[Any] = [self._last if strategy.global_rank == donor else None]
        dist.broadcast_object_list(last, group=group, group_src=donor_rank)
        done_kind, result = last[0]
        behind = self.position < latest
        if behind and done_kind != kind:
            raise RuntimeError(
                f"rank {strategy.global_rank} stopped at a {kind} where rank {donor} completed a {done_kind}: the "
                "ranks do not run the same sync points in the same order (a collective called on some ranks only?)"
            )
        # everything arrives before anything is applied: a loss meanwhile changes nothing
        if done_kind == PULL or (done_kind == EXCHANGE and strategy.exchange_outcome_travels):
            params = [p.data for p in strategy.model.parameters()]
            weights = [p.clone() for p in params]
            broadcast_tensors(weights, src=donor_rank, group=group)
            states: list[Any] = [None]
            if done_kind == EXCHANGE:  # (after a pull every server holds its own state already)
                states = [[unwrap_optimizer(o).state_dict() for o in strategy.optimizers]
                          if strategy.global_rank == donor else None]  # fmt: skip
                dist.broadcast_object_list(states, group=group, group_src=donor_rank)
            if behind:
                with torch.no_grad():
                    for p, w in zip(params, weights):
                        p.copy_(w)
                for optimizer, state in zip(map(unwrap_optimizer, strategy.optimizers), states[0] or []):
                    optimizer.load_state_dict(state)
        if not behind:
            return _REDO
        strategy.point_completed(done_kind)
        self.position = latest
        self._last = (done_kind, result)
        assert self.membership is not None
        self.membership.agreement.committed = latest  # what this rank reports if another loss follows
        return result

    # ------------------------------------------------------------------ new members
    def _at_boundary(self, strategy: DataParallelStrategy, trainer: pl.Trainer) -> None:
        """Before every training step (Lightning's SIGTERM broadcast, replaced): whether any member received SIGTERM
        (then every member stops at the same step), which new processes every member hears (each is dealt a share
        from the first batch no loader has drawn) and which members ask to leave (their shares are dealt away from
        there), and at the boundary before that batch their admission, or their leave."""
        if self._departed is not None:  # (a rank that left runs no more steps)
            return
        try:
            self._boundary(strategy, trainer)
        except _Departed as departed:
            self._depart(strategy, trainer, departed.decision)

    def _boundary(self, strategy: DataParallelStrategy, trainer: pl.Trainer) -> None:
        if self._newcomer is not None:  # a new process's first step: the members took this boundary at its admission
            # the members set their validation loaders up again after the admission, as after every change: it sets
            # its own up with them, at the next validation (not the one its sanity check set up alone)
            reset_evaluation_data(trainer)
            if self._newcomer.loaders is not None:
                set_loaders_state(trainer, self._newcomer.loaders)
            self._newcomer.release(strategy)
            self._newcomer = None
            return
        membership = self.membership
        assert membership is not None
        for hook in self.boundary_hooks:
            hook()
        pending, start = (self._pending[0], self._pending[1]) if self._pending is not None else ([], (-1, -1))
        leaving, last = (self._leaving[0], self._leaving[1]) if self._leaving is not None else ([], (-1, -1))
        offered = sorted(membership.candidates() - set(membership.members)) if self._pending is None else []
        asks = self._asks_to_leave(strategy) and self._leaving is None
        row = [1 if getattr(trainer, "received_sigterm", False) else 0, _mask(offered), _mask(pending), *start,
               _mask([strategy.global_rank] if asks else []), _mask(leaving), *last,
               *strategy.batches.boundary_row()]  # fmt: skip

        def combine(group: dist.ProcessGroup | None) -> list[list[int]]:
            everyone = [torch.empty(len(row), dtype=torch.int64) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, torch.tensor(row, dtype=torch.int64), group=group)
            return [t.tolist() for t in everyone]

        rows = self.collective(strategy, combine)
        if any(r[_SIGTERM] for r in rows):
            raise SIGTERMException()
        drawn = [r[_DRAWN:] for r in rows]
        if len({tuple(r[_JOINING]) for r in rows}) > 1:
            # the members dealt different shares to new processes (a loss raced with the boundary that dealt them):
            # every one takes them back alike, before any batch with them is drawn; they are offered again
            strategy.batches.withdraw(
                _ranks(functools.reduce(lambda a, b: a | b, (r[_JOINING.start] for r in rows))), drawn
            )
            self._pending = None
            return
        if len({tuple(r[_LEAVING]) for r in rows}) > 1:  # (as above, for members dealt away: they ask again)
            strategy.batches.reinstate(
                _ranks(functools.reduce(lambda a, b: a | b, (r[_LEAVING.start] for r in rows))), drawn
            )
            self._leaving = None
            return
        if self._leaving is not None and next_training_batch(trainer) >= self._leaving[1]:
            while self._leaving is not None:  # (again where a loss's change let them go no further)
                self._let_go(strategy)
            return  # (the rows are the old members')
        if self._pending is not None and next_training_batch(trainer) >= self._pending[1] and not self._refused:
            self._admit(strategy)
            if self._pending is None:  # admitted: the rows are the old members'
                return
        if self._refused:  # the change that was to admit them did not (a loss, or a member that does not hear them)
            assert self._pending is not None
            strategy.batches.withdraw(self._pending[0], drawn)
            self._pending, self._refused = None, False
            return
        asked = [r for r in _ranks(functools.reduce(lambda a, b: a | b, (r[_ASKED] for r in rows)))
                 if r in membership.members]  # fmt: skip
        problem = membership.problem_without(set(asked)) if asked else None
        if problem is not None:  # (every member finds the same; the ranks that asked drop their request)
            if strategy.global_rank in asked:
                warnings.warn(f"rank {strategy.global_rank} does not leave the running job: {problem}", stacklevel=2)
                self._leave_asked = None
            asked = []
        if self._pending is None and self._leaving is None and asked:
            after = next_training_batch(trainer)
            last = strategy.batches.let_go(asked, drawn, trainer.accumulate_grad_batches, after)
            self._leaving = (asked, last)
            _announce(
                trainer,
                f"strategy {strategy.strategy_name!r}: rank(s) {asked} leave the job; they train the batches before "
                f"batch {last[1]} of epoch {last[0]}, the others take their share from there",
            )
            return
        heard = _ranks(functools.reduce(lambda a, b: a & b, (r[_OFFERED] for r in rows)))
        joining = [r for r in heard if r not in membership.members]
        if self._pending is None and self._leaving is None and joining:
            joined = joining[:1]  # (one at a time: each one admitted is heard by the next)
            after = next_training_batch(trainer)
            start = strategy.batches.include(joined, drawn, trainer.accumulate_grad_batches, after)
            self._pending = (joined, start)
            _announce(
                trainer,
                f"strategy {strategy.strategy_name!r}: a new process asks to join as rank {joined[0]}; it trains from "
                f"batch {start[1]} of epoch {start[0]} on",
            )

    def _asks_to_leave(self, strategy: DataParallelStrategy) -> bool:
        """Whether this rank was asked to leave and can (a request it cannot follow is said and dropped)."""
        if self._leave_asked is None:
            return False
        refusal = self._leave_refusal(strategy)
        if refusal is not None:
            warnings.warn(f"{refusal} (asked by {self._leave_asked})", stacklevel=2)
            self._leave_asked = None
            return False
        return True

    def _let_go(self, strategy: DataParallelStrategy) -> None:
        """Let the members dealt away go at this step boundary (every member); on a rank that leaves, raises
        :class:`_Departed` with the decision."""
        assert self._leaving is not None and self.membership is not None
        self.membership.let_go(set(self._leaving[0]))
        self._recover(strategy, COLLECTIVE)

    def _depart(self, strategy: DataParallelStrategy, trainer: pl.Trainer, decision: Decision) -> None:
        """This rank left the job: its membership closes (the others see it finish, not fail), what Lightning still
        runs after runs alone, and the process ends with exit code 0."""
        membership = self.membership
        assert membership is not None
        self._departed = _group_of_one(strategy.global_rank, strategy.timeout, "departed")
        step = self.committed
        self._close(farewell=True)
        print(
            f"strategy {strategy.strategy_name!r}: rank {strategy.global_rank} left the job after {step} steps "
            f"(the job goes on with ranks {list(decision.members)}); this process ends",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        raise SystemExit(0)

    def _note_admission(self, decision: Decision) -> None:
        """The new processes dealt a share are admitted by ``decision``, or refused by it (asked for, not admitted:
        their shares are taken back at this step boundary, by every member alike)."""
        if self._pending is None:
            return
        if set(self._pending[0]) <= set(decision.joined):
            self._pending = None
        elif set(self._pending[0]) & set(decision.asked):
            self._refused = True

    def _note_leave(self, decision: Decision) -> bool:
        """The members dealt away that ``decision`` let go (or lost) are no longer to leave; whether no one is left
        to leave now."""
        if self._leaving is None:
            return False
        staying = [r for r in self._leaving[0] if r not in decision.left and r not in decision.lost]
        self._leaving = (staying, self._leaving[1]) if staying else None
        return self._leaving is None

    def _admit(self, strategy: DataParallelStrategy) -> None:
        """Admit the new processes dealt a share from the batch that comes next, and hand them the job's state (every
        member at this step boundary)."""
        assert self._pending is not None and self.membership is not None
        self.membership.admit(set(self._pending[0]))
        self._recover(strategy, COLLECTIVE)

    def _join(self, strategy: DataParallelStrategy, trainer: pl.Trainer) -> None:
        """A new process, at the end of its set-up: ask the members to join, wait for their admission and take the
        job's state from them (restored by Lightning as a loaded checkpoint)."""
        assert self.membership is not None
        began = time.monotonic()
        self.membership.ask_to_join()
        self.position = -1  # (behind every member: a sync point a member completes alone is taken from it)
        self._recover(strategy, COLLECTIVE)
        self.join_seconds = time.monotonic() - began

    def _welcome(self, strategy: DataParallelStrategy) -> None:
        """Hand the job's state to the admitted new members from the others, chunked across them (collective over the
        members; for the others a sync point, so that a loss meanwhile runs it again over the survivors)."""
        membership = self.membership
        assert membership is not None and strategy.gradient_group is not None
        trainer = trainer_of(strategy.lightning_module)
        me = strategy.global_rank
        if self._newcomer is not None:
            recipients = sorted(self._welcoming & set(membership.members))
            donors = [r for r in membership.members if r not in self._welcoming]
            held = strategy.after_admission(recipients)
            state, moved = hand_over(strategy.gradient_group, me, donors[0], donors, recipients, None,
                                     _replicated(strategy))  # fmt: skip
            self.handover_bytes.append(moved.bytes)
            if held:  # the members sent the hyperparameters; the states are the ones it holds already
                for saved, optimizer in zip(state["optimizer_states"], strategy.optimizers, strict=True):
                    saved["state"] = strategy.optimizer_state(optimizer).get("state", {})
            self._take_state(strategy, trainer, state)
            return

        def run(group: dist.ProcessGroup | None) -> int:
            recipients = sorted(self._welcoming & set(membership.members))
            donors = [r for r in membership.members if r not in self._welcoming]
            if not recipients:  # (lost before it was handed anything)
                return 0
            held = strategy.after_admission(recipients)

            def state() -> Any:
                return self._state_to_hand_over(strategy, trainer, me == donors[0], held)

            assert strategy.gradient_group is not None
            _, moved = hand_over(strategy.gradient_group, me, donors[0], donors, recipients, state,
                                 _replicated(strategy))  # fmt: skip
            return moved.bytes

        self.handover_bytes.append(self.collective(strategy, run))

    def _state_to_hand_over(
        self, strategy: DataParallelStrategy, trainer: Any, full: bool, held: bool
    ) -> dict[str, Any]:
        """This member's state for a new one: Lightning's checkpoint in memory and where the members stand
        (``full``, the source), or only the replicas' weights and optimizer states (another donor); without the
        optimizers' states, their hyperparameters only, where the new members hold them already (``held``)."""
        if not full:
            optimizers = [strategy.optimizer_state(o) for o in strategy.optimizers]
            return {"state_dict": strategy.lightning_module_state_dict(),
                    "optimizer_states": [{**o, "state": {}} for o in optimizers] if held else optimizers}  # fmt: skip
        checkpoint = dump_checkpoint(trainer)
        if held:
            checkpoint["optimizer_states"] = [{**saved, "state": {}} for saved in checkpoint["optimizer_states"]]
        checkpoint[JOIN_KEY] = {"position": self.position, "committed": self.committed,
                                "batches": strategy.batches.join_state(),
                                "loaders": loaders_state(trainer)}  # fmt: skip
        return checkpoint

    def _take_state(self, strategy: DataParallelStrategy, trainer: Any, checkpoint: dict[str, Any]) -> None:
        """A new member's: stand where the members stand, and have Lightning restore their checkpoint."""
        assert self._newcomer is not None and self.membership is not None
        where = checkpoint.pop(JOIN_KEY)
        self.position = int(where["position"]) + 1  # (the handover: a sync point of the members')
        self.committed = int(where["committed"])
        self.join_steps.append(self.committed)
        self._last = (COLLECTIVE, None)
        self.membership.agreement.committed = self.position
        strategy.batches.take_join_state(where["batches"])
        self._newcomer.loaders = where["loaders"]
        self._newcomer.checkpoint = checkpoint
        set_loaded_checkpoint(trainer, checkpoint)
        self._newcomer.hold(strategy)

    # ------------------------------------------------------------------ what the run lost
    @property
    def losses(self) -> list[Loss]:
        """Every rank this fit went on without."""
        return list(self.membership.losses[self._losses_before :]) if self.membership is not None else self._losses

    @property
    def pending_joins(self) -> list[int]:
        """The new processes dealt a share of the global batches and not admitted yet."""
        return list(self._pending[0]) if self._pending is not None else []

    @property
    def joins(self) -> list[Join]:
        """Every new process this fit admitted."""
        return list(self.membership.joins[self._joins_before :]) if self.membership is not None else self._joins

    @property
    def leaves(self) -> list[Leave]:
        """Every member that left this fit on purpose."""
        return list(self.membership.leaves[self._leaves_before :]) if self.membership is not None else self._leaves

    def metrics(self) -> dict[str, Any]:
        return {
            "lost_ranks": [loss.rank for loss in self.losses],
            "loss_causes": [loss.cause for loss in self.losses],
            "loss_steps": list(self.loss_steps),
            "recovery_seconds": list(self.recovery_seconds),
            "dropped_samples": getattr(self._batches, "dropped", 0),
            "redone_steps": self.redone_steps,
            "caught_up_steps": self.caught_up_steps,
            "lost_servers": list(self.lost_servers),
            "server_recovery_seconds": list(self.server_recovery_seconds),
            "returned_servers": list(self.returned_servers),
            "server_return_seconds": list(self.server_return_seconds),
            "server_return_steps": list(self.server_return_steps),
            "lost_residuals": list(self.lost_residuals),
            "joined_ranks": [join.rank for join in self.joins],
            "join_steps": list(self.join_steps),
            "join_pause_seconds": list(self.join_pause_seconds),
            "join_seconds": self.join_seconds,
            "handover_bytes": list(self.handover_bytes),
            "left_ranks": [leave.rank for leave in self.leaves],
            "leave_steps": list(self.leave_steps),
            "leave_pause_seconds": list(self.leave_pause_seconds),
        }

    def close(self) -> None:
        """The stage's end: the membership stays (a later stage of this job uses it) until the process exits, when
        this rank says goodbye."""
        super().close()
        if self.membership is not None:
            self._losses, self._joins, self._leaves = self.losses, self.joins, self.leaves
            self.membership = None

    def _close(self, farewell: bool) -> None:
        membership = self.membership
        self.close()
        if membership is not None:
            _drop_live(membership)
            membership.close(farewell)


class MembersSampler(DistributedSampler):
    """An evaluation loader's ``DistributedSampler`` (``base``), sharded at each pass over the ranks that train now
    (every sample evaluated once, as ``DistributedSampler`` does over all ranks)."""

    def __init__(self, base: DistributedSampler, membership: Membership) -> None:
        self.__dict__.update(vars(base))
        self._membership = membership
        self._place()

    def _place(self) -> None:
        members = self._membership.members
        self.num_replicas = len(members)
        self.rank = members.index(self._membership.rank)
        size = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last and size % self.num_replicas:
            self.num_samples = math.ceil((size - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(size / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[Any]:
        self._place()
        return super().__iter__()

    def __len__(self) -> int:
        self._place()
        return self.num_samples


def _mask(ranks: list[int]) -> int:
    """``ranks`` as the bits of an int64 (ranks above :data:`MAX_JOIN_RANK` left out)."""
    return sum(1 << r for r in ranks if r <= MAX_JOIN_RANK)


def _ranks(mask: int) -> list[int]:
    return [r for r in range(MAX_JOIN_RANK + 1) if mask >> r & 1]


def _lead(strategy: DataParallelStrategy | ProcessGroupStrategy, membership: Membership) -> None:
    """Global rank 0's roles (logging, checkpoints, the progress bar) on the members' leader, and on it alone (a new
    process in rank 0's place leads again once admitted)."""
    leads = membership.leader == strategy.global_rank
    rank_zero_only.rank = utils_rank_zero_only.rank = 0 if leads else strategy.global_rank  # type: ignore[attr-defined]


def _announce(trainer: Any, text: str) -> None:
    """Say ``text`` on the leader: as a line above the progress bar where one shows, else in Lightning's log."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None and bar.is_enabled and getattr(rank_zero_only, "rank", 0) == 0:
        bar.print(text)
    else:
        rank_zero_info(text)


def _replicated(strategy: DataParallelStrategy) -> Callable[[Path], bool]:
    """Whether a tensor of the handed-over checkpoint is equal on every member: the parameters and the optimizer
    states (not the buffers: each member's running statistics are its own until rank 0's are broadcast)."""
    module = strategy.lightning_module
    assert module is not None
    parameters = {name for name, _ in module.named_parameters()}

    def replicated(path: Path) -> bool:
        return (len(path) == 2 and path[0] == "state_dict" and path[1] in parameters) or (
            bool(path) and path[0] == "optimizer_states"
        )

    return replicated


#: the rank-loss mode :data:`LEAVE_SIGNAL` asks to leave (``None``: none listens, the signal's default action)
_leave_listener: list[weakref.ref[ContinueOnRankLoss] | None] = [None]


def _on_leave_signal(signum: int, frame: Any) -> None:
    """:data:`LEAVE_SIGNAL`'s handler: the listening fit's rank leaves at its next step boundary; with none (it
    ended; Lightning's signal connector may put this handler back at its teardown), the default action."""
    listener = _leave_listener[0]() if _leave_listener[0] is not None else None
    if listener is not None:
        listener._leave_asked = LEAVE_SIGNAL.name
        return
    signal.signal(LEAVE_SIGNAL, signal.SIG_DFL)
    os.kill(os.getpid(), LEAVE_SIGNAL)


class _Departed(BaseException):  # noqa: N818 - not an error: this rank's leave, carried to the step boundary
    """The decision that let this rank go, raised from the recovery to the step boundary that handles it (a
    ``BaseException``: nothing between them takes it for a failed exchange)."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(f"rank left the job in generation {decision.generation}")
        self.decision = decision


_alone_count = [0]


def _group_of_one(rank: int, timeout: Any, what: str) -> dist.ProcessGroup:
    """A gloo group of global rank ``rank`` alone, on a store of its own (``what``: a word for its name)."""
    _alone_count[0] += 1
    return form_group((rank,), rank, dist.PrefixStore(what, dist.HashStore()),
                      f"lightning_dp/{what}/{_alone_count[0]}", "gloo", timeout)  # fmt: skip


class _Newcomer:
    """A new process before its first step: the group of itself alone, on which its set-up's collectives run, and
    the checkpoint the members handed it. Between its admission and its first step Lightning restores that
    checkpoint and starts the loop, whose collectives the members ran long ago: they run alone too, the strategy's
    groups held aside until then (:meth:`hold`, :meth:`release`)."""

    def __init__(self, rank: int, timeout: Any) -> None:
        self.group = _group_of_one(rank, timeout, "newcomer")
        self.checkpoint: dict[str, Any] | None = None
        #: the members' loaders (:func:`~lightning_dp._lightning_compat.loaders_state`), from the handover
        self.loaders: dict[str, Any] | None = None
        self._held: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, Any] | None = None

    def hold(self, strategy: DataParallelStrategy) -> None:
        """Set the members' groups and exchange aside: the strategy's collectives and a callback's measurement of the
        link run alone, over a ring of itself (whatever the scheme: nothing is exchanged before the first step)."""
        self._held = (strategy.gradient_group, strategy._control_group, strategy.transport)
        strategy.gradient_group = strategy._control_group = self.group
        if strategy.reducer is not None:
            strategy.transport = RingTransport(self.group, strategy.sync_stats)
            strategy.transport.bind(strategy.reducer.buckets)

    def release(self, strategy: DataParallelStrategy) -> None:
        """The strategy's collectives and exchanges run over the members again."""
        if self._held is not None:
            if strategy.transport is not None and strategy.transport is not self._held[2]:
                strategy.transport.close()
            strategy.gradient_group, strategy._control_group, strategy.transport = self._held
            self._held = None


class MembersGather:
    """A torchmetrics metric's ``dist_sync_fn``: ``gather_all_tensors`` over the ranks training now, as a sync point
    of the strategy's. It holds the strategy weakly; a copy of the metric shares it, a pickled one syncs as
    torchmetrics does by default (``None``)."""

    def __init__(self, strategy: DataParallelStrategy) -> None:
        self._strategy = weakref.ref(strategy)

    def __call__(self, result: Tensor, group: Any = None) -> list[Tensor]:
        strategy = self._strategy()
        if group is not None or strategy is None:
            return gather_all_tensors(result, group)
        return strategy.rank_loss.collective(
            cast("ProcessGroupStrategy", strategy),
            lambda g: gather_all_tensors(result, g if g is not None else dist.group.WORLD),
        )

    def __deepcopy__(self, memo: dict) -> MembersGather:
        return self

    def __reduce__(self) -> tuple[Any, tuple]:
        return type(None), ()


def make_rank_loss(
    on_rank_loss: Any, heartbeat_timeout: Any, max_lost_ranks: Any, max_ranks: Any = None
) -> StopOnRankLoss:
    """The object of the ``on_rank_loss`` mode, its options checked."""
    check_choice("on_rank_loss", on_rank_loss, ON_RANK_LOSS)
    heartbeat = check_positive("heartbeat_timeout", heartbeat_timeout)
    max_lost = None if max_lost_ranks is None else check_count("max_lost_ranks", max_lost_ranks, 0)
    most = None if max_ranks is None else check_count("max_ranks", max_ranks, 1)
    if most is not None and most > MAX_JOIN_RANK + 1:
        raise ConfigurationError(f"max_ranks must be at most {MAX_JOIN_RANK + 1}, got {max_ranks!r}")
    if on_rank_loss == "stop":
        for option, value in (("max_lost_ranks", max_lost_ranks), ("max_ranks", max_ranks)):
            if value is not None:
                raise ConfigurationError(f"{option} applies to on_rank_loss='continue'; it is set with 'stop'")
        return StopOnRankLoss()
    return ContinueOnRankLoss(heartbeat, max_lost, most)


#: the membership of each job this process takes part in, kept from one stage (fit, validate, test) to the next
_live: dict[str, Membership] = {}
_leaving_registered: list[bool] = []


def _keep_live(job: str, membership: Membership) -> None:
    """``membership`` is this process's for ``job``; one of an earlier job (a Hydra sweep's) leaves, finished."""
    if not _leaving_registered:
        atexit.register(_leave_all)
        _leaving_registered.append(True)
    for earlier in [key for key in _live if key != job]:
        _live.pop(earlier).close(farewell=True)
    _live[job] = membership


def _drop_live(membership: Membership) -> None:
    for job in [job for job, live in _live.items() if live is membership]:
        del _live[job]


def _leave_all() -> None:
    """The process exits: every membership leaves, saying goodbye (the others see this rank finish) unless the
    process ends with an uncaught error (then they see it lost)."""
    crashed = getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    for membership in list(_live.values()):
        membership.close(farewell=not crashed)
    _live.clear()


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
