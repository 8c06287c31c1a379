"""A real multi-node run: one Lightning node per emulated host (network namespace), joined only through
MASTER_ADDR / MASTER_PORT / NODE_RANK as on a cluster; then a link goes down mid-run."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.netns import IFNAME, SUBNET, emulated_hosts, node_ranks, server_command
from tests.helpers.hosts import Node, finish, start_in_host, stop
from tests.helpers.launch import BATCH, load_ranks, subprocess_env
from tests.helpers.netns import skip_without_netns
from tests.helpers.replicas import assert_identical_replicas
from tests.scripts.models import reference_training

pytestmark = [pytest.mark.multiprocess, pytest.mark.netns, skip_without_netns]

#: optimizer steps of tests/scripts/fit.py without --steps
FIT_STEPS = 4


def start_nodes(hosts, args, port, out: Path, devices=1) -> list[Node]:
    env = subprocess_env({"MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": str(port)})
    env.pop("GLOO_SOCKET_IFNAME", None)  # the strategies find the interface towards MASTER_ADDR themselves
    fit = [sys.executable, "-m", "tests.scripts.fit", "--devices", str(devices), "--num-nodes", str(len(hosts)), *args]
    return [start_in_host(host, fit, {**env, **extra}, out / f"node{rank}.log")
            for rank, (host, extra) in enumerate(zip(hosts, node_ranks(len(hosts)), strict=True))]  # fmt: skip


@pytest.mark.parametrize("strategy", ["ring_allreduce", "parameter_server", "sharded_ps"])
def test_equivalence_across_emulated_hosts(tmp_path, strategy):
    with emulated_hosts(2, rate_mbit=1000) as hosts:
        nodes = start_nodes(hosts, ["--strategy", strategy, "--out", str(tmp_path)], port=29710, out=tmp_path)
        outputs = finish(nodes, timeout=240)
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    ranks = load_ranks(tmp_path, 2)
    assert_identical_replicas(ranks)
    assert len(ranks[0]["weights"]) == FIT_STEPS
    for got, want in zip(ranks[0]["weights"], reference_training(BATCH * 2, FIT_STEPS, "sgd"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # every socket of each node is on its host's cluster address: nothing listens on 0.0.0.0 or loopback
    for rank, r in enumerate(ranks):
        addresses = {s["address"] for s in r["sockets"]}
        assert addresses == {f"{SUBNET}.{rank + 1}"}, (rank, r["sockets"])


def test_hierarchical_ring_two_hosts_of_two_ranks(tmp_path):
    """Shared memory inside each host, one ring per local rank across the hosts: the same weights as one process."""
    with emulated_hosts(2, rate_mbit=1000) as hosts:
        nodes = start_nodes(hosts, ["--strategy", "ring_allreduce", "--out", str(tmp_path)], port=29730, out=tmp_path,
                            devices=2)  # fmt: skip
        outputs = finish(nodes, timeout=240)
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    ranks = load_ranks(tmp_path, 4)
    assert_identical_replicas(ranks)
    assert {r["transport"] for r in ranks} == {"SharedMemoryTransport"}
    assert [r["hierarchical"] for r in ranks] == [True] * 4
    assert len(ranks[0]["weights"]) == FIT_STEPS
    for got, want in zip(ranks[0]["weights"], reference_training(BATCH * 4, FIT_STEPS, "sgd"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_trainers_on_two_hosts_with_a_server_started_by_the_cli_on_a_third(tmp_path):
    """``ParameterServerStrategy(num_servers=1, start_servers=False)`` on two hosts; ``python -m lightning_dp.server``
    on a third joins through MASTER_ADDR / MASTER_PORT: the same weights as one process, the server exits 0."""
    port = 29740
    with emulated_hosts(3, rate_mbit=1000) as hosts:
        args = ["--strategy", "parameter_server", "--num-servers", "1", "--external-servers", "--out", str(tmp_path)]
        nodes = start_nodes(hosts[:2], args, port=port, out=tmp_path)
        server = start_in_host(hosts[2], server_command(f"{SUBNET}.1", port, 0, 1), subprocess_env(),
                               tmp_path / "server.log")  # fmt: skip
        outputs = finish([*nodes, server], timeout=240)
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert server.returncode == 0 and "server 0 done after 4 steps" in outputs[2], outputs[2][-3000:]
    ranks = load_ranks(tmp_path, 2)
    assert_identical_replicas(ranks)
    assert len(ranks[0]["weights"]) == FIT_STEPS
    for got, want in zip(ranks[0]["weights"], reference_training(BATCH * 2, FIT_STEPS, "sgd"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_link_down_mid_run_fails_with_an_error_naming_the_peer(tmp_path):
    with emulated_hosts(2, rate_mbit=1000) as hosts:
        args = ["--strategy", "ring_allreduce", "--steps", "100000", "--timeout", "10", "--mark-step", "3",
                "--out", str(tmp_path)]  # fmt: skip
        nodes = start_nodes(hosts, args, port=29720, out=tmp_path)
        marks = [tmp_path / f"at-step-3-rank{r}" for r in range(2)]
        deadline = time.monotonic() + 120
        while not all(m.exists() for m in marks):  # both nodes are up and training
            assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, stop(nodes)
            time.sleep(0.2)
        subprocess.run(["ip", "-n", hosts[1], "link", "set", IFNAME, "down"], check=True)
        outputs = finish(nodes, timeout=120)
    assert nodes[0].returncode != 0
    assert "could not" in outputs[0] and "rank 1" in outputs[0], outputs[0][-3000:]
