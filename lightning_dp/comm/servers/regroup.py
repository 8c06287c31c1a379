"""Dedicated servers that go on when a trainer or a server is lost (``on_rank_loss="continue"``).

The trainers agree on a loss among themselves (:mod:`lightning_dp.comm.membership`); the servers take no part in it.
A server's loss is seen by every trainer (its connections close) and starts a change that loses no trainer
(:meth:`~lightning_dp.comm.membership.Membership.request_change`). Either way the trainers' lowest survivor, the
leader, then probes every server and tells each one how the run goes on (:class:`Regroup`: the new generation, how
many trainers train now, which servers serve which shares, where the member group meets) on a connection of its own,
which the server listens on from set-up (:class:`RegroupListener`). The server fences its member group, so that
whatever it waited for fails at once, and forms the next one with the survivors.

The trainers hold no share: the servers hold the whole state, and a trainer's loss takes none of it. Each server's
server's shares have their replicas on its neighbour (:func:`replica_holders`): the server forwards its summed
gradients to it at every synchronization and the neighbour steps its copies with the same request, so a lost server's
shares are taken over by its neighbour, whose range of every bucket they adjoin (:func:`serving_after`,
:func:`union_segments`). After a loss every share the servers left serve has its replica made again on its server's
new neighbour (:func:`replicas_to_make`), its state sent once by the server, so that the next loss is survived too.

Each step is a sequence of requests from the leader that a server can answer again after a regroup
(:class:`RegroupingServer`): ``SYNC`` (sum every trainer's gradients, forward them to the replica, acknowledge),
``VOTE`` (the shares' squared norm and NaN/inf flag), ``STEP`` (update each share and replica once per step key,
whatever number of times it is asked, and send the new weights), ``PULL``, and the set-up's and checkpoints' requests.
"""

from __future__ import annotations

import errno
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.membership.fence import Connection, connections_opened_by, fence
from lightning_dp.comm.servers.members import MemberGroup, Tag
from lightning_dp.comm.servers.plan import Control, ServerPlan, buckets_of
from lightning_dp.comm.servers.replicas import ReplicaLostError
from lightning_dp.comm.servers.server import DedicatedServer
from lightning_dp.comm.servers.sharded_optimizer import Segment
from lightning_dp.comm.transports.shards import _average_in_rank_order

#: the largest regroup message a server reads (it is a few hundred bytes)
_MESSAGE_LIMIT = 1 << 16


@dataclass(frozen=True)
class Regroup:
    """How the run goes on after a loss, from the trainers' leader to every server."""

    #: the trainers' membership generation (a server follows only a newer one than it has)
    generation: int
    num_trainers: int
    #: the servers that serve now (their indices when the run started), in member order, and the shares each serves
    servers: tuple[int, ...]
    serves: tuple[tuple[int, ...], ...]
    #: the store the next member group meets on, and its prefix there
    store: tuple[str, int]
    prefix: str
    #: proof that the message comes from this run, not from a stray process
    token: str

    def encode(self) -> bytes:
        return _frame({"generation": self.generation, "num_trainers": self.num_trainers, "servers": list(self.servers),
                       "serves": [list(s) for s in self.serves], "store": list(self.store), "prefix": self.prefix,
                       "token": self.token})  # fmt: skip

    @classmethod
    def decode(cls, fields: dict[str, Any]) -> Regroup:
        return cls(int(fields["generation"]), int(fields["num_trainers"]), tuple(int(s) for s in fields["servers"]),
                   tuple(tuple(int(x) for x in s) for s in fields["serves"]),
                   (str(fields["store"][0]), int(fields["store"][1])), str(fields["prefix"]),
                   str(fields["token"]))  # fmt: skip


def _frame(fields: dict[str, Any]) -> bytes:
    data = json.dumps(fields).encode()
    return struct.pack("!I", len(data)) + data


