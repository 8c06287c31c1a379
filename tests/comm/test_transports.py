"""Every transport, under every codec, averages a bucket on its owners and shares it with every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dp.comm.buckets import BucketReducer
from lightning_dp.comm.codecs import Codec
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports import (
    CentralServerTransport,
    RingTransport,
    ShardedServerTransport,
    SharedMemoryServerTransport,
    SharedMemoryShardedTransport,
    SharedMemoryTransport,
)

TRANSPORTS = {
    "ring": lambda stats: RingTransport(stats=stats),
    "central": lambda stats: CentralServerTransport(1, stats=stats),
    "sharded": lambda stats: ShardedServerTransport(stats=stats),
    "shm-ring": lambda stats: SharedMemoryTransport(stats=stats),
    "shm-central": lambda stats: SharedMemoryServerTransport(1, stats=stats),
    "shm-sharded": lambda stats: SharedMemoryShardedTransport(stats=stats),
    # three nodes of one rank: nothing to share in memory, the ring across nodes does everything
    "hierarchical-ring": lambda stats: SharedMemoryTransport(stats=stats, node_key=dist.get_rank()),
}


def _buckets_of_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4), nn.Linear(4, 3))
    reducer = BucketReducer(model.parameters(), lambda b: None, bucket_cap_mb=30 * 4 / 2**20)
    reducer.close()
    return reducer.buckets


def _reduce_then_share(rank: int, world_size: int, kind: str) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4), nn.Linear(4, 3))
    reducer = BucketReducer(model.parameters(), lambda b: None, bucket_cap_mb=30 * 4 / 2**20)
    stats = CommStats()
    transport, codec = TRANSPORTS[kind](stats), Codec()
    transport.bind(reducer.buckets)
    # rank r's gradient is r + 1 everywhere, except that only rank 0 uses the last layer
    grads = {id(p): torch.full_like(p, rank + 1.0) for p in model.parameters()}
    for bucket in reducer.buckets:
        for i, p in enumerate(bucket.params):
            bucket.fill(i, None if (p is model[2].weight and rank != 0) else grads[id(p)])
    average = sum(range(1, world_size + 1)) / world_size
    owned_elements = 0
    for bucket in reducer.buckets:
        codec.reduce(bucket, transport)
        start, end = transport.owned(bucket)
        owned_elements += end - start
        expected = torch.full((end - start,), average)
        for i, p in enumerate(bucket.params):  # the unused-by-most parameter averages its one contribution
            lo, hi = bucket.slices[i]
            a, b = max(lo, start), min(hi, end)
            if p is model[2].weight and a < b:
                expected[a - start : b - start] = 1.0 / world_size
        assert torch.equal(bucket.buffer[start:end], expected), (kind, bucket.index)
    reduced_bytes = stats.reset()
    for bucket in reducer.buckets:
        codec.share(bucket, transport)
        assert (bucket.flags != 0).all()  # every parameter was used by some rank
        expected = torch.full((bucket.grad_numel,), average)
        for i, p in enumerate(bucket.params):
            if p is model[2].weight:
                expected[bucket.slices[i][0] : bucket.slices[i][1]] = 1.0 / world_size
        assert torch.equal(bucket.buffer[: bucket.grad_numel], expected), (kind, bucket.index, "after share")
    reducer.close()
    transport.close()
    # plain lists, not tensors: a worker may exit before the parent reads tensors it shares through file descriptors
    return [owned_elements, reduced_bytes, stats.reset(), [b.buffer.tolist() for b in reducer.buckets]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", sorted(TRANSPORTS))
def test_reduce_averages_on_owners_and_share_gives_everyone_the_same_bits(kind):
    from tests.helpers.distributed import run_distributed

    world_size = 3
    ranks = run_distributed(_reduce_then_share, world_size, kind, timeout=120)
    total = sum(p.numel() for p in nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4), nn.Linear(4, 3)).parameters())
    owned = [r[0] for r in ranks]
    if kind.endswith("ring"):
        assert owned == [total] * world_size
    elif kind.endswith("central"):
        assert owned == [0, total, 0]  # the server is rank 1
    else:
        # every bucket cut into equal shards (one element apart at most)
        assert sum(owned) == total and max(owned) - min(owned) <= len(_buckets_of_model())
    for r in ranks[1:]:
        for mine, theirs in zip(r[3], ranks[0][3], strict=True):
            assert mine == theirs  # identical buckets everywhere after reduce + share
    nbytes = sum(b.nbytes for b in _buckets_of_model())
    if kind.endswith("ring"):
        assert all(r[2] == (0, 0) for r in ranks)  # nothing left to share
    elif kind == "central":  # fan-in then fan-out of whole buckets (flags included), server rank 1
        assert [r[1] for r in ranks] == [(nbytes, 0), (0, 2 * nbytes), (nbytes, 0)]
        assert [r[2] for r in ranks] == [(0, nbytes), (2 * nbytes, 0), (0, nbytes)]
    elif kind == "shm-central":  # the two others copy the server's whole buckets out of shared memory
        assert [r[2] for r in ranks] == [(0, nbytes), (2 * nbytes, 0), (0, nbytes)]
    else:  # every rank's shard goes to the 2 others: the gradient regions once over (sockets: plus the flags)
        grad_bytes = sum(b.grad_numel * b.buffer.element_size() for b in _buckets_of_model())
        assert sum(r[2][0] for r in ranks) == sum(r[2][1] for r in ranks) == 2 * grad_bytes
