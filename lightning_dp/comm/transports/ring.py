"""Ring all-reduce on point-to-point ``torch.distributed`` messages.

The buffer is cut into ``N`` chunks (``N`` = group size). In the reduce-scatter phase each rank sends one chunk
to its right neighbour and adds the chunk arriving from its left neighbour, ``N - 1`` times, after which rank
``r`` holds the complete sum of chunk ``(r + 1) % N``. In the all-gather phase the finished chunks travel once
more around the ring, ``N - 1`` steps, overwriting the partial sums. Every rank sends and receives
``2 (N - 1) / N`` of the buffer, the bandwidth-optimal amount, whatever ``N`` is.

Every chunk is reduced on exactly one rank and then copied, so all ranks end with bit-identical results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports.p2p import post, wait_for
from lightning_dp.comm.transports.staging import moves_host_memory_only

ReduceOpName = Literal["sum", "avg"]
REDUCE_OPS = ("sum", "avg")
#: the pieces a chunk travels in over a group that moves host memory (see :class:`Ring`)
HOST_SEGMENT_BYTES = 1 << 20
#: ``segment_bytes`` for one piece per chunk: each ring step is one message each way
WHOLE_CHUNKS = 1 << 62


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

    Ranks are *group* ranks, so a ring can run on any sub-group. ``segment_bytes`` sets the pipelining: each
    chunk travels as pieces of about that size, and a piece moves on to the next step as soon as it has arrived
    (and, in the reduce-scatter, been added), so the link stays busy while the previous pieces are still in
    flight. By default (``None``) pieces of 1 MiB over a group whose messages move host memory (gloo), and over
    one that moves device memory (NCCL) one message each way per ring step: NCCL pipelines a message itself, while
    a batch per piece would queue launch after launch on its one stream.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, segment_bytes: int | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size
        if segment_bytes is None:
            segment_bytes = HOST_SEGMENT_BYTES if moves_host_memory_only(dist.get_backend(self.group)) else WHOLE_CHUNKS
        if segment_bytes < 1:
            raise ConfigurationError(f"segment_bytes must be positive, got {segment_bytes}")
        self.segment_bytes = segment_bytes

    def exchange(
        self, send: torch.Tensor, recv: torch.Tensor, tag: int, stats: CommStats | None
    ) -> tuple[dist.Work | None, dist.Work | None]:
        """Start sending ``send`` to the right neighbour and receiving ``recv`` from the left one, as one batch
        (receive first); returns ``(receive work, send work)``."""
        if stats is not None:
            stats.add(sent=send.numel() * send.element_size(), received=recv.numel() * recv.element_size())
        receive, sent = post([("recv", recv, self.left, tag), ("send", send, self.right, tag)], self.group)
        return receive, sent


def _check_op(op: str, tensor: torch.Tensor) -> None:
    if op not in REDUCE_OPS:
        raise ConfigurationError(f"op={op!r} is not supported; choose one of {REDUCE_OPS}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ConfigurationError(f"op='avg' needs a floating point tensor, got dtype {tensor.dtype}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pieces(flat: torch.Tensor, ring: Ring) -> tuple[int, int, Callable[[int, int], tuple[int, int]]]:
    """Pieces per chunk, the largest piece's length, and ``piece(chunk, p) -> (start, end)`` in ``flat``."""
    bounds = chunk_bounds(flat.numel(), ring.size)
    largest_chunk = bounds[0][1] - bounds[0][0]
    num_pieces = max(1, min(64, _ceil_div(largest_chunk * flat.element_size(), ring.segment_bytes)))

    def piece(chunk: int, p: int) -> tuple[int, int]:
        start, end = bounds[chunk]
        a, b = chunk_bounds(end - start, num_pieces)[p]
        return start + a, start + b

    return num_pieces, _ceil_div(largest_chunk, num_pieces), piece


