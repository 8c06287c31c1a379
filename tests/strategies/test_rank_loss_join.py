"""A new process in a lost rank's place joins the running job (``on_rank_loss="continue"``): each rank is started on its
own as a single-device node, rank 2 (global rank 0, whose store goes with it, in one scenario) is killed in flight, and
the same command started again in its place joins at a step boundary with the state the members hand it. From its first
step the global batch is dealt over the three ranks again, every step is one process's step on the samples trained, and
the replicas are bit-identical; a checkpoint written after the join resumes exactly. A new process killed in the
handover, or a member killed while a new process waits for its admission, leaves the job going. The same for the
parameter servers on the trainers (``sharded_ps``, and the central server), whose state the members cut again over the
grown membership."""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.midepoch import Reference, read_seen, replay
from tests.helpers.replicas import close

pytestmark = pytest.mark.multiprocess

DEVICES, BATCH, SAMPLES, EPOCHS = 3, 4, 72, 4
GLOBAL_BATCH = DEVICES * BATCH
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH
LOST, LOST_AT = 2, 4
#: rank 0 waits in this step until the new process is about to ask to join (a cold start takes seconds)
AWAIT_AT = 8
#: - "replaced": the new process, started by hand (by the test), joins and trains to the end; every epoch validates
#:   (the new process sets up its validation loader alone before its first step, as the members did long before);
#: - "restarted by the launcher": the ranks are started by Lightning's launcher in one process, which starts the lost
#:   one again (restart_lost_ranks); they exchange through shared memory (the default on one machine), which the new
#:   process, set up alone, takes from the members;
#: - "new process killed in the handover": it dies as the members start handing it their state; they go on without it
#: - "replaced, bf16": the gradients travel in 16 bits with error feedback; the new process's residuals start at zero,
#:   the members keep theirs (the lost rank's are lost)
#: - "replaced, throughput": balance="throughput" with rank 2 slow, the lost one and the new process alike: the new
#:   process is dealt the members' mean share, nobody measures until its admission, and then every rank measures
#:   afresh and the shares follow the speeds of the three (the new process's shrinks)
#: - the parameter servers on the trainers, the state of every shard replicated on the next rank: the members cut it
#:   again over the grown membership, the new process's shard and replica included ("sharded_ps replaced": by hand,
#:   validating every epoch; "parameter_server restarted by the launcher": the central server's state, on rank 0,
#:   replicated on rank 1; "sharded_ps, new process killed in the handover": it dies once the state was cut over the
#:   three ranks, and the members cut it again over themselves from the full state they hold)
#: (no sleep in every rank's step: inside the measured span it would make every rank's speed follow its share)
BALANCED = ("--balance", "throughput", "--balance-interval", "2", "--slow-rank", str(LOST), "--slow-per-sample", "0.05",
            "--step-seconds", "0")  # fmt: skip
SCENARIOS = {
    "replaced": ("ring_allreduce", "--validate"),
    "restarted by the launcher": ("ring_allreduce", "--restart-lost-ranks", "1"),
    "new process killed in the handover": ("ring_allreduce", "--kill-in-handover", str(LOST)),
    "replaced, bf16": ("ring_allreduce", "--compression", "bf16"),
    "replaced, throughput": ("ring_allreduce", *BALANCED),
    "sharded_ps replaced": ("sharded_ps", "--validate"),
    "sharded_ps, new process killed in the handover": ("sharded_ps", "--kill-in-handover", str(LOST)),
    "parameter_server restarted by the launcher": ("parameter_server", "--restart-lost-ranks", "1"),
    "sharded_ps+servers replaced": ("sharded_ps", "--num-servers", "2"),
}
BY_LAUNCHER = {"restarted by the launcher", "parameter_server restarted by the launcher"}
#: the scenarios that lose another rank than LOST: "sharded_ps replaced" loses global rank 0, whose store (the job's
#: directory) goes with it; the new process serves it again, the members find it there and it leads again once
#: admitted (logging, checkpoints; every process is given the job's id, which a new process in rank 0's place needs)
LOST_RANKS = {"sharded_ps replaced": 0}
#: the scenarios whose new process trains to the end, validating every epoch, with checkpoints resumed
VALIDATED = ["replaced", "sharded_ps replaced"]


