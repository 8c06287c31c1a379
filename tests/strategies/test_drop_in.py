"""Drop-in means drop-in: ordinary LightningModule idioms train exactly as under Lightning's ``ddp``.

``tests/scripts/dropin.py`` runs every case in one launch per strategy; ``ddp`` runs the same script first (and
writes the checkpoint the resume case starts from). Each test checks one case under one strategy: the weights
after every step equal ``ddp``'s and are bit-identical on both ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.replicas import TOLERANCE, prefixed
from tests.helpers.runs import STRATEGIES, DropInRuns, assert_follows_ddp

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # any test may start the shared launches (minutes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> DropInRuns:
    return DropInRuns(tmp_path_factory.mktemp("dropin"))


@pytest.mark.parametrize("strategy", [*STRATEGIES, "sharded_ps_spawn"])
def test_gradient_edits_in_hooks_and_callbacks_take_effect_as_under_ddp(runs, strategy):
    """A layer masked in ``on_after_backward``, one scaled there, one clipped in ``on_before_optimizer_step``, a
    callback doubling a bias gradient; ``grad_norm`` logged in ``on_before_optimizer_step`` equals ddp's."""
    ranks = assert_follows_ddp(runs, strategy, "hooks")
    ddp = runs.case("ddp", "hooks")
    masked = 16 * 8 + 16  # layer a comes first in the flat weights
    assert torch.equal(ranks[0]["weights"][-1][:masked], ranks[0]["weights"][0][:masked]), "the masked layer moved"
    for rank in range(2):
        assert ranks[rank]["norms"] == pytest.approx(ddp[rank]["norms"], rel=1e-6), f"rank {rank} grad_norm"
    assert ranks[0]["full_gradients"] is True


@pytest.mark.parametrize("strategy", ["parameter_server", "sharded_ps"])
def test_parameter_servers_send_averaged_gradients_back_only_when_something_reads_them(runs, strategy):
    """The extra traffic is counted in ``last_step_bytes``: with the hooks every rank also receives the averaged
    gradients (central: S per worker, (N - 1) S from the server; sharded: (N - 1) / N S each); a timing callback
    that declares ``reads_gradients = False`` (the plain case) does not count as reading them."""
    hooks, plain = runs.case(strategy, "hooks"), runs.case(strategy, "plain")
    assert all(r["full_gradients"] is False for r in plain)
    sync = plain[0]["sync_bytes"]
    if strategy == "parameter_server":  # server 0 sends S more, worker 1 receives S more
        assert hooks[0]["bytes"][0] - plain[0]["bytes"][0] == sync
        assert hooks[1]["bytes"][1] - plain[1]["bytes"][1] == sync
    else:
        gradients = sync - 4 * 6  # six parameters, one float32 flag each, stay out of the shards
        for rank in range(2):
            extra = [h - p for h, p in zip(hooks[rank]["bytes"], plain[rank]["bytes"], strict=True)]
            assert abs(extra[0] - gradients / 2) <= 4 and abs(extra[1] - gradients / 2) <= 4, extra


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_param_group_added_during_fit_trains_as_under_ddp(runs, strategy):
    ranks = assert_follows_ddp(runs, strategy, "add_group")
    last_layer = 16 * 4 + 4
    assert not torch.equal(ranks[0]["weights"][-1][-last_layer:], ranks[0]["weights"][1][-last_layer:])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_module_and_compiled_submodule_equal_ddp_and_eager(runs, strategy):
    eager = runs.case(strategy, "plain")[0]["weights"]  # the same module and data, not compiled
    for case in ("compiled", "compiled_submodule"):
        ranks = assert_follows_ddp(runs, strategy, case)
        for step, (got, want) in enumerate(zip(ranks[0]["weights"], eager, strict=True)):
            torch.testing.assert_close(got, want, **TOLERANCE, msg=prefixed(f"{case} vs eager, step {step + 1}"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reentrant_checkpointing_reusing_a_weight_equals_ddp(runs, strategy):
    assert_follows_ddp(runs, strategy, "reentrant")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float16_parameters_with_large_gradients_do_not_overflow(runs, strategy):
    """``precision="16-true"``: every rank's bias gradient is 4e4, their sum overflows float16; averages divide
    first, so the averaged gradient is 4e4 (ddp's too) and the weights stay finite."""
    # fp16 steps of ~0.4 cancel to small weights: allow one float16 rounding of those operands (2^-11 x 4)
    ranks = assert_follows_ddp(runs, strategy, "fp16", dict(rtol=2e-3, atol=2e-3))
    for rank in (*ranks, *runs.case("ddp", "fp16")):
        assert rank["bias_grads"] == pytest.approx([40000.0] * len(rank["weights"]), rel=1e-3)
    assert ranks[0]["bucket_dtypes"] == ["torch.float16"] * len(ranks[0]["bucket_dtypes"]) != []
    assert all(bool(torch.isfinite(w).all()) for w in ranks[0]["weights"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_true_buckets_are_bf16_and_follow_ddp(runs, strategy):
    ranks = assert_follows_ddp(runs, strategy, "bf16", dict(rtol=1e-2, atol=1e-2))
    assert ranks[0]["bucket_dtypes"] == ["torch.bfloat16"] * len(ranks[0]["bucket_dtypes"]) != []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_ddp_checkpoint_resumes_as_ddp_itself_continues(runs, strategy):
    """``ddp`` wrote the checkpoint after step 3 of 6, mid-epoch (AdamW state in it); every strategy resumed from it
    trains steps 4 to 6 exactly as ``ddp`` did uninterrupted (ddp's own resume would replay the epoch's start)."""
    ranks = assert_follows_ddp(runs, strategy, "resume")
    assert len(ranks[0]["weights"]) == 3


def test_ranks_started_as_single_device_nodes_follow_ddp(tmp_path):
    """The one-GPU tier's launch (``tests/test_gpu.py``: two single-device nodes sharing one GPU over gloo), on
    CPUs: Lightning's general-purpose cluster recipe, one process per node, ``ddp`` and a strategy alike."""
    from tests.helpers.launch import load_ranks, run_script

    nodes = {"LIGHTNING_DP_TEST_NODES": "2", "LIGHTNING_DP_TEST_BACKEND": "gloo"}
    for strategy in ("ddp", "ring_allreduce"):
        run_script("dropin", "--strategy", strategy, "--cases", "hooks", "--out", str(tmp_path / strategy),
                   timeout=200, env=nodes)  # fmt: skip
    ddp, ring = (load_ranks(tmp_path / s / "hooks", 2) for s in ("ddp", "ring_allreduce"))
    assert len(ring[0]["weights"]) == len(ddp[0]["weights"]) >= 3
    for step, want in enumerate(ddp[0]["weights"]):
        assert torch.equal(ring[0]["weights"][step], ring[1]["weights"][step]), f"ranks differ after step {step + 1}"
        torch.testing.assert_close(ring[0]["weights"][step], want, **TOLERANCE, msg=prefixed(f"step {step + 1}"))
    assert not torch.equal(ddp[0]["weights"][-1], ddp[0]["weights"][0])
