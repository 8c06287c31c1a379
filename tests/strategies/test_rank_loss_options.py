"""``on_rank_loss`` and its options, checked when the strategy is built: what cannot survive a loss is refused with
an error naming the option."""

from __future__ import annotations

import pytest

from lightning_dp import ParameterServerStrategy, RingAllReduceStrategy, ShardedParameterServerStrategy
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.strategies.engines import (
    CentralServerEngine,
    DedicatedEngine,
    RegroupingDedicatedEngine,
    ShardedServerEngine,
)
from lightning_dp.strategies.engines.replicated import ReplicatedShardedEngine

pytestmark = pytest.mark.unit


def test_restarting_a_lost_rank_is_kept_with_or_without_servers():
    for kept in (RingAllReduceStrategy, ParameterServerStrategy, ShardedParameterServerStrategy):
        assert kept(on_rank_loss="continue", restart_lost_ranks=2).restart_lost_ranks == 2
    for cls, servers in ((ShardedParameterServerStrategy, 2), (ParameterServerStrategy, 1)):
        assert cls(on_rank_loss="continue", restart_lost_ranks=2, num_servers=servers).restart_lost_ranks == 2
    for options in ({"compression": "fp16"}, {"compression": "bf16"}, {"balance": "throughput"}):
        kept = RingAllReduceStrategy(on_rank_loss="continue", restart_lost_ranks=2, **options)
        assert kept.restart_lost_ranks == 2


def test_the_servers_replicate_their_state_only_when_they_must_survive_a_loss():
    assert type(ShardedParameterServerStrategy().engine) is ShardedServerEngine
    assert type(ParameterServerStrategy().engine) is CentralServerEngine
    for cls in (ShardedParameterServerStrategy, ParameterServerStrategy):
        assert type(cls(on_rank_loss="continue").engine) is ReplicatedShardedEngine
        assert type(cls(num_servers=2).engine) is DedicatedEngine
        engine = cls(num_servers=2, on_rank_loss="continue").engine
        assert type(engine) is RegroupingDedicatedEngine and not engine.trainers_serve  # the servers hold every share


def test_the_replicated_servers_refuse_gpus_before_any_process_starts():
    import torch

    for cls in (ShardedParameterServerStrategy, ParameterServerStrategy):
        engine = cls(on_rank_loss="continue").engine
        engine.check_devices([torch.device("cpu")])
        with pytest.raises(ConfigurationError, match="on_rank_loss='continue' runs the servers on CPU devices only"):
            engine.check_devices([torch.device("cuda", 0)])
        engine = cls(on_rank_loss="continue", num_servers=1).engine
        engine.check_devices([torch.device("cpu")])
        with pytest.raises(ConfigurationError, match="num_servers=1 runs the trainers on CPU devices only"):
            engine.check_devices([torch.device("cuda", 0)])


def test_the_replicated_servers_need_no_replica_for_a_loss_between_two_fits():
    """Outside a fit (no exchange set up) the next fit cuts its state afresh: two neighbouring ranks lost then are
    no loss of state."""
    engine = ShardedParameterServerStrategy(on_rank_loss="continue").engine
    assert isinstance(engine, ReplicatedShardedEngine) and engine.strategy.reducer is None
    engine.layout_members = (0, 1, 2, 3)  # the cut of an earlier fit
    engine.after_recovery([1, 2])
    assert engine.lost == set()


def test_a_join_is_said_above_the_progress_bar_where_one_shows_else_in_the_log(caplog):
    from types import SimpleNamespace

    from lightning_dp.strategies.rank_loss import _announce

    printed: list[str] = []
    shown = SimpleNamespace(is_enabled=True, print=printed.append)
    _announce(SimpleNamespace(progress_bar_callback=shown), "rank 2 joined")
    assert printed == ["rank 2 joined"]
    hidden = SimpleNamespace(is_enabled=False, print=printed.append)
    with caplog.at_level("INFO"):
        _announce(SimpleNamespace(progress_bar_callback=hidden), "rank 3 joined")
        _announce(None, "rank 1 joined")
    assert printed == ["rank 2 joined"]
    assert [r.getMessage() for r in caplog.records] == ["rank 3 joined", "rank 1 joined"]


def test_leaving_the_job_is_refused_without_continue():
    with pytest.raises(ConfigurationError, match="on_rank_loss='continue' only, got on_rank_loss='stop'"):
        RingAllReduceStrategy().leave()
    for strategy in (RingAllReduceStrategy(on_rank_loss="continue"),
                     ShardedParameterServerStrategy(on_rank_loss="continue", num_servers=2)):  # fmt: skip
        strategy.leave()  # (asked: it leaves at the fit's next step boundary)
