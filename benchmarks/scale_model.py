"""Every scheme at 64 to 4,096 ranks, on paper: the cost model on racks (:mod:`lightning_dp.comm.scale`), and how
close it comes to published scaling numbers.

Four clusters of 8-rank machines in racks of 32 (their parameters are in the report): 25 Gbit/s Ethernet over TCP
with 3 : 1 oversubscribed rack uplinks, and without oversubscription; 100 Gbit/s RDMA; 100 Gbit/s TCP with racks
0.5 ms apart, where a flow's 4 MiB window carries less than the link. Two models whose
single-GPU speed is published (TensorFlow's benchmarks, Tesla P100, batch 64): ResNet-50 and VGG-16, gradients in
25 MiB buckets. Per point: every scheme's communication, the part backward does not hide, the scaling efficiency.

The anchor: Horovod's 512-GPU benchmark (128 machines of 4 Pascal GPUs, 25 Gbit/s RoCE-capable Ethernet, batch 64,
tensor fusion in 64 MiB buffers): 90 % scaling efficiency for Inception V3 and ResNet-101, 68 % for VGG-16. The
model prices it as a ring over all 512 ranks, once with RDMA's and once with TCP's parameters.

The software cost of one message (``μ``) is measured here: two gloo processes over loopback, a burst of small
messages from one to the other.

    python -m benchmarks.scale_model                          # writes results/scale_model.{json,md,png}
    python -m benchmarks.scale_model --message-seconds 2e-5   # μ given, nothing measured
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.report import pyplot, save
from lightning_dp.comm.cost import Scheme, Wire
from lightning_dp.comm.scale import Cluster, cluster_step

MiB = 2**20
RANKS = (64, 128, 256, 512, 1024, 2048, 4096)
#: Linux's default largest TCP send buffer (net.ipv4.tcp_wmem), the window a flow can keep in flight
TCP_WINDOW = 4 * MiB
#: P100, batch 64, synthetic data (TensorFlow's published benchmarks, DGX-1): images/s of one GPU. ResNet-101 is not
#: in that table: its time per image is interpolated by forward GFLOPs between ResNet-50's and ResNet-152's.
MODELS = {
    "ResNet-50": {"parameters": 25_557_032, "images_per_second": 238.0, "gflops": 4.1},
    "ResNet-152": {"parameters": 60_192_808, "images_per_second": 95.6, "gflops": 11.5},
    "VGG-16": {"parameters": 138_357_544, "images_per_second": 132.0},
    "Inception V3": {"parameters": 23_851_784, "images_per_second": 142.0},
    "ResNet-101": {"parameters": 44_549_160, "images_per_second": None, "gflops": 7.8},
}
BATCH = 64
#: backward's share of a step's compute (a backward pass costs about twice the forward)
BACKWARD_SHARE = 2 / 3
#: Horovod's published 512-GPU scaling efficiencies
HOROVOD = {"Inception V3": 0.90, "ResNet-101": 0.90, "VGG-16": 0.68}
#: Horovod's cluster (128 machines of 4 GPUs, 25 Gbit/s) priced with RDMA's and with TCP's parameters
ANCHOR_CLUSTERS = {
    "RDMA": Cluster(512, 4, 32, 25e9 / 8, 3e-6, 5e-6, latencies_per_round=1.0),
    "TCP": Cluster(512, 4, 32, 25e9 / 8, 15e-6, 25e-6, flow_window=TCP_WINDOW, latencies_per_round=1.0),
}


def images_per_second(model: str) -> float:
    """One GPU's published images/s, or one interpolated by GFLOPs between ResNet-50's and ResNet-152's."""
    known = MODELS[model]["images_per_second"]
    if known is not None:
        return float(known)
    low, high = MODELS["ResNet-50"], MODELS["ResNet-152"]
    t0, t1 = 1 / low["images_per_second"], 1 / high["images_per_second"]
    fraction = (MODELS[model]["gflops"] - low["gflops"]) / (high["gflops"] - low["gflops"])
    return 1 / (t0 + fraction * (t1 - t0))


