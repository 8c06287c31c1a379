"""Chain replication of the servers' state, without Lightning: a replica stepped with its owner's forwarded
gradients holds the owner's state bit for bit, and the survivors of a loss cut the full state again from their
shards and the lost ranks' replicas, stepping on exactly like one optimizer that lost nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.comm.buckets import BucketReducer
from lightning_dp.comm.servers.replicas import (
    ReplicaLostError,
    ShardReplica,
    chain_predecessor,
    chain_successor,
    check_recoverable,
    survivors_state,
)
from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout
from lightning_dp.comm.transports.shards import shard_segments

#: the gradients' global norm is clipped to this (below the model's, so that every step clips)
CLIP = 0.02


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 1, bias=False))


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.05)


class Rank:
    """One simulated rank: its model, front optimizer and scheduler, buckets, own shard and its predecessor's
    replica, over ``size`` ranks (``index``: its place among them)."""

    def __init__(self, index: int, size: int) -> None:
        self.model = _model()
        self.front = _adam(self.model)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.front, step_size=2, gamma=0.5)
        self.reducer = BucketReducer(self.model.parameters(), lambda b: None, bucket_cap_mb=40 * 4 / 2**20)
        self.place(index, size)

    def place(self, index: int, size: int) -> None:
        buckets = self.reducer.buckets
        self.index, self.size = index, size
        self.segments = shard_segments([b.grad_numel for b in buckets], [b.buffer.element_size() for b in buckets],
                                       size)  # fmt: skip
        self.own = ShardedOptimizer(self.front, ShardLayout(buckets, self.segments, index))
        owner = chain_predecessor(index, size)
        self.replica = ShardReplica([self.front], buckets, self.segments, owner) if size > 1 else None

    def backward(self, seed: int) -> None:
        """The averaged gradient of step ``seed`` in the buckets (as every owner holds its part after the push)."""
        torch.manual_seed(seed)
        self.model.zero_grad(set_to_none=True)
        self.model(torch.randn(8, 7)).pow(2).mean().backward()
        self.reducer.finish(copy_back=False)


def _step(ranks: list[Rank], seed: int, skip_replica: bool = False) -> None:
    for rank in ranks:
        rank.backward(seed)
    for rank in ranks:  # the forward: the owner's segment of every bucket lands in its successor's replica
        owner = ranks[chain_predecessor(rank.index, rank.size)]
        if rank.replica is not None:
            for mine, theirs in zip(rank.reducer.buckets, owner.reducer.buckets, strict=True):
                start, end = owner.segments[theirs.index][owner.index]
                rank.replica.incoming(mine).copy_(theirs.buffer[start:end])
    for rank in ranks:
        if rank.replica is not None and not skip_replica:
            rank.replica.take_gradients()  # the weights before the step
        rank.own.layout.take_bucket_gradients()
    squares = sum(float(rank.own.squared_norm()) for rank in ranks)  # the vote's sum over every shard
    for rank in ranks:
        rank.own.apply_clip_(("norm", CLIP), squares)
        rank.own.step()
        if rank.replica is not None and not skip_replica:
            rank.replica.step(0, ("norm", CLIP), squares)
    for rank in ranks:  # the pull: every rank takes every owner's new weights
        for other in ranks:
            for p, q in zip(rank.model.parameters(), other.model.parameters(), strict=True):
                for pc in other.own.layout.pieces_of([q]):
                    p.detach().view(-1)[pc.start : pc.end] = q.detach().view(-1)[pc.start : pc.end]
    for rank in ranks:
        rank.scheduler.step()


def _reference(steps: int) -> list[list[torch.Tensor]]:
    model = _model()
    optimizer = _adam(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    history = []
    for seed in range(steps):
        torch.manual_seed(seed)
        optimizer.zero_grad()
        model(torch.randn(8, 7)).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=CLIP)
        assert norm > CLIP  # the clipping acts at every step
        optimizer.step()
        scheduler.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _assert_weights(ranks: list[Rank], expected: list[torch.Tensor], step: int) -> None:
    for rank in ranks:
        for p, q in zip(rank.model.parameters(), expected, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=f"step {step}, rank {rank.index}")
    first = ranks[0]
    for rank in ranks[1:]:  # replicas bit-identical
        for p, q in zip(rank.model.parameters(), first.model.parameters(), strict=True):
            assert torch.equal(p, q), f"step {step}: rank {rank.index} differs from rank {first.index}"


def _run_with_loss(
    size: int, lost: list[int], before: int, after: int, skip_replica: bool = False, check_replicas: bool = True
) -> None:
    expected = _reference(before + after)
    ranks = [Rank(i, size) for i in range(size)]
    for seed in range(before):
        _step(ranks, seed, skip_replica)
        _assert_weights(ranks, expected[seed], seed)
    for rank in ranks if check_replicas else []:  # each replica holds its owner's state and weights, bit for bit
        owner = ranks[chain_predecessor(rank.index, size)]
        assert rank.replica is not None
        held = f"rank {rank.index}'s replica of rank {owner.index}'s shard"
        owners = torch.cat([pc.tensor.detach().reshape(-1) for pc in owner.own.layout.pieces])
        assert torch.equal(rank.replica.weights, owners), held
        mine, theirs = rank.replica.local_state(), owner.own.local_state()
        assert [k[:3] for k in mine] == [k[:3] for k in theirs] and len(mine) == len(owner.own.pieces), held
        for (*_, a), (*_, b) in zip(mine, theirs, strict=True):
            assert a.keys() == b.keys(), held
            assert all(torch.equal(a[key].reshape(-1), b[key].reshape(-1)) for key in a), held
    check_recoverable(lost, size)
    survivors = [r for r in ranks if r.index not in lost]
    gathered = [survivors_state(r.own, r.replica, lost) for r in survivors]
    full_holder = survivors[0].own
    full_holder.merge_states(gathered)
    full = full_holder.state_dict()
    for i, rank in enumerate(survivors):
        rank.place(i, len(survivors))
        rank.own.load_state_dict(full)
        if rank.replica is not None:
            rank.replica.load_state_dict(full)
    for seed in range(before, before + after):
        _step(survivors, seed)
        _assert_weights(survivors, expected[seed], seed)


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize(("size", "lost"), [(2, [0]), (3, [1]), (4, [0]), (4, [3]), (4, [0, 2]), (5, [1, 3])])
def test_survivors_recut_the_state_from_their_shards_and_the_lost_ranks_replicas(size, lost):
    _run_with_loss(size, lost, before=3, after=3)


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_replica_that_misses_its_owners_steps_fails_the_check():
    with pytest.raises(AssertionError, match=r"replica of rank \d's shard"):
        _run_with_loss(3, [1], before=3, after=2, skip_replica=True)
    # and without the direct check, the weights after the loss show it
    with pytest.raises(AssertionError, match="step 3"):
        _run_with_loss(3, [1], before=3, after=2, skip_replica=True, check_replicas=False)


@pytest.mark.unit
def test_a_shard_lost_with_its_replica_is_named():
    assert [chain_successor(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert [chain_predecessor(r, 4) for r in range(4)] == [3, 0, 1, 2]
    check_recoverable([1, 3], 4)
    with pytest.raises(ReplicaLostError, match="rank 3 and its replica on rank 0"):
        check_recoverable([0, 3], 4)
    with pytest.raises(ReplicaLostError, match="every one"):
        check_recoverable([0, 1], 2)


def _forward_and_recut(rank: int, world_size: int) -> bool:
    """Over gloo: the push averages each shard on its owner, the owner forwards it to its successor, owner and
    replica step; then rank 1 is gone and the other two assemble the full state over their own group."""
    import torch.distributed as dist

    from lightning_dp.comm.servers.replicas import gather_full_state, post_forward, survivors_state
    from lightning_dp.comm.transports.shards import push_shards

    model, reference = _model(), _model()
    front, reference_opt = _adam(model), _adam(reference)
    reducer = BucketReducer(model.parameters(), lambda b: None, bucket_cap_mb=40 * 4 / 2**20)
    buckets = reducer.buckets
    segments = shard_segments([b.grad_numel for b in buckets], [b.buffer.element_size() for b in buckets], world_size)
    own = ShardedOptimizer(front, ShardLayout(buckets, segments, rank))
    replica = ShardReplica([front], buckets, segments, chain_predecessor(rank, world_size))
    survivors = dist.new_group([0, 2])  # collective over everyone, so formed before rank 1 leaves
    for step in range(3):
        torch.manual_seed(100 * step + rank)  # every rank its own batch
        model.zero_grad(set_to_none=True)
        model(torch.randn(4, 7)).pow(2).mean().backward()
        reducer.finish(copy_back=False)
        reference_opt.zero_grad()
        for other in range(world_size):  # one process on the global batch (the same batches, their mean)
            torch.manual_seed(100 * step + other)
            (reference(torch.randn(4, 7)).pow(2).mean() / world_size).backward()
        reference_opt.step()
        works = []
        for bucket in buckets:
            push_shards(bucket.buffer[: bucket.grad_numel], segments[bucket.index], summed=bucket.flags)
            works += [post_forward(bucket, segments), replica.post_receive(bucket)]
        for work in works:
            if work is not None:
                work.wait()
        replica.take_gradients()
        own.layout.take_bucket_gradients()
        own.step()
        replica.step()
        for bucket in buckets:  # the pull
            from lightning_dp.comm.transports.shards import pull_shards

            bucket.pack_params(*segments[bucket.index][rank])
            pull_shards(bucket.buffer[: bucket.grad_numel], segments[bucket.index])
            bucket.unpack_params(keep=segments[bucket.index][rank])
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    if rank == 1:
        return True
    full = gather_full_state(own, survivors_state(own, replica, [1]), survivors)
    expected = reference_opt.state_dict()
    assert sorted(full["state"]) == sorted(expected["state"])
    for k, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(full["state"][k][key].reshape(value.shape), value, rtol=0, atol=1e-6)
    return True


@pytest.mark.multiprocess
def test_the_forwarded_shard_keeps_the_replica_and_the_survivors_assemble_the_full_state():
    from tests.helpers.distributed import run_distributed

    assert run_distributed(_forward_and_recut, 3, timeout=120) == [True] * 3
