"""Errors that name the peer a rank lost, instead of a bare transport message."""

from __future__ import annotations

import re
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


class PeerDirectory:
    """Which rank owns which TCP endpoint, so a transport error that gives only a peer's address names its rank.

    Built collectively once the process groups exist (gloo connects every pair of ranks when a group is created):
    every rank shares the local endpoints of its sockets. Empty where /proc is not available.
    """

    def __init__(self, owners: Optional[dict[str, int]] = None) -> None:
        self.owners = owners or {}

    @classmethod
    def build(cls, group: Optional[dist.ProcessGroup] = None) -> "PeerDirectory":
        from lightning_dp.comm.sockets import tcp_sockets

        mine = [f"{s['address']}:{s['port']}" for s in tcp_sockets()]
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (dist.get_rank(), mine), group=group)
        return cls({endpoint: rank for rank, endpoints in everyone for endpoint in endpoints})

    def rank_in(self, message: str) -> Optional[int]:
        """The rank owning an endpoint ``[address]:port`` that ``message`` mentions, if known."""
        for address, port in re.findall(r"\[(?:::ffff:)?([0-9A-Fa-f.:]+)\]:(\d+)", message):
            number = int(port)
            # gloo prints some ports in network byte order: try the byte-swapped number too
            for candidate in (number, int.from_bytes(number.to_bytes(2, "little"), "big") if number < 65536 else -1):
                if f"{address}:{candidate}" in self.owners:
                    return self.owners[f"{address}:{candidate}"]
        return None


@contextmanager
def naming_lost_peer(
    what: str, group: Optional[dist.ProcessGroup] = None, directory: Optional[PeerDirectory] = None
) -> Generator[None, None, None]:
    """Re-raise a transport failure inside the block as :class:`PeerUnreachableError`, saying during ``what`` it
    happened and which rank was lost: in a group of two the other rank, otherwise the one ``directory`` finds
    behind the address in the transport error."""
    try:
        yield
    except Exception as error:
        if not is_transport_error(error):
            raise
        group = group if group is not None else dist.group.WORLD
        me, members = dist.get_rank(), dist.get_process_group_ranks(group)
        lost = directory.rank_in(str(error)) if directory is not None else None
        if len(members) == 2:
            lost = next(r for r in members if r != me)
        peer = f"rank {lost}" if lost is not None else "a peer (the transport error below gives its address)"
        raise PeerUnreachableError(
            f"rank {me} could not reach {peer} during {what}: the peer is unreachable (it may have died, its link "
            f"may be down, or it did not answer within the strategy's timeout). Transport error: {error}"
        ) from error


class NonFiniteGradientError(FloatingPointError):
    """The averaged gradient of a step holds NaN or infinity; raised on every rank before the optimizer step."""
