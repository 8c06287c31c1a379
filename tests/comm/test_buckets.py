"""Gradient buckets: layout, launch order, overlap with backward, unused parameters."""

import threading

import pytest
import torch
from torch import nn

from lightning_dp.comm.buckets import BucketReducer, assign_buckets

pytestmark = pytest.mark.unit


def test_buckets_follow_reverse_parameter_order_and_cap():
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(300), torch.zeros(10, dtype=torch.float64)]
    # 400 bytes a float32 tensor of 100; cap 900 bytes
    assert assign_buckets(params, 900) == [[3], [2], [1, 0]]
    assert assign_buckets(params, 10_000) == [[3], [2, 1, 0]]  # dtype change starts a new bucket
    assert assign_buckets(params, 1) == [[3], [2], [1], [0]]  # oversize tensors get a bucket each
    # the first bucket is small (here 500 bytes) so communication starts early; later ones use the full cap
    assert assign_buckets(params[:3], 10_000, first_bucket_cap_bytes=500) == [[2], [1, 0]]


class Chain(nn.Module):
    def __init__(self, width=64, depth=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.unused = nn.Linear(width, width)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def test_buckets_launch_in_order_while_backward_runs():
    model = Chain()
    ready_at_launch = []
    hooks_fired = []
    order = []

    def reduce_bucket(bucket):
        order.append(bucket.index)
        bucket.buffer.mul_(2)  # stands in for the communication

    reducer = BucketReducer(model.parameters(), reduce_bucket, bucket_cap_mb=64 * 65 * 4 / 2**20)
    original = reducer._launch_ready_buckets

    def spy():
        ready_at_launch.append(len(hooks_fired))
        original()

    # the first backward teaches the reducer how many accumulations each gradient gets; nothing leaves early
    model(torch.randn(4, 64)).backward()
    reducer.finish()
    assert order == list(range(7))
    model.zero_grad()
    order.clear()
    reducer._launch_ready_buckets = spy
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: hooks_fired.append(p))
    model(torch.randn(4, 64)).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    reducer.finish()
    # one bucket per layer plus one for the unused layer; they ran in bucket order
    assert len(reducer.buckets) == 7 and order == list(range(7))
    # the first bucket was handed to the comm thread long before backward produced the last gradient
    assert ready_at_launch[0] < len(hooks_fired) / 2
    for name, p in model.named_parameters():
        if name.startswith("unused"):
            assert p.grad is None  # no rank used it: stays None, as without data parallelism
        else:
            assert torch.equal(p.grad, 2 * reference[name])
    reducer.close()


def test_sync_disabled_accumulates_locally_and_flushes_accumulated_grads():
    model = Chain(depth=2)
    calls = []
    reducer = BucketReducer(model.parameters(), lambda b: calls.append(b.index), bucket_cap_mb=25)
    with reducer.no_sync():
        assert not reducer.enabled
        model(torch.randn(2, 64)).backward()
    assert calls == [] and reducer.enabled
    # second micro-batch uses only the first layer's input path through a detached second layer
    x = torch.randn(2, 64)
    (model.layers[0](x).sum()).backward()
    reducer.finish()
    assert calls == [0]  # one bucket; layers[1] was flushed with its accumulated gradient
    assert model.layers[1].weight.grad is not None and model.layers[1].weight.grad.abs().sum() > 0
    reducer.close()


def test_communication_errors_reach_the_caller():
    model = Chain(depth=1)

    def broken(bucket):
        raise ConnectionError("peer 1 unreachable")

    reducer = BucketReducer(model.parameters(), broken)
    model(torch.randn(2, 64)).backward()
    with pytest.raises(ConnectionError, match="peer 1"):
        reducer.finish()
    # the reducer is reusable after a failed round
    model.zero_grad()
    reducer.reduce_bucket = lambda b: None
    model(torch.randn(2, 64)).backward()
    reducer.finish()
    reducer.close()


def test_reduce_runs_off_the_main_thread():
    model = Chain(depth=1)
    threads = set()
    reducer = BucketReducer(model.parameters(), lambda b: threads.add(threading.current_thread().name))
    model(torch.randn(2, 64)).backward()
    reducer.finish()
    assert threads and all(name.startswith("lightning-dp-comm") for name in threads)
    reducer.close()


def test_reducer_marks_a_fresh_synchronization_once():
    model = Chain(depth=1)
    reducer = BucketReducer(model.parameters(), lambda b: None)
    assert not reducer.fresh  # nothing reduced yet: a scheme must not read the buckets as gradients
    model(torch.randn(2, 64)).backward()
    reducer.finish(copy_back=False)
    assert reducer.fresh
    reducer.close()


