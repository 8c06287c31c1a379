"""Step engines: how a parameter-server strategy runs its step, one object per consistency model."""

from lightning_dp.strategies.engines.backup import BackupEngine
from lightning_dp.strategies.engines.base import StepEngine
from lightning_dp.strategies.engines.dedicated import DedicatedEngine
from lightning_dp.strategies.engines.regrouping import RegroupingDedicatedEngine
from lightning_dp.strategies.engines.stale import StaleEngine
from lightning_dp.strategies.engines.synchronous import CentralServerEngine, ShardedServerEngine, SynchronousEngine

__all__ = [
    "BackupEngine",
    "CentralServerEngine",
    "DedicatedEngine",
    "RegroupingDedicatedEngine",
    "ShardedServerEngine",
    "StaleEngine",
    "StepEngine",
    "SynchronousEngine",
]
