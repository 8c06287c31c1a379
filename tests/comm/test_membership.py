"""The membership layer: survivors agree on one new membership and go on; a slow rank is not lost; a fenced one
is refused; a side without a majority stops."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm.errors import FencedError, MembershipChange, QuorumLostError
from lightning_dp.comm.membership import Agreement, Decision, choose_members, quorum_problem
from lightning_dp.comm.membership.control import ControlPlane
from tests.helpers.distributed import run_distributed_allow_deaths


# ---------------------------------------------------------------------------------------------------- the decision
@pytest.mark.unit
def test_members_are_the_reporters_that_all_hear_each_other():
    full = {0, 1, 2, 3}
    assert choose_members({0: full, 1: full, 3: full}) == [0, 1, 3]
    # link 2-3 cut: one of the pair goes (the higher), the rest stay
    assert choose_members({0: full, 1: full, 2: {0, 1, 2}, 3: {0, 1, 3}}) == [0, 1, 2]
    # rank 0 hears nobody
    assert choose_members({0: {0}, 1: {1, 2, 3}, 2: {1, 2, 3}, 3: {1, 2, 3}}) == [0]


@pytest.mark.unit
def test_a_majority_of_the_original_ranks_and_max_lost_decide_whether_the_job_goes_on():
    assert quorum_problem([0, 1, 3], 4, 3, [2]) is None
    assert "not a strict majority" in str(quorum_problem([0, 1], 4, 3, [2, 3]))
    assert "max_lost_ranks=1" in str(quorum_problem([0, 1, 2], 5, 1, [3, 4]))


class _Network:
    """Agreements of ``n`` ranks joined by an in-memory network whose links can be cut."""

    def __init__(self, n: int, max_lost: int | None = None) -> None:
        self.queue: deque[tuple[int, int, dict[str, Any]]] = deque()
        self.cut: set[frozenset[int]] = set()
        self.dead: set[int] = set()
        #: the ranks whose training side was told to leave its exchanges (``on_change``), in order
        self.fenced: list[int] = []
        self.agreements = [
            Agreement(r, list(range(n)), n, n if max_lost is None else max_lost, timeout=5.0,
                      send=self._sender(r), serve_store=lambda r=r: (f"host{r}", 1000 + r),
                      on_change=lambda r=r: self.fenced.append(r))
            for r in range(n)
        ]  # fmt: skip

    def _sender(self, rank: int):
        def send(peer: int, message: dict[str, Any]) -> bool:
            self.queue.append((rank, peer, dict(message)))
            return True

        return send

    def pump(self) -> None:
        while self.queue:
            sender, peer, message = self.queue.popleft()
            if peer in self.dead or sender in self.dead or frozenset((sender, peer)) in self.cut:
                continue
            message["from"] = sender
            self.agreements[peer].receive(message)

    def lose(self, rank: int) -> None:
        """``rank`` dies: every other live rank sees its connection close."""
        self.dead.add(rank)
        for a in self.agreements:
            if a.rank not in self.dead:
                a.suspect(rank, "closed", True)

    def outcome(self, rank: int) -> Decision | BaseException:
        a = self.agreements[rank]
        try:
            return a.wait() if a._decision is not None or a._failure is not None else RuntimeError("undecided")
        except BaseException as error:  # noqa: BLE001
            return error


@pytest.mark.unit
def test_the_survivors_of_a_dead_rank_adopt_one_decision_with_what_each_committed():
    net = _Network(4)
    for r, step in enumerate([7, 7, 6, 7]):
        net.agreements[r].commit(step)
    net.lose(2)
    with pytest.raises(MembershipChange, match="not committed"):
        net.agreements[1].commit(8)  # a step whose exchange completed after the change began does not count
    net.pump()
    decisions = [net.outcome(r) for r in (0, 1, 3)]
    assert all(isinstance(d, Decision) for d in decisions), decisions
    assert len({(d.generation, d.members, d.store) for d in decisions}) == 1  # type: ignore[union-attr]
    d = decisions[0]
    assert d.members == (0, 1, 3) and d.generation == 1 and d.lost == (2,) and d.causes == {2: "closed"}  # type: ignore[union-attr]
    assert d.committed == {0: 7, 1: 7, 3: 7} and d.store == ("host0", 1000)  # type: ignore[union-attr]
    # the training side must activate the new generation before it exchanges again
    with pytest.raises(MembershipChange):
        net.agreements[1].check()
    net.agreements[1].activate(1)
    net.agreements[1].check()


@pytest.mark.unit
def test_a_change_without_a_loss_gives_every_member_a_new_generation_of_the_same_members():
    """A member that saw something outside the membership fail (a dedicated server) asks for a change: every other
    member is told (a planted request that tells nobody leaves rank 1 undecided), and the decision loses no rank."""
    net = _Network(3)
    for r in range(3):
        net.agreements[r].commit(4)
    net.agreements[2].request_change("server 0 lost")
    with pytest.raises(MembershipChange):
        net.agreements[2].commit(5)
    net.pump()
    with pytest.raises(MembershipChange):
        net.agreements[0].commit(5)  # nothing commits until the new generation is active
    decisions = [net.outcome(r) for r in range(3)]
    assert all(isinstance(d, Decision) for d in decisions), decisions
    assert {(d.generation, d.members, d.lost) for d in decisions} == {(1, (0, 1, 2), ())}  # type: ignore[union-attr]
    net.agreements[1].request_change("server 0 lost")  # decided but not active yet: the recovery under way covers it
    net.pump()
    assert net.agreements[1].generation == 1


@pytest.mark.unit
def test_a_leader_lost_during_the_agreement_is_replaced_by_the_next_lowest_rank():
    net = _Network(5)
    net.dead.add(0)  # rank 0 dies right after 2: it never decides, and the reports sent to it are lost
    net.lose(2)
    net.pump()
    net.lose(0)
    net.pump()
    decisions = [net.outcome(r) for r in (1, 3, 4)]
    assert all(isinstance(d, Decision) and d.members == (1, 3, 4) for d in decisions), decisions
    assert decisions[0].store == ("host1", 1001) and set(decisions[0].lost) == {0, 2}  # type: ignore[union-attr]


@pytest.mark.unit
def test_a_leader_lost_after_it_sent_its_decision_is_suspected_at_once_in_the_next_generation():
    net = _Network(5)
    net.lose(2)
    while net.agreements[0].generation == 0:  # up to rank 0's decision, queued but not yet delivered
        sender, peer, message = net.queue.popleft()
        message["from"] = sender
        net.agreements[peer].receive(message)
    for r in (1, 3, 4):  # rank 0 dies now: its connections close before its decision reaches anyone
        net.agreements[r].suspect(0, "closed", True)
    net.pump()  # the decision still arrives (it was on the wire)
    net.dead.add(0)
    net.pump()
    for r in (1, 3, 4):
        first = net.outcome(r)
        assert isinstance(first, Decision) and first.generation in (1, 2), (r, first)
        latest = first if first.generation == 2 else net.outcome(r)
        assert isinstance(latest, Decision) and latest.members == (1, 3, 4) and latest.lost == (0,), (r, latest)


@pytest.mark.unit
def test_a_cut_link_leaves_out_one_end_and_the_rest_go_on():
    net = _Network(4)
    net.cut.add(frozenset((0, 3)))
    net.agreements[0].suspect(3, "silent", True)
    net.agreements[3].suspect(0, "silent", True)
    for r in (1, 2):  # they hear of the suspicions (the control plane passes them on)
        net.agreements[r].suspect(3, "silent at rank 0", False)
    net.pump()
    for r in (0, 1, 2):
        d = net.outcome(r)
        assert isinstance(d, Decision) and d.members == (0, 1, 2) and d.lost == (3,), (r, d)
    assert isinstance(net.outcome(3), RuntimeError)  # undecided: its members fence it (see the process test)
    net.agreements[3].fenced("declared lost in generation 1")
    assert isinstance(net.outcome(3), FencedError)


@pytest.mark.unit
@pytest.mark.parametrize(("side", "goes_on"), [({3}, True), ({2, 3}, False)])
def test_a_partition_goes_on_only_on_its_majority_side(side, goes_on):
    net = _Network(4)
    rest = {0, 1, 2, 3} - side
    net.cut = {frozenset((a, b)) for a in side for b in rest}
    for a in side:
        for b in rest:
            net.agreements[a].suspect(b, "silent", True)
            net.agreements[b].suspect(a, "silent", True)
    net.pump()
    for r in rest:
        outcome = net.outcome(r)
        if goes_on:
            assert isinstance(outcome, Decision) and outcome.members == tuple(sorted(rest))
        else:
            assert isinstance(outcome, QuorumLostError) and "not a strict majority" in str(outcome)
    for r in side:
        outcome = net.outcome(r)
        assert isinstance(outcome, QuorumLostError) and "not a strict majority" in str(outcome), outcome


@pytest.mark.unit
def test_more_losses_than_allowed_stop_every_survivor_naming_them():
    net = _Network(5, max_lost=1)
    net.lose(3)
    net.pump()
    for r in (0, 1, 2, 4):
        net.outcome(r)
        net.agreements[r].activate(1)
    net.lose(4)
    net.pump()
    for r in (0, 1, 2):
        outcome = net.outcome(r)
        assert isinstance(outcome, QuorumLostError) and "max_lost_ranks=1" in str(outcome), outcome
        assert "[3, 4]" in str(outcome)


def _admission(
    lose_during: int | None = None, heard_by: tuple[int, ...] = (0, 1, 3, 4), asking: tuple[int, ...] = (0, 1, 3, 4)
) -> tuple[_Network, Agreement]:
    """Five ranks lose rank 2; a new process for rank 2 (heard by ``heard_by``) asks to join and the members
    ``asking`` ask to admit it at the same point (the others are still in the exchange before it); ``lose_during``: a
    member lost in that change."""
    net = _Network(5)
    net.lose(2)
    net.pump()
    for r in (0, 1, 3, 4):
        net.agreements[r].activate(net.agreements[r].generation)
        net.agreements[r]._candidates = lambda r=r: {2} if r in heard_by else set()  # type: ignore[assignment]
    joiner = Agreement(2, [2], 5, 5, timeout=5.0, send=net._sender(2), serve_store=lambda: ("host2", 1002),
                       on_change=lambda: None, joining=True)  # fmt: skip
    net.dead.discard(2)
    net.agreements[2] = joiner
    net.fenced.clear()
    for r in (0, 1, 3, 4):
        net.agreements[r].commit(9)
    for r in asking:
        net.agreements[r].admit({2})
    if lose_during is not None:
        net.lose(lose_during)
        net.agreements[2].suspect(lose_during, "closed", True)  # (ignored: it is no member yet)
    net.pump()
    return net, joiner


@pytest.mark.unit
def test_a_new_process_every_member_hears_is_admitted_in_a_change_that_loses_no_rank():
    net, joiner = _admission()
    decisions = [net.outcome(r) for r in range(5)]
    assert all(isinstance(d, Decision) for d in decisions), decisions
    assert {(d.generation, d.members, d.joined, d.lost) for d in decisions} == {(2, (0, 1, 2, 3, 4), (2,), ())}  # type: ignore[union-attr]
    assert decisions[0].committed == {0: 9, 1: 9, 3: 9, 4: 9}  # type: ignore[union-attr]  (the new process reports none)
    assert not joiner.joining and joiner.members == (0, 1, 2, 3, 4) and joiner.generation == 2


@pytest.mark.unit
def test_an_admission_leaves_the_exchanges_in_flight_to_complete_and_a_loss_during_it_ends_them():
    """Members still in the exchange before the admission (every member took part in it, so it completes) are not
    made to leave it: their training side would wait on a connection cut under it. A loss during the admission
    makes every survivor leave its exchanges."""
    net, _ = _admission(asking=(0, 1))  # ranks 3 and 4 hear of it from the others, before they ask themselves
    assert {(d.members, d.joined) for d in (net.outcome(r) for r in (0, 1, 3, 4))} == {((0, 1, 2, 3, 4), (2,))}  # type: ignore[union-attr]
    assert net.fenced == []
    net, _ = _admission(lose_during=4)
    assert sorted(net.fenced) == [0, 1, 3]


@pytest.mark.unit
def test_a_new_process_not_heard_by_every_member_or_in_a_change_that_loses_a_rank_is_not_admitted():
    net, joiner = _admission(heard_by=(0, 1, 3))  # rank 4 does not hear it
    assert {(d.members, d.joined) for d in (net.outcome(r) for r in (0, 1, 3, 4))} == {((0, 1, 3, 4), ())}  # type: ignore[union-attr]
    assert joiner.joining and isinstance(net.outcome(2), RuntimeError)  # undecided: it waits
    net, joiner = _admission(lose_during=4)
    assert {(d.members, d.joined, d.lost) for d in (net.outcome(r) for r in (0, 1, 3))} == {((0, 1, 3), (), (4,))}  # type: ignore[union-attr]
    assert joiner.joining


@pytest.mark.unit
def test_max_lost_ranks_counts_from_the_largest_membership_the_job_grew_to():
    """A job started on 2 ranks with max_lost=0 that grew to 4 may not go on without one of them (counted from the 2
    it started with, 3 of 4 would look like a gain)."""
    grown = Agreement(0, [0, 1], 2, 0, timeout=5.0, send=lambda peer, message: True,
                      serve_store=lambda: ("host0", 1000), on_change=lambda: None)  # fmt: skip
    grown.receive({"t": "decision", "gen": 1, "members": [0, 1, 2, 3], "committed": {"0": 5, "1": 5},
                   "store": ["host0", 1000], "lost": [], "joined": [2, 3], "asked": [2, 3]})  # fmt: skip
    grown.activate(grown.wait().generation)
    grown.suspect(1, "closed", True)
    assert isinstance(grown.failure, QuorumLostError) and "max_lost_ranks=0" in str(grown.failure), grown.failure
    assert "([1])" in str(grown.failure)
    # a new process admitted after the job had 4 and lost one counts from the 4 the decision carries (from the 3 it
    # sees, 2 would look like a majority)
    joiner = Agreement(3, [3], 2, 1, timeout=5.0, send=lambda peer, message: True,
                       serve_store=lambda: ("host3", 1003), on_change=lambda: None, joining=True)  # fmt: skip
    joiner.receive({"t": "decision", "gen": 3, "members": [0, 2, 3], "committed": {"0": 9, "2": 9},
                    "store": ["host0", 1000], "lost": [], "joined": [3], "asked": [3], "most": 4})  # fmt: skip
    joiner.activate(joiner.wait().generation)
    joiner.suspect(0, "closed", True)
    assert isinstance(joiner.failure, QuorumLostError) and "job's 4 ranks" in str(joiner.failure), joiner.failure


@pytest.mark.unit
def test_a_side_without_a_majority_of_the_last_generation_stops_even_with_one_of_the_first():
    # a job grown back to four after losing one of three: two against two is no majority of the last generation
    assert "last generation" in str(quorum_problem([0, 1], 3, 3, [2, 3], previous=(0, 1, 2, 3)))
    assert quorum_problem([0, 1, 2], 3, 3, [3], previous=(0, 1, 2, 3)) is None


def _leave(
    net: _Network, leavers: set[int], asking: tuple[int, ...], max_lost: int | None = None
) -> list[Decision | BaseException]:
    """The members ``asking`` let ``leavers`` go at the same point (the others hear of it from them); every rank's
    outcome, in rank order."""
    for a in net.agreements:
        a.commit(6)
    for r in asking:
        net.agreements[r].let_go(leavers)
    net.pump()
    return [net.outcome(r) for r in range(len(net.agreements))]


@pytest.mark.unit
def test_members_let_go_leave_as_left_not_lost_and_the_others_go_on_without_fencing_their_exchanges():
    net = _Network(4)
    outcomes = _leave(net, {1, 3}, asking=(0, 2))
    assert all(isinstance(d, Decision) for d in outcomes), outcomes
    assert {(d.generation, d.members, d.left, d.lost, d.most) for d in outcomes} == {(1, (0, 2), (1, 3), (), 2)}  # type: ignore[union-attr]
    assert outcomes[0].committed == {0: 6, 2: 6}  # type: ignore[union-attr]
    assert net.fenced == []  # (every member asked at the same sync point: the exchanges in flight complete)
    assert [a.left for a in net.agreements] == [None, 1, None, 1]
    net.agreements[1].fenced("declared lost")  # a member's word that it is gone: no failure where it left
    assert net.agreements[1].failure is None
    # the quorum counts from the two that stay: losing one of them is a loss of half, which stops the job
    for r in (0, 2):
        net.agreements[r].activate(1)
    net.lose(2)
    net.pump()
    outcome = net.outcome(0)
    assert isinstance(outcome, QuorumLostError) and "of the last generation's 2 ranks" in str(outcome), outcome


@pytest.mark.unit
def test_leaving_members_are_not_counted_as_lost_by_max_lost_and_a_loss_in_the_same_change_is():
    """Two of five leave with max_lost=1 (were they counted as lost, the change would stop the job); a loss in the same
    change is a loss, counted from the three that stay."""
    net = _Network(5, max_lost=1)
    outcomes = _leave(net, {3, 4}, asking=(0, 1, 2, 3, 4))
    assert {(d.members, d.left, d.lost) for d in outcomes} == {((0, 1, 2), (3, 4), ())}, outcomes  # type: ignore[union-attr]
    net = _Network(5, max_lost=1)
    for a in net.agreements:
        a.commit(6)
    net.lose(2)  # a loss first: the change under way lets them go as well (the leader hears it in a second report)
    for r in (0, 1, 3, 4):
        net.agreements[r].let_go({4})
    net.pump()
    outcomes = [net.outcome(r) for r in (0, 1, 3, 4)]
    assert {(d.members, d.left, d.lost) for d in outcomes} == {((0, 1, 3), (4,), (2,))}, outcomes  # type: ignore[union-attr]
    assert outcomes[0].most == 4  # type: ignore[union-attr]


@pytest.mark.unit
def test_a_leaving_rank_that_would_lead_hands_the_decision_and_the_store_to_the_lowest_that_stays():
    """Rank 0 is lost as rank 1 leaves: rank 2 decides and serves the next generation's store (rank 1's goes with
    it)."""
    net = _Network(4)
    for a in net.agreements:
        a.commit(6)
    net.lose(0)
    for r in (1, 2, 3):
        net.agreements[r].let_go({1})
    net.pump()
    outcomes = [net.outcome(r) for r in (1, 2, 3)]
    assert {(d.members, d.left, d.lost, d.store) for d in outcomes} == {((2, 3), (1,), (0,), ("host2", 1002))}, outcomes  # type: ignore[union-attr]


@pytest.mark.unit
def test_a_member_that_hears_of_a_leave_only_from_the_others_reports_again_to_the_rank_that_stays():
    """Rank 0 dies at the boundary where rank 1 is to leave: rank 3, still recovering from its failed commit, reported
    to rank 1 and never asks for the leave itself; ranks 1 and 2 let rank 1 go, rank 2 leads, and rank 3 reports to it
    again (without, the change would wait for it until its timeout)."""
    net = _Network(4)
    for a in net.agreements:
        a.commit(6)
    net.dead.add(0)
    for r in (1, 2, 3):
        net.agreements[r].suspect(0, "closed", True)
    net.queue = deque(m for m in net.queue if m[0] == 3)  # rank 3's report to rank 1 only
    for r in (1, 2):
        net.agreements[r].let_go({1})
    net.pump()
    outcomes = [net.outcome(r) for r in (1, 2, 3)]
    assert {(d.members, d.left, d.lost) for d in outcomes} == {((2, 3), (1,), (0,))}, outcomes  # type: ignore[union-attr]


@pytest.mark.unit
def test_a_new_process_counts_its_quorum_from_the_members_after_those_that_left():
    """A job of four that let two go admits a new process: it counts from three (the members' count), so losing one
    of them leaves a majority (counted from the four the job started with, it would stop alone)."""
    joiner = Agreement(2, [2], 4, 4, timeout=5.0, send=lambda peer, message: True,
                       serve_store=lambda: ("host2", 1002), on_change=lambda: None, joining=True)  # fmt: skip
    joiner.receive({"t": "decision", "gen": 2, "members": [0, 1, 2], "committed": {"0": 9, "1": 9},
                    "store": ["host0", 1000], "lost": [], "joined": [2], "asked": [2], "most": 3})  # fmt: skip
    joiner.activate(joiner.wait().generation)
    joiner.suspect(1, "closed", True)
    assert joiner.failure is None


@pytest.mark.unit
def test_the_members_find_before_they_deal_it_whether_a_leave_would_break_the_quorum():
    net = _Network(3)
    net.lose(2)
    net.pump()
    for r in (0, 1):
        net.outcome(r)
        net.agreements[r].activate(1)
    problem = net.agreements[0].problem_without({1})
    assert problem is not None and "not a strict majority" in problem, problem
    assert net.agreements[0]._leaving == set()  # (asking changes nothing)
    assert _Network(4).agreements[0].problem_without({3}) is None


def _hello(port: int, **fields: Any) -> dict[str, Any] | None:
    """Dial a control plane on loopback with a hello of ``fields``; its answer (``None``: closed without one)."""
    import json
    import socket
    import struct

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        body = json.dumps({"t": "hello", **fields}).encode()
        sock.sendall(struct.pack("!I", len(body)) + body)
        data = b""
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
            if len(data) >= 4 and len(data) >= 4 + struct.unpack("!I", data[:4])[0]:
                break
    if len(data) < 4:
        return None
    message = json.loads(data[4 : 4 + struct.unpack("!I", data[:4])[0]])
    return None if message.get("t") == "hb" else message


@pytest.mark.unit
def test_a_replacement_is_a_candidate_while_strays_wrong_secrets_and_the_fenced_process_are_refused():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = [master, *(dist.TCPStore("127.0.0.1", master.port, is_master=False) for _ in range(2))]
    planes: list[ControlPlane | None] = [None, None, None]

    def start(rank: int) -> None:
        planes[rank] = ControlPlane(rank, [0, 1, 2], stores[rank], "join", "127.0.0.1", 5.0, timeout=20, proof="p",
                                    places=4)  # fmt: skip

    starters = [threading.Thread(target=start, args=(r,)) for r in range(3)]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    member, lost = planes[0], planes[2]
    assert member is not None and planes[1] is not None and lost is not None
    port = int(stores[0].get("join/control/0").decode().split("/")[0].rsplit(":", 1)[1])
    fenced_incarnation = lost.incarnation
    lost.close(farewell=False)
    for plane in planes[:2]:
        assert plane is not None
        plane.retire({2}, "declared lost in generation 1")
    hello = {"job": "join", "rank": 2, "proof": "p"}
    # the lost process itself, dialing again (even asking to join) is fenced by its incarnation
    answer = _hello(port, **hello, inc=fenced_incarnation, join=True)
    assert answer is not None and answer["t"] == "fenced", answer
    # another job's process, one without the secret, a rank that is no rank of the job, a live member's rank
    assert _hello(port, **{**hello, "job": "other"}, inc="x", join=True) is None
    answer = _hello(port, **{**hello, "proof": "q"}, inc="x", join=True)
    assert answer is not None and answer["t"] == "refused" and "shared secret" in answer["why"], answer
    answer = _hello(port, **{**hello, "rank": 7}, inc="x", join=True)
    assert answer is not None and answer["t"] == "refused" and "places for ranks 0 to 3" in answer["why"], answer
    # a place the job may grow into (max_ranks): heard as a candidate (a heartbeat, no refusal) until it hangs up
    assert _hello(port, **{**hello, "rank": 3}, inc="g", join=True) is None
    deadline = time.monotonic() + 5
    while member.candidates() and time.monotonic() < deadline:
        time.sleep(0.02)
    answer = _hello(port, **{**hello, "rank": 1}, inc="x", join=True)
    assert answer is not None and answer["t"] == "refused" and "live member" in answer["why"], answer
    assert member.candidates() == set()
    # a new process in rank 2's place: a candidate on every member, until they admit it
    store = dist.TCPStore("127.0.0.1", master.port, is_master=False)
    joiner = ControlPlane(2, [0, 1, 2], store, "join", "127.0.0.1", 5.0, timeout=20, proof="p", joining=True)
    joiner.connect_as_joiner([0, 1], store)
    deadline = time.monotonic() + 5
    while not all(p is not None and p.candidates() == {2} for p in planes[:2]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [p.candidates() for p in planes[:2] if p is not None] == [{2}, {2}]
    # what a candidate says is not heard: a suspicion it passes on starts no change among the members
    recorder = _Recorder()
    member.attach(recorder)
    assert joiner.send(0, {"t": "suspect", "rank": 1, "by": 2, "cause": "closed"})
    time.sleep(0.3)
    assert recorder.suspicions == [] and member.suspected == {}
    # a second process for the same rank is refused while the first asks
    answer = _hello(port, **hello, inc="y", join=True)
    assert answer is not None and answer["t"] == "refused" and "another process" in answer["why"], answer
    for plane in planes[:2]:
        assert plane is not None
        plane.admit({2})
        assert plane.candidates() == set() and plane.send(2, {"t": "ping"})
    for plane in (joiner, *planes[:2]):
        assert plane is not None
        plane.close()


class _Recorder:
    """A control plane's handler that records what it is told."""

    def __init__(self) -> None:
        self.suspicions: list[tuple[int, str]] = []

    def suspect(self, peer: int, cause: str, direct: bool) -> None:
        self.suspicions.append((peer, cause))

    def fenced(self, why: str) -> None:
        pass

    def refused(self, error: BaseException) -> None:
        pass

    def receive(self, message: dict[str, Any]) -> None:
        pass

    def tick(self, now: float) -> None:
        pass


@pytest.mark.unit
def test_ranks_that_finish_at_the_same_moment_take_no_one_for_lost():
    """Ranks 0 and 1 leave at once, each saying goodbye, while rank 2 still works: neither takes the other's closing
    connection for a loss, so none passes a suspicion on to rank 2 (which would then start a change with no one left
    to agree), and rank 2 hears both leave as finished."""
    for attempt in range(10):
        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        stores = [master, *(dist.TCPStore("127.0.0.1", master.port, is_master=False) for _ in range(2))]
        planes: list[ControlPlane | None] = [None, None, None]

        def start(rank: int, stores=stores, planes=planes, attempt=attempt) -> None:
            planes[rank] = ControlPlane(rank, [0, 1, 2], stores[rank], f"leave/{attempt}", "127.0.0.1", 5.0,
                                        timeout=20)  # fmt: skip

        starters = [threading.Thread(target=start, args=(r,)) for r in range(3)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        recorders = [_Recorder() for _ in range(3)]
        for plane, recorder in zip(planes, recorders, strict=True):
            assert plane is not None
            plane.attach(recorder)
        closers = [threading.Thread(target=plane.close) for plane in planes[:2] if plane is not None]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
        time.sleep(0.2)  # what rank 2 would hear of them has arrived
        working = planes[2]
        assert working is not None
        assert [r.suspicions for r in recorders] == [[], [], []], f"attempt {attempt}"
        # both left as finished: rank 2 keeps no connection to them (its own listener and waker pair only)
        assert working.suspected == {} and len(working.descriptors()) == 3, f"attempt {attempt}"
        working.close()


@pytest.mark.unit
def test_a_new_process_whose_job_ends_before_it_reaches_a_member_stops_instead_of_dialing_on():
    """A new process dials members that have gone (the job ended as it started): once the job's store is gone too it
    stops with JoinAbandonedError, within a few seconds rather than the strategy's timeout. One for a place the job
    does not have is refused at once."""
    import json
    import socket

    from lightning_dp.comm.errors import ConfigurationError, JoinAbandonedError
    from lightning_dp.comm.membership import Membership
    from lightning_dp.comm.membership.control import endpoint

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with socket.socket() as gone:  # a member's endpoint nobody listens on any more
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]
    master.set("ended/control/0", endpoint("127.0.0.1", port, "x"))
    master.set("directory", json.dumps({"scope": "ended", "generation": 0, "members": [0], "original": [0, 1],
                                        "max_lost": 1, "places": 2}))  # fmt: skip
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False)
    # a process for a place the job does not have (past max_ranks) is refused before it dials anyone
    with pytest.raises(ConfigurationError, match="places for ranks 0 to 1 only.*max_ranks"):
        Membership.join(2, client, "directory", "127.0.0.1", 5.0, timeout=timedelta(seconds=120))
    joining = Membership.join(1, client, "directory", "127.0.0.1", 5.0, timeout=timedelta(seconds=120))
    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            joining.ask_to_join()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001
            outcome.append(error)

    asking = threading.Thread(target=ask)
    started = time.monotonic()
    asking.start()
    time.sleep(1.0)
    del master  # the job's store goes with its last process
    asking.join(timeout=30)
    assert outcome and isinstance(outcome[0], JoinAbandonedError), outcome
    assert time.monotonic() - started < 20
    joining.close(farewell=False)