def replica_holders(servers: Sequence[int]) -> dict[int, int]:
    """Where each server's shares have their replicas, ``servers`` being those serving now in member order: on the
    next server, the last one's on the one before it (so that a server's shares and its holder's always adjoin in every
    bucket); none for a single server."""
    if len(servers) < 2:
        return {}
    return {s: servers[i + 1] if i + 1 < len(servers) else servers[i - 1] for i, s in enumerate(servers)}


def serving_after(
    serves: dict[int, tuple[int, ...]], lost: set[int], unreplicated: Collection[int] = ()
) -> dict[int, tuple[int, ...]]:
    """Which shares each server serves once the servers ``lost`` are gone (``serves``: before, by server in member
    order): a lost server's shares move to its replicas' holder (:func:`replica_holders`).
    :class:`~.replicas.ReplicaLostError` where a share has no live replica: a single server, its holder lost too, or a
    share among ``unreplicated`` (its new replica not confirmed made yet)."""
    holders = replica_holders(sorted(serves))
    after = {s: tuple(shares) for s, shares in serves.items() if s not in lost}
    for server in sorted(lost):
        holder = holders.get(server)
        without = sorted(set(serves[server]) & set(unreplicated))
        if holder is None or holder not in after or without:
            gone = ", ".join(f"share {share}" for share in (without or serves[server]))
            raise ReplicaLostError(
                f"dedicated server {server} was lost with {gone} of the servers' state, which has no replica on a "
                "live server (a single server, the holder of its replicas lost too, or a replica still being made): "
                "restart the run from its last checkpoint"
            )
        after[holder] = tuple(sorted((*after[holder], *serves[server])))
    return after


def replicas_to_make(
    before: dict[int, tuple[int, ...]], after: dict[int, tuple[int, ...]]
) -> dict[int, tuple[int, ...]]:
    """``server -> shares``: the replicas each server must receive once the servers serve ``after`` instead of
    ``before`` (both by server in member order): those of the shares whose holder changed, a share taken over by its
    holder among them."""
    held_before = replica_holders(sorted(before))
    where_before = {share: held_before.get(server) for server, shares in before.items() for share in shares}
    holders = replica_holders(sorted(after))
    make: dict[int, tuple[int, ...]] = {}
    for server, shares in after.items():
        holder = holders.get(server)
        if holder is not None:
            moved = tuple(share for share in shares if where_before.get(share) != holder)
            if moved:
                make[holder] = tuple(sorted((*make.get(holder, ()), *moved)))
    return make


def union_segments(server_segments: list[list[Segment]], serves: list[tuple[int, ...]]) -> list[list[Segment]]:
    """``[b][j]``: the range of bucket ``b`` that the ``j``-th server serving now serves, ``serves[j]`` being the
    shares it serves and ``server_segments[b][s]`` share ``s``'s range (adjoining ranges: one range)."""
    table = []
    for segments in server_segments:
        row = []
        for shares in serves:
            ranges = sorted(segments[s] for s in shares if segments[s][1] > segments[s][0])
            for (_, end), (start, _) in zip(ranges, ranges[1:]):
                if end != start:
                    raise ValueError(f"shares {shares} do not adjoin in a bucket: {ranges}")
            row.append((ranges[0][0], ranges[-1][1]) if ranges else (0, 0))
        table.append(row)
    return table


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed before the message was complete")
        data += chunk
    return data


def tell_server(address: tuple[str, int], message: Regroup | None, timeout: float, token: str = "") -> None:
    """Send ``message`` to the server listening at ``address`` and wait for its acknowledgement (``None``: a probe
    with ``token``, which only asks whether it is there); :class:`ConnectionError` (an :class:`OSError`) where it
    cannot be reached or refuses."""
    frame = message.encode() if message is not None else _frame({"probe": True, "token": token})
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(frame)
        reply = _read_exactly(sock, 2)
    if reply != b"ok":
        raise ConnectionError(f"the server at {address[0]}:{address[1]} refused the message")


def _silence(error: OSError) -> bool:
    """Whether a probe's ``error`` says the server's host is silent: the probe timed out, or the host is unreachable."""
    return isinstance(error, TimeoutError) or error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


