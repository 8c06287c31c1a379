"""``on_rank_loss="continue"``: the survivors of a killed rank go on without a restart; from the loss on every
step is one process's step on the samples the survivors trained, the replicas stay bit-identical, and the global
batch is whole again once the lost rank's share is dealt among the survivors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.midepoch import read_seen, replay_loss
from tests.helpers.replicas import close

pytestmark = pytest.mark.multiprocess

DEVICES, BATCH, SAMPLES, EPOCHS = 3, 4, 72, 2
GLOBAL_BATCH = DEVICES * BATCH
LOST_AT = 4
#: how a rank dies at step LOST_AT (rank 2 unless named), and what each survivor then does:
#: - "in flight": SIGKILLed in its training step: no one completes that step's exchange; every survivor exchanges
#:   its gradients again over the survivors (the lost rank's samples of the step are dropped);
#: - "one behind": SIGKILLed after its exchange completed everywhere, while rank 1 has not committed it yet: rank 0
#:   committed the step with every rank's samples, rank 1 takes rank 0's weights and optimizer state instead of its
#:   own update;
#: - "in flight, shared memory, collectives": as "in flight", the ranks exchanging through shared memory (the default
#:   on one machine) and the training step logging with sync_dist and all-gathering, which meets the loss first: the
#:   step trains over the survivors from its collective on, nothing runs again;
#: - "in flight, bf16": as "in flight", the gradients travelling in 16 bits with error feedback: the codec is bound
#:   again to the survivors' ring, each keeping its residual and dividing by their number (a codec left dividing by
#:   the ranks it started with fails), and the lost rank's residual is counted as lost;
#: - "rank 0 in flight, one process per host": as "in flight", losing global rank 0, each rank started on its own as
#:   a single-device node (Lightning's general cluster environment): its roles (the store, checkpoints, logging) move
#:   to rank 1.
#: The second and third also validate every epoch (after the loss); the last fits once more after the fit, with a new
#: Trainer in the same job (the ranks lost in the first fit stay out from its first batch).
SCENARIOS = {
    "in flight": ("--intra-node", "ring"),
    "one behind": ("--intra-node", "ring", "--lose-after-backward", "--slow-commit-rank", "1", "--collectives",
                   "--validate"),
    "in flight, shared memory, collectives": ("--collectives", "--validate"),
    "in flight, bf16": ("--intra-node", "ring", "--compression", "bf16"),
    "rank 0 in flight, one process per host": ("--intra-node", "ring", "--collectives", "--refit-epochs", "1"),
}  # fmt: skip
LOST = {"rank 0 in flight, one process per host": 0}
PER_HOST = {"rank 0 in flight, one process per host"}


@dataclass
class Run:
    scenario: str
    lost: int
    out: Path
    #: the survivors' records, in rank order
    survivors: list[dict]
    #: what the lost rank trained at each step until it died
    seen: dict[int, list[int]]

    @property
    def left(self) -> list[int]:
        return [r for r in range(DEVICES) if r != self.lost]


_runs: dict[str, Run] = {}


def _launch(scenario: str, tmp_path_factory) -> Run:
    """The scenario's job, run once per session."""
    if scenario not in _runs:
        out = tmp_path_factory.mktemp("ring-loss")
        lost = LOST.get(scenario, 2)
        per_host = scenario in PER_HOST
        result = run_script(
            "midepoch", "--strategy", "ring_allreduce", "--devices", "1" if per_host else str(DEVICES),
            "--num-nodes", str(DEVICES) if per_host else "1",
            "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss",
            "continue", "--heartbeat-timeout", "2", "--lose-rank", str(lost), "--lose-at-step", str(LOST_AT),
            *SCENARIOS[scenario], "--out", str(out), timeout=180, check=not per_host, deaths_expected=per_host,
            env={"LIGHTNING_DP_TEST_NODES": str(DEVICES)} if per_host else None,
        )  # fmt: skip
        if per_host:  # the lost process was killed; every other one finished
            want = [-9 if r == lost else 0 for r in range(DEVICES)]
            assert result.codes == want, result.stdout[-5000:]
        assert not (out / f"rank{lost}.pt").exists()
        survivors = [torch.load(out / f"rank{r}.pt") for r in range(DEVICES) if r != lost]
        _runs[scenario] = Run(scenario, lost, out, survivors, read_seen(out / f"seen-rank{lost}.txt"))
    return _runs[scenario]


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def ring_loss(request, tmp_path_factory) -> Run:
    return _launch(request.param, tmp_path_factory)


