"""Dedicated servers that go on when a trainer or a server is lost (``on_rank_loss="continue"``).

The trainers agree on a loss among themselves (:mod:`lightning_dp.comm.membership`); the servers take no part in it. A
server's loss is seen by every trainer (its connections close, and every server whose member group fails fences it) and
starts a change that loses no trainer (:meth:`~lightning_dp.comm.membership.Membership.request_change`). Either way the
trainers' lowest survivor, the leader, then probes every server and tells each one how the run goes on
(:class:`Regroup`: the new generation, how many trainers train now, which servers serve which shares, where the member
group meets) on a connection of its own, which the server listens on from set-up (:class:`RegroupListener`). The server
fences its member group, so that whatever it waited for fails at once, and forms the next one with the survivors.

The trainers hold no share: the servers hold the whole state, and a trainer's loss takes none of it. Each server's
shares have their replicas on its neighbour (:func:`replica_holders`): the server forwards its summed gradients to it
at every synchronization and the neighbour steps its copies with the same request, so a lost server's shares are
taken over by its neighbour, whose range of every bucket they adjoin (:func:`serving_after`, :func:`union_segments`).
After a loss every share the servers left serve has its replica made again on its server's new neighbour
(:func:`replicas_to_make`), its state sent once by the server, so that the next loss is survived too.

A process started again for a lost server (``python -m lightning_dp.server``, the same command) claims its place in
the run's store once the leader took it for lost (:func:`claim_return`); the leader's watch sees the claim, the
trainers agree on a change that loses nobody, and the leader's regroup message lets it serve again: it takes back its
own share, with the shares its taker took over on its side (:func:`serving_back`), whose state the server that served
them sends it before either serves (:meth:`RegroupingServer._hand_over`); then the replicas are made as after a loss.

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
from functools import partial
from typing import Any, cast

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
    """How the run goes on after a loss or a lost server's return, from the trainers' leader to every server."""

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
    #: ``(share, from server, to server)``: shares a server that returned takes back, their state sent by the server
    #: that served them (:func:`serving_back`)
    handed: tuple[tuple[int, int, int], ...] = ()

    def encode(self) -> bytes:
        return _frame({"generation": self.generation, "num_trainers": self.num_trainers, "servers": list(self.servers),
                       "serves": [list(s) for s in self.serves], "store": list(self.store), "prefix": self.prefix,
                       "token": self.token, "handed": [list(h) for h in self.handed]})  # fmt: skip

    @classmethod
    def decode(cls, fields: dict[str, Any]) -> Regroup:
        handed = tuple((int(a), int(b), int(c)) for a, b, c in fields.get("handed", []))
        return cls(int(fields["generation"]), int(fields["num_trainers"]), tuple(int(s) for s in fields["servers"]),
                   tuple(tuple(int(x) for x in s) for s in fields["serves"]),
                   (str(fields["store"][0]), int(fields["store"][1])), str(fields["prefix"]),
                   str(fields["token"]), handed)  # fmt: skip


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


def serving_back(serves: dict[int, tuple[int, ...]], server: int) -> tuple[dict[int, tuple[int, ...]], int]:
    """Which shares each server serves once ``server``, lost earlier, serves again (``serves``: by server in member
    order, ``server`` not among them), and the server that hands them to it. It takes back its own share from the
    server that serves it now, with the shares that server took over on its side of ``server``'s share, so that every
    server's shares stay one contiguous run of the servers' order (adjoining ranges of every bucket); that server
    keeps its own share. :class:`ValueError` where ``server`` serves already or its share is nowhere."""
    if server in serves:
        raise ValueError(f"dedicated server {server} serves already")
    holder = next((s for s, shares in serves.items() if server in shares), None)
    if holder is None:
        raise ValueError(f"share {server} is served by no server: {serves}")
    taken = tuple(s for s in serves[holder] if (s >= server if holder < server else s <= server))
    after = {s: tuple(x for x in shares if x not in taken) if s == holder else shares for s, shares in serves.items()}
    after[server] = taken
    return dict(sorted(after.items())), holder


def replicas_to_make(
    before: dict[int, tuple[int, ...]],
    after: dict[int, tuple[int, ...]],
    handed: Collection[tuple[int, int, int]] = (),
) -> dict[int, tuple[int, ...]]:
    """``server -> shares``: the replicas each server must receive once the servers serve ``after`` instead of
    ``before`` (both by server in member order): those of the shares whose holder changed, a share taken over by its
    holder among them. A share ``handed`` back ``(share, from, to)`` needs none where its giver holds ``to``'s
    replicas (the giver keeps its copy as the replica)."""
    held_before = replica_holders(sorted(before))
    where_before = {share: {held_before.get(server)} for server, shares in before.items() for share in shares}
    for share, giver, _ in handed:
        where_before.setdefault(share, set()).add(giver)
    holders = replica_holders(sorted(after))
    make: dict[int, tuple[int, ...]] = {}
    for server, shares in after.items():
        holder = holders.get(server)
        if holder is not None:
            moved = tuple(share for share in shares if holder not in where_before.get(share, set()))
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


#: a dedicated server's state in the run's store, by the trainers' leader: lost (a process started again for it may
#: join), serving again; a process started again for it claims the place with :data:`JOINING` and its listener
LOST, SERVING, JOINING = "lost", "serving", "joining "


def state_key(index: int) -> str:
    """The run store's key of dedicated server ``index``'s state (:data:`LOST`, ...); absent until it is lost."""
    return f"server/{index}/state"


def listener_key(index: int) -> str:
    """The run store's key of dedicated server ``index``'s first listener (written at set-up)."""
    return f"listener/{index}"


def claim_return(store: dist.Store, index: int, address: tuple[str, int], wait_seconds: float) -> None:
    """A process started again for dedicated server ``index``, listening at ``address``: waits up to
    ``wait_seconds`` for the trainers' leader to have taken the server for lost, then claims its place, one process
    at a time, so that the leader lets it in at its next probe. :class:`TimeoutError` where the server is not lost
    (it still serves), :class:`RuntimeError` where another process claimed the place (at once)."""
    key, claim = state_key(index), JOINING + json.dumps(list(address))
    deadline = time.monotonic() + wait_seconds
    while True:
        state = store.get(key).decode() if store.check([key]) else None
        if state == LOST:
            break
        if state is not None and state.startswith(JOINING):
            raise RuntimeError(f"another process started for dedicated server {index} is joining the running job")
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"dedicated server {index} was not lost (it still serves, or its loss was not noticed within "
                f"{wait_seconds:.0f} s): a process started again for it joins only after its loss"
            )
        time.sleep(0.2)
    got = store.compare_set(key, LOST, claim)
    if (got.decode() if isinstance(got, bytes) else str(got)) != claim:
        raise RuntimeError(f"another process started for dedicated server {index} is joining the running job")


def returning_address(store: dist.Store, index: int) -> tuple[str, int] | None:
    """The listener of a process that claimed lost dedicated server ``index``'s place (:func:`claim_return`), if
    one did."""
    key = state_key(index)
    if not store.check([key]):
        return None
    value = store.get(key).decode()
    if not value.startswith(JOINING):
        return None
    host, port = json.loads(value[len(JOINING) :])
    return str(host), int(port)


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
    server. ``listeners``: each server's listener, by server (read at each probe: a server started again listens
    elsewhere); ``watching()``: the servers to probe now (none where this trainer is not the leader);
    ``on_silent(server, why)`` and ``on_tick()`` (once per interval, before the probes) run on the watch's thread."""

    def __init__(
        self,
        listeners: Sequence[tuple[str, int]],
        token: str,
        interval: float,
        timeout: float,
        watching: Callable[[], Sequence[int]],
        on_silent: Callable[[int, str], None],
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.listeners, self.token, self.interval, self.timeout = listeners, token, interval, timeout
        self.watching, self.on_silent, self.on_tick = watching, on_silent, on_tick
        #: the servers reported silent
        self.silent: set[int] = set()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="lddp-server-watch").start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            if self.on_tick is not None:
                try:
                    self.on_tick()
                except Exception:  # noqa: BLE001, S110 - the probes go on (what the tick looks for is seen again)
                    pass
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
    stops with that failure; ``group_timeout``: the timeout of the member groups it forms. ``joining``: the regroup
    message that let this server, started again after its loss, join the running job (``members`` formed from it);
    ``num_servers``: the servers the run started with (with ``joining``: ``members`` has those serving now)."""

    def __init__(
        self,
        members: MemberGroup,
        plan: ServerPlan,
        connections: list[Connection],
        rejoin_timeout: float,
        group_timeout: timedelta,
        joining: Regroup | None = None,
        num_servers: int | None = None,
    ) -> None:
        k = members.num_servers if num_servers is None else num_servers
        place = members.rank - members.num_trainers
        index = place if joining is None else joining.servers[place]
        #: the member rank of server 0 when the run started (the plan's segments are laid out by those ranks)
        self._first_server_member = len(plan.segments[0]) - k if plan.segments else members.num_trainers
        super().__init__(members, plan, member_index=self._first_server_member + index)
        self.index, self.num_servers = index, k
        self.rejoin_timeout = rejoin_timeout
        self.group_timeout = group_timeout
        self.generation = 0
        #: the servers serving now (their indices when the run started), in member order
        self.servers: tuple[int, ...] = tuple(range(k))
        #: the shares each server serving now serves (a share: the index of the server that served it at first)
        self.serving: dict[int, tuple[int, ...]] = {s: (s,) for s in range(k)}
        #: the shares this server serves: its own (itself), then those it took over
        self.shares: dict[int, DedicatedServer] = {self.index: self}
        #: the replicas of shares other servers serve, held here, by share
        holders = replica_holders(self.servers)
        self.replicas = {} if joining is not None else {s: self._share(s) for s in range(k)
                                                         if holders.get(s) == self.index}  # fmt: skip
        #: replicas received from another server since the run started (after a loss)
        self.replicas_made = 0
        self._replicas_pending = False
        #: shares this server gave back to a server that returned (``share -> (state, to server)``), kept until the
        #: next step in case it asks again
        self._handing: dict[int, tuple[DedicatedServer, int]] = {}
        #: shares a returning server is still to receive from the server that served them (``share -> giver``)
        self._receiving: dict[int, int] = {}
        #: the servers this one receives shares from, and those it sends shares to, in the handover under way
        self._givers: list[int] = []
        self._takers: list[int] = []
        self._handover_pending = False
        #: shares received from the servers that served them while this one was lost, and their state's bytes
        self.shares_taken_back = 0
        self.bytes_taken_back = 0
        #: the last step key each share (or replica) stepped optimizer ``index`` with: ``(server, index) -> key``
        self.stepped: dict[tuple[int, int], Any] = {}
        #: regroups this server went through
        self.regroups = 0
        #: ``(server, optimizer index) -> (squared norm, any NaN/inf)`` of each share and replica, at the last sync
        self._votes: dict[tuple[int, int], tuple[float, bool]] = {}
        self._connections = list(connections)
        self._pending: Regroup | None = None
        self._regroup_cond = threading.Condition()
        if joining is not None:  # nothing held yet: every share it serves and replica it holds comes from the others
            self.generation = joining.generation
            self._follow(joining)
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
                if self._handover_pending:
                    self._hand_over()
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
        self._handing = {}  # every server answered since the handover: nobody asks for those shares again
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
        where none comes. The failed group is fenced first: a member still waiting on this server fails at once,
        whatever else told it of the change, rather than wait for requests this server no longer answers."""
        with self._regroup_cond:
            connections = list(self._connections)
        fence(connections)
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
        self._follow(message)
        self._lay_out()

    def _follow(self, message: Regroup) -> None:
        """Take the shares ``message`` says this server serves: its own and those it served before, those whose
        replica it holds (their server is lost), and those handed back to it (received before it serves); give back
        those it hands to a server that returned (kept as the replica where it holds that server's); keep the
        replicas it still holds."""
        self.servers = message.servers
        self.serving = dict(zip(message.servers, message.serves, strict=True))
        holders = replica_holders(self.servers)
        for share, giver, taker in message.handed:
            if giver == self.index and share in self._receiving:
                raise ReplicaLostError(f"dedicated server {self.index} was told to hand share {share} over, whose "
                                       "state it has not received yet")  # fmt: skip
            if giver == self.index and share in self.shares and share != self.index:
                served = self.shares.pop(share)
                self._handing[share] = (served, taker)
                if holders.get(taker) == self.index:  # the copy given back stays here as its replica
                    self.replicas[share] = served
        receiving = {share: giver for share, giver, taker in message.handed if taker == self.index}
        missing = [share for share in self._receiving if share not in receiving]
        if missing:
            raise ReplicaLostError(f"dedicated server {self.index} was told to serve shares {missing}, whose state it "
                                   "has not received")  # fmt: skip
        self._receiving = receiving
        self._givers = sorted({giver for _, giver, taker in message.handed if taker == self.index} - {self.index})
        self._takers = sorted({taker for _, giver, taker in message.handed if giver == self.index} - {self.index})
        for share in self.serving[self.index]:
            if share in self.shares:
                continue
            if share in self.replicas:  # its server is lost: the replica held here serves now
                self.shares[share] = self.replicas.pop(share)
            elif share in self._handing:  # the server it was handed to is lost before it served it
                self.shares[share] = self._handing.pop(share)[0]
            elif share in self._receiving:
                self.shares[share] = self if share == self.index else self._share(share)
            else:
                raise ReplicaLostError(
                    f"dedicated server {self.index} was told to serve share {share}, of which it holds no replica"
                )
        wanted = {share for server, shares in self.serving.items() if holders.get(server) == self.index
                  for share in shares}  # fmt: skip
        self.replicas = {share: replica for share, replica in self.replicas.items() if share in wanted}
        self._handover_pending = bool(message.handed)
        self._replicas_pending = True

    def _hand_over(self) -> None:
        """Every server, after a regroup that lets a lost server serve again: each returning server asks the server
        that served its shares for the state of those it has not received yet, and that server sends it (as for a
        replica made again, :meth:`_share_state`). A failure here fences this server's member group, so that the
        others' waits on it fail at once (the trainers then agree again) rather than wait for it."""
        try:
            self._exchange_handed()
        except BaseException:
            fence(self._connections)
            raise

    def _exchange_handed(self) -> None:
        asks = {self._member(g): [share for share, giver in sorted(self._receiving.items()) if giver == g]
                for g in self._givers}  # fmt: skip
        asked = self.members.exchange_objects(asks, [self._member(t) for t in self._takers], Tag.REPLICA)
        outgoing: dict[int, Any] = {}
        for member, shares in asked.items():
            missing = [share for share in shares if share not in self._handing]
            if missing:
                raise ReplicaLostError(f"dedicated server {self.index} was asked for shares {missing}, which it "
                                       "no longer holds")  # fmt: skip
            outgoing[member] = [self._share_state(share, self._handing[share][0]) for share in shares]
        arrived = self.members.exchange_objects(outgoing, list(asks), Tag.REPLICA)
        for member, shares in asks.items():
            for share, state in zip(shares, arrived[member], strict=True):
                self._load_share(self.shares[share], share, state)
                self._receiving.pop(share)
                self.shares_taken_back += 1
                self.bytes_taken_back += _tensor_bytes(state)
        self._handover_pending = False

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

    def _share_state(self, share: int, served: DedicatedServer | None = None) -> dict[str, Any]:
        """What a new replica of ``share`` (served here, or ``served``) needs to go on as the share does."""
        served = self.shares[share] if served is None else served
        count = len(served.optimizers)
        return {
            "weights": served.layout.storage, "gradients": served.gradients, "flags": served.flags,
            "optimizers": [sharded.shard.state_dict() for sharded in served.optimizers],
            "stepped": [self.stepped.get((share, i)) for i in range(count)],
            "votes": [self._votes.get((share, i)) for i in range(count)],
        }  # fmt: skip

    def _replica_from(self, share: int, state: dict[str, Any]) -> DedicatedServer:
        return self._load_share(self._share(share), share, state)

    def _load_share(self, replica: DedicatedServer, share: int, state: dict[str, Any]) -> DedicatedServer:
        """``replica`` (a copy of ``share``) set to ``state`` (:meth:`_share_state`)."""
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

        def newer() -> bool:
            with self._regroup_cond:
                return self._pending is not None

        formed = form_member_group(message, self.index, self.group_timeout, newer)
        if formed is None:
            return None
        members, connections = formed
        with self._regroup_cond:
            self._connections = connections
            later = self._pending is not None
        if later:
            fence(connections)
            return None
        return members