@dataclass
class Run:
    scenario: str
    #: the rank killed, and replaced by the new process
    lost: int
    out: Path
    #: the ranks that trained from the start to the end, in rank order
    members: list[dict]
    #: the new process's record (``None``: it did not finish)
    joiner: dict | None
    #: what the killed rank trained at each step until it died
    seen: dict[int, list[int]]
    codes: list[int]
    #: each process's output, by node (the new process's last)
    outputs: list[str]

    @property
    def join_step(self) -> int:
        """The exchanges committed before the new process's first."""
        (step,) = self.members[0]["rank_loss"]["join_steps"]
        return step


_runs: dict[str, Run] = {}


def _launch(scenario: str, tmp_path_factory) -> Run:
    """The scenario's job, run once per session."""
    if scenario not in _runs:
        out = tmp_path_factory.mktemp("join")
        strategy, *options = SCENARIOS[scenario]
        launcher, lost = scenario in BY_LAUNCHER, LOST_RANKS.get(scenario, LOST)
        env = {"LIGHTNING_DP_TEST_NODES": str(DEVICES), **({"LIGHTNING_DP_JOB_ID": "join-test"} if lost == 0 else {})}
        placement = ("--devices", str(DEVICES)) if launcher else ("--devices", "1", "--num-nodes", str(DEVICES))
        result = run_script(
            "midepoch", "--strategy", strategy, *placement,
            "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss",
            "continue", "--heartbeat-timeout", "2", *(() if launcher else ("--intra-node", "ring")),
            "--lose-rank", str(lost), "--lose-at-step",
            str(LOST_AT), "--step-seconds", "0.1", "--await-replacement-at", str(AWAIT_AT), "--checkpoint-every", "3",
            *options, "--out",
            str(out), timeout=240, check=launcher, deaths_expected=True, replace_killed=not launcher,
            env=None if launcher else env,
        )  # fmt: skip
        joiner_dies = "--kill-in-handover" in options
        codes = [0] if launcher else [-9 if r == lost else 0 for r in range(DEVICES)] + [-9 if joiner_dies else 0]
        assert result.codes == codes, result.stdout[-6000:]
        members = [torch.load(out / f"rank{r}.pt") for r in range(DEVICES) if r != lost]
        joiner = None if joiner_dies else torch.load(out / f"rank{lost}.pt")
        seen = read_seen(out / f"seen-rank{lost}.txt")
        outputs = re.split(r"--- node \d+ ---\n", result.stdout)[1:]
        _runs[scenario] = Run(scenario, lost, out, members, joiner, seen, result.codes, outputs)
    return _runs[scenario]


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def joined(request, tmp_path_factory) -> Run:
    return _launch(request.param, tmp_path_factory)


def _batches(run: Run) -> list[list[int]]:
    """The samples of every global batch the job trained: the members', the killed rank's for the steps committed
    with it, and the new process's from its first step."""
    steps = len(run.members[0]["trained"])
    with_lost = run.members[0]["rank_loss"]["loss_steps"][0]
    batches = []
    for j in range(steps):
        batch = [i for m in run.members for i in m["trained"][j]] + (run.seen[j] if j < with_lost else [])
        if run.joiner is not None and j >= run.join_step:
            batch += run.joiner["trained"][j - run.join_step]
        batches.append(batch)
    return batches


