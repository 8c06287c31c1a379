"""All-reduce through shared memory inside a node, and a ring across nodes per local rank (hierarchical).

On one node of ``L`` ranks, with every rank's tensor in its input region of a
:class:`~lightning_dp.comm.transports.shm.NodeSharedMemory` slot, :meth:`HierarchicalAllReduce.reduce_in_place`:

1. barrier (every input is written);
2. local rank ``i`` sums slice ``i`` (of ``L`` near-equal slices) of every input, in local-rank order, a chunk that
   stays in cache at a time, and writes the sum back into slice ``i`` of *every* input;
3. across ``M`` nodes, between the two: local rank ``i`` of every node all-reduces its summed slice with the ring
   (:func:`~lightning_dp.comm.transports.ring.ring_allreduce`) over the group of local ranks ``i`` (Horovod's parallel
   hierarchical form: ``L`` rings of ``M`` ranks run at once, each on ``1/L`` of the data, so a rank takes
   ``2 (M - 1)`` network steps instead of ``2 (N - 1)``);
4. barrier (every input holds the whole result).

A rank reads ``S`` bytes and writes ``S`` bytes, the traffic of one memory copy, spread over all ranks' cores
(DeepSpeed's CPU all-reduce reduces slices the same way but gathers the result in a second pass). Slice ``i`` of
every input is touched by rank ``i`` alone between the barriers, and every element is summed by exactly one rank
per node in a fixed order, so all ranks end bit-identical. Averages of 16-bit floats accumulate in float32 inside
the node and are divided before the (16-bit) ring, as DDP divides them first.

The server transports take only parts of the result: :meth:`~HierarchicalAllReduce.reduce_scatter` sums slice
``i`` into a result region shared by the node and :meth:`~HierarchicalAllReduce.gather` copies ranges of it out.
Each slot has two result regions, used alternately: :meth:`~HierarchicalAllReduce.share_region` lets a rank write
its values *before* the barrier of ``gather``, while a slower peer may still copy the previous result out of the
other region; ``reduce_scatter`` writes only after its own barrier.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple, cast

import torch
import torch.distributed as dist

from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.execution import peers_arrived
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports.ring import (
    REDUCE_OPS,
    ReduceOpName,
    Ring,
    chunk_bounds,
    divides_first,
    ring_allreduce,
)
from lightning_dp.comm.transports.shm import NodeLayout, NodeSharedMemory

Segment = tuple[int, int]

#: bytes of each input's slice summed at a time by :meth:`HierarchicalAllReduce.reduce_in_place`: the sum (in
#: float32 for 16-bit averages, so twice this) stays in a core's cache until it is written back into every input
CHUNK_BYTES = 256 * 1024


def overlap(a: Segment, b: Segment) -> int:
    """Elements two ``(start, end)`` ranges share."""
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def check_uniform(layout: NodeLayout) -> None:
    """Refuse nodes of different sizes: local rank ``i`` of every node must exist for the rings across nodes."""
    if layout.num_nodes > 1 and not layout.uniform:
        sizes = [len(n) for n in layout.nodes]
        raise ConfigurationError(f"a hierarchical all-reduce needs the same number of ranks on every node, got {sizes}")


def cross_node_groups(
    layout: NodeLayout, group: dist.ProcessGroup | None = None, timeout: float = 300.0
) -> dist.ProcessGroup | None:
    """Collective over the default group (every process of the job calls it, as ``dist.new_group`` requires, so
    ``group`` must span the whole job): one process group per local rank index ``i``, holding local rank ``i`` of
    every node (nodes must be of equal size); returns this rank's, or ``None`` on a single node."""
    if layout.num_nodes == 1:
        return None
    check_uniform(layout)
    backend = dist.get_backend(group)
    mine: dist.ProcessGroup | None = None
    for i in range(layout.local_size):
        ranks = [dist.get_global_rank(group, n[i]) if group is not None else n[i] for n in layout.nodes]
        created = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout))
        if i == layout.local_rank:
            mine = cast(dist.ProcessGroup, created)
    return mine


