"""What clusters do: ranks started by the cluster (``devices="auto"``), torchrun's kill-and-restart, exact mid-epoch
resume, and jobs kept apart (stray ranks, a taken port, a killed launcher, a shared secret)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import free_port
from tests.helpers.launch import CLUSTER_VARIABLES, REPO, WARM, kill_process_tree, run_script, subprocess_env
from tests.helpers.replicas import assert_continues
from tests.helpers.warm import WarmProcess

pytestmark = pytest.mark.multiprocess

STRATEGIES = ["ring_allreduce", "parameter_server", "sharded_ps"]


def _ranks(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


# ---------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize(
    "strategy, options, step",
    [
        ("ring_allreduce", (), 12),  # epoch 1, batch 4 of 8
        ("sharded_ps", ("--workers", "2"), 12),  # the sampler's order is drawn in the loader's worker processes
        ("parameter_server", ("--accumulate", "2"), 3),  # epoch 0, batch 6 of 8, two batches per step
    ],
)
def test_fit_from_a_mid_epoch_checkpoint_continues_exactly(tmp_path, uninterrupted, strategy, options, step):
    full_dir, full = uninterrupted(strategy, *options)
    ckpt = full_dir / "ckpt" / f"step={step}.ckpt"
    # every warning shown: Lightning's "not resumable" must not be among them
    run = run_script("midepoch", "--strategy", strategy, *options, "--resume-from", str(ckpt), "--out",
                     str(tmp_path), timeout=180, env={"PYTHONWARNINGS": "default"})  # fmt: skip
    assert "the sampler skips" in run.stdout and "not resumable" not in run.stdout, run.stdout[-3000:]
    assert_continues(full, _ranks(tmp_path))


# ---------------------------------------------------------------------------------------------------- torchrun
def _torchrun(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in subprocess_env().items() if k not in CLUSTER_VARIABLES}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
               "--master-port", str(free_port()), "-m", "tests.scripts.midepoch", *args, "--out", str(out)]  # fmt: skip
    log = out.parent / f"{out.name}-torchrun.log"
    with log.open("w") as output:  # torchrun and its workers warm where they can be
        proc = WARM.start(command, env, REPO, output)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)  # the workers run in sessions of their own
        raise AssertionError(f"torchrun did not finish in {timeout} s:\n{log.read_text()[-5000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, log.read_text(), "")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torchrun_restart_after_a_killed_rank_ends_with_the_uninterrupted_weights(tmp_path, uninterrupted, strategy):
    """torchrun's defaults (its store shared by every attempt): rank 1 SIGKILLed after step 10, the restarted
    attempt resumes from the newest checkpoint (step 9) and finishes bit for bit where the uninterrupted run did."""
    _, full = uninterrupted(strategy)
    run = _torchrun(tmp_path, "--strategy", strategy, "--resume-from", "newest", "--kill-at-step", "10")
    assert run.returncode == 0, run.stdout[-6000:]
    resumed = _ranks(tmp_path)
    assert all(r["resumed_from"].endswith("step=9.ckpt") for r in resumed)
    assert_continues(full, resumed)


def test_ranks_started_by_the_cluster_take_their_world_size_from_it(tmp_path, uninterrupted):
    """``devices="auto"`` (one CPU device) in each of two processes a cluster started (Ray Train, SLURM): the world
    size, ranks and sampler come from the cluster environment, and the run equals Lightning's launch of two."""
    _, full = uninterrupted("sharded_ps")
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**subprocess_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0"}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.scripts.midepoch", "--strategy", "sharded_ps", "--devices", "auto",
             "--variables-environment", "--out", str(tmp_path)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    for a, b in zip(full, _ranks(tmp_path), strict=True):
        assert torch.equal(a["weights"], b["weights"]) and a["trained"] == b["trained"]