def schemes(machines: int) -> list[Scheme]:
    """Every scheme priced at a point; the dedicated servers as many as the trainers' ``machines``."""
    return [
        Scheme("ddp"),
        Scheme("ring_allreduce", "shm"),
        Scheme("parameter_server", "ring"),
        Scheme("sharded_ps", "ring"),
        Scheme("sharded_ps", "ring", num_servers=machines),
        Scheme("parameter_server", "ring", num_servers=machines),
    ]


def label(scheme: Scheme) -> str:
    """A scheme's name in the tables."""
    if scheme.strategy == "ring_allreduce" and scheme.intra_node == "shm":
        return "hierarchical ring"
    if scheme.strategy == "ddp":
        return "ring (ddp)"
    return scheme.strategy + (" + M servers" if scheme.num_servers else "")


def clusters(message_seconds: float) -> dict[str, Cluster]:
    """The four clusters by name (64 ranks: :func:`sweep` sets the size), with μ where a transport pays it."""
    tcp_25 = Cluster(64, 8, 32, 25e9 / 8, 15e-6, 25e-6, oversubscription=3.0, flow_window=TCP_WINDOW,
                     message_seconds=message_seconds)  # fmt: skip
    rdma_100 = Cluster(64, 8, 32, 100e9 / 8, 3e-6, 5e-6, latencies_per_round=1.0)
    apart = Cluster(64, 8, 32, 100e9 / 8, 15e-6, 250e-6, flow_window=TCP_WINDOW, message_seconds=message_seconds)
    return {
        "25 Gbit/s TCP, 3:1": tcp_25,
        "25 Gbit/s TCP, 1:1": replace(tcp_25, oversubscription=1.0),
        "100 Gbit/s RDMA": rdma_100,
        "100 Gbit/s TCP, racks 0.5 ms apart": apart,
    }


def buckets(parameters: int, cap: int) -> Wire:
    """A model's float32 gradients in buckets of ``cap`` bytes."""
    total = 4 * parameters
    whole, rest = divmod(total, cap)
    return Wire((cap,) * whole + ((rest,) if rest else ()))


def point(scheme: Scheme, cluster: Cluster, model: str, cap: int) -> dict:
    """One scheme's row: its communication, what backward leaves exposed, the scaling efficiency."""
    compute = BATCH / images_per_second(model)
    step = cluster_step(scheme, cluster, buckets(MODELS[model]["parameters"], cap))
    backward = BACKWARD_SHARE * compute
    return {
        "scheme": label(scheme),
        "ranks": cluster.ranks,
        "model": model,
        "comm_s": step.seconds,
        "latency_s": step.latency_seconds,
        "transfer_s": step.transfer_seconds,
        "exposed_s": step.exposed_seconds(backward),
        "compute_s": compute,
        "efficiency": step.efficiency(compute, backward),
    }


def sweep(message_seconds: float) -> list[dict]:
    """Every scheme at every size on every cluster, for ResNet-50 and VGG-16."""
    rows = []
    for name, base in clusters(message_seconds).items():
        for model in ("ResNet-50", "VGG-16"):
            for n in RANKS:
                cluster = replace(base, ranks=n)
                for scheme in schemes(cluster.nodes):
                    rows.append({"kind": "sweep", "cluster": name, **point(scheme, cluster, model, 25 * MiB)})
    return rows


def anchors() -> list[dict]:
    """Horovod's 512 GPUs: NCCL's ring over every rank (ρ = 1: no rendezvous per round; μ = 0: its per-message
    cost inside ``α``), 64 MiB fusion buffers, non-blocking racks of 32 machines."""
    rows = []
    for model, published in HOROVOD.items():
        for variant, cluster in ANCHOR_CLUSTERS.items():
            row = point(Scheme("ddp"), cluster, model, 64 * MiB)
            rows.append({"kind": "anchor", "cluster": f"Horovod, 25 Gbit/s {variant}", "published": published, **row})
    return rows


# ---------------------------------------------------------------------------------------------------- μ, measured
def _sender(rank: int, port: int, count: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.collectives import timed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    messages = [torch.zeros(1) for _ in range(count)]

    def burst() -> None:
        op = dist.isend if rank == 0 else dist.irecv
        works = [op(t, 1 - rank, tag=i) for i, t in enumerate(messages)]
        for work in works:
            work.wait()

    seconds = timed(burst, repeats)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "count": count}))
    dist.destroy_process_group()