class NodeProbe(NamedTuple):
    """What :meth:`HierarchicalAllReduce.measure_in_node` found: what the cost model's
    :class:`~lightning_dp.comm.cost.Link` calls ``local_latency`` (``barrier_seconds``) and ``local_bandwidth``
    (``reduction_bandwidth``, bytes/s) for this exchange, and the cores the node's ranks may run on together."""

    barrier_seconds: float
    reduction_bandwidth: float
    cores: int


class HierarchicalAllReduce:
    """Reduce tensors of fixed slots (sizes in bytes, ``slot_bytes``) over ``group``: shared memory inside each
    node, a ring across nodes. Collective to construct; ``node_key`` says which ranks share a node (default: the
    host name); ``wait``: how a rank waits for its peers (:data:`~.shm.WAITS`); ``interrupt``: called while it waits,
    to end the wait by raising (:attr:`~.shm.NodeSharedMemory.interrupt`). Raises
    :class:`~.shm.SharedMemoryUnavailable` on every rank when a node cannot share memory.
    """

    def __init__(
        self,
        slot_bytes: Sequence[int],
        group: dist.ProcessGroup | None = None,
        node_key: object = None,
        timeout: float = 300.0,
        stats: CommStats | None = None,
        wait: str = "auto",
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        self.group = group
        self.slot_bytes = list(slot_bytes)
        self.size = dist.get_world_size(group)
        self.layout = NodeLayout.gather(socket.gethostname() if node_key is None else node_key, group)
        check_uniform(self.layout)  # before any segment exists
        self.memory = NodeSharedMemory(self.layout, slot_bytes, group, timeout, wait, interrupt)
        self.cross_group = cross_node_groups(self.layout, group, timeout)
        self.cross_ring = Ring(self.cross_group) if self.cross_group is not None else None
        self.stats = stats if stats is not None else CommStats()
        self._parity = [0] * len(slot_bytes)
        self._inputs: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    @property
    def local_rank(self) -> int:
        return self.layout.local_rank

    @property
    def local_size(self) -> int:
        return self.layout.local_size

    def buffer(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's input region of ``slot``: a tensor written there is reduced without being copied in."""
        return self.memory.input(slot, numel, dtype)

    def slice(self, numel: int) -> Segment:
        """The ``(start, end)`` part of a slot's ``numel`` elements this rank reduces."""
        return chunk_bounds(numel, self.local_size)[self.local_rank]

    def measure_in_node(self, barriers: int = 50, repeats: int = 5) -> NodeProbe | None:
        """Collective over the node's ranks: this node's :class:`NodeProbe`, ``None`` for a node of one rank. The
        barrier: the median of ``barriers``. The reduction: :meth:`reduce_in_place` of the largest slot inside this
        node, every rank's input freshly written first as backward writes it, less its two barriers (the fastest of
        ``repeats``), priced as the ``2 (L - 1) / L`` of the slot's bytes the model counts. The slot's contents and
        the byte counters are as they were before; after an error on one rank the others' waits end as any
        exchange's do (the peer is named, or the timeout passes)."""
        if self.local_size == 1:
            return None
        slot = max(range(len(self.slot_bytes)), key=self.slot_bytes.__getitem__)
        region = self.memory.input(slot, self.slot_bytes[slot] // 4, torch.float32)
        kept, fresh, stats, cross_ring = region.clone(), torch.ones_like(region), self.stats, self.cross_ring
        self.stats, self.cross_ring = CommStats(), None  # this node's part alone
        try:
            self.memory.barrier()
            times = []
            for _ in range(barriers):
                start = time.perf_counter()
                self.memory.barrier()
                times.append(time.perf_counter() - start)
            barrier = statistics.median(times)
            best = float("inf")
            for _ in range(repeats):
                region.copy_(fresh)
                self.memory.barrier()
                start = time.perf_counter()
                self.reduce_in_place(region, slot, "avg")
                best = min(best, time.perf_counter() - start)
            self.memory.barrier()  # no rank restores its region while a peer still sums it
            region.copy_(kept)
        finally:
            self.stats, self.cross_ring = stats, cross_ring
        reduction = best - 2 * barrier
        if reduction < best / 2:  # a slot too small to tell its reduction from its barriers
            reduction = best
        counted = 2 * (self.local_size - 1) / self.local_size * region.numel() * 4
        return NodeProbe(barrier, counted / reduction, self.memory.cores)

    def all_reduce(self, tensor: torch.Tensor, slot: int = 0, op: ReduceOpName = "sum") -> torch.Tensor:
        """All-reduce the contiguous ``tensor`` in place and return it; bit-identical on every rank. A tensor that is
        ``slot``'s input region (see :meth:`buffer`) is reduced where it lies; any other is copied in and out."""
        self._check(op, tensor)
        flat = tensor.view(-1)
        region = self.memory.input(slot, flat.numel(), flat.dtype)
        if region.data_ptr() == flat.data_ptr():
            self.reduce_in_place(flat, slot, op)
            return tensor
        region.copy_(flat)
        flat.copy_(self.reduce_in_place(region, slot, op))
        return tensor

    def reduce_in_place(
        self,
        region: torch.Tensor,
        slot: int,
        op: ReduceOpName = "sum",
        wire_dtype: torch.dtype | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reduce this rank's input region of ``slot`` (``region``, from :meth:`buffer`) over all ranks, leaving the
        result in every rank's region; returns ``region``. ``wire_dtype``: the dtype the rings across nodes send
        (see :func:`~lightning_dp.comm.transports.ring.ring_allreduce`); inside a node values are added in
        ``region``'s dtype. ``residual`` (``region``'s shape) gains what this rank's roundings on those rings lost."""
        self._check(op, region)
        numel, dtype = region.numel(), region.dtype
        if self.memory.input(slot, numel, dtype).data_ptr() != region.data_ptr():
            raise ValueError(f"reduce_in_place takes slot {slot}'s input region (buffer()), not another tensor")
        self.memory.barrier()
        peers_arrived()
        lo, hi = self.slice(numel)
        if hi > lo:
            parts = [whole[lo:hi] for whole in self._input_regions(slot, numel, dtype)]
            if self.cross_ring is None:
                self._sum_in_chunks(parts, op)
            else:
                summed = self.share_region(slot, numel, dtype)[lo:hi]  # not read by a slower peer
                slice_residual = residual[lo:hi] if residual is not None else None
                self._sum_slice(parts, summed, op, wire_dtype, slice_residual)
                for part in parts:
                    part.copy_(summed)
        self.memory.barrier()
        peers, element = self.local_size - 1, region.element_size()
        # as reduce_scatter + gather count it: read peers' slices, peers read this rank's sum, and the rest received
        self.stats.add(sent=2 * peers * (hi - lo) * element, received=(peers * (hi - lo) + numel - (hi - lo)) * element)
        return region

    def reduce_scatter(
        self,
        flat: torch.Tensor,
        slot: int,
        op: ReduceOpName = "sum",
        wire_dtype: torch.dtype | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reduce ``flat`` over all ranks into ``slot``'s current result region (returned); on return its
        :meth:`slice` holds the reduced values (over every node), the rest is not yet defined. Finish with
        :meth:`gather`. ``wire_dtype``: the dtype the rings across nodes send (see
        :func:`~lightning_dp.comm.transports.ring.ring_allreduce`); inside a node values are added in ``flat``'s dtype.
        ``residual`` (``flat``'s shape) gains what this rank's roundings on those rings lost."""
        self._check(op, flat)
        numel, dtype = flat.numel(), flat.dtype
        mine = self.memory.input(slot, numel, dtype)
        if mine.data_ptr() != flat.data_ptr():
            mine.copy_(flat)
        result = self.memory.result(slot, self._parity[slot], numel, dtype)
        self.memory.barrier()
        peers_arrived()
        lo, hi = self.slice(numel)
        if hi > lo:
            parts = [whole[lo:hi] for whole in self._input_regions(slot, numel, dtype)]
            slice_residual = residual[lo:hi] if residual is not None else None
            self._sum_slice(parts, result[lo:hi], op, wire_dtype, slice_residual)
            element = result.element_size()
            self.stats.add(sent=(len(parts) - 1) * (hi - lo) * element, received=(len(parts) - 1) * (hi - lo) * element)
        return result

    def gather(
        self,
        flat: torch.Tensor,
        slot: int,
        result: torch.Tensor,
        ranges: Sequence[Segment] | None = None,
        written: Segment | None = None,
        sent: int | None = None,
    ) -> None:
        """Once every rank wrote its part of ``result`` (the region :meth:`reduce_scatter` returned, or
        :meth:`share_region`): copy ``ranges`` of it (default: all) into ``flat``. Collective on the node: every
        rank calls it, with its own ranges (possibly none).

        For the byte counts: this rank wrote ``written`` of ``result`` (default its :meth:`slice`), and peers copy
        ``sent`` elements of it (default: every peer all of it). Shared-memory traffic counts as *received* the
        bytes a rank copies out of memory a peer wrote, and as *sent* the bytes of its own writes that peers copy.
        """
        self.memory.barrier()
        ranges = [(0, flat.numel())] if ranges is None else ranges
        for start, end in ranges:
            if end > start:
                flat[start:end].copy_(result[start:end])
        self._parity[slot] ^= 1
        lo, hi = self.slice(flat.numel()) if written is None else written
        sent = (self.local_size - 1) * (hi - lo) if sent is None else sent
        own = sum(overlap((start, end), (lo, hi)) for start, end in ranges)
        element = flat.element_size()
        self.stats.add(sent=sent * element, received=(sum(e - s for s, e in ranges) - own) * element)

    def share_region(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The result region the next :meth:`gather` of ``slot`` reads: write this rank's values there first."""
        return self.memory.result(slot, self._parity[slot], numel, dtype)

    def _input_regions(self, slot: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        key = (slot, numel, dtype)
        if key not in self._inputs:
            self._inputs[key] = [self.memory.input(slot, numel, dtype, r) for r in range(self.local_size)]
        return self._inputs[key]

    def _sum_in_chunks(self, parts: list[torch.Tensor], op: ReduceOpName) -> None:
        """Write the reduction of the equal-length ``parts`` (summed in list order) back into each of them, a chunk
        at a time, so that each chunk is read from memory once and its sum is written from cache."""
        dtype = parts[0].dtype
        accumulate = torch.float32 if op == "avg" and divides_first(dtype) else dtype
        chunk = max(1, CHUNK_BYTES // parts[0].element_size())
        scratch = self._scratch.get(accumulate)
        if scratch is None or scratch.numel() < min(chunk, parts[0].numel()):
            scratch = self._scratch[accumulate] = torch.empty(min(chunk, parts[0].numel()), dtype=accumulate)
        for start in range(0, parts[0].numel(), chunk):
            pieces = [part[start : start + chunk] for part in parts]
            total = scratch[: pieces[0].numel()]
            self._sum_slice(pieces, total, op, None, None)
            for piece in pieces:
                piece.copy_(total)

    def _sum_slice(
        self,
        parts: list[torch.Tensor],
        out: torch.Tensor,
        op: ReduceOpName,
        wire_dtype: torch.dtype | None,
        residual: torch.Tensor | None,
    ) -> None:
        """``out`` = the reduction of ``parts`` (in list order) over every node: summed here, then on the ring across
        nodes, divided by the group size for ``avg`` (16-bit floats: summed in float32 and divided before the ring;
        ``out`` may be float32 then)."""
        if op == "avg" and divides_first(parts[0].dtype):
            if out.dtype == torch.float32:
                out.copy_(parts[0])
                total = out
            else:
                total = parts[0].float()
            for part in parts[1:]:
                total.add_(part)
            total.div_(self.size)
            if total is not out:
                out.copy_(total)
            if self.cross_ring is not None:
                ring_allreduce(
                    out, op="sum", stats=self.stats, ring=self.cross_ring, wire_dtype=wire_dtype, residual=residual
                )
            return
        if len(parts) == 1:
            out.copy_(parts[0])
        else:
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)
        if self.cross_ring is not None:
            ring_allreduce(
                out, op="sum", stats=self.stats, ring=self.cross_ring, wire_dtype=wire_dtype, residual=residual
            )
        if op == "avg":
            out.div_(self.size)

    @staticmethod
    def _check(op: str, tensor: torch.Tensor) -> None:
        if op not in REDUCE_OPS:
            raise ConfigurationError(f"op={op!r} is not supported; choose one of {REDUCE_OPS}")
        if op == "avg" and not tensor.is_floating_point():
            raise ConfigurationError(f"op='avg' needs a floating point tensor, got dtype {tensor.dtype}")
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ConfigurationError("the shared-memory all-reduce takes contiguous CPU tensors")

    def close(self) -> None:
        self._inputs.clear()
        self._scratch.clear()
        self.memory.close()
