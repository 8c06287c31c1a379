"""Dedicated parameter servers: processes of their own (on spare CPU machines) that aggregate and update.

A run has ``n`` trainers and ``k`` server processes, the *members* of one gloo group of their own
(:class:`MemberGroup`): trainers are members ``0 .. n - 1`` (their trainer ranks), servers ``n .. n + k - 1``.
The gradient buckets laid end to end are cut into ``n + k`` shares (:func:`member_segments`); a member serves its
share: it averages that part of every trainer's gradients, runs the user's optimizer on it (a
:class:`~lightning_dp.comm.sharded_optimizer.ShardedOptimizer`) and sends the new weights to every trainer.

With per-machine bandwidth ``B``, gradient bytes ``S``, trainers that serve a share ``x`` each and servers a share
``y`` each (``n x + k y = 1``), a trainer machine sends ``(1 - x) S`` gradients plus ``(n - 1) x S`` weights of its
share, a server machine receives ``n y S`` (and sends as much back). Equal loads give the optimal split
(:func:`~lightning_dp.comm.cost.trainer_share`)::

    x = (n - k) / (n² + k n - 2 k),   y = 2 (n - 1) / (n² + k n - 2 k),
    t(n, k) = 2 n (n - 1) / (n² + k n - 2 k) · S / B      (:func:`~lightning_dp.comm.cost.dedicated_exchange_seconds`)

``k = 0`` is the sharded server on the trainers (the ring's ``2 (n - 1) / n · S / B``); from ``k = n`` on the
trainers serve nothing and a step takes ``S / B``: each trainer sends its gradients once and receives the weights
once. ``parameter_server`` with ``k`` servers uses ``x = 0`` and whole parameters, so any per-parameter optimizer
runs there.

Trainers' side: :class:`DedicatedServerTransport` (a :class:`~lightning_dp.comm.transports.Transport` for the
gradient buckets, plus the control messages trainer 0 sends each step). Servers' side: :class:`DedicatedServer`,
run by ``python -m lightning_dp.server``. Per synchronization every trainer pushes each bucket's shares to their
owners during backward; per optimizer step trainer 0 sends a control message (which optimizer, its current
hyperparameters, the clipping Lightning asked for), every member takes part in one tiny all-reduce (the
gradients' squared norm for clipping by norm and a NaN/inf vote), the owners step, and every trainer receives the
new weights.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.cost import trainer_share
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.parameter_server import _average_in_rank_order, segments_at
from lightning_dp.comm.peers import PeerDirectory, wait_naming_peer
from lightning_dp.comm.rendezvous import JOB_ID_VARIABLE, JobRecord
from lightning_dp.comm.sharded_optimizer import Segment, ShardedOptimizer, ShardLayout, ShardPiece, hyperparameters
from lightning_dp.comm.sockets import tcp_sockets
from lightning_dp.comm.staging import Staging
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports import Transport

# message tags on the member group (a pair of members matches messages per tag, in order)
TAG_GRADIENTS, TAG_AVERAGED, TAG_CONTROL, TAG_EDITED, TAG_WEIGHTS, TAG_OBJECT = 11, 12, 13, 14, 15, 16
# control kinds (trainer 0 -> every server)
STEP, PULL, SET_WEIGHTS, STATE, LOAD, STOP, ABORT = 1, 2, 3, 4, 5, 6, 7
#: the prefix of the run's keys in the rendezvous store
STORE_PREFIX = "lightning_dp/servers"


# ---------------------------------------------------------------------------------------------------- the load split
def member_shares(num_trainers: int, num_servers: int, trainers_serve: bool) -> list[float]:
    """The fraction of the gradient bytes each member serves, trainers first: the optimal split
    (:func:`trainer_share`) when ``trainers_serve``, else ``1 / k`` per server and nothing on the trainers."""
    n, k = num_trainers, num_servers
    if not trainers_serve:
        if k == 0:
            raise ValueError("without dedicated servers the trainers must serve")
        return [0.0] * n + [1.0 / k] * k
    x = trainer_share(n, k)
    return [x] * n + ([(1.0 - n * x) / k] * k if k else [])


def member_segments(
    buckets: Sequence[GradientBucket], shares: Sequence[float], whole_parameters: bool
) -> list[list[Segment]]:
    """``[b][m]``: the range of bucket ``b``'s gradient region member ``m`` serves, the buckets laid end to end in
    bytes and cut by ``shares`` (fractions summing to 1); with ``whole_parameters`` each cut moves to the nearest
    parameter boundary, so that every parameter is served whole by one member."""
    sizes = [b.grad_numel for b in buckets]
    element_sizes = [b.buffer.element_size() for b in buckets]
    total = sum(n * e for n, e in zip(sizes, element_sizes))
    cuts, acc = [0], 0.0
    for share in shares[:-1]:
        acc += share
        cuts.append(min(total, round(total * acc)))
    cuts.append(total)
    if whole_parameters:
        boundaries, base = [0], 0
        for bucket, esize in zip(buckets, element_sizes):
            boundaries += [base + hi * esize for _, hi in bucket.slices]
            base += bucket.grad_numel * esize
        cuts = [cuts[0]] + [_nearest(boundaries, c) for c in cuts[1:-1]] + [cuts[-1]]
    return segments_at(sizes, element_sizes, cuts)


#: the largest single message: bigger tensors travel as several, which keeps a shaped link's throughput steady
MESSAGE_BYTES = 1 << 20


class _AllWorks:
    """Several works waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:  # noqa: SIM110 - each must be waited for
            work.wait(timeout) if timeout is not None else work.wait()
        return True


