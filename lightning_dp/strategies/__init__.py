"""Lightning strategies: thin adapters from Lightning's Strategy API to the schemes in :mod:`lightning_dp.comm`."""

from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.ring_allreduce import RingAllReduceStrategy

STRATEGIES = (RingAllReduceStrategy,)

__all__ = ["STRATEGIES", "DataParallelStrategy", "RingAllReduceStrategy", "register_strategies"]


def register_strategies() -> None:
    """Add every lightning-dp strategy to Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for cls in STRATEGIES:
        cls.register_strategies(StrategyRegistry)
