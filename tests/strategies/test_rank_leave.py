"""A member leaves the running job on purpose (``on_rank_loss="continue"``; a host drained before maintenance): asked
by ``SIGUSR2`` or ``trainer.strategy.leave()``, it trains every batch dealt to it, the others take its share from
the first batch no loader had drawn, and at that batch's step boundary they go on without it, counted as left, not
lost. Nothing is dropped, every step is one process's step on the global batch, the replicas stay bit-identical,
and the process that left ends with exit code 0. The rank that leads the members is refused, with the reason.

- ring_allreduce, the three ranks started by the strategy's own launcher, exchanging through shared memory: rank 2,
  a child of rank 0, leaves on ``SIGUSR2``; rank 0 asks to leave first and is refused;
- parameter_server, one process per host: rank 1, holding the central server's replica, leaves on
  ``strategy.leave()``; the server's state is replicated on rank 2 again, and the last checkpoint's momenta are the
  one process's;
- sharded_ps with two dedicated servers that trainer 0 starts, one process per host: trainer 2 leaves on ``SIGUSR2``;
  the servers go on with the two trainers that stay, the last checkpoint's momenta are the one process's, and both
  servers stop with exit code 0 at the end.
(The sharded servers on the trainers: ``test_rank_loss_join.py``'s growth, which shrinks by one in the end.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.midepoch import replay
from tests.helpers.replicas import close

pytestmark = pytest.mark.multiprocess

DEVICES, BATCH, SAMPLES, EPOCHS, LEAVE_AT = 3, 4, 72, 2, 4
STEPS = EPOCHS * SAMPLES // (DEVICES * BATCH)
#: strategy: (the rank that leaves, how it is asked, per host)
SCENARIOS = {
    "ring_allreduce": (2, "signal", False),
    "parameter_server": (1, "call", True),
    "sharded_ps+servers": (2, "signal", True),
}


@dataclass
class Run:
    strategy: str
    leaving: int
    out: Path
    #: every rank's record, in rank order (the one that left: up to its leave)
    records: list[dict]
    stdout: str


_runs: dict[str, Run] = {}


def _launch(strategy: str, tmp_path_factory) -> Run:
    """The strategy's job, run once per session."""
    if strategy not in _runs:
        leaving, by, per_host = SCENARIOS[strategy]
        name, *servers = strategy.split("+")
        out = tmp_path_factory.mktemp("leave")
        placement = ("--devices", "1", "--num-nodes", str(DEVICES), "--intra-node", "ring") if per_host else (
            "--devices", str(DEVICES), "--refuse-leave", "0", "2")  # fmt: skip
        placement += ("--num-servers", "2") if servers else ()
        result = run_script(
            "midepoch", "--strategy", name, *placement, "--samples", str(SAMPLES), "--batch-size", str(BATCH),
            "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue", "--heartbeat-timeout", "2", "--step-seconds",
            "0.05", "--leave", str(leaving), str(LEAVE_AT), "--leave-by", by, "--out", str(out), timeout=180,
            env={"LIGHTNING_DP_TEST_NODES": str(DEVICES)} if per_host else None,
        )  # fmt: skip
        assert result.codes == ([0] * DEVICES if per_host else [0]), result.stdout[-6000:]
        records = [torch.load(out / f"rank{r}.pt") for r in range(DEVICES)]
        _runs[strategy] = Run(strategy, leaving, out, records, result.stdout)
    return _runs[strategy]


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def left(request, tmp_path_factory) -> Run:
    return _launch(request.param, tmp_path_factory)


def _batches(run: Run, left_at: int) -> list[list[int]]:
    """The samples of every global batch: every rank's, the one that left up to its leave."""
    return [[i for r, record in enumerate(run.records) if r != run.leaving or j < left_at for i in record["trained"][j]]
            for j in range(STEPS)]  # fmt: skip


def test_the_rank_leaves_at_a_step_boundary_counted_as_left_not_lost(left):
    staying = [r for r in range(DEVICES) if r != left.leaving]
    metrics = left.records[0]["rank_loss"]
    (left_at,) = metrics["leave_steps"]
    assert LEAVE_AT < left_at <= LEAVE_AT + 3, metrics  # (the first batch its loader had not drawn)
    for r in staying:
        m = left.records[r]["rank_loss"]
        assert m["left_ranks"] == [left.leaving] and m["leave_steps"] == [left_at], m
        assert m["lost_ranks"] == [] and m["dropped_samples"] == 0 and m["redone_steps"] == 0, m
        assert left.records[r]["global_step"] == STEPS and left.records[r]["world_size"] == DEVICES - 1
    leaver = left.records[left.leaving]
    assert leaver["global_step"] == left_at == len(leaver["trained"]) and leaver["rank_loss"]["left_ranks"] == [
        left.leaving
    ]
    assert f"rank {left.leaving} left the job after {left_at} steps" in left.stdout


