"""Dedicated servers that go on with the trainers that survive a loss (``on_rank_loss="continue"``).

The trainers agree on a loss among themselves (:mod:`lightning_dp.comm.membership`); the servers take no part in it.
Their lowest survivor, the leader, then tells every server how the run goes on (:func:`tell_server`: the new
generation, how many trainers train now, where their member group meets) on a connection of its own, which the
server listens on from set-up (:class:`RegroupListener`). The server fences its member group, so that whatever it
waited for fails at once, and forms the next one with the survivors. The trainers hold no share: the servers hold
the whole state, and a trainer's loss takes none of it.

Each step is a sequence of requests from the leader that a server can answer again after a regroup
(:class:`RegroupingServer`): ``SYNC`` (sum every trainer's gradients, acknowledge), ``VOTE`` (each share's squared
norm and NaN/inf flag), ``STEP`` (update once per step key, whatever number of times it is asked, and send the new
weights), ``PULL``, and the set-up's and checkpoints' requests as before.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_dp.comm.membership.fence import connections_opened_by, fence
from lightning_dp.comm.servers.members import MemberGroup, Tag
from lightning_dp.comm.servers.plan import Control, ServerPlan, buckets_of
from lightning_dp.comm.servers.server import DedicatedServer
from lightning_dp.comm.transports.shards import _average_in_rank_order

#: the largest regroup message a server reads (it is a few hundred bytes)
_MESSAGE_LIMIT = 1 << 16


@dataclass(frozen=True)
class Regroup:
    """How the run goes on after a loss, from the trainers' leader to every server."""

    #: the trainers' membership generation (a server follows only a newer one than it has)
    generation: int
    num_trainers: int
    #: the store the next member group meets on, and its prefix there
    store: tuple[str, int]
    prefix: str
    #: proof that the message comes from this run (its scope and run key), not from a stray process
    token: str

    def encode(self) -> bytes:
        data = json.dumps({"generation": self.generation, "num_trainers": self.num_trainers,
                           "store": list(self.store), "prefix": self.prefix, "token": self.token}).encode()  # fmt: skip
        return struct.pack("!I", len(data)) + data

    @classmethod
    def decode(cls, data: bytes) -> Regroup:
        fields = json.loads(data)
        return cls(int(fields["generation"]), int(fields["num_trainers"]),
                   (str(fields["store"][0]), int(fields["store"][1])), str(fields["prefix"]),
                   str(fields["token"]))  # fmt: skip


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed before the message was complete")
        data += chunk
    return data


