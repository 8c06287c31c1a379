"""Errors that name the peer a rank lost, instead of a bare transport message."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Generator, Optional

import torch
import torch.distributed as dist


def post(ops: list[tuple[str, "torch.Tensor", int, int]], group: Optional[dist.ProcessGroup]) -> list[Optional[dist.Work]]:
    """Start ``(kind, tensor, group_peer, tag)`` sends/receives (kind ``"send"`` or ``"recv"``) as one batch and
    return their works in the same order (``None`` for empty tensors, which are skipped on both ends).

    One batch lets NCCL run a send and a receive to the same peer together instead of deadlocking on the pair;
    with gloo it is the same as posting them one by one.
    """
    batch, index = [], []
    for i, (kind, tensor, peer, tag) in enumerate(ops):
        if tensor.numel():
            op = dist.irecv if kind == "recv" else dist.isend
            batch.append(dist.P2POp(op, tensor, group=group, tag=tag, group_peer=peer))
            index.append(i)
    works: list[Optional[dist.Work]] = [None] * len(ops)
    if batch:
        for i, work in zip(index, dist.batch_isend_irecv(batch)):
            works[i] = work
    return works


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


#: fragments of the messages gloo and NCCL raise when a peer or its link is gone (they raise plain RuntimeErrors)
_TRANSPORT_MARKERS = ("transport/", "Connection reset", "Connection closed", "Connection refused", "Broken pipe",
                      "Timed out", "timed out", "NCCL", "Socket Timeout")  # fmt: skip


def is_transport_error(error: BaseException) -> bool:
    """Whether ``error`` reports a lost peer or link rather than a bug in the calling code."""
    if isinstance(error, PeerUnreachableError):
        return False
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in _TRANSPORT_MARKERS)


@contextmanager
def naming_lost_peer(what: str, group: Optional[dist.ProcessGroup] = None) -> Generator[None, None, None]:
    """Re-raise a transport failure inside the block as :class:`PeerUnreachableError`, saying during ``what`` it
    happened and which rank was lost where that is known (a group of two: the other rank)."""
    try:
        yield
    except Exception as error:
        if not is_transport_error(error):
            raise
        group = group if group is not None else dist.group.WORLD
        me, size = dist.get_rank(), dist.get_world_size(group)
        if size == 2:
            peer = f"rank {next(r for r in dist.get_process_group_ranks(group) if r != me)}"
        else:
            peer = "a peer (the transport error below names its address)"
        raise PeerUnreachableError(
            f"rank {me} could not reach {peer} during {what}: the peer is unreachable (it may have died, its link "
            f"may be down, or it did not answer within the strategy's timeout). Transport error: {error}"
        ) from error


class NonFiniteGradientError(FloatingPointError):
    """The averaged gradient of a step holds NaN or infinity; raised on every rank before the optimizer step."""