def test_the_new_process_is_admitted_at_a_step_boundary_and_every_process_agrees(joined):
    records = [*joined.members, *([joined.joiner] if joined.joiner is not None else [])]
    metrics = [r["rank_loss"] for r in records]
    for m in metrics:
        assert m["joined_ranks"] == [joined.lost] and m["join_steps"] == metrics[0]["join_steps"], metrics
    assert LOST_AT < joined.join_step < STEPS, "the new process joined after the loss and before the end"
    for m in joined.members:
        assert m["global_step"] == STEPS and len(m["history"]) == STEPS
        assert f"a new process joined as rank {joined.lost} after {joined.join_step} steps" in m["monitor_table"]
        pauses = m["rank_loss"]["join_pause_seconds"]
        if joined.joiner is not None:
            assert len(pauses) == 1 and pauses[0] < 2.0, pauses  # (target: 1 s plus a few KB at loopback rates)
    if joined.joiner is None:  # admitted, then lost in the handover: the members went on without it
        assert [m["rank_loss"]["lost_ranks"] for m in joined.members] == [[joined.lost, joined.lost]] * 2
        assert (joined.out / f"killed-in-handover-{joined.lost}").exists()
        return
    assert [m["rank_loss"]["lost_ranks"] for m in joined.members] == [[joined.lost]] * 2
    joiner = joined.joiner
    assert joiner["rank_loss"]["lost_ranks"] == [] and joiner["global_step"] == STEPS
    assert joiner["rank_loss"]["join_seconds"] is not None and joiner["world_size"] == DEVICES
    assert f"this process joined as rank {joined.lost} after {joined.join_step} steps" in joiner["monitor_table"]
    # its first step is the members' next: it trained every step from there, the same batches of the same epochs
    assert len(joiner["trained"]) == STEPS - joined.join_step
    keys = [(e, b) for e, b, _ in joiner["history"]]
    assert keys == [(e, b) for e, b, _ in joined.members[0]["history"][joined.join_step :]]
    if "--num-servers" in SCENARIOS[joined.scenario]:  # the servers went on with the new trainer, and stopped with 0
        assert joined.members[0]["server_codes"] == {0: 0, 1: 0}, joined.members[0]["server_codes"]
        for server in (0, 1):  # (a regroup after the loss, one at the admission)
            assert f"server {server} done after {STEPS} steps and 2 regroups" in joined.outputs[0], joined.outputs[0]
    if joined.lost == 0 and joined.outputs:  # the new process leads again: rank zero's messages are its alone
        *_, member_1, _, new_rank_0 = joined.outputs
        assert "`Trainer.fit` stopped" in new_rank_0 and "`Trainer.fit` stopped" not in member_1, member_1[-3000:]
        assert "the directory is kept there" in member_1, member_1[-3000:]  # (it led while rank 0 was lost)


def test_the_global_batch_is_dealt_over_the_grown_membership_and_every_sample_is_trained_once(joined):
    steps = len(joined.members[0]["trained"])
    balanced = "--balance" in SCENARIOS[joined.scenario]
    for j in range(steps):
        sizes = [len(m["trained"][j]) for m in joined.members]
        if joined.joiner is not None and j >= joined.join_step:
            sizes.append(len(joined.joiner["trained"][j - joined.join_step]))
            if balanced:  # shares by speed, every rank training some
                assert sum(sizes) == GLOBAL_BATCH and min(sizes) > 0, f"batch {j}: {sizes}"
            else:
                assert sizes == [BATCH] * DEVICES, f"batch {j}: {sizes}"
        elif j > LOST_AT + 1 and j != joined.join_step:  # dealt among the two members (from the first batch drawn
            # after the loss; the join's batch: the lost rank's share dealt to the new process, which did not train)
            assert sum(sizes) == GLOBAL_BATCH and (balanced or sorted(sizes) == [GLOBAL_BATCH // 2] * 2), (j, sizes)
    per_epoch = SAMPLES // GLOBAL_BATCH
    batches = _batches(joined)
    dropped = 0
    for epoch in range(EPOCHS):
        trained = [i for j in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in batches[j]]
        assert len(trained) == len(set(trained)), f"epoch {epoch}: a sample trained twice"
        dropped += SAMPLES - len(trained)
    # what no one trained: the killed rank's samples in flight, and the share of the new process killed in the
    # handover of the batch it was to train first, where the members learnt of its death only in that batch's exchange
    in_flight = len(joined.seen[LOST_AT])  # (its share of that batch: BATCH, or by speed under balance="throughput")
    assert dropped == in_flight or (joined.joiner is None and dropped == in_flight + BATCH), dropped
    assert all(m["rank_loss"]["dropped_samples"] == dropped for m in joined.members)


def test_every_step_equals_one_process_on_the_samples_trained_and_replicas_are_identical(joined):
    reference = replay(_batches(joined), joined.members[0]["history"], SAMPLES)
    compressed = "--compression" in SCENARIOS[joined.scenario]
    # 16-bit gradients with error feedback stay within a few roundings of each gradient: a tenth of the smallest step
    # the weights take, so weights a step behind fail
    tolerance = min((b - a).abs().max().item() for a, b in pairwise(reference)) / 10
    assert (joined.members[0]["history"][-1][2] - reference[-2]).abs().max() > tolerance  # the check can fail
    for j, want in enumerate(reference):
        got = joined.members[0]["history"][j][2]
        assert torch.equal(got, joined.members[1]["history"][j][2]), f"the members differ after batch {j}"
        if joined.joiner is not None and j >= joined.join_step:
            assert torch.equal(got, joined.joiner["history"][j - joined.join_step][2]), f"after batch {j}"
        if compressed:
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=lambda m: f"after batch {j}: {m}")  # noqa: B023
        else:
            close(got, want, f"after batch {j}")
    codecs = {r["codec"] for r in [*joined.members, *([joined.joiner] if joined.joiner is not None else [])]}
    assert codecs == ({"HalfPrecisionCodec"} if compressed else {"Codec"}), codecs
    if compressed:  # the lost rank's residuals went with it; the new process's started at zero
        assert all(m["rank_loss"]["lost_residuals"] == [joined.lost] for m in joined.members)
    assert all(torch.equal(m["weights"], joined.members[0]["weights"]) for m in joined.members)
    if joined.joiner is not None:
        assert torch.equal(joined.joiner["weights"], joined.members[0]["weights"])


@pytest.mark.parametrize("scenario", VALIDATED)
def test_validation_after_the_join_evaluates_every_sample_once_over_the_grown_membership(scenario, tmp_path_factory):
    run = _launch(scenario, tmp_path_factory)
    assert run.joiner is not None
    records = [*run.members, run.joiner]
    joined_epoch = run.members[0]["history"][run.join_step][0]
    for epoch in range(joined_epoch, EPOCHS):
        seen = [i for r in records for e, indices in r["validated"] if e == epoch for i in indices]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}"
    assert len({r["val_loss"] for r in records}) == 1  # sync_dist: one value on every rank
    assert all(r["val_counted"] == [SAMPLES, SAMPLES] for r in records), [r["val_counted"] for r in records]


