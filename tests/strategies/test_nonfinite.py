"""The rule for NaN/inf gradients: every rank raises NonFiniteGradientError with the step, before stepping."""

import pytest

from tests.helpers.launch import run_script

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("strategy", ["ring_allreduce", "parameter_server", "sharded_ps"])
def test_a_nan_on_one_rank_stops_every_rank_at_that_step(strategy):
    result = run_script("nonfinite", "--strategy", strategy, check=False, timeout=150)
    assert result.returncode != 0
    message = "non-finite (NaN or infinite) averaged gradient at global step 2"
    assert result.stdout.count(message) >= 2, result.stdout[-4000:]  # both ranks, not only the one with the NaN
    assert "FINISHED" not in result.stdout


@pytest.mark.parametrize("strategy", ["ring_allreduce", "parameter_server", "sharded_ps"])
def test_gradients_sanitized_in_a_hook_train_on_as_under_ddp(strategy):
    """The check looks at the gradients the optimizer is about to use: after the hooks, as DDP's user sees them."""
    result = run_script("nonfinite", "--strategy", strategy, "--sanitize", timeout=150)
    assert "FINISHED" in result.stdout
