"""The cost model past one switch: one rack reproduces :mod:`lightning_dp.comm.cost`, and racks, windows and
per-message costs against amounts derived by hand."""

import re

import pytest

from lightning_dp.comm.cost import (
    Link,
    Scheme,
    Topology,
    Wire,
    dedicated_exchange_seconds,
    step_cost,
    trainer_share,
)
from lightning_dp.comm.scale import Cluster, cluster_step, dedicated_link_bytes
from tests.helpers.launch import REPO

pytestmark = pytest.mark.unit

S = 64 * 2**20
ALPHA, B = 20e-6, 3.125e9  # 20 µs, 25 Gbit/s
RHO, BETA, MOST = 2, 0.05, 3

SCHEMES = [
    Scheme("ddp"),
    Scheme("ring_allreduce", "ring"),
    Scheme("ring_allreduce", "shm"),
    Scheme("parameter_server", "ring"),
    Scheme("sharded_ps", "ring"),
    Scheme("sharded_ps", "ring", full_gradients=True),
    Scheme("sharded_ps", "ring", num_servers=3),
    Scheme("parameter_server", "ring", num_servers=2),
]
WIRES = {
    "plain": (Wire((S // 4,) * 4), None),
    "fp16": (Wire((S // 8,) * 4), Wire((S // 4,) * 4)),
    "powersgd": (Wire((S // 40,) * 4, passes=2, weights_compressed=False), Wire((S // 4,) * 4)),
}


def one_rack(ranks, local, **overrides):
    return Cluster(ranks, local, nodes_per_rack=64, bandwidth=B, latency=ALPHA, rack_latency=ALPHA, **overrides)


#: the switch model prices dedicated servers with trainers on machines of their own
LAYOUTS = [
    (scheme, machines, local)
    for scheme in SCHEMES
    for machines, local in [(2, 1), (3, 1), (5, 1), (2, 4), (3, 2)]
    if not (scheme.num_servers and local > 1)
]


@pytest.mark.parametrize("scheme, machines, local", LAYOUTS, ids=lambda v: v.label() if isinstance(v, Scheme) else v)
@pytest.mark.parametrize("wire", sorted(WIRES))
def test_one_rack_without_windows_is_the_switch_model(scheme, machines, local, wire):
    cluster = one_rack(machines * local, local)
    link = Link(ALPHA, B, local_bandwidth=cluster.local_bandwidth, local_latency=cluster.local_latency)
    on_wire, plain = WIRES[wire]
    expected = step_cost(scheme, Topology(machines, local), link, on_wire, plain)
    got = cluster_step(scheme, cluster, on_wire, plain)
    assert len(got.transfers) == len(expected.phases)
    assert got.latency_seconds == pytest.approx(expected.latency_seconds)
    assert got.transfer_seconds == pytest.approx(expected.transfer_seconds)
    for backward in (0.0, 0.05, 10.0):
        assert got.exposed_seconds(backward) == pytest.approx(expected.exposed_seconds(backward))


def test_a_racks_oversubscribed_uplink_bounds_the_all_to_all():
    """64 machines in 4 racks of 16, uplinks 4 : 1: each machine sends 1/64 of S to each of the 48 ranks outside
    its rack, so an uplink carries 16 · 48 / 64 · S at 16 B / 4."""
    racks = Cluster(64, 1, 16, B, ALPHA, 2 * ALPHA, oversubscription=4)
    step = cluster_step(Scheme("sharded_ps", "ring"), racks, Wire((S,)))
    push = step.transfers[0]
    uplink_seconds = 16 * 48 / 64 * S / (16 * B / 4)
    link_seconds = (1 + BETA * (MOST - 1)) * 63 / 64 * S / B
    assert uplink_seconds > link_seconds
    assert push.transfer_seconds(racks, 64) == pytest.approx(uplink_seconds)
    # without oversubscription the machines' links bind again
    full = Cluster(64, 1, 16, B, ALPHA, 2 * ALPHA)
    assert cluster_step(Scheme("sharded_ps", "ring"), full, Wire((S,))).transfers[0].transfer_seconds(
        full, 64
    ) == pytest.approx(link_seconds)
    # the ring leaves a rack once: its uplink carries what one machine's link does, 16 times as wide / 4
    ring = cluster_step(Scheme("ring_allreduce", "ring"), racks, Wire((S,)))
    assert ring.transfer_seconds == pytest.approx(2 * 63 / 64 * S / B)
    assert ring.latency_seconds == pytest.approx(2 * 63 * RHO * 2 * ALPHA)  # every round waits for the rack hop


def test_a_flows_window_caps_its_rate_and_more_flows_lift_it():
    window, rack_latency = 2 * 2**20, 1e-3  # 2 MiB in flight over a 2 ms round trip: 1.05 GB/s a flow
    per_flow = window / (2 * rack_latency)
    assert per_flow < B
    cluster = Cluster(32, 8, 2, B, ALPHA, rack_latency, flow_window=window)
    flat = cluster_step(Scheme("ddp"), cluster, Wire((S,)))
    assert flat.transfer_seconds == pytest.approx(2 * 31 / 32 * S / per_flow)
    # the hierarchical ring runs 8 rings side by side: 8 flows fill the link
    hierarchical = cluster_step(Scheme("ring_allreduce", "shm"), cluster, Wire((S,)))
    copies = 2 * 7 / 8 * S / cluster.local_bandwidth
    assert hierarchical.transfer_seconds == pytest.approx(2 * 3 / 4 * S / B + copies)
    # two connections per peer double a flow's share
    doubled = Cluster(32, 8, 2, B, ALPHA, rack_latency, flow_window=window, flows_per_peer=2)
    assert cluster_step(Scheme("ddp"), doubled, Wire((S,))).transfer_seconds == pytest.approx(
        2 * 31 / 32 * S / (2 * per_flow)
    )


def test_rounds_and_messages_decide_at_thousands_of_ranks():
    mu, buckets = 3e-6, 4
    cluster = Cluster(4096, 8, 32, B, ALPHA, 2 * ALPHA, message_seconds=mu)
    wire = Wire((S // buckets,) * buckets)
    flat = cluster_step(Scheme("ddp"), cluster, wire)
    hierarchical = cluster_step(Scheme("ring_allreduce", "shm"), cluster, wire)
    sharded = cluster_step(Scheme("sharded_ps", "ring"), cluster, wire)
    assert flat.latency_seconds == pytest.approx(2 * 4095 * buckets * (RHO * 2 * ALPHA + mu))
    local_sync = 2 * buckets * cluster.local_latency
    assert hierarchical.latency_seconds == pytest.approx(2 * 511 * buckets * (RHO * 2 * ALPHA + mu) + local_sync)
    # the all-to-all: one round per bucket each way, but a message to every other rank; the vote too
    assert sharded.latency_seconds == pytest.approx((2 * buckets + 1) * RHO * 2 * ALPHA + (2 * buckets + 1) * 4095 * mu)


def test_dedicated_servers_bytes_per_link():
    # one trainer per machine: the split balances the links and gives t(n, k)
    n, k = 6, 2
    trainer, server = dedicated_link_bytes(Scheme("sharded_ps", num_servers=k), n, 1, S)
    assert trainer == pytest.approx(server)
    assert trainer / B == pytest.approx(dedicated_exchange_seconds(n, k, S, B))
    # four trainers a machine, servers alone: the machine sends its four trainers' S, a server N S / k
    trainer, server = dedicated_link_bytes(Scheme("parameter_server", num_servers=k), 8, 4, S)
    assert (trainer, server) == pytest.approx((4 * S, 8 * S / k))
    # over racks: a rack holds N / P trainers, each pushing S spread over owners of whom (P - 1) / P are outside
    # (the shares add up to S wherever they lie), and as much comes back as weights
    cluster = Cluster(64, 1, 16, B, ALPHA, 2 * ALPHA, oversubscription=3)
    for k, machines, racks in ((64, 128, 8), (32, 96, 6)):
        step = cluster_step(Scheme("sharded_ps", num_servers=k), cluster, Wire((S,)))
        assert step.machines == machines
        uplink = (racks - 1) / racks * (64 / racks) * S / (16 * B / 3)
        assert step.transfers[0].transfer_seconds(cluster, machines) == pytest.approx(uplink)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="not a whole number of machines"):
        Cluster(10, 4, 2, B, ALPHA, ALPHA)
    with pytest.raises(ValueError, match="oversubscription >= 1"):
        Cluster(8, 4, 2, B, ALPHA, ALPHA, oversubscription=0.5)
    with pytest.raises(ValueError, match="latency <= rack_latency"):
        Cluster(8, 4, 2, B, ALPHA, ALPHA / 2)
    with pytest.raises(ValueError, match="flow_window"):
        Cluster(8, 4, 2, B, ALPHA, ALPHA, flow_window=0)
    with pytest.raises(ValueError, match="staleness"):
        cluster_step(Scheme("sharded_ps", staleness=2), Cluster(8, 4, 2, B, ALPHA, ALPHA), Wire((S,)))


def test_the_guides_snippet_runs_as_pasted(capsys):
    (code,) = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "at-scale.md").read_text(), re.S)
    exec(code, {})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["ddp", "ring_allreduce", "sharded_ps"]
    assert all(line.endswith("ms exposed") for line in lines)


# ---------------------------------------------------------------------------------------------------- brute force
def busiest(pairs, place):
    """The most bytes one direction of any link carries: ``pairs`` maps (sender, receiver) to bytes, ``place`` a
    member to its machine (or rack); traffic inside one place uses no link."""
    out, into = {}, {}
    for (a, b), nbytes in pairs.items():
        if place(a) != place(b):
            out[place(a)] = out.get(place(a), 0.0) + nbytes
            into[place(b)] = into.get(place(b), 0.0) + nbytes
    return max([*out.values(), *into.values(), 0.0])


def exchange_pairs(scheme, n, local):
    """Bytes each rank sends each other rank in one exchange of S, from what each transport does: the ring passes
    2 (N - 1) chunks of S / N to its neighbour, the hierarchical ring 2 (M - 1) chunks of S / (L M) on the ring of
    local rank i, the central server receives S from every rank, the sharded servers S / N from every rank."""
    m = n // local
    if scheme.strategy == "ddp":
        return {(r, (r + 1) % n): 2 * (n - 1) / n * S for r in range(n)}
    if scheme.strategy == "ring_allreduce":
        return {
            (j * local + i, (j + 1) % m * local + i): 2 * (m - 1) / m * S / local
            for j in range(m)
            for i in range(local)
        }
    if scheme.strategy == "parameter_server":
        return {(r, 0): float(S) for r in range(1, n)}
    return {(a, b): S / n for a in range(n) for b in range(n) if a != b}


@pytest.mark.parametrize("scheme", [Scheme("ddp"), Scheme("ring_allreduce", "shm"), Scheme("parameter_server", "ring"),
                                    Scheme("sharded_ps", "ring")], ids=lambda s: s.label())  # fmt: skip
@pytest.mark.parametrize("n, local, per_rack", [(16, 2, 3), (24, 4, 2), (12, 1, 4), (64, 8, 4)])
def test_every_links_bytes_add_up_from_the_pairs(scheme, n, local, per_rack):
    cluster = Cluster(n, local, per_rack, B, ALPHA, 2 * ALPHA)
    pairs = exchange_pairs(scheme, n, local)
    first = cluster_step(scheme, cluster, Wire((S,))).transfers[0]
    assert first.machine_bytes == pytest.approx(busiest(pairs, lambda r: r // local))
    assert first.uplink_bytes == pytest.approx(busiest(pairs, lambda r: r // local // per_rack))


@pytest.mark.parametrize("strategy", ["parameter_server", "sharded_ps"])
@pytest.mark.parametrize("machines, local, k, per_rack", [(8, 2, 4, 3), (6, 1, 3, 3), (4, 4, 2, 3)])
def test_dedicated_servers_links_add_up_from_the_pairs(strategy, machines, local, k, per_rack):
    """Members 0..N-1 the trainers, N.. the servers; each rack holds M / P trainer machines and k / P servers. A
    trainer pushes share x of S to every other trainer and y to every server, and pulls as much back."""
    n = machines * local
    racks = (machines + k) // per_rack
    x = trainer_share(n, k) if strategy == "sharded_ps" else 0.0
    y = (1 - n * x) / k
    push = {(a, b): x * S for a in range(n) for b in range(n) if a != b}
    push |= {(a, n + j): y * S for a in range(n) for j in range(k)}
    pull = {(b, a): v for (a, b), v in push.items()}

    def machine(member):
        return member // local if member < n else machines + member - n

    def rack(member):
        if member < n:
            return member // local // (machines // racks)
        return (member - n) // (k // racks)

    step = cluster_step(Scheme(strategy, num_servers=k), Cluster(n, local, per_rack, B, ALPHA, 2 * ALPHA), Wire((S,)))
    gradients, weights = step.transfers[0], step.transfers[2]
    if strategy == "parameter_server":  # the push, then the pull
        assert gradients.machine_bytes == pytest.approx(busiest(push, machine))
        assert weights.machine_bytes == pytest.approx(busiest(pull, machine))
        assert gradients.uplink_bytes == pytest.approx(busiest(push, rack))
    else:  # push and pull overlap: each phase carries half the step's bytes
        step_pairs = {key: push.get(key, 0.0) + pull.get(key, 0.0) for key in push.keys() | pull.keys()}
        assert gradients.machine_bytes + weights.machine_bytes == pytest.approx(busiest(step_pairs, machine))
        assert gradients.uplink_bytes + weights.uplink_bytes == pytest.approx(busiest(step_pairs, rack))


def test_windows_limit_every_connection_the_transports_open():
    """A 1 KiB window over a 2 ms round trip (512 KB/s a flow) binds every scheme: a machine's rate is its
    connections' windows, one connection per pair of ranks on different machines."""
    window, rack_latency = 1024, 1e-3
    per_flow = window / (2 * rack_latency)
    n, local = 32, 4
    cluster = Cluster(n, local, 4, B, ALPHA, rack_latency, flow_window=window, incast=0.0)
    sharded = cluster_step(Scheme("sharded_ps", "ring"), cluster, Wire((S,))).transfers[0]
    # each of a machine's 4 ranks talks to the 28 ranks on other machines (and copies 3 / 32 of S to its neighbours)
    copies = 3 / 32 * S / cluster.local_bandwidth
    assert sharded.transfer_seconds(cluster, 8) == pytest.approx(4 * 28 / 32 * S / (4 * 28 * per_flow) + copies)
    central = cluster_step(Scheme("parameter_server", "ring"), cluster, Wire((S,))).transfers[0]
    # the server's rank hears from the 28 ranks elsewhere (and its 3 neighbours by copies)
    assert central.transfer_seconds(cluster, 8) == pytest.approx(
        28 * S / (28 * per_flow) + 3 * S / cluster.local_bandwidth
    )
    dedicated = cluster_step(Scheme("sharded_ps", num_servers=8), cluster, Wire((S,))).transfers[0]
    # trainers keep a share (k < N): each rank to the 8 servers and the 28 trainers elsewhere
    assert dedicated.transfer_seconds(cluster, 16) == pytest.approx(dedicated.machine_bytes / (4 * 36 * per_flow))


@pytest.mark.parametrize("strategy", ["parameter_server", "sharded_ps"])
def test_dedicated_servers_count_every_message_of_the_protocol(strategy):
    """With μ = 1 s a message and no latency, the seconds are the busiest rank's messages: per bucket a trainer
    sends used-flags and gradients to each owner, a server receives both from every trainer; the weights come back
    with a status per bucket; the bytes travel in 256 KiB pieces; control and vote go around the ring of members."""
    n, local, k, buckets = 16, 2, 4, 3
    cluster = Cluster(n, local, 64, B, 0.0, 0.0, message_seconds=1.0)
    step = cluster_step(Scheme(strategy, num_servers=k), cluster, Wire((S // buckets,) * buckets))
    piece = 256 * 1024
    x = trainer_share(n, k) if strategy == "sharded_ps" else 0.0
    owners = k + (n - 1 if x else 0)
    trainer_pieces = S * (1 + (n - 2 * local) * x) / piece
    server_pieces = n * (1 - n * x) * S / k / piece
    if strategy == "sharded_ps":
        trainer_pieces, server_pieces = trainer_pieces / 2, server_pieces / 2
    push = max(buckets * 2 * owners + trainer_pieces, buckets * 2 * n + server_pieces)
    pull = max(buckets * owners + trainer_pieces, buckets * 2 * n + server_pieces)
    control = 1 + 2 * (n + k - 1)
    assert [t.latency_seconds(cluster, 12) for t in step.transfers] == pytest.approx([push, control, pull])
