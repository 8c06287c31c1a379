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


@pytest.mark.parametrize(
    ("cls", "options", "match"),
    [
        (ShardedParameterServerStrategy, {"staleness": 1}, "needs staleness=0"),
        (ShardedParameterServerStrategy, {"backup_workers": 1}, "needs backup_workers=0"),
        (ShardedParameterServerStrategy, {"compression": "bf16"}, "needs compression='none'"),
        (RingAllReduceStrategy, {"compression": "powersgd"}, "low-rank factors must agree on every rank"),
        (ParameterServerStrategy, {"num_servers": 1, "compression": "bf16"}, "needs compression='none'"),
        (RingAllReduceStrategy, {"process_group_backend": "nccl"}, "needs process_group_backend='gloo'"),
    ],
)
def test_what_cannot_survive_a_loss_is_refused_when_the_strategy_is_built(cls, options, match):
    with pytest.raises(ConfigurationError, match=match):
        cls(on_rank_loss="continue", **options)


def test_the_ring_compresses_in_16_bits_and_every_strategy_balances_by_speed_with_a_loss():
    for compression in ("fp16", "bf16"):
        assert RingAllReduceStrategy(on_rank_loss="continue", compression=compression).compression == compression
    for cls in (RingAllReduceStrategy, ParameterServerStrategy, ShardedParameterServerStrategy):
        assert cls(on_rank_loss="continue", balance="throughput").balance == "throughput"


def test_the_options_are_checked_by_name():
    with pytest.raises(ValueError, match="on_rank_loss"):
        RingAllReduceStrategy(on_rank_loss="restart")
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        RingAllReduceStrategy(on_rank_loss="continue", heartbeat_timeout=0)
    with pytest.raises(ValueError, match="max_lost_ranks"):
        RingAllReduceStrategy(on_rank_loss="continue", max_lost_ranks=-1)
    with pytest.raises(ConfigurationError, match="max_lost_ranks applies to on_rank_loss='continue'"):
        RingAllReduceStrategy(max_lost_ranks=1)
    with pytest.raises(ValueError, match="restart_lost_ranks"):
        RingAllReduceStrategy(on_rank_loss="continue", restart_lost_ranks=-1)
    with pytest.raises(ConfigurationError, match="restart_lost_ranks=1 needs on_rank_loss='continue'"):
        RingAllReduceStrategy(restart_lost_ranks=1)
    with pytest.raises(ValueError, match="max_ranks must be an integer >= 1"):
        RingAllReduceStrategy(on_rank_loss="continue", max_ranks=0)
    with pytest.raises(ValueError, match="max_ranks must be at most 63"):
        RingAllReduceStrategy(on_rank_loss="continue", max_ranks=64)
    with pytest.raises(ConfigurationError, match="max_ranks applies to on_rank_loss='continue'"):
        ShardedParameterServerStrategy(max_ranks=4)
    assert ShardedParameterServerStrategy(on_rank_loss="continue", max_ranks=4).max_ranks == 4
    with pytest.raises(ConfigurationError, match="max_ranks=4 cannot be kept: .*num_servers=2 takes new trainers only"):
        ShardedParameterServerStrategy(on_rank_loss="continue", num_servers=2, max_ranks=4)
    # below the ranks the job starts with: refused once the world size is known, before any process starts
    with pytest.raises(ConfigurationError, match="max_ranks=2 is below the 4 ranks the job starts with"):
        RingAllReduceStrategy(on_rank_loss="continue", max_ranks=2)._check_world_size(4)
    RingAllReduceStrategy(on_rank_loss="continue", max_ranks=4)._check_world_size(4)


def test_restarting_lost_servers_needs_servers_trainer_0_starts_and_a_job_that_goes_on():
    """Each missing condition is named with the value given (planted: a check that forgets one fails its case)."""
    for cls in (ParameterServerStrategy, ShardedParameterServerStrategy):
        kept = cls(on_rank_loss="continue", num_servers=2, restart_lost_servers=3)
        assert kept.restart_lost_servers == 3
        with pytest.raises(ValueError, match="restart_lost_servers"):
            cls(on_rank_loss="continue", num_servers=2, restart_lost_servers=-1)
        with pytest.raises(
            ConfigurationError, match="restart_lost_servers=1 needs num_servers > 1 .* got num_servers=0"
        ):
            cls(on_rank_loss="continue", restart_lost_servers=1)
        with pytest.raises(ConfigurationError, match="needs num_servers > 1 .*no replica.* got num_servers=1"):
            cls(on_rank_loss="continue", num_servers=1, restart_lost_servers=1)
        with pytest.raises(ConfigurationError, match="needs start_servers True .* got start_servers=False"):
            cls(on_rank_loss="continue", num_servers=2, start_servers=False, restart_lost_servers=1)
        with pytest.raises(ConfigurationError, match="needs on_rank_loss 'continue' .* got on_rank_loss='stop'"):
            cls(num_servers=2, restart_lost_servers=1)


def test_restarting_a_lost_rank_is_kept_with_or_without_dedicated_servers():
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
