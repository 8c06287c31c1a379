"""Who holds whose replica among dedicated servers, and who serves what after a server's loss."""

from __future__ import annotations

import itertools
import json

import pytest
import torch.distributed as dist

from lightning_dp.comm.servers.regroup import (
    LOST,
    SERVING,
    Regroup,
    claim_return,
    replica_holders,
    replicas_to_make,
    returning_address,
    serving_after,
    serving_back,
    state_key,
    union_segments,
)
from lightning_dp.comm.servers.replicas import ReplicaLostError
from tests.helpers.distributed import free_port

pytestmark = pytest.mark.unit


def test_each_servers_shares_have_their_replicas_on_a_neighbour():
    assert replica_holders((0,)) == {}
    assert replica_holders((0, 1)) == {0: 1, 1: 0}
    assert replica_holders(range(4)) == {0: 1, 1: 2, 2: 3, 3: 2}  # the last one's: the one before it
    assert replica_holders((0, 2, 3)) == {0: 2, 2: 3, 3: 2}  # over the servers serving now
    for k in range(2, 6):
        assert all(abs(holder - s) == 1 for s, holder in replica_holders(range(k)).items())


def test_a_lost_servers_shares_move_to_their_replicas_holder():
    everyone = {s: (s,) for s in range(4)}
    assert serving_after(everyone, {1}) == {0: (0,), 2: (1, 2), 3: (3,)}
    assert serving_after(everyone, {3}) == {0: (0,), 1: (1,), 2: (2, 3)}
    assert serving_after(everyone, {0, 2}) == {1: (0, 1), 3: (2, 3)}  # two losses, each replica alive
    assert serving_after({0: (0,), 2: (1, 2)}, {2}) == {0: (0, 1, 2)}  # shares taken over, then replicated again


@pytest.mark.parametrize(
    ("serves", "lost", "unreplicated"),
    [
        ({0: (0,)}, {0}, ()),  # a single server has no neighbour
        ({0: (0,), 1: (1,), 2: (2,)}, {0, 1}, ()),  # server 0's replica was on server 1
        ({0: (0,), 2: (1, 2)}, {2}, (1,)),  # share 1's replica on server 0 not confirmed made yet
    ],
)
def test_a_share_without_a_live_replica_is_named(serves, lost, unreplicated):
    with pytest.raises(ReplicaLostError, match="dedicated server"):
        serving_after(serves, lost, unreplicated)


def test_the_replicas_a_loss_leaves_missing_are_made_again_on_the_new_neighbour():
    everyone = {s: (s,) for s in range(3)}  # replicas: 0's on 1, 1's on 2, 2's on 1
    # server 1 lost: server 2 serves 1 and 2, their replicas go to server 0; share 0's was on server 1
    assert replicas_to_make(everyone, serving_after(everyone, {1})) == {0: (1, 2), 2: (0,)}
    # server 0 lost: server 1 serves 0 and 1 (their replicas to server 2, which holds 1's already); 2's stays on 1
    assert replicas_to_make(everyone, serving_after(everyone, {0})) == {2: (0,)}
    assert replicas_to_make(everyone, everyone) == {}  # a trainer lost: every replica stays where it is
    assert replicas_to_make({0: (0,), 1: (1,)}, {0: (0, 1)}) == {}  # one server left: no replica to make


def test_a_server_serving_two_shares_serves_one_range_of_every_bucket():
    segments = [[(0, 10), (10, 20), (20, 30)], [(0, 4), (4, 4), (4, 9)]]  # server 1 serves nothing of bucket 1
    assert union_segments(segments, [(0,), (1, 2)]) == [[(0, 10), (10, 30)], [(0, 4), (4, 9)]]
    assert union_segments(segments, [(0, 1), (2,)]) == [[(0, 20), (20, 30)], [(0, 4), (4, 9)]]
    with pytest.raises(ValueError, match="do not adjoin"):
        union_segments(segments, [(0, 2), (1,)])


