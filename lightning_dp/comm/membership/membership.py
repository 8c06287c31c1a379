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

What the survivors then do with their state (redo the step, catch up from a member that committed more) is the
caller's: the membership knows ranks, steps and groups, not models.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d

from lightning_dp.comm.errors import MembershipChange
from lightning_dp.comm.membership.agreement import Agreement, Decision
from lightning_dp.comm.membership.control import ControlPlane
from lightning_dp.comm.membership.fence import Connection, connections_opened_by, fence

log = logging.getLogger(__name__)
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
    ) -> None:
        self.rank = rank
        self.original = tuple(sorted(ranks))
        self.scope = scope
        self.host = host
        self.backend = backend
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        #: the current generation's members and generation number (changed by :meth:`recover`)
        self.members: tuple[int, ...] = self.original
        self.generation = 0
        #: every rank the job went on without, in order
        self.losses: list[Loss] = []
        self._store: dist.Store | None = store
        self._store_at: tuple[str, int] = ("", 0)
        self._store_prefix = f"{scope}/gen0"
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._connections: list[Connection] = []
        self._lock = threading.Lock()
        self._old_groups: list[dist.ProcessGroup] = []
        self._served_stores: list[dist.Store] = []
        self._change_began: float | None = None
        #: when the last change began on this rank (``time.monotonic()``; ``None`` before the first)
        self.change_began: float | None = None
        self.control = ControlPlane(rank, list(self.original), store, scope, host, heartbeat_timeout,
                                    timeout=timeout.total_seconds())  # fmt: skip
        self.agreement = Agreement(rank, list(self.original), len(self.original), max_lost,
                                   timeout=max(10.0, 3 * heartbeat_timeout), send=self.control.send,
                                   serve_store=self._serve_store, on_change=self._on_change,
                                   on_adopt=self._on_adopt)  # fmt: skip
        self.control.attach(self.agreement)

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
            lambda: connections_opened_by(create, exclude=self.control.descriptors()), f"forming group {name!r}"
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
            lambda: connections_opened_by(create, exclude=self.control.descriptors()), what
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
    def recover(self) -> Decision:
        """Wait for the survivors' decision and move to its generation: the lost ranks are retired (a later
        message of theirs is refused), the old groups stay fenced, and the next :meth:`group` call forms the new
        generation's groups over the members. Raises :class:`~lightning_dp.comm.errors.QuorumLostError` where the
        job must stop, :class:`~lightning_dp.comm.errors.FencedError` where it went on without this rank."""
        decision = self.agreement.wait()
        began = self._change_began if self._change_began is not None else time.monotonic()
        self.change_began = began
        lost = set(self.members) - set(decision.members)
        with self._lock:
            self._old_groups.extend(self._groups.values())
            self._groups = {}
            self._connections = []
            self.members = decision.members
            self.generation = decision.generation
            self._store = self._served_stores[-1] if decision.members[0] == self.rank else None
            self._store_at = decision.store
            self._store_prefix = f"{self.scope}/gen{decision.generation}"
            self._change_began = None
        self.agreement.activate(decision.generation)
        step = max(decision.committed.values())
        seconds = time.monotonic() - began
        for rank in sorted(lost):
            self.losses.append(Loss(rank, decision.causes.get(rank, "lost"), decision.generation, step, seconds))
        log.warning("rank %d: the job goes on with ranks %s (generation %d) without rank(s) %s",
                    self.rank, list(decision.members), decision.generation, sorted(lost))  # fmt: skip
        return decision

    def _on_adopt(self, decision: Decision) -> None:
        """A decision is adopted (on the control plane's thread): the ranks it leaves out are told so and dropped at
        once, so that nothing they send counts and a late suspicion of them starts no new change."""
        lost = set(decision.lost)
        named = ", ".join(f"rank {r} ({decision.causes.get(r, 'lost')})" for r in sorted(lost))
        self.control.retire(lost, f"declared lost in generation {decision.generation}: {named}")
        self.control.clear(set(decision.members))

    def _on_change(self) -> None:
        """A change began (on the control plane's thread): fence this generation's groups at once."""
        with self._lock:
            if self._change_began is None:
                self._change_began = time.monotonic()
            connections = list(self._connections)
        fence(connections)

    def _serve_store(self) -> tuple[str, int]:
        """Serve the next generation's store on this rank (its leader)."""
        store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self._served_stores = [*self._served_stores[-1:], store]
        return self.host, int(store.port)

    def close(self, farewell: bool = True) -> None:
        """Leave: the control plane closes. With ``farewell`` the others are told this rank finished (no loss);
        without, they see it go as a lost rank (it failed)."""
        self.control.close(farewell)
