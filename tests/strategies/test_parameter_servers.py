"""``parameter_server`` and ``sharded_ps``: equivalence, identical replicas, byte counts, optimizer-state memory."""

import pytest
import torch

from lightning_dp.comm.cost import Scheme, rank_traffic
from tests.helpers.launch import BATCH, STEPS, load_ranks, run_script
from tests.helpers.replicas import assert_identical_replicas
from tests.scripts.models import reference_training

pytestmark = pytest.mark.multiprocess

CASES = [
    # strategy, devices, optimizer, clipping, intra_node, extra arguments
    ("parameter_server", 2, "sgd", None, "ring", []),
    ("parameter_server", 3, "adamw", "norm", "shm", ["--server-rank", "1"]),
    ("parameter_server", 4, "sgd", "value", "ring", []),
    ("sharded_ps", 2, "adamw", None, "shm", []),
    ("sharded_ps", 3, "sgd", "norm", "ring", []),
    ("sharded_ps", 4, "adamw", "value", "shm", []),
    ("ring_allreduce", 3, "sgd", "norm", "ring", []),  # shared memory: every other test of ring_allreduce
]
TRANSPORTS = {
    ("parameter_server", "ring"): "CentralServerTransport",
    ("parameter_server", "shm"): "SharedMemoryServerTransport",
    ("sharded_ps", "ring"): "ShardedServerTransport",
    ("sharded_ps", "shm"): "SharedMemoryShardedTransport",
    ("ring_allreduce", "ring"): "RingTransport",
    ("ring_allreduce", "shm"): "SharedMemoryTransport",
}


def expected_bytes(strategy, intra_node, n, s, rank, server, flags):
    """(sent, received) by ``rank`` per step: the reference post's bandwidth model for sockets (the sharded servers'
    used-flags go to every peer); through shared memory a rank receives what it copies out of peers' writes and
    sends what peers copy out of its own."""
    if strategy == "sharded_ps" and intra_node == "ring":
        return (2 * (n - 1) / n * (s - flags) + (n - 1) * flags,) * 2
    if strategy != "parameter_server":
        return 2 * (n - 1) / n * s, 2 * (n - 1) / n * s  # the ring, and the sharded servers in shared memory
    if intra_node == "ring":
        return ((n - 1) * s,) * 2 if rank == server else (s, s)
    # reduce-scatter ((n - 1) / n S each way), the server reads every other slice, everyone copies its weights
    if rank == server:
        return (n - 1) / n * s + (n - 1) * s, 2 * (n - 1) / n * s
    return (n - 1) / n * s + s / n, (n - 1) / n * s + s


@pytest.mark.parametrize(
    "strategy, devices, optimizer, clip, intra_node, extra",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}" for c in CASES],
)
def test_equals_single_process_and_counts_bytes(tmp_path, strategy, devices, optimizer, clip, intra_node, extra):
    args = ["--strategy", strategy, "--devices", str(devices), "--optimizer", optimizer, "--steps", str(STEPS)]
    args += ["--clip", clip] if clip else []
    run_script("fit", *args, *extra, "--intra-node", intra_node, "--out", str(tmp_path))
    ranks = load_ranks(tmp_path, devices)
    assert_identical_replicas(ranks)
    reference = reference_training(BATCH * devices, STEPS, optimizer, clip=clip)
    assert len(ranks[0]["weights"]) == STEPS and not torch.equal(ranks[0]["weights"][0], ranks[0]["weights"][-1])
    for step, (got, want) in enumerate(zip(ranks[0]["weights"], reference, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step + 1} differs from one process")

    # the reference post's bandwidth model; S = bytes of one rank's gradient buckets
    n, s = devices, ranks[0]["sync_bytes"]
    assert s > 0 and all(r["sync_bytes"] == s for r in ranks)
    assert {r["transport"] for r in ranks} == {TRANSPORTS[strategy, intra_node]}
    server = int(extra[1]) if extra else 0
    # up to the rounding of chunks and shard boundaries to whole elements (4 bytes each, per bucket), and in shared
    # memory the flags the ranks whose slice holds them send to every peer
    slack = 4 * 4 * n * n + (n - 1) * ranks[0]["flag_bytes"]
    for rank, r in enumerate(ranks):
        want_bytes = expected_bytes(strategy, intra_node, n, s, rank, server, r["flag_bytes"])
        # the cost model, and what the strategy tells CommMonitor and advise from it (its scheme, world size,
        # server and flags), against this test's own formula
        model = rank_traffic(Scheme(strategy, intra_node), n, s, rank, r["flag_bytes"], server)
        assert model == pytest.approx(want_bytes)
        assert tuple(r["predicted_bytes"]) == pytest.approx(want_bytes)
        for moved, want in zip(r["last_step_bytes"], want_bytes, strict=True):
            assert abs(moved - want) <= slack, (rank, moved, want)

    # optimizer state: SGD with momentum holds one buffer per element, AdamW two (plus a step counter)
    state = [r["optimizer_state_bytes"] for r in ranks]
    if strategy == "parameter_server":
        server = int(extra[1]) if extra else 0
        assert all(b == 0 for rank, b in enumerate(state) if rank != server)
        assert state[server] > 0
    elif strategy == "sharded_ps":
        total = sum(state)
        for b in state:
            assert abs(b - total / n) <= 0.05 * total, state
