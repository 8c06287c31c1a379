"""Dedicated parameter servers on emulated hosts: a step's exchange with n trainer hosts and k server hosts against
the optimal-split formula, and ``ring_allreduce`` among the same trainers in the same run:

    t(n, k) = 2 n (n - 1) / (n² + k n - 2 k) · S / B      (k = 0: the sharded servers on the trainers = the ring's)

Every host is a network namespace behind a link shaped with tc tbf (and a netem delay); the servers are real
``python -m lightning_dp.server`` processes, the trainers run the strategies' transport
(:class:`~lightning_dp.comm.servers.DedicatedServerTransport`): push during "backward", trainer 0's control
message, the vote, the owners' optimizer step, the pull of the weights. Each trainer also times its step in parts
(:data:`PHASES`); the report shows each part's slowest trainer.

    sudo python -m benchmarks.dedicated_servers                    # n = 2, 3, 4; k = 0 .. n; S = 16 MB; 1 Gbit/s
    sudo python -m benchmarks.dedicated_servers --quick            # n = 3, S = 8 MB

Needs root and iproute2; writes results/dedicated_servers.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.netns import IFNAME, SUBNET, emulated_hosts, run_in_hosts, server_command
from benchmarks.report import pyplot, save

REPO = Path(__file__).resolve().parents[1]
#: a trainer's dedicated step, timed in parts: pushing every bucket (its own share averaged as it arrives), waiting
#: for the servers' new weights, its own share's vote and optimizer step, pulling the other trainers' weights
PHASES = ("push", "servers' weights", "own step", "pull")


def trainer(rank: int, n: int, k: int, size_mb: float, bucket_mb: float, repeats: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_dp.comm.buckets import GradientBucket
    from lightning_dp.comm.servers import (
        DedicatedServerTransport,
        MemberGroup,
        ServerPlan,
        member_shares,
        optimizer_spec,
        run_store,
    )
    from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout, hyperparameters
    from lightning_dp.comm.transports.ring import ring_allreduce
    from lightning_dp.comm.transports.shards import any_rank

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
    main = f"{SUBNET}.1"
    timeout = timedelta(minutes=5)
    store = dist.TCPStore(main, port, n, rank == 0, timeout=timeout, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank, world_size=n)
    # the gradients in buckets of --bucket-mb, as the strategies' reducer makes them (one parameter per bucket)
    numel = int(bucket_mb * 2**20) // 4
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(max(1, round(size_mb / bucket_mb)))]
    buckets = [GradientBucket(i, [p]) for i, p in enumerate(params)]
    optimizer = torch.optim.SGD(params, lr=0.0)
    # trainer 0 publishes the job's record, as a strategy's rendezvous does: the servers find the scope in it
    runs = run_store(main, port, "0", timeout, scope="lightning_dp/benchmark", publish=rank == 0)
    if rank == 0:
        runs.set("num_trainers", str(n))
        runs.set("num_servers", str(k))
    members = MemberGroup(runs, rank, n, k, timeout)
    transport = DedicatedServerTransport(members, member_shares(n, k, True), False, None, None, timeout)
    transport.bind(buckets)
    if rank == 0:
        index_of = {id(p): i for i, p in enumerate(params)}
        plan = ServerPlan([tuple(p.shape) for p in params], torch.float32, [[i] for i in range(len(params))],
                          transport.segments, [optimizer_spec(optimizer, index_of)], full_gradients=False)  # fmt: skip
        runs.set("plan", pickle.dumps(plan))  # type: ignore[arg-type]
    layout = ShardLayout(buckets, transport.segments, rank)
    sharded = ShardedOptimizer(optimizer, layout)
    control = {"hyperparameters": [hyperparameters(optimizer.param_groups[0])], "clip": None, "kwargs": {}}
    gradients = torch.randn(numel)
    #: seconds of each phase of every timed dedicated step on this trainer (see PHASES)
    phase_samples: list[list[float]] = []

    def dedicated_step() -> None:
        """What a step of the strategies does with nothing to wait for but the network: the servers step each
        bucket as it arrives (see DedicatedEngine._eager_step), the trainers their own shares after it."""
        marks = [time.perf_counter()]
        transport.arm(control)
        for bucket in buckets:  # the communication thread, bucket after bucket as backward fills them
            bucket.buffer[: bucket.grad_numel].copy_(gradients)
            bucket.flags.fill_(1)
            transport.reduce(bucket)
        transport.disarm()
        marks.append(time.perf_counter())
        assert not transport.finish_eager()
        marks.append(time.perf_counter())
        layout.take_bucket_gradients()
        any_rank(sharded.has_nonfinite_gradient(), transport.ring, torch.device("cpu"))
        sharded.step()
        for bucket in buckets:
            bucket.pack_params(*transport.owned(bucket))
        marks.append(time.perf_counter())
        transport.share_weights_all(buckets, from_servers=False)
        for bucket in buckets:
            bucket.unpack_params()
        marks.append(time.perf_counter())
        phase_samples.append([b - a for a, b in zip(marks, marks[1:])])

    def timed(fn) -> tuple[float, float]:
        """Median seconds of ``fn`` over the repeats, and how busy the machine's CPUs were meanwhile."""
        fn()  # warm-up: connections, allocations
        seconds = []
        before = cpu_times()
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
        after = cpu_times()
        busy = 1 - (after[1] - before[1]) / max(1, after[0] - before[0])
        return statistics.median(seconds), busy

    result, busy = {}, {}
    result["dedicated"], busy["dedicated"] = timed(dedicated_step)
    mine = {phase: statistics.median(sample[i] for sample in phase_samples[1:]) for i, phase in enumerate(PHASES)}
    every: list = [None] * n
    dist.all_gather_object(every, mine)
    phases = {phase: max(trainer[phase] for trainer in every) for phase in PHASES}
    if k == 0:
        result["ring_allreduce"], busy["ring_allreduce"] = timed(lambda: [ring_allreduce(b.buffer) for b in buckets])
    if rank == 0:
        transport.stop_servers()
        Path(out).write_text(json.dumps({"seconds": result, "cpu_busy": busy, "phases_s": phases}))
    dist.barrier()
    members.close()
    dist.destroy_process_group()


