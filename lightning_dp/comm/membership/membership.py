"""The job's membership: who trains now, the process groups they share, and how they go on without a lost rank.

One :class:`Membership` per rank, built collectively at set-up. Every exchange of every scheme consults it (as
torchft's ``Manager``): an exchange runs on :meth:`Membership.group`'s groups, a step counts once
:meth:`Membership.commit` has accepted it, and a failed exchange asks :meth:`Membership.interpret` what the error
means. When a rank is lost:

1. every survivor learns it from the control plane (:mod:`.control`): at once for a process that died, within the
   heartbeat timeout for a silent one;
2. each survivor fences its groups (:mod:`.fence`), so that every exchange of every survivor fails at once,
   wherever it waited, and no late message of the old groups lands anywhere;
3. the survivors agree on the new members and on the last step each committed (:mod:`.agreement`), over the
   control plane: no store and no process group is needed, so nothing that dies with one rank (rank 0's store
   included) stops the agreement;
4. :meth:`Membership.recover` returns the decision, and the new generation's groups meet on a store served by that
   generation's leader.

A member leaves on purpose the same way (:meth:`Membership.let_go`, every member asking at the same sync point): the
decision names it as left, not lost, and the others go on without it.

A new process in a lost rank's place joins the same way (:meth:`Membership.join`): it finds the job's current
members in the directory the leader keeps in the job's store, dials each of them as a candidate, and the members admit
it with a change that loses no rank (:meth:`Membership.admit`), from which it is a member like the others.

What the survivors then do with their state (redo the step, catch up from a member that committed more, hand a new
member the job's state) is the caller's: the membership knows ranks, steps and groups, not models.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d

from lightning_dp.comm.errors import (
    ConfigurationError,
    ForeignJobError,
    JoinAbandonedError,
    MembershipChange,
    PeerUnreachableError,
    QuorumLostError,
)
from lightning_dp.comm.membership.agreement import Agreement, Decision
from lightning_dp.comm.membership.control import ControlPlane
from lightning_dp.comm.membership.fence import Connection, connections_opened_by, fence

log = logging.getLogger(__name__)
#: how long a new process dials the members at a time before it reads the job's directory again
JOIN_DIAL_SECONDS = 5.0
#: how often the leader looks for the job's store served again, once it went with the rank that served it
REACH_STORE_SECONDS = 1.0
T = TypeVar("T")

#: seconds a failed exchange waits for the control plane to name a lost peer before it is taken for a local error
#: (a process that died closes its control connection as it closes its group connections)
INTERPRET_GRACE_SECONDS = 2.0


@dataclass(frozen=True)
class Loss:
    """A rank the job went on without."""

    rank: int
    #: why it was suspected: ``"closed"`` (its connections closed: it died), ``"silent"`` (no heartbeat within the
    #: timeout), or what its reporters saw
    cause: str
    #: the generation that left it out
    generation: int
    #: the progress the job had when it went on without it: the highest count any survivor had committed (see
    #: :meth:`Membership.commit`; under a strategy, sync points rather than optimizer steps)
    step: int
    #: seconds from the first suspicion on this rank to the new generation's groups being ready here
    recovery_seconds: float


@dataclass(frozen=True)
class Join:
    """A new process the job admitted in a rank's place."""

    rank: int
    #: the generation that admitted it
    generation: int
    #: the progress the job had when it was admitted (as :attr:`Loss.step`)
    step: int


@dataclass(frozen=True)
class Leave:
    """A member that left the job on purpose."""

    rank: int
    #: the generation that let it go
    generation: int
    #: the progress the job had when it left (as :attr:`Loss.step`)
    step: int


def form_group(members: tuple[int, ...], me: int, store: dist.Store, name: str, backend: str,
               timeout: timedelta) -> dist.ProcessGroup:  # fmt: skip
    """A process group over the global ranks ``members`` that meets on ``store`` (not the default group's), with
    ``name``; collective over ``members`` only."""
    pg, _ = distributed_c10d._new_process_group_helper(
        len(members), members.index(me), list(members), backend, store, distributed_c10d.GroupName(name),
        timeout=timeout,
    )  # fmt: skip
    assert isinstance(pg, dist.ProcessGroup)
    distributed_c10d._world.pg_group_ranks[pg] = {rank: i for i, rank in enumerate(members)}
    return pg


