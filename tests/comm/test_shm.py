"""The shared-memory all-reduce inside a node and its hierarchical form across nodes: exact results, bounded
waits that name a lost or late peer, a clean fallback signal, and nothing left in /dev/shm."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm.errors import ConfigurationError, PeerUnreachableError
from lightning_dp.comm.transports import hierarchical as hierarchical_module
from lightning_dp.comm.transports.hierarchical import HierarchicalAllReduce
from lightning_dp.comm.transports.shm import (
    NAME_PREFIX,
    SHM_DIR,
    SPIN_SECONDS,
    SharedMemoryUnavailable,
    process_alive,
    spin_seconds,
    usable_cores,
)
from tests.helpers.distributed import run_distributed, run_distributed_allow_deaths

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DTYPES += [torch.int8, torch.uint8, torch.int32, torch.int64]
SIZES = [1, 7, 65536 + 3]  # fewer elements than ranks, uneven slices, several pages


def _compare_with_gloo(rank: int, world_size: int, nodes: int, wait: str = "auto") -> list:
    """Integer-valued data in every dtype and size: the shared-memory (or hierarchical) sum equals gloo's, bit for
    bit, on every rank; a float average equals the sum divided by N. Slices are summed in chunks of an odd number
    of bytes here, so the largest size's slices span many chunks and end in a partial one."""
    hierarchical_module.CHUNK_BYTES = 4104
    node_key = rank * nodes // world_size
    slot_bytes = [max(SIZES) * 8]
    exchange = HierarchicalAllReduce(slot_bytes, node_key=node_key, timeout=60, wait=wait)
    checked = []
    for dtype in DTYPES:
        for size in SIZES:
            gen = torch.Generator().manual_seed(1000 * rank + size)
            top = 3 if dtype in (torch.int8, torch.uint8) else 50  # no overflow of the smallest types at N = 4
            data = torch.randint(0, top, (size,), generator=gen).to(dtype)
            expected = data.clone()
            dist.all_reduce(expected)
            got = exchange.all_reduce(data.clone(), op="sum")
            assert torch.equal(got, expected), (dtype, size)
            checked.append((str(dtype), size))
    reduced_bytes = sum(torch.empty(0, dtype=d).element_size() for d in DTYPES) * sum(SIZES)
    for dtype in (torch.float16, torch.bfloat16):  # averaged in float32 inside a node, divided before the ring
        k = torch.randint(0, 10, (1000,), generator=torch.Generator().manual_seed(rank)).to(dtype)
        expected = k.clone()
        dist.all_reduce(expected)  # the sum of k: exact, and the average of world_size * k
        assert torch.equal(exchange.all_reduce(k * world_size, op="avg"), expected), dtype
        reduced_bytes += 1000 * k.element_size()
    if nodes == 1:  # inexact values over many chunks: summed in float32 in rank order, divided, then rounded once
        for dtype in (torch.float16, torch.bfloat16):
            data = [torch.randn(5003, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world_size)]
            total = data[0].float()
            for part in data[1:]:
                total += part.float()
            got = exchange.all_reduce(data[rank].clone(), op="avg")
            assert torch.equal(got, (total / world_size).to(dtype)), dtype
            reduced_bytes += 5003 * got.element_size()
    data = torch.arange(10, dtype=torch.float32) * (rank + 1)
    expected = data.clone()
    dist.all_reduce(expected)
    # in its own input region: reduced without a copy in
    zero_copy = exchange.buffer(0, 10, torch.float32)
    zero_copy.copy_(data)
    assert torch.equal(exchange.all_reduce(zero_copy, op="avg"), expected / world_size)
    reduced_bytes += 10 * 4
    with pytest.raises(ValueError, match="input region"):
        exchange.reduce_in_place(data, 0)
    sent, received = exchange.stats.reset()
    layout = exchange.layout
    spin = exchange.memory.spin_seconds
    exchange.close()
    return [checked, layout.num_nodes, layout.local_size, exchange.cross_group is not None, sent, received,
            reduced_bytes, spin]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world_size", "wait"), [(2, "spin"), (3, "auto"), (4, "sleep")])
def test_equals_gloo_all_reduce_bit_for_bit_on_one_node(world_size, wait):
    ranks = run_distributed(_compare_with_gloo, world_size, 1, wait, timeout=180)
    for checked, num_nodes, local_size, hierarchical, *_ in ranks:
        assert len(checked) == len(DTYPES) * len(SIZES)
        assert (num_nodes, local_size, hierarchical) == (1, world_size, False)
    # every byte a rank reduces is read by one peer and written back into every other: over all ranks, sent and
    # received each come to 2 (L - 1) times the bytes reduced
    reduced = ranks[0][6]
    assert sum(r[4] for r in ranks) == sum(r[5] for r in ranks) == 2 * (world_size - 1) * reduced
    spins = {"spin": SPIN_SECONDS, "sleep": 0.0, "auto": SPIN_SECONDS if world_size <= usable_cores() else 0.0}
    assert [r[7] for r in ranks] == [spins[wait]] * world_size
    assert not _segments_left()


@pytest.mark.multiprocess
def test_hierarchical_two_nodes_of_two_equals_gloo():
    ranks = run_distributed(_compare_with_gloo, 4, 2, timeout=180)
    for checked, num_nodes, local_size, hierarchical, sent, received, *_ in ranks:
        assert len(checked) == len(DTYPES) * len(SIZES)
        assert (num_nodes, local_size, hierarchical) == (2, 2, True)
        assert sent > 0 and received > 0
    assert not _segments_left()


