"""Checks of strategy options: each bad value raises a ConfigurationError naming the option and what it allows."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch

from lightning_dp.comm.errors import ConfigurationError


def check_choice(option: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        raise ConfigurationError(
            f"{option}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}"
        )
    return value


def check_positive(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise ConfigurationError(f"{option} must be a positive number, finite, got {value!r}")
    return float(value)


def check_flag(option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{option} must be True or False, got {value!r}")
    return value


def check_rank(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ConfigurationError(f"{option} must be a rank in [0, world_size), got {value!r}")
    return int(value)


def check_timeout(value: timedelta | float | None, default: timedelta) -> timedelta:
    if value is None:
        return default
    if isinstance(value, timedelta):
        if value <= timedelta(0):
            raise ConfigurationError(f"timeout must be a positive duration, got {value.total_seconds():g} seconds")
        return value
    return timedelta(seconds=check_positive("timeout", value))


def check_count(option: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ConfigurationError(f"{option} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_backend_for_devices(backend: str | None, devices: list[torch.device]) -> None:
    """Refuse ``process_group_backend="nccl"`` on devices other than CUDA GPUs (NCCL moves GPU memory only); gloo
    runs on every device (on CUDA its buckets travel through pinned host memory)."""
    if backend == "nccl":
        other = sorted({str(d) for d in devices if d.type != "cuda"})
        if other:
            raise ConfigurationError(
                f"process_group_backend='nccl' needs CUDA devices, but this run trains on {other[0]}: NCCL moves GPU "
                "memory only. Use process_group_backend='gloo' (the default on CPU), or accelerator='gpu'."
            )


def check_known_options(owner: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Refuse options ``owner`` does not take, naming them and the ones it does (rather than Python's bare
    ``TypeError`` from deep in the constructors)."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigurationError(
            f"{owner} has no option {', '.join(map(repr, unknown))}; its options: {', '.join(sorted(known))}"
        )


def constructor_options(cls: type, up_to: type) -> set[str]:
    """Every keyword the constructors of ``cls`` and of its bases up to ``up_to`` (included) take."""
    names: set[str] = set()
    for klass in cls.__mro__[: cls.__mro__.index(up_to) + 1]:
        if "__init__" in vars(klass):
            parameters = inspect.signature(vars(klass)["__init__"]).parameters.values()
            names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names - {"self"}
