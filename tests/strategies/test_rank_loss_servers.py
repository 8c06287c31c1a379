"""``on_rank_loss="continue"`` on the parameter servers (trainers serving): a rank lost at any point of a step (before
its exchange completed, after it, in the weight pull; global rank 0; the central server itself) takes none of the
servers' state with it. Its shard's state lives on in its replica on the next rank, the survivors cut the state again
over themselves, and from the loss on every step is one process's step on the samples trained (clipped by the global
norm), with the replicas bit-identical and the optimizer state of the last checkpoint the one process's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.midepoch import read_seen, replay, replay_loss
from tests.helpers.replicas import close

pytestmark = pytest.mark.multiprocess

DEVICES, BATCH, SAMPLES, EPOCHS, LOST_AT, CLIP = 3, 4, 72, 2, 4, 0.05
#: strategy: how a rank dies at step LOST_AT, and what that step then is:
#: - "rank 0 in flight, one process per host": global rank 0 (the store, checkpoints, logging) SIGKILLed in its
#:   training step, each rank started on its own: no one completes the step's exchange; the survivors cut the state
#:   over themselves and exchange their gradients again (that step trains without the lost rank's samples);
#: - "after its exchange": rank 2 dies after backward, once every rank holds its shard's gradients: the step closes
#:   with its samples, shard 2 served by its replica on rank 0 (its share of the norm, its update, its weights);
#: - "in its pull, gradients read": rank 2 dies as the weight pull starts, having updated its shard: its replica sends
#:   the new weights; a callback reads the averaged gradients, so every rank holds them (the servers send them back)
#:   and the replicas step with them as the hooks left them;
#: - "shared memory, collectives": rank 1, the ranks exchanging through shared memory, the training step logging with
#:   sync_dist and all-gathering (which meets the loss first), validating every epoch;
#: - "the server after its exchange, one process per host": the central server (rank 0) dies once every rank's
#:   gradients reached it and its replica on rank 1; rank 1 finishes the step in its place and serves from then on;
#: - "the server's replica in its pull": rank 1 (holding the central server's replica) dies in the pull, through shared
#:   memory: the server goes on and replicates its state on rank 2.
SCENARIOS = {
    ("sharded_ps", "rank 0 in flight, one process per host"): (0, ("--intra-node", "ring")),
    ("sharded_ps", "after its exchange"): (2, ("--intra-node", "ring", "--lose-after-backward")),
    ("sharded_ps", "in its pull, gradients read"): (2, ("--intra-node", "ring", "--lose-in-pull", "--read-gradients")),
    ("sharded_ps", "shared memory, collectives"): (1, ("--collectives", "--validate")),
    ("parameter_server", "the server after its exchange, one process per host"): (0, ("--intra-node", "ring",
                                                                                    "--lose-after-backward")),
    ("parameter_server", "the server's replica in its pull"): (1, ("--lose-in-pull",)),
}  # fmt: skip
#: (exchanges committed with the lost rank, steps whose exchange ran again over the survivors)
EXPECTED = {
    "rank 0 in flight, one process per host": (LOST_AT, 1),
    "after its exchange": (LOST_AT + 1, 0),
    "in its pull, gradients read": (LOST_AT + 1, 0),
    "shared memory, collectives": (LOST_AT, 0),
    "the server after its exchange, one process per host": (LOST_AT + 1, 0),
    "the server's replica in its pull": (LOST_AT + 1, 0),
}


@dataclass
class Run:
    strategy: str
    scenario: str
    lost: int
    out: Path
    survivors: list[dict]
    seen: dict[int, list[int]]


_runs: dict[tuple[str, str], Run] = {}


def _launch(key: tuple[str, str], tmp_path_factory) -> Run:
    """The scenario's job, run once per session."""
    strategy, scenario = key
    if key not in _runs:
        lost, options = SCENARIOS[key]
        out = tmp_path_factory.mktemp("sharded-loss")
        per_host = "one process per host" in scenario
        result = run_script(
            "midepoch", "--strategy", strategy, "--devices", "1" if per_host else str(DEVICES),
            "--num-nodes", str(DEVICES) if per_host else "1", "--samples", str(SAMPLES), "--batch-size", str(BATCH),
            "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue", "--heartbeat-timeout", "2", "--lose-rank",
            str(lost), "--lose-at-step", str(LOST_AT), "--clip-norm", str(CLIP), *options, "--out", str(out),
            timeout=180, check=not per_host, deaths_expected=per_host,
            env={"LIGHTNING_DP_TEST_NODES": str(DEVICES)} if per_host else None,
        )  # fmt: skip
        if per_host:
            assert result.codes == [-9 if r == lost else 0 for r in range(DEVICES)], result.stdout[-5000:]
        survivors = [torch.load(out / f"rank{r}.pt") for r in range(DEVICES) if r != lost]
        _runs[key] = Run(strategy, scenario, lost, out, survivors, read_seen(out / f"seen-rank{lost}.txt"))
    return _runs[key]


