"""Errors that name the peer a rank lost, instead of a bare transport message."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist


class PeerUnreachableError(RuntimeError):
    """A message to or from another rank failed: the peer died, the link is down, or the timeout passed."""


def wait_for(work: Optional[dist.Work], group: Optional[dist.ProcessGroup], peer: int, action: str) -> None:
    """Wait for ``work`` (a send to / receive from group rank ``peer``); re-raise failures naming both ranks."""
    if work is None:
        return
    try:
        work.wait()
    except Exception as error:  # gloo and NCCL raise RuntimeError subclasses with transport details
        group = group if group is not None else dist.group.WORLD
        me, them = dist.get_rank(), dist.get_global_rank(group, peer)
        raise PeerUnreachableError(
            f"rank {me} could not {action} rank {them}: the peer is unreachable (it may have died, its link may be "
            f"down, or it did not answer within the strategy's timeout). Transport error: {error}"
        ) from error


class NonFiniteGradientError(FloatingPointError):
    """The averaged gradient of a step holds NaN or infinity; raised on every rank before the optimizer step."""
