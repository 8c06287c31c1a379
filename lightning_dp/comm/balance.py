"""Throughput-balanced batches: each rank's share of a constant global batch follows its measured speed.

Under plain data parallelism every rank trains ``b`` samples per step, so a rank that stays slower (an older machine,
a noisy neighbour) makes every step wait for it. Here the global batch of ``B = N b`` samples is the same as the
data-parallel run's, but rank ``r`` trains ``n_r`` of them, ``sum n_r = B``, chosen so that every rank finishes its
share at about the same time. The update stays one global-batch step: rank ``r``'s gradient (the mean over its
``n_r`` samples) is weighted by ``N n_r / B`` before the ranks' gradients are averaged, so the average is the mean over
all ``B`` samples, as one process training the same global batch computes it (:func:`gradient_weight`).

- :func:`apportion`: whole shares of ``B`` proportional to speeds (largest remainder), each at least one sample.
- :func:`deal`: which rank trains which position of a global batch; equal shares give rank ``r`` the positions
  ``r, r + N, ...``, exactly the samples ``DistributedSampler`` and a ``BatchSampler`` of ``b`` give it.
- :class:`ThroughputBalancer`: the measurements and the schedule of shares. Every ``interval`` batches, each rank's
  seconds of its own computation (from the start of each training step to the end of its backward, before the wait
  for the gradient exchange; the median batch's seconds per sample) and samples are gathered, and every rank
  computes the same decision from them. Shares move a fraction ``gain`` of the way to the speeds' proportions, and
  only when that would shorten the step by more than ``tolerance`` and by more than 2 ms (equal speeds keep equal
  shares). A decision made at batch ``j`` applies from batch ``j + lag``: a loader may have drawn the batches before.
- :class:`BalancedBatchSampler`: the training loader's batch sampler, drawing each step's global batch as
  ``DistributedSampler`` orders the epoch, and this rank's part of it by the schedule.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

#: ``(epoch, batch index in the epoch)``: where a batch lies in training, ordered
BatchKey = tuple[int, int]
#: the shares change only if the step would get shorter by more than this too: below it, the ranks' timings differ by
#: the scheduler's and the timer's noise, not by their speeds
MIN_SAVING_SECONDS = 0.002


def apportion(total: int, weights: Sequence[float], minimum: int = 1) -> list[int]:
    """Whole numbers summing to ``total``, proportional to ``weights`` (largest remainder; ties to the lower index),
    each at least ``minimum``. Needs ``total >= minimum * len(weights)`` and positive weights."""
    n = len(weights)
    if n == 0 or total < minimum * n:
        raise ValueError(f"cannot give {n} ranks at least {minimum} of {total} each")
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"weights must be positive and finite, got {list(weights)}")
    spare = total - minimum * n
    scale = sum(weights)
    exact = [spare * w / scale for w in weights]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[: spare - sum(shares)]:
        shares[i] += 1
    return [minimum + s for s in shares]


def apportion_among(total: int, weights: Sequence[float], members: Sequence[int], minimum: int = 1) -> list[int]:
    """:func:`apportion` of ``total`` among the positions ``members`` of ``weights`` (by their weights); every other
    position gets 0 (a rank the job lost)."""
    shares = [0] * len(weights)
    for position, share in zip(members, apportion(total, [weights[m] for m in members], minimum)):
        shares[position] = share
    return shares


def deal(shares: Sequence[int]) -> list[int]:
    """The rank of each position of a global batch of ``sum(shares)`` samples: round robin over the ranks that still
    have room. Equal shares give rank ``r`` the positions ``r, r + N, r + 2N, ...``."""
    left = list(shares)
    owners: list[int] = []
    rank = 0
    n = len(left)
    for _ in range(sum(left)):
        while left[rank] == 0:
            rank = (rank + 1) % n
        owners.append(rank)
        left[rank] -= 1
        rank = (rank + 1) % n
    return owners


def gradient_weight(num_ranks: int, samples: int, batch_samples: int) -> float:
    """The factor on a rank's gradient (the mean over its ``samples``) that makes the ranks' average the mean over
    the ``batch_samples`` of the global batch: ``N n_r / B`` (exactly 1 with equal shares)."""
    return num_ranks * samples / batch_samples


@dataclass(frozen=True)
class Decision:
    """Shares of a full global batch, in force from batch ``start`` on."""

    start: BatchKey
    shares: tuple[int, ...]


@dataclass
class ThroughputBalancer:
    """The schedule of shares and this rank's measurements (see the module docstring). Every rank holds an equal
    schedule: decisions are computed from measurements gathered from every rank."""

    num_ranks: int
    global_batch: int
    interval: int = 5
    tolerance: float = 0.1
    gain: float = 0.5
    lag: int = 2
    decisions: list[Decision] = field(default_factory=list)
    #: this rank's ``(seconds, samples)`` of the batches measured since the last decision
    window: list[tuple[float, int]] = field(default_factory=list)
    #: ``(this rank's samples, the global batch's samples)`` of each batch drawn and not yet trained
    drawn: dict[BatchKey, tuple[int, int]] = field(default_factory=dict)
    #: the latest batch a loader has drawn
    latest_drawn: BatchKey = (-1, -1)
    #: batches per epoch (set by the training loader; 0: unknown)
    batches_per_epoch: int = 0
    #: the ranks that start with a share, the first of the ``num_ranks`` places (``None``: all of them); the places
    #: after them are for ranks a job may grow by (:meth:`include`)
    starting: int | None = None

    def __post_init__(self) -> None:
        starting = self.num_ranks if self.starting is None else self.starting
        if not 1 <= starting <= self.num_ranks:
            raise ValueError(f"{starting} starting ranks for {self.num_ranks} places")
        if self.global_batch < starting:
            raise ValueError(f"a global batch of {self.global_batch} samples cannot give each of {starting} ranks one")
        if not self.decisions:
            shares = apportion_among(self.global_batch, [1.0] * self.num_ranks, range(starting))
            self.decisions = [Decision((0, 0), tuple(shares))]

    def shares_at(self, key: BatchKey) -> tuple[int, ...]:
        """The shares of a full global batch at batch ``key``."""
        current = self.decisions[0].shares
        for decision in self.decisions:
            if decision.start <= key:
                current = decision.shares
        return current

    @property
    def shares(self) -> tuple[int, ...]:
        """The latest decision's shares."""
        return self.decisions[-1].shares

    def sizes(self, key: BatchKey, batch_samples: int) -> list[int]:
        """Every rank's samples of the global batch at ``key`` with ``batch_samples`` samples (fewer than the full
        batch at an epoch's end: the shares scaled down, equal shares staying equal)."""
        shares = self.shares_at(key)
        if batch_samples == sum(shares):
            return list(shares)
        return apportion_among(batch_samples, [float(s) for s in shares], [r for r, s in enumerate(shares) if s])

    def note_drawn(self, key: BatchKey, samples: int, batch_samples: int) -> None:
        self.drawn[key] = (samples, batch_samples)
        self.latest_drawn = max(self.latest_drawn, key)

    def take_drawn(self, key: BatchKey) -> tuple[int, int] | None:
        """``(this rank's samples, the global batch's)`` of the batch at ``key``, forgetting it and older ones."""
        found = self.drawn.get(key)
        for old in [k for k in self.drawn if k <= key]:
            del self.drawn[old]
        return found

    def record(self, seconds: float, samples: int) -> None:
        """One measured batch of this rank: ``seconds`` of its own work on ``samples`` samples."""
        self.window.append((seconds, samples))

    @property
    def window_full(self) -> bool:
        return len(self.window) >= self.interval

    def measurement(self) -> tuple[float, float]:
        """This rank's ``(seconds, samples)`` over the window, the seconds at the median batch's seconds per sample
        (one batch slowed by something passing, a page fault or the scheduler, does not move the shares)."""
        samples = sum(n for _, n in self.window)
        return statistics.median(s / n for s, n in self.window) * samples, float(samples)

    def decide(
        self, measurements: Sequence[tuple[float, float]], at: BatchKey, members: Sequence[int] | None = None
    ) -> Decision | None:
        """From the ``(seconds, samples)`` over the window of every rank (rank order), or of each of ``members`` (the
        ranks that train now, the others' shares staying 0), the new shares, in force from ``at`` plus :attr:`lag`
        batches (``None``: the shares stay). Clears the window."""
        self.window = []
        ranks = list(range(self.num_ranks)) if members is None else list(members)
        if len(measurements) != len(ranks):
            raise ValueError(f"{len(measurements)} measurements for {len(ranks)} ranks")
        if any(seconds <= 0 or samples <= 0 for seconds, samples in measurements):
            return None
        speeds = [samples / seconds for seconds, samples in measurements]
        shares = [self.shares[r] for r in ranks]
        now = max(n / v for n, v in zip(shares, speeds))  # the step's time at the current shares
        best = self.global_batch / sum(speeds)  # every rank busy for the same time
        if now - best <= max(self.tolerance * best, MIN_SAVING_SECONDS):
            return None
        target = [self.global_batch * v / sum(speeds) for v in speeds]
        moved = [1.0] * self.num_ranks
        for r, n, t in zip(ranks, shares, target):
            moved[r] = n + self.gain * (t - n)
        new = tuple(apportion_among(self.global_batch, moved, ranks))
        if new == self.shares:
            return None
        start = (at[0], at[1] + self.lag)
        if start <= self.latest_drawn:
            raise RuntimeError(
                f"the training loader has drawn batch {self.latest_drawn[1]} of epoch {self.latest_drawn[0]} ahead of "
                f"batch {at[1]}, past the {self.lag} batches a change of shares waits: prefetching runs deeper than "
                "the balancer allows for"
            )
        decision = Decision(start, new)
        self.decisions.append(decision)
        return decision

    def exclude(self, lost: Sequence[int], start: BatchKey) -> Decision:
        """Deal the shares of the ``lost`` ranks among the others (in proportion to their shares) from batch
        ``start`` on, which no rank's loader may have drawn yet: the batches before keep their shares (the lost ranks'
        samples of them are not trained). Every rank calls it with the same arguments."""
        if start <= self.latest_drawn:
            raise RuntimeError(f"the shares cannot change from batch {start}: batch {self.latest_drawn} is drawn")
        shares = self.shares_at(start)  # (a later decision, dropped below, is not in force yet)
        members = [r for r in range(self.num_ranks) if r not in set(lost) and shares[r]]
        new = tuple(apportion_among(self.global_batch, [float(s) for s in shares], members))
        self.decisions = [d for d in self.decisions if d.start < start]
        decision = Decision(start, new)
        self.decisions.append(decision)
        self.window = []
        return decision

    def include(self, joined: Sequence[int], start: BatchKey) -> Decision:
        """Deal shares to the ``joined`` ranks (new processes in lost ranks' places, or in places after the starting
        ranks) from batch ``start`` on, which no rank's loader may have drawn yet: each joins with the mean share of
        the ranks training now, and the others keep their proportions. Every rank calls it with the same
        arguments."""
        if start <= self.latest_drawn:
            raise RuntimeError(f"the shares cannot change from batch {start}: batch {self.latest_drawn} is drawn")
        shares = self.shares
        training = [r for r in range(self.num_ranks) if shares[r]]
        mean = sum(shares) / len(training)
        weights = [float(s) if r not in joined else mean for r, s in enumerate(shares)]
        members = sorted({*training, *joined})
        new = tuple(apportion_among(self.global_batch, weights, members))
        self.decisions = [d for d in self.decisions if d.start < start]
        decision = Decision(start, new)
        self.decisions.append(decision)
        self.window = []
        return decision

    def withdraw(self, ranks: Sequence[int], start: BatchKey) -> BatchKey | None:
        """Take back the shares :meth:`include` dealt ``ranks`` (new processes that did not join), from batch
        ``start`` on, which no rank's loader may have drawn yet: the shares in force before they were dealt theirs
        apply again (not dealt anew: a rank that never dealt them any holds exactly those). Returns the batch their
        shares began at (``None``: they had none)."""
        if start <= self.latest_drawn:
            raise RuntimeError(f"the shares cannot change from batch {start}: batch {self.latest_drawn} is drawn")
        first: BatchKey | None = None
        before: tuple[int, ...] = self.decisions[0].shares
        previous: tuple[int, ...] | None = None
        for decision in self.decisions:
            given = any(decision.shares[r] for r in ranks)
            if given and (previous is None or not any(previous[r] for r in ranks)):
                first, before = decision.start, previous if previous is not None else decision.shares
            previous = decision.shares
        if first is None or previous is None or not any(previous[r] for r in ranks):
            return None
        self.decisions = [d for d in self.decisions if d.start < start]
        if self.shares_at(start) != before:
            self.decisions.append(Decision(start, before))
        self.window = []
        return first

    def reinstate(self, ranks: Sequence[int], start: BatchKey) -> None:
        """Give back the shares :meth:`exclude` took from ``ranks`` (members that did not leave), from batch ``start``
        on, which no rank's loader may have drawn yet: the shares in force before they were taken apply again (not
        dealt anew: a rank that never took them holds exactly those)."""
        if start <= self.latest_drawn:
            raise RuntimeError(f"the shares cannot change from batch {start}: batch {self.latest_drawn} is drawn")
        before: tuple[int, ...] | None = None
        previous: tuple[int, ...] | None = None
        for decision in self.decisions:
            if previous is not None and all(previous[r] for r in ranks) and not any(decision.shares[r] for r in ranks):
                before = previous
            previous = decision.shares
        if before is None or previous is None or any(previous[r] for r in ranks):
            return
        self.decisions = [d for d in self.decisions if d.start < start]
        if self.shares_at(start) != before:
            self.decisions.append(Decision(start, before))
        self.window = []

    def state_dict(self) -> dict:
        """The schedule (equal on every rank); the measurements of a window in progress are not kept."""
        return {
            "num_ranks": self.num_ranks,
            "starting": self.num_ranks if self.starting is None else self.starting,
            "global_batch": self.global_batch,
            "decisions": [[list(d.start), list(d.shares)] for d in self.decisions],
        }

    def load_state_dict(self, state: dict) -> None:
        saved = (int(state["num_ranks"]), int(state.get("starting", state["num_ranks"])), int(state["global_batch"]))
        mine = (self.num_ranks, self.num_ranks if self.starting is None else self.starting, self.global_batch)
        if saved != mine:
            raise ValueError(
                f"the saved shares are of {saved[1]} starting ranks ({saved[0]} places with max_ranks) and a global "
                f"batch of {saved[2]}, this run has {mine[1]} starting ranks ({mine[0]} places) and a global batch "
                f"of {mine[2]}"
            )
        self.decisions = [Decision((int(s[0]), int(s[1])), tuple(int(n) for n in shares))
                          for s, shares in state["decisions"]]  # fmt: skip
        self.window = []


