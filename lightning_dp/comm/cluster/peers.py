"""Which rank a transport error is about: a directory of the ranks' socket endpoints, and a context that turns a
lost peer or link into :class:`~lightning_dp.comm.errors.PeerUnreachableError` naming it."""

from __future__ import annotations

import re
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_dp.comm.cluster.sockets import tcp_sockets
from lightning_dp.comm.errors import PeerUnreachableError

#: fragments of the messages gloo and NCCL raise when a peer or its link is gone (often as plain RuntimeErrors);
#: other failures (out of memory, invalid usage) must keep their own message; the last two are NCCL's watchdog's
_TRANSPORT_MARKERS = ("Connection reset", "Connection closed", "Connection refused", "Broken pipe", "Timed out",
                      "timed out", "Socket Timeout", "pair closure",
                      "ncclRemoteError", "ncclSystemError", "remote process exited",
                      "before timing out", "communicator was aborted")  # fmt: skip


def is_transport_error(error: BaseException) -> bool:
    """Whether ``error`` reports a lost peer or link rather than a bug or a local failure."""
    if isinstance(error, PeerUnreachableError):
        return False
    if isinstance(error, (getattr(dist, "DistNetworkError", ()), getattr(dist, "DistStoreError", ()))):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in _TRANSPORT_MARKERS)


class PeerDirectory:
    """Which rank owns which TCP endpoint, so a transport error that gives only a peer's address names its rank.

    Built collectively once the process groups exist (gloo connects every pair of ranks when a group is created):
    every rank shares the local endpoints of its sockets. Empty where /proc is not available.
    """

    def __init__(self, owners: dict[str, int] | None = None) -> None:
        self.owners = owners or {}

    @classmethod
    def build(cls, group: dist.ProcessGroup | None = None) -> PeerDirectory:
        try:
            mine = [f"{s['address']}:{s['port']}" for s in tcp_sockets()]
        except OSError:  # best effort: every rank must still take part in the gather below
            mine = []
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (dist.get_rank(), mine), group=group)
        return cls({endpoint: rank for rank, endpoints in everyone for endpoint in endpoints})

    def rank_in(self, message: str, exclude: int | None = None) -> int | None:
        """The rank (other than ``exclude``) owning an endpoint ``[address]:port`` that ``message`` mentions."""
        found = re.findall(r"\[(?:::ffff:)?([0-9A-Fa-f.:]+)\]:(\d+)", message)
        # gloo prints some ports in network byte order: the byte-swapped number only if the literal one is unknown
        for swap in (False, True):
            for address, port in found:
                number = int(port)
                if swap:
                    if number >= 65536:
                        continue
                    number = int.from_bytes(number.to_bytes(2, "little"), "big")
                owner = self.owners.get(f"{address}:{number}")
                if owner is not None and owner != exclude:
                    return owner
        return None


def lost_peer_error(me: str, action: str, peer: str, error: BaseException) -> PeerUnreachableError:
    """The error for a transport failure ``error`` of ``me`` while it tried to ``action`` ``peer``: the one place
    its text is built."""
    return PeerUnreachableError(
        f"{me} could not {action} {peer}: the peer is unreachable (it may have died, its link may be down, or it did "
        f"not answer within the strategy's timeout). Transport error: {error}"
    )


def wait_naming_peer(work: Any, me: str, action: str, peer: str | Callable[[BaseException], str],
                     timeout: timedelta | None = None) -> None:  # fmt: skip
    """Wait for ``work`` (``None``: nothing to wait for). A transport failure is re-raised as
    :func:`lost_peer_error` naming ``peer`` (or what ``peer(error)`` finds behind the error); any other failure as it
    is."""
    if work is None:
        return
    try:
        work.wait() if timeout is None else work.wait(timeout)
    except Exception as error:  # gloo and NCCL raise RuntimeError subclasses with transport details
        if not is_transport_error(error):
            raise
        raise lost_peer_error(me, action, peer(error) if callable(peer) else peer, error) from error


@contextmanager
def naming_lost_peer(
    what: str, group: dist.ProcessGroup | None = None, directory: PeerDirectory | None = None
) -> Generator[None, None, None]:
    """Re-raise a transport failure inside the block as :class:`PeerUnreachableError`, saying during ``what`` it
    happened and which rank was lost: in a group of two the other rank, otherwise the one ``directory`` finds
    behind the address in the transport error."""
    try:
        yield
    except Exception as error:
        if not is_transport_error(error):
            raise
        me, members = dist.get_rank(), dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        lost = directory.rank_in(str(error), exclude=me) if directory is not None else None
        if len(members) == 2:
            lost = next(r for r in members if r != me)
        peer = f"rank {lost}" if lost is not None else "a peer (the transport error below gives its address)"
        raise lost_peer_error(f"rank {me}", "reach", f"{peer} during {what}", error) from error
