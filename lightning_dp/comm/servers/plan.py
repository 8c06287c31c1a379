"""What trainer 0 tells the dedicated servers at set-up (the plan) and in each control message."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor

from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.servers.sharded_optimizer import (
    Segment,
    hyperparameters,
)


class Control(IntEnum):
    """What trainer 0 tells every server (a control message's kind)."""

    STEP = 1
    PULL = 2
    SET_WEIGHTS = 3
    STATE = 4
    LOAD = 5
    STOP = 6
    ABORT = 7
    #: a synchronization starts: every trainer pushes its gradients, every server acknowledges once it summed them
    #: (``on_rank_loss="continue"``)
    SYNC = 8
    #: every server sends every trainer its shares' squared norm and NaN/inf flag for an optimizer
    #: (``on_rank_loss="continue"``)
    VOTE = 9


@dataclass
class OptimizerSpec:
    """How to rebuild one user optimizer on a server: its class (imported there by name), defaults and groups."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    #: per parameter group: the indices of its parameters in :attr:`ServerPlan.shapes`, and its hyperparameters
    groups: list[tuple[list[int], dict[str, Any]]]


@dataclass
class ServerPlan:
    """What trainer 0 tells every server at set-up (through the store)."""

    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    #: indices into :attr:`shapes` of each bucket's parameters, in bucket order
    buckets: list[list[int]]
    #: ``[b][m]`` as :func:`member_segments`
    segments: list[list[Segment]]
    optimizers: list[OptimizerSpec]
    #: whether the trainers' hooks read gradients: servers then send the averaged gradients back during backward
    #: and step with the edited gradients trainer 0 sends
    full_gradients: bool
    owner: str = "dedicated server"
    extra: dict[str, Any] = field(default_factory=dict)


def check_importable(cls: type, owner: str) -> None:
    """Servers import the optimizer class by name: refuse one they cannot find (defined in ``__main__``, local)."""
    module, name = cls.__module__, cls.__qualname__
    found: Any = None
    if module != "__main__" and "<locals>" not in name:
        try:
            found = importlib.import_module(module)
            for part in name.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
    if found is not cls:
        raise ConfigurationError(
            f"{owner}: the optimizer class {name} (module {module}) cannot be imported by the server processes, which "
            "rebuild it by name: define it in an importable module (not in the script run as __main__)"
        )


def optimizer_spec(optimizer: torch.optim.Optimizer, index_of: dict[int, int]) -> OptimizerSpec:
    groups = [([index_of[id(p)] for p in g["params"]], hyperparameters(g)) for g in optimizer.param_groups]
    return OptimizerSpec(type(optimizer), dict(optimizer.defaults), groups)


def buckets_of(plan_groups: Sequence[tuple[list[int], dict[str, Any]]], buckets: Sequence[Sequence[int]]) -> list[int]:
    """The buckets holding any parameter of an optimizer whose groups are ``plan_groups``."""
    ids = {i for indices, _ in plan_groups for i in indices}
    return [b for b, params in enumerate(buckets) if any(i in ids for i in params)]


def _header(kind: int, optimizer_index: int = 0, syncs: int = 0) -> Tensor:
    return torch.tensor([kind, optimizer_index, syncs], dtype=torch.int64)
