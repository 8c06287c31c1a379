"""Transports: how the averaged values of a gradient bucket reach the ranks (the contract is
:class:`~lightning_dp.comm.transports.base.Transport`), and the collectives they are built on: the ring
(:mod:`.ring`), the servers' shard exchanges (:mod:`.shards`), shared memory (:mod:`.shm`, :mod:`.hierarchical`),
point-to-point messages (:mod:`.p2p`) and host staging of device buckets (:mod:`.staging`)."""

from lightning_dp.comm.transports.base import Segment, Transport, balanced_shards, central_shards
from lightning_dp.comm.transports.network import CentralServerTransport, RingTransport, ShardedServerTransport
from lightning_dp.comm.transports.shared_memory import (
    SharedMemoryServerTransport,
    SharedMemoryShardedTransport,
    SharedMemoryTransport,
)

__all__ = [
    "CentralServerTransport",
    "RingTransport",
    "Segment",
    "SharedMemoryServerTransport",
    "SharedMemoryShardedTransport",
    "SharedMemoryTransport",
    "ShardedServerTransport",
    "Transport",
    "balanced_shards",
    "central_shards",
]
