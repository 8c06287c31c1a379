"""Point-to-point messages: batched sends and receives, and waits that name the peer when it fails."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_dp.comm.errors import PeerUnreachableError


def post(ops: list[tuple[str, torch.Tensor, int, int]], group: dist.ProcessGroup | None) -> list[dist.Work | None]:
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
    works: list[dist.Work | None] = [None] * len(ops)
    if batch:
        for i, work in zip(index, dist.batch_isend_irecv(batch)):
            works[i] = work
    return works


def wait_for(work: dist.Work | None, group: dist.ProcessGroup | None, peer: int, action: str) -> None:
    """Wait for ``work`` (a send to / receive from group rank ``peer``); re-raise failures naming both ranks."""
    if work is None:
        return
    try:
        work.wait()
    except Exception as error:  # gloo and NCCL raise RuntimeError subclasses with transport details
        me = dist.get_rank()
        them = dist.get_global_rank(group, peer) if group is not None else peer  # the default group's ranks are global
        raise PeerUnreachableError(
            f"rank {me} could not {action} rank {them}: the peer is unreachable (it may have died, its link may be "
            f"down, or it did not answer within the strategy's timeout). Transport error: {error}"
        ) from error
