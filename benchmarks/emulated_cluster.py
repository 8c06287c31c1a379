"""Emulated cluster: N hosts in network namespaces, each behind a rate-limited link to one switch, so the
network (not memory copies) is the bottleneck. Measures the communication time of one gradient exchange of S
bytes under each scheme beside the analytic time of the classic bandwidth model:

    ring all-reduce and sharded PS:   2 (N - 1) / N * S / B   (every link carries the same load)
    central PS (the server's link):   2 (N - 1) * S / B       (fan-in then fan-out through one link)

    sudo python -m benchmarks.emulated_cluster                       # N = 2, 3, 4 hosts, S = 16 MB, 1 Gbit/s
    sudo python -m benchmarks.emulated_cluster --quick               # N = 3, S = 8 MB
    sudo python -m benchmarks.emulated_cluster --rate-mbit 500 --size-mb 32

With ``--ranks-per-host L`` (M hosts of L ranks, N = M L) it compares the all-reduces instead: this project's
hierarchical form (shared memory inside a host, local rank i of every host on a ring of its own across hosts),
the flat ring over all N ranks, and gloo's; ``--delay-ms`` adds latency to every link (netem):

    flat ring:     2 (N - 1) / N * S / B + 2 (N - 1) d     (one chunk of S / N leaves each host per step)
    hierarchical:  2 (M - 1) / M * S / B + 2 (M - 1) d     (L rings of S / L share each host's link)

    sudo python -m benchmarks.emulated_cluster --world-sizes 2 --ranks-per-host 2 --delay-ms 5

Needs root and iproute2. Namespaces are named lddp-*; addresses 10.77.0.0/24 exist only inside them. All of it
is removed at the end, also on errors. Writes results/emulated_cluster.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.netns import IFNAME, SUBNET, emulated_hosts, run_in_hosts
from benchmarks.report import save

REPO = Path(__file__).resolve().parents[1]


def worker(rank: int, world_size: int, size_mb: float, repeats: int, port: int, out: str, per_host: int = 1) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.collectives import timed
    from lightning_dp.comm import ring_allreduce
    from lightning_dp.comm.transports.shards import (
        pull_shards,
        pull_weights,
        push_gradients,
        push_shards,
        shard_segments,
    )

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
    dist.init_process_group("gloo", init_method=f"tcp://{SUBNET}.1:{port}", rank=rank, world_size=world_size)
    numel = int(size_mb * 2**20) // 4
    buf = torch.randn(numel)
    segments = shard_segments([numel], [4], world_size)[0]
    if per_host > 1:
        from lightning_dp.comm.transports.hierarchical import HierarchicalAllReduce

        exchange = HierarchicalAllReduce([numel * 4], node_key=rank // per_host)
        ops = {
            "hierarchical": lambda: exchange.all_reduce(buf),
            "ring_allreduce": lambda: ring_allreduce(buf),
            "gloo_all_reduce": lambda: dist.all_reduce(buf),
        }
    else:
        ops = {
            "ring_allreduce": lambda: ring_allreduce(buf),
            "sharded_ps": lambda: (push_shards(buf, segments), pull_shards(buf, segments)),
            "central_ps": lambda: (push_gradients(buf, 0), pull_weights(buf, 0)),
            "gloo_all_reduce": lambda: dist.all_reduce(buf),
        }
    results = {name: timed(fn, repeats) for name, fn in ops.items()}
    if per_host > 1:
        exchange.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measure(
    n: int, size_mb: float, rate_mbit: float, repeats: int, tmp: Path, per_host: int = 1, delay_ms: float = 0.0
) -> dict:
    """``n`` hosts of ``per_host`` ranks each."""
    out = tmp / f"n{n}.json"
    port = 29500 + n
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the workers import benchmarks.* from any working directory
    world = n * per_host
    with emulated_hosts(n, rate_mbit, delay_ms) as hosts:
        worker = [sys.executable, "-m", "benchmarks.emulated_cluster", "--worker"]
        run_in_hosts([(ns, [*worker, str(host * per_host + local), str(world), str(size_mb), str(repeats), str(port),
                            str(out), str(per_host)])
                      for host, ns in enumerate(hosts) for local in range(per_host)], env, timeout=600)  # fmt: skip
    measured = json.loads(out.read_text())
    s, b, d = size_mb * 2**20, rate_mbit * 1e6 / 8, delay_ms / 1e3
    if per_host > 1:
        m = n
        analytic = {
            "hierarchical": 2 * (m - 1) / m * s / b + 2 * (m - 1) * d,
            "ring_allreduce": 2 * (world - 1) / world * s / b + 2 * (world - 1) * d,
            "gloo_all_reduce": 2 * (world - 1) / world * s / b + 2 * (world - 1) * d,
        }
    else:
        analytic = {
            "ring_allreduce": 2 * (n - 1) / n * s / b + 2 * (n - 1) * d,
            "sharded_ps": 2 * (n - 1) / n * s / b + 2 * d,
            "central_ps": 2 * (n - 1) * s / b + 2 * d,
            "gloo_all_reduce": 2 * (n - 1) / n * s / b + 2 * (n - 1) * d,
        }
    return {
        "hosts": n, "ranks_per_host": per_host, "world_size": world, "size_mb": size_mb, "rate_mbit": rate_mbit,
        "delay_ms": delay_ms, "measured_s": measured, "analytic_s": analytic,
    }  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, n, size_mb, repeats, port, out, per_host = sys.argv[2:9]
        worker(int(rank), int(n), float(size_mb), int(repeats), int(port), out, int(per_host))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world-sizes", type=int, nargs="+")
    parser.add_argument("--size-mb", type=float)
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[0.0], help="one-way delay added to each link")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks.emulated_cluster needs root (network namespaces and tc)")
    world_sizes = args.world_sizes or ([3] if args.quick else [2, 3, 4])
    size_mb = args.size_mb or (8.0 if args.quick else 16.0)
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for delay in args.delay_ms:
            for n in world_sizes:
                row = measure(n, size_mb, args.rate_mbit, args.repeats, Path(tmp), args.ranks_per_host, delay)
                print(json.dumps(row), flush=True)
                rows.append(row)
    name = "emulated_cluster" if args.ranks_per_host == 1 else "emulated_hierarchical"
    save(args.out, name, rows, report_lines)


def report_lines(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first)."""
    lines = [
        f"Machine: {os.cpu_count()} CPUs; hosts are network namespaces, each link shaped with tc tbf to "
        f"{rows[0]['rate_mbit']:g} Mbit/s in both directions (netem adds the delay); S = {rows[0]['size_mb']:g} MB",
        "",
        "| hosts × ranks | delay (ms) | scheme | measured s | analytic s | measured / analytic | vs ring |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for scheme, m in r["measured_s"].items():
            a = r["analytic_s"][scheme]
            lines.append(f"| {r['hosts']} × {r['ranks_per_host']} | {r['delay_ms']:g} | {scheme} | {m:.3f} | "
                         f"{a:.3f} | {m / a:.2f} | {m / r['measured_s']['ring_allreduce']:.2f} |")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
