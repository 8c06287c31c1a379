"""Measuring the link a run uses: a short ping-pong over its process group (for the cost model's :class:`Link`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_dp.comm.cost import Link
from lightning_dp.comm.transports.p2p import post, wait_for

#: the large message of the bandwidth probe
PROBE_BYTES = 4 * 2**20


def _round_trip(rank: int, peer: int, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """Seconds for ``tensor`` to go from group rank 0 to ``peer`` and back (measured on rank 0)."""
    start = time.perf_counter()
    if rank in (0, peer):
        other = peer if rank == 0 else 0
        for kind in ("send", "recv") if rank == 0 else ("recv", "send"):
            action = "send the link probe to" if kind == "send" else "receive the link probe from"
            wait_for(post([(kind, tensor, other, 0)], group)[0], group, other, action)
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - start


def copy_bandwidth(nbytes: int = 32 * 2**20, repeats: int = 3, device: torch.device | str = "cpu") -> float:
    """Bytes/s of a memory copy on ``device`` (what shared-memory exchanges run at), the fastest of ``repeats``."""
    source = torch.empty(nbytes // 4, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy faults the pages in
        start = time.perf_counter()
        target.copy_(source)
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def measure_link(
    group: dist.ProcessGroup | None = None,
    peer: int | None = None,
    device: torch.device | str = "cpu",
    repeats: int = 20,
    nbytes: int = PROBE_BYTES,
) -> Link:
    """Collective over ``group``: group rank 0 and ``peer`` (default the last rank: on another machine whenever
    the ranks span several, as they are numbered machine by machine) ping-pong a 4-byte message ``repeats`` times
    (latency: half the median round trip) and an ``nbytes`` message three times (bandwidth: ``nbytes`` over half
    the fastest round trip less the latency); rank 0 also times a memory copy. Every rank returns the same
    :class:`Link`. A group of one rank measures only the copy (latency 0, bandwidth that of the copy). On one
    machine the link measured is its loopback."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local = copy_bandwidth(device=device) if rank == 0 else 0.0
    if size == 1:
        return Link(0.0, local, local)
    peer = size - 1 if peer is None else peer
    if not 0 < peer < size:
        raise ValueError(f"peer={peer} must be another rank of the group, in [1, {size})")
    small = torch.zeros(1, device=device)
    trips = [_round_trip(rank, peer, small, group) for _ in range(repeats + 1)][1:]
    latency = statistics.median(trips) / 2
    large = torch.zeros(nbytes // 4, device=device)
    one_way = min(_round_trip(rank, peer, large, group) for _ in range(3)) / 2
    bandwidth = nbytes / max(one_way - latency, 1e-9)
    values = torch.tensor([latency, bandwidth, local], dtype=torch.float64, device=device)
    dist.broadcast(values, group=group, group_src=0)
    latency, bandwidth, local = values.tolist()
    return Link(latency, bandwidth, local)


def _probe_worker(rank: int, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        link = measure_link()
        if rank == 0:
            results.put((link.latency, link.bandwidth, link.local_bandwidth))
    finally:
        dist.destroy_process_group()


def measure_this_machine(timeout: float = 60.0) -> Link:
    """:func:`measure_link` between two processes this function starts on this machine (gloo over loopback): the
    link its ranks would use among themselves, without a process group of the caller's."""
    import queue
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_probe_worker, args=(rank, port, results), daemon=True) for rank in (0, 1)]
    for p in processes:
        p.start()
    try:
        latency, bandwidth, local = results.get(timeout=timeout)
    except queue.Empty:
        codes = [p.exitcode for p in processes]
        raise RuntimeError(
            f"the link probe's two processes on this machine gave no answer within {timeout:g} s "
            f"(exit codes {codes}); pass the link instead (latency and bandwidth)"
        ) from None
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return Link(latency, bandwidth, local)
