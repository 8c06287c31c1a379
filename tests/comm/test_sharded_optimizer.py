"""The sharded optimizer, without Lightning: N shards stepping their pieces equal one optimizer stepping it all."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from torch import nn

from lightning_dp.comm.buckets import BucketReducer, GradientBucket
from lightning_dp.comm.errors import ConfigurationError, UnsupportedChangeError
from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout, check_shardable
from lightning_dp.comm.transports.shards import shard_segments


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 1, bias=False))


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    # two groups with different settings, as real modules configure (no weight decay on biases)
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.05)


def _buckets(model: nn.Module, num_shards: int, bucket_cap_mb: float = 40 * 4 / 2**20):
    reducer = BucketReducer(model.parameters(), lambda b: None, bucket_cap_mb=bucket_cap_mb)
    segments = shard_segments(
        [b.grad_numel for b in reducer.buckets], [b.buffer.element_size() for b in reducer.buckets], num_shards
    )
    return reducer, segments


def _backward(model: nn.Module, reducer: BucketReducer, seed: int) -> None:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(torch.randn(8, 7)).pow(2).mean().backward()
    reducer.finish(copy_back=False)  # the buckets hold the gradients, as after an exchange


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the front never steps itself
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_shards_stepping_their_pieces_equal_one_optimizer(num_shards):
    reference, model = _model(), _model()
    reference_opt, front = _adam(reference), _adam(model)
    reducer, segments = _buckets(model, num_shards)
    assert len(reducer.buckets) > 1  # the shards cut across buckets
    layouts = [ShardLayout(reducer.buckets, segments, rank) for rank in range(num_shards)]
    # every element is served by exactly one shard
    served = sum(pc.end - pc.start for layout in layouts for pc in layout.pieces)
    assert served == sum(p.numel() for p in model.parameters())
    shards = [ShardedOptimizer(front, layout) for layout in layouts]
    scheduler = torch.optim.lr_scheduler.StepLR(front, step_size=2, gamma=0.5)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_opt, step_size=2, gamma=0.5)
    for step in range(5):
        torch.manual_seed(step)
        reference_opt.zero_grad()
        reference(torch.randn(8, 7)).pow(2).mean().backward()
        reference_opt.step()
        reference_scheduler.step()
        _backward(model, reducer, step)
        for layout, shard in zip(layouts, shards, strict=True):
            layout.take_bucket_gradients()
            shard.step()
        scheduler.step()  # acts on the front optimizer; the shards follow at their next step
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=f"step {step}")

    # per-element state (exp_avg, exp_avg_sq) is split without overlap: together the shards hold what one optimizer does
    def per_element_bytes(optimizer: torch.optim.Optimizer) -> int:
        return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values() if v.dim() > 0)

    assert sum(per_element_bytes(s.shard) for s in shards) == per_element_bytes(reference_opt)
    reducer.close()


@pytest.mark.unit
def test_unused_parameters_get_no_gradient_and_no_update():
    model = _model()
    front = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reducer, segments = _buckets(model, 2)
    layouts = [ShardLayout(reducer.buckets, segments, rank) for rank in range(2)]
    shards = [ShardedOptimizer(front, layout) for layout in layouts]
    head = model[3].weight
    before = head.detach().clone()
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    model[0](torch.randn(4, 7)).sum().backward()  # the last layers are not used
    reducer.finish(copy_back=False)
    for layout, shard in zip(layouts, shards, strict=True):
        layout.take_bucket_gradients()
        assert all(pc.tensor.grad is None for pc in layout.pieces if pc.param is head)
        shard.step()
    assert torch.equal(head, before)
    reducer.close()


@pytest.mark.unit
def test_added_param_groups_are_followed_and_changed_groups_refused():
    model = _model()
    body = list(model[0].parameters()) + list(model[2].parameters())
    front = torch.optim.SGD(body, lr=0.1)
    reducer, segments = _buckets(model, 2)
    layout = ShardLayout(reducer.buckets, segments, 0)
    shard = ShardedOptimizer(front, layout)
    front.add_param_group({"params": list(model[3].parameters()), "lr": 0.5})
    shard.follow_param_groups()
    assert len(shard.shard.param_groups) == 2 and shard.shard.param_groups[1]["lr"] == 0.5
    assert [pc.param for pc in shard._group_pieces[1]] == [p for p in model[3].parameters() if layout.pieces_of([p])]
    front.param_groups[0]["params"].pop()
    with pytest.raises(UnsupportedChangeError, match="add_param_group"):
        shard.follow_param_groups()
    reducer.close()


@pytest.mark.unit
def test_only_elementwise_optimizers_are_accepted():
    params = [nn.Parameter(torch.zeros(3))]
    check_shardable(torch.optim.Adam(params))
    with pytest.raises(ConfigurationError, match="LBFGS.*element-wise optimizers \\(SGD, Adam"):
        check_shardable(torch.optim.LBFGS(params))


def _consolidate_and_reload(rank: int, world_size: int) -> dict:
    """Each rank clips by the global norm and steps its shard; the full state gathered on rank 0 equals one
    optimizer's; a fresh sharded optimizer loading it steps on exactly like the unsharded one."""
    import torch.distributed as dist

    reference, model = _model(), _model()
    reference_opt, front = _adam(reference), _adam(model)
    reducer, segments = _buckets(model, world_size)
    shard = ShardedOptimizer(front, ShardLayout(reducer.buckets, segments, rank))

    def step(seed: int, sharded: ShardedOptimizer) -> None:
        torch.manual_seed(seed)
        reference_opt.zero_grad()
        reference(torch.randn(8, 7)).pow(2).mean().backward()
        want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.01)
        reference_opt.step()
        _backward(model, reducer, seed)
        sharded.layout.take_bucket_gradients()
        norm = sharded.clip_grad_norm_(0.01)  # the global norm across every rank's pieces
        torch.testing.assert_close(norm.float().squeeze(), want_norm, rtol=1e-5, atol=0)
        assert want_norm > 0.01  # so the clipping acts
        sharded.step()
        for p in model.parameters():  # every rank takes the others' updated pieces (what the pull does)
            flat = p.detach().view(-1)
            pieces = [torch.zeros_like(flat) for _ in range(world_size)]
            mine = torch.zeros_like(flat)
            for pc in sharded.layout.pieces_of([p]):
                mine[pc.start : pc.end] = flat[pc.start : pc.end]
            dist.all_gather(pieces, mine)
            with torch.no_grad():
                p.copy_(torch.stack(pieces).sum(0).view_as(p))

    for seed in range(3):
        step(seed, shard)
    shard.consolidate_state_dict(to=0)
    full = shard.state_dict() if rank == 0 else None
    if rank != 0:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            shard.state_dict()
    container = [full]
    dist.broadcast_object_list(container, src=0)
    full = container[0]
    expected = reference_opt.state_dict()
    assert full["param_groups"] == expected["param_groups"]
    assert sorted(full["state"]) == sorted(expected["state"])
    for k, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(full["state"][k][key], value, rtol=0, atol=1e-6)
    # a fresh sharded optimizer resumes from the full state
    resumed = ShardedOptimizer(_adam(model), ShardLayout(reducer.buckets, segments, rank))
    resumed.load_state_dict(full)
    for seed in range(3, 5):
        step(seed, resumed)
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
    reducer.close()
    return True


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_consolidated_state_is_torch_layout_and_resumes(world_size):
    from tests.helpers.distributed import run_distributed

    assert run_distributed(_consolidate_and_reload, world_size, timeout=120) == [True] * world_size


