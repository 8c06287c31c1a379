"""What leaves a process as a pickle, and the full optimizer state a checkpoint holds, are in host memory: a CPU-only
dedicated server must read them, and no rank may rebuild the whole state on a GPU (checked with tensors that say they
live on ``cuda:1``, :class:`~tests.helpers.devices.OnDevice`)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_dp.comm.host import to_host
from lightning_dp.comm.servers.members import MemberGroup
from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout
from lightning_dp.strategies.engines import synchronous
from lightning_dp.strategies.engines.synchronous import CentralServerEngine
from tests.comm.test_sharded_optimizer import _adam, _backward, _buckets, _model
from tests.helpers.devices import OnDevice, tensors_in

pytestmark = pytest.mark.unit


def _device_state() -> dict:
    """An optimizer state as Lightning loads a checkpoint saved on a GPU: tensors on the device they were saved from."""
    return {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": OnDevice(torch.arange(4.0))}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
    }


def _assert_host_only(obj, like) -> None:
    tensors, expected = tensors_in(obj), tensors_in(like)
    assert len(tensors) == len(expected) == 2
    for tensor, want in zip(tensors, expected, strict=True):
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu"
        assert torch.equal(tensor, want.to("cpu"))


def test_to_host_copies_device_tensors_and_keeps_everything_else():
    state = _device_state()
    host = to_host(state)
    _assert_host_only(host, state)
    assert host["state"][0]["step"] is state["state"][0]["step"]  # a host tensor is not copied
    assert host["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]


def test_an_object_sent_to_a_member_holds_host_tensors_only():
    """The payload trainer 0 sends a dedicated server (a checkpoint's state to load, a step's control)."""
    group = MemberGroup.__new__(MemberGroup)
    sent = []
    group.isend = lambda tensor, member, tag: sent.append(tensor.clone())
    group.wait = lambda *args, **kwargs: None
    state = _device_state()
    group.send_object(state, member=2)
    size, data = sent
    assert int(size) == data.numel()
    _assert_host_only(pickle.loads(data.numpy().tobytes()), state)


def test_the_central_server_hands_rank_zero_its_state_in_host_memory(monkeypatch):
    """``server_rank=1``: rank 0 gathers the server's state to save it, and must not rebuild it on the server's GPU."""
    gathered = []
    monkeypatch.setattr(synchronous.dist, "gather_object", lambda obj, *args, **kwargs: gathered.append(obj))
    strategy = SimpleNamespace(global_rank=1, world_size=2, is_global_zero=False)
    engine = CentralServerEngine(strategy, server_rank=1)
    optimizer = SimpleNamespace(state_dict=_device_state)
    assert engine.optimizer_state(optimizer) == {}
    _assert_host_only(gathered[0], _device_state())


def test_the_consolidated_state_is_assembled_in_host_memory():
    """Each rank's pieces arrive on the CPU; the full state stays there whatever device the parameters are on (a GPU
    would need the whole state, defeating the sharding), and equals one optimizer's."""
    reference, model = _model(), _model()
    reference_opt, front = _adam(reference), _adam(model)
    reducer, segments = _buckets(model, 2)
    shards = [ShardedOptimizer(front, ShardLayout(reducer.buckets, segments, rank)) for rank in range(2)]
    for step in range(2):
        _backward(model, reducer, seed=step)
        _backward(reference, BucketReducerless(), seed=step)
        for shard in shards:
            shard.layout.take_bucket_gradients()
            shard.step()
        reference_opt.step()
    pieces = [shard.local_state() for shard in shards]
    for param in model.parameters():  # the parameters now live on another device than the host
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device="meta")))
    shards[0].merge_states(pieces)
    merged, expected = shards[0].state_dict(), reference_opt.state_dict()
    assert sorted(merged["state"]) == sorted(expected["state"]) and merged["state"]
    for index, state in expected["state"].items():
        assert sorted(merged["state"][index]) == sorted(state)
        for key, value in state.items():
            got = merged["state"][index][key]
            assert got.device.type == "cpu", (index, key, got.device)
            torch.testing.assert_close(got, value, rtol=1e-6, atol=1e-7)


class BucketReducerless:
    """The reference trains without buckets: nothing to finish."""

    def finish(self, copy_back: bool = True) -> None:
        pass