# ---------------------------------------------------------------------------------------------------- fencing
@pytest.mark.unit
def test_a_group_s_connections_are_told_apart_from_those_another_thread_opens_or_closes_meanwhile():
    """While a group forms, the control plane's thread may close a socket (whose descriptor number a connection of
    the group then takes) and accept another (which is not the group's): the group's connections are found by the
    sockets' identities, and the other thread's are left out, so that a fence ends the group's waits and never a
    control connection."""
    import socket

    from lightning_dp.comm.membership.fence import connections_opened_by, fence

    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    closed_meanwhile = socket.create_connection(address)
    held_by_listener = [listener.accept()[0]]
    reused_number = closed_meanwhile.fileno()
    control: list[socket.socket] = []

    def create() -> list[socket.socket]:
        closed_meanwhile.close()  # (the other thread)
        group = socket.create_connection(address)  # takes the lowest free number: the one just closed
        assert group.fileno() == reused_number
        control.append(socket.create_connection(address))  # (the other thread accepts or dials one)
        return [group]

    (group,), connections = connections_opened_by(create, exclude=lambda: [s.fileno() for s in control])
    held_by_listener.extend(listener.accept()[0] for _ in range(2))  # (the peers' ends, in other processes)
    try:
        assert [c.fd for c in connections] == [group.fileno()]
        fence(connections)
        with pytest.raises(OSError):
            group.sendall(b"x" * (1 << 20))
        control[0].sendall(b"still open")
    finally:
        for sock in [group, *control, *held_by_listener, listener]:
            sock.close()


