"""The ``balance`` option: how a strategy splits the global batch among its ranks, one object per mode.

- :class:`EqualBatches` (``balance="none"``): every rank trains the batches Lightning's ``DistributedSampler`` gives
  it, as under ``ddp``.
- :class:`ThroughputBatches` (``balance="throughput"``): the training loader's batches come from a
  :class:`~lightning_dp.comm.balance.BalancedBatchSampler`, each rank's share of the global batch following its
  measured speed (:mod:`lightning_dp.comm.balance`), and each rank's loss is weighted by ``N n_r / B`` for backward,
  so the averaged gradients are those of the whole global batch.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lightning_dp._lightning_compat import _parse_num_batches
from lightning_dp.comm.balance import (
    BalancedBatchSampler,
    BatchKey,
    ThroughputBalancer,
    gather_measurements,
    gradient_weight,
)
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.strategies.options import check_count, check_positive
from lightning_dp.strategies.resume import _silence_not_resumable, batches_already_trained

#: values of the ``balance`` option
BALANCE = ("none", "throughput")
#: where a full checkpoint keeps the schedule of shares
CHECKPOINT_KEY = "lightning_dp_batch_shares"
#: the entry of a checkpoint written after a loss of ranks: its global batch and the ranks that order each epoch
KEPT_KEY = "kept_global_batch"


class UnsupportedLoaderError(ConfigurationError):
    """The training loader is not one whose batches the balanced sampler can draw."""


class EqualBatches:
    """``balance="none"``: the batches are Lightning's, every rank's gradient counts alike."""

    name = "none"

    def training_loader(self, trainer: pl.Trainer, dataloader: Any) -> Any | None:
        """The training loader to use instead of ``dataloader`` (``None``: keep it)."""
        return None

    def reset(self) -> None:
        """A fit starts: nothing of an earlier one carries over (a checkpoint's state is loaded after this)."""

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """A training batch starts (every rank at the same batch)."""

    def forward_started(self) -> None:
        """The training step's own computation starts (after the strategy's collectives before it)."""

    def backward_done(self) -> None:
        """A backward's computation has ended (before the wait for the gradient exchange)."""

    def weighted(self, loss: Tensor) -> Tensor:
        """The loss whose gradients this rank contributes for the current batch."""
        return loss

    def exchange_committed(self) -> None:
        """The gradient exchange of the batch being trained was committed (``on_rank_loss="continue"``)."""

    def exclude(self, lost: list[int]) -> int:
        """Deal the ``lost`` ranks' shares among the ranks that train now (collective over them, after a loss, every
        member having committed the same exchanges); returns how many samples of the batch in flight no one
        trains."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a lost rank's share")

    def reweigh_in_flight(self) -> float:
        """After a loss: the factor that turns the gradient of the batch in flight into its weight among the ranks
        that train now."""
        return 1.0

    def boundary_row(self) -> list[int]:
        """What this rank contributes, at a step boundary, to choosing where a new member's shares start."""
        return [-1, -1, 0]

    def include(self, joined: list[int], rows: list[list[int]], accumulate: int, after: BatchKey) -> BatchKey:
        """Deal shares to the ``joined`` ranks from the first batch that no member's loader drew (``rows``: every
        member's :meth:`boundary_row`), comes after batch ``after`` and starts an optimizer step (``accumulate``
        batches each); returns it."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a share to a new member")

    def keep_included(self, joined: list[int], start: BatchKey) -> None:
        """After a loss dealt the shares again: deal ``joined`` (new processes still to be admitted) theirs from batch
        ``start`` again, if that deal dropped them (every member alike)."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a share to a new member")

    def withdraw(self, ranks: list[int], rows: list[list[int]]) -> None:
        """Take back the shares dealt to ``ranks`` (new processes that will not join now), from the first batch no
        member's loader drew (``rows``); their samples of batches drawn before are counted as dropped. Every member
        calls it with the same arguments, whether it had dealt them shares or not."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a share to a new member")

    def let_go(self, leaving: list[int], rows: list[list[int]], accumulate: int, after: BatchKey) -> BatchKey:
        """Deal the shares of the ``leaving`` members among the others from the first batch that no member's loader
        drew (``rows``), comes after batch ``after`` and starts an optimizer step; returns it (they train every batch
        before it, and leave at the step boundary before it)."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a leaving member's share")

    def keep_excluded(self, leaving: list[int], start: BatchKey) -> None:
        """After a loss dealt the shares again: keep ``leaving`` (members still to leave) without a share from batch
        ``start`` on, if that deal gave them one again (every member alike)."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a leaving member's share")

    def reinstate(self, ranks: list[int], rows: list[list[int]]) -> None:
        """Give back the shares :meth:`let_go` took from ``ranks`` (members that will not leave now), from the first
        batch no member's loader drew (``rows``). Every member calls it with the same arguments, whether it had taken
        them or not."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a leaving member's share")

    def admitted(self) -> None:
        """New members were admitted at this step boundary (every member, after the handover, whether they stayed or
        were lost before it)."""

    def join_state(self) -> dict:
        """What a new member needs to deal the batches as the members do (handed over with the job's state)."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a share to a new member")

    def take_join_state(self, state: dict) -> None:
        """A new member's: deal the batches as :meth:`join_state`'s members did."""
        raise NotImplementedError(f"balance={self.name!r} cannot deal a share to a new member")

    def state_dict(self) -> dict | None:
        """What a full checkpoint keeps (``None``: nothing)."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """Take what a checkpoint kept."""
        _refuse_to_keep(state, self.name)


class ThroughputBatches(EqualBatches):
    """``balance="throughput"``: shares of the global batch by measured speed (see the module docstring).

    ``strategy``: the strategy whose ranks, gradient group and step timings this uses; ``interval``: batches
    measured per decision; ``tolerance``: the shortening of the step below which the shares stay."""

    name = "throughput"

    def __init__(self, strategy: Any, interval: int, tolerance: float) -> None:
        self.strategy = strategy
        self.interval = interval
        self.tolerance = tolerance
        self.balancer: ThroughputBalancer | None = None
        self._saved: dict | None = None
        #: the batch being trained, when its training step started, and the seconds from then to the end of its
        #: last backward
        self._batch: tuple[int, int] | None = None
        self._forward_start = 0.0
        self._computed: float | None = None
        #: ``N n_r / B`` of the batch being trained
        self._weight = 1.0

    def reset(self) -> None:
        self.balancer, self._saved, self._batch, self._computed, self._weight = None, None, None, None, 1.0

    def training_loader(self, trainer: pl.Trainer, dataloader: Any) -> Any | None:
        if trainer.state.stage != RunningStage.TRAINING:
            return None
        sampler = getattr(dataloader, "sampler", None)
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        if (
            type(dataloader) is not DataLoader
            or isinstance(dataloader.dataset, IterableDataset)
            or type(sampler) is not DistributedSampler
            or type(batch_sampler) is not BatchSampler
        ):
            raise UnsupportedLoaderError(
                f"balance='throughput' resizes each rank's batches through the training loader's sampler, which needs "
                "a plain torch DataLoader over a map-style dataset with Lightning's DistributedSampler "
                "(Trainer(use_distributed_sampler=True), no sampler or batch_sampler of your own); got "
                f"{type(dataloader).__name__} with sampler {type(sampler).__name__} and batch sampler "
                f"{type(batch_sampler).__name__}. Use balance='none' with this loader."
            )
        assert isinstance(sampler, DistributedSampler) and isinstance(batch_sampler, BatchSampler)
        strategy = self.strategy
        global_batch, order_ranks = self._global_batch(batch_sampler.batch_size)
        # a loader draws up to workers x prefetch_factor batches ahead, and Lightning's fetcher one more
        ahead = dataloader.num_workers * (dataloader.prefetch_factor or 0) if dataloader.num_workers else 0
        if self._places() > global_batch:
            raise ConfigurationError(
                f"max_ranks={self._places()} cannot be dealt the global batch of {global_batch} samples (each rank "
                "trains at least one): lower max_ranks or raise the batch size"
            )
        if self.balancer is None or self.balancer.global_batch != global_batch:
            self.balancer = ThroughputBalancer(self._places(), global_batch, self.interval, self.tolerance,
                                               lag=ahead + 2, starting=self._started_ranks())  # fmt: skip
            if self._saved is not None:
                try:
                    self.balancer.load_state_dict(self._saved)
                except ValueError as error:
                    raise ConfigurationError(f"balance='throughput' cannot resume: {error}") from None
                self._saved = None
        self.balancer.lag = ahead + 2
        balanced = BalancedBatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last, self.balancer,
                                        strategy.global_rank, skip_epoch=trainer.current_epoch,
                                        global_batch=global_batch, order_ranks=order_ranks)  # fmt: skip
        done = batches_already_trained(trainer)
        if done >= _parse_num_batches(RunningStage.TRAINING, len(balanced), trainer.limit_train_batches):
            done = 0  # the epoch was complete: the next one starts from its beginning
        balanced.skip = done
        self.balancer.batches_per_epoch = len(balanced)
        balanced.set_epoch(trainer.current_epoch)
        if done:
            _silence_not_resumable()
            rank_zero_info(f"resuming mid-epoch: the balanced sampler skips the {done} batches already trained")
        return _with_batch_sampler(dataloader, balanced)

    def _global_batch(self, batch_size: int) -> tuple[int, int]:
        """The samples of a global batch, and the ranks whose ``DistributedSampler`` pads each epoch's order: those
        the run started with."""
        return batch_size * self._started_ranks(), self._started_ranks()

    def _started_ranks(self) -> int:
        """The ranks the job started with (the shares are theirs; a lost rank's is 0)."""
        membership = self.strategy.rank_loss.membership
        return len(membership.original) if membership is not None else self.strategy.world_size

    def _places(self) -> int:
        """The ranks the job may have: those it started with, and those it may grow by (``max_ranks``)."""
        membership = self.strategy.rank_loss.membership
        return membership.places if membership is not None else self.strategy.world_size

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        balancer = self.balancer
        if balancer is None:
            return
        key = (trainer.current_epoch, batch_idx)
        strategy = self.strategy
        if self._batch is not None and self._computed is not None:
            drawn = balancer.take_drawn(self._batch)
            if drawn is not None:
                balancer.record(self._computed, drawn[0])
        if balancer.window_full:
            measurements = gather_measurements(balancer.measurement(), strategy.control_group, strategy.root_device)
            decision = balancer.decide(measurements, key)
            if decision is not None:
                rank_zero_info(
                    f"balance='throughput': from batch {decision.start[1]} of epoch {decision.start[0]} the ranks "
                    f"train {list(decision.shares)} samples of each global batch of {balancer.global_batch}"
                )
        current = balancer.drawn.get(key)
        if current is None and len(set(balancer.shares_at(key))) > 1:
            raise RuntimeError(
                f"balance='throughput': batch {batch_idx} of epoch {key[0]} is not one this rank's balanced sampler "
                "drew, so its share of the global batch (and its gradient's weight) is unknown: the training loop "
                "does not take its batches from the loader the strategy set up (a training_step taking "
                "dataloader_iter, several training loaders). Use balance='none' here."
            )
        self._weight = gradient_weight(strategy.world_size, *current) if current is not None else 1.0
        self._batch, self._computed = key, None

    def forward_started(self) -> None:
        self._synchronize()
        self._forward_start = time.perf_counter()

    def backward_done(self) -> None:
        self._synchronize()
        self._computed = time.perf_counter() - self._forward_start

    def _synchronize(self) -> None:
        """On a GPU the clock must wait for the kernels, not their launches."""
        device = self.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def weighted(self, loss: Tensor) -> Tensor:
        return loss if self._weight == 1.0 else loss * self._weight

    def state_dict(self) -> dict | None:
        return self.balancer.state_dict() if self.balancer is not None else self._saved

    def load_state_dict(self, state: dict | None) -> None:
        if state is None or _refuse_to_keep(state, self.name):
            return
        self._saved = state
        if self.balancer is not None:
            self.balancer.load_state_dict(state)
            self._saved = None


class DealtBatches(ThroughputBatches):
    """``balance="none"`` with ``on_rank_loss="continue"``: equal shares of each global batch, drawn by the balanced
    sampler (exactly the batches of ``DistributedSampler``), so that a lost rank's share can be dealt among the
    survivors (:meth:`exclude`) and each survivor's gradient weighed for the samples of its step
    (``M n_r / sum of the survivors' n``, ``M`` the ranks training now)."""

    name = "none"

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy, interval=1, tolerance=1.0)
        #: ``(first, end, lost)``: the batches drawn before the survivors' shares start, whose ``lost`` shares no one
        #: trains (counted as each is trained), and the keys counted already
        self._dropping: tuple[BatchKey, BatchKey, list[int]] | None = None
        self._counted: set[BatchKey] = set()
        self.dropped = 0
        self._committed_key: BatchKey = (-1, -1)
        #: ranks lost before the training loader (and its balancer) existed, and the batch their shares end at
        self._lost_early: list[tuple[list[int], BatchKey]] = []
        #: ``(global batch, order ranks)`` kept from a checkpoint written after a loss (``None``: Lightning's)
        self._kept: tuple[int, int] | None = None
        #: a new member's: the members' schedule of shares was handed over (the training loader takes it as it is)
        self._joined = False
        #: a new member's: the members' ``(global batch, order ranks)`` (its own loader's batch size, for a world it
        #: grew into, may differ)
        self._handed: tuple[int, int] | None = None

    def reset(self) -> None:
        super().reset()
        self._dropping, self._counted, self.dropped, self._committed_key = None, set(), 0, (-1, -1)
        self._lost_early, self._kept, self._joined, self._handed = [], None, False, None

    def _global_batch(self, batch_size: int) -> tuple[int, int]:
        if self._handed is not None:
            return self._handed
        if self._kept is None:
            return super()._global_batch(batch_size)
        global_batch, order_ranks = self._kept
        if global_batch < self._started_ranks():
            raise ConfigurationError(
                f"on_rank_loss='continue': the checkpoint's global batch of {global_batch} samples cannot be dealt "
                f"over the {self._started_ranks()} ranks of this run (each needs one)"
            )
        return global_batch, order_ranks

    def state_dict(self) -> dict | None:
        """Once the ranks training are not those the job started with (a loss, ranks it grew by; or in a run that
        resumed such a job): the global batch and the ranks that order each epoch, so that a resumed run trains the
        same global batches on any number of ranks; else nothing (a resumed run's global batch is its batch size
        times its ranks, as under ``ddp``)."""
        balancer = self.balancer
        if balancer is None:
            return {KEPT_KEY: list(self._kept)} if self._kept is not None else None
        training = [r for r, share in enumerate(balancer.shares) if share]
        if self._kept is None and training == list(range(self._started_ranks())):
            return None
        return {KEPT_KEY: list(self._kept or (balancer.global_batch, self._started_ranks()))}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None or KEPT_KEY not in state:  # (shares of balance='throughput': this run's are equal)
            return
        global_batch, order_ranks = (int(n) for n in state[KEPT_KEY])
        self._kept = (global_batch, order_ranks)
        self.balancer = None  # made again for this global batch by the training loader
        rank_zero_info(
            f"on_rank_loss='continue': the checkpoint was written after a loss of ranks; the resumed run keeps its "
            f"global batch of {global_batch} samples, dealt over the ranks that train now"
        )

    def training_loader(self, trainer: pl.Trainer, dataloader: Any) -> Any | None:
        if trainer.state.stage != RunningStage.TRAINING:
            return None
        try:
            fresh = self.balancer is None
            loader = super().training_loader(trainer, dataloader)
            membership = self.strategy.rank_loss.membership
            if fresh and self.balancer is not None and membership is not None and not self._joined:
                # ranks an earlier stage of the job lost (a fit after a fit that lost them): no share from the start
                gone = sorted(set(membership.original) - set(membership.members))
                if gone:
                    self.balancer.exclude(gone, (-1, 0))
                grown = sorted(set(membership.members) - set(membership.original))  # (the ranks it grew by)
                if grown:
                    self.balancer.include(grown, (-1, 0))
            if self.balancer is not None:
                for lost, start in self._lost_early:  # (the new sampler has drawn nothing yet)
                    self.balancer.exclude(lost, start)
                self._lost_early = []
            return loader
        except UnsupportedLoaderError:
            raise ConfigurationError(
                "on_rank_loss='continue' deals a lost rank's share of each global batch among the survivors through "
                "the training loader's sampler, which needs a plain torch DataLoader over a map-style dataset with "
                "Lightning's DistributedSampler (Trainer(use_distributed_sampler=True), no sampler or batch_sampler of "
                f"your own); got {type(dataloader).__name__} with sampler "
                f"{type(getattr(dataloader, 'sampler', None)).__name__}"
            ) from None

    def _members(self) -> list[int]:
        membership = self.strategy.rank_loss.membership
        return list(membership.members) if membership is not None else list(range(self.strategy.world_size))

    def _weight_at(self, key: BatchKey, mine: int, batch_samples: int) -> float:
        """``M n_r / (the samples of the ranks training now)`` of the batch at ``key``."""
        assert self.balancer is not None
        members = self._members()
        sizes = self.balancer.sizes(key, batch_samples)
        return len(members) * mine / sum(sizes[r] for r in members)

    def _count_dropped(self, key: BatchKey) -> int:
        """The lost ranks' samples of the batch at ``key``, if it lies where no one trains them (once per key)."""
        if self._dropping is None or self.balancer is None or key in self._counted:
            return 0
        first, end, lost = self._dropping
        drawn = self.balancer.drawn.get(key)
        if not first <= key < end or drawn is None:
            return 0
        self._counted.add(key)
        sizes = self.balancer.sizes(key, drawn[1])
        return sum(sizes[r] for r in lost)

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        balancer = self.balancer
        if balancer is None:
            return
        key = (trainer.current_epoch, batch_idx)
        current = balancer.drawn.get(key)
        if current is None:
            raise RuntimeError(
                f"on_rank_loss='continue': batch {batch_idx} of epoch {key[0]} is not one this rank's balanced sampler "
                "drew, so its share of the global batch is unknown: the training loop does not take its batches from "
                "the loader the strategy set up (a training_step taking dataloader_iter, several training loaders)"
            )
        self.dropped += self._count_dropped(key)
        self._weight = self._weight_at(key, *current)
        self._batch, self._computed = key, None

    def forward_started(self) -> None:
        pass

    def backward_done(self) -> None:
        pass

    def reweigh_in_flight(self) -> float:
        if self._batch is None or self.balancer is None:
            return 1.0
        current = self.balancer.drawn.get(self._batch)
        if current is None:
            return 1.0
        weight = self._weight_at(self._batch, *current)
        factor, self._weight = weight / self._weight, weight
        return factor

    def exchange_committed(self) -> None:
        self._committed_key = self._batch if self._batch is not None else (-1, -1)
        if self.balancer is not None:  # the batches up to here trained: their shares are no longer needed
            self.balancer.take_drawn(self._committed_key)

    def exclude(self, lost: list[int]) -> int:
        balancer = self.balancer
        strategy = self.strategy
        # the survivors' shares start after every member's latest drawn batch; the batches after the last one whose
        # exchange was committed, up to there, train without the lost ranks' samples. Collective on every member,
        # those without a training loader yet (it comes after a loss at set-up, or in the sanity check) included.
        if balancer is not None:
            mine = [*self._committed_key, *balancer.latest_drawn, balancer.batches_per_epoch or 0]
        else:
            mine = [-1, -1, -1, -1, 0]
        everyone = [torch.empty(5, dtype=torch.int64) for _ in range(dist.get_world_size(strategy.control_group))]
        dist.all_gather(everyone, torch.tensor(mine, dtype=torch.int64), group=strategy.control_group)
        rows = [t.tolist() for t in everyone]
        committed = max((r[0], r[1]) for r in rows)
        start = _first_undrawn([r[2:] for r in rows])
        if balancer is None:
            self._lost_early.append((list(lost), start))
            return 0
        balancer.exclude(lost, start)
        self._dropping = ((committed[0], committed[1] + 1), start, list(lost))
        # the batches of the exchange in flight trained so far (several where gradients accumulate)
        dropped = sum(self._count_dropped(key) for key in sorted(balancer.drawn) if self._batch and key <= self._batch)
        self.dropped += dropped
        return dropped

    def boundary_row(self) -> list[int]:
        balancer = self.balancer
        return [*balancer.latest_drawn, balancer.batches_per_epoch or 0] if balancer is not None else [-1, -1, 0]

    def include(self, joined: list[int], rows: list[list[int]], accumulate: int, after: BatchKey) -> BatchKey:
        assert self.balancer is not None  # (at a step boundary of the fit)
        start = self._planned_start(rows, accumulate, after)
        self.balancer.include(joined, start)
        return start

    def let_go(self, leaving: list[int], rows: list[list[int]], accumulate: int, after: BatchKey) -> BatchKey:
        assert self.balancer is not None  # (at a step boundary of the fit)
        start = self._planned_start(rows, accumulate, after)
        self.balancer.exclude(leaving, start)
        return start

    def _planned_start(self, rows: list[list[int]], accumulate: int, after: BatchKey) -> BatchKey:
        """Where a planned change of the members' shares starts: after every member's latest drawn batch, and after
        what any loader may draw before the next boundary (the batch the loop takes next, and as many as it
        prefetches), so that the members check at that boundary that each dealt the same shares before any batch with
        them is drawn; at an optimizer step's first batch."""
        assert self.balancer is not None
        per_epoch = max(r[2] for r in rows)
        epoch, index = max(_first_undrawn(rows), _advance(after, self.balancer.lag, per_epoch))
        index = -(-index // accumulate) * accumulate
        return (epoch + 1, 0) if per_epoch and index >= per_epoch else (epoch, index)

    def keep_excluded(self, leaving: list[int], start: BatchKey) -> None:
        balancer = self.balancer
        if balancer is not None and any(balancer.shares_at(start)[r] for r in leaving):
            balancer.exclude(leaving, start)

    def reinstate(self, ranks: list[int], rows: list[list[int]]) -> None:
        assert self.balancer is not None
        self.balancer.reinstate(ranks, _first_undrawn(rows))

    def keep_included(self, joined: list[int], start: BatchKey) -> None:
        balancer = self.balancer
        if balancer is not None and not all(balancer.shares_at(start)[r] for r in joined):
            balancer.include(joined, start)

    def withdraw(self, ranks: list[int], rows: list[list[int]]) -> None:
        balancer = self.balancer
        assert balancer is not None
        start = _first_undrawn(rows)
        first = balancer.withdraw(ranks, start)
        if first is not None and first < start:  # batches drawn with their shares: no one trains those samples
            self._dropping = (first, start, list(ranks))

    def join_state(self) -> dict:
        assert self.balancer is not None
        order = self._kept[1] if self._kept else self._started_ranks()
        return {"schedule": self.balancer.state_dict(), "kept": list(self._kept) if self._kept else None,
                "batch": [self.balancer.global_batch, order]}  # fmt: skip

    def take_join_state(self, state: dict) -> None:
        self.balancer = None
        self._saved = state["schedule"]
        self._kept = (int(state["kept"][0]), int(state["kept"][1])) if state["kept"] else None
        self._handed = (int(state["batch"][0]), int(state["batch"][1]))
        self._joined = True


def _first_undrawn(rows: list[list[int]]) -> BatchKey:
    """The first batch after every member's latest drawn one (``rows``: each member's ``[epoch, batch, batches per
    epoch]``)."""
    latest = max((r[0], r[1]) for r in rows)
    per_epoch = max(r[2] for r in rows)
    return (latest[0] + 1, 0) if per_epoch and latest[1] + 1 >= per_epoch else (latest[0], latest[1] + 1)


def _advance(key: BatchKey, batches: int, per_epoch: int) -> BatchKey:
    """The batch ``batches`` after ``key``, in the next epochs past ``per_epoch`` batches (0: unknown)."""
    epoch, index = key[0], key[1] + batches
    while per_epoch and index >= per_epoch:
        epoch, index = epoch + 1, index - per_epoch
    return epoch, index


class DealtThroughputBatches(DealtBatches):
    """``balance="throughput"`` with ``on_rank_loss="continue"``: shares by measured speed among the ranks that train
    now (:class:`ThroughputBatches`' measurement and decisions, the speeds gathered at a sync point of the
    membership), dealt as :class:`DealtBatches` deals them, a lost rank's share among the survivors."""

    name = "throughput"

    def __init__(self, strategy: Any, interval: int, tolerance: float) -> None:
        super().__init__(strategy)
        self.interval, self.tolerance = interval, tolerance
        #: this rank's samples of the batch being trained
        self._samples = 0
        #: whether a new process was dealt a share and is not admitted yet, or a leaving member's share was dealt away
        #: and it has not left: no measurement, no decision until then (a decision over the members as they are would
        #: undo the deal; a new member's window starts empty)
        self._planned = False

    forward_started = ThroughputBatches.forward_started
    backward_done = ThroughputBatches.backward_done

    def reset(self) -> None:
        super().reset()
        self._planned = False

    def include(self, joined: list[int], rows: list[list[int]], accumulate: int, after: BatchKey) -> BatchKey:
        self._planned = True
        return super().include(joined, rows, accumulate, after)

    def withdraw(self, ranks: list[int], rows: list[list[int]]) -> None:
        super().withdraw(ranks, rows)
        self.admitted()  # (every member alike, whether it had dealt them a share or not)

    def let_go(self, leaving: list[int], rows: list[list[int]], accumulate: int, after: BatchKey) -> BatchKey:
        self._planned = True
        return super().let_go(leaving, rows, accumulate, after)

    def reinstate(self, ranks: list[int], rows: list[list[int]]) -> None:
        super().reinstate(ranks, rows)
        self.admitted()

    def admitted(self) -> None:
        """Every member measures afresh from the admission, the leave or the withdrawal of either on, as a new one
        does."""
        self._planned, self._computed = False, None
        if self.balancer is not None:
            self.balancer.window = []

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        balancer, strategy = self.balancer, self.strategy
        if balancer is not None and self._batch is not None and self._computed is not None:
            if not self._planned:
                balancer.record(self._computed, self._samples)  # the batch before, on every member alike
            self._computed = None
        if balancer is not None and balancer.window_full:
            mine = balancer.measurement()
            measurements = strategy.rank_loss.collective(
                strategy, lambda group: gather_measurements(mine, group, strategy.root_device)
            )
            members = self._members()
            if len(measurements) != len(members):
                # taken from a member that completed the gather before a loss (its decision, for the ranks then,
                # starts after the batches the loss's deal starts at, and the deal removed it): no decision
                balancer.window = []
                decision = None
            else:
                decision = balancer.decide(measurements, (trainer.current_epoch, batch_idx), members)
            if decision is not None:
                rank_zero_info(
                    f"balance='throughput': from batch {decision.start[1]} of epoch {decision.start[0]} the ranks "
                    f"train {list(decision.shares)} samples of each global batch of {balancer.global_batch}"
                )
        super().on_train_batch_start(trainer, batch_idx)
        current = balancer.drawn.get((trainer.current_epoch, batch_idx)) if balancer is not None else None
        self._samples = current[0] if current is not None else 0

    def state_dict(self) -> dict | None:
        """The schedule of shares (as :class:`ThroughputBatches`); after a loss the kept global batch only, as
        :class:`DealtBatches` keeps it (a resumed run, on any number of ranks, deals it equally and measures again)."""
        kept = super().state_dict()
        if kept is not None:
            return kept
        return self.balancer.state_dict() if self.balancer is not None else self._saved

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        super().load_state_dict(state)
        shares = {k: v for k, v in state.items() if k != KEPT_KEY}
        if shares:
            ThroughputBatches.load_state_dict(self, shares)


def _refuse_to_keep(state: dict | None, balance: str) -> bool:
    """Whether ``state`` is the kept global batch of a job that lost ranks, which ``balance`` cannot keep (then
    say so: the resumed run's global batch is its batch size times its ranks)."""
    if state is None or KEPT_KEY not in state:
        return False
    rank_zero_warn(
        f"the checkpoint was written after a loss of ranks, with a global batch of {state[KEPT_KEY][0]} samples; "
        f"with balance={balance!r} and on_rank_loss='stop' this run's global batch is its batch size times its "
        "ranks instead. Resume with on_rank_loss='continue' (balance='none') to keep it."
    )
    return True


def make_batches(strategy: Any, balance: str, interval: Any, tolerance: Any, dealt: bool = False) -> EqualBatches:
    """The object of the ``balance`` mode (options checked by the caller: ``balance``; here the others); ``dealt``:
    equal shares drawn by the balanced sampler, to deal a lost rank's share (``on_rank_loss="continue"``)."""
    interval = check_count("balance_interval", interval, 1)
    tolerance = check_positive("balance_tolerance", tolerance)
    if balance == "throughput" and dealt:
        return DealtThroughputBatches(strategy, interval, tolerance)
    if balance == "throughput":
        return ThroughputBatches(strategy, interval, tolerance)
    if dealt:
        return DealtBatches(strategy)
    return EqualBatches()


def _with_batch_sampler(dataloader: DataLoader, batch_sampler: BalancedBatchSampler) -> DataLoader:
    """``dataloader``'s settings with ``batch_sampler`` drawing the batches."""
    kwargs: dict[str, Any] = {
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    if dataloader.num_workers:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    if hasattr(dataloader, "in_order"):
        kwargs["in_order"] = dataloader.in_order
    return DataLoader(dataloader.dataset, batch_sampler=batch_sampler, **kwargs)