def _nearest(boundaries: Sequence[int], cut: int) -> int:
    return min(boundaries, key=lambda b: (abs(b - cut), b))


# ---------------------------------------------------------------------------------------------------- the group
class MemberGroup:
    """The gloo group of a run's trainers and dedicated servers (see the module docstring), on a store of its own
    under :data:`STORE_PREFIX`. Not registered with ``torch.distributed``: a server process has no default group,
    and Lightning's collectives never see the servers."""

    def __init__(self, store: dist.Store, rank: int, num_trainers: int, num_servers: int, timeout: timedelta) -> None:
        self.rank, self.num_trainers, self.num_servers = rank, num_trainers, num_servers
        self.size = num_trainers + num_servers
        self.backend: Any = dist.ProcessGroupGloo(store, rank, self.size, timeout)
        # every member's socket endpoints, so that a transport error giving only an address names the member
        try:
            mine = [f"{s['address']}:{s['port']}" for s in tcp_sockets()]
        except OSError:  # best effort: no /proc
            mine = []
        store.set(f"endpoints/{rank}", json.dumps(mine))
        self.directory = PeerDirectory(
            {endpoint: m for m in range(self.size) for endpoint in json.loads(store.get(f"endpoints/{m}"))}
        )

    @property
    def trainers(self) -> range:
        return range(self.num_trainers)

    @property
    def servers(self) -> range:
        return range(self.num_trainers, self.size)

    def name(self, member: int) -> str:
        """``"trainer 1"`` or ``"server 0 (member 3)"``."""
        if member < self.num_trainers:
            return f"trainer {member}"
        return f"server {member - self.num_trainers} (member {member})"

    def isend(self, tensor: Tensor, member: int, tag: int) -> Any:
        return self._pieces(self.backend.send, tensor, member, tag)

    def irecv(self, tensor: Tensor, member: int, tag: int) -> Any:
        return self._pieces(self.backend.recv, tensor, member, tag)

    def _pieces(self, op: Callable[..., Any], tensor: Tensor, member: int, tag: int) -> Any:
        """``op`` on ``tensor`` in messages of at most :data:`MESSAGE_BYTES`, each piece on a tag of its own: gloo
        then has every piece's receive announced at once, instead of one announcement per piece that would queue
        behind the bulk data already filling the link back."""
        if not tensor.numel():
            return None
        step = max(1, MESSAGE_BYTES // tensor.element_size())
        pieces = range(0, tensor.numel(), step)
        return _AllWorks([op([tensor[i : i + step]], member, tag * 65536 + k) for k, i in enumerate(pieces)])

    def wait(self, work: dist.Work | None, member: int, action: str, timeout: timedelta | None = None) -> None:
        """Wait for ``work`` (with ``member``); a lost member is named (see :func:`wait_naming_peer`)."""
        wait_naming_peer(work, self.name(self.rank), action, self.name(member), timeout)

    def wait_all(self, works: Sequence[tuple[Any, int, str]], timeout: timedelta | None = None) -> None:
        """:meth:`wait` for every ``(work, member, action)`` of ``works``, in order."""
        for work, member, action in works:
            self.wait(work, member, action, timeout)

    def all_reduce_sum(self, tensor: Tensor, timeout: timedelta | None = None) -> None:
        """Sum ``tensor`` over every member, in place, the same bits everywhere."""

        def lost(error: BaseException) -> str:
            member = self.directory.rank_in(str(error), exclude=self.rank)
            who = self.name(member) if member is not None else "a member (the transport error below gives its address)"
            return f"{who} during the step's vote of the trainers and servers"

        wait_naming_peer(self.backend.allreduce([tensor]), self.name(self.rank), "reach", lost, timeout)

    def send_object(self, obj: Any, member: int, timeout: timedelta | None = None, tag: int = TAG_OBJECT) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for tensor in (size, data):
            self.wait(self.isend(tensor, member, tag), member, "send a message to", timeout)

    def recv_object(self, member: int, timeout: timedelta | None = None, tag: int = TAG_OBJECT) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        self.wait(self.irecv(size, member, tag), member, "receive a message from", timeout)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.wait(self.irecv(data, member, tag), member, "receive a message from", timeout)
        return pickle.loads(data.numpy().tobytes())  # noqa: S301 - members of one run, on the run's private network

    def close(self) -> None:
        try:
            self.backend.shutdown()
        except Exception:  # noqa: BLE001, S110 - peers may be gone already
            pass


def run_store(
    host: str, port: int, run_key: str, timeout: timedelta, scope: str | None = None, publish: bool = False
) -> dist.Store:
    """A client of the rendezvous store at ``host:port``, narrowed to this run's keys under the job's ``scope``;
    without one, the scope the job's record names, once the record proves this process belongs to the job
    (:class:`~lightning_dp.comm.rendezvous.JobRecord`; :class:`ForeignJobError` otherwise). ``publish``: first
    write the record for ``scope`` (trainer 0, where no lightning-dp rendezvous wrote one)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if publish:
        assert scope is not None
        JobRecord.publish_for(store, scope)
    if scope is None:
        record = JobRecord.read(store, f"{host}:{port}", timeout)
        # a server is pointed at host:port by hand, often from another scheduler job: only an explicit job id counts
        record.check(f"{host}:{port}", "this dedicated server", os.environ.get(JOB_ID_VARIABLE) or None)
        scope = record.scope
    return dist.PrefixStore(f"{scope}/{STORE_PREFIX}/{run_key}", store)


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass
class OptimizerSpec:
    """How to rebuild one user optimizer on a server: its class (imported there by name), defaults and groups."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    #: per parameter group: the indices of its parameters in :attr:`ServerPlan.shapes`, and its hyperparameters
    groups: list[tuple[list[int], dict[str, Any]]]


@dataclass
class ServerPlan:
    """What trainer 0 tells every server at set-up (through the store)."""

    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    #: indices into :attr:`shapes` of each bucket's parameters, in bucket order
    buckets: list[list[int]]
    #: ``[b][m]`` as :func:`member_segments`
    segments: list[list[Segment]]
    optimizers: list[OptimizerSpec]
    #: whether the trainers' hooks read gradients: servers then send the averaged gradients back during backward
    #: and step with the edited gradients trainer 0 sends
    full_gradients: bool
    owner: str = "dedicated server"
    extra: dict[str, Any] = field(default_factory=dict)


def check_importable(cls: type, owner: str) -> None:
    """Servers import the optimizer class by name: refuse one they cannot find (defined in ``__main__``, local)."""
    module, name = cls.__module__, cls.__qualname__
    found: Any = None
    if module != "__main__" and "<locals>" not in name:
        try:
            found = importlib.import_module(module)
            for part in name.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
    if found is not cls:
        raise ConfigurationError(
            f"{owner}: the optimizer class {name} (module {module}) cannot be imported by the server processes, which "
            "rebuild it by name: define it in an importable module (not in the script run as __main__)"
        )


def optimizer_spec(optimizer: torch.optim.Optimizer, index_of: dict[int, int]) -> OptimizerSpec:
    groups = [([index_of[id(p)] for p in g["params"]], hyperparameters(g)) for g in optimizer.param_groups]
    return OptimizerSpec(type(optimizer), dict(optimizer.defaults), groups)


def buckets_of(plan_groups: Sequence[tuple[list[int], dict[str, Any]]], buckets: Sequence[Sequence[int]]) -> list[int]:
    """The buckets holding any parameter of an optimizer whose groups are ``plan_groups``."""
    ids = {i for indices, _ in plan_groups for i in indices}
    return [b for b, params in enumerate(buckets) if any(i in ids for i in params)]


def _header(kind: int, optimizer_index: int = 0, syncs: int = 0) -> Tensor:
    return torch.tensor([kind, optimizer_index, syncs], dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------- trainers' side
class DedicatedServerTransport(Transport):
    """The trainers' side of dedicated servers (see the module docstring). ``group`` is the trainers' own gradient
    group (its ring carries the trainers' votes); the exchanges run on ``members``. :meth:`reduce` pushes each
    owner its share of the bucket (and the used-flags) and averages this trainer's own share; :meth:`share` brings
    back the averaged gradients (when the hooks read them); :meth:`share_weights` the new weights. GPU buckets are
    staged through pinned CPU memory (blocking copies on the communication thread's stream)."""

    def __init__(
        self,
        members: MemberGroup,
        shares: Sequence[float],
        whole_parameters: bool,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(group, stats)
        self.members = members
        self.me = members.rank
        self.shares = list(shares)
        self.whole_parameters = whole_parameters
        self.timeout = timeout
        self.segments: list[list[Segment]] = []
        #: synchronizations started so far (trainer 0 tells the servers how many a step follows)
        self.syncs = 0
        self._num_buckets = 0
        self._staging: dict[int, Tensor] = {}
        #: set around a step's backward when the servers update each bucket as it arrives (see :meth:`arm`)
        self._eager: dict[str, Any] | None = None
        self._sent: list[tuple[dist.Work | None, int, str]] = []
        self._buckets: list[GradientBucket] = []
        self._arriving: dict[int, tuple[list[tuple[dist.Work | None, int, str]], dict[int, tuple[Tensor, Tensor]]]]
        self._arriving = {}
        self._pending: list[tuple[dist.Work | None, int, GradientBucket, Segment, Tensor | None]] = []

    def _bind(self, buckets: Sequence[GradientBucket]) -> None:
        self._buckets = list(buckets)
        self.segments = member_segments(buckets, self.shares, self.whole_parameters)
        self._num_buckets = len(buckets)
        for b in buckets:
            if b.buffer.is_cuda:
                self._staging[b.index] = torch.empty(b.buffer.shape, dtype=b.buffer.dtype, pin_memory=True)

    def _default_staging(self, buckets: Sequence[GradientBucket]) -> Staging:
        # the exchanges run on the member group and outlive one call (an armed backward's weights arrive later):
        # the transport keeps its own pinned host copies (``_staging``)
        return Staging()

    @property
    def crosses_network(self) -> bool:
        return True

    def owned(self, bucket: GradientBucket) -> Segment:
        start, end = self.segments[bucket.index][self.me]
        return (start, end)

    def _host(self, bucket: GradientBucket) -> Tensor:
        """The bucket's CPU copy (itself on CPU)."""
        return self._staging.get(bucket.index, bucket.buffer)

    def _to_host(self, bucket: GradientBucket) -> Tensor:
        host = self._host(bucket)
        if host is not bucket.buffer:
            host.copy_(bucket.buffer)  # blocking: ordered after the producing stream's work
        return host

    def _from_host(self, bucket: GradientBucket, ranges: Sequence[Segment]) -> None:
        host = self._host(bucket)
        if host is not bucket.buffer:
            for start, end in ranges:
                bucket.buffer[start:end].copy_(host[start:end])

    def _owners(self, bucket: GradientBucket) -> list[tuple[int, Segment]]:
        return [(m, (s, e)) for m, (s, e) in enumerate(self.segments[bucket.index]) if e > s]

    def arm(self, control: dict[str, Any]) -> None:
        """The next synchronization is a step's: the servers update each bucket as soon as every trainer's share of
        it is in, with ``control`` (trainer 0's: hyperparameters, clipping by value, step arguments), and send the
        new weights back at once, while later buckets are still being pushed; :meth:`finish_eager` collects them."""
        self._eager = control

    def disarm(self) -> None:
        self._eager = None

    def _reduce(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        if wire is not None:
            raise ValueError("dedicated servers carry full-precision buckets: use no codec")
        if bucket.index == 0:
            self.syncs += 1
            if self.me == 0:  # every synchronization starts with trainer 0 saying whether the servers step in it
                for server in self.members.servers:
                    self.members.send_object(self._eager, server, self.timeout, TAG_GRADIENTS)
        host = self._to_host(bucket)
        flags = host[bucket.grad_numel :]
        flags_out = flags.clone()  # this trainer's own flags, while its share's flags sum everyone's below
        if bucket.index == 0:  # this trainer's share of every bucket: announced before any of its pushes leaves
            self._arriving = {b.index: self._receive_share(b) for b in self._buckets}
        start, end = self.owned(bucket)
        works, received = self._arriving.pop(bucket.index, ([], {}))
        if self._eager is not None:  # the servers' new weights of this bucket, waited for after backward
            for owner, (s, e) in self._owners(bucket):
                if owner >= self.members.num_trainers:
                    status = torch.zeros(1, dtype=torch.float64)
                    self._pending.append(
                        (self.members.irecv(status, owner, TAG_WEIGHTS), owner, bucket, (s, e), status)
                    )
                    self._pending.append(
                        (self.members.irecv(host[s:e], owner, TAG_WEIGHTS), owner, bucket, (s, e), None)
                    )
        for owner, (s, e) in self._owners(bucket):  # after the receives are announced (see MemberGroup._pieces)
            if owner != self.me:  # not waited for here: the next bucket's push overlaps (see wait_sent)
                for tensor in (host[s:e], flags_out):
                    self._sent.append((self.members.isend(tensor, owner, TAG_GRADIENTS), owner, "push gradients to"))
                self.stats.add(sent=(e - s + flags.numel()) * host.element_size())
        self.members.wait_all(works, self.timeout)
        if received:
            mine = host[start:end]
            parts = [mine if t == self.me else received[t][0] for t in self.members.trainers]
            _average_in_rank_order(parts, len(parts), mine)
            for _, their_flags in received.values():
                flags.add_(their_flags)
            self.stats.add(received=sum((g.numel() + f.numel()) * g.element_size() for g, f in received.values()))
            self._from_host(bucket, [(start, end), (bucket.grad_numel, bucket.buffer.numel())])

    def _receive_share(
        self, bucket: GradientBucket
    ) -> tuple[list[tuple[dist.Work | None, int, str]], dict[int, tuple[Tensor, Tensor]]]:
        """Start receiving every other trainer's gradients (and flags) of this trainer's share of ``bucket``."""
        start, end = self.owned(bucket)
        works: list[tuple[dist.Work | None, int, str]] = []
        received: dict[int, tuple[Tensor, Tensor]] = {}
        if end > start:
            flags = bucket.buffer[bucket.grad_numel :]
            for t in self.members.trainers:
                if t != self.me:
                    grads = torch.empty(end - start, dtype=bucket.buffer.dtype)
                    their_flags = torch.empty(flags.shape, dtype=flags.dtype)
                    for tensor in (grads, their_flags):
                        works.append((self.members.irecv(tensor, t, TAG_GRADIENTS), t, "receive gradients from"))
                    received[t] = (grads, their_flags)
        return works, received

    def _share(self, bucket: GradientBucket, wire: torch.dtype | None, residual: Tensor | None) -> None:
        """The owners' averaged gradients (and the combined used-flags, from the bucket's first owner)."""
        self._receive_shares(bucket, TAG_AVERAGED, with_flags=True)

    def share_weights(self, bucket: GradientBucket, from_servers: bool = True) -> None:
        """The owners' new weights of ``bucket`` into its gradient region (this trainer packed its own share); only
        the trainers' shares without ``from_servers`` (the servers' came during an armed backward)."""
        self._receive_shares(bucket, TAG_WEIGHTS, with_flags=False, from_servers=from_servers)

    def share_weights_all(self, buckets: Sequence[GradientBucket], from_servers: bool = True) -> None:
        """:meth:`share_weights` of every bucket at once (all messages in flight together)."""
        self.wait_sent()
        started = [(bucket, *self._start_share(bucket, TAG_WEIGHTS, False, from_servers, phase="receive"))
                   for bucket in buckets]  # fmt: skip
        for bucket, works, _ in started:  # every receive announced before any send (see MemberGroup._pieces)
            works += self._start_share(bucket, TAG_WEIGHTS, False, from_servers, phase="send")[0]
        for bucket, works, ranges in started:
            self.members.wait_all(works, self.timeout)
            self._from_host(bucket, ranges)

    def _receive_shares(self, bucket: GradientBucket, tag: int, with_flags: bool, from_servers: bool = True) -> None:
        self.wait_sent()
        works, ranges = self._start_share(bucket, tag, with_flags, from_servers)
        self.members.wait_all(works, self.timeout)
        self._from_host(bucket, ranges)

    def _start_share(
        self, bucket: GradientBucket, tag: int, with_flags: bool, from_servers: bool, phase: str = "both"
    ) -> tuple[list[tuple[dist.Work | None, int, str]], list[Segment]]:
        owners = [(m, seg) for m, seg in self._owners(bucket) if from_servers or m < self.members.num_trainers]
        if not owners:
            return [], []
        host = self._host(bucket)
        start, end = self.owned(bucket)
        if end > start and host is not bucket.buffer:
            host[start:end].copy_(bucket.buffer[start:end])
        works: list[tuple[dist.Work | None, int, str]] = []
        ranges: list[Segment] = []
        phases = {"both": (True, False), "receive": (True,), "send": (False,)}[phase]
        for receiving in phases:  # every receive announced before any send (see MemberGroup._pieces)
            for owner, (s, e) in owners:
                tensors = [host[s:e]] + ([host[bucket.grad_numel :]] if with_flags and owner == owners[0][0] else [])
                if owner == self.me and not receiving:
                    for t in self.members.trainers:
                        if t != self.me:
                            for tensor in tensors:
                                works.append((self.members.isend(tensor, t, tag), t, "send its share to"))
                                self.stats.add(sent=tensor.numel() * tensor.element_size())
                elif owner != self.me and receiving:
                    for tensor in tensors:
                        works.append((self.members.irecv(tensor, owner, tag), owner, "receive its share from"))
                        self.stats.add(received=tensor.numel() * tensor.element_size())
                    ranges.append((s, e))
        if with_flags and owners[0][0] != self.me and True in phases:
            ranges.append((bucket.grad_numel, bucket.buffer.numel()))
        return works, ranges

    def wait_sent(self) -> None:
        """Wait for the pushes still leaving (before anything rewrites the buckets)."""
        sent, self._sent = self._sent, []
        self.members.wait_all(sent, self.timeout)

    def finish_eager(self) -> list[int]:
        """After an armed backward: wait for the servers' new weights (into the buckets' gradient regions); the
        servers that found a non-finite gradient (they did not update that bucket's share)."""
        self.wait_sent()
        bad = []
        pending, self._pending = self._pending, []
        for work, owner, bucket, (s, e), status in pending:
            self.members.wait(work, owner, "receive the new weights from", self.timeout)
            if status is not None:
                if float(status) != 0.0 and owner not in bad:
                    bad.append(owner)
            else:
                self.stats.add(received=(e - s) * bucket.buffer.element_size())
                self._from_host(bucket, [(s, e)])
        return bad

    def _all_reduce(self, tensor: Tensor, bucket: GradientBucket) -> None:
        raise ConfigurationError("dedicated servers run without compression: codecs have no all-reduce there")

    # ------------------------------------------------------------------ trainer 0's control messages
    def control(self, kind: int, optimizer_index: int = 0, payload: Any = None) -> None:
        """Trainer 0: send every server a control message (with a pickled ``payload`` if given)."""
        header = _header(kind, optimizer_index, self.syncs)
        for server in self.members.servers:
            self.members.wait(self.members.isend(header, server, TAG_CONTROL), server, "send a control message to",
                              self.timeout)  # fmt: skip
            if kind in (STEP, LOAD, ABORT):
                self.members.send_object(payload, server, self.timeout)

    def send_edited(self, buckets: Sequence[GradientBucket]) -> None:
        """Trainer 0: each server's share of the gradients of ``buckets``' parameters as ``param.grad`` holds them now
        (edited by the hooks; the buckets' contents are overwritten)."""
        self.wait_sent()
        works = []
        for bucket in buckets:
            for i, p in enumerate(bucket.params):
                bucket.fill(i, p.grad)
            host = self._to_host(bucket)
            for owner, (s, e) in self._owners(bucket):
                if owner >= self.members.num_trainers:
                    for tensor in (host[s:e], host[bucket.grad_numel :]):
                        works.append((self.members.isend(tensor, owner, TAG_EDITED), owner, "send gradients to"))
                        self.stats.add(sent=tensor.numel() * tensor.element_size())
        self.members.wait_all(works, self.timeout)

    def send_weights(self, buckets: Sequence[GradientBucket]) -> None:
        """Trainer 0: every server's share of the current parameters (at the start of training, after a restore)."""
        works = []
        for bucket in buckets:
            host = self._host(bucket)
            for owner, (s, e) in self._owners(bucket):
                if owner >= self.members.num_trainers:
                    values = bucket.read_params(s, e, torch.empty(e - s, dtype=host.dtype))
                    works.append((self.members.isend(values, owner, TAG_WEIGHTS), owner, "send weights to"))
        self.members.wait_all(works, self.timeout)

    def vote(self, squares: float, bad: bool) -> tuple[float, bool]:
        """Every member: the sum of the squared gradient norms of every share, and whether any share is not finite."""
        tensor = torch.tensor([squares, 1.0 if bad else 0.0], dtype=torch.float64)
        self.members.all_reduce_sum(tensor, self.timeout)
        return float(tensor[0]), bool(tensor[1] > 0)

    def stop_servers(self) -> None:
        """Trainer 0: tell every server the run is over and wait until each has taken it in."""
        self.control(STOP)
        for server in self.members.servers:
            self.members.recv_object(server, self.timeout)

    def server_states(self, optimizer_index: int) -> list:
        """Trainer 0: every server's pieces of optimizer ``optimizer_index``'s state."""
        self.control(STATE, optimizer_index)
        return [self.members.recv_object(server, self.timeout) for server in self.members.servers]

    def close(self) -> None:
        self.members.close()


def clip_coefficient(max_norm: float, squares: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor for a total 2-norm of ``sqrt(squares)``."""
    return min(1.0, max_norm / (squares**0.5 + 1e-6))


def clip_pieces(sharded: ShardedOptimizer, clip: tuple[str, float] | None, squares_total: float) -> None:
    """Apply Lightning's clipping request (``("norm", max)`` with the global squared norm, or ``("value", v)``)."""
    if clip is None:
        return
    kind, value = clip
    if kind == "value":
        sharded.clip_grad_value_(value)
    else:
        coefficient = torch.clamp(value / (torch.tensor(squares_total, dtype=torch.float64).sqrt() + 1e-6), max=1.0)
        for _, grad in sharded.gradients():
            grad.mul_(coefficient.to(grad.dtype))


def squared_norm(sharded: ShardedOptimizer) -> float:
    return sum(float(grad.detach().double().pow(2).sum()) for _, grad in sharded.gradients())


def first_bad(sharded: ShardedOptimizer) -> bool:
    return first_nonfinite(sharded.gradients()) is not None


# ---------------------------------------------------------------------------------------------------- servers' side
class DedicatedServer:
    """One server process's share: its own copy of its weights and the optimizer state over them, fed by the
    trainers (see the module docstring). :meth:`run` serves until trainer 0 says stop; a lost trainer ends it with
    :class:`~lightning_dp.comm.errors.PeerUnreachableError` naming the trainer."""

    def __init__(
        self, members: MemberGroup, plan: ServerPlan, on_lost: Callable[[BaseException], None] | None = None
    ) -> None:
        self.members, self.plan = members, plan
        #: called (on the receiving thread) when a trainer is lost before trainer 0 said stop; by default the error
        #: waits for the serving loop
        self.on_lost = on_lost
        self.stopping = False
        me = members.rank
        params = [torch.nn.Parameter(torch.empty(shape, dtype=plan.dtype, device="meta")) for shape in plan.shapes]
        self.buckets = [GradientBucket(b, [params[i] for i in indices]) for b, indices in enumerate(plan.buckets)]
        owner = f"{members.name(me)} ({plan.owner})"
        self.layout = ShardLayout(self.buckets, plan.segments, me, owner, own_storage=True, read_params=False)
        self.optimizers = [ShardedOptimizer(self._template(spec, params), self.layout, None, owner)
                           for spec in plan.optimizers]  # fmt: skip
        self.served = [b.index for b in self.buckets if plan.segments[b.index][me][1] > plan.segments[b.index][me][0]]
        self.offset: dict[int, int] = {}
        offset = 0
        for b in self.buckets:
            self.offset[b.index] = offset
            start, end = plan.segments[b.index][me]
            offset += end - start
        self.gradients = torch.zeros_like(self.layout.storage)
        self.flags = {b: torch.zeros(len(plan.buckets[b]), dtype=plan.dtype) for b in self.served}
        self._scratch = {b: [torch.empty(self._numel(b), dtype=plan.dtype) for _ in members.trainers]
                         for b in self.served}  # fmt: skip
        self._flag_scratch = {b: [torch.empty_like(self.flags[b]) for _ in members.trainers] for b in self.served}
        self._synced = 0
        self._consumed = 0
        self._sync_error: BaseException | None = None
        self._cond = threading.Condition()
        self.steps = 0

    @staticmethod
    def _template(spec: OptimizerSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import inspect

        accepted = inspect.signature(spec.cls.__init__).parameters
        defaults = {k: v for k, v in spec.defaults.items() if k in accepted}
        return spec.cls([{**hyper, "params": [params[i] for i in indices]} for indices, hyper in spec.groups],
                        **defaults)  # fmt: skip

    def _numel(self, b: int) -> int:
        start, end = self.plan.segments[b][self.members.rank]
        return end - start

    def _share_of(self, b: int) -> slice:
        return slice(self.offset[b], self.offset[b] + self._numel(b))

    # ------------------------------------------------------------------ gradients, on a thread of their own
    def _receive_syncs(self) -> None:
        members = self.members
        try:
            while True:
                eager = members.recv_object(0, tag=TAG_GRADIENTS)  # trainer 0 starts every synchronization
                if eager is not None:
                    self._apply_hyperparameters(eager)
                arriving = {b: [(members.irecv(tensor, t, TAG_GRADIENTS), t) for t in members.trainers
                                for tensor in (self._scratch[b][t], self._flag_scratch[b][t])]
                            for b in self.served}  # fmt: skip
                sending: list[tuple[dist.Work | None, int]] = []
                for b in self.served:
                    for work, t in arriving[b]:
                        members.wait(work, t, "receive gradients from")
                    _average_in_rank_order(self._scratch[b], members.num_trainers, self.gradients[self._share_of(b)])
                    self.flags[b].zero_()
                    for their_flags in self._flag_scratch[b]:
                        self.flags[b].add_(their_flags)
                    if self.plan.full_gradients:
                        sending += self._send_to_trainers(b, TAG_AVERAGED, self.gradients, self._first_owner(b))
                    if eager is not None:
                        sending += self._step_bucket(b, eager)
                for work, t in sending:
                    members.wait(work, t, "send to")
                with self._cond:
                    self._synced += 1
                    if eager is not None:
                        self._consumed = self._synced
                    self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - reported by the serving loop when it needs the gradients
            with self._cond:
                self._sync_error = error
                self._cond.notify_all()
            if not self.stopping and self.on_lost is not None:
                self.on_lost(error)

    def _apply_hyperparameters(self, control: dict[str, Any]) -> None:
        sharded = self.optimizers[0]
        for group, hyper in zip(sharded.optimizer.param_groups, control["hyperparameters"]):
            group.update(hyper)

    def _step_bucket(self, b: int, control: dict[str, Any]) -> list[tuple[dist.Work | None, int]]:
        """An armed synchronization: update this server's share of bucket ``b`` now and start sending it to every
        trainer, after a status (1: a non-finite gradient, the share left as it was); the sends' works."""
        sharded = self.optimizers[0]
        pieces = [pc for pc in sharded.pieces if pc.bucket.index == b]
        self._take_gradients(pieces)
        bad = first_nonfinite([(pc.param, pc.tensor.grad) for pc in pieces if pc.tensor.grad is not None]) is not None
        if bad:
            for piece in pieces:
                piece.tensor.grad = None
        else:
            clip = control["clip"]
            if clip is not None:  # by value only: an armed step never clips by norm
                for piece in pieces:
                    if piece.tensor.grad is not None:
                        piece.tensor.grad.clamp_(-clip[1], clip[1])
            sharded.step(**control["kwargs"])
            if b == self.served[-1]:
                self.steps += 1
        status = torch.tensor([1.0 if bad else 0.0], dtype=torch.float64)
        works = []
        for trainer in self.members.trainers:
            works.append((self.members.isend(status, trainer, TAG_WEIGHTS), trainer))
            works.append((self.members.isend(self.layout.storage[self._share_of(b)], trainer, TAG_WEIGHTS), trainer))
        return works

    def _first_owner(self, b: int) -> bool:
        return next(m for m, (s, e) in enumerate(self.plan.segments[b]) if e > s) == self.members.rank

    def _send_to_trainers(
        self, b: int, tag: int, source: Tensor, with_flags: bool = False
    ) -> list[tuple[dist.Work | None, int]]:
        """Start sending this server's share of bucket ``b`` (of ``source``) to every trainer; the works."""
        tensors = [source[self._share_of(b)]] + ([self.flags[b]] if with_flags else [])
        return [(self.members.isend(t, trainer, tag), trainer) for trainer in self.members.trainers for t in tensors]

    def _send_and_wait(self, b: int, tag: int, source: Tensor) -> None:
        for work, trainer in self._send_to_trainers(b, tag, source):
            self.members.wait(work, trainer, "send to")

    def _wait_syncs(self, syncs: int) -> None:
        with self._cond:
            while self._synced < syncs and self._sync_error is None:
                self._cond.wait()
            if self._synced < syncs and self._sync_error is not None:
                raise self._sync_error

    # ------------------------------------------------------------------ the serving loop
    def run(self) -> None:
        """Serve until trainer 0 sends STOP (returns) or ABORT (raises), or a trainer is lost (raises)."""
        threading.Thread(target=self._receive_syncs, daemon=True, name="lddp-server-gradients").start()
        header = torch.zeros(3, dtype=torch.int64)
        while True:
            self.members.wait(self.members.irecv(header, 0, TAG_CONTROL), 0, "receive the next control message from")
            kind, index, syncs = (int(v) for v in header.tolist())
            if kind == STOP:  # acknowledged: the trainers leave only once every server knows the run is over
                self.stopping = True
                self.members.send_object("stopped", 0)
                return
            if kind == ABORT:
                reason = self.members.recv_object(0)
                raise RuntimeError(f"trainer 0 stopped the run: {reason}")
            if kind == STEP:
                self._step(index, syncs, self.members.recv_object(0))
            elif kind == PULL:  # a timed exchange: its gradients are nobody's step
                self._wait_syncs(syncs)
                self._consumed = max(self._consumed, syncs)
                for b in self.served:
                    self._send_and_wait(b, TAG_WEIGHTS, self.layout.storage)
            elif kind == SET_WEIGHTS:
                works = [(self.members.irecv(self.layout.storage[self._share_of(b)], 0, TAG_WEIGHTS), b)
                         for b in self.served]  # fmt: skip
                for work, _ in works:
                    self.members.wait(work, 0, "receive the weights from")
            elif kind == STATE:
                self.members.send_object(self.optimizers[index].local_state(), 0)
            elif kind == LOAD:
                self.optimizers[index].load_state_dict(self.members.recv_object(0))

    def _step(self, index: int, syncs: int, control: dict[str, Any]) -> None:
        sharded = self.optimizers[index]
        spec = self.plan.optimizers[index]
        mine = [b for b in buckets_of(spec.groups, self.plan.buckets) if b in self.served]
        for group, hyper in zip(sharded.optimizer.param_groups, control["hyperparameters"]):
            group.update(hyper)
        if syncs > self._consumed:  # a synchronization since the last step: every optimizer's pieces take it
            self._wait_syncs(syncs)
            self._consumed = syncs
            if not self.plan.full_gradients:
                self._take_gradients(self.layout.pieces)
        if self.plan.full_gradients:  # the gradients as the trainers' hooks left them, from trainer 0
            works = []
            for b in mine:
                for tensor in (self.gradients[self._share_of(b)], self.flags[b]):
                    works.append(self.members.irecv(tensor, 0, TAG_EDITED))
            for work in works:
                self.members.wait(work, 0, "receive gradients from")
            self._take_gradients(sharded.pieces)
        clip = None if self.plan.full_gradients else control["clip"]
        squares = squared_norm(sharded) if clip is not None and clip[0] == "norm" else 0.0
        total, bad = self.members_vote(squares, first_bad(sharded))
        if bad:
            for piece in sharded.pieces:
                piece.tensor.grad = None
            return
        clip_pieces(sharded, clip, total)
        sharded.step(**control["kwargs"])
        self.steps += 1
        for b in mine:
            self._send_and_wait(b, TAG_WEIGHTS, self.layout.storage)

    def _take_gradients(self, pieces: Sequence[ShardPiece]) -> None:
        for piece in pieces:
            if piece.bucket.index in self.flags:
                used = bool(self.flags[piece.bucket.index][piece.index_in_bucket] != 0)
                n = piece.tensor.numel()
                grad = self.gradients[piece.storage_start : piece.storage_start + n].view_as(piece.tensor)
                piece.tensor.grad = grad.clone() if used else None

    def members_vote(self, squares: float, bad: bool) -> tuple[float, bool]:
        tensor = torch.tensor([squares, 1.0 if bad else 0.0], dtype=torch.float64)
        self.members.all_reduce_sum(tensor)
        return float(tensor[0]), bool(tensor[1] > 0)