# ---------------------------------------------------------------------------------------------------- processes
HEARTBEAT = 1.0
#: the faults of the job below, by step: (what, rank)
FAULTS = {5: ("kill", 0), 10: ("pause", 3), 15: ("stop", 4), 25: ("kill", 3)}
SHORT_PAUSE, LONG_STOP = 0.3 * HEARTBEAT, 4 * HEARTBEAT
STEPS = 40


def _through_faults(rank: int, world_size: int) -> dict[str, Any]:
    """Ring all-reduces of ``rank + 1`` over the membership's group, through :data:`FAULTS`: rank 0 killed (it serves
    the default store), rank 3 paused shorter than the heartbeat timeout, rank 4 stopped longer (then resumed: it
    must find itself fenced), rank 3 killed (two of five left: no majority)."""
    from torch.distributed import distributed_c10d

    from lightning_dp.comm.membership import Membership
    from lightning_dp.comm.transports.ring import Ring, ring_allreduce

    pids: list[Any] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    membership = Membership(rank, list(range(world_size)), distributed_c10d._get_default_store(), "test/membership",
                            "127.0.0.1", heartbeat_timeout=HEARTBEAT, max_lost=3)  # fmt: skip
    group = membership.group("gradients")
    sums: list[tuple[int, float, tuple[int, ...]]] = []
    recoveries: list[tuple[int, float, tuple[int, ...]]] = []
    step, fault_at = 0, None
    try:
        while step < STEPS:
            what, victim = FAULTS.get(step, (None, None))
            if what == "kill" and rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            if what in ("pause", "stop") and rank == 1 and fault_at is None:
                os.kill(pids[victim], signal.SIGSTOP)
                fault_at = time.monotonic()
                delay = SHORT_PAUSE if what == "pause" else LONG_STOP
                threading.Timer(delay, os.kill, (pids[victim], signal.SIGCONT)).start()
            started = time.monotonic()
            values = torch.full((50_000,), float(rank + 1))
            try:
                membership.check()
                ring_allreduce(values, group, ring=Ring(group))
                membership.commit(step)
            except Exception as error:  # noqa: BLE001 - what it means is the membership's to say
                change = membership.interpret(error)
                if not isinstance(change, MembershipChange):
                    raise change from error
                decision = membership.recover()
                since = fault_at if fault_at is not None and rank == 1 else started
                recoveries.append((step, time.monotonic() - since, decision.members))
                group = membership.group("gradients")
                continue
            sums.append((step, float(values[0]), membership.members))
            if what in ("pause", "stop"):
                fault_at = None
            step += 1
    except (QuorumLostError, FencedError) as error:
        return {"sums": sums, "recoveries": recoveries, "losses": membership.losses, "end": type(error).__name__,
                "message": str(error)}  # fmt: skip
    return {"sums": sums, "recoveries": recoveries, "losses": membership.losses, "end": "finished"}