def test_a_server_started_again_takes_back_its_share_and_those_on_its_side():
    """Every server keeps one contiguous run of shares (adjoining ranges of every bucket), its own among them; the
    giver keeps its copy as the replica where it holds the returning server's replicas, so no replica is made of it
    (planted: a giver that keeps nothing makes share 1's replica missing)."""
    assert serving_back({0: (0,), 2: (1, 2)}, 1) == ({0: (0,), 1: (1,), 2: (2,)}, 2)
    assert serving_back({0: (0, 1, 2)}, 2) == ({0: (0, 1), 2: (2,)}, 0)
    assert serving_back({0: (0, 1), 2: (2,)}, 1) == ({0: (0,), 1: (1,), 2: (2,)}, 0)
    assert serving_back({0: (0,), 3: (1, 2, 3)}, 1) == ({0: (0,), 1: (1,), 3: (2, 3)}, 3)
    with pytest.raises(ValueError, match="serves already"):
        serving_back({0: (0,), 1: (1,)}, 1)
    before, after = {0: (0,), 2: (1, 2)}, {0: (0,), 1: (1,), 2: (2,)}
    assert replicas_to_make(before, after, [(1, 2, 1)]) == {1: (0, 2)}
    assert replicas_to_make(before, after) == {1: (0, 2), 2: (1,)}
    message = Regroup(3, 2, (0, 1, 2), ((0,), (1,), (2,)), ("127.0.0.1", 1), "p", "run", ((1, 2, 1),))
    assert Regroup.decode(json.loads(message.encode()[4:])) == message


def test_a_process_started_again_claims_a_lost_servers_place_once():
    """It waits while the server serves (refused after its timeout), claims the place once the leader marked it lost,
    and a second process for the same place is refused at once."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    with pytest.raises(TimeoutError, match="was not lost"):
        claim_return(store, 1, ("127.0.0.1", 5), wait_seconds=0.5)
    assert returning_address(store, 1) is None
    store.set(state_key(1), LOST)
    claim_return(store, 1, ("127.0.0.1", 5), wait_seconds=5)
    assert returning_address(store, 1) == ("127.0.0.1", 5)
    with pytest.raises(RuntimeError, match="another process started for dedicated server 1 is joining"):
        claim_return(store, 1, ("127.0.0.1", 6), wait_seconds=30)  # (at once, not after its wait)
    assert returning_address(store, 1) == ("127.0.0.1", 5)
    store.set(state_key(1), SERVING)  # let in: a process started now waits for its loss
    with pytest.raises(TimeoutError, match="was not lost"):
        claim_return(store, 1, ("127.0.0.1", 6), wait_seconds=0.5)


def test_every_sequence_of_losses_and_returns_keeps_each_servers_shares_adjoining():
    """Four servers, any two lost in turn (each while the others serve) and both started again in either order:
    every server serves its own share and one contiguous run of shares, every share is served once, and the
    ranges of every bucket adjoin (:func:`union_segments` accepts them); a server lost again at once, before its
    shares' new replicas are made, leaves no share without a live copy."""
    segments = [[(10 * s, 10 * s + 10) for s in range(4)]]
    for first, second in itertools.permutations(range(4), 2):
        for back in itertools.permutations((first, second)):
            serves = serving_after(serving_after({s: (s,) for s in range(4)}, {first}), {second})
            for server in back:
                before = serves
                serves, giver = serving_back(serves, server)
                assert giver != server and server in serves[server]
                # lost again before any server answered after its return: its shares go to its replicas' holder,
                # which holds them already (the giver's copy, or its replica of the giver's shares)
                handed = [(share, giver, server) for share in serves[server]]
                made = replicas_to_make(before, serves, handed)
                serving_after(serves, {server}, {share for shares in made.values() for share in shares})
                for s, shares in serves.items():
                    assert s in shares and list(shares) == list(range(shares[0], shares[-1] + 1)), serves
                assert sorted(x for shares in serves.values() for x in shares) == [0, 1, 2, 3]
                union_segments(segments, [serves[s] for s in sorted(serves)])
            assert serves == {s: (s,) for s in range(4)}