def _with_lost(survivors: list[dict]) -> int:
    """How many steps trained the lost rank's samples too (the exchanges committed with it)."""
    return survivors[0]["rank_loss"]["loss_steps"][0]


def test_the_survivors_agree_on_the_loss_and_finish(ring_loss):
    scenario, survivors, seen = ring_loss.scenario, ring_loss.survivors, ring_loss.seen
    metrics = survivors[0]["rank_loss"]
    agreed = ("lost_ranks", "loss_causes", "loss_steps", "dropped_samples")
    assert all({k: s["rank_loss"][k] for k in agreed} == {k: metrics[k] for k in agreed} for s in survivors)
    assert metrics["lost_ranks"] == [ring_loss.lost] and metrics["loss_causes"] == ["closed"], metrics
    assert max(seen) == LOST_AT
    redone = [s["rank_loss"]["redone_steps"] for s in survivors]
    caught_up = [s["rank_loss"]["caught_up_steps"] for s in survivors]
    collectives = "--collectives" in SCENARIOS[scenario]
    if "in flight" in scenario and not collectives:  # every survivor committed LOST_AT steps with the lost rank,
        # then redid one
        assert _with_lost(survivors) == LOST_AT and redone == [1, 1] and caught_up == [0, 0], metrics
    elif "in flight" in scenario:  # the all-gather met the loss: that step trained without it, once
        assert _with_lost(survivors) == LOST_AT and redone == [0, 0] and caught_up == [0, 0], metrics
    else:  # rank 0 committed LOST_AT with it; rank 1 took rank 0's state for that step; nothing ran again
        assert _with_lost(survivors) == LOST_AT + 1 and redone == [0, 0] and caught_up == [0, 1], metrics
    for s in survivors:
        assert len(s["rank_loss"]["recovery_seconds"]) == 1 and s["rank_loss"]["recovery_seconds"][0] < 2.0
        assert f"lost rank {ring_loss.lost} (closed) after {_with_lost(survivors)} steps" in s["monitor_table"]
    steps = EPOCHS * SAMPLES // GLOBAL_BATCH
    for s in survivors:
        assert len(s["history"]) == steps and s["global_step"] == steps


def test_the_global_batch_is_dealt_among_the_survivors_and_every_sample_is_trained_or_counted(ring_loss):
    survivors, seen = ring_loss.survivors, ring_loss.seen
    with_lost = _with_lost(survivors)
    steps = len(survivors[0]["trained"])
    sizes = [[len(s["trained"][j]) for s in survivors] for j in range(steps)]
    assert all(row == [BATCH] * len(survivors) for row in sizes[: LOST_AT + 1]), sizes  # before, and in flight
    # once dealt, the survivors' shares make up the whole global batch, evenly
    dealt = [j for j in range(steps) if sum(sizes[j]) == GLOBAL_BATCH]
    assert dealt and dealt[0] <= LOST_AT + 2 and dealt == list(range(dealt[0], steps)), sizes
    assert all(max(sizes[j]) - min(sizes[j]) <= 1 for j in dealt), sizes
    # what no one trained: the lost rank's share of the step in flight and of any batch drawn before the deal
    per_epoch = SAMPLES // GLOBAL_BATCH
    dropped = 0
    for epoch in range(EPOCHS):
        trained = [i for j in range(epoch * per_epoch, (epoch + 1) * per_epoch) for s in survivors
                   for i in s["trained"][j]]  # fmt: skip
        trained += [i for j, indices in seen.items() if j < with_lost and j // per_epoch == epoch for i in indices]
        assert len(trained) == len(set(trained)), f"epoch {epoch}: a sample trained twice"
        missing = set(range(SAMPLES)) - set(trained)
        if epoch == 0 and with_lost == LOST_AT:
            assert set(seen[LOST_AT]) <= missing  # the lost rank's samples of the step in flight
        dropped += len(missing)
    assert dropped == GLOBAL_BATCH * steps - sum(map(sum, sizes)) - BATCH * with_lost
    assert all(s["rank_loss"]["dropped_samples"] == dropped for s in survivors)
    if with_lost == LOST_AT:
        assert dropped >= BATCH


def test_lightning_collectives_and_validation_run_over_the_survivors(ring_loss):
    options, survivors = SCENARIOS[ring_loss.scenario], ring_loss.survivors
    if "--collectives" not in options:  # this scenario's step runs none of its own
        assert all(not s["gathered"] and not s["validated"] for s in survivors)
        return
    with_lost = _with_lost(survivors)
    everyone, left = list(range(DEVICES)), ring_loss.left
    for s in survivors:  # all_gather inside the training step, and the world size the trainer reports
        assert s["gathered"] == [everyone if j < with_lost else left for j in range(len(s["gathered"]))]
        assert s["world_sizes"] == [DEVICES if j < with_lost else DEVICES - 1 for j in range(len(s["world_sizes"]))]
    if "--validate" not in options:
        assert all(not s["validated"] for s in survivors)
        return
    # each epoch's validation (both after the loss) evaluates every sample once, over the survivors
    for epoch in range(EPOCHS):
        seen = [i for s in survivors for e, indices in s["validated"] if e == epoch for i in indices]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}"
    losses = [s["val_loss"] for s in survivors]
    assert losses[0] == losses[1] and math.isfinite(losses[0])  # sync_dist: one value on every rank
    # a torchmetrics metric syncs over the survivors, in the fit and in a validation after it (a later stage)
    for s in survivors:
        assert s["val_counted"] == [SAMPLES, SAMPLES], s["val_counted"]


