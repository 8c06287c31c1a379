"""Throughput-balanced batches: shares, the sampler against DistributedSampler, decisions, the gradient weight."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from lightning_dp.comm.balance import (
    BalancedBatchSampler,
    Decision,
    ThroughputBalancer,
    apportion,
    deal,
    gradient_weight,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "total, weights, expected",
    [
        (128, [1, 1, 1, 1], [32, 32, 32, 32]),
        (128, [1, 2, 2, 2], [19, 37, 36, 36]),  # 18.29 + 36.57 x 3 at least 1 each: remainders 0.29, .57, .57, .57
        (10, [1, 1, 1], [4, 3, 3]),
        (4, [100, 1, 1, 1], [1, 1, 1, 1]),  # every rank keeps one sample
        (7, [0.5, 0.5], [4, 3]),
    ],
)
def test_apportion(total, weights, expected):
    shares = apportion(total, weights)
    assert shares == expected and sum(shares) == total


def test_apportion_is_proportional_within_one():
    weights = [0.3, 1.7, 2.2, 5.0, 0.01]
    shares = apportion(1000, weights)
    spare = 1000 - len(weights)
    for share, w in zip(shares, weights, strict=True):
        assert abs(share - 1 - spare * w / sum(weights)) < 1


@pytest.mark.parametrize("total, weights", [(3, [1, 1, 1, 1]), (8, [1, 0]), (8, [1, float("inf")])])
def test_apportion_refuses(total, weights):
    with pytest.raises(ValueError):
        apportion(total, weights)


def test_deal_equal_shares_is_strided():
    owners = deal([3, 3, 3])
    assert owners == [0, 1, 2] * 3


def test_deal_gives_each_rank_its_share():
    shares = [1, 5, 2, 4]
    owners = deal(shares)
    assert [owners.count(r) for r in range(4)] == shares and len(owners) == sum(shares)


@pytest.mark.parametrize("length", [100, 97, 7, 130])
@pytest.mark.parametrize("drop_last_sampler", [False, True])
@pytest.mark.parametrize("drop_last_batches", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_equal_shares_give_the_distributed_samplers_batches(length, drop_last_sampler, drop_last_batches, shuffle):
    dataset = TensorDataset(torch.arange(length))
    n, b = 3, 8
    balancer = ThroughputBalancer(n, n * b)
    for rank in range(n):
        expected_sampler = DistributedSampler(dataset, n, rank, shuffle=shuffle, seed=5, drop_last=drop_last_sampler)
        expected_sampler.set_epoch(2)
        expected = list(BatchSampler(expected_sampler, b, drop_last_batches))
        base = DistributedSampler(dataset, n, rank, shuffle=shuffle, seed=5, drop_last=drop_last_sampler)
        sampler = BalancedBatchSampler(base, b, drop_last_batches, balancer, rank)
        sampler.set_epoch(2)
        got = list(sampler)
        assert got == expected and len(sampler) == len(expected)
        resumed = BalancedBatchSampler(base, b, drop_last_batches, balancer, rank, skip=2, skip_epoch=2)
        resumed.set_epoch(2)
        assert list(resumed) == expected[2:] and list(resumed) == expected  # the skip holds for one iteration
        other_epoch = BalancedBatchSampler(base, b, drop_last_batches, balancer, rank, skip=2, skip_epoch=1)
        other_epoch.set_epoch(2)
        assert list(other_epoch) == expected  # a skip is of its own epoch only


def test_unequal_shares_split_the_same_global_batches():
    dataset = TensorDataset(torch.arange(203))
    n, b = 4, 16
    balancer = ThroughputBalancer(n, n * b)
    balancer.decisions.append(Decision((0, 3), (10, 18, 18, 18)))
    equal = ThroughputBalancer(n, n * b)
    batches = {}
    reference = {}
    for rank in range(n):
        base = DistributedSampler(dataset, n, rank, shuffle=True, seed=0)
        batches[rank] = list(BalancedBatchSampler(base, b, False, balancer, rank))
        reference[rank] = list(BalancedBatchSampler(base, b, False, equal, rank))
    steps = len(batches[0])
    assert steps == 4 and all(len(batches[r]) == steps for r in range(n))
    for j in range(steps):
        union = sorted(i for r in range(n) for i in batches[r][j])
        assert union == sorted(i for r in range(n) for i in reference[r][j])  # the same global batch
        sizes = [len(batches[r][j]) for r in range(n)]
        if j < 3:
            assert sizes == [16] * 4
        else:  # the last batch is partial: 203 padded to 204 = 3 x 64 + 12, the shares scaled to 12
            assert sum(sizes) == 12 and sizes == apportion(12, [10, 18, 18, 18])
    assert balancer.drawn[(0, 3)] == (len(batches[3][3]), 12)


def test_equal_speeds_keep_the_shares():
    balancer = ThroughputBalancer(4, 128, interval=2)
    assert balancer.decide([(1.0, 64.0), (1.05, 64.0), (0.97, 64.0), (1.0, 64.0)], (0, 10)) is None
    assert balancer.shares == (32, 32, 32, 32)


def test_a_slow_rank_gets_less_gradually_towards_its_speed():
    balancer = ThroughputBalancer(4, 128, interval=2, gain=0.5, lag=3)
    speeds = [1.0, 2.0, 2.0, 2.0]
    for step in range(12):
        shares = balancer.shares
        balancer.decide([(n / v, float(n)) for n, v in zip(shares, speeds, strict=True)], (0, 10 * step))
    target = [128 * v / sum(speeds) for v in speeds]
    first = balancer.decisions[1]
    assert first.start == (0, 3) and first.shares == tuple(apportion(128, [32 + 0.5 * (t - 32) for t in target]))
    step = max(n / v for n, v in zip(balancer.shares, speeds, strict=True))
    assert step <= 1.1 * 128 / sum(speeds)  # settled within the tolerance of the balanced step
    assert balancer.shares[0] < 128 * 1.1 / sum(speeds) < 32
    before = len(balancer.decisions)
    shares = balancer.shares
    assert balancer.decide([(n / v, float(n)) for n, v in zip(shares, speeds, strict=True)], (5, 0)) is None  # settled
    assert len(balancer.decisions) == before


def test_shares_follow_the_schedule():
    balancer = ThroughputBalancer(2, 10)
    balancer.decisions += [Decision((0, 5), (3, 7)), Decision((2, 1), (4, 6))]
    assert balancer.shares_at((0, 4)) == (5, 5)
    assert balancer.shares_at((0, 5)) == (3, 7) and balancer.shares_at((1, 0)) == (3, 7)
    assert balancer.shares_at((2, 1)) == (4, 6) and balancer.shares == (4, 6)


def test_a_decision_for_a_batch_already_drawn_is_refused():
    balancer = ThroughputBalancer(2, 10, lag=2)
    balancer.note_drawn((0, 7), 5, 10)
    with pytest.raises(RuntimeError, match="prefetching runs deeper"):
        balancer.decide([(1.0, 5.0), (2.0, 5.0)], (0, 5))


def test_state_round_trip_and_mismatch():
    balancer = ThroughputBalancer(3, 30)
    balancer.decisions.append(Decision((1, 4), (6, 12, 12)))
    restored = ThroughputBalancer(3, 30)
    restored.load_state_dict(balancer.state_dict())
    assert restored.decisions == balancer.decisions
    with pytest.raises(ValueError, match="ranks"):
        ThroughputBalancer(2, 30).load_state_dict(balancer.state_dict())
    # places a job may grow into (max_ranks): the starting ranks hold the shares, and a schedule of other starting
    # ranks is refused even with as many places (a job of 2 in 4 places resumed as a job of 4)
    growing = ThroughputBalancer(4, 30, starting=2)
    assert growing.shares == (15, 15, 0, 0)
    with pytest.raises(ValueError, match="2 starting ranks .* this run has 4 starting ranks"):
        ThroughputBalancer(4, 30).load_state_dict(growing.state_dict())
    growing.include([2, 3], (0, 0))
    assert growing.shares_at((0, 0)) == (8, 8, 7, 7)


def test_weighted_average_is_the_global_batch_mean():
    torch.manual_seed(0)
    samples = torch.randn(64, 5, dtype=torch.float64)
    shares = [7, 20, 20, 17]
    parts = torch.split(samples, shares)
    # each rank's gradient of a mean loss is its mean; the ranks' average of the weighted means
    average = sum(gradient_weight(4, len(p), 64) * p.mean(0) for p in parts) / 4
    torch.testing.assert_close(average, samples.mean(0), rtol=0, atol=1e-14)
    assert gradient_weight(4, 16, 64) == 1.0


def test_one_slow_batch_does_not_move_the_shares():
    balancer = ThroughputBalancer(2, 8, interval=5)
    for seconds in (0.004, 0.004, 0.030, 0.004, 0.004):
        balancer.record(seconds, 4)
    assert balancer.window_full and balancer.measurement() == pytest.approx((0.02, 20.0))
    assert balancer.decide([balancer.measurement(), (0.02, 20.0)], (0, 5)) is None and balancer.window == []


def test_differences_below_the_timers_noise_keep_the_shares():
    balancer = ThroughputBalancer(2, 64)
    assert balancer.decide([(0.004, 32.0), (0.0055, 32.0)], (0, 5)) is None  # 37 % apart, 0.6 ms to gain
    assert balancer.decide([(0.040, 32.0), (0.055, 32.0)], (0, 10)) is not None  # 6 ms to gain


def _lost_one() -> ThroughputBalancer:
    """Four ranks, a global batch of 16, rank 3 lost at batch 3: shares 6, 5, 5, 0."""
    balancer = ThroughputBalancer(4, 16)
    balancer.latest_drawn = (0, 2)
    balancer.exclude([3], (0, 3))
    balancer.latest_drawn = (0, 4)
    return balancer


def test_a_new_process_is_dealt_the_mean_share_from_its_start_and_withdrawn_to_the_shares_before():
    balancer = _lost_one()
    balancer.include([3], (0, 8))
    assert balancer.shares_at((0, 7)) == (6, 5, 5, 0) and balancer.shares_at((0, 8)) == (4, 4, 4, 4)
    with pytest.raises(RuntimeError, match="is drawn"):
        balancer.include([3], (0, 4))
    balancer.latest_drawn = (0, 8)  # its first batch drawn: those samples are dropped, the shares before come back
    assert balancer.withdraw([3], (0, 9)) == (0, 8)
    assert balancer.shares_at((0, 8)) == (4, 4, 4, 4) and balancer.shares_at((0, 9)) == (6, 5, 5, 0)
    assert balancer.withdraw([3], (0, 10)) is None  # (nothing dealt to it any more)


def test_members_that_deal_a_new_process_and_lose_a_rank_in_either_order_hold_one_schedule():
    """A loss racing with the boundary that deals a new process its share: one member dealt it, then lost rank 2
    (dealing it again as the loss dropped it); another lost rank 2, then dealt it; a third never dealt it and takes it
    back when the members find they differ. A planted exclusion that deals the later share among the ranks (the new
    one included) differs."""
    first, second, third = _lost_one(), _lost_one(), _lost_one()
    first.include([3], (0, 8))
    first.exclude([2], (0, 5))
    if not first.shares_at((0, 8))[3]:
        first.include([3], (0, 8))
    second.exclude([2], (0, 5))
    second.include([3], (0, 8))
    third.exclude([2], (0, 5))
    assert first.decisions == second.decisions
    for balancer in (first, second, third):
        balancer.latest_drawn = (0, 6)
        balancer.withdraw([3], (0, 7))
    assert first.decisions == second.decisions == third.decisions
    assert third.shares_at((0, 9)) == (9, 7, 0, 0)


def test_a_leaving_member_s_share_is_dealt_away_from_its_last_batch_and_reinstated_where_it_stays():
    """Rank 1 of four leaves from batch 8: the three others take its share in proportion; a loss of rank 2 before
    then keeps rank 1 without a share from batch 8 (keep_excluded's rule), and members that dealt it away, or not,
    hold one schedule again once it is reinstated."""
    balancer = ThroughputBalancer(4, 16)
    balancer.latest_drawn = (0, 4)
    balancer.exclude([1], (0, 8))
    assert balancer.shares_at((0, 7)) == (4, 4, 4, 4) and balancer.shares_at((0, 8)) == (6, 0, 5, 5)
    balancer.exclude([2], (0, 5))  # a loss: its deal from batch 5 drops the later one
    assert balancer.shares_at((0, 8))[1] and balancer.shares_at((0, 5)) == (6, 5, 0, 5)
    balancer.exclude([1], (0, 8))  # (keep_excluded: rank 1 had a share again at batch 8)
    assert balancer.shares_at((0, 8)) == (9, 0, 0, 7)
    dealt, never = ThroughputBalancer(4, 16), ThroughputBalancer(4, 16)
    for b in (dealt, never):
        b.latest_drawn = (0, 4)
    dealt.exclude([1], (0, 8))
    for b in (dealt, never):
        b.latest_drawn = (0, 6)
        b.reinstate([1], (0, 7))
    assert dealt.decisions == never.decisions and dealt.shares_at((0, 9)) == (4, 4, 4, 4)
    with pytest.raises(RuntimeError, match="is drawn"):
        dealt.reinstate([1], (0, 6))
