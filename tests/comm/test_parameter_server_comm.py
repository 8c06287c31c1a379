"""Parameter-server exchanges on plain torch.distributed: push/pull (central and sharded), shard layout."""

from itertools import pairwise

import pytest
import torch

from lightning_dp.comm import CommStats
from lightning_dp.comm.transports.shards import (
    pull_shards,
    pull_weights,
    push_gradients,
    push_shards,
    shard_owner,
    shard_segments,
)
from tests.helpers.distributed import run_distributed


@pytest.mark.unit
def test_shard_segments_balance_bytes_at_element_granularity():
    # one huge buffer and a small one: every shard still gets a quarter of the bytes
    segments = shard_segments([1000, 10], [4, 4], 4)
    per_shard = [sum(seg[i][1] - seg[i][0] for seg in segments) for i in range(4)]
    assert sum(per_shard) == 1010 and max(per_shard) - min(per_shard) <= 1
    for seg in segments:  # contiguous cover of each buffer
        assert seg[0][0] == 0 and all(a[1] == b[0] for a, b in pairwise(seg))
    assert segments[0][0] == (0, 253) and shard_owner(252, segments[0]) == 0 and shard_owner(253, segments[0]) == 1
    # mixed element sizes are balanced by bytes
    segments = shard_segments([100, 100], [8, 2], 2)
    bytes_per_shard = [(s0[1] - s0[0]) * 8 + (s1[1] - s1[0]) * 2 for s0, s1 in zip(*segments, strict=True)]
    assert abs(bytes_per_shard[0] - bytes_per_shard[1]) <= 8
    # fewer elements than shards: some shards are empty, nothing is lost
    segments = shard_segments([3], [4], 4)
    assert sum(e - s for s, e in segments[0]) == 3
    with pytest.raises(IndexError):
        shard_owner(3, segments[0])


def _exchanges(rank, world_size, numel):
    g = torch.Generator().manual_seed(rank)
    local = torch.randint(-8, 9, (numel,), generator=g).float()
    everyone = [
        torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(r)).float() for r in range(world_size)
    ]
    mean = torch.stack(everyone).sum(0) / world_size
    results = {}
    for server in range(world_size):
        buf, stats = local.clone(), CommStats()
        push_gradients(buf, server, stats=stats)
        if rank == server:
            assert torch.equal(buf, mean)
            assert (stats.bytes_sent, stats.bytes_received) == (0, (world_size - 1) * numel * 4)
        else:
            assert torch.equal(buf, local) and stats.bytes_sent == numel * 4
        weights = torch.full((numel,), float(rank))
        stats = CommStats()
        pull_weights(weights, server, stats=stats)
        assert torch.equal(weights, torch.full((numel,), float(server)))
        expected = (world_size - 1) * numel * 4 if rank == server else 0
        assert stats.bytes_sent == expected
    segments = shard_segments([numel], [4], world_size)[0]
    buf, stats = local.clone(), CommStats()
    push_shards(buf, segments, stats=stats)
    start, end = segments[rank]
    assert torch.equal(buf[start:end], mean[start:end])
    results["push_shards"] = stats.reset()
    pulled = torch.full((numel,), -1.0)
    pulled[start:end] = float(rank)
    pull_shards(pulled, segments, stats=stats)
    owners = torch.tensor([float(shard_owner(i, segments)) for i in range(numel)])
    assert torch.equal(pulled, owners)
    results["pull_shards"] = stats.reset()
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_push_pull_exact_and_byte_counts(world_size):
    numel = 1001
    results = run_distributed(_exchanges, world_size, numel, timeout=120)
    segments = shard_segments([numel], [4], world_size)[0]
    for rank, r in enumerate(results):
        mine = (segments[rank][1] - segments[rank][0]) * 4
        assert r["push_shards"] == (numel * 4 - mine, mine * (world_size - 1))
        assert r["pull_shards"] == (mine * (world_size - 1), numel * 4 - mine)


def _one_round_sums(rank, world_size):
    from lightning_dp.comm.transports.ring import Ring
    from lightning_dp.comm.transports.shards import any_rank, sum_everywhere

    stats = CommStats()
    votes = torch.tensor([float(rank), 1.0])
    sum_everywhere(votes, stats=stats)
    assert votes.tolist() == [sum(range(world_size)), world_size]
    assert (stats.bytes_sent, stats.bytes_received) == ((world_size - 1) * 8,) * 2
    ring = Ring()
    assert any_rank(rank == world_size - 1, ring) and not any_rank(False, ring)
    # a bucket with fewer elements than ranks (empty shards) still sums its flags on every rank
    gradients = torch.full((2,), float(rank))
    flags = torch.tensor([1.0 if rank == 0 else 0.0, 1.0])
    segments = shard_segments([2], [4], world_size)[0]
    push_shards(gradients, segments, summed=flags)
    assert flags.tolist() == [1.0, float(world_size)]
    start, end = segments[rank]
    assert torch.equal(gradients[start:end], torch.full((end - start,), (world_size - 1) / 2))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_sums_everywhere_in_one_round_and_flags_ride_with_the_shards(world_size):
    run_distributed(_one_round_sums, world_size, timeout=120)
