"""Collectives benchmark (no Lightning), in one run: this project's shared-memory all-reduce and its ring
all-reduce, gloo's all_reduce, MPI's Allreduce (mpi4py, if installed), the central and the sharded parameter
server (push + pull), the point-to-point bandwidth of the TCP transport, and a memory bound.

    python -m benchmarks.collectives                 # N = 2, 3, 4; buffers 1, 4, 16, 64 MB
    python -m benchmarks.collectives --quick         # N = 2, 3; buffers 1, 4, 16 MB; fewer repeats

Bus bandwidth follows nccl-tests: busbw = S / t * 2 (N - 1) / N, the rate each rank's link must sustain for an
all-reduce of S bytes in t seconds; a bandwidth-optimal algorithm approaches the point-to-point bandwidth.
Times are medians over repeats of the slowest rank. The shared-memory all-reduce runs twice: averaging a tensor that
lies in its input region (``shm_in_place``, where the strategies' buckets live) and averaging one that it copies
in and the result back out (``shm_allreduce``, as a caller with its own tensor pays). The memory bound is one process
copying S bytes between two warm buffers (``copy_``), alone on the machine. Writes results/collectives.{json,md,png}
(``--name`` another name).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.report import pyplot, save
from lightning_dp.comm import Ring, ring_allreduce
from lightning_dp.comm.transports.hierarchical import HierarchicalAllReduce
from lightning_dp.comm.transports.shards import (
    pull_shards,
    pull_weights,
    push_gradients,
    push_shards,
    shard_segments,
)
from lightning_dp.comm.transports.shm import WAITS

MB = 1024 * 1024
#: the collectives plotted, one line each
PLOTTED = ("shm_in_place", "shm_allreduce", "mpi_allreduce", "ring_allreduce", "gloo_all_reduce", "central_ps")
PLOTTED += ("sharded_ps",)


def timed(fn, repeats: int, warmup: int = 1) -> float:
    """Median over ``repeats`` of the slowest rank's time for ``fn()``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed))
    return statistics.median(samples)


def _operations(rank, buf, peer_buf, segments, ring, shm, region):
    """The timed operations on one buffer, by name."""

    def p2p():
        # one link, one direction: rank 0 sends S bytes to rank 1
        if rank == 0:
            dist.send(buf, dst=1)
        elif rank == 1:
            dist.recv(peer_buf, src=0)

    return {
        "p2p": p2p,
        "shm_allreduce": lambda: shm.all_reduce(buf, op="avg"),
        "shm_in_place": lambda: shm.all_reduce(region, op="avg"),
        "ring_allreduce": lambda: ring_allreduce(buf, ring=ring),
        "gloo_all_reduce": lambda: dist.all_reduce(buf),
        "central_ps": lambda: (push_gradients(buf, 0), pull_weights(buf, 0)),
        "sharded_ps": lambda: (push_shards(buf, segments), pull_shards(buf, segments)),
    }


