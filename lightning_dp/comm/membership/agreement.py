"""How the survivors of a loss agree on one new membership and on what every member has committed.

One :class:`Agreement` per rank, driven by its control plane's thread (:mod:`.control`): suspicions, the peers'
messages and the clock. A change begins on a rank when it suspects a peer, hears of a suspicion, receives a
report or a decision, or is asked for one that loses no rank (:meth:`Agreement.request_change`): from then on no
step commits there (:meth:`Agreement.commit` refuses), and it sends a report
(the members it still hears, the last step it committed) to its leader, the lowest rank it still hears. A leader
that has the reports of every rank it hears decides:

- the members are the reporters, less one of each pair that cannot hear each other (the higher rank goes), so that
  every member hears every other;
- the job goes on only with a strict majority of its original ranks and of the previous generation's (a minority
  side of a partition never trains on as a second job) and no more ranks lost than the run allows (``max_lost``);
  otherwise every reporter is told to stop, naming the lost ranks;
- a change asked for to admit new processes (:meth:`Agreement.admit`, every member asking for the same ones) admits
  those every reporter hears, unless the change also loses a rank: then it admits nobody (the members deal the
  batches again and may ask once more);
- a change asked for to let members go (:meth:`Agreement.let_go`, every member asking for the same ones) leaves
  them out, as left rather than lost: the quorum and ``max_lost`` count from the ranks that stay;
- the decision (the new generation, the members, what each committed, the store its groups meet on) goes to every
  member. A rank left out is told it is fenced.

A leader that dies in the middle is suspected like any other rank: its reporters report again, to the next lowest.
A rank that is not heard from for ``timeout`` seconds is left out in the same way. Messages carry the generation
they belong to; those of older generations are dropped, newer ones wait until this rank adopts that generation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_dp.comm.errors import FencedError, MembershipChange, QuorumLostError

Send = Callable[[int, dict[str, Any]], bool]
#: the cause of a suspicion where the peer's connection closed (it is gone, not only silent)
CLOSED = "closed"


@dataclass(frozen=True)
class Decision:
    """What the members of a new generation agreed on."""

    generation: int
    members: tuple[int, ...]
    #: the last step each member had committed when the change began
    committed: dict[int, int]
    #: where the new generation's process groups meet (the leader serves it)
    store: tuple[str, int]
    #: members of the previous generation that are not in this one
    lost: tuple[int, ...]
    #: why each lost rank was suspected (as its reporters saw it)
    causes: dict[int, str] = field(default_factory=dict)
    #: members of this generation that were not members of the previous one (admitted new processes)
    joined: tuple[int, ...] = ()
    #: the new processes the change was asked to admit (admitted or not)
    asked: tuple[int, ...] = ()
    #: the most ranks the job has had, this generation's included, less those that left on purpose (a new member
    #: counts its quorum from there)
    most: int = 0
    #: members of the previous generation that left on purpose (:meth:`Agreement.let_go`): not lost, and no longer
    #: counted by the quorum or ``max_lost``
    left: tuple[int, ...] = ()

    def message(self) -> dict[str, Any]:
        return {"t": "decision", "gen": self.generation, "members": list(self.members),
                "committed": {str(k): v for k, v in self.committed.items()}, "store": list(self.store),
                "lost": list(self.lost), "causes": {str(k): v for k, v in self.causes.items()},
                "joined": list(self.joined), "asked": list(self.asked), "most": self.most,
                "left": list(self.left)}  # fmt: skip

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> Decision:
        return cls(
            int(message["gen"]), tuple(int(r) for r in message["members"]),
            {int(k): int(v) for k, v in message["committed"].items()},
            (str(message["store"][0]), int(message["store"][1])), tuple(int(r) for r in message["lost"]),
            {int(k): str(v) for k, v in message.get("causes", {}).items()},
            tuple(int(r) for r in message.get("joined", [])), tuple(int(r) for r in message.get("asked", [])),
            int(message.get("most", 0)), tuple(int(r) for r in message.get("left", [])),
        )  # fmt: skip


def choose_members(views: dict[int, set[int]]) -> list[int]:
    """The members of the next generation from each reporter's view (the ranks it hears, itself included): the
    reporters, less the higher rank of every pair where one does not hear the other."""
    members = sorted(views)
    for a in sorted(views):
        for b in sorted(views):
            if a < b and a in members and b in members and (b not in views[a] or a not in views[b]):
                members.remove(b)
    return members


def quorum_problem(
    members: list[int], original: int, max_lost: int, lost: list[int], previous: tuple[int, ...] = ()
) -> str | None:
    """Why ``members`` may not go on as the job (``None``: they may); ``previous``: the last generation's members."""
    kept = [r for r in members if r in previous]
    if previous and 2 * len(kept) <= len(previous):
        return (
            f"only {len(kept)} of the last generation's {len(previous)} ranks ({kept}) can reach each other, not a "
            f"strict majority: this side of the partition stops (ranks out of reach: {lost}), so that no two sides "
            "train on as two jobs"
        )
    if 2 * len(members) <= original:
        return (
            f"only {len(members)} of the job's {original} ranks ({members}) can reach each other, not a strict "
            f"majority: this side of the partition stops (ranks out of reach: {lost}), so that no two sides train on "
            "as two jobs"
        )
    if original - len(members) > max_lost:
        return (
            f"{original - len(members)} of the job's {original} ranks are lost ({lost}), more than the run allows "
            f"(max_lost_ranks={max_lost})"
        )
    return None


