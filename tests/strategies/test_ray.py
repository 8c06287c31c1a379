"""Ray Train as Ray documents it: ``TorchTrainer`` with 2 CPU workers, ``RayLightningEnvironment`` and
``devices="auto"``, every strategy by name and every class of :mod:`lightning_dp.ray` through ``prepare_trainer``,
against ``RayDDPStrategy`` after every step."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.replicas import TOLERANCE

pytest.importorskip("ray.train.lightning", reason='Ray Train is not installed (pip install "lightning-dp[ray]")')

pytestmark = pytest.mark.multiprocess

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
    # once per worker process, although six fits of three strategies ran there (Ray repeats a line through
    # the driver's log and Lightning's logger: count distinct worker pids)
    workers = {line.split("pid=", 1)[1].split(")", 1)[0] for line in said if "pid=" in line}
    assert len(workers) <= 2 and len({line.split(")", 1)[-1] for line in said}) <= 2