def measure(rank: int, world_size: int, sizes_mb: list[float], repeats: int, shm_wait: str) -> list[dict]:
    rows = []
    ring = Ring()
    shm = HierarchicalAllReduce([int(max(sizes_mb) * MB) // 4 * 4], wait=shm_wait)
    for size_mb in sizes_mb:
        numel = int(size_mb * MB) // 4
        nbytes = numel * 4
        buf = torch.randn(numel)
        segments = shard_segments([numel], [4], world_size)[0]
        region = shm.buffer(0, numel, torch.float32)  # where the strategies' buckets live
        region.copy_(buf)
        ops = _operations(rank, buf, torch.empty(numel), segments, ring, shm, region)
        times = {name: timed(fn, repeats) for name, fn in ops.items()}
        link = nbytes / times["p2p"]
        for name, t in times.items():
            row = {"world_size": world_size, "size_mb": size_mb, "op": name, "time_s": t}
            if name == "p2p":
                row["bandwidth_GBps"] = link / 1e9
            else:
                busbw = nbytes / t * 2 * (world_size - 1) / world_size
                row["busbw_GBps"] = busbw / 1e9
                row["busbw_vs_p2p"] = busbw / link
                row["vs_gloo"] = times["gloo_all_reduce"] / t
            rows.append(row)
        if rank == 0:
            summary = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items())
            print(f"N={world_size} S={size_mb} MB: {summary}", flush=True)
    shm.close()
    return rows


def memory_copy_seconds(size_mb: float, repeats: int) -> float:
    """Median time of one process copying ``size_mb`` between two warm buffers."""
    torch.set_num_threads(1)
    src = torch.randn(int(size_mb * MB) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


#: why MPI's Allreduce is missing from the results, per world size (mpiexec could not run it)
MPI_SKIPPED: dict[int, str] = {}


def run_mpi(world_size: int, sizes_mb, repeats) -> list[dict]:
    """MPI's Allreduce through ``mpiexec`` (benchmarks/mpi_allreduce.py); none when mpi4py is not installed, or
    when mpiexec fails (the reason is printed and kept in :data:`MPI_SKIPPED` for the report)."""
    import importlib.util
    import json
    import shutil
    import subprocess
    import sys

    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if importlib.util.find_spec("mpi4py") is None or mpiexec is None:
        return []
    cmd = [mpiexec, "-n", str(world_size), sys.executable, "-m", "benchmarks.mpi_allreduce", "--sizes-mb"]
    cmd += [str(s) for s in sizes_mb] + ["--repeats", str(repeats)]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        said = (error.stderr or "").strip().splitlines()[-1:] if isinstance(error.stderr, str) else []
        what = f"exited {error.returncode}" if isinstance(error, subprocess.CalledProcessError) else "timed out"
        reason = f"mpiexec {what}{': ' + said[0] if said else ''}"
        MPI_SKIPPED[world_size] = reason
        print(f"MPI's Allreduce skipped for N = {world_size}: {reason}", file=sys.stderr, flush=True)
        return []
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def add_peers(rows: list[dict], world_size: int, sizes_mb, repeats) -> None:
    """Add MPI's Allreduce and the memory bound to the rows of one world size, with the same ratios."""
    for mpi in run_mpi(world_size, sizes_mb, repeats):
        rows.append({**mpi, "op": "mpi_allreduce"})
    for size_mb in sizes_mb:
        rows.append(
            {"world_size": world_size, "size_mb": size_mb, "op": "memory_copy",
             "time_s": memory_copy_seconds(size_mb, repeats)}
        )  # fmt: skip
    for size_mb in sizes_mb:
        by = {r["op"]: r for r in rows if (r["world_size"], r["size_mb"]) == (world_size, size_mb)}
        nbytes = int(size_mb * MB) // 4 * 4
        by["memory_copy"]["bandwidth_GBps"] = nbytes / by["memory_copy"]["time_s"] / 1e9
        if "mpi_allreduce" in by:
            mpi = by["mpi_allreduce"]
            mpi["busbw_GBps"] = nbytes / mpi["time_s"] * 2 * (world_size - 1) / world_size / 1e9
            mpi["vs_gloo"] = by["gloo_all_reduce"]["time_s"] / mpi["time_s"]
        for shm in (by["shm_allreduce"], by["shm_in_place"]):
            shm["vs_mpi"] = mpi["time_s"] / shm["time_s"] if "mpi_allreduce" in by else None
            shm["vs_memory_copy"] = shm["busbw_GBps"] / by["memory_copy"]["bandwidth_GBps"]


def worker(rank: int, world_size: int, port: int, sizes_mb, repeats, shm_wait, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    rows = measure(rank, world_size, sizes_mb, repeats, shm_wait)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run_local(world_size: int, sizes_mb, repeats, shm_wait: str = "auto") -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=worker, args=(r, world_size, port, sizes_mb, repeats, shm_wait, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join(timeout=120)
    return rows


def report_lines(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first); rows of op ``mpi_skipped`` say why MPI did not run."""
    lines = [
        f"Machine: {os.cpu_count()} CPUs, torch {torch.__version__}; gloo over loopback TCP; "
        "MPI: the MPICH wheel (its shared-memory transport inside the node)",
        "",
        "| N | S (MB) | shm busbw GB/s | shm / gloo | shm / MPI | shm / memory copy | shm copied in+out busbw "
        "| ring busbw | ring / gloo | gloo busbw | MPI busbw | memory copy GB/s | p2p GB/s | central PS busbw "
        "| sharded PS busbw |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    skipped = [f"MPI skipped for N = {r['world_size']}: {r['reason']}" for r in rows if r["op"] == "mpi_skipped"]
    rows = [r for r in rows if r["op"] != "mpi_skipped"]
    key = lambda r: (r["world_size"], r["size_mb"])  # noqa: E731
    for n, size in sorted({key(r) for r in rows}):
        by = {r["op"]: r for r in rows if key(r) == (n, size)}
        shm, mpi = by["shm_in_place"], by.get("mpi_allreduce")
        mpi_cells = (f"{shm['vs_mpi']:.2f}", f"{mpi['busbw_GBps']:.2f}") if mpi else ("n/a", "n/a")
        lines.append(
            f"| {n} | {size:g} | {shm['busbw_GBps']:.2f} | {shm['vs_gloo']:.2f} | {mpi_cells[0]} | "
            f"{shm['vs_memory_copy']:.2f} | {by['shm_allreduce']['busbw_GBps']:.2f} | "
            f"{by['ring_allreduce']['busbw_GBps']:.2f} | "
            f"{by['ring_allreduce']['vs_gloo']:.2f} | {by['gloo_all_reduce']['busbw_GBps']:.2f} | {mpi_cells[1]} | "
            f"{by['memory_copy']['bandwidth_GBps']:.2f} | {by['p2p']['bandwidth_GBps']:.2f} | "
            f"{by['central_ps']['busbw_GBps']:.2f} | {by['sharded_ps']['busbw_GBps']:.2f} |"
        )
    if skipped:
        lines += ["", *skipped]
    return lines


def plot(rows: list[dict], out: Path, name: str = "collectives") -> None:
    """results/<name>.png: bus bandwidth against buffer size, one panel per N, one line per method."""
    rows = [r for r in rows if r["op"] != "mpi_skipped"]
    key = lambda r: (r["world_size"], r["size_mb"])  # noqa: E731
    plt = pyplot()
    if plt is None:
        return
    sizes = sorted({n for n, _ in map(key, rows)})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for op in PLOTTED:
            pts = sorted((r["size_mb"], r["busbw_GBps"]) for r in rows if r["world_size"] == n and r["op"] == op)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
        for op, style, label in (("p2p", "k--", "p2p link (TCP)"), ("memory_copy", "k:", "memory copy")):
            pts = sorted((r["size_mb"], r["bandwidth_GBps"]) for r in rows if r["world_size"] == n and r["op"] == op)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set(xscale="log", yscale="log", xlabel="buffer (MB)", ylabel="bus bandwidth (GB/s)", title=f"N = {n}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world-sizes", type=int, nargs="+")
    parser.add_argument("--sizes-mb", type=float, nargs="+")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--shm-wait", choices=WAITS, default="auto", help="how the shared-memory ranks wait")
    parser.add_argument("--name", default="collectives", help="results/<name>.{json,md,png}")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    world_sizes = args.world_sizes or ([2, 3] if args.quick else [2, 3, 4])
    sizes = args.sizes_mb or ([1, 4, 16] if args.quick else [1, 4, 16, 64])
    repeats = args.repeats or (3 if args.quick else 7)
    rows = []
    for n in world_sizes:
        rows += run_local(n, sizes, repeats, args.shm_wait)
        add_peers(rows, n, sizes, repeats)
    rows += [{"world_size": n, "op": "mpi_skipped", "reason": reason} for n, reason in sorted(MPI_SKIPPED.items())]
    save(args.out, args.name, rows, report_lines)
    plot(rows, Path(args.out), args.name)


if __name__ == "__main__":
    main()
