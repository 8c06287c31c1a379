"""Finding the first gradient with NaN or infinity, without false alarms from sums that overflow."""

import pytest
import torch

from lightning_dp.comm.nonfinite import first_nonfinite

pytestmark = pytest.mark.unit


def _pairs(*grads):
    return [(torch.nn.Parameter(torch.zeros_like(g)), g) for g in grads]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_names_the_first_parameter_with_a_nonfinite_gradient(bad, dtype):
    grads = [torch.ones(5, dtype=dtype), torch.ones(3, 4, dtype=dtype), torch.ones(7, dtype=dtype)]
    grads[1][2, 1] = bad
    grads[2][0] = bad
    pairs = _pairs(*grads)
    assert first_nonfinite(pairs) is pairs[1][0]


def test_plus_and_minus_infinity_in_one_gradient_are_found():
    g = torch.zeros(10)
    g[3], g[7] = float("inf"), float("-inf")
    pairs = _pairs(torch.ones(2), g)
    assert first_nonfinite(pairs) is pairs[1][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_values_whose_sum_overflows_are_not_reported(dtype):
    big = torch.full((1000,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert first_nonfinite(_pairs(torch.ones(3, dtype=dtype), big)) is None
    assert first_nonfinite([]) is None
