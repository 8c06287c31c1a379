"""Parameter-server exchanges on point-to-point ``torch.distributed`` messages.

Central server (one rank aggregates for everyone):

- :func:`push_gradients`: fan-in. Every other rank sends its buffer to the server, which sums them with its
  own and divides by the group size. The server receives ``(N - 1) S`` bytes, a worker sends ``S``.
- :func:`pull_weights`: fan-out. The server sends its buffer to every other rank. The server sends
  ``(N - 1) S`` bytes, a worker receives ``S``.

Sharded servers (rank ``i`` serves shard ``i`` of every buffer):

- :func:`push_shards`: each rank sends segment ``i`` of its buffer to rank ``i`` and averages the segments it
  serves. Every rank sends and receives about ``(N - 1) / N S`` bytes.
- :func:`pull_shards`: each rank sends the segment it serves to every other rank. Again ``(N - 1) / N S``.

Each exchange is one message round (every message of a rank is posted at once), so a step of a parameter server
pays the network's latency a few times, not ``2 (N - 1)`` times as a ring does. :func:`sum_everywhere` sums a few
values on every rank in one round (votes, used-flags).

The sums run in rank order on the serving rank, and the result is then copied, so every rank ends with the
same bits.

``wire_dtype`` (optional, every exchange): a narrower floating dtype the messages travel in. Pushes then send each
rank's values rounded to it and the server *sums* what arrives in the buffer's own dtype (the caller divided by
the group size beforehand, see :class:`~lightning_dp.comm.codecs.HalfPrecisionCodec`); pulls round the server's
values to it, its own copy included, so every rank ends with the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports.p2p import post, wait_for
from lightning_dp.comm.transports.ring import Ring, divides_first
from lightning_dp.comm.transports.staging import moves_host_memory_only

Segment = tuple[int, int]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _average_in_rank_order(contributions: Iterable[torch.Tensor], size: int, out: torch.Tensor) -> None:
    """``out`` = the average of the ``size`` ``contributions`` (one per rank, in rank order, taken one at a time so
    a lazy iterable can wait for each message just before it is added); 16-bit floats are divided before they
    are summed, so that large gradients do not overflow (see :func:`~.ring.divides_first`)."""
    first = divides_first(out.dtype)
    total: torch.Tensor | None = None
    for contribution in contributions:
        term = contribution / size if first else contribution
        total = term.clone() if total is None else total.add_(term)
    assert total is not None
    out.copy_(total if first else total.div_(size))


def _sum_in_rank_order(contributions: Iterable[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` = the sum of ``contributions`` (in rank order, lazily as above), added in ``out``'s dtype."""
    total: torch.Tensor | None = None
    for contribution in contributions:
        total = contribution.to(out.dtype, copy=True) if total is None else total.add_(contribution.to(out.dtype))
    assert total is not None
    out.copy_(total)


def _combine(
    contributions: Iterable[torch.Tensor], size: int, out: torch.Tensor, wire_dtype: torch.dtype | None
) -> None:
    if wire_dtype is None:
        _average_in_rank_order(contributions, size, out)
    else:
        _sum_in_rank_order(contributions, out)


