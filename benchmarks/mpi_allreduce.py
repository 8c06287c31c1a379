"""MPI's ``Allreduce`` (mpi4py, in place, float32, sum) for the collectives benchmark; run under ``mpiexec``.

    mpiexec -n 4 python -m benchmarks.mpi_allreduce --sizes-mb 1 4 16 64 --repeats 7

Rank 0 prints one JSON object per size: ``{"world_size", "size_mb", "time_s"}``, the median over repeats of the
slowest rank's time, measured like :func:`benchmarks.collectives.timed`. Needs ``pip install ".[mpi]"`` (mpi4py and
the MPICH wheel, whose ``mpiexec`` lands next to ``python``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

MB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=float, nargs="+", required=True)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    for size_mb in args.sizes_mb:
        buf = np.random.default_rng(comm.rank).standard_normal(int(size_mb * MB) // 4).astype(np.float32)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)  # warm-up
        samples = []
        for _ in range(args.repeats):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        if comm.rank == 0:
            row = {"world_size": comm.size, "size_mb": size_mb, "time_s": statistics.median(samples)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
