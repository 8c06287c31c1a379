"""``on_rank_loss="continue"`` across emulated hosts, one rank per network namespace joined by the delay switch: a
host whose link is cut silently (no reset reaches anyone) is suspected after the heartbeat timeout and left out,
the others go on from the last step every one of them completed; a partition goes on only on its majority side
(2 | 2: every rank stops); a link that fails one way only leaves one of its ends out."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from benchmarks.netns import SUBNET, delayed_hosts, node_ranks
from tests.helpers.distributed import free_port
from tests.helpers.hosts import finish, start_in_host, stop
from tests.helpers.launch import subprocess_env
from tests.helpers.midepoch import read_seen, replay_loss
from tests.helpers.netns import skip_without_netns
from tests.helpers.replicas import close

pytestmark = [pytest.mark.multiprocess, pytest.mark.netns, skip_without_netns]

RANKS, BATCH, SAMPLES, EPOCHS = 4, 4, 96, 2
HEARTBEAT, STEP_SECONDS, FAULT_AT = 2.0, 0.3, 4
#: the fault applied to the switch once every rank started step FAULT_AT; the ranks that go on, and the error with
#: which each of the others stops
SCENARIOS = {
    "host 3 cut": (lambda hosts: hosts.cut(3), [0, 1, 2], {3: "not a strict majority"}),
    "partition 2 | 2": (lambda hosts: hosts.partition([[0, 1], [2, 3]]), [],
                        {r: "not a strict majority" for r in range(RANKS)}),
    "one way, 3 to 0": (lambda hosts: hosts.block(3, 0), [0, 1, 2], {3: "FencedError"}),
}  # fmt: skip


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_silent_host_a_partition_and_a_one_way_link(tmp_path, scenario):
    fault, going_on, stopping = SCENARIOS[scenario]
    env = subprocess_env({"MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": str(free_port())})
    env.pop("GLOO_SOCKET_IFNAME", None)
    argv = [sys.executable, "-m", "tests.scripts.midepoch", "--strategy", "ring_allreduce", "--devices", "1",
            "--num-nodes", str(RANKS), "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs",
            str(EPOCHS), "--on-rank-loss", "continue", "--heartbeat-timeout", str(HEARTBEAT), "--intra-node", "ring",
            "--record-seen", "--mark-step", str(FAULT_AT), "--step-seconds", str(STEP_SECONDS), "--out",
            str(tmp_path)]  # fmt: skip
    with delayed_hosts(RANKS, rate_mbit=1000, latency_ms=0.1) as hosts:
        nodes = [start_in_host(host, argv, {**env, **extra}, tmp_path / f"node{r}.log")
                 for r, (host, extra) in enumerate(zip(hosts, node_ranks(RANKS), strict=True))]  # fmt: skip
        marks = [tmp_path / f"at-step-{FAULT_AT}-rank{r}" for r in range(RANKS)]
        deadline = time.monotonic() + 120
        while not all(m.exists() for m in marks):
            assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, stop(nodes)
            time.sleep(0.05)
        fault(hosts)
        faulted = time.time()
        outputs = finish(nodes, timeout=120)
    codes = [n.returncode for n in nodes]
    for r in going_on:
        assert codes[r] == 0, f"rank {r}: {outputs[r][-4000:]}"
    for r, error in stopping.items():
        assert codes[r] != 0 and error in outputs[r], f"rank {r} (exit {codes[r]}): {outputs[r][-4000:]}"
    if not going_on:
        return
    (lost,) = stopping
    survivors = [torch.load(tmp_path / f"rank{r}.pt") for r in going_on]
    for s in survivors:
        assert s["rank_loss"]["lost_ranks"] == [lost], s["rank_loss"]
        assert s["global_step"] == EPOCHS * SAMPLES // (RANKS * BATCH)
    # a silent host: the survivors train again within the heartbeat timeout and 2 s (plus that step's own time)
    back = max(min(t for t in s["step_ends"] if t > faulted) for s in survivors)
    assert back - faulted < HEARTBEAT + 2.0 + STEP_SECONDS + 0.5, back - faulted
    reference = replay_loss(survivors, read_seen(tmp_path / f"seen-rank{lost}.txt"), SAMPLES)
    for j, want in enumerate(reference):
        got = survivors[0]["history"][j][2]
        assert all(torch.equal(got, s["history"][j][2]) for s in survivors[1:]), f"the replicas differ after {j}"
        close(got, want, f"after batch {j}")