# ---------------------------------------------------------------------------------------------------- jobs apart
def _session_processes(session: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":  # field 6 of stat: the session id
                pids.append(int(entry))
    return pids


def _kill_session(session: int) -> None:
    for pid in _session_processes(session):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _assert_session_ends(session: int, within: float) -> None:
    deadline = time.monotonic() + within
    while _session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _session_processes(session)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the launch still alive after {within} s: {left}"


def _start_fit(*args: str, output: Path, env: dict | None = None) -> subprocess.Popen | WarmProcess:
    """``tests/scripts/midepoch.py args`` in a session of its own (warm where it can be), its output to the file
    ``output``."""
    full_env = {k: v for k, v in subprocess_env().items() if k not in CLUSTER_VARIABLES}
    with output.open("w") as log:
        return WARM.start([sys.executable, "-m", "tests.scripts.midepoch", *args], {**full_env, **(env or {})}, REPO,
                          log)  # fmt: skip


def test_a_launch_whose_port_is_taken_fails_naming_it_and_leaves_no_process(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        log = tmp_path / "output"
        proc = _start_fit(
            "--out", str(tmp_path), output=log, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        )
        proc.wait(timeout=120)
    out = log.read_text()
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in out and "another process holds the port" in out, out[-3000:]
    _assert_session_ends(proc.pid, within=10)


def test_sigkill_of_rank_0_stops_the_ranks_it_started(tmp_path):
    log = tmp_path / "output"
    proc = _start_fit("--pause-at-step", "1", "--out", str(tmp_path), output=log)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"paused-rank{r}").exists() for r in range(2)):  # both ranks are training
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _assert_session_ends(proc.pid, within=10)
    finally:
        _kill_session(proc.pid)


_STRAY = """
import os, sys
from datetime import timedelta
from lightning_dp.comm.cluster.rendezvous import init_bound_process_group
from lightning_dp.comm.errors import ForeignJobError
try:
    init_bound_process_group("gloo", "127.0.0.1", int(sys.argv[1]), 1, 2, timedelta(seconds=60), single_host=True,
                             local_rank=1)
except ForeignJobError as error:
    print("refused:", error)
    sys.exit(3)
print("joined")
"""

_STRAY_DDP = """
import sys, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=1, world_size=2)
"""


def _stray(code: str, port: int, env: dict) -> subprocess.Popen:
    full_env = {k: v for k, v in subprocess_env().items() if k not in CLUSTER_VARIABLES}
    return subprocess.Popen([sys.executable, "-c", code, str(port)], cwd=REPO, env={**full_env, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def test_stray_ranks_dialing_the_port_leave_the_job_unaffected(tmp_path, uninterrupted):
    """A rank of an earlier launch whose launcher died, and a `ddp` rank of another job, both dial the port
    before the job starts: the job finishes with its usual weights, our stray is refused naming the launch."""
    _, full = uninterrupted("ring_allreduce")
    port = free_port()
    ours = _stray(_STRAY, port, {"LIGHTNING_DP_LAUNCH": "999999:earlier"})
    theirs = _stray(_STRAY_DDP, port, {})
    try:
        time.sleep(3)  # both are dialing
        run = run_script("midepoch", "--out", str(tmp_path), timeout=180,
                         env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
        refused = ours.communicate(timeout=60)[0]
        assert theirs.poll() is None  # the `ddp` rank still waits for a job of its own: it joined nothing of ours
    finally:
        for proc in (ours, theirs):
            _kill_session(proc.pid)
    assert ours.returncode == 3 and "stray rank of an earlier launch" in refused, refused[-3000:]
    for a, b in zip(full, _ranks(tmp_path), strict=True):
        assert torch.equal(a["weights"], b["weights"])
    assert "Trainer.fit` stopped" in run.stdout


_SECRET_JOB = """
import os, sys
from datetime import timedelta
from lightning_dp.comm.cluster.rendezvous import init_bound_process_group
from lightning_dp.comm.errors import ForeignJobError
rank = int(sys.argv[2])
try:
    init_bound_process_group("gloo", "127.0.0.1", int(sys.argv[1]), rank, 2, timedelta(seconds=30), single_host=True)
except ForeignJobError as error:
    print("refused:", error)
    sys.exit(3)
import torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item())
"""


@pytest.mark.parametrize("secret_of_rank_1", ["right", "wrong", None])
def test_only_holders_of_the_job_secret_join(secret_of_rank_1):
    port = free_port()
    full_env = {k: v for k, v in subprocess_env().items() if k not in CLUSTER_VARIABLES}
    procs = []
    for rank, secret in ((0, "right"), (1, secret_of_rank_1)):
        env = {**full_env, **({"LIGHTNING_DP_JOB_SECRET": secret} if secret else {})}
        procs.append(subprocess.Popen([sys.executable, "-c", _SECRET_JOB, str(port), str(rank)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
        time.sleep(0.5 if rank == 0 else 0)
    rank1 = procs[1].communicate(timeout=60)[0]
    if secret_of_rank_1 == "right":
        assert procs[0].communicate(timeout=60)[0].strip().endswith("sum 2.0") and "sum 2.0" in rank1
        return
    procs[0].kill()  # it waits for a rank 1 that was refused
    assert procs[1].returncode == 3 and "shared secret" in rank1, rank1[-2000:]
    assert ("different" in rank1) == (secret_of_rank_1 == "wrong")