def test_a_later_fit_of_the_job_deals_the_global_batch_over_the_survivors_from_its_first_batch(tmp_path_factory):
    run = _launch("rank 0 in flight, one process per host", tmp_path_factory)
    refits = [torch.load(run.out / f"refit-rank{r}.pt") for r in run.left]
    per_epoch = SAMPLES // GLOBAL_BATCH
    for r in refits:
        assert r["world_size"] == DEVICES - 1 and r["global_step"] == per_epoch and r["rank_loss"]["lost_ranks"] == []
        assert len(r["trained"]) == per_epoch
    sizes = [[len(r["trained"][j]) for r in refits] for j in range(per_epoch)]
    assert sizes == [[GLOBAL_BATCH // 2] * 2] * per_epoch, sizes
    trained = [i for r in refits for batch in r["trained"] for i in batch]
    assert sorted(trained) == list(range(SAMPLES))


def _reference(run: Run) -> list[torch.Tensor]:
    """One process on the global batches the job trained: the weights after every batch."""
    return replay_loss(run.survivors, run.seen, SAMPLES)


def test_every_step_equals_one_process_on_the_samples_trained_and_replicas_are_identical(ring_loss):
    survivors = ring_loss.survivors
    reference = _reference(ring_loss)
    compressed = "--compression" in SCENARIOS[ring_loss.scenario]
    # 16-bit gradients with error feedback stay within a few roundings of each gradient: a tenth of the smallest step
    # the weights take, so weights a step behind fail (as a step's rounding counted twice does)
    tolerance = min((b - a).abs().max().item() for a, b in pairwise(reference)) / 10
    assert (survivors[0]["history"][-1][2] - reference[-2]).abs().max() > tolerance  # the check can fail
    for j, want in enumerate(reference):
        got = survivors[0]["history"][j][2]
        for other in survivors[1:]:
            assert torch.equal(got, other["history"][j][2]), f"the replicas differ after batch {j}"
        if compressed:
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=lambda m: f"after batch {j}: {m}")  # noqa: B023
        else:
            close(got, want, f"after batch {j}")
    codec, lost_residuals = survivors[0]["codec"], survivors[0]["rank_loss"]["lost_residuals"]
    assert (codec, lost_residuals) == (("HalfPrecisionCodec", [ring_loss.lost]) if compressed else ("Codec", []))


#: a checkpoint the "in flight" job wrote after its loss, mid-epoch (3 of epoch 1's 6 batches trained)
RESUME_STEP = 9


@pytest.fixture(scope="module", params=["the survivors", "a full set of ranks", "more ranks than at the start"])
def resumed(request, tmp_path_factory) -> tuple[Run, int, list[dict]]:
    run = _launch("in flight", tmp_path_factory)
    devices = {"the survivors": DEVICES - 1, "a full set of ranks": DEVICES}.get(request.param, DEVICES + 1)
    out = tmp_path_factory.mktemp("ring-loss-resumed")
    run_script("midepoch", "--strategy", "ring_allreduce", "--devices", str(devices), "--samples", str(SAMPLES),
               "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue",
               "--intra-node", "ring", "--resume-from", str(run.out / "ckpt" / f"step={RESUME_STEP}.ckpt"),
               "--out", str(out), timeout=180)  # fmt: skip
    return run, devices, [torch.load(out / f"rank{r}.pt") for r in range(devices)]


def test_a_checkpoint_written_after_a_loss_resumes_exactly_with_the_survivors_or_a_full_set(resumed):
    run, devices, ranks = resumed
    steps = EPOCHS * SAMPLES // GLOBAL_BATCH
    after = range(RESUME_STEP, steps)
    for r in ranks:
        assert r["global_step"] == steps and len(r["trained"]) == len(after)
        assert r["rank_loss"]["lost_ranks"] == [] and r["world_size"] == devices
    # the global batch of the job, dealt over the ranks of the resumed run: the same samples at every step
    for k, j in enumerate(after):
        want = sorted(i for s in run.survivors for i in s["trained"][j])
        assert len(want) == GLOBAL_BATCH
        assert sorted(i for r in ranks for i in r["trained"][k]) == want, f"batch {j}"
        assert [len(r["trained"][k]) for r in ranks] == [GLOBAL_BATCH // devices] * devices
    reference = _reference(run)
    for k, j in enumerate(after):
        got = ranks[0]["history"][k][2]
        assert all(torch.equal(got, r["history"][k][2]) for r in ranks[1:]), f"the replicas differ after batch {j}"
        if devices == DEVICES - 1:  # the same ranks as the job's survivors, the same ring: bit for bit
            assert torch.equal(got, run.survivors[0]["history"][j][2]), f"after batch {j}"
        close(got, reference[j], f"after batch {j}")


def test_a_checkpoint_written_after_a_loss_and_resumed_with_stop_warns_that_its_global_batch_changes(
    tmp_path_factory,
):
    run = _launch("in flight", tmp_path_factory)
    out = tmp_path_factory.mktemp("ring-loss-resumed-stop")
    devices = DEVICES - 1
    result = run_script("midepoch", "--strategy", "ring_allreduce", "--devices", str(devices), "--samples",
                        str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--intra-node", "ring",
                        "--resume-from", str(run.out / "ckpt" / f"step={RESUME_STEP}.ckpt"), "--out", str(out),
                        timeout=180)  # fmt: skip
    assert f"the checkpoint was written after a loss of ranks, with a global batch of {GLOBAL_BATCH} samples" in (
        result.stdout
    ), result.stdout[-3000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(devices)]
    for r in ranks:  # the global batch is the batch size times the ranks now, as the warning says
        assert r["rank_loss"] == {}
        assert {len(batch) for batch in r["trained"]} == {BATCH}


def test_a_rank_lost_between_two_stages_is_agreed_on_as_the_next_starts(tmp_path_factory):
    """Rank 2 dies once the fit has ended: the validation after it and a later fit (a new Trainer) go on over ranks 0
    and 1, every sample evaluated once, the global batch dealt over the two from the later fit's first batch."""
    out = tmp_path_factory.mktemp("ring-loss-between-stages")
    run_script("midepoch", "--strategy", "ring_allreduce", "--devices", str(DEVICES), "--samples", str(SAMPLES),
               "--batch-size", str(BATCH), "--max-epochs", "1", "--on-rank-loss", "continue", "--heartbeat-timeout",
               "2", "--intra-node", "ring", "--validate", "--refit-epochs", "1", "--lose-rank", "2", "--lose-after-fit",
               "--out", str(out), timeout=180)  # fmt: skip
    survivors = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    per_epoch = SAMPLES // GLOBAL_BATCH
    for s in survivors:
        assert s["rank_loss"]["lost_ranks"] == [2] and s["world_size"] == DEVICES - 1, s["rank_loss"]
        assert s["global_step"] == per_epoch and {len(batch) for batch in s["trained"]} == {BATCH}  # the fit: 3 ranks
        assert s["val_counted"] == [SAMPLES, SAMPLES], s["val_counted"]  # in the fit, and over the survivors after it
    refits = [torch.load(out / f"refit-rank{r}.pt") for r in range(2)]
    for r in refits:
        assert r["world_size"] == DEVICES - 1 and r["global_step"] == per_epoch
        assert [len(batch) for batch in r["trained"]] == [GLOBAL_BATCH // 2] * per_epoch
    assert sorted(i for r in refits for batch in r["trained"] for i in batch) == list(range(SAMPLES))
