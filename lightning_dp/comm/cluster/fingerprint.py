"""Set-up check that every rank built the same model, so a mismatch fails loudly instead of hanging a ring."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lightning_dp.comm.errors import ReplicaMismatchError


def module_fingerprint(module: nn.Module) -> list[tuple]:
    """``(kind, name, shape, dtype, requires_grad)`` for every parameter and buffer, in registration order."""
    params = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    buffers = [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return params + buffers


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "nothing"
    kind, name, shape, dtype, requires_grad = entry
    trainable = "" if kind == "buffer" else (" trainable" if requires_grad else " frozen")
    return f"{kind} {name!r} of shape {shape} {dtype.replace('torch.', '')}{trainable}"


def check_replicas_match(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Compare this rank's :func:`module_fingerprint` with every other rank's; on a difference raise, on every
    rank at once, a :class:`ReplicaMismatchError` naming the first differing rank and tensor."""
    if dist.get_world_size(group) == 1:
        return
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, module_fingerprint(module), group=group)
    reference = gathered[0]
    for rank, fingerprint in enumerate(gathered[1:], start=1):
        if fingerprint == reference:
            continue
        for i in range(max(len(reference), len(fingerprint))):
            ours = fingerprint[i] if i < len(fingerprint) else None
            theirs = reference[i] if i < len(reference) else None
            if ours != theirs:
                raise ReplicaMismatchError(
                    f"the model on rank {rank} differs from rank 0: at position {i} rank {rank} has "
                    f"{_describe(ours)}, rank 0 has {_describe(theirs)}. Every rank must build the same model "
                    "(check configuration overrides given to one node only)."
                )
