"""Ring all-reduce on point-to-point ``torch.distributed`` messages.

The buffer is cut into ``N`` chunks (``N`` = group size). In the reduce-scatter phase each rank sends one chunk
to its right neighbour and adds the chunk arriving from its left neighbour, ``N - 1`` times, after which rank
``r`` holds the complete sum of chunk ``(r + 1) % N``. In the all-gather phase the finished chunks travel once
more around the ring, ``N - 1`` steps, overwriting the partial sums. Every rank sends and receives
``2 (N - 1) / N`` of the buffer, the bandwidth-optimal amount, whatever ``N`` is.

Every chunk is reduced on exactly one rank and then copied, so all ranks end with bit-identical results.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from lightning_dp.comm.stats import CommStats

ReduceOpName = Literal["sum", "avg"]
REDUCE_OPS = ("sum", "avg")


def chunk_bounds(numel: int, num_chunks: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``num_chunks`` contiguous ``(start, end)`` pieces whose sizes differ by at most 1.

    Pieces may be empty when ``numel < num_chunks``.
    """
    base, extra = divmod(numel, num_chunks)
    bounds = []
    start = 0
    for i in range(num_chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class Ring:
    """The ring order of a process group: who this rank sends to (right) and receives from (left).

    Ranks are *group* ranks, so a ring can run on any sub-group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size

    def exchange(
        self, send: torch.Tensor, recv: torch.Tensor, stats: CommStats | None = None
    ) -> None:
        """Send ``send`` to the right neighbour while receiving ``recv`` from the left one; blocks until both are done.

        The receive is posted before the send, so neither side can wait on the other. Empty tensors are skipped on
        both ends (chunk sizes are known to every rank).
        """
        works = []
        if recv.numel():
            works.append(dist.irecv(recv, group=self.group, group_src=self.left))
        if send.numel():
            works.append(dist.isend(send, group=self.group, group_dst=self.right))
        for work in works:
            work.wait()
        if stats is not None:
            stats.add(sent=send.numel() * send.element_size(), received=recv.numel() * recv.element_size())


def _check_op(op: str, tensor: torch.Tensor) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r} is not supported; choose one of {REDUCE_OPS}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op='avg' needs a floating point tensor, got dtype {tensor.dtype}")


def ring_reduce_scatter(
    flat: torch.Tensor, ring: Ring, op: ReduceOpName = "sum", stats: CommStats | None = None
) -> tuple[int, int]:
    """Reduce-scatter phase, in place on the 1-D contiguous ``flat``.

    Returns the ``(start, end)`` slice of ``flat`` that this rank now holds fully reduced (divided by the group
    size when ``op == "avg"``). The other chunks hold partial sums.
    """
    n, r = ring.size, ring.rank
    bounds = chunk_bounds(flat.numel(), n)
    scratch = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype, device=flat.device)
    for step in range(n - 1):
        s0, s1 = bounds[(r - step) % n]
        r0, r1 = bounds[(r - step - 1) % n]
        incoming = scratch[: r1 - r0]
        ring.exchange(flat[s0:s1], incoming, stats)
        flat[r0:r1].add_(incoming)
    owned = bounds[(r + 1) % n]
    if op == "avg":
        flat[owned[0] : owned[1]].div_(n)
    return owned


def ring_allgather(flat: torch.Tensor, ring: Ring, stats: CommStats | None = None) -> None:
    """All-gather phase, in place: rank ``r`` starts owning chunk ``(r + 1) % N`` and ends with every chunk."""
    n, r = ring.size, ring.rank
    bounds = chunk_bounds(flat.numel(), n)
    for step in range(n - 1):
        s0, s1 = bounds[(r + 1 - step) % n]
        r0, r1 = bounds[(r - step) % n]
        ring.exchange(flat[s0:s1], flat[r0:r1], stats)


def ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: ReduceOpName = "sum",
    stats: CommStats | None = None,
    ring: Ring | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` with the ring algorithm and return it.

    ``op`` is ``"sum"`` or ``"avg"``. Any shape and length works (including 0 and lengths shorter than the group);
    a group of one rank leaves the tensor as it is (``avg`` divides by 1). Non-contiguous tensors are reduced
    through a contiguous copy. The result is bit-identical on every rank.
    """
    _check_op(op, tensor)
    ring = ring or Ring(group)
    if ring.size == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    ring_reduce_scatter(flat, ring, op, stats)
    ring_allgather(flat, ring, stats)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