@pytest.fixture(scope="module", params=sorted(SCENARIOS), ids=[" ".join(key) for key in sorted(SCENARIOS)])
def server_loss(request, tmp_path_factory) -> Run:
    return _launch(request.param, tmp_path_factory)


def test_the_survivors_agree_on_the_loss_and_where_it_fell(server_loss):
    survivors = server_loss.survivors
    with_lost, redone = EXPECTED[server_loss.scenario]
    for s in survivors:
        metrics = s["rank_loss"]
        assert metrics["lost_ranks"] == [server_loss.lost] and metrics["loss_causes"] == ["closed"], metrics
        assert metrics["loss_steps"] == [with_lost] and metrics["redone_steps"] == redone, metrics
        assert metrics["caught_up_steps"] == 0, metrics
        assert len(s["history"]) == s["global_step"] == EPOCHS * SAMPLES // (DEVICES * BATCH)
    assert max(server_loss.seen) == LOST_AT


def test_every_step_equals_one_process_and_the_state_lost_nothing(server_loss):
    survivors = server_loss.survivors
    momenta: list[torch.Tensor] = []
    reference = replay_loss(survivors, server_loss.seen, SAMPLES, clip_norm=CLIP, momenta=momenta)
    assert len(reference) == len(survivors[0]["history"])
    for j, want in enumerate(reference):
        got = survivors[0]["history"][j][2]
        for other in survivors[1:]:
            assert torch.equal(got, other["history"][j][2]), f"the replicas differ after batch {j}"
        close(got, want, f"after batch {j}")
    # the optimizer state of the last checkpoint, gathered from the shards cut over the survivors
    last = len(reference)
    saved = torch.load(server_loss.out / "ckpt" / f"step={last}.ckpt", weights_only=False)
    state = saved["optimizer_states"][0]["state"]
    buffers = torch.cat([state[k]["momentum_buffer"].flatten() for k in sorted(state)])
    close(buffers, momenta[last - 1], "the momentum buffers of the last checkpoint")


def test_the_replicas_step_with_the_gradients_the_hooks_saw(tmp_path_factory):
    run = _launch(("sharded_ps", "in its pull, gradients read"), tmp_path_factory)
    for s in run.survivors:
        assert s["full_gradients"] is True
        norms = s["gradient_norms"]
        # the hook sees them before clipping: every step's norm is above CLIP, so the clipping acts at every step
        assert len(norms) == len(s["history"]) and all(n > CLIP for n in norms), norms
    assert run.survivors[0]["gradient_norms"] == run.survivors[1]["gradient_norms"]


def test_validation_and_collectives_run_over_the_survivors(tmp_path_factory):
    run = _launch(("sharded_ps", "shared memory, collectives"), tmp_path_factory)
    for epoch in range(EPOCHS):
        seen = [i for s in run.survivors for e, indices in s["validated"] if e == epoch for i in indices]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}"
    assert all(s["val_counted"] == [SAMPLES, SAMPLES] for s in run.survivors)
    everyone, left = list(range(DEVICES)), [r for r in range(DEVICES) if r != run.lost]
    for s in run.survivors:  # the training step's all_gather, over the survivors from the loss on
        assert s["gathered"] == [everyone if j < LOST_AT else left for j in range(len(s["gathered"]))]