@pytest.mark.unit
@pytest.mark.parametrize("every", [1, 3, 7, 64])
def test_pieces_split_at_partitions_cover_the_range_and_step_like_whole_ones(every):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(11)), nn.Parameter(torch.randn(2, 2))]
    bucket = GradientBucket(0, params)
    start, end = 4, bucket.grad_numel - 2  # a range that starts and ends inside parameters
    segments = [[(0, start), (start, end), (end, bucket.grad_numel)]]
    whole = ShardLayout([bucket], segments, 1, own_storage=True)
    split = ShardLayout([bucket], segments, 1, own_storage=True, split_every=every)
    covered = [(pc.bucket_start, pc.bucket_start + pc.end - pc.start) for pc in split.pieces]
    assert covered[0][0] == start and covered[-1][1] == end
    assert all(a[1] == b[0] for a, b in pairwise(covered))  # contiguous, nothing twice
    for pc, (a, b) in zip(split.pieces, covered, strict=True):
        assert (a - start) // every == (b - 1 - start) // every == split.partition_of(pc, start)
        assert pc.tensor.data_ptr() == split.storage[pc.storage_start :].data_ptr()
    boundaries = {a for a, _ in covered} | {end}
    assert {start + m * every for m in range(1, (end - start - 1) // every + 1)} <= boundaries
    # Adam over the split pieces, a partition at a time (every piece's gradient set first, as a server's arrive),
    # equals Adam over the unsplit ones: step_pieces steps exactly its pieces, and drops only their gradients
    results = []
    for layout in (whole, split):
        optimizer = ShardedOptimizer(torch.optim.Adam(params, lr=0.1), layout)
        for step in range(3):
            grad = torch.randn(end - start, generator=torch.Generator().manual_seed(step))
            for pc in layout.pieces:
                lo = pc.bucket_start - start
                pc.tensor.grad = grad[lo : lo + pc.end - pc.start].view_as(pc.tensor).clone()
            for k in sorted({layout.partition_of(pc, start) for pc in layout.pieces}):
                partition = [pc for pc in layout.pieces if layout.partition_of(pc, start) == k]
                optimizer.step_pieces(partition)
                assert all(pc.tensor.grad is None for pc in partition)
            assert all(pc.tensor.grad is None for pc in layout.pieces)
        results.append(layout.storage.clone())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    assert len(optimizer.shard.param_groups[0]["params"]) == len(split.pieces)  # the groups are whole again
