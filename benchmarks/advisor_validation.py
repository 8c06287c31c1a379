"""Does the cost model predict the measured communication, and does it pick the fastest scheme?

A grid of emulated clusters (one rank per host, hosts in network namespaces joined by a switch in user space that
gives every link its rate and delay, benchmarks/delay_switch.c: this kernel has no netem qdisc): N hosts, link
rate, one-way latency between two hosts, and S bytes of gradients. On each, the ranks first measure
their link as ``lightning_dp.advise`` and ``CommMonitor`` do (:func:`lightning_dp.comm.cluster.probe.measure_link`, a
ping-pong), then time one synchronized step's exchange of every scheme with the transports the strategies use
(gradient buckets of the strategies' default 25 MB cap: reduce every bucket; the parameter servers also vote and
pull the weights), and the model predicts the same from the measured link (:mod:`lightning_dp.comm.cost`). Beside
the three exact schemes, whose fastest the model must name, every point also times the ring in float16 (the fp16
codec), and at 0 and 10 ms with S = 4 MB a second cluster of two ranks per host times the hierarchical ring
(shared memory inside a host) against the flat ring over the same ranks.

    sudo python -m benchmarks.advisor_validation                # N = 2,3,4 × 100M/1G × 0/1/10/50 ms × 1/4/16 MB
    sudo python -m benchmarks.advisor_validation --quick        # N = 3, 1 Gbit/s, 0 and 10 ms, 4 MB
    python -m benchmarks.advisor_validation --report            # tables and plot from results/advisor_validation.json
    python -m benchmarks.advisor_validation --repredict         # the stored measurements, the current model

Hosts get TCP settings for long fat links (benchmarks.netns.LONG_FAT_TCP: 32 MB socket buffers, no slow start
after idle), as a cluster tuned for such links would. Needs root and iproute2; writes
results/advisor_validation.{json,md} and results/advisor_map.png.
"""

from __future__ import annotations

import argparse
import functools
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


#: schemes measured beside the exact ones: the ring in 16 bits (a codec), and, on hosts of two ranks each, the ring
#: that goes through shared memory inside a host (hierarchical); neither takes part in the best-scheme count
COMPRESSED, HIERARCHICAL = "ring_allreduce+fp16", "ring_allreduce+shm"
#: the hierarchical sub-grid: two ranks per host, these latencies and this S, at every N and rate of the grid
HIERARCHICAL_LATENCIES_MS, HIERARCHICAL_SIZE_MB = (0.0, 10.0), 4.0


