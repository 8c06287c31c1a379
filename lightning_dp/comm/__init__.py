"""Synchronization algorithms on plain ``torch.distributed`` (no Lightning import here)."""

from lightning_dp.comm.ring import Ring, chunk_bounds, ring_allgather, ring_allreduce, ring_reduce_scatter
from lightning_dp.comm.stats import CommStats

__all__ = [
    "CommStats",
    "Ring",
    "chunk_bounds",
    "ring_allgather",
    "ring_allreduce",
    "ring_reduce_scatter",
]
