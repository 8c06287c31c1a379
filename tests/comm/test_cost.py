"""The cost model's formulas against the analytic amounts of each scheme."""

import pytest

from lightning_dp.comm.cost import (
    Link,
    Scheme,
    Topology,
    Wire,
    core_sharing,
    dedicated_exchange_seconds,
    optimizer_state_peak,
    rank_traffic,
    step_cost,
    trainer_share,
)

pytestmark = pytest.mark.unit

S = 16 * 2**20
ALPHA, B = 0.01, 125e6  # 10 ms, 1 Gbit/s
LINK = Link(ALPHA, B)
#: a message round over gloo: the receiver's ready notice, then the data; each extra machine sending into a link:
#: +5 %, up to three machines (as far as it was measured)
RHO, BETA, MOST = 2, 0.05, 3


def incast(machines):
    return 1 + BETA * (min(machines, MOST) - 1)


def test_the_link_prices_rounds_as_two_trips_and_incast_from_the_all_to_all_measurement():
    plain = Link(ALPHA, B, latencies_per_round=1, incast=0.0)
    ring = Scheme("ring_allreduce", "ring")
    assert step_cost(ring, hosts(4), plain, Wire((S,))).seconds == pytest.approx(6 * ALPHA + 1.5 * S / B)
    with pytest.raises(ValueError, match="latencies_per_round >= 1"):
        Link(ALPHA, B, latencies_per_round=0.5)


def hosts(n):
    return Topology(num_nodes=n, ranks_per_node=1)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("buckets", [1, 3])