def _on_wire(tensor: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as it travels: itself, or a copy rounded to ``wire_dtype``."""
    return tensor if wire_dtype is None or wire_dtype == tensor.dtype else tensor.to(wire_dtype)


def _round_to(tensor: torch.Tensor, wire_dtype: torch.dtype | None, residual: torch.Tensor | None = None) -> None:
    """Round ``tensor`` in place to what ``wire_dtype`` can hold (the sender keeps what the receivers get); ``residual``
    gains what that lost."""
    if wire_dtype is not None and wire_dtype != tensor.dtype:
        rounded = tensor.to(wire_dtype)
        if residual is not None:
            residual.add_(tensor - rounded.to(tensor.dtype))
        tensor.copy_(rounded)


def _wait(works: list[tuple[Any, int, str]], group: dist.ProcessGroup | None) -> None:
    for work, peer, action in works:
        wait_for(work, group, peer, action)


def push_gradients(
    buffer: torch.Tensor,
    server: int,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    scratch: Sequence[torch.Tensor] | None = None,
    wire_dtype: torch.dtype | None = None,
) -> None:
    """Fan-in: on group rank ``server`` leave the average of every rank's ``buffer`` (1-D); others only send.
    With ``wire_dtype``: the sum, see the module docstring.

    ``scratch`` (optional, server only) are ``N - 1`` receive buffers of ``buffer``'s size and the wire's dtype.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1 or buffer.numel() == 0:
        return
    if rank != server:
        outgoing = _on_wire(buffer, wire_dtype)
        wait_for(post([("send", outgoing, server, 0)], group)[0], group, server, "push gradients to")
        if stats is not None:
            stats.add(sent=_nbytes(outgoing))
        return
    peers = [r for r in range(size) if r != server]
    if scratch is None:
        scratch = [torch.empty_like(buffer, dtype=wire_dtype or buffer.dtype) for _ in peers]
    works = post([("recv", scratch[k], peer, 0) for k, peer in enumerate(peers)], group)

    def arriving() -> Iterator[torch.Tensor]:  # in rank order; each add waits only for its own message
        for peer_rank in range(size):
            if peer_rank == server:
                yield buffer
            else:
                k = peers.index(peer_rank)
                wait_for(works[k], group, peer_rank, "receive gradients from")
                yield scratch[k]

    _combine(arriving(), size, buffer, wire_dtype)
    if stats is not None:
        stats.add(received=_nbytes(scratch[0]) * len(peers))


def pull_weights(
    buffer: torch.Tensor,
    server: int,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    wire_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> None:
    """Fan-out: every rank's ``buffer`` becomes a copy of the server's (rounded to ``wire_dtype``, the server's too;
    the server's ``residual`` gains what that lost)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1 or buffer.numel() == 0:
        return
    if rank == server:
        _round_to(buffer, wire_dtype, residual)
        outgoing = _on_wire(buffer, wire_dtype)
        peers = [p for p in range(size) if p != server]
        sends = post([("send", outgoing, p, 0) for p in peers], group)
        _wait([(work, p, "send weights to") for work, p in zip(sends, peers)], group)
        if stats is not None:
            stats.add(sent=_nbytes(outgoing) * (size - 1))
    else:
        incoming = _on_wire(buffer, wire_dtype)
        wait_for(post([("recv", incoming, server, 0)], group)[0], group, server, "pull weights from")
        if incoming is not buffer:
            buffer.copy_(incoming)
        if stats is not None:
            stats.add(received=_nbytes(incoming))


def _to_every_peer_ops(tensor: torch.Tensor, rank: int, size: int, tag: int) -> tuple[list, dict[int, torch.Tensor]]:
    """The sends and receives of a direct exchange of ``tensor`` with every peer, and the receive buffers."""
    incoming = {peer: torch.empty_like(tensor) for peer in range(size) if peer != rank}
    ops = [("recv", incoming[p], p, tag) for p in sorted(incoming)]
    ops += [("send", tensor, p, tag) for p in range(size) if p != rank]
    return ops, incoming


def sum_everywhere(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, stats: CommStats | None = None
) -> torch.Tensor:
    """``tensor`` (1-D, small) becomes the sum over all ranks, on every rank, in one message round: each rank sends
    it to every peer and adds what arrives in rank order (the same bits everywhere). Each rank sends and receives
    ``(N - 1) S`` bytes: meant for a few values (a vote, used-flags), where a ring's ``2 (N - 1)`` rounds of latency
    would cost more than the bytes."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1 or tensor.numel() == 0:
        return tensor
    ops, incoming = _to_every_peer_ops(tensor, rank, size, tag=1)
    actions = ["receive a vote from" if kind == "recv" else "send a vote to" for kind, *_ in ops]
    _wait([(w, op[2], a) for w, op, a in zip(post(ops, group), ops, actions)], group)
    _sum_in_rank_order((tensor if p == rank else incoming[p] for p in range(size)), tensor)
    if stats is not None:
        stats.add(sent=_nbytes(tensor) * (size - 1), received=_nbytes(tensor) * (size - 1))
    return tensor


def push_shards(
    buffer: torch.Tensor,
    segments: Sequence[Segment],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    wire_dtype: torch.dtype | None = None,
    summed: torch.Tensor | None = None,
) -> None:
    """Sharded fan-in: ``buffer[segments[i]]`` goes to rank ``i``; this rank's own segment ends up averaged (with
    ``wire_dtype``: summed, see the module docstring).

    ``segments`` has one ``(start, end)`` per group rank, the same on every rank. Other segments of ``buffer`` are
    left as they were. ``summed`` (optional, small, e.g. used-flags) travels in the same message round to every
    peer and becomes the sum over all ranks on every rank (as :func:`sum_everywhere`).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return
    dtype = wire_dtype or buffer.dtype
    mine = buffer[segments[rank][0] : segments[rank][1]]
    scratch = {peer: torch.empty_like(mine, dtype=dtype) for peer in range(size) if peer != rank and mine.numel()}
    ops = [("recv", scratch[p], p, 0) for p in sorted(scratch)]
    ops += [("send", _on_wire(buffer[s:e], wire_dtype), p, 0) for p, (s, e) in enumerate(segments) if p != rank]
    actions = ["receive a gradient shard from" if kind == "recv" else "push a gradient shard to" for kind, *_ in ops]
    flags: dict[int, torch.Tensor] = {}
    if summed is not None and summed.numel():
        flag_ops, flags = _to_every_peer_ops(summed, rank, size, tag=2)
        ops += flag_ops
        actions += ["receive used-flags from" if kind == "recv" else "send used-flags to" for kind, *_ in flag_ops]
    _wait([(w, op[2], a) for w, op, a in zip(post(ops, group), ops, actions)], group)
    element = torch.empty((), dtype=dtype).element_size()
    sent = sum(e - s for p, (s, e) in enumerate(segments) if p != rank) * element
    if mine.numel():
        _combine([mine if peer == rank else scratch[peer] for peer in range(size)], size, mine, wire_dtype)
    if stats is not None:
        stats.add(sent=sent, received=mine.numel() * element * (size - 1))
    if flags:
        assert summed is not None
        _sum_in_rank_order((summed if p == rank else flags[p] for p in range(size)), summed)
        if stats is not None:
            stats.add(sent=_nbytes(summed) * (size - 1), received=_nbytes(summed) * (size - 1))


def pull_shards(
    buffer: torch.Tensor,
    segments: Sequence[Segment],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    wire_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> None:
    """Sharded fan-out: this rank's segment goes to every peer; every other segment arrives from its server
    (rounded to ``wire_dtype``, the owner's copy too; ``residual``, ``buffer``'s shape, gains what that lost)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return
    start, end = segments[rank]
    _round_to(buffer[start:end], wire_dtype, residual[start:end] if residual is not None else None)
    incoming = {p: _on_wire(buffer[s:e], wire_dtype) for p, (s, e) in enumerate(segments) if p != rank}
    outgoing = _on_wire(buffer[start:end], wire_dtype)
    ops = [("recv", incoming[p], p, 0) for p in sorted(incoming)]
    ops += [("send", outgoing, p, 0) for p in range(size) if p != rank]
    actions = ["pull a weight shard from" if kind == "recv" else "send a weight shard to" for kind, *_ in ops]
    _wait([(w, op[2], a) for w, op, a in zip(post(ops, group), ops, actions)], group)
    if wire_dtype is not None and wire_dtype != buffer.dtype:
        for p, (s, e) in enumerate(segments):
            if p != rank:
                buffer[s:e].copy_(incoming[p])
    received = sum(_nbytes(t) for t in incoming.values())
    if stats is not None:
        stats.add(sent=_nbytes(outgoing) * (size - 1), received=received)


def shard_segments(sizes: Sequence[int], element_sizes: Sequence[int], num_shards: int) -> list[list[Segment]]:
    """Split buffers of ``sizes`` elements into ``num_shards`` shards balanced by bytes, at element granularity.

    The buffers are laid end to end in bytes and cut into ``num_shards`` equal byte ranges; returns, for every
    buffer, the ``(start, end)`` element range of each shard inside it (empty where a shard does not reach it).
    A single huge buffer is therefore split across all shards instead of landing on one.
    """
    total = sum(n * e for n, e in zip(sizes, element_sizes))
    return segments_at(sizes, element_sizes, [total * i // num_shards for i in range(num_shards + 1)])


def segments_at(sizes: Sequence[int], element_sizes: Sequence[int], cuts: Sequence[int]) -> list[list[Segment]]:
    """The shards between consecutive byte offsets ``cuts`` (non-decreasing, from 0 to the total) of buffers of
    ``sizes`` elements laid end to end: for every buffer, the ``(start, end)`` element range of each shard in it
    (a cut inside an element moves up to the element's end)."""
    result = []
    base = 0
    for numel, esize in zip(sizes, element_sizes):
        segments = []
        for i in range(len(cuts) - 1):
            lo = min(max(-(-(cuts[i] - base) // esize), 0), numel)
            hi = min(max(-(-(cuts[i + 1] - base) // esize), 0), numel)
            segments.append((lo, hi))
        result.append(segments)
        base += numel * esize
    return result


def shard_owner(element: int, segments: Sequence[Segment]) -> int:
    """The rank that serves ``element`` of a buffer split by ``segments``."""
    for rank, (start, end) in enumerate(segments):
        if start <= element < end:
            return rank
    raise IndexError(f"element {element} is outside the buffer")


def any_rank(flag: bool, ring: Ring, device: torch.device | str = "cpu") -> bool:
    """Whether ``flag`` is true on any rank of the ring's group (collective: every rank calls it). One message
    round: the votes go straight to every peer, not around the ring (``2 (N - 1)`` rounds of latency). The votes
    travel in host memory over gloo, on ``device`` otherwise (NCCL)."""
    if moves_host_memory_only(dist.get_backend(ring.group)):
        device = "cpu"  # the vote is the host's: a device tensor would only travel through a host copy
    # sync: under NCCL the vote travels in device memory, and its verdict is the host's (raise, or start afresh)
    vote = torch.tensor([1.0 if flag else 0.0], device=device)
    sum_everywhere(vote, ring.group)
    return bool(vote.item() > 0)  # sync: (the vote's verdict)
