"""The member group of a run's trainers and dedicated servers, and the store they meet in."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable, Sequence
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.cluster.peers import PeerDirectory, wait_naming_peer
from lightning_dp.comm.cluster.rendezvous import JOB_ID_VARIABLE, JobRecord
from lightning_dp.comm.cluster.sockets import tcp_sockets
from lightning_dp.comm.host import to_host


class Tag(IntEnum):
    """Message tags on the member group (a pair of members matches messages per tag, in order)."""

    GRADIENTS = 11
    AVERAGED = 12
    CONTROL = 13
    EDITED = 14
    WEIGHTS = 15
    OBJECT = 16
    #: a server's reply to every trainer: a synchronization summed, an optimizer's vote
    REPLY = 17
    #: a server's summed gradients (or weights) of its share, to the server holding its replica
    FORWARD = 18
    #: a share's whole state, to the server that makes a replica of it after a loss (and which replicas it wants)
    REPLICA = 19


#: pieces of one message travel on tags of their own: ``Tag * PIECE_TAGS + piece`` (below 2**31 for every tag)
PIECE_TAGS = 1 << 24
#: the prefix of the run's keys in the rendezvous store
STORE_PREFIX = "lightning_dp/servers"


#: the largest single message by default: bigger tensors travel as several pieces, and a server sums, steps and
#: sends back each piece of a bucket as soon as every trainer's copy of it is in (BytePS's partitions)
MESSAGE_BYTES = 1 << 18
#: the environment variable that sets another piece size, in bytes, read by trainer 0 (every member follows it)
MESSAGE_BYTES_VARIABLE = "LIGHTNING_DP_PARTITION_BYTES"


def message_bytes_from_environment() -> int:
    """:data:`MESSAGE_BYTES_VARIABLE` if set (a positive integer, else :class:`ValueError` naming it), else
    :data:`MESSAGE_BYTES`."""
    value = os.environ.get(MESSAGE_BYTES_VARIABLE)
    if value is None:
        return MESSAGE_BYTES
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{MESSAGE_BYTES_VARIABLE}={value!r}: expected a positive integer number of bytes")
    return number


class PieceWorks:
    """The works of one message's pieces (:meth:`MemberGroup.isend`, :meth:`MemberGroup.irecv`), waited for as one;
    ``works[k]`` is piece ``k``'s alone."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:  # noqa: SIM110 - each must be waited for
            work.wait(timeout) if timeout is not None else work.wait()
        return True


