"""Registration by name, option validation before any process starts."""

from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dp
from lightning_dp import ParameterServerStrategy, RingAllReduceStrategy, ShardedParameterServerStrategy


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, cls, words",
    [
        ("ring_allreduce", RingAllReduceStrategy, "ring all-reduce"),
        ("parameter_server", ParameterServerStrategy, "central parameter server"),
        ("sharded_ps", ShardedParameterServerStrategy, "sharded over all ranks"),
        ("sharded_parameter_server", ShardedParameterServerStrategy, "sharded over all ranks"),
    ],
)
def test_strategies_are_registered_with_descriptions(name, cls, words):
    available = StrategyRegistry.available_strategies()
    for variant in (name, f"{name}_spawn", f"{name}_fork"):
        assert variant in available
        assert StrategyRegistry[variant]["strategy"] is cls
        assert words in StrategyRegistry[variant]["description"]
    lightning_dp.register_strategies()  # idempotent


@pytest.mark.unit
def test_trainer_accepts_name_and_instance():
    trainer = L.Trainer(strategy="ring_allreduce", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, RingAllReduceStrategy)
    assert trainer.strategy._start_method == "popen"
    trainer = L.Trainer(strategy="ring_allreduce_spawn", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy._start_method == "spawn"
    strategy = RingAllReduceStrategy(bucket_cap_mb=1, timeout=30)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=3, logger=False)
    assert trainer.strategy is strategy and trainer.strategy.num_processes == 3
    assert strategy.bucket_cap_mb == 1.0 and strategy._timeout == timedelta(seconds=30)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 0}


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a positive number"),
        ({"bucket_cap_mb": -5}, "bucket_cap_mb must be a positive number"),
        ({"bucket_cap_mb": "big"}, "bucket_cap_mb must be a positive number"),
        (
            {"process_group_backend": "mpi"},
            "process_group_backend='mpi' is not supported; allowed values: 'gloo', 'nccl'",
        ),
        ({"start_method": "thread"}, "start_method='thread' is not supported"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"broadcast_buffers": "yes"}, "broadcast_buffers must be True or False"),
        ({"intra_node": "pipe"}, "intra_node='pipe' is not supported; allowed values: 'shm', 'ring'"),
        ({"shm_wait": "busy"}, "shm_wait='busy' is not supported; allowed values: 'auto', 'spin', 'sleep'"),
        (
            {"compression": "zip"},
            "compression='zip' is not supported; allowed values: 'none', 'fp16', 'bf16', 'powersgd'",
        ),
        ({"error_feedback": 1}, "error_feedback must be True or False"),
        ({"powersgd_rank": 0}, "powersgd_rank must be an integer >= 1, got 0"),
        ({"powersgd_warmup_steps": 2.5}, "powersgd_warmup_steps must be an integer >= 0"),
        ({"balance": "speed"}, "balance='speed' is not supported; allowed values: 'none', 'throughput'"),
        ({"balance": "throughput", "balance_interval": 0}, "balance_interval must be an integer >= 1, got 0"),
        ({"balance": "throughput", "balance_tolerance": -1}, "balance_tolerance must be a positive number"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RingAllReduceStrategy(**kwargs)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "code, expected",
    [
        # the algorithms load without Lightning
        ("import sys, lightning_dp.comm.transports.ring, lightning_dp.comm.transports.shards\n"
         "import lightning_dp.comm.cluster.rendezvous, lightning_dp.comm.servers, lightning_dp.comm.consistency\n"
         "print('lightning' in sys.modules)", "False"),
        # package first, Lightning later: registered the moment Lightning loads
        ("import lightning_dp\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
         "print(all(n in StrategyRegistry for n in ('ring_allreduce', 'parameter_server', 'sharded_ps_spawn')))",
         "True"),
        # a strategy class imported before Lightning (it imports Lightning itself)
        ("from lightning_dp import ShardedParameterServerStrategy\nimport lightning as L\n"
         "print(type(L.Trainer(strategy='sharded_ps', accelerator='cpu', devices=2, logger=False).strategy).__name__)",
         "ShardedParameterServerStrategy"),
        # the Hydra support installed before Lightning is imported (it loads Lightning, which registers)
        ("from lightning_dp import hydra_support\nhydra_support.install()\nimport lightning as L\n"
         "trainer = L.Trainer(strategy='ring_allreduce', accelerator='cpu', devices=2, logger=False)\n"
         "print(type(trainer.strategy).__name__)",
         "RingAllReduceStrategy"),
    ],
    ids=["comm-alone", "package-then-lightning", "class-first", "hydra-support-first"],
)  # fmt: skip
def test_import_orders(code, expected):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == expected


