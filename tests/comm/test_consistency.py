"""Bounded staleness and asynchrony on plain torch.distributed (no Lightning): the bound, the flush, failures."""

import functools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.consistency import (
    PushLayout,
    StalenessClient,
    StalenessRecord,
    StalenessServer,
    StopReason,
    check_staleness,
)
from lightning_dp.comm.errors import NonFiniteGradientError
from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout
from lightning_dp.comm.transports.shards import shard_segments
from tests.helpers.distributed import run_distributed


@pytest.mark.unit
def test_staleness_option_values():
    assert check_staleness(None) is None and check_staleness(0) == 0 and check_staleness(3) == 3
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="staleness must be an integer >= 0 or None"):
            check_staleness(bad)


@pytest.mark.unit
def test_staleness_record():
    record = StalenessRecord()
    assert record.max == 0 and record.steps == 0 and record.mean() == 0.0
    for s in (0, 2, 2, 1):
        record.add(s)
    assert record.max == 2 and record.steps == 4 and record.mean() == 1.25 and record.histogram[2] == 2


def _setup(rank, size, staleness, sharded, lr=0.1, zero=False, optimizer_class=torch.optim.SGD):
    """Two parameters in two buckets, served centrally by rank 0 or sharded over every rank."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    if zero:
        for p in params:
            p.data.zero_()
    buckets = [GradientBucket(0, [params[1]]), GradientBucket(1, [params[0]])]
    if sharded:
        segments = shard_segments([b.grad_numel for b in buckets], [4, 4], size)
    else:
        segments = [[(0, b.grad_numel) if r == 0 else (0, 0) for r in range(size)] for b in buckets]
    push_group = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    reply_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    optimizer = optimizer_class(params, lr=lr)
    layout = ShardLayout(buckets, segments, rank, own_storage=True)
    sharded_optimizer = ShardedOptimizer(optimizer, layout, dist.group.WORLD)
    push_layout = PushLayout(buckets, segments, size)
    server = None
    if rank in push_layout.servers:
        server = StalenessServer(layout, [sharded_optimizer], push_layout, rank, size, staleness, push_group,
                                 reply_group)  # fmt: skip
        server.start()
    client = StalenessClient(push_layout, rank, push_group, reply_group, server, timeout=30)
    return params, buckets, client


def _fill(buckets, grads):
    for bucket in buckets:
        for i, p in enumerate(bucket.params):
            bucket.fill(i, grads.get(id(p)))


def _bounded_run(rank, size, staleness, sharded, steps, slow_rank, delay):
    """Every rank pushes constant gradients ``rank + 1``; ``slow_rank`` sleeps before each push."""
    params, buckets, client = _setup(rank, size, staleness, sharded)
    start = [p.detach().clone() for p in params]
    seen = []
    for _ in range(steps):
        if rank == slow_rank:
            time.sleep(delay)
        _fill(buckets, {id(p): torch.full_like(p, float(rank + 1)) for p in params})
        seen.append(client.push())
    client.flush()
    client.close()
    # every update applied once at lr / size: w = w0 - lr / size * steps * sum(rank + 1)
    total = steps * sum(r + 1 for r in range(size)) * 0.1 / size
    return seen, [(p.detach() - (s - total)).abs().max().item() for p, s in zip(params, start, strict=True)]


def _decoded_run(rank, size, staleness, slow_rank, delay, steps=8):
    """SGD at lr = N (each arrival steps with lr 1) from zero weights, rank r always pushing 1000^r: the weights
    after each push hold, exactly, -sum_r 1000^r n_r, so they reveal how many updates n_r of each rank are in."""
    params, buckets, client = _setup(rank, size, staleness, True, lr=float(size), zero=True)
    counts = []
    for _ in range(steps):
        if rank == slow_rank:
            time.sleep(delay)
        _fill(buckets, {id(p): torch.full_like(p, 1000.0**rank) for p in params})
        client.push()
        held = []  # one entry per distinct value: the servers of different shards may hold different counts
        for value in torch.cat([p.detach().flatten() for p in params]).unique().tolist():
            left = int(round(-value))
            held.append([left // 1000**r % 1000 for r in range(size)])
        counts.append((client.clock, held))
    client.close()
    return counts


def _synchronous_sgd(rank, size, sharded):
    """``staleness=0`` in the comm layer is synchronous SGD: each round equals one step on the average."""
    params, buckets, client = _setup(rank, size, 0, sharded)
    expected = [p.detach().clone() for p in params]
    errors, seen = [], []
    for step in range(4):
        _fill(buckets, {id(p): torch.full_like(p, float((rank + 1) * (step + 1))) for p in params})
        seen.append(client.push())
        mean = sum((r + 1) * (step + 1) for r in range(size)) / size
        expected = [e - 0.1 * mean for e in expected]
        errors += [(p.detach() - e).abs().max().item() for p, e in zip(params, expected, strict=True)]
    client.close()
    return seen, max(errors)


def _unused_parameter(rank, size):
    params, buckets, client = _setup(rank, size, None, True)
    before = params[1].detach().clone()
    _fill(buckets, {id(params[0]): torch.ones_like(params[0])})  # params[1] got no gradient on any rank
    client.push()
    client.flush()
    client.close()
    return torch.equal(params[1].detach(), before) and not torch.equal(params[0].detach(), before[:1])


def _nonfinite(rank, size):
    params, buckets, client = _setup(rank, size, 1, True)
    _fill(buckets, {id(p): torch.ones_like(p) for p in params})
    client.push()
    dist.barrier()  # every rank's first step is answered before rank 2 stops
    if rank == 2:  # found a NaN in its gradient: tells the servers instead of pushing it
        client.close(StopReason.NONFINITE)
        return "stopped"
    time.sleep(0.5)
    started = time.monotonic()
    try:
        for _ in range(5):
            _fill(buckets, {id(p): torch.ones_like(p) for p in params})
            client.push()
    except NonFiniteGradientError as error:
        client.close(StopReason.NONFINITE)
        return str(error), time.monotonic() - started
    return "no error"


class ExplodingSGD(torch.optim.SGD):
    """Fails at its first step on the server: the server's own error must reach every rank."""

    def step(self, closure=None):
        raise RuntimeError("the optimizer exploded")


