"""The cost model past one switch: one rack reproduces :mod:`lightning_dp.comm.cost`, and racks, windows and
per-message costs against amounts derived by hand."""

import math
import re

import pytest

from lightning_dp.comm.cost import Link, Scheme, Topology, Wire, dedicated_exchange_seconds, step_cost
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
    # over racks: (P - 1) / P of a rack's sends leave it, the uplink as wide as its machines' links / o
    cluster = Cluster(64, 1, 16, B, ALPHA, 2 * ALPHA, oversubscription=3)
    step = cluster_step(Scheme("sharded_ps", num_servers=64), cluster, Wire((S,)))
    machines, racks = 128, 8
    per_machine = S / 2  # k = n: every link carries S over the push and the pull
    uplink = (racks - 1) / racks * (machines / racks) * per_machine / (16 * B / 3)
    assert step.transfers[0].transfer_seconds(cluster, machines) == pytest.approx(uplink)
    assert math.isclose(step.machines, machines)
    # half as many servers: 96 machines in 6 racks; every link still carries t(n, k) B over the step, and a rack's
    # 16 machines (two thirds trainers) send 5 / 6 of it out
    half = cluster_step(Scheme("sharded_ps", num_servers=32), cluster, Wire((S,)))
    per_link = dedicated_exchange_seconds(64, 32, S, B) * B
    uplink = 5 / 6 * 16 * per_link / 2 / (16 * B / 3)
    assert half.transfers[0].transfer_seconds(cluster, 96) == pytest.approx(uplink)


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
