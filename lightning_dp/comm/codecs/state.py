"""A codec's per-bucket state (residuals, factors, master weights) in checkpoints and after overflowing steps."""

from __future__ import annotations

import torch
from torch import Tensor


def drop_nonfinite(state: Tensor) -> None:
    """Zero what an overflowing step (inf/NaN gradients, skipped by a gradient scaler) left in a codec's state, so
    that it does not poison every later step."""
    torch.nan_to_num_(state, nan=0.0, posinf=0.0, neginf=0.0)


def check_fits(saved: dict[int, Tensor], into: dict[int, Tensor], what: str) -> None:
    if sorted(saved) != sorted(into) or any(saved[b].shape != into[b].shape for b in into):
        raise ValueError(f"the saved {what} do not fit this run's gradient buckets")


def restore_state(saved: dict[int, Tensor], into: dict[int, Tensor]) -> None:
    for b, tensor in into.items():
        tensor.copy_(saved[b])
