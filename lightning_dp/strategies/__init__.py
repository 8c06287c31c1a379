"""Lightning strategies: thin adapters from Lightning's Strategy API to the schemes in :mod:`lightning_dp.comm`."""

from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.parameter_server import ParameterServerStrategy
from lightning_dp.strategies.parameter_server_base import ParameterServerBase
from lightning_dp.strategies.processes import ProcessGroupStrategy
from lightning_dp.strategies.ring_allreduce import RingAllReduceStrategy
from lightning_dp.strategies.sharded_ps import ShardedParameterServerStrategy

STRATEGIES = (RingAllReduceStrategy, ParameterServerStrategy, ShardedParameterServerStrategy)

__all__ = [
    "STRATEGIES",
    "DataParallelStrategy",
    "ParameterServerBase",
    "ParameterServerStrategy",
    "ProcessGroupStrategy",
    "RingAllReduceStrategy",
    "ShardedParameterServerStrategy",
    "register_strategies",
]


def register_strategies() -> None:
    """Add every lightning-dp strategy to Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for cls in STRATEGIES:
        cls.register_strategies(StrategyRegistry)


register_strategies()
