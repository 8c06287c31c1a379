"""The cost model past one switch: every scheme on a cluster of racks, for clusters far larger than can be emulated.

:mod:`.cost` prices a step on machines behind one switch, each machine's link the only bottleneck. Past a few dozen
machines more things decide, and :class:`Cluster` adds them:

* **racks**: ``R`` machines share a top-of-rack switch whose uplink carries ``R B / o`` bytes/s each way (``o`` : 1
  oversubscription); a message between racks takes ``α_r`` one way instead of ``α``;
* **windows**: a TCP flow keeps at most ``w`` bytes in flight, so it moves at most ``w / (2 α)`` bytes/s; a machine
  whose bytes travel on ``c`` connections of ``f`` flows each moves ``min(B, c f w / (2 α))`` (RDMA: no window);
* **messages**: every message costs the rank that sends or receives it ``μ`` seconds of software, so an all-to-all
  over ``N`` ranks pays ``(N - 1) μ`` per bucket where a ring pays ``μ`` per round.

A phase of ``r`` rounds over the slowest path (``α_p``: ``α_r`` once the machines span racks), ``m`` messages,
``W_m`` bytes through the busiest machine's link on ``c`` connections from ``F`` sending machines, ``W_u`` through
the busiest rack uplink and ``Q`` copied inside a machine costs::

    r ρ α_p + m μ + max((1 + β (min(F, F_max) - 1)) W_m / min(B, c f w / (2 α_p)), W_u o / (R' B)) + Q / C

(``ρ``, ``β``, ``F_max`` and ``C`` as in :class:`.cost.Link`; ``R'`` the machines of a rack). On one rack with no
window, ``μ = 0`` and the same copy rates, every phase is :func:`.cost.step_phases`' own (tested). For
``N = M L`` ranks (``M`` machines of ``L``, ``P`` racks), ``S`` bytes in ``K`` buckets (``K`` times ``passes`` for
a low-rank codec), per step:

=========================  ==================  ==========================  ===================================
exchange                   rounds              a machine's link            a rack's uplink
=========================  ==================  ==========================  ===================================
ring (flat, ``ddp``)       ``2 (N - 1) K``     ``2 (N - 1) / N · S``       the same (the ring leaves a rack once)
hierarchical ring          ``2 (M - 1) K``     ``2 (M - 1) / M · S``       the same, on ``L`` rings' connections
central server             ``K`` each way      ``(N - L) S`` each way      ``(N - R' L) S`` each way
sharded servers            ``K`` each way      ``L (N - L) / N · S``       ``R' L (N - R' L) / N · S`` each way
dedicated servers (``k``)  1 each way          :func:`dedicated_link_bytes` ``(P - 1) / P · N S / P`` each way
=========================  ==================  ==========================  ===================================

The parameter servers' vote is one round of ``N - 1`` messages; the dedicated servers' control message and vote
are ``1 + 2 (N + k - 1)`` rounds (a ring over all members).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_dp.comm.cost import Scheme, Topology, Wire, exposed_seconds, incast_sharing, trainer_share
from lightning_dp.comm.servers.members import MESSAGE_BYTES


@dataclass(frozen=True)
class Cluster:
    """``ranks`` training ranks, ``ranks_per_node`` to a machine, ``nodes_per_rack`` machines to a rack.

    Attributes:
        bandwidth: bytes/s a machine sends, and at the same time receives (``B``).
        latency: one-way seconds between two machines of one rack, software included (``α``).
        rack_latency: one-way seconds between machines of different racks (``α_r``).
        oversubscription: a rack's machines can send ``o`` times what its uplink carries (``o`` : 1).
        flow_window: bytes one flow keeps in flight (``w``; TCP's send buffer); ``None``: no window (RDMA).
        flows_per_peer: TCP flows that carry one connection between two ranks side by side (``f``: several
            sockets per pair, as NCCL's ``NCCL_NSOCKS_PERTHREAD``).
        message_seconds: software seconds one message costs the rank that sends or receives it (``μ``).
        local_bandwidth, local_latency: copies and synchronizations among the ranks of one machine (defaults:
            GPUs joined by NVLink; :class:`.cost.Link`'s are a CPU machine's shared memory).
        latencies_per_round, incast, incast_flows: as :class:`.cost.Link`'s.

    Dedicated servers (a :class:`.cost.Scheme` with ``num_servers``) are machines of their own, spread evenly over
    the racks with the trainers' machines.
    """

    ranks: int
    ranks_per_node: int
    nodes_per_rack: int
    bandwidth: float
    latency: float
    rack_latency: float
    oversubscription: float = 1.0
    flow_window: float | None = None
    flows_per_peer: int = 1
    message_seconds: float = 0.0
    local_bandwidth: float = 1e11
    local_latency: float = 5e-6
    latencies_per_round: float = 2.0
    incast: float = 0.05
    incast_flows: int = 3

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.ranks_per_node < 1 or self.nodes_per_rack < 1:
            raise ValueError(f"a cluster needs ranks, ranks_per_node and nodes_per_rack >= 1, got {self}")
        if self.ranks % self.ranks_per_node:
            raise ValueError(f"ranks={self.ranks} is not a whole number of machines of {self.ranks_per_node}")
        if self.bandwidth <= 0 or self.local_bandwidth <= 0 or self.latency < 0 or self.rack_latency < self.latency:
            raise ValueError(f"a cluster needs bandwidths > 0 and 0 <= latency <= rack_latency, got {self}")
        if self.oversubscription < 1 or self.flows_per_peer < 1 or self.message_seconds < 0:
            raise ValueError(
                f"a cluster needs oversubscription >= 1, flows_per_peer >= 1 and message_seconds >= 0, got {self}"
            )
        if self.flow_window is not None and self.flow_window <= 0:
            raise ValueError(f"flow_window must be > 0 bytes or None (no window), got {self.flow_window}")
        if self.latencies_per_round < 1 or self.incast < 0 or self.incast_flows < 1:
            raise ValueError(f"a cluster needs latencies_per_round >= 1, incast >= 0, incast_flows >= 1, got {self}")

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    @property
    def topology(self) -> Topology:
        return Topology(self.nodes, self.ranks_per_node)

    def racks(self, machines: int) -> int:
        """Racks ``machines`` machines fill."""
        return math.ceil(machines / self.nodes_per_rack)

    def uplink_bandwidth(self, machines: int) -> float:
        """Bytes/s one rack's uplink carries each way when ``machines`` machines fill the racks."""
        return min(self.nodes_per_rack, machines) * self.bandwidth / self.oversubscription

    def path_latency(self, machines: int) -> float:
        """One-way seconds of the slowest path among ``machines`` machines."""
        return self.rack_latency if self.racks(machines) > 1 else self.latency

    def machine_rate(self, connections: int, machines: int) -> float:
        """Bytes/s a machine moves on ``connections`` connections at once: its link, or what their windows allow
        (each connection between two ranks is ``flows_per_peer`` flows)."""
        if self.flow_window is None:
            return self.bandwidth
        round_trip = 2 * self.path_latency(machines)
        if round_trip == 0:
            return self.bandwidth
        return min(self.bandwidth, connections * self.flows_per_peer * self.flow_window / round_trip)


@dataclass(frozen=True)
class Transfer:
    """One part of a step's communication on a :class:`Cluster`."""

    name: str
    rounds: int
    #: bytes through the busiest machine's link, one direction
    machine_bytes: float
    #: bytes through the busiest rack uplink, one direction
    uplink_bytes: float = 0.0
    #: connections carrying ``machine_bytes`` at once (each limited by its window)
    connections: int = 1
    #: machines sending into the busiest link at once (incast)
    senders: int = 1
    local_bytes: float = 0.0
    local_rounds: int = 0
    #: messages the busiest rank sends or receives
    messages: float = 0.0
    overlaps_backward: bool = False

    def latency_seconds(self, cluster: Cluster, machines: int) -> float:
        """The rounds' and the messages' part of :meth:`seconds`."""
        rounds = self.rounds * cluster.latencies_per_round * cluster.path_latency(machines)
        return rounds + self.messages * cluster.message_seconds + self.local_rounds * cluster.local_latency

    def transfer_seconds(self, cluster: Cluster, machines: int) -> float:
        """The bytes' part of :meth:`seconds`: the busiest machine link or rack uplink, and the local copies."""
        sharing = incast_sharing(self.senders, cluster.incast, cluster.incast_flows)
        link = sharing * self.machine_bytes / cluster.machine_rate(self.connections, machines)
        uplink = self.uplink_bytes / cluster.uplink_bandwidth(machines) if self.uplink_bytes else 0.0
        return max(link, uplink) + self.local_bytes / cluster.local_bandwidth

    def seconds(self, cluster: Cluster, machines: int) -> float:
        return self.latency_seconds(cluster, machines) + self.transfer_seconds(cluster, machines)


@dataclass(frozen=True)
class ClusterStep:
    """The predicted communication of one optimizer step of ``scheme`` on ``cluster``."""

    scheme: Scheme
    cluster: Cluster
    transfers: tuple[Transfer, ...]
    num_buckets: int
    #: the machines the step spans (trainers' and dedicated servers')
    machines: int

    @property
    def seconds(self) -> float:
        return sum(t.seconds(self.cluster, self.machines) for t in self.transfers)

    @property
    def latency_seconds(self) -> float:
        return sum(t.latency_seconds(self.cluster, self.machines) for t in self.transfers)

    @property
    def transfer_seconds(self) -> float:
        return sum(t.transfer_seconds(self.cluster, self.machines) for t in self.transfers)

    def exposed_seconds(self, backward_seconds: float) -> float:
        """As :meth:`.cost.StepCost.exposed_seconds`: the gradient exchange hides behind backward but for the last
        bucket's share."""
        overlapping = sum(t.seconds(self.cluster, self.machines) for t in self.transfers if t.overlaps_backward)
        return exposed_seconds(overlapping, self.seconds - overlapping, self.num_buckets, backward_seconds)

    def efficiency(self, compute_seconds: float, backward_seconds: float) -> float:
        """Scaling efficiency: the step's compute over the step (compute and exposed communication)."""
        return compute_seconds / (compute_seconds + self.exposed_seconds(backward_seconds))


def dedicated_link_bytes(scheme: Scheme, ranks: int, ranks_per_node: int, nbytes: float) -> tuple[float, float]:
    """``(trainer machine, server)`` bytes one direction of each link carries in one step with ``k`` dedicated
    servers, every rank a trainer that pushes and pulls for itself (as the strategies do): ``sharded_ps`` keeps
    :func:`.cost.trainer_share` ``x`` per trainer, so a machine of ``L`` trainers sends ``L S (1 + (N - 2 L) x)``
    over the push and the pull and a server ``N (1 - N x) S / k``; ``parameter_server`` (``x = 0``) sends ``L S``
    and ``N S / k`` in each."""
    n, k, local = ranks, scheme.num_servers, ranks_per_node
    if k < 1:
        raise ValueError(f"num_servers={k}: dedicated servers need num_servers >= 1")
    x = trainer_share(n, k) if scheme.strategy == "sharded_ps" else 0.0
    return local * nbytes * (1 + (n - 2 * local) * x), n * (1 - n * x) * nbytes / k


def cluster_step(scheme: Scheme, cluster: Cluster, wire: Wire, plain: Wire | None = None) -> ClusterStep:
    """The predicted communication of one step of ``scheme`` on ``cluster`` (see the module docstring); ``wire`` and
    ``plain`` as in :func:`.cost.step_phases`. Staleness is not modelled past one switch."""
    if scheme.staleness != 0:
        raise ValueError("staleness != 0 is not modelled on a cluster of racks (its pushes are not synchronized)")
    plain = plain or wire
    n, m, local = cluster.ranks, cluster.nodes, cluster.ranks_per_node
    k = len(wire.bucket_bytes)
    s_w, s = wire.total, plain.total
    if n == 1:
        return ClusterStep(scheme, cluster, (), k, 1)
    racked = min(cluster.nodes_per_rack, m) * local  # ranks in a full rack
    spans_racks = cluster.racks(m) > 1
    if scheme.num_servers:
        return _dedicated(scheme, cluster, s, k)
    if scheme.strategy in ("ring_allreduce", "ddp"):
        if scheme.uses_shared_memory(cluster.topology):  # local rank i of every machine on a ring of its own
            rounds = 2 * (m - 1) * k * wire.passes
            network = 2 * (m - 1) / m * s_w
            transfer = Transfer(
                "gradients",
                rounds,
                network,
                network if spans_racks else 0.0,
                connections=local,
                local_bytes=2 * (local - 1) / local * s,
                local_rounds=2 * k,
                messages=rounds,
                overlaps_backward=True,
            )
            return ClusterStep(scheme, cluster, (transfer,), k, m)
        # one ring over every rank: each machine's link carries one neighbour's chunk per round, the ring leaves
        # and enters each rack once; the copies between ranks of a machine run beside the network's hop
        rounds = 2 * (n - 1) * k * wire.passes
        network = 2 * (n - 1) / n * s_w
        uplink = network if spans_racks else 0.0
        transfer = Transfer("gradients", rounds, network, uplink, messages=rounds, overlaps_backward=True)
        return ClusterStep(scheme, cluster, (transfer,), k, m)
    if m == 1:
        raise ValueError("a cluster of one machine is priced by lightning_dp.comm.cost.step_cost")
    if scheme.strategy == "parameter_server":  # the server's machine receives from (and sends to) every other rank
        per_link, per_copy, per_uplink = float(n - local), float(local - 1), float(n - racked)
        fan_in, fan_out, connections, sent = m - 1, 1, n - local, n - 1
    else:  # each rank exchanges 1 / N of the buckets with every other rank
        per_link, per_copy = local * (n - local) / n, (local - 1) / n
        per_uplink = racked * (n - racked) / n
        fan_in = fan_out = m - 1
        connections, sent = local * (n - local), n - 1
    weights = s_w if wire.weights_compressed else s
    rounds = k * wire.passes

    def phase(name: str, rounds: int, nbytes: float, senders: int, overlaps: bool) -> Transfer:
        return Transfer(
            name,
            rounds,
            per_link * nbytes,
            per_uplink * nbytes if spans_racks else 0.0,
            connections=connections,
            senders=senders,
            local_bytes=per_copy * nbytes,
            messages=rounds * sent,
            overlaps_backward=overlaps,
        )

    transfers = [phase("gradients", rounds, s_w, fan_in, True)]
    if wire.passes > 1:
        transfers.append(phase("averaged factors", rounds, s_w, fan_out, True))
    elif scheme.full_gradients:
        transfers.append(phase("averaged gradients", k, s_w, fan_out, True))
    transfers.append(Transfer("vote", 1, 0.0, messages=n - 1))
    transfers.append(phase("weights", k, weights, fan_out, False))
    return ClusterStep(scheme, cluster, tuple(transfers), k, m)


def _dedicated(scheme: Scheme, cluster: Cluster, s: float, num_buckets: int) -> ClusterStep:
    """Trainers push their gradients to ``k`` server machines (spread over the racks with the trainers' machines)
    and pull the weights; every machine's link and every rack's uplink carries its share (see
    :func:`dedicated_link_bytes`). ``sharded_ps``: the push and the pull share the step's bytes, as
    :func:`.cost.dedicated_exchange_seconds`; ``parameter_server``: each moves them all. Messages travel in
    pieces of :data:`.servers.members.MESSAGE_BYTES`, each bucket's with a message of used-flags ahead."""
    n, m, local, k = cluster.ranks, cluster.nodes, cluster.ranks_per_node, scheme.num_servers
    machines = m + k
    trainer_bytes, server_bytes = dedicated_link_bytes(scheme, n, local, s)
    racks = cluster.racks(machines)
    # with the servers spread evenly a rack holds N / P trainers, and (P - 1) / P of the shares each of them
    # pushes (and of the weights each pulls) lie outside it: (P - 1) / P · N S / P each way
    uplink = (racks - 1) / racks * n * s / racks
    keeps = scheme.strategy == "sharded_ps" and trainer_share(n, k) > 0
    owners = k + (n - 1 if keeps else 0)  # where a trainer's push goes, and its pull comes from
    pieces_trainer = trainer_bytes / local / MESSAGE_BYTES  # one rank's
    pieces_server = server_bytes / MESSAGE_BYTES
    if scheme.strategy == "sharded_ps":  # trainers' pushes and owners' weights cross the links side by side
        push = pull = max(trainer_bytes, server_bytes) / 2
        push_senders, pull_senders = m, k + (m - 1 if keeps else 0)
        pieces_trainer, pieces_server = pieces_trainer / 2, pieces_server / 2
    else:  # the trainers push, then the servers send the weights; the busier link, at equal bytes the receiving one
        push = pull = max(trainer_bytes, server_bytes)
        push_senders = m if server_bytes >= trainer_bytes else 1
        pull_senders = k if trainer_bytes >= server_bytes else 1
    connections = local * (k + (n - local if keeps else 0))
    # the busiest rank's messages: a trainer's flags and gradients to every owner, a server's from every trainer;
    # a server's weights and status to every trainer, a trainer's weights (of its own share) to every other
    push_messages = max(num_buckets * 2 * owners + pieces_trainer, num_buckets * 2 * n + pieces_server)
    pull_messages = max(num_buckets * owners + pieces_trainer, num_buckets * 2 * n + pieces_server)
    members = n + k
    return ClusterStep(
        scheme,
        cluster,
        (
            Transfer(
                "gradients",
                1,
                push,
                uplink,
                connections=connections,
                senders=push_senders,
                messages=push_messages,
                overlaps_backward=True,
            ),
            Transfer("control and vote", 1 + 2 * (members - 1), 0.0, messages=1 + 2 * (members - 1)),
            Transfer("weights", 1, pull, uplink, connections=connections, senders=pull_senders, messages=pull_messages),
        ),
        num_buckets,
        machines,
    )
