"""Ring all-reduce against gloo's ``dist.all_reduce`` on 2, 3 and 4 processes."""

import math
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm import CommStats, chunk_bounds, ring_allreduce
from lightning_dp.comm.transports.ring import divides_first
from tests.helpers.distributed import run_distributed

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def lengths(world_size):
    return (0, 1, 7, world_size - 1, 1_000_003)  # the last: several pipelined pieces per chunk


@pytest.mark.unit
def test_chunk_bounds_cover_range_evenly():
    for numel in (0, 1, 5, 7, 100):
        for n in (1, 2, 3, 4, 8):
            bounds = chunk_bounds(numel, n)
            assert len(bounds) == n
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in pairwise(bounds))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1


def _integer_valued(numel, dtype, rank):
    # Small integers are exact in every dtype, so any summation order gives the same bits.
    g = torch.Generator().manual_seed(1000 * rank + numel % 997)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def _compare_with_all_reduce(rank, world_size):
    checked = 0
    for numel in lengths(world_size):
        for dtype in DTYPES:
            for op in ("sum", "avg"):
                local = _integer_valued(numel, dtype, rank)
                predivide = op == "avg" and divides_first(dtype)
                expected = local / world_size if predivide else local.clone()
                dist.all_reduce(expected)
                if op == "avg" and not predivide:
                    expected.div_(world_size)
                stats = CommStats()
                got = ring_allreduce(local, op=op, stats=stats)
                assert got is local and got.dtype == dtype and got.shape == (numel,)
                if predivide:  # 16-bit averages divide first (as DDP): inexact terms, summed in another order
                    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
                else:
                    assert torch.equal(got, expected), (numel, dtype, op)
                # every rank holds the same bits as rank 0
                reference = got.clone()
                dist.broadcast(reference, src=0)
                assert torch.equal(got.view(torch.uint8 if numel == 0 else got.dtype), reference), (numel, dtype)
                # bandwidth-optimal traffic: 2 (N - 1) chunks of about numel / N elements
                steps, size = 2 * (world_size - 1), got.element_size()
                for moved in (stats.bytes_sent, stats.bytes_received):
                    assert steps * (numel // world_size) * size <= moved <= steps * -(-numel // world_size) * size
                checked += 1
    # real-valued data: close to gloo's result (summation order differs), identical across ranks
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    expected = x.clone()
    dist.all_reduce(expected)
    ring_allreduce(x)
    torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-12)
    reference = x.clone()
    dist.broadcast(reference, src=0)
    assert torch.equal(x, reference)
    return checked


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_allreduce_matches_gloo(world_size):
    results = run_distributed(_compare_with_all_reduce, world_size, timeout=240)
    assert results == [len(lengths(world_size)) * len(DTYPES) * 2] * world_size


def _shapes_and_groups(rank, world_size):
    # non-contiguous input, 2-D shape, integer sum, and a ring on a sub-group of ranks
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (rank + 1)
    ring_allreduce(x)
    assert torch.equal(x, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * sum(range(1, world_size + 1)))
    ints = torch.full((5,), rank, dtype=torch.int64)
    ring_allreduce(ints)
    assert ints.tolist() == [sum(range(world_size))] * 5
    with pytest.raises(ValueError, match="op='avg' needs a floating point"):
        ring_allreduce(ints, op="avg")
    with pytest.raises(ValueError, match="choose one of"):
        ring_allreduce(x, op="max")
    _whole_chunks_match_pieces(rank, world_size)
    evens = dist.new_group([r for r in range(world_size) if r % 2 == 0])
    if rank % 2 == 0:
        y = torch.full((10,), float(rank))
        ring_allreduce(y, group=evens)
        assert y.tolist() == [float(sum(r for r in range(world_size) if r % 2 == 0))] * 10
    return True


def _whole_chunks_match_pieces(rank, world_size):
    """The schedule a device group (NCCL) gets, one message each way per ring step, run over gloo: the same bits as
    the pipelined pieces, residuals of a 16-bit wire included, in 2 (N - 1) batches instead of 2 (N - 1) per piece."""
    from lightning_dp.comm.transports import ring as ring_module

    posted = []
    original = ring_module.post
    ring_module.post = lambda ops, group: posted.append(len(ops)) or original(ops, group)
    try:
        results = {}
        for name, segment in (("pieces", None), ("whole", ring_module.WHOLE_CHUNKS)):
            posted.clear()
            x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(rank))
            residual = torch.zeros_like(x)
            stats = CommStats()
            ring = ring_module.Ring(segment_bytes=segment)
            ring_allreduce(x, op="sum", stats=stats, ring=ring, wire_dtype=torch.bfloat16, residual=residual)
            results[name] = (x, residual, (stats.bytes_sent, stats.bytes_received), list(posted))
    finally:
        ring_module.post = original
    (x, residual, moved, posts), (whole_x, whole_residual, whole_moved, whole_posts) = results.values()
    assert torch.equal(whole_x, x) and torch.equal(whole_residual, residual) and residual.abs().sum() > 0
    assert whole_moved == moved
    largest_chunk_bytes = math.ceil(1_000_003 / world_size) * 4
    pieces = math.ceil(largest_chunk_bytes / ring_module.HOST_SEGMENT_BYTES)
    assert pieces == 2 and posts == [2] * 2 * (world_size - 1) * pieces
    assert whole_posts == [2] * 2 * (world_size - 1)


