"""``parameter_server`` and ``sharded_ps``: equivalence, identical replicas, byte counts, optimizer-state memory."""

import pytest
import torch

from tests.helpers.launch import BATCH, STEPS, load_ranks, run_script
from tests.helpers.replicas import assert_identical_replicas
from tests.scripts.models import reference_training

pytestmark = pytest.mark.multiprocess

CASES = [
    # strategy, devices, optimizer, clipping, extra arguments
    ("parameter_server", 2, "sgd", None, []),
    ("parameter_server", 3, "adamw", "norm", ["--server-rank", "1"]),
    ("parameter_server", 4, "sgd", "value", []),
    ("sharded_ps", 2, "adamw", None, []),
    ("sharded_ps", 3, "sgd", "norm", []),
    ("sharded_ps", 4, "adamw", "value", []),
    ("ring_allreduce", 3, "sgd", "norm", []),
]


@pytest.mark.parametrize(
    "strategy, devices, optimizer, clip, extra", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES]
)
def test_equals_single_process_and_counts_bytes(tmp_path, strategy, devices, optimizer, clip, extra):
    args = ["--strategy", strategy, "--devices", str(devices), "--optimizer", optimizer, "--steps", str(STEPS)]
    args += ["--clip", clip] if clip else []
    run_script("fit", *args, *extra, "--out", str(tmp_path))
    ranks = load_ranks(tmp_path, devices)
    assert_identical_replicas(ranks)
    reference = reference_training(BATCH * devices, STEPS, optimizer, clip=clip)
    for step, (got, want) in enumerate(zip(ranks[0]["weights"], reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step + 1} differs from one process")

    # the reference post's bandwidth model; S = bytes of one rank's gradient buckets
    n, s = devices, ranks[0]["sync_bytes"]
    assert s > 0 and all(r["sync_bytes"] == s for r in ranks)
    if strategy == "parameter_server":
        server = int(extra[1]) if extra else 0
        for rank, r in enumerate(ranks):
            expected = (n - 1) * s if rank == server else s
            assert r["last_step_bytes"] == (expected, expected), rank
    else:
        # 2 (N - 1) / N S, up to the rounding of chunks and shard boundaries to whole elements (4 bytes each)
        slack = 4 * 4 * n * n
        for rank, r in enumerate(ranks):
            for moved in r["last_step_bytes"]:
                assert abs(moved - 2 * (n - 1) / n * s) <= slack, (rank, moved, 2 * (n - 1) / n * s)

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
