"""Does the cost model predict the measured communication, and does it pick the fastest scheme?

A grid of emulated clusters (one rank per host, hosts in network namespaces joined by a switch in user space that
gives every link its rate and delay, benchmarks/delay_switch.c: this kernel has no netem qdisc): N hosts, link
rate, one-way latency between two hosts, and S bytes of gradients. On each, the ranks first measure
their link as ``lightning_dp.advise`` and ``CommMonitor`` do (:func:`lightning_dp.comm.cluster.probe.measure_link`, a
ping-pong), then time one synchronized step's exchange of every scheme with the transports the strategies use
(gradient buckets of the strategies' default 25 MB cap: reduce every bucket; the parameter servers also vote and
pull the weights), and the model predicts the same from the measured link (:mod:`lightning_dp.comm.cost`).

    sudo python -m benchmarks.advisor_validation                # N = 2,3,4 × 100M/1G × 0/1/10/50 ms × 1/4/16 MB
    sudo python -m benchmarks.advisor_validation --quick        # N = 3, 1 Gbit/s, 0 and 10 ms, 4 MB
    python -m benchmarks.advisor_validation --report            # tables and plot from results/advisor_validation.json

Hosts get TCP settings for long fat links (benchmarks.netns.LONG_FAT_TCP: 32 MB socket buffers, no slow start
after idle), as a cluster tuned for such links would. Needs root and iproute2; writes
results/advisor_validation.{json,md} and results/advisor_map.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.netns import IFNAME, LONG_FAT_TCP, SUBNET, delayed_hosts, run_in_hosts
from benchmarks.report import command_line, load, pyplot, save

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SCHEMES = ("ring_allreduce", "parameter_server", "sharded_ps")
MB = 2**20


def worker(rank: int, world_size: int, sizes_mb: list[float], repeats: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.collectives import timed
    from lightning_dp.comm.buckets import GradientBucket, assign_buckets
    from lightning_dp.comm.cluster.probe import measure_link
    from lightning_dp.comm.cost import Scheme, Topology, Wire, step_cost
    from lightning_dp.comm.transports import CentralServerTransport, RingTransport, ShardedServerTransport
    from lightning_dp.comm.transports.shards import any_rank

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
    dist.init_process_group("gloo", init_method=f"tcp://{SUBNET}.1:{port}", rank=rank, world_size=world_size)
    link = measure_link()
    rows = []
    for size_mb in sizes_mb:
        # a model of S bytes: four weight matrices' worth of parameters, laid into buckets as the strategies do
        numel = int(size_mb * MB) // 4
        params = [torch.nn.Parameter(torch.randn(numel // 4 + (i < numel % 4))) for i in range(4)]
        buckets = [GradientBucket(i, [params[j] for j in idx]) for i, idx in enumerate(assign_buckets(params, 25 * MB))]
        for name in SCHEMES:
            if name == "ring_allreduce":
                transport = RingTransport()
            elif name == "parameter_server":
                transport = CentralServerTransport(server=0)
            else:
                transport = ShardedServerTransport()
            transport.bind(buckets)

            def step(transport=transport, name=name, buckets=buckets) -> None:
                for bucket in buckets:
                    transport.reduce(bucket)
                if name != "ring_allreduce":
                    any_rank(False, transport.ring)  # the servers' vote on non-finite gradients
                    for bucket in buckets:
                        transport.share(bucket)  # the new weights

            seconds = timed(step, repeats)  # after a warm-up (connections, TCP windows): the slowest rank's median
            wire = Wire(tuple(b.nbytes for b in buckets))
            cost = step_cost(Scheme(name, intra_node="ring"), Topology(world_size, 1), link, wire)
            rows.append({"scheme": name, "size_mb": size_mb, "measured_s": seconds,
                         "predicted_s": cost.seconds, "rounds": cost.rounds, "buckets": len(buckets)})  # fmt: skip
    if rank == 0:
        measured_link = {"latency_s": link.latency, "bandwidth_Bps": link.bandwidth}
        Path(out).write_text(json.dumps({"link": measured_link, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


def measure(n: int, rate_mbit: float, latency_ms: float, sizes_mb: list[float], repeats: int, tmp: Path) -> list[dict]:
    """One emulated cluster: ``n`` hosts, links of ``rate_mbit``, ``latency_ms`` added one way host to host."""
    out = tmp / f"n{n}-{rate_mbit}-{latency_ms}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    port = 29600 + n
    with delayed_hosts(n, rate_mbit, latency_ms, tcp=LONG_FAT_TCP) as hosts:
        worker = [sys.executable, "-m", "benchmarks.advisor_validation", "--worker"]
        sizes = ",".join(map(str, sizes_mb))
        run_in_hosts([(ns, [*worker, str(rank), str(n), sizes, str(repeats), str(port), str(out)])
                      for rank, ns in enumerate(hosts)], env, timeout=1200)  # fmt: skip
    result = json.loads(out.read_text())
    base = {"hosts": n, "rate_mbit": rate_mbit, "latency_ms": latency_ms, **result["link"]}
    return [{**base, **row} for row in result["rows"]]


# ---------------------------------------------------------------------------------------------------- the report
def _points(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    points: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        points.setdefault((r["hosts"], r["rate_mbit"], r["latency_ms"], r["size_mb"]), {})[r["scheme"]] = r
    return points


def summarize(rows: list[dict]) -> dict:
    """The targets: prediction error of the communication time, and whether the predicted best is the measured
    best (or within 5 % of it)."""
    errors = sorted(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows)
    points = _points(rows)
    hits = model_ties = 0
    for schemes in points.values():
        predicted = min(schemes.values(), key=lambda r: r["predicted_s"])
        fastest = min(r["measured_s"] for r in schemes.values())
        hit = predicted["measured_s"] <= 1.05 * fastest
        hits += hit
        first, second = sorted(r["predicted_s"] for r in schemes.values())[:2]
        model_ties += not hit and second <= 1.05 * first
    return {
        "median_error": statistics.median(errors),
        "p90_error": errors[min(len(errors) - 1, int(0.9 * len(errors)))],
        "best_hits": hits,
        "points": len(points),
        "misses_the_model_called_a_tie": model_ties,
    }


def report_lines(rows: list[dict]) -> list[str]:
    s = summarize(rows)
    lines = [
        f"Machine: {os.cpu_count()} CPUs; one rank per emulated host (network namespace), hosts joined by a switch in "
        "user space that gives each link its rate and delay (benchmarks/delay_switch.c), TCP tuned for long "
        "fat links. `latency` is the one-way delay between two hosts; `link` what the ping-pong measured. Times are "
        "the median of the repeats of one step's exchange, slowest rank; predictions (in parentheses) from the "
        "measured link.",
        "",
        f"Prediction error |predicted − measured| / measured over {len(rows)} measurements: median "
        f"{100 * s['median_error']:.0f} % (target ≤ 25 %), 90th percentile {100 * s['p90_error']:.0f} % (target ≤ "
        f"50 %). Predicted best scheme measured best or within 5 % of it: {s['best_hits']} of {s['points']} grid "
        f"points ({100 * s['best_hits'] / s['points']:.0f} %, target ≥ 90 %); of the other "
        f"{s['points'] - s['best_hits']}, {s['misses_the_model_called_a_tie']} are points where the model put its two "
        "fastest schemes within 5 % of each other.",
        "",
        "Ring time / sharded-server time, measured / predicted, by latency (the crossover: above 1 the sharded "
        "servers win):",
        "",
        "| N | rate | S | 0 ms | 1 ms | 10 ms | 50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    points = _points(rows)
    latencies = sorted({k[2] for k in points})
    for n, rate, size in sorted({(k[0], k[1], k[3]) for k in points}):
        cells = []
        for latency in latencies:
            schemes = points.get((n, rate, latency, size))
            if schemes is None:
                cells.append("-")
                continue
            ring, sharded = schemes["ring_allreduce"], schemes["sharded_ps"]
            cells.append(f"{ring['measured_s'] / sharded['measured_s']:.2f} / "
                         f"{ring['predicted_s'] / sharded['predicted_s']:.2f}")  # fmt: skip
        lines.append(f"| {n} | {rate:g} Mbit/s | {size:g} MB | {' | '.join(cells)} |")
    lines += [
        "",
        "Every grid point:",
        "",
        "| N | rate | latency | link measured | S | ring s (pred.) | central s (pred.) | sharded s (pred.) | "
        "best measured | best predicted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (n, rate, latency, size), schemes in sorted(_points(rows).items()):
        any_row = next(iter(schemes.values()))
        cells = [f"{schemes[k]['measured_s']:.3f} ({schemes[k]['predicted_s']:.3f})" for k in SCHEMES]
        best_m = min(schemes, key=lambda k: schemes[k]["measured_s"])
        best_p = min(schemes, key=lambda k: schemes[k]["predicted_s"])
        link = f"{any_row['latency_s'] * 1e3:.2f} ms, {any_row['bandwidth_Bps'] * 8 / 1e6:.0f} Mbit/s"
        lines.append(f"| {n} | {rate:g} Mbit/s | {latency:g} ms | {link} | {size:g} MB | {' | '.join(cells)} | "
                     f"{best_m} | {best_p} |")  # fmt: skip
    return lines


def plot_map(rows: list[dict], out: Path, hosts: tuple[int, ...] = (2, 4), size_mb: float = 4.0) -> None:
    """Which scheme the model predicts fastest over bandwidth × latency (one panel per N in ``hosts``, S =
    ``size_mb``; grey where the two fastest are within 5 %), with the grid's measured winners overlaid (hollow
    where the runner-up was within 5 %)."""
    plt = pyplot()
    if plt is None:
        return
    import numpy as np

    # the grid's buckets for S: four tensors of S / 4 bytes, the strategies' bucket caps
    import torch
    from matplotlib.colors import ListedColormap

    from lightning_dp.comm.buckets import GradientBucket, assign_buckets
    from lightning_dp.comm.cost import Link, Scheme, Topology, Wire, step_cost

    numel = int(size_mb * MB) // 4
    params = [torch.nn.Parameter(torch.empty(numel // 4)) for _ in range(4)]
    wire = Wire(tuple(GradientBucket(i, [params[j] for j in idx]).nbytes
                      for i, idx in enumerate(assign_buckets(params, 25 * MB))))  # fmt: skip
    rates = np.logspace(1, 5, 150)  # Mbit/s
    latencies = np.logspace(-2, 2.3, 150)  # ms
    colors = ["#4c72b0", "#dd8452", "#55a868", "#d0d0d0"]
    fig, axes = plt.subplots(1, len(hosts), figsize=(6 * len(hosts), 4.8), sharey=True)
    for ax, n in zip(np.atleast_1d(axes), hosts):
        winner = np.zeros((len(latencies), len(rates)))
        for i, latency in enumerate(latencies):
            for j, rate in enumerate(rates):
                link = Link(latency / 1e3, rate * 1e6 / 8)
                times = [step_cost(Scheme(s, "ring"), Topology(n, 1), link, wire).seconds for s in SCHEMES]
                first, second = sorted(times)[:2]
                winner[i, j] = 3 if second <= 1.05 * first else int(np.argmin(times))
        ax.pcolormesh(rates, latencies, winner, cmap=ListedColormap(colors), vmin=-0.5, vmax=3.5, shading="auto",
                      alpha=0.6)  # fmt: skip
        for (h, rate, latency, size), schemes in _points(rows).items():
            if h != n or size != size_mb:
                continue
            times = sorted(r["measured_s"] for r in schemes.values())
            best = min(schemes, key=lambda k: schemes[k]["measured_s"])
            tie = times[1] <= 1.05 * times[0]
            color = colors[SCHEMES.index(best)]
            y = max(latency, 0.012)  # 0 ms: plotted at the bottom edge
            ax.scatter([rate], [y], s=140, facecolor="white" if tie else color, edgecolor=color, linewidth=2.5,
                       zorder=3)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bandwidth per host (Mbit/s)")
        ax.set_title(f"N = {n}, S = {size_mb:g} MB")
    np.atleast_1d(axes)[0].set_ylabel("one-way latency (ms)")
    handles = [plt.Line2D([], [], marker="s", linestyle="", markersize=10, color=c) for c in colors]
    fig.legend(handles, [*SCHEMES, "within 5 %"], loc="lower center", ncol=4, fontsize=9)
    fig.suptitle("Fastest exchange: the cost model's areas, the emulated clusters' winners (hollow: a 5 % tie)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out / "advisor_map.png", dpi=100)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, n, sizes, repeats, port, out = sys.argv[2:8]
        worker(int(rank), int(n), [float(s) for s in sizes.split(",")], int(repeats), int(port), out)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rates-mbit", type=float, nargs="+", default=[100.0, 1000.0])
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 1.0, 10.0, 50.0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--report", action="store_true", help="only rewrite the tables and plot from the JSON")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    out = Path(args.out)
    if args.report:
        saved = load(out / "advisor_validation.json")
        rows, command, machine = saved["rows"], saved["command"], saved["machine"]
    else:
        if os.geteuid() != 0:
            sys.exit("benchmarks.advisor_validation needs root (network namespaces and tc)")
        if args.quick:
            args.hosts, args.rates_mbit, args.latencies_ms, args.sizes_mb = [3], [1000.0], [0.0, 10.0], [4.0]
        rows = []
        command, machine = command_line(), None
        with tempfile.TemporaryDirectory() as tmp:
            for n in args.hosts:
                for rate in args.rates_mbit:
                    for latency in args.latencies_ms:
                        measured = measure(n, rate, latency, args.sizes_mb, args.repeats, Path(tmp))
                        print(json.dumps(measured), flush=True)
                        rows += measured
    save(out, "advisor_validation", rows, report_lines, command, machine)
    plot_map(rows, out)


if __name__ == "__main__":
    main()