def tell_server(address: tuple[str, int], message: Regroup, timeout: float) -> None:
    """Send ``message`` to the server listening at ``address`` and wait for its acknowledgement;
    :class:`ConnectionError` (an :class:`OSError`) where it cannot be reached or refuses."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(message.encode())
        reply = _read_exactly(sock, 2)
    if reply != b"ok":
        raise ConnectionError(f"the server at {address[0]}:{address[1]} refused the regroup message")


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
            with conn:
                try:
                    conn.settimeout(10.0)
                    (size,) = struct.unpack("!I", _read_exactly(conn, 4))
                    if size > _MESSAGE_LIMIT:
                        raise ValueError(f"a regroup message of {size} bytes")
                    message = Regroup.decode(_read_exactly(conn, size))
                    if message.token != self.token:
                        conn.sendall(b"no")
                        continue
                    self.on_message(message)
                    conn.sendall(b"ok")
                except (OSError, ValueError, KeyError):  # a stray or broken connection: not this run's
                    continue

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class RunAborted(RuntimeError):
    """Trainer 0 stopped the run (``ABORT``): the server exits, it does not wait for a regroup."""


class RegroupingServer(DedicatedServer):
    """A dedicated server that goes on with the trainers that survive a loss (see the module docstring).

    ``connections``: the TCP connections of ``members`` (fenced when a regroup message arrives); ``rejoin_timeout``:
    seconds it waits after its member group failed for the trainers' leader to say how the run goes on, before it
    stops with that failure; ``group_timeout``: the timeout of the member groups it forms."""

    def __init__(
        self,
        members: MemberGroup,
        plan: ServerPlan,
        connections: list[int],
        rejoin_timeout: float,
        group_timeout: timedelta,
    ) -> None:
        super().__init__(members, plan)
        self.index = members.rank - members.num_trainers
        self.rejoin_timeout = rejoin_timeout
        self.group_timeout = group_timeout
        self.generation = 0
        #: the last step key each optimizer stepped with (a step asked for again is answered with its weights)
        self.stepped: dict[int, Any] = {}
        #: regroups this server went through
        self.regroups = 0
        self._votes: dict[int, torch.Tensor] = {}
        self._connections = list(connections)
        self._pending: Regroup | None = None
        self._regroup_cond = threading.Condition()

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
                self._serve()
                return
            except RunAborted:
                raise
            except Exception as error:  # noqa: BLE001 - a lost trainer, unless no regroup follows
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
                self._send_weights(self.served)
            elif kind == Control.SET_WEIGHTS:
                works = [(self.members.irecv(self.layout.storage[self._share_of(b)], 0, Tag.WEIGHTS), b)
                         for b in self.served]  # fmt: skip
                for work, _ in works:
                    self.members.wait(work, 0, "receive the weights from")
            elif kind == Control.STATE:
                self.members.send_object(self.optimizers[index].local_state(), 0)
            elif kind == Control.LOAD:
                self.optimizers[index].load_state_dict(self.members.recv_object(0))

    def _sync(self) -> None:
        """Average every trainer's gradients of this server's shares (the trainers that train now), take them into
        the pieces, and tell every trainer."""
        members = self.members
        trainers = list(members.trainers)
        arriving = {b: [(members.irecv(flags, t, Tag.GRADIENTS), members.irecv(grads, t, Tag.GRADIENTS))
                        for t, flags, grads in zip(trainers, self._flag_scratch[b], self._scratch[b])]
                    for b in self.served}  # fmt: skip
        for b in self.served:
            self.flags[b].zero_()
            for t, (flags_work, grads_work) in zip(trainers, arriving[b]):
                members.wait(flags_work, t, "receive gradients from")
                members.wait(grads_work, t, "receive gradients from")
            for their_flags in self._flag_scratch[b]:
                self.flags[b].add_(their_flags)
            _average_in_rank_order(self._scratch[b], len(trainers), self.gradients[self._share_of(b)])
        self._take_gradients(self.layout.pieces)
        self._votes = {}
        self._reply(torch.ones(1, dtype=torch.float64))

    def _vote(self, index: int) -> torch.Tensor:
        """Optimizer ``index``'s shares: their squared gradient norm and whether any is not finite, as computed at the
        first request after a synchronization (asked again after a regroup, it is the same even where the step has
        run since)."""
        if index not in self._votes:
            sharded = self.optimizers[index]
            self._votes[index] = torch.tensor([float(sharded.squared_norm()), float(sharded.has_nonfinite_gradient())],
                                              dtype=torch.float64)  # fmt: skip
        return self._votes[index]

    def _reply(self, tensor: torch.Tensor) -> None:
        works = [(self.members.isend(tensor, t, Tag.REPLY), t) for t in self.members.trainers]
        for work, t in works:
            self.members.wait(work, t, "reply to")

    def _step_once(self, index: int, control: dict[str, Any]) -> None:
        """Update optimizer ``index``'s shares with ``control`` (the trainers' hyperparameters, clipping, the summed
        squares of the vote, the step's key), unless it stepped with this key already; then send the new weights."""
        sharded = self.optimizers[index]
        if self.stepped.get(index) != control["key"]:
            for group, hyper in zip(sharded.optimizer.param_groups, control["hyperparameters"]):
                group.update(hyper)
            squares = control["squares"]
            sharded.voted_step(control["clip"], lambda _squares, _bad: (squares, False), **control["kwargs"])
            self.stepped[index] = control["key"]
            self.steps += 1
        spec = self.plan.optimizers[index]
        self._send_weights([b for b in buckets_of(spec.groups, self.plan.buckets) if b in self.served])

    def _send_weights(self, buckets: list[int]) -> None:
        sending: list[tuple[dist.Work | None, int]] = []
        for b in buckets:
            sending += self._send_to_trainers(b, Tag.WEIGHTS, self.layout.storage)
        for work, t in sending:
            self.members.wait(work, t, "send to")

    # ------------------------------------------------------------------ a regroup
    def _regroup(self, error: BaseException) -> None:
        """The member group failed with ``error``: wait up to :attr:`rejoin_timeout` seconds for the trainers'
        leader to say how the run goes on, and form the next member group with the trainers that train now
        (a newer message meanwhile abandons a formation); ``error`` is raised where none comes."""
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
        n = members.num_trainers
        self._scratch = {b: [torch.empty(self._numel(b), dtype=self.plan.dtype) for _ in range(n)]
                         for b in self.served}  # fmt: skip
        self._flag_scratch = {b: [torch.empty_like(self.flags[b]) for _ in range(n)] for b in self.served}

    def _form(self, message: Regroup) -> MemberGroup | None:
        """The member group of ``message``'s generation (``None`` where a newer message came first)."""
        outcome: list[Any] = []
        done = threading.Event()
        rank = message.num_trainers + self.index

        def create() -> MemberGroup:
            store = dist.TCPStore(message.store[0], message.store[1], is_master=False, timeout=self.group_timeout)
            return MemberGroup(dist.PrefixStore(message.prefix, store), rank, message.num_trainers,
                               self.members.num_servers, self.group_timeout)  # fmt: skip

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