class Membership:
    """Rank ``rank``'s view of the job's membership (see the module docstring).

    Args:
        rank: this process's global rank (it keeps it for the whole run).
        ranks: the job's training ranks at start (global ranks).
        store: a store every rank reaches now (the default group's), to exchange the control plane's endpoints.
        scope: a prefix no other membership uses (a job's scope and a counter), for store keys and group names.
        host: the address this rank's control plane listens on (the one its process groups use).
        heartbeat_timeout: seconds without a heartbeat after which a peer is suspected lost.
        max_lost: how many of ``ranks`` the job may lose in all before it stops.
        backend: the backend of the groups (``"gloo"``).
        timeout: how long a group's operations may wait (the strategy's timeout).
        proof: the proof of the job's shared secret (empty without one): a process without it is refused.
        directory: the key in ``store`` under which the leader keeps the job's directory (its members now, for new
            processes to find them; ``None``: no directory, nobody joins).
        places: how many ranks the job may have (``None``: those it starts with); a new process may join in any place
            ``0`` to ``places - 1`` that no member holds, growing the job past ``ranks``.
        reach_store: where the directory's store went with the rank that served it (global rank 0), a client of
            that store once a new process in that rank's place serves it again, else ``None`` (asked by the leader
            every :data:`REACH_STORE_SECONDS`, which then keeps the directory and the members' endpoints there).
    """

    def __init__(
        self,
        rank: int,
        ranks: list[int],
        store: dist.Store,
        scope: str,
        host: str,
        heartbeat_timeout: float,
        max_lost: int,
        backend: str = "gloo",
        timeout: timedelta = timedelta(minutes=5),
        proof: str = "",
        directory: str | None = None,
        joining: bool = False,
        places: int | None = None,
        reach_store: Callable[[], dist.Store | None] | None = None,
    ) -> None:
        self.rank = rank
        self.original = tuple(sorted(ranks))
        #: how many ranks the job may have (global ranks ``0`` to ``places - 1``)
        self.places = max(places or 0, max(self.original) + 1)
        self.max_lost = max_lost
        self._directory = directory
        self._directory_store = store
        self._reach_store = reach_store
        self._keeper: threading.Thread | None = None
        self._directory_due = threading.Event()
        self._closed = False
        self.scope = scope
        self.host = host
        self.backend = backend
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        #: the current generation's members and generation number (changed by :meth:`recover`)
        self.members: tuple[int, ...] = self.original
        self.generation = 0
        #: every rank the job went on without, and every new process it admitted, in order
        self.losses: list[Loss] = []
        self.joins: list[Join] = []
        self.leaves: list[Leave] = []
        self._store: dist.Store | None = store
        self._store_at: tuple[str, int] = ("", 0)
        self._store_prefix = f"{scope}/gen0"
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._connections: list[Connection] = []
        self._lock = threading.Lock()
        self._old_groups: list[dist.ProcessGroup] = []
        self._served_stores: list[dist.Store] = []
        #: where this rank served the last store it served
        self._served_at: tuple[str, int] = ("", 0)
        #: when the last change began on this rank (``time.monotonic()``; ``None`` before the first)
        self.change_began: float | None = None
        if joining:
            self.members = (rank,)
            self.generation = -1
        self.control = ControlPlane(rank, list(self.original), store, scope, host, heartbeat_timeout,
                                    timeout=timeout.total_seconds(), proof=proof, joining=joining,
                                    places=self.places)  # fmt: skip
        self.agreement = Agreement(rank, list(self.members), len(self.original), max_lost,
                                   timeout=max(10.0, 3 * heartbeat_timeout), send=self.control.send,
                                   serve_store=self._serve_store, on_change=self._on_change,
                                   on_adopt=self._on_adopt, candidates=self.control.candidates,
                                   joining=joining, connected=lambda peer: peer in self.control.peers())  # fmt: skip
        self.control.attach(self.agreement)
        if not joining and self.leader == rank:
            self._publish_directory()

    @classmethod
    def join(
        cls,
        rank: int,
        store: dist.Store,
        directory: str,
        host: str,
        heartbeat_timeout: float,
        backend: str = "gloo",
        timeout: timedelta = timedelta(minutes=5),
        proof: str = "",
        reach_store: Callable[[], dist.Store | None] | None = None,
    ) -> Membership:
        """The membership of a new process taking rank ``rank``'s place in the running job whose directory is at
        ``directory`` in ``store`` (see :func:`read_directory`): it listens, and is a member of nothing until
        :meth:`ask_to_join` and the members' admission (:meth:`recover`)."""
        record = read_directory(store, directory)
        if record is None:
            raise RuntimeError(f"rank {rank}: no running job's directory at {directory!r}")
        places = int(record.get("places", len(record["original"])))
        if not 0 <= rank < places:
            raise ConfigurationError(
                f"rank {rank}: the running job has places for ranks 0 to {places - 1} only; a job grows past the ranks "
                f"it started with up to its strategy's max_ranks (set when the job started)"
            )
        return cls(rank, list(record["original"]), store, str(record["scope"]), host, heartbeat_timeout,
                   int(record["max_lost"]), backend, timeout, proof, directory, joining=True,
                   places=places, reach_store=reach_store)  # fmt: skip

    # ------------------------------------------------------------------ joining
    def ask_to_join(self) -> None:
        """A joining process's request: once the job no longer counts this rank as a member (its loss is settled),
        dial every member as a candidate. Raises where a member is out of reach or refuses it."""
        assert self._directory is not None
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            record = read_directory(self._directory_store, self._directory)
            members = [int(r) for r in record["members"]] if record is not None else []
            if members and self.rank not in members:
                break
            if time.monotonic() > deadline:
                raise QuorumLostError(
                    f"rank {self.rank}: the job still counts rank {self.rank} as a member after "
                    f"{self.timeout.total_seconds():.0f} s (is another process running as rank {self.rank}?)"
                )
            time.sleep(0.1)
        log.warning("rank %d: asking the job's members %s to join", self.rank, members)
        while True:  # (a member out of reach for a while: the directory read again, in case the job ended)
            attempt = min(JOIN_DIAL_SECONDS, max(0.1, deadline - time.monotonic()))
            try:
                self.control.connect_as_joiner(members, self._directory_store, timeout=attempt)
                return
            except RuntimeError as error:  # (PeerUnreachableError among them)
                if isinstance(error, ForeignJobError) or time.monotonic() > deadline:
                    raise
                record = read_directory(self._directory_store, self._directory)
                if record is None:
                    raise JoinAbandonedError(
                        f"rank {self.rank}: the job's store is gone before this process could reach every member "
                        "(the job ended)"
                    ) from error
                members = [int(r) for r in record["members"] if int(r) != self.rank]

    def _dial_members(self) -> None:
        """A joining process, while it waits: dial the members it is not connected to (a member admitted since it
        asked, one that asked it to dial again), as the directory names them now."""
        assert self._directory is not None
        record = read_directory(self._directory_store, self._directory)
        members = {int(r) for r in record["members"]} - {self.rank} if record is not None else set()
        if members - self.control.peers():
            try:
                self.control.connect_as_joiner(sorted(members), self._directory_store, timeout=1.0)
            except (PeerUnreachableError, RuntimeError) as error:  # (again at the next wait)
                log.info("rank %d: could not reach every member yet: %s", self.rank, error)

    def candidates(self) -> set[int]:
        """The new processes every connection of this rank hears asking to join."""
        return self.control.candidates()

    def admit(self, ranks: set[int]) -> None:
        """Start a change that admits the new processes ``ranks`` (every member asks for the same ones at the same
        sync point); :meth:`recover` returns the decision, which names those admitted in ``joined``."""
        log.warning("rank %d: the members admit new process(es) for rank(s) %s", self.rank, sorted(ranks))
        self.agreement.admit(set(ranks))

    def let_go(self, ranks: set[int]) -> None:
        """Start a change that lets the members ``ranks`` go (every member asks for the same ones at the same sync
        point); :meth:`recover` returns the decision, which names them in ``left`` (on a rank that leaves, it is the
        last thing this membership does before :meth:`close`)."""
        log.warning("rank %d: the members let rank(s) %s leave the job", self.rank, sorted(ranks))
        self.agreement.let_go(set(ranks))

    def problem_without(self, ranks: set[int]) -> str | None:
        """Why the members could not go on if ``ranks`` left now (the quorum, ``max_lost``; ``None``: they could)."""
        return self.agreement.problem_without(ranks)

    def _publish_directory(self) -> None:
        """Keep the job's members now where a new process finds them (the leader), on the directory's thread: a store
        that went silent with the rank that served it never holds up a change."""
        if self._directory is None:
            return
        with self._lock:
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep_directory, name="lddp-directory", daemon=True)
                self._keeper.start()
        self._directory_due.set()

    def _keep_directory(self) -> None:
        """The directory's thread: while this rank leads, write the directory when asked and every
        :data:`REACH_STORE_SECONDS` (which also finds the store gone). Where the store went with the rank that served
        it (global rank 0), look for it served again there (``reach_store``), and keep in it the members' endpoints,
        then the directory (a new process reads the directory first). Best effort: without ``reach_store`` no process
        joins once the store went."""
        key = self._directory
        assert key is not None
        gone = False
        while not self._closed:
            self._directory_due.wait(REACH_STORE_SECONDS)
            self._directory_due.clear()
            if self._closed or self.leader != self.rank:
                continue
            if gone:
                store = self._reach_store() if self._reach_store is not None else None
                if store is None:
                    continue
                try:
                    self.control.publish_endpoints(store, list(self.members))
                except (RuntimeError, OSError):
                    continue
                self._directory_store, gone = store, False
                log.warning("rank %d: the job's store is served again; the directory is kept there", self.rank)
            record = {"scope": self.scope, "generation": self.generation, "members": list(self.members),
                      "original": list(self.original), "max_lost": self.max_lost, "places": self.places}  # fmt: skip
            try:
                self._directory_store.set(key, json.dumps(record))
                self._directory_store.check([key])  # (a set is not answered: a dead store shows here)
            except (RuntimeError, OSError) as error:
                gone = True
                log.warning("rank %d: the job's store went (%s); %s", self.rank, error,
                            "the directory goes to it once it is served again (by a new process in global rank 0's "
                            "place)" if self._reach_store is not None else "no process can join any more")  # fmt: skip

    # ------------------------------------------------------------------ the current generation
    @property
    def size(self) -> int:
        """How many ranks train now."""
        return len(self.members)

    @property
    def leader(self) -> int:
        """The lowest member's global rank (it takes over global rank 0's roles)."""
        return self.members[0]

    def group(self, name: str) -> dist.ProcessGroup:
        """The current generation's process group called ``name`` over every member, created on first use
        (collective: every member asks for the same names in the same order)."""
        with self._lock:
            found = self._groups.get(name)
        if found is not None:
            return found
        self.check()
        with self._lock:
            generation, members, prefix, address = self.generation, self.members, self._store_prefix, self._store_at
        group_name = f"{self.scope}/gen{generation}/{name}"

        def create() -> dist.ProcessGroup:
            with self._lock:
                base = self._store if self.generation == generation else None
            if base is None:  # the generation's leader serves it; a follower connects on first use
                base = dist.TCPStore(address[0], address[1], is_master=False, timeout=self.timeout)
                with self._lock:
                    if self.generation == generation:  # (a formation abandoned for a newer generation keeps out)
                        self._store = base
            return form_group(members, self.rank, dist.PrefixStore(prefix, base), group_name, self.backend,
                              self.timeout)  # fmt: skip

        group, connections = self._interruptible(
            lambda: connections_opened_by(create, exclude=self.control.descriptors), f"forming group {name!r}"
        )
        with self._lock:
            self._groups[name] = group
            self._connections.extend(connections)
            moved_on = self.generation != generation
        if moved_on or self.agreement.changing:  # a change began while the group formed: fence it with the others
            fence(connections)
            self.check()
        return group

    def guard(self, connections: list[Connection]) -> None:
        """Fence ``connections`` (those of a group this rank formed apart, see :func:`connections_opened_by`) with
        this generation's groups when a change begins (at once, if one has begun)."""
        with self._lock:
            self._connections.extend(connections)
        if self.agreement.changing:
            fence(connections)

    def form_apart(self, create: Callable[[], T], what: str) -> tuple[T, list[Connection]]:
        """``create()`` a gloo group apart from the membership's (another store, other members too), interrupted by a
        change as :meth:`group` is; returns it with its connections, fenced with this generation's groups
        (:meth:`guard`)."""
        created, connections = self._interruptible(
            lambda: connections_opened_by(create, exclude=self.control.descriptors), what
        )
        self.guard(connections)
        return created, connections

    def release(self, connections: list[Connection]) -> None:
        """Stop guarding ``connections`` (their group was closed: the descriptors may be reused)."""
        with self._lock:
            self._connections = [c for c in self._connections if c not in set(connections)]

    @property
    def store_address(self) -> tuple[str, int]:
        """Where this generation's store is served (by its leader; after the first change only)."""
        return self._store_at

    def _interruptible(self, work: Any, what: str) -> Any:
        """Run ``work()`` on a helper thread and return its result, unless a change begins first (then
        :class:`MembershipChange`; the helper is abandoned, and ends by the group's timeout at worst)."""
        outcome: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append((True, work()))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                outcome.append((False, error))
            done.set()

        threading.Thread(target=run, name="lddp-membership-form", daemon=True).start()
        while not done.wait(0.05):
            if self.agreement.changing:
                self.check()
        ok, value = outcome[0]
        if not ok:
            raise self.interpret(value) from value
        return value

    # ------------------------------------------------------------------ what exchanges ask
    def check(self) -> None:
        """Raise :class:`MembershipChange` if a change has begun (or the agreement's error if it failed)."""
        self.agreement.check()

    def commit(self, step: int) -> None:
        """This rank completed ``step``'s exchange and is about to apply it: accepted, or
        :class:`MembershipChange` if a change began first (then the step does not count as committed here, and
        this rank must not apply it)."""
        self.agreement.commit(step)

    def request_change(self, why: str) -> None:
        """Start a change that loses no rank (see :meth:`Agreement.request_change`): every member's exchanges stop, and
        :meth:`recover` returns a new generation of the same members."""
        log.warning("rank %d: %s; the members agree on a new generation", self.rank, why)
        self.agreement.request_change(why)

    def interpret(self, error: BaseException) -> BaseException:
        """What a failed exchange's ``error`` means: :class:`MembershipChange` (chained to it) where a change has
        begun or begins within :data:`INTERPRET_GRACE_SECONDS` (a lost peer), else ``error`` itself (a local error
        is never reported as a lost peer)."""
        if isinstance(error, MembershipChange):
            return error
        deadline = time.monotonic() + INTERPRET_GRACE_SECONDS
        while True:
            try:
                self.agreement.check()
            except BaseException as change:  # noqa: BLE001 - a change, or the agreement's failure
                change.__cause__ = error
                return change
            if time.monotonic() > deadline:
                return error
            time.sleep(0.01)

    # ------------------------------------------------------------------ recovery
    def recover(self, timeout: float | None = None) -> Decision:
        """Wait for the survivors' decision and move to its generation: the lost ranks are retired (a later
        message of theirs is refused), the old groups stay fenced, and the next :meth:`group` call forms the new
        generation's groups over the members. Raises :class:`~lightning_dp.comm.errors.QuorumLostError` where the
        job must stop (or no decision came within ``timeout`` seconds, if given),
        :class:`~lightning_dp.comm.errors.FencedError` where it went on without this rank."""
        decision = self._wait_for_admission(timeout) if self.agreement.joining else self.agreement.wait(timeout)
        began = self.agreement.began_at.get(decision.generation, time.monotonic())
        self.change_began = began
        step = max(decision.committed.values(), default=0)
        self.leaves += [Leave(rank, decision.generation, step) for rank in decision.left]
        if self.rank in decision.left:
            log.warning("rank %d: left the job (generation %d goes on with ranks %s)", self.rank, decision.generation,
                        list(decision.members))  # fmt: skip
            return decision
        lost = set(self.members) - set(decision.members) - set(decision.left)
        with self._lock:
            self._old_groups.extend(self._groups.values())
            self._groups = {}
            self._connections = []
            self.members = decision.members
            self.generation = decision.generation
            served = self._served_stores[-1] if self._served_stores else None
            self._store = served if served is not None and decision.store == self._served_at else None
            self._store_at = decision.store
            self._store_prefix = f"{self.scope}/gen{decision.generation}"
        self.agreement.activate(decision.generation)
        seconds = time.monotonic() - began
        for rank in sorted(lost):
            self.losses.append(Loss(rank, decision.causes.get(rank, "lost"), decision.generation, step, seconds))
        self.joins += [Join(rank, decision.generation, step) for rank in decision.joined]
        log.warning("rank %d: the job goes on with ranks %s (generation %d)%s%s%s",
                    self.rank, list(decision.members), decision.generation,
                    f" without rank(s) {sorted(lost)}" if lost else "",
                    f", rank(s) {list(decision.left)} having left" if decision.left else "",
                    f", new process(es) for rank(s) {list(decision.joined)}" if decision.joined else "")  # fmt: skip
        if self.leader == self.rank:
            self._publish_directory()
        return decision

    def _wait_for_admission(self, timeout: float | None) -> Decision:
        """A joining process's wait for the decision that admits it; raises
        :class:`~lightning_dp.comm.errors.JoinAbandonedError` when every member has left (the job ended) or after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        while True:
            try:
                return self.agreement.wait(0.25)
            except TimeoutError:
                self._dial_members()
                if not self.control.peers():
                    raise JoinAbandonedError(
                        f"rank {self.rank}: every member of the job left before admitting this process (the job ended)"
                    ) from None
                if deadline is not None and time.monotonic() > deadline:
                    raise JoinAbandonedError(
                        f"rank {self.rank}: the job's members did not admit this process within {timeout:.0f} s (they "
                        "admit a new process at a step boundary of a fit)"
                    ) from None

    def _on_adopt(self, decision: Decision) -> None:
        """A decision is adopted (on the control plane's thread): the ranks it leaves out are told so and dropped at
        once, so that nothing they send counts and a late suspicion of them starts no new change."""
        lost = set(decision.lost)
        named = ", ".join(f"rank {r} ({decision.causes.get(r, 'lost')})" for r in sorted(lost))
        self.control.retire(lost, f"declared lost in generation {decision.generation}: {named}")
        self.control.let_go(set(decision.left))
        # (a new member was told of no change before its admission: the ranks lost meanwhile are retired here too)
        stale = self.control.expected() - set(decision.members) - lost
        if stale:
            self.control.retire(stale, f"declared lost before generation {decision.generation}")
        self.control.admit(set(decision.joined))
        self.control.clear(set(decision.members))

    def _on_change(self) -> None:
        """The exchanges must stop (on the control plane's thread): fence this generation's groups at once."""
        with self._lock:
            connections = list(self._connections)
        fence(connections)

    def _serve_store(self) -> tuple[str, int]:
        """Serve the next generation's store on this rank (its leader)."""
        store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self._served_stores = [*self._served_stores[-1:], store]
        self._served_at = (self.host, int(store.port))
        return self._served_at

    def close(self, farewell: bool = True) -> None:
        """Leave: the control plane closes. With ``farewell`` the others are told this rank finished (no loss);
        without, they see it go as a lost rank (it failed)."""
        self._closed = True
        self._directory_due.set()
        self.control.close(farewell)


def read_directory(store: dist.Store, key: str) -> dict[str, Any] | None:
    """The job directory at ``key`` in ``store`` (its membership's scope, generation, members, original ranks and
    ``max_lost``), or ``None`` where no job with a membership published one."""
    try:
        if not store.check([key]):
            return None
        record = json.loads(store.get(key))
    except (RuntimeError, ValueError):
        return None
    return record if isinstance(record, dict) else None