def cpu_times() -> tuple[int, int]:
    """The machine's (total, idle) CPU jiffies from /proc/stat (not namespaced: the whole machine)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


def measure(
    n: int, k: int, size_mb: float, bucket_mb: float, rate_mbit: float, delay_ms: float, repeats: int, tmp: Path
) -> dict:
    out = tmp / f"n{n}k{k}.json"
    port = 29600 + 10 * n + k
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with emulated_hosts(n + k, rate_mbit, delay_ms) as hosts:
        worker = [sys.executable, "-m", "benchmarks.dedicated_servers", "--worker"]
        sizes = [str(size_mb), str(bucket_mb), str(repeats), str(port), str(out)]
        trainers = [(hosts[r], [*worker, str(r), str(n), str(k), *sizes]) for r in range(n)]
        dedicated = [(hosts[n + j], server_command(f"{SUBNET}.1", port, j, k)) for j in range(k)]
        run_in_hosts([*trainers, *dedicated], env, 900)
    from lightning_dp.comm.cost import dedicated_exchange_seconds as communication_time

    measured = json.loads(out.read_text())
    s, b = size_mb * 2**20, rate_mbit * 1e6 / 8
    return {"trainers": n, "servers": k, "size_mb": size_mb, "bucket_mb": bucket_mb, "repeats": repeats,
            "rate_mbit": rate_mbit, "delay_ms": delay_ms, "measured_s": measured["seconds"],
            "cpu_busy": measured["cpu_busy"], "formula_s": communication_time(n, k, s, b),
            "phases_s": measured["phases_s"]}  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, n, k, size_mb, bucket_mb, repeats, port, out = sys.argv[2:10]
        trainer(int(rank), int(n), int(k), float(size_mb), float(bucket_mb), int(repeats), int(port), out)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="n = 3 only, S = 8 MB")
    parser.add_argument("--trainers", type=int, nargs="+", default=None, help="n (default 2 3 4)")
    parser.add_argument("--size-mb", type=float, default=None, help="S (default 16)")
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size (the strategies' bucket_cap_mb)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to each link (netem)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--servers", type=int, nargs="+", default=None,
                        help="only these k (default 0 .. n); k = 0 (the ring baseline) always runs")  # fmt: skip
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks.dedicated_servers needs root (network namespaces and tc)")
    args.trainers = args.trainers or ([3] if args.quick else [2, 3, 4])
    args.size_mb = args.size_mb or (8.0 if args.quick else 16.0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.trainers:
            ring = None
            for k in range(n + 1) if args.servers is None else sorted({0, *args.servers}):
                row = measure(
                    n, k, args.size_mb, args.bucket_mb, args.rate_mbit, args.delay_ms, args.repeats, Path(tmp)
                )
                if "ring_allreduce" in row["measured_s"]:
                    ring = (row["measured_s"]["ring_allreduce"], row["cpu_busy"]["ring_allreduce"])
                assert ring is not None
                row["ring_allreduce_s"], row["ring_cpu_busy"] = ring
                print(json.dumps(row), flush=True)
                rows.append(row)
    name = "dedicated_servers" if args.rate_mbit == 1000 else f"dedicated_servers_{args.rate_mbit:g}mbit"
    save(args.out, name, rows, report_lines)
    plot(rows, Path(args.out) / f"{name}.png")


def report_lines(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first)."""
    r0 = rows[0]
    lines = [
        f"Machine: {os.cpu_count()} CPUs; every host a network namespace whose link is shaped with tc tbf to "
        f"{r0['rate_mbit']:g} Mbit/s both ways plus {r0['delay_ms']:g} ms netem delay; S = {r0['size_mb']:g} MB of "
        f"float32 gradients in buckets of {r0['bucket_mb']:g} MB; median of {r0['repeats']} steps",
        "",
        "| trainers n | servers k | measured s | t(n, k) s | measured / t(n, k) | CPUs busy | ring_allreduce s "
        "| ring's CPUs busy | speed-up over ring (measured) | speed-up (formula) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n, k, m, t, ring = (
            r["trainers"],
            r["servers"],
            r["measured_s"]["dedicated"],
            r["formula_s"],
            r["ring_allreduce_s"],
        )
        formula = (2 * (n - 1) / n) / (t * r["rate_mbit"] * 1e6 / 8 / (r["size_mb"] * 2**20))
        lines.append(f"| {n} | {k} | {m:.3f} | {t:.3f} | {m / t:.2f} | {r['cpu_busy']['dedicated']:.0%} | {ring:.3f} | "
                     f"{r['ring_cpu_busy']:.0%} | {ring / m:.2f} | {formula:.2f} |")  # fmt: skip
    timed = [r for r in rows if "phases_s" in r]
    if timed:
        lines += [
            "",
            "Where a trainer's step goes, seconds (median over the steps, slowest trainer per phase): push (every "
            "bucket's shares sent to their owners, this trainer's own share received and averaged), the servers' "
            "new weights (waited for after the push), own step (vote and the optimizer on its own share), pull (the "
            "other trainers' new weights). The formula gives push and pull t(n, k) / 2 each.",
            "",
            "| trainers n | servers k | push | servers' weights | own step | pull "
            "| (push + weights + pull) / t(n, k) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in timed:
            ph = r["phases_s"]
            cells = " | ".join(f"{ph[p]:.3f}" for p in PHASES)
            network = (ph["push"] + ph["servers' weights"] + ph["pull"]) / r["formula_s"]
            lines.append(f"| {r['trainers']} | {r['servers']} | {cells} | {network:.2f} |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """Measured exchange time against the formula's, over the number of server hosts."""
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in sorted({r["trainers"] for r in rows}):
            sel = [r for r in rows if r["trainers"] == n]
            line = ax.plot(
                [r["servers"] for r in sel], [r["measured_s"]["dedicated"] for r in sel], "o-", label=f"n={n} measured"
            )
            ax.plot([r["servers"] for r in sel], [r["formula_s"] for r in sel], "--", color=line[0].get_color(),
                    label=f"n={n} t(n, k)")  # fmt: skip
        ax.set_xlabel("dedicated server hosts k")
        ax.set_ylabel("seconds per step's exchange")
        ax.set_title(f"{rows[0]['size_mb']:g} MB at {rows[0]['rate_mbit']:g} Mbit/s: measured vs formula")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