def _uneven_nodes(rank: int, world_size: int) -> str:
    try:
        HierarchicalAllReduce([64], node_key=min(rank, 1))
    except ConfigurationError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_nodes_of_unequal_size_are_refused():
    for message in run_distributed(_uneven_nodes, 3, timeout=60):
        assert "same number of ranks on every node" in message and "[1, 2]" in message


def _killed_peer(rank: int, world_size: int) -> str | None:
    exchange = HierarchicalAllReduce([4096], timeout=60)
    exchange.all_reduce(torch.ones(1024))
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        exchange.all_reduce(torch.ones(1024))
    except PeerUnreachableError as error:
        return f"{time.monotonic() - start:.1f} {error}"
    return None


@pytest.mark.multiprocess
def test_a_killed_local_rank_fails_the_others_quickly_naming_it():
    world_size = 3
    results = run_distributed_allow_deaths(_killed_peer, world_size, timeout=60)
    assert results[-1] is None  # killed
    for message in results[:-1]:
        assert message is not None
        seconds, text = message.split(" ", 1)
        assert float(seconds) < 3, message  # noticed by polling (every 0.1 s), long before the 60 s timeout
        assert f"rank {world_size - 1}" in text and "process exited" in text, text
    assert not _segments_left()


def _late_peer(rank: int, world_size: int) -> str:
    exchange = HierarchicalAllReduce([64], timeout=1.0)
    if rank == 1:
        time.sleep(3)
    start = time.monotonic()
    try:
        exchange.all_reduce(torch.ones(4))
    except PeerUnreachableError as error:
        return f"{time.monotonic() - start:.1f} {error}"
    return "no error"


@pytest.mark.multiprocess
def test_a_peer_that_never_arrives_is_named_after_the_timeout():
    results = run_distributed(_late_peer, 2, timeout=60)
    seconds, text = results[0].split(" ", 1)
    assert 0.9 < float(seconds) < 2.5, results[0]
    assert "rank 1" in text and "never arrived" in text, text


def _no_shared_memory(rank: int, world_size: int) -> str:
    import lightning_dp.comm.transports.shm as shm

    shm.SHM_DIR = "/nonexistent-lightning-dp"
    try:
        HierarchicalAllReduce([64])
    except SharedMemoryUnavailable as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_a_node_that_cannot_share_memory_is_reported_on_every_rank():
    for message in run_distributed(_no_shared_memory, 2, timeout=60):
        assert "rank 0 could not create /nonexistent-lightning-dp/" in message


@pytest.mark.unit
def test_ranks_spin_before_sleeping_only_where_they_fit_the_cores():
    cores = usable_cores()
    assert spin_seconds("auto", cores) == SPIN_SECONDS > 0
    assert spin_seconds("auto", cores + 1) == 0.0
    assert spin_seconds("spin", cores + 1) == SPIN_SECONDS and spin_seconds("sleep", 1) == 0.0
    with pytest.raises(ConfigurationError, match=r"shm_wait='busy'.*'auto', 'spin', 'sleep'"):
        spin_seconds("busy", 2)


@pytest.mark.unit
def test_a_zombie_counts_as_dead():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 5
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not process_alive(pid)  # exited, not yet reaped
    os.waitpid(pid, 0)
    assert not process_alive(pid) and process_alive(os.getpid())


def _segments_left() -> list[str]:
    return [name for name in os.listdir(SHM_DIR) if name.startswith(NAME_PREFIX)]


def _probe_in_node(rank: int, world_size: int) -> list:
    """The in-node probe on two nodes of two ranks, between two buckets' worth of real data in the slots."""
    exchange = HierarchicalAllReduce([4096, 1 << 20], node_key=rank // 2, timeout=60)
    regions = [exchange.buffer(slot, nbytes // 4, torch.float32) for slot, nbytes in enumerate(exchange.slot_bytes)]
    for slot, region in enumerate(regions):
        region.copy_(torch.randn(region.numel(), generator=torch.Generator().manual_seed(10 * rank + slot)))
    before = [r.clone() for r in regions]
    probe = exchange.measure_in_node(barriers=20, repeats=3)
    assert probe is not None
    barrier, rate, cores = probe
    restored = all(torch.equal(a, b) for a, b in zip(before, regions, strict=True))
    counters = exchange.stats.reset()
    data = torch.arange(8, dtype=torch.float32) * (rank + 1)
    expected = data.clone()
    dist.all_reduce(expected)  # across both nodes: the ring between them is back in place
    across = torch.equal(exchange.all_reduce(data, op="sum"), expected)
    exchange.close()
    alone = HierarchicalAllReduce([64], node_key=rank, timeout=60)  # a node of one rank: nothing to measure
    nothing = alone.measure_in_node()
    alone.close()
    return [barrier, rate, cores, restored, counters, across, nothing]


@pytest.mark.multiprocess
def test_the_in_node_probe_measures_the_exchange_and_leaves_it_as_it_was():
    """``measure_in_node``: a barrier and a reduction rate, positive and finite, and the node's cores; the slot's
    contents, the byte counters and the ring across nodes as they were; on a node of one rank nothing."""
    for barrier, rate, cores, restored, counters, across, nothing in run_distributed(_probe_in_node, 4, timeout=120):
        assert 0 < barrier < 1 and 0 < rate < float("inf") and cores == usable_cores()
        assert restored and counters == (0, 0) and across and nothing is None
    assert not _segments_left()
