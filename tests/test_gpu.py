"""NCCL on CUDA devices (skipped without at least two GPUs): the ring on CUDA tensors, then the whole feature
matrix and every drop-in case for every strategy against Lightning's ``ddp`` on the GPUs, where the
communication thread runs on its own CUDA stream behind events recorded on the streams that produced the
gradients, and Lightning's collectives use a second NCCL communicator."""

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm import ring_allreduce
from tests.helpers import replicas
from tests.helpers.distributed import run_distributed
from tests.helpers.runs import STRATEGIES, DropInRuns, FeatureRuns, assert_follows_ddp

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least two CUDA devices for NCCL"),
]
GPU = {"LIGHTNING_DP_TEST_ACCELERATOR": "gpu"}
#: NCCL sums in its own order, and cuBLAS kernels are not bitwise reproducible across ranks' streams
GPU_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def _ring_on_cuda(rank, world_size):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in (0, 1, 7, 1_000_003):
            x = torch.randint(-8, 9, (numel,), device="cuda", generator=None).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            ring_allreduce(x, op="sum")
            assert torch.equal(x, expected), (dtype, numel)
    return True


@pytest.mark.parametrize("world_size", [2])
def test_ring_allreduce_nccl(world_size):
    assert all(run_distributed(_ring_on_cuda, world_size, backend="nccl", timeout=180))


@pytest.fixture(scope="module")
def feature_runs(tmp_path_factory):
    return FeatureRuns(tmp_path_factory.mktemp("features-gpu"), env=GPU)


@pytest.fixture(scope="module")
def dropin_runs(tmp_path_factory):
    return DropInRuns(tmp_path_factory.mktemp("dropin-gpu"), env=GPU)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_feature_matrix_under_nccl_follows_ddp(feature_runs, strategy, monkeypatch):
    monkeypatch.setattr(replicas, "TOLERANCE", GPU_TOLERANCE)
    ranks, ddp = feature_runs.main(strategy), feature_runs.main("ddp")
    for key in ("weights", "bf16_weights", "bn_weights"):
        replicas.assert_replicas_follow(ranks, key, ddp[0][key], f"{key} vs ddp under NCCL")
    for rank in range(2):
        assert ranks[rank]["seen"] == ddp[rank]["seen"] and ranks[rank]["epochs"] == ddp[rank]["epochs"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "case", ["hooks", "add_group", "compiled", "compiled_submodule", "reentrant", "syncbn", "resume"]
)
def test_drop_in_cases_under_nccl_follow_ddp(dropin_runs, strategy, case):
    assert_follows_ddp(dropin_runs, strategy, case, GPU_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_16_bit_cases_under_nccl_follow_ddp(dropin_runs, strategy):
    assert_follows_ddp(dropin_runs, strategy, "fp16", dict(rtol=2e-3, atol=2e-3))
    assert_follows_ddp(dropin_runs, strategy, "bf16", dict(rtol=1e-2, atol=1e-2))


def _codecs_on_cuda(rank, world_size):
    from torch import nn

    from lightning_dp.comm.buckets import BucketReducer
    from lightning_dp.comm.codecs import make_codec
    from lightning_dp.comm.transports import RingTransport, ShardedServerTransport

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 32)).cuda()
    for transport_kind in (RingTransport, ShardedServerTransport):
        for name, tolerance in (("bf16", 2e-2), ("fp16", 4e-3), ("powersgd", None)):
            reducer = BucketReducer(model.parameters(), lambda b: None)
            transport = transport_kind()
            transport.bind(reducer.buckets)
            codec = make_codec(name, powersgd_warmup_steps=0)
            codec.bind(reducer.buckets, transport)
            generator = torch.Generator(device="cuda").manual_seed(rank)
            for bucket in reducer.buckets:
                for i, p in enumerate(bucket.params):
                    bucket.fill(i, torch.randn(p.shape, device="cuda", generator=generator))
                exact = bucket.buffer[: bucket.grad_numel].clone()
                dist.all_reduce(exact)
                exact /= world_size
                codec.reduce(bucket, transport)
                codec.share(bucket, transport)
                got = bucket.buffer[: bucket.grad_numel]
                gathered = [torch.empty_like(got) for _ in range(world_size)]
                dist.all_gather(gathered, got)
                assert all(torch.equal(g, gathered[0]) for g in gathered), (transport_kind.__name__, name)
                if tolerance is not None:
                    assert (got - exact).abs().max().item() <= tolerance * exact.abs().max().item(), name
            reducer.close()
    return True


def test_codecs_under_nccl_keep_replicas_identical():
    assert all(run_distributed(_codecs_on_cuda, 2, backend="nccl", timeout=180))
