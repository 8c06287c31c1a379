"""Replicas built differently are caught at set-up, on every rank, naming the rank and the tensor."""

import pytest
import torch
from torch import nn

from lightning_dp.comm.cluster.fingerprint import ReplicaMismatchError, check_replicas_match, module_fingerprint
from tests.helpers.distributed import run_distributed


def _check(rank, world_size, variant):
    width = 32
    if variant == "shape" and rank == 2:
        width = 16  # e.g. an override typo on one node
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))
    if variant == "frozen" and rank == 1:
        model[0].requires_grad_(False)
    try:
        check_replicas_match(model)
    except ReplicaMismatchError as error:
        return str(error)
    return "same"


@pytest.mark.multiprocess
def test_identical_replicas_pass():
    assert run_distributed(_check, 3, "none", timeout=60) == ["same"] * 3


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "variant, expected",
    [
        ("shape", "the model on rank 2 differs from rank 0: at position 0 rank 2 has parameter '0.weight' of shape "
                  "(16, 8) float32 trainable, rank 0 has parameter '0.weight' of shape (32, 8) float32 trainable"),
        ("frozen", "rank 1 has parameter '0.weight' of shape (32, 8) float32 frozen"),
    ],
)  # fmt: skip
def test_mismatch_is_reported_on_every_rank(variant, expected):
    messages = run_distributed(_check, 3, variant, timeout=60)
    assert all(expected in m for m in messages), messages


@pytest.mark.unit
def test_fingerprint_lists_parameters_and_buffers():
    fp = module_fingerprint(nn.BatchNorm1d(4))
    assert [e[:2] for e in fp] == [("parameter", "weight"), ("parameter", "bias"), ("buffer", "running_mean"),
                                   ("buffer", "running_var"), ("buffer", "num_batches_tracked")]  # fmt: skip
    assert fp[-1][3] == str(torch.int64)