class MemberGroup:
    """The gloo group of a run's trainers and dedicated servers (see the module docstring), on a store of its own
    under :data:`STORE_PREFIX`. Not registered with ``torch.distributed``: a server process has no default group,
    and Lightning's collectives never see the servers."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        num_trainers: int,
        num_servers: int,
        timeout: timedelta,
        message_bytes: int | None = None,
    ) -> None:
        self.rank, self.num_trainers, self.num_servers = rank, num_trainers, num_servers
        self.size = num_trainers + num_servers
        #: called with the member and the error when a wait with that member fails (before the error is raised)
        self.on_failure: Callable[[int, BaseException], None] | None = None
        if rank == 0:  # ``message_bytes``: the size an earlier group of the same run used
            store.set("message_bytes", str(message_bytes or message_bytes_from_environment()))
        #: the largest single message (trainer 0's :func:`message_bytes_from_environment`)
        self.message_bytes = int(store.get("message_bytes"))
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

    def isend(self, tensor: Tensor, member: int, tag: int, first_piece: int = 0) -> Any:
        """Send ``tensor`` in pieces (see :meth:`_pieces`); ``first_piece``: the pieces are those from
        ``first_piece`` on of a larger message, whose receiver posted it whole."""
        return self._pieces(self.backend.send, tensor, member, tag, first_piece)

    def irecv(self, tensor: Tensor, member: int, tag: int) -> Any:
        return self._pieces(self.backend.recv, tensor, member, tag)

    def piece_numel(self, tensor: Tensor) -> int:
        """Elements of ``tensor`` per piece of a message: piece ``k`` is ``tensor[k * piece_numel : ...]``."""
        return max(1, self.message_bytes // tensor.element_size())

    def _pieces(
        self, op: Callable[..., Any], tensor: Tensor, member: int, tag: int, first_piece: int = 0
    ) -> PieceWorks | None:
        """``op`` on ``tensor`` in messages of at most :attr:`message_bytes`, each piece on a tag of its own: gloo
        then has every piece's receive announced at once, instead of one announcement per piece that would queue
        behind the bulk data already filling the link back."""
        if not tensor.numel():
            return None
        step = self.piece_numel(tensor)
        pieces = range(0, tensor.numel(), step)
        if first_piece + len(pieces) > PIECE_TAGS:
            raise ValueError(
                f"a message of {tensor.numel() * tensor.element_size()} bytes needs {first_piece + len(pieces)} pieces "
                f"of {self.message_bytes} bytes, more than the {PIECE_TAGS} tags a message has: raise "
                f"{MESSAGE_BYTES_VARIABLE}"
            )
        tags = (tag * PIECE_TAGS + first_piece + k for k in range(len(pieces)))
        try:  # (gloo refuses to post on a connection it saw close)
            return PieceWorks([op([tensor[i : i + step]], member, t) for i, t in zip(pieces, tags)])
        except BaseException as error:
            if self.on_failure is not None:
                self.on_failure(member, error)
            raise

    def wait(self, work: dist.Work | None, member: int, action: str, timeout: timedelta | None = None) -> None:
        """Wait for ``work`` (with ``member``); a lost member is named (see :func:`wait_naming_peer`), and
        :attr:`on_failure` told first."""
        try:
            wait_naming_peer(work, self.name(self.rank), action, self.name(member), timeout)
        except BaseException as error:
            if self.on_failure is not None:
                self.on_failure(member, error)
            raise

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

    def vote(self, squares: float, bad: bool, timeout: timedelta | None = None) -> tuple[float, bool]:
        """Every member: the sum of the squared gradient norms of every share, and whether any share is not finite."""
        tensor = torch.tensor([squares, 1.0 if bad else 0.0], dtype=torch.float64)
        self.all_reduce_sum(tensor, timeout)
        return float(tensor[0]), bool(tensor[1] > 0)

    def send_object(self, obj: Any, member: int, timeout: timedelta | None = None, tag: int = Tag.OBJECT) -> None:
        """Send ``obj`` pickled, its tensors in host memory (:func:`~lightning_dp.comm.host.to_host`: a server may
        have no GPU)."""
        data = _pickled(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for tensor in (size, data):
            self.wait(self.isend(tensor, member, tag), member, "send a message to", timeout)

    def recv_object(self, member: int, timeout: timedelta | None = None, tag: int = Tag.OBJECT) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        self.wait(self.irecv(size, member, tag), member, "receive a message from", timeout)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.wait(self.irecv(data, member, tag), member, "receive a message from", timeout)
        return _unpickled(data)

    def exchange_objects(self, outgoing: dict[int, Any], incoming: list[int], tag: int = Tag.OBJECT) -> dict[int, Any]:
        """Send each ``outgoing[member]`` to its member (as :meth:`send_object`) and receive one object from each of
        ``incoming``, every message posted before any is waited for (two members may send each other at once); what
        arrived, by member."""
        data = {m: _pickled(obj) for m, obj in outgoing.items()}
        sizes = {m: torch.zeros(1, dtype=torch.int64) for m in incoming}
        self.wait_all([(self.isend(torch.tensor([d.numel()]), m, tag), m, "send a message to") for m, d in data.items()]
                      + [(self.irecv(sizes[m], m, tag), m, "receive a message from") for m in incoming])  # fmt: skip
        received = {m: torch.empty(int(sizes[m].item()), dtype=torch.uint8) for m in incoming}
        self.wait_all([(self.isend(d, m, tag), m, "send a message to") for m, d in data.items()]
                      + [(self.irecv(received[m], m, tag), m, "receive a message from") for m in incoming])  # fmt: skip
        return {m: _unpickled(t) for m, t in received.items()}

    def close(self) -> None:
        try:
            self.backend.shutdown()
        except Exception:  # noqa: BLE001, S110 - peers may be gone already
            pass


def _pickled(obj: Any) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(to_host(obj))), dtype=torch.uint8)


def _unpickled(data: Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 - members of one run, on the run's private network


def run_store(
    host: str, port: int, run_key: str, timeout: timedelta, scope: str | None = None, publish: bool = False
) -> dist.Store:
    """A client of the rendezvous store at ``host:port``, narrowed to this run's keys under the job's ``scope``;
    without one, the scope the job's record names, once the record proves this process belongs to the job
    (:class:`~lightning_dp.comm.cluster.rendezvous.JobRecord`; :class:`ForeignJobError` otherwise). ``publish``: first
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
