"""The staleness protocol's messages, the learning-rate scaling of an arriving gradient, and a push's layout."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.servers.sharded_optimizer import Segment


class Request(IntEnum):
    """A message's kind, worker to server; ``LOST`` is a receiving thread's note that its worker is gone. With backup
    workers, ``SKIP`` asks for the weights after a step closed without this worker, and ``DECIDED`` is the
    coordinating server's word on which workers a step aggregates."""

    PUSH = 1
    FLUSH = 2
    BYE = 3
    ABORT = 4
    LOST = 5
    SKIP = 6
    DECIDED = 7


class Reply(IntEnum):
    """A reply's status, server to worker."""

    OK = 0
    FAILED = 1


class StopReason(IntEnum):
    """Why a run stops, carried by ``ABORT`` requests and ``FAILED`` replies."""

    LOST = 1
    NONFINITE = 2
    ERROR = 3
    TERMINATED = 4


_REASONS: dict[int, str] = {
    StopReason.LOST: "is unreachable (it died or its link is down)",
    StopReason.NONFINITE: "pushed a non-finite (NaN or infinite) gradient",
    StopReason.ERROR: "stopped with an error",
    StopReason.TERMINATED: "was asked to terminate (SIGTERM)",
}
#: ``[kind, clock, optimizer index, reason]`` and ``[status, staleness, culprit rank, reason]``
HEADER_LEN = 4

#: optimizers whose step is normalized by a running average of the squared gradient (see :func:`arrival_lr_scale`)
ADAPTIVE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Adafactor")
    if hasattr(torch.optim, name)
)


def arrival_lr_scale(optimizer: torch.optim.Optimizer, num_workers: int) -> float:
    """The factor on ``optimizer``'s learning rate for one worker's gradient applied alone among ``num_workers``:
    ``1 / sqrt(N)`` for :data:`ADAPTIVE_OPTIMIZERS`, ``1 / N`` otherwise (see the module docstring)."""
    if isinstance(optimizer, ADAPTIVE_OPTIMIZERS):
        return 1.0 / math.sqrt(num_workers)
    return 1.0 / num_workers


def arrival_scale(optimizer: torch.optim.Optimizer, num_workers: int) -> dict[str, float]:
    """Factors on ``optimizer``'s hyperparameters for one arriving gradient: the learning rate's
    (:func:`arrival_lr_scale`), and for decoupled weight decay (``lr * weight_decay`` per step: AdamW's, Adafactor's,
    Adam's with ``decoupled_weight_decay=True``) the one that
    makes ``N`` arrivals decay the weights by ``lr * weight_decay``, as one synchronous step."""
    lr = arrival_lr_scale(optimizer, num_workers)
    scale = {"lr": lr}
    decoupled_classes = tuple(getattr(torch.optim, n) for n in ("AdamW", "Adafactor") if hasattr(torch.optim, n))
    groups = [optimizer.defaults, *optimizer.param_groups]
    decoupled = isinstance(optimizer, decoupled_classes) or any(g.get("decoupled_weight_decay", False) for g in groups)
    if decoupled:
        scale["weight_decay"] = 1.0 / (num_workers * lr)
    return scale


def check_staleness(value: object) -> int | None:
    """``None`` (asynchronous) or an integer >= 0; raises ``ValueError`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"staleness must be an integer >= 0 or None (asynchronous), got {value!r}")
    return value


@dataclass
class StalenessRecord:
    """The staleness a worker saw at each of its steps: how many steps the slowest worker's updates in its weights
    lagged behind its own clock."""

    histogram: Counter[int] = field(default_factory=Counter)

    def add(self, staleness: int) -> None:
        self.histogram[staleness] += 1

    @property
    def max(self) -> int:
        return max(self.histogram, default=0)

    @property
    def steps(self) -> int:
        return sum(self.histogram.values())

    def mean(self) -> float:
        return sum(k * n for k, n in self.histogram.items()) / self.steps if self.steps else 0.0


class PushLayout:
    """Where server ``s``'s share lies in the buckets (``segments[b][s]``) and how its messages are laid out."""

    def __init__(self, buckets: Sequence[GradientBucket], segments: Sequence[Sequence[Segment]], size: int) -> None:
        self.buckets = list(buckets)
        self.segments = segments
        self.numel = [sum(end - start for start, end in (segments[b.index][s] for b in buckets)) for s in range(size)]
        #: the servers: ranks that serve any element
        self.servers = [s for s in range(size) if self.numel[s] > 0]
        self.flag_base: list[int] = []
        base = 0
        for bucket in self.buckets:
            self.flag_base.append(base)
            base += len(bucket.params)
        self.num_flags = base
        self.dtype = self.buckets[0].buffer.dtype if self.buckets else torch.float32

    def message_numel(self, server: int) -> int:
        return self.numel[server] + self.num_flags

    def gradients_for(self, server: int) -> Tensor:
        """Server ``server``'s message from the buckets' current contents (gradients and flags)."""
        parts = [b.buffer[slice(*self.segments[b.index][server])] for b in self.buckets]
        return torch.cat(parts + [b.flags for b in self.buckets])

    def write_weights(self, server: int, weights: Tensor) -> None:
        """Put server ``server``'s share of the weights (``weights``, laid out as its storage) into the parameters."""
        offset = 0
        for bucket in self.buckets:
            start, end = self.segments[bucket.index][server]
            if end > start:
                bucket.write_params(start, end, weights[offset : offset + end - start])
                offset += end - start

    def flag_index(self, bucket: GradientBucket, index_in_bucket: int, server: int) -> int:
        """Where a parameter's used-flag lies in a message to ``server``."""
        return self.numel[server] + self.flag_base[bucket.index] + index_in_bucket


@dataclass(eq=False)
class _Request:
    worker: int
    kind: int
    clock: int
    optimizer_index: int = 0
    reason: int = 0
    payload: Tensor | None = None


def _describe(culprit: int, reason: int) -> str:
    return f"rank {culprit} {_REASONS.get(reason, 'stopped')}"