def form_member_group(
    message: Regroup, index: int, timeout: timedelta, newer: Callable[[], bool]
) -> tuple[MemberGroup, list[Connection]] | None:
    """Server ``index``'s member group of ``message``'s generation and its TCP connections (``None`` where
    ``newer()`` says a newer message came first: that generation will not form)."""
    outcome: list[Any] = []
    done = threading.Event()
    rank = message.num_trainers + message.servers.index(index)

    def create() -> MemberGroup:
        store = dist.TCPStore(message.store[0], message.store[1], is_master=False, timeout=timeout)
        return MemberGroup(dist.PrefixStore(message.prefix, store), rank, message.num_trainers,
                           len(message.servers), timeout)  # fmt: skip

    def run() -> None:
        try:
            outcome.append(connections_opened_by(create))
        except BaseException as failure:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(failure)
        done.set()

    threading.Thread(target=run, daemon=True, name="lddp-server-form").start()
    while not done.wait(0.05):
        if newer():
            return None
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return cast("tuple[MemberGroup, list[Connection]]", outcome[0])


def warm_up(plan: ServerPlan) -> None:
    """Build each of the plan's optimizer classes once on a one-element parameter, so that their first construction
    (torch's lazy imports: most of a second) happens before the trainers wait for this server, not while they do.
    A class that cannot be built so is left to the real construction, which says why."""
    for spec in plan.optimizers:
        try:
            spec.cls([torch.nn.Parameter(torch.zeros(1, dtype=plan.dtype))], **spec.defaults)
        except Exception:  # noqa: BLE001, S112 - only a warm-up
            continue


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _newer_than(messages: list[Regroup], generation: int) -> bool:
    return messages[-1].generation > generation


