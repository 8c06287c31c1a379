"""What a scheme cannot run is refused with an error that names the strategy, the option or the optimizer."""

from datetime import timedelta

import lightning as L
import pytest

from lightning_dp import (
    ConfigurationError,
    ParameterServerStrategy,
    RingAllReduceStrategy,
    ShardedParameterServerStrategy,
)
from tests.helpers.launch import run_script


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy, optimizer, message",
    [
        ("parameter_server", "LBFGS", "strategy 'parameter_server' cannot run optimizer LBFGS"),
        ("sharded_ps", "LBFGS", "strategy 'sharded_ps' cannot run optimizer LBFGS"),
        ("sharded_ps", "Adafactor", "strategy 'sharded_ps' cannot shard optimizer Adafactor"),
    ],
)
def test_optimizers_the_scheme_cannot_run_are_refused_at_setup(strategy, optimizer, message):
    result = run_script("refuse", "--strategy", strategy, "--optimizer", optimizer, check=False, timeout=120)
    assert result.returncode != 0
    assert message in result.stdout
    assert "TRAINED" not in result.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_servers", [0, 2])
def test_parameter_server_runs_adafactor(num_servers):
    # the central server holds whole tensors, so factored (non-element-wise) optimizers are fine there; dedicated
    # servers then get whole parameters too (element-wise optimizers' buckets are cut over them)
    args = ["--strategy", "parameter_server", "--optimizer", "Adafactor", "--num-servers", str(num_servers)]
    result = run_script("refuse", *args, timeout=120)
    assert "TRAINED" in result.stdout


@pytest.mark.multiprocess
def test_an_observer_that_changes_the_learning_rate_after_the_overlapped_update_is_refused():
    """Dedicated servers update as gradients arrive when nothing reads them; a callback declaring
    ``reads_gradients = False`` runs its hooks after that update, so changing the learning rate there is an error
    that names the declaration, not a silently different step."""
    args = ["--strategy", "sharded_ps", "--optimizer", "SGD", "--num-servers", "1", "--halve-lr-in-hook"]
    result = run_script("refuse", *args, check=False, timeout=120)
    assert result.returncode != 0 and "TRAINED" not in result.stdout
    assert "UnsupportedChangeError" in result.stdout and "reads_gradients = False" in result.stdout


@pytest.mark.unit
@pytest.mark.parametrize("server_rank", [-1, 1.5, True, "0"])
def test_bad_server_rank_fails_at_construction(server_rank):
    with pytest.raises(ValueError, match="server_rank must be a rank in"):
        ParameterServerStrategy(server_rank=server_rank)


@pytest.mark.unit
def test_server_rank_outside_world_fails_before_launch():
    with pytest.raises(ValueError, match=r"server_rank=4 is outside \[0, 4\) for a run of 4 processes"):
        L.Trainer(strategy=ParameterServerStrategy(server_rank=4), accelerator="cpu", devices=4, logger=False)
    trainer = L.Trainer(strategy=ParameterServerStrategy(server_rank=3), accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy.server_rank == 3


@pytest.mark.unit
def test_sharded_long_name_and_options():
    trainer = L.Trainer(strategy="sharded_parameter_server", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ShardedParameterServerStrategy)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        ShardedParameterServerStrategy(bucket_cap_mb=0)


@pytest.mark.unit
@pytest.mark.parametrize("strategy_class", [ParameterServerStrategy, ShardedParameterServerStrategy])
def test_16_mixed_is_refused_by_the_parameter_servers(strategy_class):
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    # 16-mixed needs CUDA; the refusal only looks at the precision plugin's gradient scaler
    scaled = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cpu"))
    strategy = strategy_class(precision_plugin=scaled)
    strategy.optimizers = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)]
    with pytest.raises(ValueError, match="does not support precision='16-mixed'.*use precision='bf16-mixed'"):
        strategy._check_optimizers()
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    strategy._check_optimizers()


@pytest.mark.unit
def test_parameter_made_trainable_after_setup_is_refused():
    import torch

    from lightning_dp import RingAllReduceStrategy

    synced, late = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 5))
    strategy = RingAllReduceStrategy()
    strategy._synced_params = {id(synced)}  # what set-up laid out in buckets
    late.requires_grad_(False)
    optimizer = torch.optim.SGD([synced, late], lr=0.1)
    strategy.check_trainable_unchanged(optimizer)  # frozen: fine
    late.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"shape \(2, 5\) became trainable .* after set-up"):
        strategy.check_trainable_unchanged(optimizer)


