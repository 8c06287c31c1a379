"""``backup_workers=b``: every step closes with the first ``N - b`` gradients, equals one process on those ranks'
batches, leaves every replica with the same weights; a slow rank's late gradients are dropped and counted, and it
skips the steps that closed without it."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn

from lightning_dp import ParameterServerStrategy, ShardedParameterServerStrategy
from lightning_dp.comm.consistency.backup import HISTORY
from lightning_dp.strategies.engines import BackupEngine, CentralServerEngine, ShardedServerEngine
from tests.helpers.launch import run_script
from tests.helpers.replicas import close

DEVICES, BATCH, SAMPLES = 3, 4, 72  # 6 batches of 4 per rank and epoch, 2 epochs
#: ``tests/scripts/midepoch.py`` with one backup worker, rank 2 slow, the learning rate scheduled per step
BACKUP_RUN = ("--devices", str(DEVICES), "--samples", str(SAMPLES), "--backup-workers", "1", "--slow-rank", "2",
              "--slow-per-sample", "0.05", "--lr-every-step")  # fmt: skip


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    """The run of :data:`BACKUP_RUN` once per strategy in this module (the resume test continues one of them).
    Returns (folder, each rank's results)."""
    runs: dict[str, tuple] = {}

    def run(strategy: str):
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"backup-{strategy}")
            run_script("midepoch", "--strategy", strategy, *BACKUP_RUN, "--out", str(out), timeout=180)
            runs[strategy] = (out, [torch.load(out / f"rank{r}.pt") for r in range(DEVICES)])
        return runs[strategy]

    return run


