"""Does gloo carry concurrent flows at the link's rate? Every member of n emulated hosts (1 Gbit/s links) sends S / n
bytes to every other member, all at once, through the member group the dedicated servers use
(:class:`~lightning_dp.comm.servers.MemberGroup`: pieces of ``message_bytes``, every receive posted before any
send), and, for contrast, one peer after another. The all-to-all's bound is (n - 1) / n · S / B: each host's
uplink sends that much while its downlink receives as much.

    sudo python -m benchmarks.gloo_flows                 # n = 2, 3, 4; S = 16 MB; 1 Gbit/s
    sudo python -m benchmarks.gloo_flows --quick         # n = 3

Needs root and iproute2; writes results/gloo_flows.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

from benchmarks.netns import IFNAME, SUBNET, emulated_hosts, run_in_hosts
from benchmarks.report import save

MB = 2**20
#: how the members send: every flow at once, or one peer after another (rank r sends to r + 1, r + 2, ... in turn)
PATTERNS = ("all at once", "one peer at a time")


def member(rank: int, n: int, size_mb: float, repeats: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.collectives import timed
    from lightning_dp.comm.servers.members import MemberGroup

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
    timeout = timedelta(minutes=2)
    store = dist.TCPStore(f"{SUBNET}.1", port, n, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank, world_size=n)
    members = MemberGroup(dist.PrefixStore("members", store), rank, n, 0, timeout)
    share = int(size_mb * MB) // 4 // n
    sent = {peer: torch.randn(share) for peer in range(n) if peer != rank}
    received = {peer: torch.empty(share) for peer in sent}

    def all_at_once() -> None:
        works = [members.irecv(received[peer], peer, 11) for peer in received]
        works += [members.isend(sent[peer], peer, 11) for peer in sent]
        for work in works:
            work.wait()

    def one_peer_at_a_time() -> None:
        for shift in range(1, n):
            to, source = (rank + shift) % n, (rank - shift) % n
            works = [members.irecv(received[source], source, 11), members.isend(sent[to], to, 11)]
            for work in works:
                work.wait()

    seconds = {pattern: timed(fn, repeats) for pattern, fn in zip(PATTERNS, (all_at_once, one_peer_at_a_time))}
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "message_bytes": members.message_bytes}))
    dist.barrier()
    members.close()
    dist.destroy_process_group()


def measure(n: int, size_mb: float, rate_mbit: float, repeats: int, tmp: Path) -> dict:
    out = tmp / f"n{n}.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    worker = [sys.executable, "-m", "benchmarks.gloo_flows", "--worker"]
    with emulated_hosts(n, rate_mbit) as hosts:
        commands = [(hosts[r], [*worker, str(r), str(n), str(size_mb), str(repeats), str(29650 + n), str(out)])
                    for r in range(n)]  # fmt: skip
        run_in_hosts(commands, env, 600)
    bound = (n - 1) / n * size_mb * MB / (rate_mbit * 1e6 / 8)
    measured = json.loads(out.read_text())
    return {"hosts": n, "size_mb": size_mb, "rate_mbit": rate_mbit, "repeats": repeats, "bound_s": bound,
            "measured_s": measured["seconds"], "message_bytes": measured["message_bytes"]}  # fmt: skip


def report_lines(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first)."""
    r0 = rows[0]
    piece_kib = r0.get("message_bytes", 1 << 20) / 1024  # rows without the key ran with 1 MiB pieces
    lines = [
        f"Machine: {os.cpu_count()} CPUs; every host a network namespace whose link is shaped with tc tbf to "
        f"{r0['rate_mbit']:g} Mbit/s both ways; each host sends S / n of S = {r0['size_mb']:g} MB to every other "
        f"through the dedicated servers' member group (gloo, {piece_kib:g} KiB pieces); median of {r0['repeats']}, "
        "slowest host",
        "",
        "| hosts n | bound (n - 1) / n · S / B s | all at once s | / bound | one peer at a time s | / bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, bound = r["measured_s"], r["bound_s"]
        cells = " | ".join(f"{t[p]:.3f} | {t[p] / bound:.2f}" for p in PATTERNS)
        lines.append(f"| {r['hosts']} | {bound:.3f} | {cells} |")
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, n, size_mb, repeats, port, out = sys.argv[2:8]
        member(int(rank), int(n), float(size_mb), int(repeats), int(port), out)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="n = 3 only")
    parser.add_argument("--hosts", type=int, nargs="+", default=None, help="n (default 2 3 4)")
    parser.add_argument("--size-mb", type=float, default=16.0)
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks.gloo_flows needs root (network namespaces and tc)")
    hosts = args.hosts or ([3] if args.quick else [2, 3, 4])
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, args.size_mb, args.rate_mbit, args.repeats, Path(tmp)) for n in hosts]
    save(args.out, "gloo_flows", rows, report_lines)


if __name__ == "__main__":
    main()