def join_running_job(
    plan: ServerPlan,
    index: int,
    num_servers: int,
    host: str,
    token: str,
    claim: Callable[[tuple[str, int]], None],
    wait_seconds: float,
    rejoin_timeout: float,
    group_timeout: timedelta,
) -> RegroupingServer:
    """Dedicated server ``index``, started again after its loss, joins the running job: it listens on ``host`` for
    regroup messages carrying ``token``, calls ``claim(its listener's address)`` (:func:`claim_return`), waits up to
    ``wait_seconds`` for the trainers' leader to say that it serves again (the leader finds it at its next probe),
    forms the member group of that generation (a newer message meanwhile: that one's) and returns the server, which
    receives the state of its shares from the server that served them before it serves
    (:meth:`RegroupingServer.run`). :class:`TimeoutError` where no message comes, :class:`RuntimeError` where the
    trainers went on without it."""
    cond = threading.Condition()
    messages: list[Regroup] = []

    def take(message: Regroup) -> None:
        with cond:
            if not messages or message.generation > messages[-1].generation:
                messages.append(message)
                cond.notify_all()

    listener = RegroupListener(host, token, take)  # (taking messages before anyone knows where it listens)
    claim(listener.address)
    deadline, tried = time.monotonic() + wait_seconds, -1
    while True:
        with cond:
            while not messages or messages[-1].generation <= tried:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"dedicated server {index} was not let into the running job within {wait_seconds:.0f} s"
                    )
                cond.wait(left)
            message = messages[-1]
        if index not in message.servers:
            raise RuntimeError(f"the trainers went on without dedicated server {index}")
        tried = message.generation
        try:
            formed = form_member_group(message, index, group_timeout, partial(_newer_than, messages, tried))
        except Exception:  # noqa: BLE001 - a peer lost while forming: the leader's next message says more
            deadline = time.monotonic() + rejoin_timeout
            continue
        if formed is not None:
            break
    members, connections = formed
    server = RegroupingServer(members, plan, connections, rejoin_timeout, group_timeout, joining=message,
                              num_servers=num_servers)  # fmt: skip
    with cond:
        listener.on_message = server.on_regroup
        later = messages[-1] if messages[-1].generation > message.generation else None
    if later is not None:
        server.on_regroup(later)
    return server
