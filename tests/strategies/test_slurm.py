"""A real single-host SLURM cluster (Debian's ``slurm-wlm`` and ``munge``, on loopback, started here and stopped
after): every strategy as one ``srun`` job under Lightning's ``SLURMEnvironment``, the same weights as Lightning's
own launch; the example app as one ``sbatch`` job (``examples/slurm/train.sbatch``, docs/clusters.md's script) with one
run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import slurm
from tests.helpers.launch import CLUSTER_VARIABLES, QUICK, REPO, subprocess_env

pytestmark = pytest.mark.multiprocess

STRATEGIES = ["ring_allreduce", "parameter_server", "sharded_ps", "ddp"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm.unavailable()
    if reason:
        pytest.skip(f"no SLURM cluster: {reason}")
    with slurm.slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def _env(cluster: dict) -> dict:
    env = {k: v for k, v in subprocess_env().items() if k not in CLUSTER_VARIABLES and not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` in job scripts
    return {**env, **cluster}


def _ranks(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_as_one_slurm_job(cluster, tmp_path, uninterrupted, strategy):
    _, lightning = uninterrupted(strategy)
    job = tmp_path / "slurm"
    run = subprocess.run(["srun", "--nodes=1", "--ntasks-per-node=2", "--job-name=lightning-dp-test", sys.executable,
                          "-m", "tests.scripts.midepoch", "--strategy", strategy, "--out", str(job)],
                         cwd=REPO, env=_env(cluster), capture_output=True, text=True, timeout=240)  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    for a, b in zip(lightning, _ranks(job)):
        assert torch.equal(a["weights"], b["weights"]) and a["trained"] == b["trained"]


def test_the_example_app_as_one_sbatch_job_writes_one_run_folder(cluster, tmp_path):
    (tmp_path / "examples").symlink_to(REPO / "examples")
    run = subprocess.run(["sbatch", "--wait", "--parsable", str(REPO / "examples" / "slurm" / "train.sbatch"),
                          "strategy=sharded_ps", *QUICK],
                         cwd=tmp_path, env=_env(cluster), capture_output=True, text=True, timeout=400)  # fmt: skip
    job_id = run.stdout.strip().split(";")[0]
    log = tmp_path / f"slurm-{job_id}.out"
    output = log.read_text() if log.exists() else ""
    assert run.returncode == 0, (run.stderr + output)[-5000:]
    (folder,) = (tmp_path / "outputs").iterdir()
    assert folder.name == f"slurm-{job_id}"
    assert {p.name for p in folder.glob("*.log")} == {"train.log", "train_rank1.log"}
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["strategy"] == "ShardedParameterServerStrategy"
    assert "2 ranks on 1 node(s), started by SLURMEnvironment" in (folder / "train.log").read_text()
    assert (folder / "checkpoints" / "last.ckpt").exists()  # what a requeued job resumes from (ckpt_path=last)