@pytest.mark.parametrize("scenario", VALIDATED)
def test_the_state_is_handed_over_chunked_across_the_members(scenario, tmp_path_factory):
    run = _launch(scenario, tmp_path_factory)
    assert run.joiner is not None
    (received,) = run.joiner["rank_loss"]["handover_bytes"]
    sent = [m["rank_loss"]["handover_bytes"][0] for m in run.members]
    assert sum(sent) == received, (sent, received)
    # the weights and the momentum of every parameter (float32), at least; both members sent part of them
    parameters = sum(p.numel() for p in Reference(SAMPLES).parameters())
    assert received >= 2 * 4 * parameters and min(sent) > 0, (sent, received, parameters)


@pytest.mark.parametrize("scenario", VALIDATED)
def test_a_checkpoint_written_after_the_join_resumes_exactly(scenario, tmp_path_factory):
    run = _launch(scenario, tmp_path_factory)
    found = [(int(m.group(1)), p) for p in (run.out / "ckpt").glob("*.ckpt") if (m := re.search(r"step=(\d+)", p.name))]
    step, path = min((s, p) for s, p in found if s > run.join_step and s < STEPS)
    out = tmp_path_factory.mktemp("join-resumed")
    run_script("midepoch", "--strategy", SCENARIOS[scenario][0], "--devices", str(DEVICES), "--samples", str(SAMPLES),
               "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue",
               "--intra-node", "ring", "--resume-from", str(path), "--out", str(out), timeout=180)  # fmt: skip
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(DEVICES)]
    assert all(r["global_step"] == STEPS and len(r["trained"]) == STEPS - step for r in ranks)
    for k, j in enumerate(range(step, STEPS)):
        assert sorted(i for r in ranks for i in r["trained"][k]) == sorted(_batches(run)[j]), f"batch {j}"
        got = ranks[0]["history"][k][2]
        assert all(torch.equal(got, r["history"][k][2]) for r in ranks[1:]), f"the replicas differ after batch {j}"
        close(got, run.members[0]["history"][j][2], f"after batch {j}")


def _same_pieces(a: list, b: list) -> bool:
    """Whether two ranks' optimizer pieces (``local_state``) are the same slices holding equal tensors."""
    if [(k, s, e, sorted(st)) for k, s, e, st in a] != [(k, s, e, sorted(st)) for k, s, e, st in b]:
        return False
    return all(torch.equal(x[3][key], y[3][key]) for x, y in zip(a, b, strict=True) for key in x[3]
               if isinstance(x[3][key], torch.Tensor))  # fmt: skip


