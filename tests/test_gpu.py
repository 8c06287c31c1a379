"""NCCL on CUDA tensors (skipped without at least two GPUs)."""

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm import ring_allreduce
from tests.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least two CUDA devices for NCCL"),
]


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
