"""Lightning's feature matrix for every strategy, each run compared with Lightning's ``ddp`` on the same script
(or with one process on the global batch), plus a crash and a resume from ``ckpt_path="last"``.

``tests/scripts/features.py`` exercises many features per launch; each test below checks one of them, so a
failure names the feature and the strategy. Runs are started on first use and shared by the tests.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.replicas import assert_replicas_follow, close
from tests.helpers.runs import STRATEGIES, WITH_SERVERS, FeatureRuns
from tests.scripts.models import IN_FEATURES, reference_two_optimizers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # any test may start the shared launches (minutes)
MATRIX = [*STRATEGIES, WITH_SERVERS]

FROZEN = IN_FEATURES * IN_FEATURES + IN_FEATURES  # the frozen layer comes first in the flat weights
SAMPLES, PER_RANK_BATCH = 100, 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> FeatureRuns:
    return FeatureRuns(tmp_path_factory.mktemp("features"))


@pytest.mark.parametrize("strategy", MATRIX)
def test_fit_equals_ddp_after_every_step_with_identical_replicas(runs, strategy):
    """Uneven last batch, accumulate_grad_batches=2, clipping by norm, AdamW + StepLR, a frozen layer and a
    branch only some samples use: the weights after every batch match ``ddp``'s, identical on both ranks. AdamW and
    the clipped norm hide a gradient's scale from the weights, so under the ring the averaged gradients before
    clipping are compared too (a callback reading them would move the servers to another path: their scale is
    tests/strategies/test_scale_and_buckets.py's)."""
    ranks, ddp = runs.main(strategy), runs.main("ddp")
    history = ranks[0]["weights"]
    assert len(history) == 3 * 7  # 3 epochs of 7 batches, the last of 2 samples
    assert_replicas_follow(ranks, "weights", ddp[0]["weights"], "weights vs ddp")
    if strategy == "ring_allreduce":
        assert len(ddp[0]["grads"]) == 12  # optimizer steps: 4 per epoch of 7 batches accumulated by 2
        assert_replicas_follow(ranks, "grads", ddp[0]["grads"], "averaged gradients vs ddp")
    else:
        assert ranks[0]["grads"] is None
    assert torch.equal(history[-1][:FROZEN], history[0][:FROZEN]), "the frozen layer moved"
    assert not torch.equal(history[-1][FROZEN:], history[0][FROZEN:]), "training did not move the weights"


@pytest.mark.parametrize("strategy", MATRIX)
def test_sync_dist_logging_and_validate_test_predict_match_ddp(runs, strategy):
    ranks, ddp = runs.main(strategy), runs.main("ddp")
    for rank in range(2):
        close(torch.tensor(ranks[rank]["logged"]), torch.tensor(ddp[rank]["logged"]), f"rank {rank} logged loss")
        assert ranks[rank]["logged"] == ranks[0]["logged"], "sync_dist values differ between ranks"
        for stage, key in (("validate", "val_loss"), ("test", "test_loss")):
            got, want = ranks[rank][stage][0][key], ddp[rank][stage][0][key]
            assert got == pytest.approx(want, rel=1e-5) and got == ranks[0][stage][0][key], (stage, rank)
        predictions, reference = ranks[rank]["predict"], ddp[rank]["predict"]
        assert len(predictions) == len(reference) == 2
        for (index, out), (ref_index, ref_out) in zip(predictions, reference, strict=True):
            assert torch.equal(index, ref_index)
            close(out, ref_out, f"rank {rank} predictions")


@pytest.mark.parametrize("strategy", MATRIX)
def test_distributed_sampler_reshuffles_every_epoch_with_an_uneven_last_batch(runs, strategy):
    ranks, ddp = runs.main(strategy), runs.main("ddp")
    for rank in range(2):
        assert ranks[rank]["seen"] == ddp[rank]["seen"], f"rank {rank} saw other batches than under ddp"
    epochs = []
    for epoch in range(3):
        batches = [[i for e, b in r["seen"] if e == epoch for i in b] for r in ranks]
        assert set(batches[0]) | set(batches[1]) == set(range(SAMPLES)), f"epoch {epoch} missed samples"
        assert [len(b) for e, b in ranks[0]["seen"] if e == epoch][-1] == SAMPLES // 2 % PER_RANK_BATCH
        epochs.append(batches[0])
    assert epochs[0] != epochs[1] != epochs[2], "the sampler did not reshuffle between epochs"


@pytest.mark.parametrize("strategy", MATRIX)
def test_early_stopping_stops_all_ranks_together_and_schedulers_step(runs, strategy):
    """Only rank 1's metric stalls (after epoch 2); both ranks stop after epoch 3 of 5, as under ddp."""
    ranks, ddp = runs.main(strategy), runs.main("ddp")
    for rank in range(2):
        assert ranks[rank]["stopped"] and ranks[rank]["epochs"] == ddp[rank]["epochs"] == 3, rank
        assert ranks[rank]["global_step"] == ddp[rank]["global_step"] == 12
        assert ranks[rank]["lrs"] == ddp[rank]["lrs"] and ranks[rank]["lrs"][-1] == 0.01 / 8


@pytest.mark.parametrize("strategy", MATRIX)
def test_bf16_mixed_with_clipping_by_value_matches_ddp(runs, strategy):
    ranks, ddp = runs.main(strategy), runs.main("ddp")
    assert len(ranks[0]["bf16_weights"]) == 3
    assert_replicas_follow(ranks, "bf16_weights", ddp[0]["bf16_weights"], "bf16-mixed weights vs ddp")


@pytest.mark.parametrize("strategy", MATRIX)
def test_batchnorm_buffers_follow_rank_zero_as_under_ddp(runs, strategy):
    ranks, ddp = runs.main(strategy), runs.main("ddp")
    assert len(ranks[0]["bn_weights"]) == 3
    assert_replicas_follow(ranks, "bn_weights", ddp[0]["bn_weights"], "BatchNorm model weights vs ddp")
    for rank in range(2):
        assert len(ranks[rank]["bn_buffers"]) == 3, f"rank {rank} recorded {len(ranks[rank]['bn_buffers'])} steps"
        for step, (got, want) in enumerate(zip(ranks[rank]["bn_buffers"], ddp[rank]["bn_buffers"], strict=True)):
            assert torch.equal(got, ranks[0]["bn_buffers"][step]), f"rank {rank} buffers differ from rank 0's"
            close(got, want, f"rank {rank} BatchNorm buffers at step {step + 1}")


@pytest.mark.parametrize("strategy", MATRIX)
def test_manual_optimization_two_optimizers_and_plateau_scheduler_equal_one_process(runs, strategy):
    """GAN-style: ``toggle_optimizer``, ``manual_backward``, StepLR and ReduceLROnPlateau stepped on a
    ``sync_dist`` loss; compared with the same loop in one process on the global batch."""
    ranks = runs.main(strategy)
    reference, lrs = reference_two_optimizers(2 * 8, 4)
    assert [lr for pair in ranks[0]["gan_lrs"] for lr in pair] == pytest.approx([lr for pair in lrs for lr in pair])
    assert lrs[-1][0] < lrs[0][0] and lrs[-1][1] < 0.1  # both schedulers acted
    assert_replicas_follow(ranks, "gan_weights", reference, "GAN weights vs one process")


@pytest.mark.parametrize("strategy", MATRIX)
def test_sockets_listen_only_on_loopback_in_a_single_node_run(runs, strategy):
    for rank, result in enumerate(runs.main(strategy)):
        addresses = {s["address"] for s in result["sockets"]}
        assert addresses == {"127.0.0.1"}, f"rank {rank} holds sockets on {addresses}"
        assert any(s["listening"] for s in result["sockets"])


@pytest.mark.parametrize("strategy", MATRIX)
def test_killed_rank_then_resume_from_last_equals_the_run_that_never_crashed(runs, strategy):
    returncode, output, seconds, resumed = runs.crash(strategy)
    assert returncode != 0
    named = re.search(r"PeerUnreachableError: (rank|trainer) 0 could not [a-z' ]+ (rank|trainer) 1\b", output)
    assert named, output[-3000:]
    assert seconds < 120, f"the surviving rank took {seconds:.0f}s to stop"
    uninterrupted = runs.main(strategy)
    for rank in range(2):
        assert resumed[rank]["epochs"] == 3  # EarlyStopping's state came back with the checkpoint
        assert resumed[rank]["lrs"] == uninterrupted[rank]["lrs"][-7:]
        assert torch.equal(resumed[rank]["final"], uninterrupted[rank]["final"]), f"rank {rank} ends elsewhere"


def test_a_rank_lost_among_three_is_named_in_lightnings_collectives(tmp_path):
    """With three ranks the lost one is found behind the address in gloo's error (the peer directory)."""
    args = ["--strategy", "ring_allreduce", "--phase", "crash", "--devices", "3", "--kill-rank", "2"]
    crashed = run_script("features", *args, "--out", str(tmp_path), timeout=180, check=False)
    assert crashed.returncode != 0
    expected = "PeerUnreachableError: rank 0 could not reach rank 2 during Lightning's reduce"
    assert expected in crashed.stdout, crashed.stdout[-3000:]
