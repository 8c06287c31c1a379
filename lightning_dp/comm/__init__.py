"""Synchronization algorithms on plain ``torch.distributed`` (no Lightning import here).

One folder per axis of a scheme: the transports and the collectives they run (:mod:`.transports`), the codecs
(:mod:`.codecs`), the consistency models (:mod:`.consistency`), the servers (:mod:`.servers`: the sharded optimizer,
dedicated server processes) and the cluster a job runs on (:mod:`.cluster`); beside them gradient buckets
(:mod:`.buckets`), the cost model (:mod:`.cost`; on racks of machines past one switch, :mod:`.scale`), the counters
(:mod:`.stats`) and the error family (:mod:`.errors`).
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
