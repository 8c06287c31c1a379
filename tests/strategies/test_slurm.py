"""A real single-host SLURM cluster (Debian's ``slurm-wlm`` and ``munge``, on loopback, started here and stopped
after): every strategy as one ``srun`` job under Lightning's ``SLURMEnvironment``, the same weights as Lightning's
own launch; a job requeued mid-epoch by ``examples/slurm/train.sbatch``'s trap, ending with the uninterrupted
weights; the example app as one ``sbatch`` job (docs/clusters.md's script) with one run folder; global rank 0 of
an ``srun`` job lost mid-step, the other tasks going on (``on_rank_loss="continue"``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import slurm
from tests.helpers.launch import CLUSTER_VARIABLES, QUICK, REPO, subprocess_env
from tests.helpers.midepoch import read_seen, replay_loss
from tests.helpers.replicas import assert_continues, close

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
    for a, b in zip(lightning, _ranks(job), strict=True):
        assert torch.equal(a["weights"], b["weights"]) and a["trained"] == b["trained"]


#: a job of two tasks that SLURM may requeue, with the example script's trap: USR1 (sent before a time limit)
#: requeues it; the ranks resume from the newest checkpoint in their folder
REQUEUED_JOB = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}/slurm-%j.out
{trap}
srun {python} -m tests.scripts.midepoch --strategy {strategy} --resume-from newest --pause-at-step 10 --out {out} &
wait
"""


def _job_state(job_id: str, env: dict) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def test_a_job_requeued_mid_epoch_ends_with_the_uninterrupted_weights(cluster, tmp_path, uninterrupted):
    """The path of a job at its time limit: SLURM signals the batch script (USR1), whose trap (the one of
    ``examples/slurm/train.sbatch``) requeues the job; SLURM stops its tasks, paused after step 10, and starts the job
    again (``SLURM_RESTART_COUNT=1``), which resumes from the step-9 checkpoint and finishes bit for bit where the
    uninterrupted run did. One strategy: the requeue is SLURM's and the resume the one every strategy's torchrun
    restart checks (tests/strategies/test_clusters.py)."""
    strategy = "sharded_ps"
    _, full = uninterrupted(strategy)
    (trap,) = [line for line in (REPO / "examples" / "slurm" / "train.sbatch").read_text().splitlines()
               if line.startswith("trap ")]  # fmt: skip
    script = tmp_path / "requeued.sbatch"
    script.write_text(REQUEUED_JOB.format(out=tmp_path, trap=trap, python=sys.executable, strategy=strategy))
    env = _env(cluster)
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        _wait_for(lambda: all((tmp_path / f"paused-rank{r}").exists() for r in range(2)), 180, job_id, env, tmp_path)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=env, check=True, timeout=30)
        _wait_for(lambda: _job_state(job_id, env).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 240,
                  job_id, env, tmp_path)  # fmt: skip
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True, timeout=30)
    state = _job_state(job_id, env)
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", (state, log[-5000:])
    resumed = _ranks(tmp_path)
    assert all(r["resumed_from"].endswith("step=9.ckpt") for r in resumed), log[-5000:]
    assert_continues(full, resumed)


def _wait_for(condition, seconds: float, job_id: str, env: dict, folder: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            log = "".join(p.read_text() for p in folder.glob("slurm-*.out"))
            raise AssertionError(f"job {job_id} after {seconds} s: {_job_state(job_id, env)}\n{log[-5000:]}")
        time.sleep(0.5)


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


def test_global_rank_0_of_an_srun_job_is_lost_and_the_other_tasks_go_on(cluster, tmp_path):
    """``srun --kill-on-bad-exit=0`` leaves the other tasks running when one dies; under ``on_rank_loss="continue"``
    they agree on the loss of global rank 0 (whose process served the rendezvous store), go on, and from the loss on
    train what one process would on the same global batches, rank 1 writing the checkpoints."""
    samples, batch, lost_at = 48, 4, 3
    run = subprocess.run(["srun", "--nodes=1", "--ntasks-per-node=3", "--kill-on-bad-exit=0",
                          "--job-name=lightning-dp-test", sys.executable, "-m", "tests.scripts.midepoch",
                          "--strategy", "ring_allreduce", "--devices", "3", "--samples", str(samples), "--batch-size",
                          str(batch), "--on-rank-loss", "continue", "--heartbeat-timeout", "2", "--intra-node",
                          "ring", "--lose-rank", "0", "--lose-at-step", str(lost_at), "--out", str(tmp_path)],
                         cwd=REPO, env=_env(cluster), capture_output=True, text=True, timeout=240)  # fmt: skip
    output = (run.stdout + run.stderr)[-5000:]
    assert run.returncode != 0 and "task 0: Killed" in output, output  # srun reports the lost task
    assert not (tmp_path / "rank0.pt").exists()
    survivors = [torch.load(tmp_path / f"rank{r}.pt") for r in (1, 2)]
    steps = 2 * samples // (3 * batch)
    for s in survivors:
        assert s["global_step"] == steps and len(s["history"]) == steps, output
        assert s["rank_loss"]["lost_ranks"] == [0] and s["rank_loss"]["loss_causes"] == ["closed"]
        assert s["world_size"] == 2
    reference = replay_loss(survivors, read_seen(tmp_path / "seen-rank0.txt"), samples)
    for j, want in enumerate(reference):
        assert torch.equal(survivors[0]["history"][j][2], survivors[1]["history"][j][2]), f"after batch {j}"
        close(survivors[0]["history"][j][2], want, f"after batch {j}")
    # rank 0's roles moved to rank 1: the checkpoints after the loss were written
    assert (tmp_path / "ckpt" / "step=6.ckpt").exists()