@pytest.mark.unit
@pytest.mark.parametrize("backend, segment", [("gloo", 1 << 20), ("nccl", 1 << 62)])
def test_a_ring_over_device_memory_sends_one_message_per_step(monkeypatch, backend, segment):
    from lightning_dp.comm.transports import ring as ring_module

    monkeypatch.setattr(ring_module.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(ring_module.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(ring_module.dist, "get_world_size", lambda group=None: 4)
    ring = ring_module.Ring(group=object())
    assert ring.segment_bytes == segment and (ring.left, ring.right) == (0, 2)
    assert ring_module.Ring(group=object(), segment_bytes=4096).segment_bytes == 4096


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [3])
def test_ring_allreduce_shapes_dtypes_and_subgroups(world_size):
    assert all(run_distributed(_shapes_and_groups, world_size, timeout=60))


def _single(rank, world_size):
    x = torch.randn(10)
    before = x.clone()
    ring_allreduce(x, op="avg")
    return torch.equal(x, before)


@pytest.mark.multiprocess
def test_world_size_one_is_a_no_op():
    assert run_distributed(_single, 1, timeout=60) == [True]


def _ring_until_peer_dies(rank, world_size):
    import os
    import signal
    import time

    from lightning_dp.comm.errors import PeerUnreachableError

    x = torch.ones(100_000)
    for step in range(1000):
        if rank == world_size - 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # the last rank dies mid-training
        start = time.monotonic()
        try:
            ring_allreduce(x, op="avg")
        except PeerUnreachableError as error:
            seconds = time.monotonic() - start
            # keep this rank's sockets open a while: a survivor that exits at once could be the peer the other
            # survivor loses first, and the test checks that each names the rank that was killed
            time.sleep(2)
            return str(error), seconds
    return "no error", 0.0


@pytest.mark.multiprocess
def test_a_killed_peer_stops_the_others_with_an_error_naming_it():
    from tests.helpers.distributed import run_distributed_allow_deaths

    results = run_distributed_allow_deaths(_ring_until_peer_dies, 3, timeout=120)
    assert results[2] is None  # killed
    for rank in (0, 1):
        message, seconds = results[rank]
        assert "could not" in message and "rank" in message, message
        assert seconds < 30
    # rank 0 receives from rank 2 in the ring: it names the dead peer
    assert "rank 2" in results[0][0]


def _collective_until_peer_dies(rank, world_size):
    import os
    import signal

    import torch.distributed as dist

    from lightning_dp.comm.cluster.peers import PeerDirectory, naming_lost_peer
    from lightning_dp.comm.errors import PeerUnreachableError

    directory = PeerDirectory.build()
    x = torch.ones(1000)
    for step in range(1000):
        if rank == world_size - 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            with naming_lost_peer("a test all-reduce", directory=directory):
                dist.all_reduce(x)  # gloo's own collective: its error gives only the peer's address
        except PeerUnreachableError as error:
            return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_a_peer_lost_in_a_torch_collective_is_named_by_rank():
    from tests.helpers.distributed import run_distributed_allow_deaths

    results = run_distributed_allow_deaths(_collective_until_peer_dies, 3, timeout=120)
    assert results[2] is None
    for rank in (0, 1):
        assert f"rank {rank} could not reach rank 2 during a test all-reduce" in results[rank], results[rank]


def _large_fp16_average(rank, world_size):
    # every rank holds 40000: the sum (80000, 160000) overflows float16 (max 65504), the average does not
    x = torch.full((1001,), 40000.0, dtype=torch.float16)
    ring_allreduce(x, op="avg")
    return bool(torch.isfinite(x).all()) and bool((x == 40000.0).all())


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_float16_average_does_not_overflow_where_the_average_fits(world_size):
    assert all(run_distributed(_large_fp16_average, world_size, timeout=60))
