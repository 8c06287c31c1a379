"""The control plane: a mesh of TCP connections among a job's ranks, beside its process groups.

It tells a lost peer from a slow one without touching the process groups: a peer whose process dies closes its
connections (the kernel does it, even for SIGKILL), which every other rank sees at once; a peer that goes silent (a
host cut off, a process stopped) is suspected after ``heartbeat_timeout`` seconds without a frame from it. Its own
thread sends the heartbeats and reads every connection, so a rank busy for long (a checkpoint write, a long
forward) keeps answering. It also carries the few small messages of the membership agreement
(:mod:`.agreement`), so that agreeing never depends on a process group, nor on a store that could die with the
rank serving it.

Frames are JSON objects behind a 4-byte length. Every connection starts with a hello naming the job's scope, the
rank, the process's incarnation (a random id, new in every process) and the proof of the job's optional shared secret.
A connection from another job, or without the secret, is refused; so is a rank the job declared lost, by its
incarnation: the process that was fenced never comes back, while a new process in its place (a replacement, see
:meth:`ControlPlane.connect_as_joiner`) is held as a *candidate* until the members admit it
(:meth:`ControlPlane.admit`).
"""

from __future__ import annotations

import hmac
import json
import logging
import selectors
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from lightning_dp.comm.errors import ForeignJobError, PeerUnreachableError

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
#: the largest frame accepted (the agreement's messages are a few hundred bytes)
MAX_FRAME_BYTES = 1 << 20
#: heartbeats per ``heartbeat_timeout``: a peer is suspected only after missing this many in a row
HEARTBEATS_PER_TIMEOUT = 4

Message = dict[str, Any]


class ControlHandler(Protocol):
    """What a control plane tells (on its own thread; each call must be short)."""

    def suspect(self, peer: int, cause: str, direct: bool) -> None:
        """This rank suspects ``peer`` (``direct``: cause ``"closed"`` or ``"silent"``), or another rank said it
        does."""

    def fenced(self, why: str) -> None:
        """A peer said the job declared this rank lost."""

    def refused(self, error: BaseException) -> None:
        """A member refused this process's connection (it does not belong to the job, or its rank is taken)."""

    def receive(self, message: Message) -> None:
        """Any other message from a peer (``message["from"]`` names it)."""

    def tick(self, now: float) -> None:
        """The clock, at least every heartbeat period."""


@dataclass
class _Peer:
    rank: int
    sock: socket.socket
    heard: float
    inbound: bytearray = field(default_factory=bytearray)
    outbound: bytearray = field(default_factory=bytearray)


def endpoint(address: str, port: int, incarnation: str) -> str:
    """What a rank publishes for its peers to dial: ``host:port/incarnation``."""
    return f"{address}:{port}/{incarnation}"


def parse_endpoint(text: str) -> tuple[str, str]:
    """``(host:port, incarnation)`` of an :func:`endpoint`."""
    host_port, _, incarnation = text.partition("/")
    return host_port, incarnation


def _frame(message: Message) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