@pytest.mark.parametrize("scenario", ["sharded_ps replaced", "parameter_server restarted by the launcher"])
def test_the_servers_state_is_cut_again_over_the_grown_membership_with_every_shard_replicated(
    scenario, tmp_path_factory
):
    run = _launch(scenario, tmp_path_factory)
    assert run.joiner is not None
    members = [m for m in range(DEVICES) if m != run.lost]
    records = {r: rec["shards"] for r, rec in zip(members, run.members, strict=True)}
    records[run.lost] = run.joiner["shards"]
    assert all(s["members"] == tuple(range(DEVICES)) for s in records.values()), records
    for rank, shards in records.items():  # its replica is its chain predecessor's shard, bit for bit
        owner = shards["owner"]
        assert owner == (rank - 1) % DEVICES
        pairs = zip(shards["replica"], records[owner]["own"], strict=True)
        assert all(_same_pieces(mine, theirs) for mine, theirs in pairs), f"rank {rank}'s replica of rank {owner}"
    served = [sum(e - s for pieces in records[r]["own"] for _, s, e, _ in pieces) for r in range(DEVICES)]
    parameters = sum(p.numel() for p in Reference(SAMPLES).parameters())
    assert sum(served) == parameters, served  # every element served once
    if scenario.startswith("sharded_ps"):
        assert served[run.lost] > 0, served  # the new process serves its shard


def test_balanced_shares_follow_the_speeds_of_the_grown_membership(tmp_path_factory):
    run = _launch("replaced, throughput", tmp_path_factory)
    assert run.joiner is not None
    decisions = run.members[0]["decisions"]
    assert all(r["decisions"] == decisions for r in [*run.members, run.joiner])  # one schedule on every rank
    # the schedule, at each step after the join: every rank is dealt a share, and a decision taken after the join
    # from the three ranks' measurements gives the slow new process less than the mean share it was dealt at its
    # admission, and less than either member (a balancer that does not measure the grown membership keeps the mean)
    started = run.members[0]["history"][run.join_step][:2]
    dealt = [shares for start, shares in decisions if tuple(start) <= tuple(started)][-1]
    after = [shares for start, shares in decisions if tuple(start) > tuple(started)]
    assert after, decisions
    assert all(len(s) == DEVICES and min(s) > 0 and sum(s) == GLOBAL_BATCH for s in after), decisions
    assert dealt[LOST] == GLOBAL_BATCH // DEVICES, decisions  # (its admission's deal: the mean share)
    assert after[-1][LOST] < dealt[LOST] and after[-1][LOST] < min(after[-1][0], after[-1][1]), decisions


#: "a member lost while a new process joins": 5 single-device nodes (two lost at once leave a strict majority of the
#: five); rank 2 is killed at step 4 and started again; rank 3 kills itself in the first step after the members dealt
#: the new rank 2 a share (before they admit it), and is started again too: the members deal rank 3's share among
#: the three left, the new rank 2 its share again, and admit it, then the new rank 3, one after the other
WIDE, WIDE_SAMPLES, SECOND = 5, 100, 3


@pytest.fixture(scope="module")
def two_joins(tmp_path_factory) -> tuple[str, list[dict], dict[int, dict[int, list[int]]]]:
    out = tmp_path_factory.mktemp("two-joins")
    result = run_script(
        "midepoch", "--strategy", "ring_allreduce", "--devices", "1", "--num-nodes", str(WIDE), "--samples",
        str(WIDE_SAMPLES), "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue",
        "--heartbeat-timeout", "2", "--intra-node", "ring", "--lose-rank", str(LOST), "--lose-at-step", str(LOST_AT),
        "--lose-while-joining", str(SECOND), "--step-seconds", "0.1", "--await-replacement-at", str(AWAIT_AT),
        "--out", str(out), timeout=240, check=False, deaths_expected=True, replace_killed=True,
        env={"LIGHTNING_DP_TEST_NODES": str(WIDE)},
    )  # fmt: skip
    assert result.codes == [0, 0, -9, -9, 0, 0, 0], result.stdout[-6000:]
    records = [torch.load(out / f"rank{r}.pt") for r in range(WIDE)]
    seen = {r: read_seen(out / f"seen-rank{r}.txt") for r in (LOST, SECOND)}
    return result.stdout, records, seen


