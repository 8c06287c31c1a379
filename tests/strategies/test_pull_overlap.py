"""The servers' weight pull behind the next forward (``overlap_pull=True``, the default) against the pull at the end
of the step (``overlap_pull=False``): bit-identical, for both servers, on a model with several buckets, a module
spanning two buckets, a shared parameter, a frozen layer, a module used twice, BatchNorm buffers and a parameter
of the LightningModule itself that ``training_step`` reads before any forward (``tests/scripts/pull_overlap.py``).
One launch per configuration runs every fit; the tests read it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.replicas import assert_identical_replicas

pytestmark = pytest.mark.multiprocess

CONFIGS = {
    # central server over sockets, the server not rank 0: rank 0 takes every bucket from the pull
    "parameter_server-3-sockets": ["--strategy", "parameter_server", "--devices", "3", "--intra-node", "ring",
                                   "--server-rank", "1"],
    "sharded_ps-2-shm": ["--strategy", "sharded_ps", "--devices", "2", "--intra-node", "shm"],
    # 16-bit weights on the wire: every rank, owners included, takes the weights from the pull
    "sharded_ps-3-sockets-bf16": ["--strategy", "sharded_ps", "--devices", "3", "--intra-node", "ring",
                                  "--compression", "bf16"],
}  # fmt: skip
STEPS = 7


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def launch(request, tmp_path_factory) -> tuple[str, list[dict]]:
    out = tmp_path_factory.mktemp(f"pull-{request.param}")
    args = CONFIGS[request.param]
    run_script("pull_overlap", *args, "--steps", str(STEPS), "--out", str(out), timeout=240)
    devices = int(args[args.index("--devices") + 1])
    return request.param, [torch.load(out / f"rank{r}.pt") for r in range(devices)]


def identical(a: dict, b: dict, what: str) -> None:
    """Two fits of one rank: the weights every forward read, the losses, the final weights, the validation losses
    and the checkpoints' weights are bit-identical."""
    assert len(a["seen"]) == len(b["seen"]) == STEPS, f"{what}: {len(a['seen'])} and {len(b['seen'])} steps"
    for step, (x, y) in enumerate(zip(a["seen"], b["seen"], strict=True)):
        assert torch.equal(x, y), f"{what}: the forward of step {step + 1} read other weights"
    assert a["losses"] == b["losses"], f"{what}: losses {a['losses']} against {b['losses']}"
    assert torch.equal(a["final"], b["final"]), f"{what}: final weights differ"
    assert len(a["val_losses"]) == 2 and a["val_losses"] == b["val_losses"], f"{what}: validation losses differ"
    assert sorted(a["checkpoints"]) == sorted(b["checkpoints"]), f"{what}: other checkpoints"
    for name, state in a["checkpoints"].items():
        for key, value in state.items():
            assert torch.equal(value, b["checkpoints"][name][key]), f"{what}: {name} differs in {key}"


def test_overlapped_pull_is_bit_identical_and_stays_on_with_lightnings_callbacks(launch):
    """Every rank's forwards read exactly the weights of the pull at the end of the step; the replicas agree; the
    buckets were waited for in forward pre-hooks (the overlap ran), and Lightning's default callbacks (progress bar,
    model summary, checkpointing) and the learning-rate monitor did not turn it off."""
    name, ranks = launch
    for r, rank in enumerate(ranks):
        identical(rank["overlapped"], rank["blocking"], f"{name}, rank {r}")
    assert_identical_replicas([rank["overlapped"] for rank in ranks], "seen")
    report = ranks[0]["overlapped"]["report"]
    assert report["mode"] == "OverlappedPull" and report["reader_hooks"] == [], report
    assert {"TQDMProgressBar", "ModelSummary", "ModelCheckpoint", "LearningRateMonitor"} <= set(report["callbacks"])
    assert report["waited_in_forward"] > 0, report  # rank 0 takes weights from the pull in every configuration
    assert ranks[0]["blocking"]["report"]["mode"] == "BlockingPull"


def test_a_callback_reading_weights_between_steps_sees_them_complete(launch):
    """A callback reading ``param.data`` in ``on_train_batch_end`` (no declaration) gets the pull completed first:
    it reads the weights after every step, as the blocking run's next forward and its final weights show."""
    name, ranks = launch
    for r, rank in enumerate(ranks):
        after, blocking = rank["reader"]["after_step"], rank["blocking"]
        assert len(after) == STEPS, f"{name}, rank {r}: {len(after)} steps read"
        for step, (read, seen) in enumerate(zip(after, [*blocking["seen"][1:], blocking["final"]], strict=True)):
            assert torch.equal(read, seen), f"{name}, rank {r}: the callback read other weights after step {step + 1}"
        identical(rank["reader"], blocking, f"{name}, rank {r}, with the reader")
    assert ranks[0]["reader"]["report"]["reader_hooks"] == ["on_train_batch_end"]


def test_a_forward_reading_a_weight_before_its_module_falls_back_to_the_blocking_pull(launch):
    """``head.weight`` read before ``head``'s forward: the probe of the first forward finds it, every rank runs the
    blocking pull from then on, and the fit equals the blocking one."""
    name, ranks = launch
    for r, rank in enumerate(ranks):
        assert rank["early"]["report"]["mode"] == "BlockingPull", f"{name}, rank {r}: {rank['early']['report']}"
        identical(rank["early"], rank["early_blocking"], f"{name}, rank {r}, reading early")


def test_a_planted_skipped_wait_is_caught(launch):
    """The comparison can fail: ``head``'s forward skipping the wait for its bias's bucket reads a stale bias, and
    the losses differ from the blocking run's on a rank that takes that bucket from the pull."""
    name, ranks = launch
    planted, blocking = ranks[0]["planted"], ranks[0]["blocking"]
    assert planted["report"]["mode"] == "OverlappedPull"
    assert planted["losses"][0] == blocking["losses"][0]  # the first step has nothing in flight
    assert planted["losses"] != blocking["losses"], f"{name}: the stale bias went unnoticed"