def test_every_sample_is_trained_once_and_every_step_equals_one_process(left):
    (left_at,) = left.records[0]["rank_loss"]["leave_steps"]
    batches = _batches(left, left_at)
    sizes = [[len(rec["trained"][j]) for r, rec in enumerate(left.records) if r != left.leaving or j < left_at]
             for j in range(STEPS)]  # fmt: skip
    assert all(s == [BATCH] * DEVICES for s in sizes[:left_at]), sizes
    assert all(sum(s) == DEVICES * BATCH and len(s) == DEVICES - 1 for s in sizes[left_at:]), sizes
    per_epoch = SAMPLES // (DEVICES * BATCH)
    for epoch in range(EPOCHS):
        trained = sorted(i for j in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in batches[j])
        assert trained == list(range(SAMPLES)), f"epoch {epoch}"
    momenta: list[torch.Tensor] = []
    reference = replay(batches, left.records[0]["history"], SAMPLES, momenta=momenta)
    for j, want in enumerate(reference):
        got = left.records[0]["history"][j][2]
        for r, record in enumerate(left.records[1:], start=1):
            if r != left.leaving or j < left_at:
                assert torch.equal(got, record["history"][j][2]), f"rank {r} after batch {j}"
        close(got, want, f"after batch {j}")
    if left.strategy != "ring_allreduce":  # the optimizer state of the last checkpoint, from the servers
        saved = torch.load(left.out / "ckpt" / f"step={STEPS}.ckpt", weights_only=False)
        state = saved["optimizer_states"][0]["state"]
        buffers = torch.cat([state[k]["momentum_buffer"].flatten() for k in sorted(state)])
        close(buffers, momenta[STEPS - 1], "the momentum buffers of the last checkpoint")


def test_the_central_server_is_replicated_again_on_a_rank_that_stays(tmp_path_factory):
    left = _launch("parameter_server", tmp_path_factory)
    shards = {r: left.records[r]["shards"] for r in (0, 2)}
    assert all(s["members"] == (0, 2) for s in shards.values()), shards
    holder = shards[2]
    assert holder["members"][holder["owner"]] == 0
    served = [sum(e - s for pieces in shards[r]["own"] for _, s, e, _ in pieces) for r in (0, 2)]
    assert served[1] == 0 and served[0] > 0, served  # (the central server: everything on rank 0)
    mine = [(k, s, e, {n: v for n, v in st.items() if isinstance(v, torch.Tensor)}) for k, s, e, st in
            (p for pieces in holder["replica"] for p in pieces)]  # fmt: skip
    theirs = [(k, s, e, {n: v for n, v in st.items() if isinstance(v, torch.Tensor)}) for k, s, e, st in
              (p for pieces in shards[0]["own"] for p in pieces)]  # fmt: skip
    assert [m[:3] for m in mine] == [t[:3] for t in theirs] and mine
    for m, t in zip(mine, theirs, strict=True):
        assert all(torch.equal(m[3][n], t[3][n]) for n in t[3]), m[:3]


def test_the_dedicated_servers_go_on_with_the_trainers_that_stay_and_stop_cleanly(tmp_path_factory):
    left = _launch("sharded_ps+servers", tmp_path_factory)
    assert left.records[0]["server_codes"] == {0: 0, 1: 0}, left.records[0]["server_codes"]
    for r in (0, 1):
        m = left.records[r]["rank_loss"]
        assert m["lost_servers"] == [] and m["returned_servers"] == [], m


def test_the_rank_that_leads_the_members_is_refused_with_the_reason(tmp_path_factory):
    left = _launch("ring_allreduce", tmp_path_factory)
    refusal = (left.out / "leave-refused-rank0.txt").read_text()
    assert "rank 0 cannot leave the running job" in refusal and "leads the members" in refusal, refusal
    assert left.records[0]["rank_loss"]["left_ranks"] == [left.leaving]