def gather_measurements(
    measurement: tuple[float, float], group: dist.ProcessGroup | None, device: torch.device
) -> list[tuple[float, float]]:
    """Every rank's ``(seconds, samples)`` of ``group``, in rank order (collective)."""
    size = dist.get_world_size(group)
    mine = torch.tensor(measurement, dtype=torch.float64, device=device)
    everyone = torch.empty(size * 2, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    values = everyone.cpu().tolist()
    return [(values[2 * r], values[2 * r + 1]) for r in range(size)]


class BalancedBatchSampler(Sampler[list[int]]):
    """Rank ``rank``'s batches: each step's global batch is the next ``N b`` indices of the epoch as ``base`` (a
    ``DistributedSampler`` of ``N`` replicas) orders and pads it for all ranks together, and this rank's part is its
    positions by :func:`deal` over the balancer's shares at that batch. One epoch has as many batches as
    ``BatchSampler(base, b, drop_last)`` gives each rank; with equal shares they are exactly its batches. The epoch
    is ``base``'s.

    ``skip``: batches of epoch ``skip_epoch`` already trained (an exact mid-epoch resume); the first iteration
    starts after them if it is of that epoch. ``global_batch`` and ``order_ranks`` (a job resumed on another number
    of ranks, keeping its global batch and its epochs' order): global batches of ``global_batch`` indices instead of
    ``N b``, from the epoch as ``DistributedSampler`` pads it for ``order_ranks`` replicas instead of ``N``."""

    def __init__(
        self,
        base: DistributedSampler,
        batch_size: int,
        drop_last: bool,
        balancer: ThroughputBalancer,
        rank: int,
        skip: int = 0,
        skip_epoch: int = 0,
        global_batch: int | None = None,
        order_ranks: int | None = None,
    ) -> None:
        self.sampler = base
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.balancer = balancer
        self.rank = rank
        self.num_replicas = base.num_replicas
        self.skip = skip
        self.skip_epoch = skip_epoch
        self.global_batch = global_batch if global_batch is not None else batch_size * base.num_replicas
        self.order_ranks = order_ranks if order_ranks is not None else base.num_replicas

    @property
    def epoch(self) -> int:
        """The epoch of ``base`` (Lightning sets the epoch of a batch sampler's ``sampler``)."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _total_size(self) -> int:
        """The epoch's indices for all ranks: ``DistributedSampler``'s ``total_size`` with ``order_ranks``
        replicas."""
        size, ranks = len(self.sampler.dataset), self.order_ranks  # type: ignore[arg-type]
        if self.sampler.drop_last and size % ranks:
            return math.ceil((size - ranks) / ranks) * ranks
        return math.ceil(size / ranks) * ranks

    def __len__(self) -> int:
        total = self._total_size()
        return total // self.global_batch if self.drop_last else math.ceil(total / self.global_batch)

    def _epoch_order(self) -> list[int]:
        """The epoch's indices for every rank, in the order of the global batches: position ``i N + r`` holds rank
        ``r``'s ``i``-th index under ``DistributedSampler``. That is ``DistributedSampler``'s shuffled and padded
        list before it takes every ``N``-th index for a rank: its own iteration with one replica over the ``N``
        replicas' total."""
        whole = copy.copy(self.sampler)
        whole.num_replicas, whole.rank = 1, 0
        whole.num_samples = whole.total_size = self._total_size()
        whole.set_epoch(self.epoch)
        return list(whole)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._epoch_order()
        full = self.global_batch
        start = self.skip if self.epoch == self.skip_epoch else 0
        self.skip = 0  # the next iteration, this epoch again or a later one, is whole
        for j in range(start, len(self)):
            chunk = order[j * full : (j + 1) * full]
            key = (self.epoch, j)
            sizes = self.balancer.sizes(key, len(chunk))
            owners = deal(sizes)
            mine = [index for index, owner in zip(chunk, owners) if owner == self.rank]
            self.balancer.note_drawn(key, len(mine), len(chunk))
            yield mine