def _server_error(rank, size):
    params, buckets, client = _setup(rank, size, 1, False, optimizer_class=ExplodingSGD)
    _fill(buckets, {id(p): torch.ones_like(p) for p in params})
    started = time.monotonic()
    try:
        client.push()
    except Exception as error:  # noqa: BLE001 - the test reports what each rank raised
        client.close(StopReason.ERROR)
        return type(error).__name__, str(error), time.monotonic() - started
    return "no error"


def _scenarios(rank, size):
    """Every scenario in one launch (each on process groups of its own), the failing one last."""
    return {
        "ssp-central": _bounded_run(rank, size, 2, False, 8, 1, 0.15),
        "ssp-sharded": _bounded_run(rank, size, 2, True, 8, 1, 0.15),
        "decoded": _decoded_run(rank, size, 2, 1, 0.15),
        "async": _bounded_run(rank, size, None, True, 6, 2, 0.3),
        "sync-central": _synchronous_sgd(rank, size, False),
        "sync-sharded": _synchronous_sgd(rank, size, True),
        "unused": _unused_parameter(rank, size),
        "server-error": _server_error(rank, size),
        "nonfinite": _nonfinite(rank, size),
    }


@functools.cache
def scenarios() -> tuple:
    return tuple(run_distributed(_scenarios, 3, timeout=180))


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["ssp-central", "ssp-sharded"])
def test_bound_holds_fast_workers_run_ahead_and_flush_holds_every_update(scenario):
    results = [ranks[scenario] for ranks in scenarios()]
    k = 2
    for rank, (seen, errors) in enumerate(results):
        assert max(seen) <= k, (rank, seen)
        assert max(errors) < 1e-5, errors  # after the flush: every rank's every update, on every rank
    assert max(results[0][0]) == k and max(results[2][0]) == k  # the fast ranks ran as far ahead as allowed
    assert sum(results[1][0][2:]) == 0, results[1][0]  # the slow rank found everyone else ahead


@pytest.mark.multiprocess
def test_the_weights_themselves_hold_every_update_the_bound_requires():
    """Independent of the servers' own book-keeping: decode from the weights how many updates of each rank they
    hold after each push (rank 1 slow, k = 2)."""
    k = 2
    for rank, counts in enumerate(ranks["decoded"] for ranks in scenarios()):
        assert [clock for clock, _ in counts] == list(range(1, 9))
        ahead = 0
        for clock, shares in counts:
            for held in shares:
                assert held[rank] == clock, (rank, clock, held)  # a worker's own updates are all in
                assert min(held) >= clock - k, (rank, clock, held)  # SSP: every rank's steps before clock - k are in
                ahead = max(ahead, clock - min(held))
        if rank != 1:
            assert ahead == k, counts  # and the fast ranks did use the slack


@pytest.mark.multiprocess
def test_asynchronous_workers_never_wait_for_the_slow_one():
    results = [ranks["async"] for ranks in scenarios()]
    fast = results[0][0]
    assert fast[-1] >= 4, fast  # the fast rank finished 6 steps while the slow one was at its first or second
    for _, errors in results:
        assert max(errors) < 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["sync-central", "sync-sharded"])
def test_staleness_zero_is_synchronous_sgd(scenario):
    for seen, error in (ranks[scenario] for ranks in scenarios()):
        assert seen == [0, 0, 0, 0] and error < 1e-5


@pytest.mark.multiprocess
def test_a_parameter_without_gradient_is_left_alone():
    assert [ranks["unused"] for ranks in scenarios()] == [True] * 3


@pytest.mark.multiprocess
def test_a_non_finite_gradient_stops_every_rank_naming_it():
    results = [ranks["nonfinite"] for ranks in scenarios()]
    assert results[2] == "stopped"
    for message, seconds in results[:2]:
        assert "rank 2 pushed a non-finite" in message and seconds < 10, message


@pytest.mark.multiprocess
def test_an_error_in_the_server_update_reaches_every_rank():
    results = [ranks["server-error"] for ranks in scenarios()]
    kind, message, seconds = results[0]  # the server's own worker raises the server's error itself
    assert kind == "RuntimeError" and "the optimizer exploded" in message and seconds < 10
    for kind, message, seconds in results[1:]:
        assert kind == "PeerUnreachableError" and "rank 0 stopped with an error" in message and seconds < 10, message
