"""``balance="throughput"``: equal speeds give today's step bit for bit; a slow rank trains a smaller share while every
step stays the step of one process on the same global batch; a mid-epoch resume continues the same shares exactly."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.midepoch import read_seen, replay, replay_loss
from tests.helpers.replicas import close

pytestmark = pytest.mark.multiprocess

BATCH, SAMPLES, DEVICES = 4, 64, 2
#: the straggler: rank 1 sleeps this long per sample it trains (its other costs are a few milliseconds per batch)
SLOW = ("--slow-rank", "1", "--slow-per-sample", "0.01", "--balance", "throughput", "--balance-interval", "2")


def _ranks(folder) -> list[dict]:
    return [torch.load(folder / f"rank{r}.pt") for r in range(DEVICES)]


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    """``tests/scripts/midepoch.py`` with a slow rank under ``balance="throughput"``, once per (strategy, options) in
    this module (the resume test continues one of them). Returns (folder, each rank's results)."""
    runs: dict[tuple, tuple] = {}

    def run(strategy: str, *options: str):
        key = (strategy, *options)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"balanced-{strategy}")
            run_script("midepoch", "--strategy", strategy, *options, *SLOW, "--out", str(out), timeout=180)
            runs[key] = (out, _ranks(out))
        return runs[key]

    return run


@pytest.mark.parametrize(
    "strategy, options",
    [("ring_allreduce", ()), ("sharded_ps", ("--workers", "2")), ("parameter_server", ("--accumulate", "2"))],
)
def test_equal_speeds_train_todays_batches_bit_for_bit(tmp_path, uninterrupted, strategy, options):
    _, today = uninterrupted(strategy, *options)
    run_script("midepoch", "--strategy", strategy, *options, "--balance", "throughput", "--out", str(tmp_path),
               timeout=180)  # fmt: skip
    balanced = _ranks(tmp_path)
    assert balanced[0]["decisions"] == [[[0, 0], [BATCH] * DEVICES]], "equal speeds changed the shares"
    for rank, (a, b) in enumerate(zip(today, balanced, strict=True)):
        assert a["trained"] == b["trained"], rank
        assert len(a["history"]) == len(b["history"]) == 2 * SAMPLES // (BATCH * DEVICES), rank
        for (epoch, batch, want), (_, _, got) in zip(a["history"], b["history"], strict=True):
            assert torch.equal(got, want), (rank, epoch, batch)


def _replay(ranks: list[dict], accumulate: int) -> list[torch.Tensor]:
    """One process training the ranks' global batches (the union of what every rank trained at each batch)."""
    batches = [[i for rank in ranks for i in rank["trained"][j]] for j in range(len(ranks[0]["trained"]))]
    return replay(batches, ranks[0]["history"], SAMPLES, accumulate)


@pytest.mark.parametrize(
    "strategy, options",
    [("ring_allreduce", ("--accumulate", "2")), ("sharded_ps", ("--workers", "2")), ("parameter_server", ())],
)
def test_a_slow_rank_trains_less_and_every_step_is_the_global_batchs(slow_runs, strategy, options):
    _, ranks = slow_runs(strategy, *options)
    accumulate = 2 if "--accumulate" in options else 1
    sizes = [[len(batch) for batch in rank["trained"]] for rank in ranks]
    assert len(sizes[0]) == len(sizes[1]) == 2 * SAMPLES // (BATCH * DEVICES)
    assert all(a + b == BATCH * DEVICES for a, b in zip(*sizes, strict=True)), sizes  # the global batch stays whole
    assert sizes[1][0] == BATCH and min(sizes[1]) < BATCH, sizes  # equal at first, then the slow rank trains less
    decisions = ranks[0]["decisions"]
    assert len(decisions) >= 2 and decisions == ranks[1]["decisions"]
    # each batch's sizes follow the schedule in force at it
    for j, (epoch, batch, _) in enumerate(ranks[0]["history"]):
        in_force = [shares for start, shares in decisions if tuple(start) <= (epoch, batch)][-1]
        assert [sizes[0][j], sizes[1][j]] == in_force, (epoch, batch)
    trained = [sorted(i for rank in ranks for i in rank["trained"][j]) for j in range(len(sizes[0]))]
    for epoch in range(2):  # every epoch trains every sample once
        per_epoch = SAMPLES // (BATCH * DEVICES)
        assert sorted(i for batch in trained[epoch * per_epoch : (epoch + 1) * per_epoch] for i in batch) == list(
            range(SAMPLES)
        )
    reference = _replay(ranks, accumulate)
    for j, want in enumerate(reference):
        got = ranks[0]["history"][j][2]
        assert torch.equal(got, ranks[1]["history"][j][2]), f"the replicas differ after batch {j}"
        close(got, want, f"{strategy}: after batch {j}")


