"""Compression under Lightning: every strategy follows one process within the codec's tolerance, replicas stay
bit-identical, the bytes shrink as the codec says, and a resumed run equals one that never stopped."""

from itertools import pairwise

import pytest
import torch

from tests.helpers.launch import BATCH, STEPS, load_ranks, run_script
from tests.helpers.replicas import assert_identical_replicas
from tests.scripts.models import RegressionModel, reference_training

pytestmark = pytest.mark.multiprocess

DEVICES = 3


@pytest.mark.parametrize(
    "strategy, compression, accumulate, clip",
    [
        ("ring_allreduce", "bf16", 2, "norm"),
        ("parameter_server", "fp16", 1, None),
        ("sharded_ps", "bf16", 1, "norm"),
    ],
)
def test_16_bit_follows_one_process_with_half_the_bytes(tmp_path, strategy, compression, accumulate, clip):
    common = ["--strategy", strategy, "--devices", str(DEVICES), "--batch-size", str(BATCH), "--steps", str(STEPS),
              "--accumulate", str(accumulate), "--intra-node", "ring"] + (["--clip", clip] if clip else [])  # fmt: skip
    run_script("fit", *common, "--compression", compression, "--out", str(tmp_path))
    ranks = load_ranks(tmp_path, DEVICES)
    assert ranks[0]["codec"] == compression
    assert_identical_replicas(ranks)
    reference = reference_training(BATCH * DEVICES, STEPS, "sgd", accumulate, clip=clip)
    stepped = ranks[0]["weights"][accumulate - 1 :: accumulate]
    assert len(stepped) == STEPS
    # a few 16-bit roundings of each gradient, through SGD with momentum: a tenth of what one step moves the weights,
    # so weights a step behind (or that did not move) fail, and so does a rank that trained on its own batch
    tolerance = min((b - a).abs().max().item() for a, b in pairwise(reference)) / 10
    assert (stepped[-1] - reference[-2]).abs().max() > tolerance  # the check can fail
    for step, (got, want) in enumerate(zip(stepped, reference, strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=f"step {step + 1}")
    # over all ranks, S bytes of buckets in float32: the ring sends 2 (N - 1) S / 2 in 16 bits; the central server
    # receives (N - 1) S / 2 and sends as much back; the sharded servers the same for the gradients ((N - 1) (S - F)),
    # and every rank sends its float32 flags to every peer (N (N - 1) F)
    size = ranks[0]["sync_bytes"]
    flags = 4 * sum(p.requires_grad for p in RegressionModel().parameters())
    n = DEVICES
    expected = (n - 1) * (size - flags) + n * (n - 1) * flags if strategy == "sharded_ps" else (n - 1) * size
    assert sum(r["last_step_bytes"][0] for r in ranks) == expected


def test_powersgd_sends_its_factors_and_keeps_replicas_identical(tmp_path):
    warmup = 2
    common = ["--strategy", "ring_allreduce", "--devices", str(DEVICES), "--batch-size", str(BATCH),
              "--steps", str(STEPS), "--intra-node", "ring"]  # fmt: skip
    run_script("fit", *common, "--compression", "powersgd", "--powersgd-rank", "1", "--powersgd-warmup", str(warmup),
               "--out", str(tmp_path))  # fmt: skip
    ranks = load_ranks(tmp_path, DEVICES)
    assert_identical_replicas(ranks)
    reference = reference_training(BATCH * DEVICES, STEPS, "sgd")
    for step in range(warmup):  # uncompressed warm-up: one process's steps
        torch.testing.assert_close(ranks[0]["weights"][step], reference[step], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ranks[0]["weights"][-1], reference[-1], rtol=1e-5, atol=1e-6)
    # bytes after warm-up, from the shapes alone: over all ranks the ring sends 2 (N - 1) times every all-reduced
    # element; at rank 1 an n x m gradient travels as n + m elements (P, then Q), vectors whole, plus one float32
    # used-flag per parameter
    trainable = [p for p in RegressionModel().parameters() if p.requires_grad]
    elements = len(trainable)
    for p in trainable:
        n, m = (p.shape[0], p[0].numel()) if p.dim() >= 2 else (0, 0)
        elements += n + m if n and 2 * (n + m) <= n * m else p.numel()
    assert elements == 24 + 32 + 24 + 6  # P: 16 + 4 + 4; Q: 8 + 16 + 8; the biases 16 + 4 + 4; 6 flags
    assert sum(r["last_step_bytes"][0] for r in ranks) == 2 * (DEVICES - 1) * 4 * elements


def test_nothing_to_compress_inside_shared_memory(tmp_path):
    run_script("fit", "--devices", "2", "--steps", "2", "--compression", "bf16", "--out", str(tmp_path))
    ranks = load_ranks(tmp_path, 2)
    assert ranks[0]["transport"] == "SharedMemoryTransport" and ranks[0]["codec"] == "none"
    assert_identical_replicas(ranks)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, compression", [("sharded_ps", "bf16"), ("ring_allreduce", "powersgd")])
def test_resume_with_codec_state_equals_never_stopping(tmp_path, strategy, compression):
    common = ["--strategy", strategy, "--compression", compression]
    ckpt = tmp_path / "epoch1.ckpt"
    run_script("resume", *common, "--max-epochs", "1", "--save-to", str(ckpt), "--out", str(tmp_path / "a"))
    saved = torch.load(ckpt, weights_only=False)
    assert saved["lightning_dp_codec"]["codec"] == compression and len(saved["lightning_dp_codec"]["ranks"]) == 2
    run_script("resume", *common, "--max-epochs", "2", "--resume-from", str(ckpt), "--out", str(tmp_path / "b"))
    run_script("resume", *common, "--max-epochs", "2", "--out", str(tmp_path / "straight"))
    resumed, straight = load_ranks(tmp_path / "b", 2), load_ranks(tmp_path / "straight", 2)
    assert resumed[0]["global_step"] == straight[0]["global_step"]
    for r, s in zip(resumed, straight, strict=True):
        assert torch.equal(r["weights"][-1], s["weights"][-1])
