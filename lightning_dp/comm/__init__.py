"""Synchronization algorithms on plain ``torch.distributed`` (no Lightning import here).

Collectives (:mod:`.ring`, :mod:`.parameter_server`), the transports and codecs built on them
(:mod:`.transports`, :mod:`.codecs`), gradient buckets (:mod:`.buckets`), the sharded optimizer
(:mod:`.sharded_optimizer`), and the error family (:mod:`.errors`).
"""

from lightning_dp.comm.buckets import BucketReducer, GradientBucket
from lightning_dp.comm.codecs import Codec
from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout
from lightning_dp.comm.stats import CommStats, SyncStats
from lightning_dp.comm.transports import CentralServerTransport, RingTransport, ShardedServerTransport, Transport
from lightning_dp.comm.transports.ring import Ring, chunk_bounds, ring_allgather, ring_allreduce, ring_reduce_scatter
from lightning_dp.comm.transports.shards import (
    any_rank,
    pull_shards,
    pull_weights,
    push_gradients,
    push_shards,
    shard_segments,
)

__all__ = [
    "BucketReducer",
    "CentralServerTransport",
    "Codec",
    "CommStats",
    "GradientBucket",
    "Ring",
    "RingTransport",
    "ShardLayout",
    "ShardedOptimizer",
    "ShardedServerTransport",
    "SyncStats",
    "Transport",
    "any_rank",
    "chunk_bounds",
    "pull_shards",
    "pull_weights",
    "push_gradients",
    "push_shards",
    "ring_allgather",
    "ring_allreduce",
    "ring_reduce_scatter",
    "shard_segments",
]
