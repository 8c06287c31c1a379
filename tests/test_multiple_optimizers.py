"""Manual optimization with two optimizers, toggle_optimizer and LR schedulers, unchanged, under every strategy."""

import pytest
import torch

from tests.launch import load_ranks, run_script
from tests.scripts.models import reference_two_optimizers
from tests.test_ring_strategy import assert_identical_replicas

STEPS = 4


@pytest.mark.parametrize("strategy", ["ring_allreduce", "parameter_server", "sharded_ps"])
def test_gan_style_module_equals_single_process(tmp_path, strategy):
    run_script("fit_gan", "--strategy", strategy, "--devices", "2", "--steps", str(STEPS), "--out", str(tmp_path))
    ranks = load_ranks(tmp_path, 2)
    assert_identical_replicas(ranks)
    reference, lrs = reference_two_optimizers(16, STEPS)
    assert len(ranks[0]["weights"]) == STEPS
    assert [lr for pair in ranks[0]["lrs"] for lr in pair] == pytest.approx([lr for pair in lrs for lr in pair])
    assert lrs[-1][0] < lrs[0][0] and lrs[-1][1] < 0.1  # both schedulers acted
    for step, (got, want) in enumerate(zip(ranks[0]["weights"], reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step + 1} differs from one process")