class Reentrant(nn.Module):
    """One weight used in two reentrant checkpoint segments: its gradient is accumulated twice per backward."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        return self.head(x).sum()


def test_reentrant_checkpointing_reduces_the_complete_gradient_every_step():
    torch.manual_seed(0)
    model = Reentrant()
    seen = []

    def reduce_bucket(bucket):
        seen.append(bucket.buffer.clone())

    reducer = BucketReducer(model.parameters(), reduce_bucket, bucket_cap_mb=16 * 17 * 4 / 2**20)
    for step in range(3):
        seen.clear()
        model.zero_grad()
        x = torch.randn(4, 16, requires_grad=True)
        model(x).backward()
        full = [p.grad.clone() for p in model.parameters()]
        reducer.finish()
        for p, want in zip(model.parameters(), full, strict=True):
            assert torch.equal(p.grad, want), f"step {step}: a partial gradient was reduced"
        assert sum(t.numel() for t in seen) == sum(b.buffer.numel() for b in reducer.buckets)
    assert reducer._expected[id(model.shared.weight)] == 2
    reducer.close()


def test_a_gradient_accumulated_after_its_bucket_left_is_refused_with_the_cause():
    model = nn.Linear(64, 64)
    reducer = BucketReducer(model.parameters(), lambda b: None)
    model(torch.randn(2, 64)).sum().backward()
    reducer.finish()
    model(torch.randn(2, 64)).sum().backward()  # a backward the strategy did not finish: loss.backward() by hand
    with pytest.raises(RuntimeError, match="manual_backward.*use_reentrant=False"):
        model(torch.randn(2, 64)).sum().backward()
    reducer.close()


def test_sparse_gradients_are_refused_with_a_clear_error():
    from lightning_dp.comm.buckets import SparseGradientError

    embedding = nn.Embedding(10, 4, sparse=True)
    reducer = BucketReducer(embedding.parameters(), lambda b: None)
    with pytest.raises(SparseGradientError, match="sparse=False"):
        embedding(torch.tensor([1, 2])).sum().backward()
    reducer.close()


def test_sharded_state_slicing_handles_scalar_parameters():
    from lightning_dp.comm.servers.sharded_optimizer import ShardPiece

    scalar = torch.nn.Parameter(torch.tensor(2.0))
    piece = ShardPiece(scalar, None, 0, 0, 1, 0, scalar.detach().view(-1)[0:1])
    # per-element state of a 0-dim parameter becomes the 1-element slice the shard optimizer holds...
    assert piece.slice_state("exp_avg", torch.tensor(0.5)).shape == (1,)
    # ...while the step counter stays one number
    assert piece.slice_state("step", torch.tensor(3.0)).shape == ()
    matrix = torch.nn.Parameter(torch.zeros(2, 3))
    piece = ShardPiece(matrix, None, 0, 2, 5, 0, matrix.detach().view(-1)[2:5])
    assert torch.equal(piece.slice_state("exp_avg", torch.arange(6.0).view(2, 3)), torch.tensor([2.0, 3.0, 4.0]))


def test_without_overlap_every_bucket_leaves_after_backward():
    model = Chain(depth=3)
    reducer = BucketReducer(model.parameters(), lambda b: None, bucket_cap_mb=64 * 65 * 4 / 2**20)
    model(torch.randn(2, 64)).backward()
    reducer.finish()  # the learning backward
    reducer.stop_overlap()
    launched_during_backward = []
    hook = model.layers[0].weight.register_post_accumulate_grad_hook(
        lambda p: launched_during_backward.append(len(reducer._futures))
    )
    model(torch.randn(2, 64)).backward()
    assert launched_during_backward == [0]  # the last gradient of backward arrived with nothing sent yet
    reducer.finish()
    hook.remove()
    reducer.close()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_as_bucket_views_accumulate_in_the_bucket_and_equal_copies(set_to_none):
    """``param.grad`` is a view into its bucket after the first synchronized backward: zero_grad in either form,
    accumulation over micro-batches and the reduction all act on the bucket, with the gradients of copying."""
    import copy

    torch.manual_seed(0)
    model = Chain(depth=2)
    reference = copy.deepcopy(model)
    halve = lambda b: b.buffer.mul_(0.5)  # noqa: E731 - the average over two ranks of equal gradients
    reducer = BucketReducer(model.parameters(), halve, gradient_as_bucket_view=True)
    for _ in range(3):
        for p in [*model.parameters(), *reference.parameters()]:  # optimizer.zero_grad(set_to_none=...)
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        x1, x2 = torch.randn(2, 64), torch.randn(2, 64)
        with reducer.no_sync():
            model(x1).sum().backward()
        model(x2).sum().backward()
        reducer.finish()
        reference(x1).sum().backward()
        reference(x2).sum().backward()
        for bucket in reducer.buckets:
            for i, p in enumerate(bucket.params):
                assert p.grad is None or bucket.holds(i, p.grad)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad * 0.5)
    assert sum(p.grad is not None for p in model.parameters()) >= 2
    reducer.close()
    grads = [p.grad for b in reducer.buckets for p in b.params if p.grad is not None]
    assert not any(b.holds(i, p.grad) for b in reducer.buckets for i, p in enumerate(b.params) if p.grad is not None)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad * 0.5)  # kept, as tensors of their own
    assert grads
