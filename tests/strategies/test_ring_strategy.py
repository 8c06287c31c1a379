"""``ring_allreduce`` under Lightning: N ranks must equal one process on the global batch, at every step."""

import json
import os

import pytest
import torch

from lightning_dp.comm.transports.shm import SPIN_SECONDS
from tests.helpers.distributed import free_port
from tests.helpers.launch import BATCH, REPO, STEPS, load_ranks, run_script, subprocess_env
from tests.helpers.replicas import assert_identical_replicas, assert_replicas_follow
from tests.scripts.models import reference_training

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "devices, optimizer, accumulate",
    [(2, "sgd", 1), (3, "adamw", 1), (2, "sgd", 2)],
    ids=["2-sgd", "3-adamw", "2-sgd-accumulate2"],
)
def test_equals_single_process_on_global_batch(tmp_path, devices, optimizer, accumulate):
    wait = "spin" if devices == 3 else "sleep"  # spinning where 3 ranks share 2 cores changes only the speed
    run_script(
        "fit", "--strategy", "ring_allreduce", "--devices", str(devices), "--batch-size", str(BATCH),
        "--steps", str(STEPS), "--optimizer", optimizer, "--accumulate", str(accumulate), "--shm-wait", wait,
        "--out", str(tmp_path),
    )  # fmt: skip
    ranks = load_ranks(tmp_path, devices)
    assert [r["spin_seconds"] for r in ranks] == [SPIN_SECONDS if wait == "spin" else 0.0] * devices
    assert all(len(r["weights"]) == STEPS * accumulate for r in ranks)
    assert_identical_replicas(ranks)
    reference = reference_training(BATCH * devices, STEPS, optimizer, accumulate)
    # Lightning records weights after every micro-batch; the optimizer steps on each accumulate-th one
    stepped = ranks[0]["weights"][accumulate - 1 :: accumulate]
    for step, (got, want) in enumerate(zip(stepped, reference, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step + 1} differs from one process")
    assert not torch.equal(stepped[0], stepped[-1]), "training did not move the weights"


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_batchnorm_buffers_follow_rank_zero(tmp_path, broadcast_buffers):
    args = ["--devices", "2", "--batchnorm", "--steps", "3", "--out", str(tmp_path)]
    run_script("fit", *args, *([] if broadcast_buffers else ["--no-broadcast-buffers"]))
    ranks = load_ranks(tmp_path, 2)
    assert_identical_replicas(ranks)
    # running stats as each rank saw them at the start of each step (after the broadcast, before forward)
    buffers = [r["buffers"] for r in ranks]
    assert len(buffers[0]) == 3
    assert torch.equal(buffers[0][0], buffers[1][0])  # set-up broadcast
    later_equal = [torch.equal(a, b) for a, b in zip(buffers[0][1:], buffers[1][1:], strict=True)]
    assert all(later_equal) if broadcast_buffers else not any(later_equal)


def test_lightning_demo_models_train_unchanged(tmp_path):
    run_script("fit_demo", "--strategy", "ring_allreduce", "--devices", "2", "--out", str(tmp_path), timeout=300)
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name in ("BoringModel", "DemoModel", "ManualOptimBoringModel"):
        assert summary[name]["moved"], name
        assert summary[name]["steps"] == 3, name
        assert summary[name]["checked"] == 3, name
    boring = summary["BoringModel"]
    assert len(boring["validate"]) == 1 and len(boring["test"]) == 1
    assert boring["predict_batches"] == 2


@pytest.mark.parametrize(
    "strategy, start_method",
    [("ring_allreduce_spawn", None), ("sharded_ps_fork", None), ("parameter_server", "forkserver")],
)
def test_spawn_fork_and_forkserver_start_methods(tmp_path, strategy, start_method):
    args = ["--strategy", strategy, "--devices", "2", "--models", "BoringModel", "--fit-only", "--out", str(tmp_path)]
    args += ["--start-method", start_method] if start_method else []
    run_script("fit_demo", *args, timeout=300)
    # the loop state stays in the started processes, which check their replicas themselves after every batch
    summary = json.loads((tmp_path / "summary.json").read_text())["BoringModel"]
    assert summary["moved"]
    assert summary["start_method"] == (start_method or strategy.rsplit("_", 1)[1])


def test_two_nodes_through_cluster_environment_variables(tmp_path):
    """Two "nodes" on this machine, joined only through MASTER_ADDR / MASTER_PORT / NODE_RANK as on a cluster."""
    import subprocess
    import sys

    env = subprocess_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"})
    cmd = [sys.executable, "-m", "tests.scripts.fit", "--devices", "1", "--num-nodes", "2", "--out", str(tmp_path)]
    nodes = [
        subprocess.Popen(cmd, cwd=REPO, env={**env, "NODE_RANK": str(n)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for n in range(2)
    ]  # fmt: skip
    try:
        outputs = [node.communicate(timeout=180)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert_replicas_follow(
        load_ranks(tmp_path, 2), "weights", reference_training(BATCH * 2, 4, "sgd"), "vs one process"
    )


def test_torchrun_environment(tmp_path):
    import subprocess
    import sys

    env = subprocess_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "tests.scripts.fit", "--devices", "2", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, out
    assert_identical_replicas(load_ranks(tmp_path, 2))


def test_without_shared_memory_every_rank_falls_back_to_sockets_with_a_warning(tmp_path):
    """A node whose ranks cannot share memory (here: no such tmpfs) trains over sockets, with the same weights."""
    out = run_script("fit", "--devices", "2", "--out", str(tmp_path),
                     env={"LIGHTNING_DP_SHM_DIR": str(tmp_path / "missing")})  # fmt: skip
    assert "cannot share memory" in out.stdout and "could not create" in out.stdout, out.stdout[-3000:]
    ranks = load_ranks(tmp_path, 2)
    assert {r["transport"] for r in ranks} == {"RingTransport"}
    assert_replicas_follow(ranks, "weights", reference_training(BATCH * 2, 4, "sgd"), "vs one process")