def test_ring_is_2_n_minus_1_rounds_per_bucket_and_2_n_minus_1_over_n_of_the_bytes(n, buckets):
    wire = Wire((S // buckets,) * buckets)
    cost = step_cost(Scheme("ring_allreduce", "ring"), hosts(n), LINK, wire)
    assert cost.rounds == 2 * (n - 1) * buckets
    assert cost.network_bytes == pytest.approx(2 * (n - 1) / n * wire.total)
    assert cost.seconds == pytest.approx(2 * (n - 1) * buckets * RHO * ALPHA + 2 * (n - 1) / n * wire.total / B)
    # Lightning's ddp is modelled as the same ring
    assert step_cost(Scheme("ddp"), hosts(n), LINK, wire).seconds == pytest.approx(cost.seconds)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_central_server_moves_n_minus_1_times_s_through_its_link_each_way(n):
    cost = step_cost(Scheme("parameter_server", "ring"), hosts(n), LINK, Wire((S,)))
    assert [p.name for p in cost.phases] == ["gradients", "vote", "weights"]
    assert cost.rounds == 3  # push, vote, pull: one round each
    # the push arrives at the server from n - 1 machines at once; each rank receives the weights alone
    assert cost.seconds == pytest.approx(3 * RHO * ALPHA + (incast(n - 1) + 1) * (n - 1) * S / B)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_servers_move_the_rings_bytes_in_three_rounds(n):
    cost = step_cost(Scheme("sharded_ps", "ring"), hosts(n), LINK, Wire((S,)))
    assert cost.rounds == 3
    # both ways an all-to-all: n - 1 machines sending into every link
    assert cost.seconds == pytest.approx(3 * RHO * ALPHA + incast(n - 1) * 2 * (n - 1) / n * S / B)
    # sending the averaged gradients back (a hook reads them) is one more push-sized phase
    full = step_cost(Scheme("sharded_ps", "ring", full_gradients=True), hosts(n), LINK, Wire((S,)))
    assert full.seconds == pytest.approx(cost.seconds + RHO * ALPHA + incast(n - 1) * (n - 1) / n * S / B)


def test_incast_counts_sending_machines_and_stops_where_it_was_measured():
    sharded = Scheme("sharded_ps", "ring")
    # 2 machines of 4 ranks: every link receives from one other machine, however many ranks it runs
    two_by_four = step_cost(sharded, Topology(2, 4), LINK, Wire((S,)))
    busiest = 4 * (8 - 4) / 8 * S  # L (N - L) / N · S each way
    assert two_by_four.transfer_seconds == pytest.approx(2 * busiest / B + 2 * 3 / 8 * S / LINK.local_bandwidth)
    # 16 machines: priced as three sending machines, not fifteen
    many = step_cost(sharded, hosts(16), LINK, Wire((S,)))
    assert many.transfer_seconds == pytest.approx(incast(3) * 2 * 15 / 16 * S / B)
    assert many.latency_seconds == pytest.approx(3 * RHO * ALPHA)


def test_the_latency_crossover_between_ring_and_sharded_servers():
    """Equal bytes; the servers' all-to-all shares its links less well (incast), the ring's 2 (N - 1) rounds per
    bucket against three per step decide with latency."""
    n, wire = 4, Wire((S,))
    ring = Scheme("ring_allreduce", "ring")
    sharded = Scheme("sharded_ps", "ring")
    at = {
        a: tuple(step_cost(s, hosts(n), Link(a, B), wire).seconds for s in (ring, sharded)) for a in (0.0, 1e-3, 1e-2)
    }
    assert at[0][1] - at[0][0] == pytest.approx(BETA * (n - 2) * 1.5 * S / B)
    crossover = BETA * (n - 2) * 1.5 * S / B / ((6 - 3) * RHO)  # the latency where the rounds pay for the incast
    assert 1e-3 < crossover < 1e-2
    assert at[1e-3][0] < at[1e-3][1] and at[1e-2][1] < at[1e-2][0]
    assert at[1e-2][0] - at[1e-2][1] == pytest.approx((6 - 3) * RHO * 1e-2 - BETA * (n - 2) * 1.5 * S / B)
    # two ranks: the ring has only two rounds per bucket, fewer than the servers' three
    assert step_cost(ring, hosts(2), LINK, wire).seconds < step_cost(sharded, hosts(2), LINK, wire).seconds


def test_hierarchical_ring_moves_the_ring_amount_of_the_machines_not_of_the_ranks():
    m, local = 3, 4
    cost = step_cost(Scheme("ring_allreduce", "shm"), Topology(m, local), LINK, Wire((S,)))
    assert cost.rounds == 2 * (m - 1)
    assert cost.network_bytes == pytest.approx(2 * (m - 1) / m * S)
    flat = step_cost(Scheme("ring_allreduce", "ring"), Topology(m, local), LINK, Wire((S,)))
    assert flat.rounds == 2 * (m * local - 1)


def test_compression_and_low_rank_factors():
    plain, half = Wire((S,)), Wire((S // 2,))
    ring = Scheme("ring_allreduce", "ring", "fp16")
    assert step_cost(ring, hosts(4), LINK, half, plain).network_bytes == pytest.approx(1.5 * S / 2)
    low_rank = Wire((S // 10,), passes=2, weights_compressed=False)
    powersgd = step_cost(Scheme("ring_allreduce", "ring", "powersgd"), hosts(4), LINK, low_rank, plain)
    assert powersgd.rounds == 2 * 6  # two factors, each a ring all-reduce
    central = step_cost(Scheme("parameter_server", "ring", "powersgd"), hosts(4), LINK, low_rank, plain)
    weights = next(p for p in central.phases if p.name == "weights")
    assert weights.network_bytes == pytest.approx(3 * S)  # the new weights travel in full precision


def test_dedicated_servers_use_the_split_formula():
    n, k = 4, 2
    # trainers serve 1/10 of the bytes each, the two servers 3/10 each: a trainer sends 9/10 S of pushes and 3 x 1/10
    # S of its share's weights, a server receives and sends 4 x 3/10 S, so every machine moves 1.2 S each way
    trainer, server = 0.1, 0.3
    assert trainer_share(n, k) == pytest.approx(trainer) and n * trainer + k * server == pytest.approx(1.0)
    moved = (1 - trainer) + (n - 1) * trainer
    assert moved == pytest.approx(n * server) == pytest.approx(1.2)
    cost = step_cost(Scheme("sharded_ps", "ring", num_servers=k), hosts(n), Link(0.0, B, incast=0.0), Wire((S,)))
    assert cost.seconds == pytest.approx(moved * S / B)
    # a server receives from the n trainers at once, a trainer (keeping a share) from k servers and n - 1 trainers
    crowded = step_cost(Scheme("sharded_ps", "ring", num_servers=k), hosts(n), Link(0.0, B), Wire((S,)))
    half = moved * S / B / 2
    assert crowded.seconds == pytest.approx(half * incast(n) + half * incast(k + n - 1))
    assert dedicated_exchange_seconds(n, 0, S, B) == pytest.approx(2 * (n - 1) / n * S / B)
    assert dedicated_exchange_seconds(n, n, S, B) == pytest.approx(S / B)
    assert trainer_share(n, 0) == pytest.approx(1 / n)
    assert dedicated_exchange_seconds(n, k, S, B) == pytest.approx(moved * S / B)


def test_exposed_time_hides_all_but_the_last_buckets_share_behind_backward():
    wire = Wire((S // 4,) * 4)
    cost = step_cost(Scheme("ring_allreduce", "ring"), hosts(4), LINK, wire)
    assert cost.exposed_seconds(backward_seconds=100.0) == pytest.approx(cost.seconds / 4)
    assert cost.exposed_seconds(backward_seconds=0.0) == pytest.approx(cost.seconds)
    one = step_cost(Scheme("ring_allreduce", "ring"), hosts(4), LINK, Wire((S,)))
    assert one.exposed_seconds(backward_seconds=100.0) == pytest.approx(one.seconds)
    # the servers' pull comes after the optimizer step: never hidden
    server = step_cost(Scheme("sharded_ps", "ring"), hosts(4), LINK, wire)
    pull = sum(p.seconds(LINK) for p in server.phases if p.name in ("vote", "weights"))
    assert server.exposed_seconds(backward_seconds=100.0) == pytest.approx(pull + (server.seconds - pull) / 4)


def test_shared_memory_prices_barriers_copies_and_the_cores_backward_shares():
    """One machine of L ranks, K buckets through shared memory: 2 K barriers of ``α_L`` and ``2 (L - 1) / L · S``
    at ``C``; the first K - 1 buckets' share of that runs beside backward, σ times as long."""
    alpha_l, c, sigma, buckets, ranks = 5e-6, 6e9, 2.0, 4, 2
    link = Link(ALPHA, B, local_bandwidth=c, local_latency=alpha_l, overlap_slowdown=sigma)
    cost = step_cost(Scheme("ring_allreduce"), Topology(1, ranks), link, Wire((S // buckets,) * buckets))
    alone = 2 * buckets * alpha_l + 2 * (ranks - 1) / ranks * S / c
    beside = alone * (buckets - 1) / buckets * (sigma - 1)
    assert cost.sharing_seconds == pytest.approx(beside)
    assert cost.seconds == pytest.approx(alone + beside)
    assert cost.exposed_seconds(backward_seconds=100.0) == pytest.approx((alone + beside) / buckets)
    spare = step_cost(Scheme("ring_allreduce"), Topology(1, ranks), Link(ALPHA, B, c, alpha_l),
                      Wire((S // buckets,) * buckets))  # fmt: skip
    assert spare.seconds == pytest.approx(alone) and spare.sharing_seconds == 0.0
    # over sockets nothing is done inside the machine: the cores backward shares cost nothing there
    sockets = step_cost(Scheme("ring_allreduce", "ring"), hosts(4), link, Wire((S,) * 2))
    assert sockets.sharing_seconds == 0.0


def test_core_sharing_counts_the_threads_that_want_a_core():
    assert core_sharing(2, 1, 2) == 2.0  # two ranks, each backward on one thread and an exchange thread, two cores
    assert core_sharing(4, 3, 8) == 2.0
    assert core_sharing(2, 1, 16) == 1.0  # cores to spare: never faster than alone
    with pytest.raises(ValueError, match="positive counts"):
        core_sharing(2, 0, 2)


def test_optimizer_state_per_rank():
    assert optimizer_state_peak(Scheme("ring_allreduce"), 4, 800) == 800
    assert optimizer_state_peak(Scheme("parameter_server"), 4, 800) == 800
    assert optimizer_state_peak(Scheme("sharded_ps"), 4, 800) == 200
    assert optimizer_state_peak(Scheme("parameter_server", num_servers=2), 4, 800) == 400


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rank_traffic_is_the_reference_posts_bandwidth_model(n):
    s = 1000.0
    assert rank_traffic(Scheme("ring_allreduce", "ring"), n, s, 0) == pytest.approx((2 * (n - 1) / n * s,) * 2)
    assert rank_traffic(Scheme("parameter_server", "ring"), n, s, 0) == pytest.approx(((n - 1) * s,) * 2)
    assert rank_traffic(Scheme("parameter_server", "ring"), n, s, 1) == pytest.approx((s, s))
    flags = 8.0
    sharded = rank_traffic(Scheme("sharded_ps", "ring"), n, s, 0, flag_bytes=flags)
    assert sharded == pytest.approx((2 * (n - 1) / n * (s - flags) + (n - 1) * flags,) * 2)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="strategy='gossip' is not modelled"):
        Scheme("gossip")
    with pytest.raises(ValueError, match="latency >= 0"):
        Link(-1.0, B)
    with pytest.raises(ValueError, match="overlap_slowdown >= 1"):
        Link(ALPHA, B, overlap_slowdown=0.5)
    with pytest.raises(ValueError, match="at least one node"):
        Topology(0, 1)
