"""Checkpoints hold the full model and optimizer state in torch's layout and resume under any strategy."""

import pytest
import torch

from tests.helpers.launch import load_ranks, run_script
from tests.scripts.models import RegressionModel, reference_training

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # two launches per test

BATCH = 8
STEPS_PER_EPOCH = 96 // (2 * BATCH)


@pytest.mark.parametrize(
    "first, second",
    # a ring's checkpoint has ddp's layout: tests/strategies/test_drop_in.py resumes every strategy from one ddp wrote
    [("sharded_ps", "ring_allreduce"), ("parameter_server", "single_device")],
)
def test_resume_under_another_strategy_matches_uninterrupted_run(tmp_path, first, second):
    ckpt = tmp_path / "epoch1.ckpt"
    run_script("resume", "--strategy", first, "--max-epochs", "1", "--save-to", str(ckpt), "--out", str(tmp_path / "a"))
    saved = torch.load(ckpt, weights_only=False)
    # standard layout: one entry per parameter, full shapes, as torch.optim.AdamW.state_dict() writes it
    params = list(RegressionModel().parameters())  # the optimizer gets all of them; frozen ones hold no state
    state = saved["optimizer_states"][0]["state"]
    assert sorted(state) == [k for k, p in enumerate(params) if p.requires_grad]
    for k in state:
        assert state[k]["exp_avg"].shape == params[k].shape and state[k]["exp_avg_sq"].shape == params[k].shape
    # AdamW counts only the steps a parameter had a gradient: the sometimes-used branch has fewer
    assert max(float(state[k]["step"]) for k in state) == STEPS_PER_EPOCH

    args = ["--strategy", second, "--max-epochs", "2", "--resume-from", str(ckpt), "--out", str(tmp_path / "b")]
    if second == "single_device":
        args += ["--batch-size", str(2 * BATCH)]
    run_script("resume", *args)
    resumed = load_ranks(tmp_path / "b", 1 if second == "single_device" else 2)
    assert resumed[0]["global_step"] == 2 * STEPS_PER_EPOCH
    for r in resumed[1:]:
        assert torch.equal(r["weights"][-1], resumed[0]["weights"][-1])
    uninterrupted = reference_training(2 * BATCH, 2 * STEPS_PER_EPOCH, "adamw")
    torch.testing.assert_close(resumed[0]["weights"][-1], uninterrupted[-1], rtol=1e-5, atol=1e-5)