def test_a_mid_epoch_resume_continues_with_the_same_shares(tmp_path, slow_runs):
    full_dir, full = slow_runs("sharded_ps", "--workers", "2")
    step = 12  # epoch 1, batch 4 of 8
    resumed_dir = tmp_path / "resumed"
    # no decision after the resume: the batches are those of the schedule the checkpoint holds
    run = run_script("midepoch", "--strategy", "sharded_ps", "--workers", "2", *SLOW[:-1], "1000", "--resume-from",
                     str(full_dir / "ckpt" / f"step={step}.ckpt"), "--out", str(resumed_dir), timeout=180)  # fmt: skip
    assert "the balanced sampler skips the 4 batches" in run.stdout, run.stdout[-3000:]
    resumed = _ranks(resumed_dir)
    saved = [d for d in full[0]["decisions"] if tuple(d[0]) <= (1, 4)]
    assert resumed[0]["decisions"] == saved and len(saved) >= 2
    later = [tuple(d[0]) for d in full[0]["decisions"] if tuple(d[0]) > (1, 4)]
    same = [j for j, (epoch, batch, _) in enumerate(full[0]["history"]) if (epoch, batch) >= (1, 4)]
    same = [j for j in same if not later or full[0]["history"][j][:2] < later[0]]
    assert len(same) >= 1 and len(resumed[0]["history"]) == 4
    for rank in range(DEVICES):
        for k, j in enumerate(same):
            assert resumed[rank]["trained"][k] == full[rank]["trained"][j], (rank, j)
            assert torch.equal(resumed[rank]["history"][k][2], full[rank]["history"][j][2]), (rank, j)


def test_a_slow_rank_and_a_lost_one_the_survivors_shares_follow_their_speeds(tmp_path):
    """Three ranks, rank 1 slow, rank 2 lost in its training step at step 6 (``on_rank_loss="continue"``): the
    decisions before and after the loss give rank 1 less, rank 2's share goes to the survivors (0 from then on),
    every step after the deal trains the whole global batch, and every step is one process's on the samples trained."""
    devices, samples, lost_at = 3, 72, 6
    run_script("midepoch", "--strategy", "ring_allreduce", "--devices", str(devices), "--samples", str(samples),
               "--batch-size", str(BATCH), "--max-epochs", "2", "--intra-node", "ring", *SLOW, "--on-rank-loss",
               "continue", "--heartbeat-timeout", "2", "--lose-rank", "2", "--lose-at-step", str(lost_at), "--out",
               str(tmp_path), timeout=180)  # fmt: skip
    survivors = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert survivors[0]["rank_loss"]["lost_ranks"] == [2]
    decisions = survivors[0]["decisions"]
    assert decisions == survivors[1]["decisions"]
    global_batch = BATCH * devices
    before = [shares for start, shares in decisions if shares[2] > 0]
    after = [shares for start, shares in decisions if shares[2] == 0]
    # a decision before the loss, the deal (the survivors' shares in proportion), and decisions over the survivors
    assert len(before) >= 2 and len(after) >= 2, decisions
    assert before[-1][1] < before[-1][0], decisions  # the slow rank trains less
    assert after[-1][1] < after[0][1] < after[0][0], decisions  # and, measured among the survivors, less again
    assert all(sum(shares) == global_batch for _, shares in decisions), decisions
    sizes = [[len(batch) for batch in s["trained"]] for s in survivors]
    steps = len(sizes[0])
    for j, (epoch, batch, _) in enumerate(survivors[0]["history"]):  # each batch follows the schedule in force at it
        in_force = [shares for start, shares in decisions if tuple(start) <= (epoch, batch)][-1]
        if in_force[2] == 0:
            assert [sizes[0][j], sizes[1][j]] == in_force[:2], (epoch, batch)
    assert sizes[0][-1] + sizes[1][-1] == global_batch
    reference = replay_loss(survivors, read_seen(tmp_path / "seen-rank2.txt"), samples)
    assert len(reference) == steps == 2 * samples // global_batch
    for j, want in enumerate(reference):
        got = survivors[0]["history"][j][2]
        assert torch.equal(got, survivors[1]["history"][j][2]), f"the replicas differ after batch {j}"
        close(got, want, f"after batch {j}")
