"""Every synchronous family through Lightning on a model whose gradients fill several buckets, with SGD (momentum and
weight decay, no clipping by norm): unlike AdamW or a clipped norm, the update follows the gradient's scale, so a
wrong divisor, a rank left out or a rank counted twice moves the weights by a multiple of the step, far outside the
tolerance. Each run: three ranks, :class:`~tests.scripts.models.LayeredModel` cut into five buckets of two or three
parameters and a partial last one, buckets sent while backward still runs; the weights after every step against one
process on the global batch, the replicas bit-identical."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import BATCH, STEPS, load_ranks, run_script
from tests.helpers.replicas import assert_replicas_follow
from tests.scripts.models import LAYERED_BUCKET_CAP_MB, reference_training

pytestmark = pytest.mark.multiprocess

DEVICES = 3
FAMILIES = {
    "ring_allreduce": ["--strategy", "ring_allreduce"],
    "parameter_server": ["--strategy", "parameter_server"],
    "sharded_ps": ["--strategy", "sharded_ps"],
    "parameter_server, 1 dedicated server": ["--strategy", "parameter_server", "--num-servers", "1"],
    "sharded_ps, 2 dedicated servers": ["--strategy", "sharded_ps", "--num-servers", "2"],
    "sharded_ps, staleness=0": ["--strategy", "sharded_ps", "--staleness", "0"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_multi_bucket_model_with_plain_sgd_equals_one_process(tmp_path, family):
    args = [*FAMILIES[family], "--model", "layered", "--optimizer", "sgd", "--devices", str(DEVICES)]
    run_script("fit", *args, "--bucket-cap-mb", repr(LAYERED_BUCKET_CAP_MB), "--steps", str(STEPS),
               "--out", str(tmp_path))  # fmt: skip
    ranks = load_ranks(tmp_path, DEVICES)
    reference = reference_training(BATCH * DEVICES, STEPS, "sgd", model_name="layered")
    assert_replicas_follow(ranks, "weights", reference, f"{family} vs one process")
    assert not torch.equal(reference[0], reference[-1])

    cap = LAYERED_BUCKET_CAP_MB * 2**20
    buckets = ranks[0]["bucket_bytes"]
    assert all(r["bucket_bytes"] == buckets for r in ranks)
    assert sum(len(b) >= 2 for b in buckets) >= 3, f"fewer than three buckets of several parameters: {buckets}"
    assert all(sum(b) <= cap for b in buckets) and sum(buckets[-1]) < cap, f"no partial last bucket: {buckets}"
    for rank, r in enumerate(ranks):
        sent = r["sent_during_backward"]
        assert len(sent) == STEPS, (rank, sent)
        # the first backward learns which gradients come (all buckets leave at its end); from the second on every
        # bucket but the one the last gradient completes has left before backward ends
        assert sent == [0] + [len(buckets) - 1] * (STEPS - 1), (rank, sent)
