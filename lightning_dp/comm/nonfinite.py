"""Finding NaN and infinity in gradients with one device synchronization and one fast pass over memory."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def _total(grad: Tensor) -> Tensor:
    # 16-bit sums overflow long before their elements do: add them up in float32
    if grad.is_floating_point() and torch.finfo(grad.dtype).bits <= 16:
        return grad.detach().sum(dtype=torch.float32)
    return grad.detach().sum()


def first_nonfinite(grads: Sequence[tuple[Tensor, Tensor]]) -> Tensor | None:
    """The first parameter of ``(parameter, gradient)`` pairs whose gradient holds NaN or infinity, or ``None``.

    A sum is finite only if every element is (an infinity or NaN makes it infinite or NaN), and summing is the
    cheapest full pass over a tensor (a max-norm or ``isfinite`` costs several times more on CPU); only a gradient
    whose sum is not finite, because of NaN/inf or because finite values overflowed, is checked element by element.
    One device synchronization when all are finite.
    """
    if not grads:
        return None
    totals = torch.stack([_total(g).abs().double() for _, g in grads])
    # sync: whether the step raises (or, with a gradient scaler, is skipped) is decided on the host
    if bool(torch.isfinite(totals).all()):
        return None
    for (p, g), total in zip(grads, totals.tolist()):
        if not math.isfinite(total) and not bool(torch.isfinite(g).all()):
            return p
    return None  # finite values whose sum overflowed