def test_a_resumed_run_replicates_the_state_it_loaded(tmp_path_factory):
    """Resumed from a checkpoint, each replica holds its owner's slices of the saved state: rank 2, lost after its
    exchange three steps later, leaves its replica on rank 0 the momentum it had."""
    run = _launch(("sharded_ps", "shared memory, collectives"), tmp_path_factory)
    resume_step, lost_at = 3, 6  # (a checkpoint written before that run's loss)
    out = tmp_path_factory.mktemp("sharded-loss-resumed")
    run_script("midepoch", "--strategy", "sharded_ps", "--devices", str(DEVICES), "--samples", str(SAMPLES),
               "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue",
               "--heartbeat-timeout", "2", "--intra-node", "ring", "--clip-norm", str(CLIP), "--resume-from",
               str(run.out / "ckpt" / f"step={resume_step}.ckpt"), "--lose-rank", "2", "--lose-at-step", str(lost_at),
               "--lose-after-backward", "--out", str(out), timeout=180)  # fmt: skip
    survivors = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    seen = read_seen(out / "seen-rank2.txt")
    with_lost = survivors[0]["rank_loss"]["loss_steps"][0]  # exchanges this fit committed with rank 2
    assert survivors[0]["rank_loss"]["lost_ranks"] == [2] and with_lost == lost_at - resume_step + 1
    # one process on the original run's global batches up to the checkpoint, then on the resumed run's
    original = [sorted(i for s in run.survivors for i in s["trained"][j]) + run.seen[j] for j in range(resume_step)]
    resumed = [[i for s in survivors for i in s["trained"][k]] + (seen[resume_step + k] if k < with_lost else [])
               for k in range(len(survivors[0]["trained"]))]  # fmt: skip
    history = run.survivors[0]["history"][:resume_step] + survivors[0]["history"]
    reference = replay(original + resumed, history, SAMPLES, clip_norm=CLIP)
    for k, entry in enumerate(survivors[0]["history"]):
        assert torch.equal(entry[2], survivors[1]["history"][k][2]), f"the replicas differ after batch {k}"
        close(entry[2], reference[resume_step + k], f"after batch {resume_step + k}")


def test_two_ranks_lost_in_turn_each_leave_their_state_to_a_replica(tmp_path_factory):
    """5 ranks (a strict majority survives two losses): rank 1 lost after its exchange at step 2 (its shard served by
    its replica on rank 2, then the state cut over 4 ranks, each with a new replica), rank 3 in its step 5 (the
    state cut again over 3)."""
    out = tmp_path_factory.mktemp("sharded-loss-twice")
    devices, samples, first, second = 5, 80, (1, 2), (3, 5)
    run_script("midepoch", "--strategy", "sharded_ps", "--devices", str(devices), "--samples", str(samples),
               "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue",
               "--heartbeat-timeout", "2", "--intra-node", "ring", "--clip-norm", str(CLIP), "--lose-rank",
               str(first[0]), "--lose-at-step", str(first[1]), "--lose-after-backward", "--lose-later",
               str(second[0]), str(second[1]), "--out", str(out), timeout=180)  # fmt: skip
    survivors = [torch.load(out / f"rank{r}.pt") for r in (0, 2, 4)]
    metrics = survivors[0]["rank_loss"]
    assert all(s["rank_loss"]["loss_steps"] == metrics["loss_steps"] for s in survivors)
    assert metrics["lost_ranks"] == [first[0], second[0]], metrics
    with_first, with_second = metrics["loss_steps"]
    assert (with_first, with_second) == (first[1] + 1, second[1]), metrics
    assert metrics["redone_steps"] == 1, metrics  # the second in flight: its step exchanged again over three
    seen = {rank: read_seen(out / f"seen-rank{rank}.txt") for rank in (first[0], second[0])}
    steps = len(survivors[0]["trained"])
    assert steps == EPOCHS * samples // (devices * BATCH)
    batches = [[i for s in survivors for i in s["trained"][j]]
               + (seen[first[0]][j] if j < with_first else []) + (seen[second[0]][j] if j < with_second else [])
               for j in range(steps)]  # fmt: skip
    reference = replay(batches, survivors[0]["history"], samples, clip_norm=CLIP)
    for j, want in enumerate(reference):
        got = survivors[0]["history"][j][2]
        assert all(torch.equal(got, s["history"][j][2]) for s in survivors[1:]), f"the replicas differ after batch {j}"
        close(got, want, f"after batch {j}")