def test_a_member_lost_while_a_new_process_joins_leaves_the_job_going_and_both_join_in_turn(two_joins):
    stdout, records, seen = two_joins
    steps = WIDE_SAMPLES * EPOCHS // (WIDE * BATCH)
    members, joiners = (
        [records[r] for r in range(WIDE) if r not in (LOST, SECOND)],
        {r: records[r] for r in (LOST, SECOND)},
    )
    metrics = members[0]["rank_loss"]
    assert metrics["lost_ranks"] == [LOST, SECOND] and metrics["joined_ranks"] == [LOST, SECOND], metrics
    lost_at = dict(zip(metrics["lost_ranks"], metrics["loss_steps"], strict=True))
    joined_at = dict(zip(metrics["joined_ranks"], metrics["join_steps"], strict=True))
    # rank 3 was lost after the members dealt rank 2 its share and before they admitted it
    leader = stdout.split("--- node 1 ---")[0]
    assert leader.index(f"asks to join as rank {LOST}") < leader.index(f"lost rank {SECOND}"), leader[-5000:]
    assert LOST_AT < lost_at[SECOND] <= joined_at[LOST] < joined_at[SECOND] < steps, (lost_at, joined_at)
    assert all(m["rank_loss"]["joined_ranks"] == [LOST, SECOND] for m in members)
    for rank, joiner in joiners.items():
        assert joiner["global_step"] == steps and len(joiner["trained"]) == steps - joined_at[rank]
    # every global batch: the members', the killed ranks' until they died, the new processes' from their first step
    batches = []
    for j in range(steps):
        batch = [i for m in members for i in m["trained"][j]]
        for rank in (LOST, SECOND):
            if j < lost_at[rank]:
                batch += seen[rank][j]
            if j >= joined_at[rank]:
                batch += joiners[rank]["trained"][j - joined_at[rank]]
        batches.append(batch)
    per_epoch = WIDE_SAMPLES // (WIDE * BATCH)
    dropped = 0
    for epoch in range(EPOCHS):
        trained = [i for j in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in batches[j]]
        assert len(trained) == len(set(trained)), f"epoch {epoch}: a sample trained twice"
        dropped += WIDE_SAMPLES - len(trained)
    assert dropped == sum(len(seen[r][lost_at[r]]) for r in (LOST, SECOND)), dropped  # the two batches in flight
    assert all(m["rank_loss"]["dropped_samples"] == dropped for m in members)
    reference = replay(batches, members[0]["history"], WIDE_SAMPLES)
    for j, want in enumerate(reference):
        got = members[0]["history"][j][2]
        assert all(torch.equal(got, m["history"][j][2]) for m in members[1:]), f"the members differ after batch {j}"
        for rank, joiner in joiners.items():
            if j >= joined_at[rank]:
                assert torch.equal(got, joiner["history"][j - joined_at[rank]][2]), f"rank {rank} after batch {j}"
        close(got, want, f"after batch {j}")


#: growth: a job started on 2 ranks with max_ranks=4; once it trains, two processes started as ranks 2 and 3 (the
#: job's command with 4 nodes) join it, one per step boundary; the global batch stays the 2 ranks' (2 x BATCH), though
#: the new processes' own loaders, of the global batch over the 4 ranks they were started for, are half the size.
#: Later rank 1, one the job started with, is asked to leave (SIGUSR2, as a host drained before maintenance): the
#: three others go on without it, its share dealt among them and its server shard cut again from its replica.
STARTED, GROWN, GROW_AT, LEAVING, LEAVE_AT = 2, 4, 2, 1, 22
GROWN_STEPS = EPOCHS * SAMPLES // (STARTED * BATCH)