class Agreement:
    """The agreement state of rank ``rank`` (see the module docstring). ``send(peer, message)`` queues a message on
    the control plane; ``serve_store()`` starts a store for the next generation's groups on this rank and returns
    its ``(host, port)``; ``on_change()`` runs (on the control plane's thread) when the training side must leave its
    exchanges at once: a change that may lose a rank began here (not one that only admits new processes: every
    member asks for it at the same sync point, and an exchange in flight completes, since every member took part in
    it), or the agreement failed; ``on_adopt(decision)`` when this rank adopts a decision (both under the agreement's
    lock: keep them short); ``candidates()`` names the new processes this rank hears that ask to join,
    ``connected(peer)`` whether it is connected to ``peer``. With ``joining`` this is such a process: a member of
    nothing until it adopts the first decision that admits it."""

    def __init__(
        self,
        rank: int,
        members: list[int],
        original: int,
        max_lost: int,
        timeout: float,
        send: Send,
        serve_store: Callable[[], tuple[str, int]],
        on_change: Callable[[], None],
        on_adopt: Callable[[Decision], None] = lambda decision: None,
        candidates: Callable[[], set[int]] = set,
        joining: bool = False,
        connected: Callable[[int], bool] = lambda peer: True,
    ) -> None:
        self.rank = rank
        self.generation = 0
        self.members = tuple(sorted(members))
        self._candidates = candidates
        self._connected = connected
        #: waiting to be admitted (see ``joining``)
        self.joining = joining
        #: the new processes the training side asked to admit in the change under way
        self._admitting: set[int] = set()
        #: the members the training side asked to let go in the change under way
        self._leaving: set[int] = set()
        #: the generation whose decision let this rank go (``None``: a member, or waiting to be one)
        self.left: int | None = None
        self.original = original
        #: every rank that has been a member here (the ranks a quorum problem names as lost are those not heard now)
        self._ever = set(self.members)
        #: the most ranks the job has had (it may grow past ``original`` with new processes): the quorum and
        #: ``max_lost`` count from there
        self._most = original
        self.max_lost = max_lost
        self.timeout = timeout
        self._send = send
        self._serve_store = serve_store
        self._on_change = on_change
        self._on_adopt = on_adopt
        self._cond = threading.Condition()
        #: the generation whose process groups the training side uses (see :meth:`activate`)
        self.active = 0
        #: the progress this rank reports (the caller's count of what it completed, see :meth:`commit`)
        self.committed = 0
        self._changing_since: float | None = None
        #: whether the change under way has had the training side leave its exchanges (``on_change``)
        self._fenced = False
        #: when the change that led to each generation adopted here began (``time.monotonic()``)
        self.began_at: dict[int, float] = {}
        self._suspected: dict[int, str] = {}
        self._reported_to: int | None = None
        self._reports: dict[int, dict[str, Any]] = {}
        self._later: list[dict[str, Any]] = []
        self._decision: Decision | None = None
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ the training side
    @property
    def changing(self) -> bool:
        """Whether the training side must stop exchanging: a change has begun, failed, or was decided and the
        training side has not activated the new generation yet."""
        with self._cond:
            return self._stale()

    def _stale(self) -> bool:
        return self._changing_since is not None or self._failure is not None or self.generation != self.active

    @property
    def failure(self) -> BaseException | None:
        """Why the job cannot go on (the quorum lost, this rank fenced), once it is so."""
        with self._cond:
            return self._failure

    def commit(self, step: int) -> None:
        """Record that this rank has completed ``step`` (its exchange done, its update about to apply), or raise
        :class:`MembershipChange` if a change has begun: then the step does not count, on this rank, as committed."""
        with self._cond:
            if self._failure is not None:
                raise self._failure
            if self._stale():
                raise MembershipChange(f"rank {self.rank}: the membership is changing; step {step} is not committed")
            self.committed = step

    def check(self) -> None:
        """Raise :class:`MembershipChange` (or the agreement's failure) if the training side must stop exchanging."""
        with self._cond:
            if self._failure is not None:
                raise self._failure
            if self._stale():
                raise MembershipChange(f"rank {self.rank}: the membership is changing")

    def activate(self, generation: int) -> None:
        """The training side uses ``generation``'s process groups from now on."""
        with self._cond:
            self.active = generation

    def wait(self, timeout: float | None = None) -> Decision:
        """Block until the change under way is decided; the decision, or the agreement's failure raised
        (:class:`TimeoutError` after ``timeout`` seconds, if given)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._decision is not None or self._failure is not None, timeout):
                raise TimeoutError(f"rank {self.rank}: no decision within {timeout} s")
            if self._failure is not None:
                raise self._failure
            assert self._decision is not None
            decision, self._decision = self._decision, None
            return decision

    # ------------------------------------------------------------------ events (the control plane's thread)
    def suspect(self, peer: int, cause: str, direct: bool) -> None:
        """This rank suspects ``peer`` (``direct``), or heard that another rank does."""
        with self._cond:
            if self.joining or self.left is not None or peer == self.rank or peer not in self.members:
                return
            if direct:
                self._suspected.setdefault(peer, cause)
            self._begin(fence=True)
            self._progress()

    def request_change(self, why: str) -> None:
        """Begin a change that loses no rank (something outside the membership changed, a dedicated server was
        lost): every member is told, reports, and the leader decides a new generation of the members that hear each
        other. Nothing happens where a change is under way or the last one is not active yet."""
        with self._cond:
            if self._stale():
                return
            self._begin(fence=True)
            for peer in self._view():
                if peer != self.rank:
                    self._send(peer, {"t": "change", "gen": self.generation, "why": why})
            self._progress()

    def admit(self, ranks: set[int]) -> None:
        """Begin a change that admits the new processes ``ranks`` (every member asks for the same ones, at the same
        sync point): they join if every member hears them and no rank is lost in the change. Nothing happens where a
        decision is not taken up yet."""
        with self._cond:
            if self._failure is not None or self.generation != self.active:
                return
            self._admitting |= set(ranks)
            if self._changing_since is None:
                self._begin(fence=False)
                for peer in self._view():
                    if peer != self.rank:
                        self._send(peer, {"t": "change", "gen": self.generation, "admit": sorted(ranks)})
            self._progress()

    def let_go(self, ranks: set[int]) -> None:
        """Begin a change that lets the members ``ranks`` go (every member asks for the same ones, at the same sync
        point): the decision names them as left, not lost, and the quorum and ``max_lost`` count from the ranks that
        stay. Nothing happens where a decision is not taken up yet."""
        with self._cond:
            if self._failure is not None or self.generation != self.active or self.left is not None:
                return
            new = set(ranks) - self._leaving
            self._leaving |= set(ranks)
            if self._changing_since is None:
                self._begin(fence=False)
            if new:  # every member hears of them, also in a change a loss began (the leader may now be another)
                for peer in self._view():
                    if peer != self.rank:
                        self._send(peer, {"t": "change", "gen": self.generation, "leave": sorted(ranks)})
                self._reported_to = None
            self._progress()

    def problem_without(self, ranks: set[int]) -> str | None:
        """Why the members could not go on without ``ranks`` if they left now (``None``: they could)."""
        with self._cond:
            leaving, self._leaving = self._leaving, self._leaving | set(ranks)
            try:
                return self._quorum_problem([r for r in self.members if r not in ranks])
            finally:
                self._leaving = leaving

    def refused(self, error: BaseException) -> None:
        """A member refused this process's connection: it does not join."""
        with self._cond:
            self._fail(error)

    def fenced(self, why: str) -> None:
        """A member says the job went on without this rank."""
        with self._cond:
            if self.left is not None:  # (it left: a member's word that it is gone is no failure)
                return
            self._fail(FencedError(f"rank {self.rank} was declared lost by the job and is no longer a member ({why})"))

    def receive(self, message: dict[str, Any]) -> None:
        """An agreement message from a peer."""
        with self._cond:
            self._receive(message)

    def tick(self, now: float) -> None:
        """The clock: a change that takes longer than ``timeout`` fails."""
        with self._cond:
            if self._changing_since is None or self._failure is not None:
                return
            if now - self._changing_since > self.timeout:
                silent = sorted(set(self._view()) - set(self._reports)) if self._leader() == self.rank else []
                detail = f"; no report from rank(s) {silent}" if silent else f"; no decision from rank {self._leader()}"
                self._fail(QuorumLostError(
                    f"rank {self.rank}: the ranks did not agree on a new membership within {self.timeout:.0f} s of "
                    f"the loss of rank(s) {sorted(self._suspected)}{detail}"
                ))  # fmt: skip

    # ------------------------------------------------------------------ internals (under the condition's lock)
    def _begin(self, fence: bool) -> None:
        """A change begins here, or goes on; with ``fence`` the training side leaves its exchanges now (once per
        change: a loss that follows an admission's start fences then)."""
        if self._failure is not None:
            return
        if self._changing_since is None:
            self._changing_since = time.monotonic()
            self._fenced = False
        if fence and not self._fenced:
            self._fenced = True
            self._on_change()

    def _view(self) -> list[int]:
        return [r for r in self.members if r not in self._suspected]

    def _leader(self) -> int:
        """The lowest rank heard that stays (it serves the next generation's store)."""
        view = self._view()
        return min([r for r in view if r not in self._leaving] or view)

    def _quorum_problem(self, members: list[int]) -> str | None:
        """Why ``members`` may not go on as the job, counting neither the members that leave in this change among
        the ranks it has nor among those it lost."""
        leaving = self._leaving & set(self.members)
        staying = [r for r in members if r not in leaving]
        return quorum_problem(staying, self._most - len(leaving), self.max_lost,
                              sorted(self._ever - set(staying) - leaving),
                              tuple(r for r in self.members if r not in leaving))  # fmt: skip

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
            self._on_change()
            self._cond.notify_all()

    def _progress(self) -> None:
        """Report to the leader (again, where it changed); decide where this rank leads and has every report."""
        if self._failure is not None or self._changing_since is None:
            return
        view = self._view()
        problem = self._quorum_problem(view)
        if problem is not None:
            self._fail(QuorumLostError(f"rank {self.rank}: {problem}"))
            return
        leader = self._leader()
        report = {"t": "report", "gen": self.generation, "rank": self.rank, "view": view,
                  "committed": self.committed, "causes": {str(k): v for k, v in self._suspected.items()},
                  "hears": sorted(self._candidates()), "admit": sorted(self._admitting),
                  "leave": sorted(self._leaving)}  # fmt: skip
        if leader == self.rank:
            self._reports[self.rank] = report
            self._reported_to = self.rank
            self._decide()  # (once every rank this one hears has reported)
        elif self._reported_to != leader:
            self._reported_to = leader
            self._send(leader, report)

    def _decide(self) -> None:
        view = self._view()
        if not set(view) <= set(self._reports):
            return
        reports = {r: self._reports[r] for r in view}
        # members that leave on purpose are left, whether they reported or went already
        left = sorted(self._leaving & set(self.members))
        members = choose_members({r: set(m["view"]) for r, m in reports.items() if r not in left})
        lost = sorted(set(self.members) - set(members) - set(left))
        problem = self._quorum_problem(members)
        if problem is not None:
            for peer in reports:
                if peer != self.rank:
                    self._send(peer, {"t": "stop", "gen": self.generation, "why": problem})
            self._fail(QuorumLostError(f"decided by rank {self.rank}: {problem}"))
            return
        causes: dict[int, str] = {}
        for m in reports.values():
            causes.update({int(k): v for k, v in m["causes"].items() if int(k) in lost})
        for r in lost:
            causes.setdefault(r, "cannot reach every member")
        # new processes join a change that loses no rank, where every member hears them
        heard = [set(m.get("hears", ())) for m in reports.values()]
        joined = [] if lost else sorted(r for r in self._admitting if all(r in h for h in heard))
        committed = {r: int(reports[r]["committed"]) for r in members}
        grown = tuple(sorted(members + joined))
        decision = Decision(self.generation + 1, grown, committed, self._serve_store(), tuple(lost), causes,
                            tuple(joined), tuple(sorted(self._admitting)), max(self._most - len(left), len(grown)),
                            tuple(left))  # fmt: skip
        for peer in [*reports, *joined]:
            if peer != self.rank:
                self._send(peer, decision.message())
        self._adopt(decision)

    def _adopt(self, decision: Decision) -> None:
        if self.rank in decision.left:  # it goes: the training side takes the decision and closes
            self.left = decision.generation
            self.generation = decision.generation
            self.began_at[decision.generation] = self._changing_since or time.monotonic()
            self._changing_since = None
            self._decision = decision
            self._cond.notify_all()
            return
        if self.rank not in decision.members:
            self._fail(FencedError(
                f"rank {self.rank} was left out of the job's generation {decision.generation} (members "
                f"{list(decision.members)}): it could not reach every member"
            ))  # fmt: skip
            return
        if self.joining:  # it stands where the members stand (what it reports if a change follows)
            self.committed = max(decision.committed.values(), default=0)
        self.generation = decision.generation
        self.members = decision.members
        if self.joining:  # (it counts from the job's largest membership, less the members that left, as they do)
            self._most = max(len(decision.members), decision.most)
        else:
            self._most = max(self._most - len(decision.left), len(decision.members), decision.most)
        self._ever = (self._ever - set(decision.left)) | set(decision.members)
        self.began_at[decision.generation] = self._changing_since or time.monotonic()
        self.joining = False
        self._admitting = set()
        self._leaving = set()
        self._on_adopt(decision)
        # a member whose connection to this rank closed already (its leader, lost after it sent the decision; a new
        # process admitted that went in the meantime) stays suspected: the next change starts now, not after a
        # heartbeat's silence (a silence may have ended since)
        carried = {r: cause for r, cause in self._suspected.items() if r in decision.members and cause == CLOSED}
        carried |= {r: CLOSED for r in decision.joined if r != self.rank and not self._connected(r)}
        self._suspected.clear()
        self._reports.clear()
        self._reported_to = None
        self._changing_since = None
        self._fenced = False
        self._decision = decision
        self._cond.notify_all()
        later, self._later = self._later, []
        for message in later:
            self._receive(message)
        for peer, cause in carried.items():
            if self._failure is None and peer in self.members:
                self._suspected.setdefault(peer, cause)
                self._begin(fence=True)
                self._progress()

    def _receive(self, message: dict[str, Any]) -> None:
        if self._failure is not None or self.left is not None:
            return
        generation = int(message.get("gen", -1))
        if self.joining:  # a process waiting to join hears of one thing only: the decision that admits it
            if message.get("t") == "decision" and self.rank in message.get("joined", []):
                self._begin(fence=False)  # (it has no exchange yet)
                self._adopt(Decision.from_message(message))
            return
        if generation > self.generation + (1 if message.get("t") == "decision" else 0):
            self._later.append(message)
            return
        kind = message.get("t")
        if kind == "decision" and generation == self.generation + 1:
            self._begin(fence=bool(message.get("lost")))
            decision = Decision.from_message(message)
            # passed on to every other member: if the leader died while sending it, no member is left without it
            for peer in (*decision.members, *decision.left):
                if peer not in (self.rank, message.get("from")):
                    self._send(peer, decision.message())
            self._adopt(decision)
        elif kind in ("change", "report") and generation == self.generation:
            admitting = {int(r) for r in message.get("admit", [])}
            leaving = {int(r) for r in message.get("leave", [])}
            self._admitting |= admitting
            if leaving - self._leaving:  # (the leader may be another: the report goes again)
                self._reported_to = None
            self._leaving |= leaving
            if kind == "report":
                self._reports[int(message["rank"])] = message
            # a change that only admits new processes or lets members go leaves the exchanges in flight to complete
            # (every member asked for it at the same sync point); one that a member asked for otherwise, or whose
            # report suspects a rank, may lose one
            self._begin(fence=not (admitting or leaving) or bool(message.get("causes")))
            self._progress()
        elif kind == "stop" and generation == self.generation:
            self._fail(QuorumLostError(f"rank {self.rank}, told by rank {message.get('from')}: {message['why']}"))
