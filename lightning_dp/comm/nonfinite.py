"""Finding NaN and infinity in gradients with one device synchronization."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def first_nonfinite(grads: Sequence[tuple[Tensor, Tensor]]) -> Tensor | None:
    """The first parameter of ``(parameter, gradient)`` pairs whose gradient holds NaN or infinity, or ``None``
    (one device synchronization when all are finite)."""
    if not grads:
        return None
    largest = torch._foreach_norm([g.detach() for _, g in grads], float("inf"))
    if bool(torch.isfinite(torch.stack([n.float() for n in largest])).all()):
        return None
    return next(p for p, g in grads if not bool(torch.isfinite(g).all()))