class ServerWatch:
    """Probes the dedicated servers every ``interval`` seconds and reports, once, each one whose probe times out after
    ``timeout`` seconds or finds its host unreachable: a host cut off or a process stopped, which closes no
    connection. Any other failure is not silence and is not reported: a process that died refuses the connection
    and has closed its own (the trainers' next exchange with it fails at once), and a local error is not a lost
    server. ``watching()``: the servers to probe now (none where this trainer is not the leader);
    ``on_silent(server, why)`` runs on the watch's thread."""

    def __init__(
        self,
        listeners: Sequence[tuple[str, int]],
        token: str,
        interval: float,
        timeout: float,
        watching: Callable[[], Sequence[int]],
        on_silent: Callable[[int, str], None],
    ) -> None:
        self.listeners, self.token, self.interval, self.timeout = list(listeners), token, interval, timeout
        self.watching, self.on_silent = watching, on_silent
        #: the servers reported silent
        self.silent: set[int] = set()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="lddp-server-watch").start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            for server in self.watching():
                if server in self.silent:
                    continue
                try:
                    tell_server(self.listeners[server], None, self.timeout, self.token)
                except OSError as error:
                    if not _silence(error):
                        continue
                    if self._stopped.is_set():
                        return
                    self.silent.add(server)
                    self.on_silent(server, f"did not answer a probe within {self.timeout:.1f} s ({error})")

    def stop(self) -> None:
        self._stopped.set()


class RegroupListener:
    """A server's listening socket for :class:`Regroup` messages (see the module docstring), on a thread of its own;
    ``on_message(message)`` runs for each one carrying ``token``, before it is acknowledged."""

    def __init__(self, host: str, token: str, on_message: Callable[[Regroup], None]) -> None:
        self.token = token
        self.on_message = on_message
        self.sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, int(self.sock.getsockname()[1]))
        threading.Thread(target=self._serve, daemon=True, name="lddp-server-regroup").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True, name="lddp-server-regroup-in").start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5.0)
                (size,) = struct.unpack("!I", _read_exactly(conn, 4))
                if size > _MESSAGE_LIMIT:
                    raise ValueError(f"a regroup message of {size} bytes")
                fields = json.loads(_read_exactly(conn, size))
                if fields.get("token") != self.token:
                    conn.sendall(b"no")
                    return
                if not fields.get("probe"):
                    self.on_message(Regroup.decode(fields))
                conn.sendall(b"ok")
            except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a stray: not this run's
                return

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class RunAborted(RuntimeError):
    """Trainer 0 stopped the run (``ABORT``): the server exits, it does not wait for a regroup."""