def worker(
    rank: int, world_size: int, ranks_per_host: int, schemes: list[str], sizes_mb: list[float], repeats: int,
    port: int, out: str,
) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    from benchmarks.collectives import timed
    from lightning_dp.comm.cluster.probe import measure_link
    from lightning_dp.comm.codecs import HalfPrecisionCodec
    from lightning_dp.comm.transports import (
        CentralServerTransport,
        RingTransport,
        ShardedServerTransport,
        SharedMemoryTransport,
    )
    from lightning_dp.comm.transports.shards import any_rank

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
    dist.init_process_group("gloo", init_method=f"tcp://{SUBNET}.1:{port}", rank=rank, world_size=world_size)
    link = measure_link()
    hosts = world_size // ranks_per_host
    rows = []
    for size_mb in sizes_mb:
        for name in schemes:
            buckets = grid_buckets(size_mb)  # fresh: the shared-memory transport takes its buckets' storage
            codec = None
            if name == HIERARCHICAL:
                transport = SharedMemoryTransport(node_key=f"advisor-host-{rank // ranks_per_host}")
            elif name in ("ring_allreduce", COMPRESSED):
                transport = RingTransport()
            elif name == "parameter_server":
                transport = CentralServerTransport(server=0)
            else:
                transport = ShardedServerTransport()
            transport.bind(buckets)
            if name == COMPRESSED:
                codec = HalfPrecisionCodec(torch.float16)
                codec.bind(buckets, transport)

            def step(transport=transport, name=name, buckets=buckets, codec=codec) -> None:
                for bucket in buckets:
                    codec.reduce(bucket, transport) if codec is not None else transport.reduce(bucket)
                if "ring_allreduce" not in name:
                    any_rank(False, transport.ring)  # the servers' vote on non-finite gradients
                    for bucket in buckets:
                        transport.share(bucket)  # the new weights

            seconds = timed(step, repeats)  # after a warm-up (connections, TCP windows): the slowest rank's median
            cost = grid_cost(name, hosts, ranks_per_host, link.latency, link.bandwidth, size_mb)
            rows.append({"scheme": name, "size_mb": size_mb, "measured_s": seconds, "ranks_per_host": ranks_per_host,
                         "predicted_s": cost.seconds, "rounds": cost.rounds, "buckets": len(buckets)})  # fmt: skip
            if hasattr(transport, "close"):
                transport.close()
    if rank == 0:
        measured_link = {"latency_s": link.latency, "bandwidth_Bps": link.bandwidth}
        Path(out).write_text(json.dumps({"link": measured_link, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


def grid_buckets(size_mb: float) -> list:
    """A model of S bytes, four weight matrices' worth of parameters (zeros), laid into buckets as the strategies do
    (their default 25 MB cap)."""
    import torch

    from lightning_dp.comm.buckets import GradientBucket, assign_buckets

    numel = int(size_mb * MB) // 4
    params = [torch.nn.Parameter(torch.zeros(numel // 4 + (i < numel % 4))) for i in range(4)]
    return [GradientBucket(i, [params[j] for j in idx]) for i, idx in enumerate(assign_buckets(params, 25 * MB))]


@functools.cache
def _grid_wires(size_mb: float) -> tuple:
    """The cost model's record of :func:`grid_buckets`: as they are, and in float16 (the fp16 codec's)."""
    import torch

    from lightning_dp.comm.codecs import HalfPrecisionCodec
    from lightning_dp.comm.cost import Wire

    buckets = grid_buckets(size_mb)
    return Wire(tuple(b.nbytes for b in buckets)), HalfPrecisionCodec(torch.float16).traffic(buckets)


def grid_cost(scheme: str, hosts: int, ranks_per_host: int, latency_s: float, bandwidth_bps: float, size_mb: float):
    """The cost model's step for ``scheme`` on ``hosts`` machines of ``ranks_per_host`` ranks joined by the measured
    link."""
    from lightning_dp.comm.cost import Link, Scheme, Topology, step_cost

    plain, half = _grid_wires(size_mb)
    strategy, _, option = scheme.partition("+")
    wire = half if option == "fp16" else plain
    model = Scheme(strategy, intra_node="shm" if option == "shm" else "ring",
                   compression="fp16" if option == "fp16" else "none")  # fmt: skip
    link = Link(latency_s, bandwidth_bps)
    return step_cost(model, Topology(hosts, ranks_per_host), link, wire, plain)


def measure(
    n: int, rate_mbit: float, latency_ms: float, sizes_mb: list[float], repeats: int, tmp: Path,
    schemes: list[str], ranks_per_host: int = 1,
) -> list[dict]:  # fmt: skip
    """One emulated cluster: ``n`` hosts of ``ranks_per_host`` ranks, links of ``rate_mbit``, ``latency_ms`` added
    one way host to host."""
    out = tmp / f"n{n}-{rate_mbit}-{latency_ms}-{ranks_per_host}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    port = 29600 + n
    world = n * ranks_per_host
    with delayed_hosts(n, rate_mbit, latency_ms, tcp=LONG_FAT_TCP) as hosts:
        worker = [sys.executable, "-m", "benchmarks.advisor_validation", "--worker"]
        sizes = ",".join(map(str, sizes_mb))
        args = [str(world), str(ranks_per_host), ",".join(schemes), sizes, str(repeats), str(port), str(out)]
        run_in_hosts([(hosts[rank // ranks_per_host], [*worker, str(rank), *args]) for rank in range(world)], env,
                     timeout=1200)  # fmt: skip
    result = json.loads(out.read_text())
    base = {"hosts": n, "rate_mbit": rate_mbit, "latency_ms": latency_ms, **result["link"]}
    return [{**base, **row} for row in result["rows"]]


# ---------------------------------------------------------------------------------------------------- the report
def _exact(rows: list[dict]) -> list[dict]:
    """The rows of the schemes that train exactly as one process, one rank per host: the best-scheme contest."""
    return [r for r in rows if r["scheme"] in SCHEMES and r.get("ranks_per_host", 1) == 1]


def _points(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    points: dict[tuple, dict[str, dict]] = {}
    for r in _exact(rows):
        points.setdefault((r["hosts"], r["rate_mbit"], r["latency_ms"], r["size_mb"]), {})[r["scheme"]] = r
    return points


def _errors(rows: list[dict]) -> tuple[float, float]:
    """Median and 90th percentile of |predicted − measured| / measured."""
    errors = sorted(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows)
    return statistics.median(errors), errors[min(len(errors) - 1, int(0.9 * len(errors)))]


def summarize(rows: list[dict]) -> dict:
    """The targets: prediction error of the communication time (the exact schemes'), whether the predicted best is
    the measured best (or within 5 % of it), and each further scheme's error."""
    median, p90 = _errors(_exact(rows))
    points = _points(rows)
    hits = model_ties = 0
    for schemes in points.values():
        predicted = min(schemes.values(), key=lambda r: r["predicted_s"])
        fastest = min(r["measured_s"] for r in schemes.values())
        hit = predicted["measured_s"] <= 1.05 * fastest
        hits += hit
        first, second = sorted(r["predicted_s"] for r in schemes.values())[:2]
        model_ties += not hit and second <= 1.05 * first
    others = {}
    exact = _exact(rows)
    for scheme, per_host in sorted({(r["scheme"], r.get("ranks_per_host", 1)) for r in rows if r not in exact}):
        chosen = [r for r in rows if r["scheme"] == scheme and r.get("ranks_per_host", 1) == per_host]
        label = scheme if per_host == 1 else f"{scheme} ({per_host} ranks per host)"
        others[label] = (len(chosen), *_errors(chosen))
    return {
        "median_error": median,
        "p90_error": p90,
        "measurements": len(_exact(rows)),
        "others": others,
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
        f"Prediction error |predicted − measured| / measured over {s['measurements']} measurements: median "
        f"{100 * s['median_error']:.0f} % (target ≤ 20 %), 90th percentile {100 * s['p90_error']:.0f} % (target ≤ "
        f"40 %). Predicted best scheme measured best or within 5 % of it: {s['best_hits']} of {s['points']} grid "
        f"points ({100 * s['best_hits'] / s['points']:.0f} %, target ≥ 90 %); of the other "
        f"{s['points'] - s['best_hits']}, {s['misses_the_model_called_a_tie']} are points where the model put its two "
        "fastest schemes within 5 % of each other.",
        "",
        *[
            f"- {scheme} (measured beside the contest, {count} points): median error {100 * median:.0f} %, 90th "
            f"percentile {100 * p90:.0f} %"
            for scheme, (count, median, p90) in s["others"].items()
        ],
        *([""] if s["others"] else []),
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
    others = [r for r in rows if r not in _exact(rows)]
    if others:
        lines += [
            "",
            f"Beside the contest: {COMPRESSED} is the ring with buckets in float16 (the fp16 codec); {HIERARCHICAL} "
            "runs two ranks per host, the ring through shared memory inside a host and across hosts one ring per "
            "local rank, against the flat ring over the same ranks (ring_allreduce, two ranks per host):",
            "",
            "| scheme | N hosts | ranks per host | rate | latency | S | measured s | predicted s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(others, key=lambda r: (r["scheme"], r.get("ranks_per_host", 1), r["hosts"], r["rate_mbit"],
                                               r["latency_ms"], r["size_mb"])):  # fmt: skip
            lines.append(f"| {r['scheme']} | {r['hosts']} | {r.get('ranks_per_host', 1)} | {r['rate_mbit']:g} Mbit/s | "
                         f"{r['latency_ms']:g} ms | {r['size_mb']:g} MB | {r['measured_s']:.3f} | "
                         f"{r['predicted_s']:.3f} |")  # fmt: skip
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
    from matplotlib.colors import ListedColormap

    rates = np.logspace(1, 5, 150)  # Mbit/s
    latencies = np.logspace(-2, 2.3, 150)  # ms
    colors = ["#4c72b0", "#dd8452", "#55a868", "#d0d0d0"]
    fig, axes = plt.subplots(1, len(hosts), figsize=(6 * len(hosts), 4.8), sharey=True)
    for ax, n in zip(np.atleast_1d(axes), hosts):
        winner = np.zeros((len(latencies), len(rates)))
        for i, latency in enumerate(latencies):
            for j, rate in enumerate(rates):
                times = [grid_cost(s, n, 1, latency / 1e3, rate * 1e6 / 8, size_mb).seconds for s in SCHEMES]
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
        rank, n, per_host, schemes, sizes, repeats, port, out = sys.argv[2:10]
        worker(int(rank), int(n), int(per_host), schemes.split(","), [float(s) for s in sizes.split(",")],
               int(repeats), int(port), out)  # fmt: skip
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rates-mbit", type=float, nargs="+", default=[100.0, 1000.0])
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 1.0, 10.0, 50.0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--report", action="store_true", help="only rewrite the tables and plot from the JSON")
    parser.add_argument("--repredict", action="store_true",
                        help="keep the stored measurements, predict them with the current cost model")  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    out = Path(args.out)
    if args.report or args.repredict:
        saved = load(out / "advisor_validation.json")
        rows, command, machine = saved["rows"], saved["command"], saved["machine"]
        if args.repredict:
            for row in rows:
                cost = grid_cost(row["scheme"], row["hosts"], row.get("ranks_per_host", 1), row["latency_s"],
                                 row["bandwidth_Bps"], row["size_mb"])  # fmt: skip
                row["predicted_s"], row["rounds"] = cost.seconds, cost.rounds
            marker = "; predicted again: "
            command = command.split(marker)[0] + marker + "python -m benchmarks.advisor_validation --repredict"
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
                        measured = measure(n, rate, latency, args.sizes_mb, args.repeats, Path(tmp),
                                           [*SCHEMES, COMPRESSED])  # fmt: skip
                        print(json.dumps(measured), flush=True)
                        rows += measured
                    for latency in [lat for lat in HIERARCHICAL_LATENCIES_MS if lat in args.latencies_ms]:
                        measured = measure(n, rate, latency, [HIERARCHICAL_SIZE_MB], args.repeats, Path(tmp),
                                           ["ring_allreduce", HIERARCHICAL], ranks_per_host=2)  # fmt: skip
                        print(json.dumps(measured), flush=True)
                        rows += measured
    save(out, "advisor_validation", rows, report_lines, command, machine)
    plot_map(rows, out)


if __name__ == "__main__":
    main()
