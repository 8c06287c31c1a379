"""``OverlappedPull`` and ``ReadProbe`` in one process: the exchange is a stand-in that writes known weights into a
bucket, so what each forward read, and when, is checked exactly."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lightning_dp.comm.buckets import BucketReducer, GradientBucket
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.weight_pull import BlockingPull, OverlappedPull, ReadProbe

pytestmark = pytest.mark.unit

#: the weights the stand-in pull delivers: every element of bucket ``b`` becomes ``NEW + b``
NEW = 100.0


class Chain(nn.Module):
    """Three layers, ``second`` used twice; with buckets of 72 bytes every weight (64 bytes) and bias (16) gets a
    bucket of its own, so every layer spans two buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.third = nn.Linear(4, 4)
        self.read: list[tuple[str, float, float]] = []
        for name in ("first", "second", "third"):
            getattr(self, name).register_forward_hook(self._record(name))  # after its forward: what it read

    def _record(self, name):
        def record(module, args, output):
            self.read.append((name, module.weight.detach()[0, 0].item(), module.bias.detach()[0].item()))

        return record

    def forward(self, x):
        return self.third(self.second(self.second(self.first(x))))


def make(cap_bytes: int = 72):
    """``(model, reducer, exchange, exchanged, stats)``: the stand-in exchange counts each bucket's bytes both ways
    in ``stats`` and records the order buckets were exchanged in; it waits while ``exchange.gate`` is clear."""
    torch.manual_seed(0)
    model = Chain()
    reducer = BucketReducer(model.parameters(), lambda bucket: None, bucket_cap_mb=cap_bytes / 2**20)
    exchanged: list[int] = []
    order_lock = threading.Lock()
    stats = CommStats()
    gate = threading.Event()
    gate.set()

    def exchange(bucket: GradientBucket) -> None:  # runs on the communication thread
        assert gate.wait(10)
        with order_lock:
            exchanged.append(bucket.index)
        bucket.buffer[: bucket.grad_numel].fill_(NEW + bucket.index)
        stats.add(bucket.nbytes, bucket.nbytes)

    exchange.gate = gate
    return model, reducer, exchange, exchanged, stats


def overlapped(model, reducer, exchange, stats, owns_all: bool = False) -> OverlappedPull:
    """An overlapped pull after its first post (which waits, to learn each bucket's bytes), the weights zeroed again."""
    pull = OverlappedPull(exchange, GradientBucket.unpack_params, reducer, model, lambda b: not owns_all, stats)
    pull.post(reducer.buckets)
    assert pull.pending == 0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return pull


def test_each_forward_reads_the_pulled_weights_of_its_own_buckets_only_when_it_runs():
    model, reducer, exchange, exchanged, stats = make()
    pull = overlapped(model, reducer, exchange, stats)
    try:
        bucket_of = pull.bucket_of
        layers = [model.first, model.second, model.third]
        assert len(reducer.buckets) == 6
        model(torch.zeros(1, 4))  # the first forward: nothing in flight; learns the order
        assert pull.forward_order == [
            i for m in layers for i in sorted({bucket_of[id(m.weight)], bucket_of[id(m.bias)]})
        ]
        pull.agree_order(pull.forward_order)
        model.read.clear()
        exchange.gate.clear()
        pull.post(reducer.buckets)
        assert pull.pending == len(reducer.buckets)
        # the post booked its buckets' bytes before any of them ran, and they do not count again when they run
        both_posts = (2 * sum(b.nbytes for b in reducer.buckets),) * 2
        assert (stats.bytes_sent, stats.bytes_received) == both_posts
        exchange.gate.set()
        model(torch.zeros(1, 4))
        expected = []
        for name in ("first", "second", "second", "third"):
            layer = getattr(model, name)
            expected.append((name, NEW + bucket_of[id(layer.weight)], NEW + bucket_of[id(layer.bias)]))
        assert model.read == expected  # every forward, the second use too, read the pulled weights
        assert exchanged[len(exchanged) - len(reducer.buckets) :] == pull.post_order  # posted in forward order
        assert pull.pending == 0 and pull.waited_in_forward == len(reducer.buckets)
        assert (stats.bytes_sent, stats.bytes_received) == both_posts
    finally:
        pull.close()
        reducer.close()


def test_a_bucket_no_forward_asks_for_waits_until_complete():
    model, reducer, exchange, _, stats = make()
    pull = overlapped(model, reducer, exchange, stats)
    try:
        exchange.gate.clear()  # the exchanges wait: nothing arrives unless a forward waits for it
        pull.post(reducer.buckets)
        third_bias = pull.bucket_of[id(model.third.bias)]
        exchange.gate.set()
        model.first(torch.zeros(1, 4))  # only the first layer runs
        assert pull.pending > 0 and third_bias in pull._in_flight
        pull.complete()
        assert model.third.bias[0].item() == NEW + third_bias and pull.completed_late > 0
    finally:
        pull.close()
        reducer.close()


def test_a_rank_owning_a_bucket_never_waits_for_it_in_forward():
    model, reducer, exchange, _, stats = make()
    pull = overlapped(model, reducer, exchange, stats, owns_all=True)
    try:
        before = model.first.weight.detach().clone()
        pull.post(reducer.buckets)
        model(torch.zeros(1, 4))
        assert pull.waited_in_forward == 0 and pull.pending == len(reducer.buckets)
        pull.complete()
        assert torch.equal(model.first.weight.detach(), before)  # its own weights are the pulled ones
    finally:
        pull.close()
        reducer.close()


def test_the_blocking_pull_delivers_every_bucket_in_post():
    model, reducer, exchange, _, _ = make()
    pull = BlockingPull(exchange, GradientBucket.unpack_params, reducer)
    try:
        pull.post(reducer.buckets)
        for bucket in reducer.buckets:
            assert all(torch.all(p.detach() == NEW + bucket.index) for p in bucket.params)
    finally:
        reducer.close()


def test_the_probe_names_a_weight_read_before_its_module_runs():
    model, reducer, exchange, _, stats = make()
    pull = OverlappedPull(exchange, GradientBucket.unpack_params, reducer, model, lambda b: True, stats)
    probe = ReadProbe(pull, {id(p): name for name, p in model.named_parameters()})
    try:
        with probe:
            model(torch.zeros(1, 4))
        assert probe.watched and probe.early_reads == []
        with probe:
            h = model.first(torch.zeros(1, 4)) + model.third.weight.sum()  # third's weight before third runs
            model.third(model.second(h))
        assert probe.early_reads == ["third.weight"]
    finally:
        pull.close()
        reducer.close()
