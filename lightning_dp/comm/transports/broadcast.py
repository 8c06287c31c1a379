"""Broadcast of many tensors at once (module state at set-up, buffers before a step)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor


def broadcast_tensors(tensors: Iterable[Tensor], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite ``tensors`` on every rank with their values on group rank ``src``, in place.

    Tensors are packed into one flat message per (dtype, device), so the cost is a few messages whatever the
    number of tensors. Every rank must pass tensors of the same shapes in the same order.
    """
    if dist.get_world_size(group) == 1:
        return
    by_kind: dict[tuple, list[Tensor]] = defaultdict(list)
    for t in tensors:
        if t.numel():
            by_kind[(t.dtype, t.device)].append(t)
    for group_tensors in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        dist.broadcast(flat, group=group, group_src=src)
        offset = 0
        with torch.no_grad():
            for t in group_tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
