"""Point-to-point messages: batched sends and receives, and waits that name the peer when it fails."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_dp.comm.cluster.peers import is_transport_error, lost_peer_error, wait_naming_peer
from lightning_dp.comm.transports.staging import moves_host_memory_only


class _ThroughHost:
    """A message of a device tensor over a group that moves host memory only, carried by a host copy: a send's copy
    is made before it is posted; a receive lands in a host buffer and is copied into the tensor by :meth:`wait`."""

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor | None) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self, timeout: Any = None) -> bool:
        self.work.wait() if timeout is None else self.work.wait(timeout)
        if self.target is not None:
            self.target.copy_(self.host)
        return True


def post(ops: list[tuple[str, torch.Tensor, int, int]], group: dist.ProcessGroup | None) -> list[Any]:
    """Start ``(kind, tensor, group_peer, tag)`` sends/receives (kind ``"send"`` or ``"recv"``) as one batch and
    return their works in the same order (``None`` for empty tensors, which are skipped on both ends).

    One batch lets NCCL run a send and a receive to the same peer together instead of deadlocking on the pair;
    NCCL then completes the batch as one (every operation's work is the batch's). With gloo it is the same as
    posting them one by one, each with a work of its own. Over gloo, which reads host memory only, a tensor on a
    device travels through a host copy (its work's ``wait`` copies a received one into place): meant for the few
    small messages outside the buckets (votes, norms, the link probe); buckets are staged by their transport
    (:mod:`lightning_dp.comm.transports.staging`).
    """
    host_only = moves_host_memory_only(dist.get_backend(group))
    batch, index, staged = [], [], {}
    for i, (kind, tensor, peer, tag) in enumerate(ops):
        if tensor.numel():
            if host_only and tensor.device.type != "cpu":
                host = tensor.to("cpu") if kind == "send" else torch.empty(tensor.shape, dtype=tensor.dtype)
                staged[i] = (host, tensor if kind == "recv" else None)
                tensor = host
            op = dist.irecv if kind == "recv" else dist.isend
            batch.append(dist.P2POp(op, tensor, group=group, tag=tag, group_peer=peer))
            index.append(i)
    works: list[Any] = [None] * len(ops)
    if batch:
        try:
            started = dist.batch_isend_irecv(batch)
        except Exception as error:  # a peer already lost when the batch is posted: gloo raises here, not at the wait
            if not is_transport_error(error):
                raise
            kinds = {ops[i][0] for i in index}
            action = "send to" if kinds == {"send"} else "receive from" if kinds == {"recv"} else "exchange with"
            peers = sorted({dist.get_global_rank(group, ops[i][2]) if group is not None else ops[i][2]
                            for i in index})  # fmt: skip
            raise lost_peer_error(f"rank {dist.get_rank()}", action, " or ".join(f"rank {p}" for p in peers),
                                  error) from error  # fmt: skip
        for i, work in zip(index, _per_op(started, len(batch))):
            works[i] = _ThroughHost(work, *staged[i]) if i in staged else work
    return works


def _per_op(started: list[Any], num_ops: int) -> list[Any]:
    """The work of each of a batch's ``num_ops`` operations: gloo returns one per operation; NCCL coalesces the batch
    into one work, which then stands for every operation (waiting for any of them waits for the whole batch)."""
    if len(started) == num_ops:
        return started
    if len(started) == 1:
        return started * num_ops
    raise RuntimeError(f"a batch of {num_ops} point-to-point operations returned {len(started)} works")


def wait_for(work: Any, group: dist.ProcessGroup | None, peer: int, action: str) -> None:
    """Wait for ``work`` (a send to / receive from group rank ``peer``, from :func:`post`); a lost peer or link is
    re-raised as :class:`~lightning_dp.comm.errors.PeerUnreachableError` naming both ranks, any other failure as it
    is."""
    if work is None:
        return
    them = dist.get_global_rank(group, peer) if group is not None else peer  # the default group's ranks are global
    wait_naming_peer(work, f"rank {dist.get_rank()}", action, f"rank {them}")