@pytest.mark.multiprocess
def test_survivors_go_on_through_kills_and_stops_and_a_side_without_majority_stops():
    results = run_distributed_allow_deaths(_through_faults, 5, timeout=120)
    assert results[0] is None and results[3] is None  # killed
    fenced = results[4]
    assert fenced is not None and fenced["end"] == "FencedError", fenced
    assert "declared lost" in fenced["message"]
    # it took no step after it was stopped (stopped at step 15 of the others, it may not have completed step 14)
    assert [s for s, *_ in fenced["sums"]] == list(range(len(fenced["sums"]))) and len(fenced["sums"]) in (14, 15)

    everyone, after_0, after_4 = 15.0, 14.0, 9.0
    for rank in (1, 2):
        result = results[rank]
        assert result["end"] == "QuorumLostError" and "not a strict majority" in result["message"], result
        steps = [s for s, *_ in result["sums"]]
        assert steps == list(range(25)), steps  # every step once, none after the majority was gone
        expected = [everyone if s < 5 else after_0 if s < 15 else after_4 for s in steps]
        assert [v for _, v, _ in result["sums"]] == expected, result["sums"]
        assert [(loss.rank, loss.cause) for loss in result["losses"]] == [(0, "closed"), (4, "silent")]
        assert [(s, members) for s, _, members in result["recoveries"]] == [(5, (1, 2, 3, 4)), (15, (1, 2, 3))]
    # recovery from a killed process: well within 2 s; from a silent one: within the heartbeat timeout + 2 s of the
    # stop (measured on rank 1, which stopped it)
    assert results[2]["recoveries"][0][1] < 2.0, results[2]["recoveries"]
    assert results[1]["recoveries"][1][1] < HEARTBEAT + 2.0, results[1]["recoveries"]