@pytest.mark.unit
@pytest.mark.parametrize("strategy_name", ["ring_allreduce", "parameter_server", "sharded_ps"])
def test_sparse_gradients_are_refused_at_setup(strategy_name):
    import torch
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dp.strategies.inspection import refuse_sparse_gradients

    owner = f"strategy {StrategyRegistry[strategy_name]['strategy'].strategy_name!r}"
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    with pytest.raises(
        ValueError,
        match=rf"strategy '{strategy_name}' does not support sparse gradients, but 0 .*sparse=False.*strategy='ddp'",
    ):
        refuse_sparse_gradients(sparse, owner)
    refuse_sparse_gradients(torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1)), owner)


@pytest.mark.multiprocess
def test_sparse_embedding_is_refused_before_training():
    result = run_script(
        "refuse", "--strategy", "ring_allreduce", "--optimizer", "SGD", "--sparse", check=False, timeout=120
    )
    assert result.returncode != 0
    assert "strategy 'ring_allreduce' does not support sparse gradients" in result.stdout
    assert "TRAINED" not in result.stdout


@pytest.mark.unit
def test_strategies_are_ddp_strategies_for_lightnings_compile_check_and_ray():
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_dp.strategies import STRATEGIES

    assert all(issubclass(cls, DDPStrategy) for cls in STRATEGIES)


@pytest.mark.unit
def test_the_environment_joins_the_process_groups_once():
    import torch

    from lightning_dp import RingAllReduceStrategy

    strategy = RingAllReduceStrategy(
        accelerator=L.pytorch.accelerators.CPUAccelerator(), parallel_devices=[torch.device("cpu")]
    )
    calls = []
    strategy.setup_distributed = lambda: calls.append(1)
    strategy.setup_environment()
    assert calls == [1]


@pytest.mark.unit
def test_nccl_gradient_traffic_waits_for_backward_when_backward_issues_collectives():
    import torch

    from lightning_dp import RingAllReduceStrategy
    from lightning_dp.comm.buckets import BucketReducer

    strategy = RingAllReduceStrategy(process_group_backend="nccl")
    strategy.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert strategy._may_overlap_backward()
    strategy.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(strategy.model)
    assert not strategy._may_overlap_backward()
    gloo = RingAllReduceStrategy(process_group_backend="gloo")
    gloo.model = strategy.model
    assert gloo._may_overlap_backward()  # one thread per communicator only matters for NCCL
    # Lightning's all_gather with gradients all-reduces in backward: from then on buckets wait for backward's end
    strategy.reducer = BucketReducer(strategy.model.parameters(), lambda b: None)
    try:
        strategy.all_gather(torch.ones(2), sync_grads=True)
    except Exception:  # noqa: BLE001 - no process group here; only the decision before the collective matters
        pass
    assert strategy.reducer.overlap is False
    strategy.reducer.close()


FINITE = "must be a positive number, finite, got"
DURATION = "timeout must be a positive duration, got"


@pytest.mark.unit
@pytest.mark.parametrize(
    "cls, options, message",
    [
        (RingAllReduceStrategy, {"bucket_cap_mb": float("inf")}, f"bucket_cap_mb {FINITE} inf"),
        (RingAllReduceStrategy, {"bucket_cap_mb": float("nan")}, f"bucket_cap_mb {FINITE} nan"),
        (RingAllReduceStrategy, {"timeout": timedelta(0)}, f"{DURATION} 0 seconds"),
        (RingAllReduceStrategy, {"timeout": timedelta(seconds=-5)}, f"{DURATION} -5 seconds"),
        (RingAllReduceStrategy, {"timeout": float("inf")}, f"timeout {FINITE} inf"),
        (ShardedParameterServerStrategy, {"server_rank": 1}, "'sharded_ps' has no option 'server_rank'; its options: "),
        (RingAllReduceStrategy, {"staleness": 2}, "'ring_allreduce' has no option 'staleness'; its options: accel"),
        (ParameterServerStrategy, {"start_servers": False}, "start_servers=False .* num_servers=0 asks for none"),
    ],
)
def test_bad_options_are_refused_at_construction_naming_the_option(cls, options, message):
    with pytest.raises(ConfigurationError, match=message):
        cls(**options)


@pytest.mark.unit
def test_every_documented_option_gets_past_the_check_of_known_options():
    sharded = ShardedParameterServerStrategy(staleness=None, bucket_cap_mb=4, intra_node="ring",
                                             broadcast_buffers=False, timeout=10, process_group_backend="gloo",
                                             start_method="spawn")  # fmt: skip
    assert sharded.staleness is None and sharded.timeout == timedelta(seconds=10)
    central = ParameterServerStrategy(server_rank=1, num_servers=0, compression="bf16", error_feedback=False)
    assert central.server_rank == 1 and central.compression == "bf16"
    ring = RingAllReduceStrategy(compression="powersgd", powersgd_rank=2, powersgd_warmup_steps=0, accelerator=None)
    assert ring.powersgd_rank == 2