@pytest.fixture(scope="module")
def grown(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("grown")
    result = run_script(
        "midepoch", "--strategy", "sharded_ps", "--devices", "1", "--num-nodes", str(STARTED), "--samples",
        str(SAMPLES), "--global-batch", str(STARTED * BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue",
        "--heartbeat-timeout", "2", "--intra-node", "ring", "--max-ranks", str(GROWN), "--step-seconds", "0.1",
        "--mark-step", str(GROW_AT), "--await-replacement-at", str(AWAIT_AT), "--leave", str(LEAVING), str(LEAVE_AT),
        "--out", str(out), timeout=240, env={"LIGHTNING_DP_TEST_NODES": str(STARTED)},
        grow=(GROWN, out / f"at-step-{GROW_AT}-rank0"),
    )  # fmt: skip
    assert result.codes == [0] * GROWN, result.stdout[-6000:]
    assert f"rank {LEAVING} left the job after" in result.stdout, result.stdout[-6000:]
    return out, [torch.load(out / f"rank{r}.pt") for r in range(GROWN)]


def test_a_job_grows_from_two_to_four_ranks_and_every_step_equals_one_process_on_its_global_batch(grown):
    """... and shrinks to three when rank 1 leaves: it trains every batch dealt to it, the others every batch from
    there on, nothing dropped and every step one process's on the global batch."""
    out, records = grown
    metrics = records[0]["rank_loss"]
    assert sorted(metrics["joined_ranks"]) == [2, 3] and metrics["lost_ranks"] == [], metrics
    joined_at = dict(zip(metrics["joined_ranks"], metrics["join_steps"], strict=True))
    assert metrics["left_ranks"] == [LEAVING] and len(metrics["leave_pause_seconds"]) == 1, metrics
    (left_at,) = metrics["leave_steps"]
    staying = [r for r in range(GROWN) if r != LEAVING]
    assert all(records[r]["rank_loss"]["left_ranks"] == [LEAVING] for r in staying)
    assert all(records[r]["rank_loss"]["leave_steps"] == [left_at] for r in staying)
    assert max(joined_at.values()) < LEAVE_AT < left_at <= LEAVE_AT + 3 < GROWN_STEPS  # (its share's last batch)
    leaver = records[LEAVING]
    assert leaver["global_step"] == left_at and len(leaver["trained"]) == left_at
    assert leaver["rank_loss"]["left_ranks"] == [LEAVING]
    first = dict.fromkeys(range(STARTED), 0) | joined_at  # the first step each rank trained
    last = dict.fromkeys(staying, GROWN_STEPS) | {LEAVING: left_at}  # and the step after its last
    for rank in staying:
        assert records[rank]["global_step"] == GROWN_STEPS
        assert len(records[rank]["trained"]) == GROWN_STEPS - first[rank]
        assert records[rank]["world_size"] == GROWN - 1  # (the ranks training at the end)
    # every global batch: the two ranks' share of 2 x BATCH samples, then dealt over three and four ranks, then three
    batches = []
    for j in range(GROWN_STEPS):
        parts = [records[r]["trained"][j - first[r]] for r in range(GROWN) if first[r] <= j < last[r]]
        assert sum(map(len, parts)) == STARTED * BATCH and min(map(len, parts)) > 0, (j, [len(p) for p in parts])
        if len(parts) == GROWN:
            assert [len(p) for p in parts] == [STARTED * BATCH // GROWN] * GROWN, (j, parts)
        if j >= left_at:
            assert len(parts) == GROWN - 1, (j, parts)
        batches.append([i for p in parts for i in p])
    per_epoch = SAMPLES // (STARTED * BATCH)
    for epoch in range(EPOCHS):  # nothing dropped, nothing trained twice
        trained = sorted(i for j in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in batches[j])
        assert trained == list(range(SAMPLES)), f"epoch {epoch}"
    reference = replay(batches, records[0]["history"], SAMPLES)
    for j, want in enumerate(reference):
        got = records[0]["history"][j][2]
        for rank in range(1, GROWN):
            if first[rank] <= j < last[rank]:
                assert torch.equal(got, records[rank]["history"][j - first[rank]][2]), f"rank {rank} after batch {j}"
        close(got, want, f"after batch {j}")
    # the servers' state cut over the three that stay: every element served once, each shard replicated on the next
    shards = {r: records[r]["shards"] for r in staying}
    assert all(s["members"] == tuple(staying) for s in shards.values()), shards
    for rank, mine in shards.items():
        owner = mine["members"][mine["owner"]]  # (the layout's group rank)
        pairs = zip(mine["replica"], shards[owner]["own"], strict=True)
        assert owner == staying[staying.index(rank) - 1] and all(_same_pieces(a, b) for a, b in pairs), rank
    served = [sum(e - s for pieces in shards[r]["own"] for _, s, e, _ in pieces) for r in staying]
    assert sum(served) == sum(p.numel() for p in Reference(SAMPLES).parameters()) and min(served) > 0, served