def _pipelined_phase(
    flat: torch.Tensor,
    ring: Ring,
    send_chunk: Callable[[int], int],
    recv_chunk: Callable[[int], int],
    reduce: bool,
    tag_base: int,
    stats: CommStats | None,
    wire_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> None:
    """``N - 1`` ring steps; at step ``s`` chunk ``send_chunk(s)`` goes right and ``recv_chunk(s)`` arrives from
    the left (added in place when ``reduce``, else copied). Step ``s + 1`` sends what step ``s`` received, piece
    by piece, as soon as that piece is ready. With ``wire_dtype`` the pieces travel in that dtype (each send a rounded
    copy) and arrive into ``flat``'s dtype; ``residual`` (``flat``'s shape) gains what the rounding of each send
    lost."""
    n = ring.size
    num_pieces, largest_piece, piece = _pieces(flat, ring)
    converts = wire_dtype is not None and wire_dtype != flat.dtype
    # received pieces wait here to be added (reduce) or converted (wire_dtype); otherwise they land in place
    staged = reduce or converts
    scratch = torch.empty(
        num_pieces * largest_piece if staged else 0, dtype=wire_dtype if converts else flat.dtype, device=flat.device
    )
    sends: list[tuple[dist.Work | None, torch.Tensor]] = []  # a converted send buffer lives until its send is done

    def post(step: int, p: int) -> dist.Work | None:
        s0, s1 = piece(send_chunk(step), p)
        r0, r1 = piece(recv_chunk(step), p)
        target = scratch[p * largest_piece : p * largest_piece + r1 - r0] if staged else flat[r0:r1]
        outgoing = flat[s0:s1].to(wire_dtype) if converts else flat[s0:s1]
        if converts and residual is not None:
            residual[s0:s1].add_(flat[s0:s1] - outgoing.to(flat.dtype))  # (mixed-dtype ops are slower)
        receive, sent = ring.exchange(outgoing, target, tag_base + p, stats)
        sends.append((sent, outgoing))
        return receive

    pending = [post(0, p) for p in range(num_pieces)]
    for step in range(n - 1):
        for p in range(num_pieces):
            wait_for(pending[p], ring.group, ring.left, "receive from")
            if staged:
                r0, r1 = piece(recv_chunk(step), p)
                arrived = scratch[p * largest_piece : p * largest_piece + r1 - r0]
                if reduce:
                    flat[r0:r1].add_(arrived.to(flat.dtype))
                else:
                    flat[r0:r1].copy_(arrived)
            if step + 1 < n - 1:
                pending[p] = post(step + 1, p)
    for work, _ in sends:
        wait_for(work, ring.group, ring.right, "send to")


def divides_first(dtype: torch.dtype) -> bool:
    """Whether an average in ``dtype`` divides every contribution before summing (16-bit floats, whose sum of N
    large values can overflow where their average does not, as DDP does) rather than dividing the sum."""
    return dtype.is_floating_point and torch.finfo(dtype).bits <= 16


def ring_reduce_scatter(
    flat: torch.Tensor,
    ring: Ring,
    op: ReduceOpName = "sum",
    stats: CommStats | None = None,
    wire_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Reduce-scatter phase, in place on the 1-D contiguous ``flat``.

    Returns the ``(start, end)`` slice of ``flat`` that this rank now holds fully reduced (divided by the group
    size when ``op == "avg"``; 16-bit floats are divided before summing, see :func:`divides_first`). The other
    chunks hold partial sums. With ``wire_dtype`` (a narrower dtype than ``flat``'s) partial sums travel rounded to it
    and every addition runs in ``flat``'s dtype; ``residual`` gains what this rank's roundings lost (error
    feedback: add it to the next contribution and no rounding is lost for good).
    """
    n, r = ring.size, ring.rank
    predivide = op == "avg" and divides_first(flat.dtype)
    if predivide:
        flat.div_(n)
    _pipelined_phase(flat, ring, lambda s: (r - s) % n, lambda s: (r - s - 1) % n, True, 0, stats, wire_dtype, residual)
    start, end = chunk_bounds(flat.numel(), n)[(r + 1) % n]
    if op == "avg" and not predivide:
        flat[start:end].div_(n)
    return start, end


def ring_allgather(
    flat: torch.Tensor,
    ring: Ring,
    stats: CommStats | None = None,
    wire_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> None:
    """All-gather phase, in place: rank ``r`` starts owning chunk ``(r + 1) % N`` and ends with every chunk. With
    ``wire_dtype`` the owner first rounds its chunk to that dtype (``residual`` gains what that lost), so every rank
    ends with the same (rounded) values."""
    n, r = ring.size, ring.rank
    if wire_dtype is not None and wire_dtype != flat.dtype:
        start, end = chunk_bounds(flat.numel(), n)[(r + 1) % n]
        rounded = flat[start:end].to(wire_dtype)
        if residual is not None:
            residual[start:end].add_(flat[start:end] - rounded.to(flat.dtype))
        flat[start:end].copy_(rounded)
    _pipelined_phase(flat, ring, lambda s: (r + 1 - s) % n, lambda s: (r - s) % n, False, 64, stats, wire_dtype)


def ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: ReduceOpName = "sum",
    stats: CommStats | None = None,
    ring: Ring | None = None,
    wire_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` with the ring algorithm and return it.

    ``op`` is ``"sum"`` or ``"avg"``. Any shape and length works (including 0 and lengths shorter than the group);
    a group of one rank leaves the tensor as it is (``avg`` divides by 1). Non-contiguous tensors are reduced
    through a contiguous copy. The result is bit-identical on every rank.

    ``wire_dtype``: a narrower floating dtype the messages travel in (e.g. ``torch.bfloat16`` for a float32 tensor):
    each rank adds what arrives in ``tensor``'s own dtype, partial sums are rounded to ``wire_dtype`` at each of the
    ``N - 1`` hops, and the result is the reduced value rounded to ``wire_dtype`` once more, on every rank alike.
    ``residual`` (contiguous, ``tensor``'s shape) gains what this rank's roundings lost.
    """
    _check_op(op, tensor)
    ring = ring or Ring(group)
    if ring.size == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    flat_residual = residual.view(-1) if residual is not None else None
    ring_reduce_scatter(flat, ring, op, stats, wire_dtype, flat_residual)
    ring_allgather(flat, ring, stats, wire_dtype, flat_residual)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