def _replay(ranks: list[dict], checkpoint: dict | None = None) -> list[torch.Tensor]:
    """One process with ``tests/scripts/midepoch.py``'s model, data and optimizer (the learning rate scheduled per
    step), from ``checkpoint`` if given, each step on the batches of the ranks whose gradients the step used; the
    weights after every step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 2, generator=g)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    if checkpoint is not None:
        net.load_state_dict({k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()})
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
    history = []
    for j in range(len(ranks[0]["history"])):
        used = [rank["trained"][j] for rank in ranks if rank["trained"][j] is not None and not rank["late"][j]]
        # the servers' mean of the members' gradients, each the mean over its own batch of equal size
        loss = sum(nn.functional.mse_loss(net(x[batch]), y[batch]) for batch in used) / len(used)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        history.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
    return history


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["parameter_server", "sharded_ps"])
def test_a_slow_rank_is_left_out_and_every_step_is_its_members_mean(slow_runs, strategy):
    _, ranks = slow_runs(strategy)
    steps = 2 * SAMPLES // (DEVICES * BATCH)
    assert all(len(r["history"]) == len(r["trained"]) == len(r["late"]) == steps for r in ranks)
    assert all(r["global_step"] == steps for r in ranks)
    for j in range(steps):
        members = [r for r in range(DEVICES) if ranks[r]["trained"][j] is not None and not ranks[r]["late"][j]]
        assert len(members) == DEVICES - 1, (j, members)  # the first N - b, exactly
        for r in range(1, DEVICES):
            assert torch.equal(ranks[r]["history"][j][2], ranks[0]["history"][j][2]), f"rank {r} after step {j}"
    slow = ranks[2]
    late = sum(slow["late"])
    skipped = sum(t is None for t in slow["trained"])
    assert late >= 1 and skipped >= 1 and late + skipped >= steps // 2, (late, skipped)
    assert slow["skipped"] == skipped
    assert slow["monitor"] == (late, skipped)  # CommMonitor's summary
    assert slow["logged"] == {"comm/late_gradients": late, "comm/skipped_steps": skipped}  # its running totals
    assert [sum(r["late"]) for r in ranks[:2]] == [0, 0]  # the fast ranks are never late
    dropped = [r["dropped_by_server"] for r in ranks if r["dropped_by_server"] is not None]
    assert dropped and all(d == [0, 0, late] for d in dropped)  # every server dropped exactly the late gradients
    for j, want in enumerate(_replay(ranks)):
        close(ranks[0]["history"][j][2], want, f"{strategy}: after step {j}")


@pytest.mark.multiprocess
def test_a_mid_epoch_resume_continues_from_the_checkpoint_exactly(tmp_path, slow_runs):
    """The run resumed from a checkpoint taken mid-epoch trains the epoch's remaining batches, and each of its steps
    is one process's step from the checkpoint's weights, optimizer and schedule on that step's members' batches."""
    full_dir, _ = slow_runs("sharded_ps")
    checkpoint = full_dir / "ckpt" / "step=9.ckpt"  # epoch 1, batch 3 of 6
    resumed_dir = tmp_path / "resumed"
    run_script("midepoch", "--strategy", "sharded_ps", *BACKUP_RUN, "--resume-from", str(checkpoint), "--out",
               str(resumed_dir), timeout=180)  # fmt: skip
    ranks = [torch.load(resumed_dir / f"rank{r}.pt") for r in range(DEVICES)]
    assert all(len(r["history"]) == 3 and r["global_step"] == 12 for r in ranks)
    assert [batch for epoch, batch, _ in ranks[0]["history"]] == [3, 4, 5]
    reference = _replay(ranks, torch.load(checkpoint, weights_only=False))
    for j, want in enumerate(reference):
        assert all(torch.equal(r["history"][j][2], ranks[0]["history"][j][2]) for r in ranks)
        close(ranks[0]["history"][j][2], want, f"resumed: step {j}")


@pytest.mark.multiprocess
def test_a_rank_more_than_history_steps_behind_jumps_to_the_newest_weights(tmp_path):
    """Rank 2 stalls 5 s in its second step while the other two close every remaining step of the epoch (one
    backup worker; no checkpoint, a collective, in between). Its late push then asks for the weights after step 2,
    which the servers no longer keep (they keep the last ``HISTORY`` versions): it gets the newest weights, more
    than ``HISTORY`` steps later, and then follows rank 0 again, ending with the same weights."""
    samples = 2 * SAMPLES  # one epoch of 12 steps
    run_script("midepoch", "--strategy", "sharded_ps", "--devices", str(DEVICES), "--samples", str(samples),
               "--max-epochs", "1", "--checkpoint-every", "1000", "--backup-workers", "1", "--slow-rank", "2",
               "--stall-at-step", "1", "--stall-seconds", "5", "--out", str(tmp_path), timeout=180)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(DEVICES)]
    steps = samples // (DEVICES * BATCH)
    fast, slow = ([weights for _, _, weights in r["history"]] for r in (ranks[0], ranks[2]))
    assert len(fast) == len(slow) == steps
    assert ranks[2]["late"][1], "the stalled step's gradient was not late"
    newest = [k + 1 for k in range(steps) if torch.equal(slow[1], fast[k])]  # the version it received
    assert newest and newest[-1] - 1 > HISTORY, f"rank 2 resumed from version {newest}, not a jump"
    assert not torch.equal(slow[1], fast[1]), "rank 2 got the weights after its own step, which had been dropped"
    assert torch.equal(slow[-1], fast[-1]) and torch.equal(ranks[1]["history"][-1][2], fast[-1])


@pytest.mark.unit
@pytest.mark.parametrize(
    "cls, engine",
    [(ParameterServerStrategy, CentralServerEngine), (ShardedParameterServerStrategy, ShardedServerEngine)],
)
def test_no_backup_workers_is_the_synchronous_step(cls, engine):
    assert type(cls().engine) is engine and type(cls(backup_workers=0).engine) is engine
    assert type(cls(backup_workers=1).engine) is BackupEngine


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backup_workers": -1}, "backup_workers must be an integer >= 0, got -1"),
        ({"backup_workers": 1.5}, "backup_workers must be an integer >= 0"),
        ({"backup_workers": 1, "staleness": 2}, "backup_workers=1 needs staleness=0"),
        ({"backup_workers": 1, "num_servers": 2}, "backup_workers=1 needs num_servers=0"),
        ({"backup_workers": 1, "compression": "fp16"}, "backup_workers=1 needs compression='none'"),
        ({"backup_workers": 1, "balance": "throughput"}, "backup_workers=1 needs balance='none'"),
    ],
)
def test_backup_workers_refusals_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParameterServerStrategy(**kwargs)


@pytest.mark.unit
def test_backup_workers_must_leave_a_gradient():
    with pytest.raises(ValueError, match="backup_workers=2 leaves no gradient to aggregate among 2 workers"):
        L.Trainer(strategy=ShardedParameterServerStrategy(backup_workers=2), accelerator="cpu", devices=2)


@pytest.mark.unit
def test_what_a_skipping_rank_cannot_do_is_refused_at_set_up():
    engine = ParameterServerStrategy(backup_workers=1).engine
    module = SimpleNamespace(automatic_optimization=False, modules=lambda: [torch.nn.SyncBatchNorm(3)])
    trainer = SimpleNamespace(accumulate_grad_batches=2, gradient_clip_val=0.5, lightning_module=module)
    with pytest.raises(
        ValueError,
        match="cannot run accumulate_grad_batches=2, manual optimization, gradient_clip_val=0.5, SyncBatchNorm",
    ):
        engine.setup_trainer(trainer)
    with pytest.raises(ValueError, match="read or edited before the optimizer step by GradLogger"):
        engine.full_gradients(trainer, ["GradLogger"])
    with engine.training_step_context(), pytest.raises(ValueError, match="sync_dist"):
        engine.check_collective("Lightning's reduce (self.log(..., sync_dist=True))")
