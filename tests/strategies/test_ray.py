"""Ray Train as Ray documents it: ``TorchTrainer`` with 2 CPU workers, ``RayLightningEnvironment`` and
``devices="auto"``, every strategy by name and every class of :mod:`lightning_dp.ray` through ``prepare_trainer``,
against ``RayDDPStrategy`` after every step; Ray Train's restart after a killed worker (``FailureConfig``), resumed
from the reported checkpoint, against the uninterrupted run. One launch of ``tests/scripts/ray_train.py`` for all."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.replicas import TOLERANCE

pytest.importorskip("ray.train.lightning", reason='Ray Train is not installed (pip install "lightning-dp[ray]")')

pytestmark = pytest.mark.multiprocess

#: the strategies the script restarts (its RESTARTED)
RESTARTED = ["sharded_ps"]
VARIANTS = ["ring_allreduce", "parameter_server", "sharded_ps", "RayRingAllReduceStrategy",
            "RayParameterServerStrategy", "RayShardedParameterServerStrategy"]  # fmt: skip


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray")
    run = run_script("ray_train", "--out", str(out), timeout=420)
    return out, run.stdout


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_strategy_under_ray_train_follows_ray_ddp(ray_run, variant):
    out, log = ray_run
    reference = [torch.load(out / "ray_ddp" / f"rank{r}.pt") for r in range(2)]
    ranks = [torch.load(out / variant / f"rank{r}.pt") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]  # from Ray's context, not devices="auto" (one CPU)
    assert ranks[0]["strategy"] == ranks[1]["strategy"]
    assert len(ranks[0]["history"]) == len(reference[0]["history"]) == 4
    for step, (mine, ddp) in enumerate(zip(ranks[0]["history"], reference[0]["history"], strict=True)):
        torch.testing.assert_close(mine, ddp, **TOLERANCE, msg=lambda m: f"{variant}, step {step}: {m}")  # noqa: B023
    for a, b in zip(ranks[0]["history"], ranks[1]["history"], strict=True):
        assert torch.equal(a, b)  # replicas bit-identical


def test_an_option_ray_overrides_is_named_once(ray_run):
    _, log = ray_run
    said = [line for line in log.splitlines() if "the default process group was created before the strategy" in line]
    assert said and all("`timeout`" in line for line in said)
    # once per worker process, by the first of its fits to set up: ring_allreduce in the first two workers (after
    # Ray's DDP; parameter_server and sharded_ps follow there), sharded_ps in the restarted run's; Ray repeats a
    # line through the driver's log and Lightning's logger, so the lines themselves are not counted
    named = {name for line in said for name in re.findall(r"strategy '(\w+)'", line)}
    assert named == {"ring_allreduce", "sharded_ps"}, named


@pytest.mark.parametrize("strategy", RESTARTED)
def test_a_restart_after_a_killed_worker_ends_with_the_uninterrupted_weights(ray_run, strategy):
    """Worker 1 SIGKILLed after step 6 of 8 (epoch 1 of 2); Ray Train starts both workers again, they resume from the
    checkpoint reported at epoch 0's end (step 4) and finish with the uninterrupted run's weights, bit for bit, having
    retrained exactly its steps 5 to 8."""
    out, log = ray_run
    assert (out / "restarted" / f"killed-{strategy}").exists(), log[-3000:]
    full = [torch.load(out / "uninterrupted" / strategy / f"rank{r}.pt") for r in range(2)]
    restarted = [torch.load(out / "restarted" / strategy / f"rank{r}.pt") for r in range(2)]
    for rank, (a, b) in enumerate(zip(full, restarted, strict=True)):
        assert a["resumed_step"] is None and b["resumed_step"] == 4, (rank, b["resumed_step"])
        assert len(a["history"]) == 8 and len(b["history"]) == 4, rank
        for step, (got, want) in enumerate(zip(b["history"], a["history"][4:], strict=True), start=5):
            assert torch.equal(got, want), f"rank {rank}, step {step}"
        assert torch.equal(a["weights"], b["weights"]), rank