@pytest.mark.unit
def test_the_leader_keeps_the_directory_where_the_job_s_store_is_served_again():
    """The store the directory was kept in goes with the rank that served it: the leader looks for it served again
    (``reach_store``, every second) and keeps there its members' endpoints and the directory of the generation it
    leads, which a new process then reads (a planted keeper that writes no endpoint, or the old generation, fails)."""
    from lightning_dp.comm.membership import Membership
    from lightning_dp.comm.membership.membership import read_directory

    first = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", first.port, is_master=False, timeout=timedelta(seconds=5))
    served_again: list[dist.Store] = []
    asked: list[float] = []

    def reach() -> dist.Store | None:
        asked.append(time.monotonic())
        return served_again[0] if served_again else None

    membership = Membership(1, [1], client, "kept", "127.0.0.1", 5.0, 0, timeout=timedelta(seconds=30),
                            directory="directory", reach_store=reach)  # fmt: skip
    try:
        deadline = time.monotonic() + 5
        while read_directory(first, "directory") is None:  # (written by the leader's directory thread)
            assert time.monotonic() < deadline, "no directory in the job's store"
            time.sleep(0.05)
        assert read_directory(first, "directory")["members"] == [1]
        del first  # (the store goes with the process that served it)
        membership.request_change("the test")
        assert membership.recover(10).generation == 1  # (the leader publishes the new generation: the store is gone)
        time.sleep(2.5)
        assert len(asked) >= 2  # looked for, again and again
        second = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        served_again.append(dist.TCPStore("127.0.0.1", second.port, is_master=False, timeout=timedelta(seconds=5)))
        deadline = time.monotonic() + 5
        while read_directory(second, "directory") is None:
            assert time.monotonic() < deadline, "the directory was not kept in the store served again"
            time.sleep(0.05)
        record = read_directory(second, "directory")
        assert record["members"] == [1] and record["generation"] == 1, record
        assert second.check(["kept/control/1"]) and second.get("kept/control/1").decode() == membership.control.endpoint
        looked = len(asked)
        time.sleep(1.5)
        assert len(asked) == looked  # found: no longer looked for
    finally:
        membership.close()
