"""``staleness=`` on the parameter servers: SSP and asynchronous training under Lightning.

``staleness=0`` is the synchronous step. With ``k >= 1`` and a straggler, fast ranks run ahead by at
most ``k`` steps (the record of every rank shows it), every rank ends with the same weights, Lightning's features
keep working (validation, EarlyStopping, checkpoints, manual optimization, BatchNorm), a checkpoint taken mid-run
resumes from exactly the servers' weights and optimizer state, and a killed rank is named by the others.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_dp import ParameterServerStrategy, ShardedParameterServerStrategy
from lightning_dp.comm.errors import ConfigurationError
from tests.helpers.launch import BATCH, STEPS, load_ranks, run_script
from tests.helpers.replicas import TOLERANCE, assert_identical_replicas
from tests.scripts.models import reference_training


@pytest.mark.unit
@pytest.mark.parametrize("cls", [ParameterServerStrategy, ShardedParameterServerStrategy])
def test_staleness_option_is_checked_at_construction(cls):
    assert cls().staleness == 0 and cls(staleness=None).staleness is None and cls(staleness=3).staleness == 3
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ConfigurationError, match="staleness must be an integer >= 0 or None"):
            cls(staleness=bad)
    with pytest.raises(ConfigurationError, match="compression='bf16' needs staleness=0"):
        cls(staleness=2, compression="bf16")
    strategy = cls(staleness=1, parallel_devices=[torch.device("cuda", 0)])
    with pytest.raises(ConfigurationError, match="staleness=1 runs on CPU devices only"):
        strategy._check_world_size(1)


@pytest.mark.unit
def test_an_arriving_gradient_steps_with_the_scaling_rules():
    from lightning_dp.comm.consistency import arrival_scale

    w = [torch.nn.Parameter(torch.zeros(2))]
    assert arrival_scale(torch.optim.SGD(w, lr=0.1, momentum=0.9), 4) == {"lr": 0.25}
    assert arrival_scale(torch.optim.Adam(w, lr=1e-3), 4) == {"lr": 0.5}  # square-root rule
    # decoupled decay: N arrivals at lr / sqrt(N) decay by lr * weight_decay in all, as one synchronous step
    assert arrival_scale(torch.optim.AdamW(w, lr=1e-3, weight_decay=0.1), 4) == {"lr": 0.5, "weight_decay": 0.5}
    assert arrival_scale(torch.optim.Adam(w, lr=1e-3, decoupled_weight_decay=True), 9)["weight_decay"] == 1 / 3


@pytest.mark.unit
def test_registry_entries_take_the_option():
    entry = StrategyRegistry["sharded_ps"]
    assert entry["strategy"](**entry["init_params"], staleness=None).staleness is None


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["parameter_server", "sharded_ps"])
def test_staleness_zero_is_the_synchronous_step(tmp_path, strategy):
    """``staleness=0`` given explicitly: every step equals one process on the global batch (as the synchronous
    servers' own tests check), replicas bit-identical after every step, and every step's staleness 0."""
    args = ["--strategy", strategy, "--devices", "2", "--steps", str(STEPS), "--optimizer", "adamw"]
    run_script("fit", *args, "--staleness", "0", "--out", str(tmp_path))
    ranks = load_ranks(tmp_path, 2)
    assert_identical_replicas(ranks)
    reference = reference_training(BATCH * 2, STEPS, "adamw")
    assert len(ranks[0]["weights"]) == STEPS
    for step, (got, want) in enumerate(zip(ranks[0]["weights"], reference, strict=True)):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=f"step {step + 1} differs from one process")
    assert all(r["staleness_seen"] == {0: STEPS} for r in ranks) and ranks[0]["codec"] == "none"


def straggler_run(tmp_path, strategy: str, staleness: str, steps: int = 12) -> list[dict]:
    """Three ranks, rank 1 sleeping 0.25 s before each of its steps (the others take milliseconds)."""
    args = ["--strategy", strategy, "--devices", "3", "--steps", str(steps), "--optimizer", "adamw"]
    run_script("fit", *args, "--staleness", staleness, "--slow-rank", "1", "--slow-seconds", "0.25",
               "--out", str(tmp_path), timeout=240)  # fmt: skip
    return load_ranks(tmp_path, 3)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, k", [("sharded_ps", 2), ("parameter_server", 1)])
def test_bounded_staleness_lets_fast_ranks_run_ahead_by_at_most_k(tmp_path, strategy, k):
    ranks = straggler_run(tmp_path, strategy, str(k))
    for rank, r in enumerate(ranks):
        assert sum(r["staleness_seen"].values()) == 12
        assert max(r["staleness_seen"]) <= k, (rank, r["staleness_seen"])
    for fast in (0, 2):  # ran ahead as far as allowed, at almost every step
        assert ranks[fast]["staleness_seen"].get(k, 0) >= 12 - 2 * k, ranks[fast]["staleness_seen"]
    # the end of training gives every rank the same weights, every update included
    assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)
    assert not torch.equal(ranks[0]["final"], ranks[0]["weights"][0])


@pytest.mark.multiprocess
def test_asynchronous_fast_ranks_do_not_wait_for_the_straggler(tmp_path):
    ranks = straggler_run(tmp_path, "sharded_ps", "none")
    for fast in (0, 2):  # far beyond any small bound: their last steps had most of the straggler's steps missing
        assert max(ranks[fast]["staleness_seen"]) >= 6, ranks[fast]["staleness_seen"]
    assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)


@pytest.mark.multiprocess
def test_a_killed_rank_is_named_by_the_others_within_the_timeout(tmp_path):
    args = ["--strategy", "sharded_ps", "--devices", "3", "--steps", "20", "--staleness", "2", "--timeout", "60"]
    start = time.monotonic()
    crashed = run_script("fit", *args, "--kill-rank", "2", "--kill-step", "4", "--out", str(tmp_path), timeout=120,
                         check=False)  # fmt: skip
    seconds = time.monotonic() - start
    assert crashed.returncode != 0
    named = re.search(r"PeerUnreachableError: rank [01] .*rank 2", crashed.stdout)
    assert named, crashed.stdout[-3000:]
    assert seconds < 60, seconds  # well within the strategy's 60 s timeout: the dead rank's sockets closed


@pytest.mark.multiprocess
def test_sigterm_on_one_rank_stops_every_rank_naming_it(tmp_path):
    """Lightning's own SIGTERM handling broadcasts from rank 0; under staleness a terminated rank tells the servers
    instead: rank 1 alone gets SIGTERM, and every rank stops (rank 0 naming rank 1) instead of waiting."""
    args = ["--strategy", "sharded_ps", "--devices", "3", "--steps", "30", "--staleness", "2", "--timeout", "60"]
    start = time.monotonic()
    stopped = run_script("fit", *args, "--sigterm-rank", "1", "--kill-step", "4", "--out", str(tmp_path), timeout=120,
                         check=False)  # fmt: skip
    assert stopped.returncode != 0 and time.monotonic() - start < 60
    assert re.search(r"rank [02] stops at step \d+: rank 1 was asked to terminate \(SIGTERM\)", stopped.stdout), (
        stopped.stdout[-3000:]
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("staleness", ["none"])
def test_lightning_features_keep_working(tmp_path, staleness):
    """The feature script (validation, sync_dist logging, EarlyStopping on a metric only one rank sees stall,
    ModelCheckpoint, accumulation, clipping, AdamW + StepLR, validate/test/predict, bf16-mixed, BatchNorm, manual
    optimization with two optimizers) under sharded_ps with staleness: it finishes, stops where ddp stops, and
    every evaluation sees identical weights on every rank."""
    run_script("features", "--strategy", "sharded_ps", "--staleness", staleness, "--out", str(tmp_path), timeout=400)
    ranks = load_ranks(tmp_path, 2)
    assert ranks[0]["epochs"] == ranks[1]["epochs"] == 3 and ranks[0]["stopped"]  # EarlyStopping, as under ddp
    for r in ranks:  # a weight set in on_fit_start survived the sanity check's flush on every rank
        assert torch.equal(r["edited_at_train_start"], torch.full((4,), 0.123))
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])
    for stage, key in (("validate", "val_loss"), ("test", "test_loss")):
        assert ranks[0][stage][0][key] == ranks[1][stage][0][key]
    assert len(ranks[0]["predict"]) == len(ranks[1]["predict"]) == 2  # each rank its share of the samples
    assert ranks[0]["lrs"] == ranks[1]["lrs"] and ranks[0]["lrs"][-1] < ranks[0]["lrs"][0]  # StepLR stepped
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    gan = ranks[0]["gan_weights"]  # 4 batches of two optimizer steps each, both optimizers served
    assert len(gan) == 4 and not torch.equal(gan[0], gan[-1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["parameter_server", "sharded_ps"])
def test_a_checkpoint_taken_mid_run_resumes_from_the_servers_state(tmp_path, strategy):
    common = ["--strategy", strategy, "--staleness", "2", "--optimizer", "adamw"]
    run_script("resume", *common, "--max-epochs", "1", "--checkpoint-every", "3", "--out", str(tmp_path / "a"))
    ckpt = tmp_path / "a" / "ckpt" / "step=3.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    run_script("resume", *common, "--max-epochs", "2", "--resume-from", str(ckpt), "--out", str(tmp_path / "b"))
    resumed = load_ranks(tmp_path / "b", 2)
    saved_weights = torch.cat([v.flatten() for v in saved["state_dict"].values()])
    for r in resumed:  # every rank starts from the checkpoint's weights
        assert torch.equal(r["start_weights"], saved_weights)
    # the servers took their shares of the checkpoint's optimizer state: consolidated again, it is the same
    state, want = resumed[0]["start_optimizer_state"], saved["optimizer_states"][0]
    assert state["param_groups"] == want["param_groups"] and state["state"].keys() == want["state"].keys()
    assert want["state"] and all(
        torch.equal(state["state"][i][key], value) for i, entry in want["state"].items() for key, value in entry.items()
    )
    assert resumed[0]["global_step"] == 12 and sum(resumed[0]["staleness_seen"].values()) == 12 - 3
    assert_identical_replicas([{"weights": [r["final"]]} for r in resumed])
