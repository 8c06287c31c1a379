"""The cost model: what one synchronized step of each scheme moves, and how long that takes on a given network.

The one place the per-scheme formulas live: :func:`rank_traffic` is what each transport's byte counters add up to
(the tests hold the counters to it), :func:`step_cost` the time the :class:`~lightning_dp.CommMonitor` and
:func:`lightning_dp.advise` predict.

The network (:class:`Link`) is the latency-bandwidth model with two refinements the validation grid
(``benchmarks/advisor_validation.py``) needed. Every machine sends and receives ``B`` bytes/s at once (full duplex);
ranks of one machine exchange at ``C`` bytes/s (shared memory or loopback). A message round costs ``ρ α``, ``α``
the one-way latency: gloo's TCP pairs send data only once the receiver's ready notice has arrived, so a round whose
receive is posted as its send is costs the notice's trip and then the data's (``ρ = 2``). ``F`` machines sending
into one link at once (an all-to-all, a server's fan-in) share it less well than one: ``1 + β (F − 1)`` times the
time (incast; ``β`` = 0.05 from ``benchmarks/gloo_flows.py``, an all-to-all through the member group, measured at
``F`` = 1 to 3 and not extrapolated past it). A step is a sequence of :class:`Phase` s; a phase of ``r`` rounds that
puts ``W`` bytes through the busiest machine's link (one direction) from ``F`` machines at once and copies ``Q``
bytes inside a machine takes ``r ρ α + (1 + β (min(F, 3) − 1)) W / B + Q / C`` plus ``l α_L`` for its ``l``
synchronizations inside a machine (shared-memory barriers). The gradient exchange's work inside a machine runs
beside backward for all buckets but the last, ``(K − 1) / K`` of it, and takes ``σ`` times as long there when
backward's threads and the exchange's want more cores than the machine has (``σ``: :func:`core_sharing`).
``CommMonitor`` measures ``α_L`` and ``C`` of a shared-memory exchange with that exchange's own barrier and
reduction. For ``N = M L`` ranks (``M``
machines of ``L`` ranks) and ``S`` bytes of gradient buckets (travelling as ``S_w`` after compression), per bucket:

=================================  =============  ===========================================
exchange                           rounds         bytes through the busiest link
=================================  =============  ===========================================
ring all-reduce (flat)             ``2 (N - 1)``  ``2 (N - 1) / N · S_w``
hierarchical (shared memory)       ``2 (M - 1)``  ``2 (M - 1) / M · S_w``
central server: push, pull         1 each         ``(N - L) S_w`` each (the server's machine)
sharded servers: push, pull        1 each         ``L (N - L) / N · S_w`` each
dedicated servers (``k``)          see below      ``t(n, k) B`` (:func:`dedicated_exchange_seconds`)
=================================  =============  ===========================================

The parameter servers add one round per step for their vote on non-finite gradients, and pull the new weights
after the optimizer step, which therefore never overlaps backward. With ``full_gradients`` (something reads the
averaged gradients before the step) they also send the averaged gradients back: one more push-sized phase.
PowerSGD all-reduces two factors per bucket (twice the rounds; a server transport pushes and pulls each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

#: the schemes the model knows: this project's strategies and Lightning's ``ddp`` (a ring all-reduce in NCCL/gloo)
SCHEMES = ("ring_allreduce", "parameter_server", "sharded_ps", "ddp")


@dataclass(frozen=True)
class Link:
    """The network between machines and the copies inside one.

    Attributes:
        latency: seconds a message takes from one machine to another (one way, software included); a round costs
            ``latencies_per_round`` of them.
        bandwidth: bytes/s a machine sends, and at the same time receives.
        local_bandwidth: bytes/s of copies between ranks of one machine (shared memory, loopback).
        local_latency: seconds of one synchronization between the ranks of one machine (a shared-memory barrier).
        overlap_slowdown: how many times longer that work inside a machine takes while backward computes beside
            it on the same cores (:func:`core_sharing`; 1: cores to spare, or the compute is on GPUs).
        latencies_per_round: one-way latencies a message round costs (``ρ``: 2 over gloo's TCP pairs).
        incast: the extra time, as a fraction, each concurrent flow beyond the first adds to a link (``β``).
        incast_flows: the most flows into one link the incast term was measured at; beyond them it is not
            extrapolated (a link with more flows is priced as with this many).
    """

    latency: float
    bandwidth: float
    local_bandwidth: float = 4e9
    local_latency: float = 2e-5
    overlap_slowdown: float = 1.0
    latencies_per_round: float = 2.0
    incast: float = 0.05
    incast_flows: int = 3

    def __post_init__(self) -> None:
        if self.latency < 0 or self.bandwidth <= 0 or self.local_bandwidth <= 0:
            raise ValueError(f"a link needs latency >= 0 and bandwidths > 0, got {self}")
        if self.latencies_per_round < 1 or self.incast < 0 or self.overlap_slowdown < 1:
            raise ValueError(
                f"a link needs latencies_per_round >= 1, incast >= 0 and overlap_slowdown >= 1, got {self}"
            )


def core_sharing(ranks_per_node: int, threads_per_rank: int, cores: int) -> float:
    """:attr:`Link.overlap_slowdown` of a machine whose ``ranks_per_node`` ranks each compute backward on
    ``threads_per_rank`` threads while one more thread of theirs exchanges buckets, on ``cores`` cores: the threads
    that want a core over the cores there are, at least 1."""
    if ranks_per_node < 1 or threads_per_rank < 1 or cores < 1:
        raise ValueError(f"core_sharing needs positive counts, got {ranks_per_node}, {threads_per_rank}, {cores}")
    return max(1.0, ranks_per_node * (threads_per_rank + 1) / cores)


@dataclass(frozen=True)
class Topology:
    """``num_nodes`` machines of ``ranks_per_node`` training ranks each."""

    num_nodes: int = 1
    ranks_per_node: int = 2

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"a topology needs at least one node of one rank, got {self}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node


@dataclass(frozen=True)
class Scheme:
    """A strategy and the options that change what it moves (see the strategies' arguments)."""

    strategy: str
    intra_node: str = "shm"
    compression: str = "none"
    staleness: int | None = 0
    num_servers: int = 0
    #: the parameter servers also send the averaged gradients back (a hook or clipping reads them)
    full_gradients: bool = False
    #: ``"throughput"``: each rank's share of the global batch follows its speed (no change to what moves)
    balance: str = "none"
    #: each step of the parameter servers uses the first ``N - b`` gradients (pushed whole after backward)
    backup_workers: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in SCHEMES:
            raise ValueError(f"strategy={self.strategy!r} is not modelled; allowed values: {', '.join(SCHEMES)}")

    @property
    def is_server(self) -> bool:
        return self.strategy in ("parameter_server", "sharded_ps")

    def label(self) -> str:
        """The scheme as a user writes it: the strategy and its options that differ from the defaults."""
        options = []
        if self.strategy != "ddp" and self.intra_node != "shm":
            options.append(f"intra_node={self.intra_node}")
        if self.compression != "none":
            options.append(f"compression={self.compression}")
        if self.staleness != 0:
            options.append(f"staleness={'null' if self.staleness is None else self.staleness}")
        if self.num_servers:
            options.append(f"num_servers={self.num_servers}")
        if self.balance != "none":
            options.append(f"balance={self.balance}")
        if self.backup_workers:
            options.append(f"backup_workers={self.backup_workers}")
        return " ".join([self.strategy, *options])

    def uses_shared_memory(self, topology: Topology) -> bool:
        """Whether the ranks of a node exchange through shared memory (as the strategies decide at set-up)."""
        if self.strategy == "ddp" or self.intra_node != "shm" or topology.ranks_per_node == 1:
            return False
        if self.num_servers or self.staleness != 0 or self.backup_workers:  # process groups of their own, sockets
            return False
        return self.strategy == "ring_allreduce" or topology.num_nodes == 1


@dataclass(frozen=True)
class Wire:
    """How the buckets travel between machines: the bytes of one rank's contribution per bucket after
    compression, and how many exchanges of them a reduction takes (PowerSGD: two factors)."""

    bucket_bytes: tuple[int, ...]
    passes: int = 1
    #: whether the weights the servers send back travel compressed too (16-bit codecs) or in full precision
    weights_compressed: bool = True

    @property
    def total(self) -> int:
        return sum(self.bucket_bytes)


def incast_sharing(senders: int, incast: float, most: int) -> float:
    """How many times longer a link takes with ``senders`` machines sending into it at once than with one:
    ``1 + incast (min(senders, most) - 1)`` (not extrapolated past the ``most`` it was measured at)."""
    return 1.0 + incast * (min(max(1, senders), most) - 1)


@dataclass(frozen=True)
class Phase:
    """One part of a step's communication."""

    name: str
    rounds: int
    #: bytes through the busiest machine's link, one direction
    network_bytes: float
    #: bytes the busiest rank copies inside its machine
    local_bytes: float = 0.0
    #: whether it runs on the communication thread while backward computes (the gradient exchange)
    overlaps_backward: bool = False
    #: synchronizations among the ranks of one machine (shared-memory barriers)
    local_rounds: int = 0
    #: machines sending into the busiest link at once (1: a ring's neighbour; M - 1: an all-to-all)
    flows: int = 1

    def seconds(self, link: Link) -> float:
        return self.latency_seconds(link) + self.transfer_seconds(link)

    def local_seconds(self, link: Link) -> float:
        """The part of :meth:`seconds` spent inside a machine: its synchronizations and copies."""
        return self.local_rounds * link.local_latency + self.local_bytes / link.local_bandwidth

    def latency_seconds(self, link: Link) -> float:
        """The rounds' part of :meth:`seconds` (network and shared-memory synchronizations)."""
        return self.rounds * link.latencies_per_round * link.latency + self.local_rounds * link.local_latency

    def transfer_seconds(self, link: Link) -> float:
        """The bytes' part of :meth:`seconds`: through the busiest link (its flows sharing it) and copied inside a
        machine."""
        sharing = incast_sharing(self.flows, link.incast, link.incast_flows)
        return sharing * self.network_bytes / link.bandwidth + self.local_bytes / link.local_bandwidth


@dataclass(frozen=True)
class StepCost:
    """The predicted communication of one optimizer step of ``scheme``."""

    scheme: Scheme
    phases: tuple[Phase, ...]
    link: Link
    num_buckets: int

    @property
    def seconds(self) -> float:
        """Communication time of a step, all phases end to end: :attr:`latency_seconds`, :attr:`transfer_seconds`
        and :attr:`sharing_seconds`."""
        return sum(p.seconds(self.link) for p in self.phases) + self.sharing_seconds

    @property
    def sharing_seconds(self) -> float:
        """What the work inside a machine of the phases that overlap backward costs beyond the rest while
        backward shares its cores: all buckets but the last, ``(K - 1) / K`` of it, run beside backward and take
        ``overlap_slowdown`` times as long."""
        k = max(1, self.num_buckets)
        local = sum(p.local_seconds(self.link) for p in self.phases if p.overlaps_backward)
        return local * (self.link.overlap_slowdown - 1) * (k - 1) / k

    @property
    def rounds(self) -> int:
        return sum(p.rounds for p in self.phases)

    @property
    def latency_seconds(self) -> float:
        """The part of :attr:`seconds` the message rounds cost."""
        return sum(p.latency_seconds(self.link) for p in self.phases)

    @property
    def transfer_seconds(self) -> float:
        """The part of :attr:`seconds` the bytes cost."""
        return sum(p.transfer_seconds(self.link) for p in self.phases)

    @property
    def network_bytes(self) -> float:
        return sum(p.network_bytes for p in self.phases)

    def exposed_seconds(self, backward_seconds: float) -> float:
        """The part of :attr:`seconds` the step waits for: the gradient exchange runs bucket by bucket while
        backward computes the rest, so at most ``(K - 1) / K`` of the backward time hides it, never the last
        bucket's share; every other phase is waited for."""
        overlapping = sum(p.seconds(self.link) for p in self.phases if p.overlaps_backward) + self.sharing_seconds
        return exposed_seconds(overlapping, self.seconds - overlapping, self.num_buckets, backward_seconds)


def exposed_seconds(overlapping: float, waited: float, num_buckets: int, backward_seconds: float) -> float:
    """Seconds a step waits for its communication: all of ``waited``, and of ``overlapping`` (the bucket-by-bucket
    gradient exchange) what ``(K - 1) / K`` of backward cannot hide, at least the last bucket's ``1 / K``."""
    if overlapping == 0.0:
        return waited
    k = max(1, num_buckets)
    hidden_window = backward_seconds * (k - 1) / k
    return waited + max(overlapping / k, overlapping - hidden_window)


# ---------------------------------------------------------------------------------------------------- dedicated servers
def trainer_share(num_trainers: int, num_servers: int) -> float:
    """The fraction of the gradient bytes each trainer serves when ``num_servers`` dedicated servers take the rest,
    the split that equalises every machine's traffic; ``1 / n`` without servers (see :mod:`.servers`)."""
    n, k = num_trainers, num_servers
    if n == 1:
        return 1.0  # its own share costs no traffic at all
    if k == 0:
        return 1.0 / n
    return max(0.0, (n - k) / (n * n + k * n - 2 * k))


def dedicated_exchange_seconds(num_trainers: int, num_servers: int, nbytes: float, bandwidth: float) -> float:
    """Seconds a step's exchange takes on links of ``bandwidth`` bytes/s per machine with ``nbytes`` of gradients,
    trainers serving the optimal share: ``t(n, k) = 2 n (n - 1) / (n² + k n - 2 k) · S / B``, ``S / B`` for
    ``k >= n`` (bandwidth term only: no latency, no compute)."""
    n, k = num_trainers, num_servers
    if n <= 1:
        return 0.0
    if k >= n:
        return nbytes / bandwidth
    return 2 * n * (n - 1) / (n * n + k * n - 2 * k) * nbytes / bandwidth


# ---------------------------------------------------------------------------------------------------- the phases
def _ring(n: int, nbytes: float, buckets: int) -> tuple[int, float]:
    return 2 * (n - 1) * buckets, 2 * (n - 1) / n * nbytes


def step_phases(scheme: Scheme, topology: Topology, wire: Wire, plain: Wire | None = None) -> tuple[Phase, ...]:
    """The phases of one synchronized step. ``wire``: the buckets as they travel between machines (compressed);
    ``plain``: as they are (default ``wire``), what shared memory copies and what servers send back uncompressed."""
    plain = plain or wire
    n, m, local = topology.world_size, topology.num_nodes, topology.ranks_per_node
    k = len(wire.bucket_bytes)
    s_w, s = wire.total, plain.total
    if n == 1:
        return ()
    if scheme.strategy in ("ring_allreduce", "ddp"):
        if scheme.uses_shared_memory(topology):  # hierarchical: local rank i of every node on a ring of its own
            rounds, network = _ring(m, s_w, k * wire.passes) if m > 1 else (0, 0.0)
            copies = 2 * (local - 1) / local * s
            return (Phase("gradients", rounds, network, copies, overlaps_backward=True, local_rounds=2 * k),)
        # over sockets; on one machine the "link" is its loopback (as a ping-pong there measures it)
        rounds, network = _ring(n, s_w, k * wire.passes)
        return (Phase("gradients", rounds, network, overlaps_backward=True),)
    if scheme.num_servers:
        return _dedicated_phases(scheme, topology, s)
    if scheme.uses_shared_memory(topology):  # one node: every exchange is a copy
        copied_back = s if scheme.strategy == "parameter_server" else (local - 1) / local * s
        phases = [Phase("gradients", 0, 0.0, 2 * (local - 1) / local * s, overlaps_backward=True, local_rounds=2 * k)]
        if scheme.full_gradients:
            phases.append(Phase("averaged gradients", 0, 0.0, copied_back, overlaps_backward=True, local_rounds=k))
        return (*phases, Phase("vote", 1, 0.0), Phase("weights", 0, 0.0, copied_back, local_rounds=k))
    # sockets; on one machine every exchange goes over its loopback, priced as the link; across machines the hops
    # inside a machine run beside the network's, at the copy rate
    if scheme.strategy == "parameter_server":  # the server's machine receives from (and sends to) every other rank
        per_link, per_copy = (float(n - local), float(local - 1)) if m > 1 else (float(n - 1), 0.0)
        fan_in, fan_out = m - 1 if m > 1 else n - 1, 1  # into the server's link; each rank's gets one flow back
    else:  # each rank exchanges 1 / N of the buckets with every other rank
        per_link, per_copy = (local * (n - local) / n, (local - 1) / n) if m > 1 else ((n - 1) / n, 0.0)
        fan_in = fan_out = m - 1 if m > 1 else n - 1  # the machines sending to one machine's link at once
    weights = s_w if wire.weights_compressed else s
    if scheme.staleness != 0 or scheme.backup_workers:  # each worker pushes all its buckets in one message after
        # backward, then pulls, on its own schedule: the flows are not priced as arriving together
        return (Phase("gradients", 1, per_link * s, per_copy * s), Phase("weights", 1, per_link * s, per_copy * s))
    # a low-rank codec averages each factor with a push and a pull, and every rank then holds the result
    low_rank = wire.passes > 1
    rounds = k * wire.passes
    phases = [Phase("gradients", rounds, per_link * s_w, per_copy * s_w, True, flows=fan_in)]
    if low_rank:
        phases.append(Phase("averaged factors", rounds, per_link * s_w, per_copy * s_w, True, flows=fan_out))
    if scheme.full_gradients and not low_rank:
        phases.append(Phase("averaged gradients", k, per_link * s_w, per_copy * s_w, True, flows=fan_out))
    phases.append(Phase("vote", 1, 0.0))
    phases.append(Phase("weights", k, per_link * weights, per_copy * weights, flows=fan_out))
    return tuple(phases)


def _dedicated_phases(scheme: Scheme, topology: Topology, s: float) -> tuple[Phase, ...]:
    """Trainers on machines of their own (one rank each), ``k`` servers. ``sharded_ps``: the push and the pull
    each move half of :func:`dedicated_exchange_seconds`' bytes (what a link sends over the step, pushes and
    weights together: they overlap when the servers update piece by piece); ``parameter_server``: each moves the
    busier link's bytes. Trainer 0's control message and the members' tiny all-reduce (norm, vote) are rounds of
    their own."""
    n, k = topology.world_size, scheme.num_servers
    if scheme.strategy == "sharded_ps":
        per_phase = dedicated_exchange_seconds(n, k, s, 1.0) / 2
        # a server receives from every trainer; a trainer from every server and, keeping a share, every trainer
        fan_in, fan_out = n, k + (n - 1 if trainer_share(n, k) > 0 else 0)
    else:  # only the servers serve: a server's machine receives n S / k, a trainer's sends S
        per_phase = max(1.0, n / k) * s
        # the busier link, at equal bytes the one receiving from many: the push into a server from every trainer
        # (n >= k), the pull into a trainer from every server (k >= n)
        fan_in, fan_out = (n if n >= k else 1), (k if k >= n else 1)
    members = n + k
    return (
        Phase("gradients", 1, per_phase, overlaps_backward=True, flows=fan_in),
        Phase("control and vote", 1 + 2 * (members - 1), 0.0),
        Phase("weights", 1, per_phase, flows=fan_out),
    )


def step_cost(scheme: Scheme, topology: Topology, link: Link, wire: Wire, plain: Wire | None = None) -> StepCost:
    """The predicted communication of one step of ``scheme`` (see the module docstring)."""
    return StepCost(scheme, step_phases(scheme, topology, wire, plain), link, len(wire.bucket_bytes))


# ---------------------------------------------------------------------------------------------------- per rank
def rank_traffic(
    scheme: Scheme, world_size: int, bucket_bytes: float, rank: int, flag_bytes: float = 0.0, server: int = 0
) -> tuple[float, float]:
    """``(sent, received)`` bytes rank ``rank`` counts for one synchronized step on one machine's sockets or
    shared memory (``scheme.intra_node``), uncompressed, with ``bucket_bytes`` of buckets of which ``flag_bytes``
    are used-flags. Shared memory counts as received the bytes a peer produced that reach this rank's buffers (read
    by it or written into them by the peer), and as sent the bytes this rank produced that reach its peers'. Up to
    the rounding of chunks and shards to whole elements, and for ``sharded_ps`` through shared memory up to
    ``(N - 1) F`` more sent by the ranks whose slice of the buffer holds the flags (every rank reads every flag)."""
    n, s = world_size, bucket_bytes
    if n == 1:
        return 0.0, 0.0
    shared = scheme.intra_node == "shm" and scheme.strategy != "ddp"
    if scheme.strategy in ("ring_allreduce", "ddp"):
        return 2 * (n - 1) / n * s, 2 * (n - 1) / n * s
    back = 1 if scheme.full_gradients else 0
    if scheme.strategy == "sharded_ps":
        if shared:  # reduce-scatter, every rank reads every flag, then the weights (and gradients) copied back
            return 2 * (n - 1) / n * s + back * (n - 1) / n * s, 2 * (n - 1) / n * s + back * (n - 1) / n * s
        grads = s - flag_bytes
        one_way = (n - 1) / n * grads
        flags = (n - 1) * flag_bytes
        return (2 + back) * one_way + flags, (2 + back) * one_way + flags
    # central server
    if not shared:
        if rank == server:
            return (1 + back) * (n - 1) * s, (n - 1) * s
        return s, (1 + back) * s
    if rank == server:  # reduce-scatter, reads every other slice, everyone copies its weights (and gradients)
        return (n - 1) / n * s + (1 + back) * (n - 1) * s, 2 * (n - 1) / n * s
    return (n - 1) / n * s + s / n, (n - 1) / n * s + (1 + back) * s


def optimizer_state_peak(scheme: Scheme, world_size: int, state_bytes: float) -> float:
    """Bytes of optimizer state the most loaded rank (trainer or server) holds, for a model whose optimizer holds
    ``state_bytes`` in one process: all of it on every rank (ring, ``ddp``), on the server (central), ``1 / N``
    each (sharded), or split with dedicated servers by :func:`trainer_share`."""
    n, k = world_size, scheme.num_servers
    if scheme.strategy in ("ring_allreduce", "ddp") or n == 1:
        return float(state_bytes)
    if scheme.strategy == "parameter_server":
        return state_bytes / k if k else float(state_bytes)
    if k:
        x = trainer_share(n, k)
        return state_bytes * max(x, (1.0 - n * x) / k)
    return float(math.ceil(state_bytes / n))


@dataclass
class Prediction:
    """One scheme's row of :func:`lightning_dp.advise`: its cost, and the step time it implies."""

    scheme: Scheme
    cost: StepCost
    compute_seconds: float
    backward_seconds: float
    optimizer_state_bytes: float
    notes: list[str] = field(default_factory=list)
    #: the slowest rank's compute over the others' (``slowest`` of :func:`predict`), as the scheme meets it: the
    #: factor on the step's compute, and the fraction of the global batch a step uses
    work_factor: float = 1.0
    batch_fraction: float = 1.0

    @property
    def exposed_seconds(self) -> float:
        return self.cost.exposed_seconds(self.backward_seconds)

    @property
    def step_seconds(self) -> float:
        """Seconds per global batch's worth of samples: the step's compute (as the slowest rank bounds it) and
        exposed communication, over the fraction of the global batch a step uses."""
        return (self.compute_seconds * self.work_factor + self.exposed_seconds) / self.batch_fraction


def straggler_factors(scheme: Scheme, world_size: int, slowest: float) -> tuple[float, float]:
    """``(work_factor, batch_fraction)`` of :class:`Prediction` when one of ``world_size`` ranks computes
    ``slowest`` times slower than the others: equal shares wait for it (``s``); balanced shares spread the global
    batch by speed (``N s / ((N - 1) s + 1)``); backup workers leave it out (1, with ``(N - b) / N`` of the
    samples per step)."""
    if slowest == 1.0 or world_size == 1:
        return 1.0, 1.0
    if scheme.backup_workers:
        return 1.0, (world_size - scheme.backup_workers) / world_size
    if scheme.balance == "throughput":
        return world_size * slowest / ((world_size - 1) * slowest + 1), 1.0
    return slowest, 1.0


def predict(
    schemes: Sequence[Scheme],
    topology: Topology,
    link: Link,
    wires: dict[str, Wire],
    plain: Wire,
    compute_seconds: float,
    backward_seconds: float,
    state_bytes: float,
    slowest: float = 1.0,
) -> list[Prediction]:
    """A :class:`Prediction` per scheme, fastest predicted step first. ``wires`` maps a compression name to how
    the buckets travel with it (``"none"``: ``plain``); ``slowest``: one rank computes that many times slower
    than the others (a persistent straggler, :func:`straggler_factors`)."""
    rows = []
    for scheme in schemes:
        wire = wires.get(scheme.compression, plain)
        cost = step_cost(scheme, topology, link, wire, plain)
        state = optimizer_state_peak(scheme, topology.world_size, state_bytes)
        work, fraction = straggler_factors(scheme, topology.world_size, slowest)
        rows.append(Prediction(scheme, cost, compute_seconds, backward_seconds, state, [], work, fraction))
    rows.sort(key=lambda p: (p.step_seconds, p.optimizer_state_bytes))
    return rows