class RegroupingServer(DedicatedServer):
    """A dedicated server that goes on when a trainer or another server is lost (see the module docstring). It serves
    its own share (itself, as a :class:`DedicatedServer`) and the shares it took over, and holds the replicas of the
    shares its neighbours serve (:func:`replica_holders`).

    ``connections``: the TCP connections of ``members`` (fenced when a regroup message arrives); ``rejoin_timeout``:
    seconds it waits after its member group failed for the trainers' leader to say how the run goes on, before it
    stops with that failure; ``group_timeout``: the timeout of the member groups it forms."""

    def __init__(
        self,
        members: MemberGroup,
        plan: ServerPlan,
        connections: list[Connection],
        rejoin_timeout: float,
        group_timeout: timedelta,
    ) -> None:
        super().__init__(members, plan)
        self.index = members.rank - members.num_trainers
        self.num_servers = k = members.num_servers
        self.rejoin_timeout = rejoin_timeout
        self.group_timeout = group_timeout
        self.generation = 0
        #: the servers serving now (their indices when the run started), in member order
        self.servers: tuple[int, ...] = tuple(range(k))
        #: the shares each server serving now serves (a share: the index of the server that served it at first)
        self.serving: dict[int, tuple[int, ...]] = {s: (s,) for s in range(k)}
        #: the member rank of server 0 when the run started (the plan's segments are laid out by those ranks)
        self._first_server_member = members.num_trainers
        #: the shares this server serves: its own (itself), then those it took over
        self.shares: dict[int, DedicatedServer] = {self.index: self}
        #: the replicas of shares other servers serve, held here, by share
        holders = replica_holders(self.servers)
        self.replicas = {s: self._share(s) for s in range(k) if holders.get(s) == self.index}
        #: replicas received from another server since the run started (after a loss)
        self.replicas_made = 0
        self._replicas_pending = False
        #: the last step key each share (or replica) stepped optimizer ``index`` with: ``(server, index) -> key``
        self.stepped: dict[tuple[int, int], Any] = {}
        #: regroups this server went through
        self.regroups = 0
        #: ``(server, optimizer index) -> (squared norm, any NaN/inf)`` of each share and replica, at the last sync
        self._votes: dict[tuple[int, int], tuple[float, bool]] = {}
        self._connections = list(connections)
        self._pending: Regroup | None = None
        self._regroup_cond = threading.Condition()
        self._lay_out()

    def _lay_out(self) -> None:
        """The buckets this server serves any of, its range of each (its shares' ranges, adjoining) and the trainers'
        receive buffers."""
        self.ranges: dict[int, list[tuple[DedicatedServer, slice]]] = {}
        for b in range(len(self.plan.buckets)):
            parts = [(share, share._share_of(b)) for _, share in sorted(self.shares.items()) if b in share.served]
            if parts:
                self.ranges[b] = parts
        n = self.members.num_trainers
        self._union = {b: torch.empty(sum(p.stop - p.start for _, p in parts), dtype=self.plan.dtype)
                       for b, parts in self.ranges.items()}  # fmt: skip
        self._scratch = {b: [torch.empty_like(self._union[b]) for _ in range(n)] for b in self.ranges}
        self._flag_scratch = {b: [torch.empty(len(self.plan.buckets[b]), dtype=self.plan.dtype) for _ in range(n)]
                              for b in self.ranges}  # fmt: skip

    def _member(self, server: int) -> int:
        return self.members.num_trainers + self.servers.index(server)

    def _share(self, share: int) -> DedicatedServer:
        """A fresh copy of ``share`` (its weights and optimizer state not set yet), for a replica."""
        return DedicatedServer(self.members, self.plan, member_index=self._first_server_member + share)

    def on_regroup(self, message: Regroup) -> None:
        """A regroup message (on the listener's thread): kept if newer than any so far, and the member group fenced,
        so that the serving loop stops waiting wherever it waits."""
        with self._regroup_cond:
            if message.generation <= max(self.generation, self._pending.generation if self._pending else -1):
                return
            self._pending = message
            self._regroup_cond.notify_all()
            connections = list(self._connections)
        fence(connections)

    # ------------------------------------------------------------------ the serving loop
    def run(self) -> None:
        """Serve until trainer 0 sends ``STOP`` (returns) or ``ABORT`` (raises :class:`RunAborted`); a failed
        exchange waits for the trainers' regroup (:meth:`_regroup`), and raises where none comes."""
        while True:
            try:
                if self._replicas_pending:
                    self._make_replicas()
                self._serve()
                return
            except RunAborted:
                raise
            except Exception as error:  # noqa: BLE001 - a lost trainer or server, unless no regroup follows
                self._regroup(error)

    def _serve(self) -> None:
        header = torch.zeros(3, dtype=torch.int64)
        while True:
            self.members.wait(self.members.irecv(header, 0, Tag.CONTROL), 0, "receive the next control message from")
            kind, index, _ = (int(v) for v in header.tolist())
            if kind == Control.STOP:
                self.stopping = True
                self.members.send_object("stopped", 0)
                return
            if kind == Control.ABORT:
                raise RunAborted(f"trainer 0 stopped the run: {self.members.recv_object(0)}")
            if kind == Control.SYNC:
                self._sync()
            elif kind == Control.VOTE:
                self._reply(self._vote(index))
            elif kind == Control.STEP:
                self._step_once(index, self.members.recv_object(0))
            elif kind == Control.PULL:
                self._send_weights(list(self.ranges))
            elif kind == Control.SET_WEIGHTS:
                self._receive_weights()
            elif kind == Control.STATE:
                self.members.send_object([p for _, share in sorted(self.shares.items())
                                          for p in share.optimizers[index].local_state()], 0)  # fmt: skip
            elif kind == Control.LOAD:
                state = self.members.recv_object(0)
                for share in [*self.shares.values(), *self.replicas.values()]:
                    share.optimizers[index].load_state_dict(state)

    def _sync(self) -> None:
        """Average every trainer's gradients of this server's range (the trainers that train now), forward its own
        share's to its replica's holder (and take its neighbours' into their replicas), and tell every trainer."""
        members = self.members
        trainers = list(members.trainers)
        arriving = {b: [(members.irecv(flags, t, Tag.GRADIENTS), members.irecv(grads, t, Tag.GRADIENTS))
                        for t, flags, grads in zip(trainers, self._flag_scratch[b], self._scratch[b], strict=True)]
                    for b in self.ranges}  # fmt: skip
        for b, parts in self.ranges.items():
            for t, (flags_work, grads_work) in zip(trainers, arriving[b], strict=True):
                members.wait(flags_work, t, "receive gradients from")
                members.wait(grads_work, t, "receive gradients from")
            flags = torch.stack(self._flag_scratch[b]).sum(0)
            _average_in_rank_order(self._scratch[b], len(trainers), self._union[b])
            offset = 0
            for share, place in parts:
                share.flags[b].copy_(flags)
                share.gradients[place].copy_(self._union[b][offset : offset + place.stop - place.start])
                offset += place.stop - place.start
        self._forward(lambda share, b: [share.gradients[share._share_of(b)], share.flags[b]])
        self._votes = {}
        for server, share in [*self.shares.items(), *self.replicas.items()]:
            share._take_gradients(share.layout.pieces)
            for index, sharded in enumerate(share.optimizers):
                self._votes[(server, index)] = (float(sharded.squared_norm()), sharded.has_nonfinite_gradient())
        self._reply(torch.ones(1, dtype=torch.float64))

    def _forward(self, tensors: Callable[[DedicatedServer, int], list[Tensor]]) -> None:
        """``tensors(share, b)`` of every share served here to their replicas' holder, and the same of each replica
        held here from the server serving its share (every receive posted before any send; shares in order)."""
        members, works = self.members, []
        holders = replica_holders(self.servers)
        for server, shares in self.serving.items():
            if server != self.index and holders.get(server) == self.index:
                source = self._member(server)
                works += [(members.irecv(t, source, Tag.FORWARD), source, "receive a replica's share from")
                          for share in shares for b in self.replicas[share].served
                          for t in tensors(self.replicas[share], b)]  # fmt: skip
        holder = holders.get(self.index)
        if holder is not None:
            target = self._member(holder)
            works += [(members.isend(t, target, Tag.FORWARD), target, "forward its shares to")
                      for _, share in sorted(self.shares.items()) for b in share.served
                      for t in tensors(share, b)]  # fmt: skip
        members.wait_all(works)

    def _vote(self, index: int) -> Tensor:
        """Optimizer ``index``'s squared gradient norm and NaN/inf flag over the shares served now, from each share's
        values as the last synchronization left them (asked again after a regroup, a share's are the same even where
        it has stepped since, and a share taken over brings its replica's)."""
        squares, bad = 0.0, False
        for server in sorted(self.shares):
            share_squares, share_bad = self._votes[(server, index)]
            squares += share_squares
            bad = bad or share_bad
        return torch.tensor([squares, float(bad)], dtype=torch.float64)

    def _reply(self, tensor: Tensor, trainers: list[int] | None = None) -> None:
        """Send ``tensor`` to every trainer (or to ``trainers``)."""
        to = self.members.trainers if trainers is None else trainers
        works = [(self.members.isend(tensor, t, Tag.REPLY), t, "reply to") for t in to]
        self.members.wait_all(works)

    def _step_once(self, index: int, control: dict[str, Any]) -> None:
        """Update optimizer ``index``'s part of every share and replica held here with ``control`` (the trainers'
        hyperparameters, clipping, the vote's summed squares, the step's key), each unless it stepped with this key
        already; then send the new weights."""
        stepped, squares = False, control["squares"]

        def verdict(_squares: float, _bad: bool) -> tuple[float, bool]:  # the trainers' vote, over every server
            return squares, False

        for server, share in [*self.shares.items(), *self.replicas.items()]:
            if self.stepped.get((server, index)) == control["key"]:
                continue
            sharded = share.optimizers[index]
            for group, hyper in zip(sharded.optimizer.param_groups, control["hyperparameters"], strict=True):
                group.update(hyper)
            sharded.voted_step(control["clip"], verdict, **control["kwargs"])
            self.stepped[(server, index)] = control["key"]
            stepped = stepped or server in self.shares
        if stepped:
            self.steps += 1
        spec = self.plan.optimizers[index]
        self._send_weights([b for b in buckets_of(spec.groups, self.plan.buckets) if b in self.ranges])

    def _gather(self, b: int) -> Tensor:
        """This server's range of bucket ``b``'s weights, from its shares."""
        return torch.cat([share.layout.storage[place] for share, place in self.ranges[b]])

    def _send_weights(self, buckets: list[int]) -> None:
        members = self.members
        works = [(members.isend(self._gather(b), t, Tag.WEIGHTS), t, "send to") for b in buckets for t in
                 members.trainers]  # fmt: skip
        members.wait_all(works)

    def _receive_weights(self) -> None:
        """Trainer 0's weights of this server's range, then the replicas' from their servers; trainer 0 is told once
        both arrived."""
        incoming = {b: torch.empty_like(self._union[b]) for b in self.ranges}
        self.members.wait_all([(self.members.irecv(incoming[b], 0, Tag.WEIGHTS), 0, "receive the weights from")
                               for b in self.ranges])  # fmt: skip
        for b, parts in self.ranges.items():
            offset = 0
            for share, place in parts:
                share.layout.storage[place].copy_(incoming[b][offset : offset + place.stop - place.start])
                offset += place.stop - place.start
        self._forward(lambda share, b: [share.layout.storage[share._share_of(b)]])
        self._reply(torch.ones(1, dtype=torch.float64), trainers=[0])  # the replicas hold the weights too

    # ------------------------------------------------------------------ a regroup
    def _regroup(self, error: BaseException) -> None:
        """The member group failed with ``error``: wait up to :attr:`rejoin_timeout` seconds for the trainers'
        leader to say how the run goes on, take over the shares it says, and form the next member group with the
        trainers and servers that serve now (a newer message meanwhile abandons a formation); ``error`` is raised
        where none comes."""
        deadline = time.monotonic() + self.rejoin_timeout
        while True:
            with self._regroup_cond:
                while self._pending is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(
                            f"the member group failed and no trainer said within {self.rejoin_timeout:.0f} s how the "
                            f"run goes on: {error}"
                        ) from error
                    self._regroup_cond.wait(left)
                message, self._pending = self._pending, None
            if self.index not in message.servers:
                raise RuntimeError(f"the trainers went on without dedicated server {self.index}")
            try:
                members = self._form(message)
            except Exception as failure:  # noqa: BLE001 - a trainer lost while forming: the next message says more
                error, deadline = failure, time.monotonic() + self.rejoin_timeout
                continue
            if members is not None:
                break
        self.members.close()
        self.members = members
        self.generation = message.generation
        self.regroups += 1
        self.servers = message.servers
        self.serving = dict(zip(message.servers, message.serves, strict=True))
        for share in self.serving[self.index]:
            if share in self.shares:
                continue
            if share not in self.replicas:
                raise ReplicaLostError(
                    f"dedicated server {self.index} was told to serve share {share}, of which it holds no replica"
                )
            self.shares[share] = self.replicas.pop(share)  # its server is lost: the replica held here serves now
        holders = replica_holders(self.servers)
        wanted = {share for server, shares in self.serving.items() if holders.get(server) == self.index
                  for share in shares}  # fmt: skip
        self.replicas = {share: replica for share, replica in self.replicas.items() if share in wanted}
        self._replicas_pending = True
        self._lay_out()

    def _make_replicas(self) -> None:
        """Every server: ask each server whose replicas it holds for those of its shares it holds no replica of
        (which a loss left without one), and send its holder the state of the shares it is asked for: weights,
        gradients and flags of the last synchronization, each optimizer's state, vote and step key. A replica counts
        once its whole state arrived (a loss meanwhile: the next regroup asks again)."""
        holders = replica_holders(self.servers)
        dependents = [s for s in self.servers if s != self.index and holders.get(s) == self.index]
        wanted = {s: [share for share in self.serving[s] if share not in self.replicas] for s in dependents}
        holder = holders.get(self.index)
        asked = self.members.exchange_objects({self._member(s): wanted[s] for s in dependents},
                                              [self._member(holder)] if holder is not None else [],
                                              Tag.REPLICA)  # fmt: skip
        outgoing: dict[int, Any] = {}
        if holder is not None and asked[self._member(holder)]:
            outgoing[self._member(holder)] = [self._share_state(share) for share in asked[self._member(holder)]]
        senders = [self._member(s) for s in dependents if wanted[s]]
        arrived = self.members.exchange_objects(outgoing, senders, Tag.REPLICA)
        for server in dependents:
            for share, state in zip(wanted[server], arrived.get(self._member(server), []), strict=True):
                self.replicas[share] = self._replica_from(share, state)
                self.replicas_made += 1
        self._replicas_pending = False

    def _share_state(self, share: int) -> dict[str, Any]:
        """What a new replica of ``share`` (served here) needs to go on as the share does."""
        served = self.shares[share]
        count = len(served.optimizers)
        return {
            "weights": served.layout.storage, "gradients": served.gradients, "flags": served.flags,
            "optimizers": [sharded.shard.state_dict() for sharded in served.optimizers],
            "stepped": [self.stepped.get((share, i)) for i in range(count)],
            "votes": [self._votes.get((share, i)) for i in range(count)],
        }  # fmt: skip

    def _replica_from(self, share: int, state: dict[str, Any]) -> DedicatedServer:
        replica = self._share(share)
        with torch.no_grad():
            replica.layout.storage.copy_(state["weights"])
            replica.gradients.copy_(state["gradients"])
            for b, flags in state["flags"].items():
                replica.flags[b].copy_(flags)
        for i, (sharded, optimizer_state) in enumerate(zip(replica.optimizers, state["optimizers"], strict=True)):
            sharded.shard.load_state_dict(optimizer_state)
            for table, value in ((self.stepped, state["stepped"][i]), (self._votes, state["votes"][i])):
                table.pop((share, i), None)
                if value is not None:
                    table[(share, i)] = value
        replica._take_gradients(replica.layout.pieces)
        return replica

    def _form(self, message: Regroup) -> MemberGroup | None:
        """The member group of ``message``'s generation (``None`` where a newer message came first)."""
        outcome: list[Any] = []
        done = threading.Event()
        rank = message.num_trainers + message.servers.index(self.index)

        def create() -> MemberGroup:
            store = dist.TCPStore(message.store[0], message.store[1], is_master=False, timeout=self.group_timeout)
            return MemberGroup(dist.PrefixStore(message.prefix, store), rank, message.num_trainers,
                               len(message.servers), self.group_timeout)  # fmt: skip

        def run() -> None:
            try:
                outcome.append(connections_opened_by(create))
            except BaseException as failure:  # noqa: BLE001 - handed to the serving thread
                outcome.append(failure)
            done.set()

        threading.Thread(target=run, daemon=True, name="lddp-server-form").start()
        while not done.wait(0.05):
            with self._regroup_cond:
                if self._pending is not None:  # a newer generation: this one will not form
                    return None
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        members, connections = outcome[0]
        with self._regroup_cond:
            self._connections = connections
            newer = self._pending is not None
        if newer:
            fence(connections)
            return None
        return members
