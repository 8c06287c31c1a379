"""Who holds whose replica among dedicated servers, and who serves what after a server's loss."""

from __future__ import annotations

import pytest

from lightning_dp.comm.servers.regroup import replica_holder, serving_after, union_segments
from lightning_dp.comm.servers.replicas import ReplicaLostError

pytestmark = pytest.mark.unit


def test_each_share_has_its_replica_on_a_neighbour():
    assert replica_holder(0, 1) is None
    assert [replica_holder(s, 2) for s in range(2)] == [1, 0]
    assert [replica_holder(s, 4) for s in range(4)] == [1, 2, 3, 2]  # the last one's: the one before it
    for k in range(2, 6):
        assert all(abs(replica_holder(s, k) - s) == 1 for s in range(k))  # type: ignore[operator]


def test_a_lost_servers_share_moves_to_its_replicas_holder():
    everyone = {s: (s,) for s in range(4)}
    assert serving_after(everyone, {1}, 4) == {0: (0,), 2: (1, 2), 3: (3,)}
    assert serving_after(everyone, {3}, 4) == {0: (0,), 1: (1,), 2: (2, 3)}
    assert serving_after(everyone, {0, 2}, 4) == {1: (0, 1), 3: (2, 3)}  # two losses, each replica alive


@pytest.mark.parametrize(
    ("serves", "lost", "k"),
    [
        ({0: (0,)}, {0}, 1),  # a single server has no neighbour
        ({0: (0,), 1: (1,), 2: (2,)}, {0, 1}, 3),  # server 0's replica was on server 1
        ({0: (0, 1)}, {0}, 2),  # server 0 had taken over server 1's share, which had no replica any more
    ],
)
def test_a_share_without_a_live_replica_is_named(serves, lost, k):
    with pytest.raises(ReplicaLostError, match="dedicated server"):
        serving_after(serves, lost, k)


def test_a_server_serving_two_shares_serves_one_range_of_every_bucket():
    segments = [[(0, 10), (10, 20), (20, 30)], [(0, 4), (4, 4), (4, 9)]]  # server 1 serves nothing of bucket 1
    assert union_segments(segments, [(0,), (1, 2)]) == [[(0, 10), (10, 30)], [(0, 4), (4, 9)]]
    assert union_segments(segments, [(0, 1), (2,)]) == [[(0, 20), (20, 30)], [(0, 4), (4, 9)]]
    with pytest.raises(ValueError, match="do not adjoin"):
        union_segments(segments, [(0, 2), (1,)])
