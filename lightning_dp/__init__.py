"""lightning-dp: data-parallel synchronization schemes as PyTorch Lightning strategies.

Importing the package registers the strategies by name, so ``Trainer(strategy="ring_allreduce")`` works.
"""

from lightning_dp.strategies import (
    DataParallelStrategy,
    ParameterServerStrategy,
    RingAllReduceStrategy,
    ShardedParameterServerStrategy,
    register_strategies,
)

__version__ = "0.1.0"

register_strategies()

__all__ = [
    "DataParallelStrategy",
    "ParameterServerStrategy",
    "RingAllReduceStrategy",
    "ShardedParameterServerStrategy",
    "__version__",
    "register_strategies",
]