@pytest.mark.unit
@pytest.mark.parametrize("cls", [RingAllReduceStrategy, ParameterServerStrategy, ShardedParameterServerStrategy])
def test_nccl_on_cpu_devices_is_refused_when_the_trainer_is_built(cls):
    with pytest.raises(
        lightning_dp.ConfigurationError, match=r"process_group_backend='nccl' needs CUDA devices.*'gloo'"
    ):
        L.Trainer(strategy=cls(process_group_backend="nccl"), accelerator="cpu", devices=2, logger=False)
    trainer = L.Trainer(strategy=cls(process_group_backend="gloo"), accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.process_group_backend == "gloo"


@pytest.mark.unit
def test_gloo_is_accepted_on_cuda_devices_and_nccl_only_there():
    from lightning_dp.strategies.options import check_backend_for_devices

    cuda, cpu = [torch.device("cuda", 0)], [torch.device("cpu")]
    for backend, devices in (("gloo", cuda), ("nccl", cuda), ("gloo", cpu), (None, cpu), (None, cuda)):
        check_backend_for_devices(backend, devices)
    with pytest.raises(lightning_dp.ConfigurationError, match="trains on cpu"):
        check_backend_for_devices("nccl", cpu)


@pytest.mark.unit
@pytest.mark.parametrize("cls", [ParameterServerStrategy, ShardedParameterServerStrategy])
def test_balance_needs_synchronous_steps(cls):
    with pytest.raises(ValueError, match="balance='throughput' needs staleness=0"):
        cls(staleness=2, balance="throughput")


@pytest.mark.unit
def test_balance_refuses_a_loader_it_cannot_resize():
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    strategy = RingAllReduceStrategy(balance="throughput")
    trainer = SimpleNamespace(state=SimpleNamespace(stage=RunningStage.TRAINING))
    data = TensorDataset(torch.arange(10))
    own_sampler = DataLoader(data, batch_size=2, sampler=RandomSampler(data))
    with pytest.raises(ValueError, match="use_distributed_sampler=True.*sampler RandomSampler"):
        strategy.batches.training_loader(trainer, own_sampler)
    validation = SimpleNamespace(state=SimpleNamespace(stage=RunningStage.VALIDATING))
    assert strategy.batches.training_loader(validation, own_sampler) is None  # only training batches are balanced


@pytest.mark.unit
def test_max_ranks_past_the_global_batch_is_refused_at_the_training_loader():
    """Each rank trains at least one sample of the global batch: a job of 2 ranks with 2 samples each may not grow
    to 8."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_dp.comm.errors import ConfigurationError

    strategy = RingAllReduceStrategy(on_rank_loss="continue", max_ranks=8)
    strategy.rank_loss.membership = SimpleNamespace(places=8, original=(0, 1), members=(0, 1))  # type: ignore[assignment]
    trainer = SimpleNamespace(state=SimpleNamespace(stage=RunningStage.TRAINING))
    data = TensorDataset(torch.arange(16))
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(ConfigurationError, match="max_ranks=8 cannot be dealt the global batch of 4 samples"):
        strategy.batches.training_loader(trainer, loader)


@pytest.mark.unit
@pytest.mark.parametrize(
    "device, intra_node, nodes, notice",
    [("cuda", "shm", 2, True), ("cuda", "ring", 2, False), ("cuda", "shm", 1, False), ("cpu", "shm", 2, False)],
)
def test_the_ring_on_gpus_across_machines_says_it_is_one_flat_ring(monkeypatch, device, intra_node, nodes, notice):
    """``intra_node="shm"`` applies to CPU tensors: on GPUs of several machines the strategy says, once at set-up,
    that its ring is flat."""
    from lightning_dp.strategies import ring_allreduce

    said = []
    monkeypatch.setattr(ring_allreduce, "rank_zero_info", said.append)
    monkeypatch.setattr(ring_allreduce, "RingTransport", lambda group, stats: "ring")
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy = RingAllReduceStrategy(intra_node=intra_node, parallel_devices=[torch.device(device, 0)])
    strategy.num_nodes = nodes
    strategy.cluster_environment = LightningEnvironment()
    strategy.cluster_environment.set_world_size(nodes)
    assert strategy._make_transport(shared_memory=False) == "ring"
    assert len(said) == int(notice)
    if notice:
        assert said[0] == (
            "ring_allreduce: intra_node='shm' applies to CPU tensors only; on these GPUs the ring is one flat ring "
            "over all 2 ranks, not a ring per machine joined across machines"
        )