class ControlPlane:
    """The control plane of rank ``rank`` among ``ranks`` (global ranks; see the module docstring).

    Built collectively: every rank listens on ``host`` (the address its process groups use), publishes the
    endpoint under ``scope`` in ``store`` and connects to every lower rank; the constructor returns once every
    peer is connected, or raises :class:`~lightning_dp.comm.errors.PeerUnreachableError` after ``timeout``
    seconds. ``proof`` is the job's proof of its shared secret (empty without one): a hello without the same proof
    is refused. With ``joining`` the plane of a process that replaces a lost rank is built: it listens and
    publishes its endpoint, and connects nowhere until :meth:`connect_as_joiner`. ``places``: how many ranks the
    job may have (``0`` to ``places - 1``; default: ``ranks``): a new process may ask to join in any of those
    places that no member holds.

    Suspicions are sticky: a suspected peer stays suspected (its frames are ignored) until :meth:`retire` drops it
    or :meth:`clear` forgives it after an agreement kept it. What it learns goes to the :class:`ControlHandler` given
    to :meth:`attach`.
    """

    def __init__(
        self,
        rank: int,
        ranks: list[int],
        store: dist.Store,
        scope: str,
        host: str,
        heartbeat_timeout: float,
        timeout: float = 60.0,
        proof: str = "",
        joining: bool = False,
        places: int | None = None,
    ) -> None:
        self.rank = rank
        self.scope = scope
        #: this process's incarnation: a rank declared lost is refused by it, a new process in its place is not
        self.incarnation = uuid.uuid4().hex
        self._proof = proof
        self._timeout = timeout
        #: a new process not admitted yet: it tells the members nothing of its own suspicions
        self._joining = joining
        self.heartbeat_timeout = heartbeat_timeout
        self._period = heartbeat_timeout / HEARTBEATS_PER_TIMEOUT
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._expected = {r for r in ranks if r != rank}
        #: the ranks of the job (a new process may take only one of their places)
        self._slots = set(ranks) | set(range(places or 0))
        self._suspected: dict[int, str] = {}
        self._retired: set[int] = set()
        #: members that left the job on purpose: their connections end when they close, which is no loss
        self._departing: set[int] = set()
        #: each connected peer's incarnation, and those of the ranks declared lost (refused for good)
        self._incarnations: dict[int, str] = {}
        self._fenced_incarnations: set[str] = set()
        #: processes that asked to join in a lost rank's place, by rank: their incarnation (not members yet)
        self._candidates: dict[int, str] = {}
        #: why a member refused this process's connection (a joiner's), once one has
        self.refusal: BaseException | None = None
        #: why the job declared this rank lost, once a peer has said so (``None`` while it is a member)
        self.fenced: str | None = None
        self._handler: ControlHandler | None = None
        self._connected = threading.Condition(self._lock)
        self._selector = selectors.DefaultSelector()
        self._waker_read, self._waker_write = socket.socketpair()
        self._waker_read.setblocking(False)
        self._waker_write.setblocking(False)
        self._selector.register(self._waker_read, selectors.EVENT_READ, None)
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._closing = False
        #: this rank is leaving (:meth:`close` began): a peer's connection ending now is no loss to report
        self._leaving = False
        #: sockets to (un)register with the selector, which only the thread touches once it runs
        self._to_register: list[tuple[socket.socket, int]] = []
        self._to_unregister: list[socket.socket] = []
        #: accepted connections whose hello has not arrived: their bytes so far and a deadline
        self._hellos: dict[socket.socket, tuple[bytearray, float]] = {}
        #: retired peers' sockets to tell why and close
        self._to_close: list[tuple[socket.socket, str]] = []
        self._thread = threading.Thread(target=self._run, name=f"lddp-control-{rank}", daemon=True)
        self._thread.start()
        address, port = self._listener.getsockname()[:2]
        #: what this plane publishes for its peers to dial, and every peer's (told in its hello, or read to dial it)
        self.endpoint = endpoint(address, port, self.incarnation)
        self._endpoints: dict[int, str] = {}
        store.set(f"{scope}/control/{rank}", self.endpoint)
        if joining:
            self._expected = set()
            return
        deadline = time.monotonic() + timeout
        for peer in sorted(r for r in self._expected if r < rank):
            store.wait([f"{scope}/control/{peer}"], timedelta(seconds=max(1.0, deadline - time.monotonic())))
            host_port, incarnation = parse_endpoint(store.get(f"{scope}/control/{peer}").decode())
            self._dial(peer, host_port, deadline, incarnation)
        self._wait_connected(deadline)

    def connect_as_joiner(self, members: list[int], store: dist.Store, timeout: float | None = None) -> None:
        """Dial each of ``members`` this plane is not connected to (their endpoints in ``store``) with a hello that asks
        to join in this rank's place; returns once each connection is open, else raises
        :class:`~lightning_dp.comm.errors.PeerUnreachableError` after ``timeout`` seconds (default: the plane's). A
        member's answer comes later: a refusal fails the agreement (:meth:`ControlHandler.refused`), a request to try
        again drops the connection (dial again)."""
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        with self._lock:
            self._expected |= set(members)
            missing = sorted(set(members) - set(self._peers))
        for peer in missing:
            host_port, incarnation = parse_endpoint(store.get(f"{self.scope}/control/{peer}").decode())
            self._dial(peer, host_port, deadline, incarnation, join=True)
        self._wait_connected(deadline)

    def publish_endpoints(self, store: dist.Store, ranks: list[int]) -> None:
        """Write the endpoints of ``ranks`` (this plane's own and its peers') into ``store``, where a new process
        finds them to dial (a store served again after the one they were published in went)."""
        with self._lock:
            known = {**self._endpoints, self.rank: self.endpoint}
        for rank in ranks:
            if rank in known:
                store.set(f"{self.scope}/control/{rank}", known[rank])

    def expected(self) -> set[int]:
        """The members this plane keeps connections to."""
        with self._lock:
            return set(self._expected)

    def _wait_connected(self, deadline: float) -> None:
        with self._connected:
            if not self._connected.wait_for(lambda: set(self._peers) >= self._expected, deadline - time.monotonic()):
                missing = sorted(self._expected - set(self._peers))
                raise PeerUnreachableError(
                    f"rank {self.rank}: the control plane could not connect to rank(s) {missing} within "
                    f"{self._timeout:.0f} s"
                )

    # ------------------------------------------------------------------ connections
    def descriptors(self) -> set[int]:
        """The file descriptors of this control plane's sockets, those accepted whose hello has not arrived included
        (never fenced with a process group's)."""
        with self._lock:
            socks = [self._listener, self._waker_read, self._waker_write] + [p.sock for p in self._peers.values()]
            socks += list(self._hellos)  # (the thread's; a copy taken at once)
        return {s.fileno() for s in socks if s.fileno() >= 0}

    def _dial(self, peer: int, host_port: str, deadline: float, incarnation: str, join: bool = False) -> None:
        host, port = host_port.rsplit(":", 1)
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as error:
                if time.monotonic() > deadline:
                    raise PeerUnreachableError(
                        f"rank {self.rank}: the control plane could not reach rank {peer} at {host_port}: {error}"
                    ) from error
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = {"t": "hello", "job": self.scope, "rank": self.rank, "inc": self.incarnation, "proof": self._proof,
                 "at": self.endpoint}  # fmt: skip
        sock.sendall(_frame({**hello, "join": True} if join else hello))
        self._adopt(peer, sock, incarnation, f"{host_port}/{incarnation}")

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._hellos[sock] = (bytearray(), time.monotonic() + max(1.0, self.heartbeat_timeout))
        self._selector.register(sock, selectors.EVENT_READ, sock)

    def _read_hello(self, sock: socket.socket) -> None:
        """A dialled connection's first frame: who dials, for which job (read without blocking the thread)."""
        buffer, _ = self._hellos[sock]
        try:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed before its hello")
            buffer += chunk
            if len(buffer) < _LENGTH.size:
                return
            (length,) = _LENGTH.unpack_from(buffer)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"a hello of {length} bytes")
            if len(buffer) < _LENGTH.size + length:
                return
            hello = json.loads(bytes(buffer[_LENGTH.size : _LENGTH.size + length]))
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError) as error:
            log.info("control plane of rank %d: a dialled connection failed before its hello: %s", self.rank, error)
            self._drop_hello(sock)
            sock.close()
            return
        # (in ``_hellos`` until adopted or closed: a group forming meanwhile leaves it out of its connections)
        self._unregister(sock)
        try:
            peer = hello.get("rank") if isinstance(hello, dict) else None
            if not isinstance(hello, dict) or hello.get("t") != "hello" or hello.get("job") != self.scope:
                log.warning("control plane of rank %d: refused a connection from another job (%s)", self.rank, hello)
                sock.close()
                return
            if not isinstance(peer, int) or not hmac.compare_digest(str(hello.get("proof", "")), self._proof):
                log.warning(
                    "control plane of rank %d: refused rank %s without the job's shared secret", self.rank, peer
                )
                sock.setblocking(True)
                self._refuse(sock, "refused", "it does not hold the job's shared secret (LIGHTNING_DP_JOB_SECRET)")
                return
            incarnation = str(hello.get("inc", ""))
            with self._lock:
                fenced = incarnation in self._fenced_incarnations or (peer in self._retired and not hello.get("join"))
                member = peer in self._expected or peer == self.rank
                known = member and peer not in self._peers
                taken = peer in self._candidates and peer in self._peers
            if fenced:
                sock.setblocking(True)
                self._refuse(sock, "fenced", "this rank was declared lost by the job; only a new process may join")
            elif hello.get("join"):
                if peer not in self._slots:
                    sock.setblocking(True)
                    self._refuse(sock, "refused", f"rank {peer} is not a rank of this job: it has places for ranks "
                                 f"{min(self._slots)} to {max(self._slots)}")  # fmt: skip
                    return
                with self._lock:
                    settling = member and peer in self._suspected
                if settling:  # its loss is not agreed on yet here
                    sock.setblocking(True)
                    self._refuse(sock, "retry", f"the job has not yet gone on without rank {peer}")
                    return
                if member or taken:
                    held = "a live member of the job" if member else "asked for by another process already"
                    sock.setblocking(True)
                    self._refuse(sock, "refused", f"rank {peer} is {held}: a process cannot join in its place")
                    return
                log.warning("control plane of rank %d: a new process asks to join as rank %d", self.rank, peer)
                with self._lock:
                    self._candidates[peer] = incarnation
                    self._suspected.pop(peer, None)  # (the suspicion of the process it replaces)
                self._adopt(peer, sock, incarnation, hello.get("at"))
            elif not known:
                sock.close()
            else:
                self._adopt(peer, sock, incarnation, hello.get("at"))
        finally:
            self._hellos.pop(sock, None)

    def _drop_hello(self, sock: socket.socket) -> None:
        self._hellos.pop(sock, None)
        self._unregister(sock)

    def _expire_hellos(self, now: float) -> None:
        for sock, (_, deadline) in list(self._hellos.items()):
            if now > deadline:
                self._drop_hello(sock)
                sock.close()

    def _refuse_later(self, state: _Peer, why: str) -> None:
        """Tell a retired peer why, then close, from the thread (which may still be writing to it)."""
        with self._lock:
            self._to_close.append((state.sock, why))
        self._wake()

    def _refuse(self, sock: socket.socket, kind: str, why: str) -> None:
        """Tell the process at ``sock`` it is ``kind`` (``"fenced"``: declared lost, ``"refused"``: not admitted to
        the job) and why, then close."""
        try:
            sock.settimeout(1.0)
            sock.sendall(_frame({"t": kind, "why": why, "by": self.rank}))
        except OSError:
            pass
        sock.close()

    def _adopt(self, peer: int, sock: socket.socket, incarnation: str, at: object = None) -> None:
        sock.setblocking(False)
        with self._connected:
            self._peers[peer] = _Peer(peer, sock, time.monotonic())
            self._incarnations[peer] = incarnation
            if isinstance(at, str) and parse_endpoint(at)[1] == incarnation:
                self._endpoints[peer] = at
            self._to_register.append((sock, peer))
            self._connected.notify_all()
        self._wake()

    def _wake(self) -> None:
        try:
            self._waker_write.send(b"x")
        except OSError:  # the waker's buffer is full: the thread wakes anyway
            pass

    # ------------------------------------------------------------------ what the rest of the process sees
    def attach(self, handler: ControlHandler) -> None:
        """Have ``handler`` hear of every suspicion and message from now on."""
        with self._lock:
            self._handler = handler

    @property
    def suspected(self) -> dict[int, str]:
        """The peers this rank suspects, with the cause (``"closed"`` or ``"silent"``)."""
        with self._lock:
            return dict(self._suspected)

    def send(self, peer: int, message: Message) -> bool:
        """Queue ``message`` for ``peer``; ``False`` where ``peer`` is not connected (suspected or retired)."""
        data = _frame(message)
        with self._lock:
            state = self._peers.get(peer)
            if state is None or peer in self._suspected:
                return False
            state.outbound += data
        self._wake()
        return True

    def clear(self, peers: set[int]) -> None:
        """Forget the suspicions of ``peers`` (an agreement kept them as members)."""
        with self._lock:
            for peer in peers:
                self._suspected.pop(peer, None)

    def peers(self) -> set[int]:
        """The ranks connected to this one now (not suspected lost)."""
        with self._lock:
            return set(self._peers) - set(self._suspected)

    def candidates(self) -> set[int]:
        """The ranks whose new processes are connected here and ask to join."""
        with self._lock:
            return {r for r in self._candidates if r in self._peers and r not in self._suspected}

    def admit(self, peers: set[int]) -> None:
        """The new processes ``peers`` (this one among them, for a joiner) are members from now on."""
        with self._lock:
            if self.rank in peers:
                self._joining = False
            for peer in peers - {self.rank}:
                self._candidates.pop(peer, None)
                self._retired.discard(peer)
                self._departing.discard(peer)
                self._suspected.pop(peer, None)
                self._expected.add(peer)

    def retire(self, peers: set[int], why: str) -> None:
        """Drop ``peers`` for good: each is told why (if it still listens) and its connection closes; the process
        that was each of them (its incarnation) is refused if it dials again, with the same message."""
        with self._lock:
            self._retired |= peers
            self._expected -= peers
            self._fenced_incarnations |= {self._incarnations[p] for p in peers if p in self._incarnations}
            dropped = [self._peers.pop(p) for p in peers if p in self._peers]
        for state in dropped:
            with self._lock:
                self._to_unregister.append(state.sock)
            self._wake()
            self._refuse_later(state, why)

    def let_go(self, peers: set[int]) -> None:
        """The members ``peers`` left the job on purpose: no longer expected, and their connections ending (with a
        goodbye as they close, or without one) is no loss."""
        with self._lock:
            self._expected -= peers
            self._departing |= peers - {self.rank}

    def close(self, farewell: bool = True) -> None:
        """Stop the thread and close every connection; with ``farewell`` first say goodbye to every peer, so that
        none takes this rank for lost (it finished), else they see it lost (it failed)."""
        with self._lock:
            if self._closing:
                return
            self._leaving = True
            peers = list(self._peers) if farewell else []
        for peer in peers:
            self.send(peer, {"t": "bye"})
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with self._lock:
                if not any(p.outbound for p in self._peers.values()):
                    break
            time.sleep(0.005)
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(timeout=5.0)
        with self._lock:
            socks = [p.sock for p in self._peers.values()]
            self._peers.clear()
        for sock in [*socks, self._listener, self._waker_read, self._waker_write]:
            sock.close()
        self._selector.close()

    # ------------------------------------------------------------------ the thread
    def _unregister(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _suspect(self, peer: int, cause: str, direct: bool = True) -> None:
        with self._lock:
            if peer in self._departing:
                return
            candidate = direct and peer in self._candidates
        if candidate:  # a process that asked to join and went: it never was a member
            self._drop_candidate(peer, cause)
            return
        with self._lock:
            if direct:
                if peer in self._suspected or peer in self._retired:
                    return
                self._suspected[peer] = cause
            handler = self._handler
            others = (
                []
                if self._joining
                else [p for p in self._peers if p not in (peer, *self._suspected, *self._candidates)]
            )
        if direct:
            log.warning("control plane of rank %d: rank %d is suspected lost (%s)", self.rank, peer, cause)
            for other in others:
                self.send(other, {"t": "suspect", "rank": peer, "by": self.rank, "cause": cause})
        if handler is not None:
            handler.suspect(peer, cause, direct)

    def _drop_candidate(self, peer: int, cause: str) -> None:
        log.warning("control plane of rank %d: the process asking to join as rank %d went (%s)", self.rank, peer, cause)
        with self._lock:
            self._candidates.pop(peer, None)
            state = self._peers.pop(peer, None)
        if state is not None:
            self._unregister(state.sock)
            state.sock.close()

    def _drop_peer(self, state: _Peer) -> None:
        """Forget ``state``'s connection without suspecting it (a member asked this joining process to dial again)."""
        with self._lock:
            if self._peers.get(state.rank) is state:
                del self._peers[state.rank]
        self._unregister(state.sock)
        state.sock.close()

    def _depart(self, state: _Peer) -> None:
        """``state``'s rank leaves the job on purpose (it finished): its connection closing is no loss. What this
        rank still had queued for it (its own goodbye, when both leave at once) is sent first, as far as the socket
        takes it without waiting."""
        with self._lock:
            self._peers.pop(state.rank, None)
            self._expected.discard(state.rank)
            pending = bytes(state.outbound)
        self._unregister(state.sock)
        if pending:
            try:
                state.sock.send(pending)
            except OSError:
                pass
        state.sock.close()

    def _fenced(self, why: str) -> None:
        """A peer says this rank is no longer a member."""
        with self._lock:
            if self.fenced is not None:
                return
            self.fenced = why
            handler = self._handler
        log.warning("control plane of rank %d: fenced by the job (%s)", self.rank, why)
        if handler is not None:
            handler.fenced(why)

    def _refused(self, why: str) -> None:
        error = ForeignJobError(why)
        with self._lock:
            if self.refusal is not None:
                return
            self.refusal = error
            handler = self._handler
            self._connected.notify_all()
        log.warning("control plane of rank %d: %s", self.rank, why)
        if handler is not None:
            handler.refused(error)

    def _run(self) -> None:
        next_beat = last_pass = time.monotonic()
        while True:
            with self._lock:
                if self._closing:
                    return
                register, self._to_register = self._to_register, []
                unregister, self._to_unregister = self._to_unregister, []
                to_close, self._to_close = self._to_close, []
                writers = [p for p in self._peers.values() if p.outbound]
            for sock, peer in register:
                self._selector.register(sock, selectors.EVENT_READ, peer)
            for sock in unregister:
                self._unregister(sock)
            for sock, why in to_close:
                self._unregister(sock)
                sock.setblocking(True)
                self._refuse(sock, "fenced", why)
            for state in writers:
                try:
                    self._selector.modify(state.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, state.rank)
                except (KeyError, ValueError):
                    pass
            now = time.monotonic()
            for key, events in self._selector.select(timeout=max(0.0, min(next_beat - now, self._period))):
                if key.fileobj is self._waker_read:
                    try:
                        self._waker_read.recv(4096)
                    except OSError:
                        pass
                elif key.fileobj is self._listener:
                    self._accept()
                elif isinstance(key.data, socket.socket):
                    self._read_hello(key.data)
                else:
                    self._serve(key.data, events)
            now = time.monotonic()
            stalled = now - last_pass > 2 * self._period
            last_pass = now
            if now >= next_beat or stalled:
                next_beat = now + self._period
                self._beat(now, stalled)
                self._expire_hellos(now)
            with self._lock:
                handler = self._handler
            if handler is not None:
                handler.tick(now)

    def _beat(self, now: float, stalled: bool) -> None:
        """Queue a heartbeat for every peer and suspect the silent ones; after a stall of this process (stopped,
        starved of CPU) the peers' frames may be waiting unread, so silence is measured afresh instead."""
        heartbeat = _frame({"t": "hb"})
        with self._lock:
            peers = [p for p in self._peers.values() if p.rank not in self._suspected]
            for state in peers:
                state.outbound += heartbeat
                if stalled:
                    state.heard = now
        for state in peers:
            if now - state.heard > self.heartbeat_timeout:
                self._suspect(state.rank, "silent")

    def _serve(self, peer: int, events: int) -> None:
        with self._lock:
            state = self._peers.get(peer)
        if state is None:
            return
        try:
            if events & selectors.EVENT_WRITE:
                with self._lock:
                    pending = bytes(state.outbound)
                sent = state.sock.send(pending) if pending else 0
                with self._lock:
                    del state.outbound[:sent]
                    idle = not state.outbound
                if idle:
                    self._selector.modify(state.sock, selectors.EVENT_READ, peer)
            if events & selectors.EVENT_READ:
                chunk = state.sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError("closed by the peer")
                state.inbound += chunk
                self._parse(state)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError) as error:
            log.info("control plane of rank %d: connection to rank %d ended: %s", self.rank, peer, error)
            self._unregister(state.sock)
            with self._lock:
                candidate = peer in self._candidates
                departing = peer in self._departing
                suspected = peer in self._suspected or peer in self._retired or self._leaving
            if candidate:
                self._drop_candidate(peer, "closed")
                return
            if departing:
                self._depart(state)
                return
            if not suspected:
                self._suspect(peer, "closed")

    def _parse(self, state: _Peer) -> None:
        while len(state.inbound) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(state.inbound)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"a frame of {length} bytes")
            if len(state.inbound) < _LENGTH.size + length:
                return
            message = json.loads(bytes(state.inbound[_LENGTH.size : _LENGTH.size + length]))
            del state.inbound[: _LENGTH.size + length]
            with self._lock:
                ignored = state.rank in self._suspected
                candidate = state.rank in self._candidates
                state.heard = time.monotonic()
            if ignored or not isinstance(message, dict):
                continue
            kind = message.get("t")
            if kind == "hb":
                continue
            if kind == "bye":
                if candidate:
                    self._drop_candidate(state.rank, "left")
                else:
                    self._depart(state)
                return
            if candidate:  # a process that only asks to join has nothing to say to the members yet
                continue
            if kind == "retry":
                self._drop_peer(state)
                return
            message["from"] = state.rank
            if kind == "suspect":
                self._suspect(int(message["rank"]), f"{message.get('cause')} at rank {message.get('by')}", False)
            elif kind == "fenced":
                self._fenced(str(message.get("why", "")))
            elif kind == "refused":
                self._refused(f"rank {message.get('by')} refused rank {self.rank}: {message.get('why', '')}")
            else:
                with self._lock:
                    handler = self._handler
                if handler is not None:
                    handler.receive(message)