def measure_message_seconds(count: int = 2000, repeats: int = 5) -> float:
    """Seconds one small message costs in a burst between two gloo processes over loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mu.json"
        worker = [sys.executable, "-m", "benchmarks.scale_model", "--worker"]
        procs = [subprocess.Popen([*worker, str(r), str(port), str(count), str(repeats), str(out)], env=env)
                 for r in (0, 1)]  # fmt: skip
        deadline = time.monotonic() + 120
        try:
            for p in procs:
                if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                    raise RuntimeError(f"the message timing process exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        measured = json.loads(out.read_text())
    return measured["seconds"] / measured["count"]


# ---------------------------------------------------------------------------------------------------- report
def cluster_rows(message_seconds: float) -> list[dict]:
    """The clusters' parameters, stored beside the points they priced."""
    rows = [{"kind": "cluster", "cluster": name, **asdict(c)} for name, c in clusters(message_seconds).items()]
    rows += [{"kind": "cluster", "cluster": f"Horovod, 25 Gbit/s {v}", **asdict(c)} for v, c in ANCHOR_CLUSTERS.items()]
    return rows


def _parameters(rows: list[dict]) -> list[str]:
    lines = [
        "| cluster | B per machine | ranks a machine, machines a rack | α in a rack / across | uplinks | window | ρ "
        "| μ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in (r for r in rows if r["kind"] == "cluster"):
        window = f"{c['flow_window'] / MiB:g} MiB × {c['flows_per_peer']}" if c["flow_window"] else "none (RDMA)"
        lines.append(
            f"| {c['cluster']} | {c['bandwidth'] * 8 / 1e9:g} Gbit/s | {c['ranks_per_node']}, {c['nodes_per_rack']} | "
            f"{c['latency'] * 1e6:g} / {c['rack_latency'] * 1e6:g} µs | {c['oversubscription']:g} : 1 | {window} | "
            f"{c['latencies_per_round']:g} | {c['message_seconds'] * 1e6:.1f} µs |"
        )
    return lines


def _sweep(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["kind"] == "sweep"]


def fastest(rows: list[dict], cluster: str, model: str, n: int) -> dict:
    """The sweep's row of the scheme with the least exposed communication at one point."""
    here = [r for r in _sweep(rows) if (r["cluster"], r["model"], r["ranks"]) == (cluster, model, n)]
    return min(here, key=lambda r: r["exposed_s"])


def best_lines(rows: list[dict]) -> list[str]:
    """The fastest scheme and its scaling efficiency at every size, per cluster and model."""
    sweep_rows = _sweep(rows)
    lines = ["| cluster | model | " + " | ".join(f"N = {n}" for n in RANKS) + " |", "|---|---|" + "---|" * len(RANKS)]
    for cluster in dict.fromkeys(r["cluster"] for r in sweep_rows):
        for model in dict.fromkeys(r["model"] for r in sweep_rows):
            cells = []
            for n in RANKS:
                best = fastest(rows, cluster, model, n)
                cells.append(f"{best['scheme']} {best['efficiency']:.0%}")
            lines.append(f"| {cluster} | {model} | " + " | ".join(cells) + " |")
    return lines


def anchor_lines(rows: list[dict]) -> list[str]:
    """Horovod's published efficiencies against the model's, with RDMA's and TCP's parameters."""
    lines = [
        "| model | published | model, RDMA | model, TCP | exposed communication, RDMA / TCP |",
        "|---|---|---|---|---|",
    ]
    anchor_rows = [r for r in rows if r["kind"] == "anchor"]
    for model in dict.fromkeys(r["model"] for r in anchor_rows):
        by = {r["cluster"].rsplit(" ", 1)[1]: r for r in anchor_rows if r["model"] == model}
        rdma, tcp = by["RDMA"], by["TCP"]
        lines.append(
            f"| {model} | {rdma['published']:.0%} | {rdma['efficiency']:.0%} | {tcp['efficiency']:.0%} | "
            f"{rdma['exposed_s'] * 1e3:.0f} / {tcp['exposed_s'] * 1e3:.0f} ms |"
        )
    return lines


def report_lines(rows: list[dict]) -> list[str]:
    """The clusters' parameters, the scaling efficiency of every scheme, the fastest scheme per size and the
    anchor (``Machine: ...`` first)."""
    sweep_rows = _sweep(rows)
    names = list(dict.fromkeys(r["scheme"] for r in sweep_rows))
    mu = sweep_rows[0]
    source = (
        f"μ measured on {mu['cpus']} CPUs, two gloo processes over loopback"
        if mu["message_seconds_measured"]
        else "μ given on the command line"
    )
    lines = [
        f"Machine: the cost model on paper (lightning_dp.comm.scale); {source}",
        "",
        *_parameters(rows),
        "",
        f"Scaling efficiency (compute / (compute + exposed communication)), batch {BATCH} a rank, P100 speeds, 25 MiB "
        "buckets; 8 ranks a machine, so M = N / 8 machines and as many dedicated servers; **bold**: the fastest",
        "",
    ]
    for cluster in dict.fromkeys(r["cluster"] for r in sweep_rows):
        for model in dict.fromkeys(r["model"] for r in sweep_rows):
            lines += [f"**{cluster}, {model}**", "", "| N | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
            for n in RANKS:
                point = [r for r in sweep_rows if (r["cluster"], r["model"], r["ranks"]) == (cluster, model, n)]
                here = {r["scheme"]: f"{r['efficiency']:.0%}" for r in point}
                best = fastest(rows, cluster, model, n)["scheme"]
                cells = [f"**{here[s]}**" if s == best else here[s] for s in names]
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += [
        "Horovod's 512 GPUs (128 machines of 4 Pascal GPUs at P100 speeds, 25 Gbit/s, batch 64, 64 MiB fusion "
        "buffers), NCCL's ring over every rank as the model prices it (ρ = 1, μ = 0)",
        "",
        *anchor_lines(rows),
    ]
    return lines


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    sweep_rows = [r for r in rows if r["kind"] == "sweep"]
    cluster_names = list(dict.fromkeys(r["cluster"] for r in sweep_rows))
    models = list(dict.fromkeys(r["model"] for r in sweep_rows))
    fig, axes = plt.subplots(len(models), len(cluster_names), figsize=(4.2 * len(cluster_names), 3.6 * len(models)),
                             sharex=True, squeeze=False)  # fmt: skip
    for i, model in enumerate(models):
        for j, cluster in enumerate(cluster_names):
            ax = axes[i][j]
            for scheme in dict.fromkeys(r["scheme"] for r in sweep_rows):
                line = [r for r in sweep_rows if (r["cluster"], r["model"], r["scheme"]) == (cluster, model, scheme)]
                ax.plot([r["ranks"] for r in line], [r["efficiency"] for r in line], marker="o", ms=3, label=scheme)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{cluster}\n{model}", fontsize=8)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("scaling efficiency")
            if i == len(models) - 1:
                ax.set_xlabel("ranks N")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, port, count, repeats, out = sys.argv[2:7]
        _sender(int(rank), int(port), int(count), int(repeats), out)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--message-seconds", type=float, default=None, help="μ (default: measured here)")
    parser.add_argument("--messages", type=int, default=2000, help="messages in the burst that measures μ")
    parser.add_argument("--quick", action="store_true", help="the same run (it takes seconds); for run_all")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.message_seconds is not None and args.message_seconds < 0:
        parser.error(f"--message-seconds must be >= 0, got {args.message_seconds}")
    if args.messages < 1:
        parser.error(f"--messages must be >= 1, got {args.messages}")
    mu = args.message_seconds if args.message_seconds is not None else measure_message_seconds(args.messages)
    rows = sweep(mu) + anchors()
    for row in rows:
        row["message_seconds_measured"] = args.message_seconds is None
        row["cpus"] = os.cpu_count()
    rows += cluster_rows(mu)
    save(args.out, "scale_model", rows, report_lines)
    plot(rows, Path(args.out) / "scale_model.png")


if __name__ == "__main__":
    main()
