"""Ray Train: the strategies as classes Ray's ``prepare_trainer`` accepts (``pip install "lightning-dp[ray]"``).

Ray's recipe (``TorchTrainer`` + ``RayLightningEnvironment`` + ``prepare_trainer``) accepts only subclasses of its
``RayDDPStrategy``. Each class here is a lightning-dp strategy first and a ``RayDDPStrategy`` second: it behaves
exactly like its plain version (every option, the same weights), and ``prepare_trainer`` takes it::

    from lightning_dp.ray import RayShardedParameterServerStrategy

    def train_loop_per_worker():
        trainer = L.Trainer(devices="auto", accelerator="auto", strategy=RayShardedParameterServerStrategy(),
                            plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback()])
        trainer = prepare_trainer(trainer)
        trainer.fit(model)

The plain strategies work under Ray too, by name or instance, with ``devices="auto"``, when ``prepare_trainer`` is
not called. Ray creates the default process group itself: the ``timeout`` option then covers the strategy's own
gradient traffic, and Ray's ``TorchConfig(timeout_s=...)`` the rest. This is the only module that imports Ray.
"""

from __future__ import annotations

try:
    from ray.train.lightning import RayDDPStrategy
except ImportError as missing:  # pragma: no cover - depends on the environment
    raise ImportError('lightning_dp.ray needs Ray Train: pip install "lightning-dp[ray]"') from missing

from lightning_dp.strategies import ParameterServerStrategy, RingAllReduceStrategy, ShardedParameterServerStrategy


class RayRingAllReduceStrategy(RingAllReduceStrategy, RayDDPStrategy):
    """:class:`~lightning_dp.RingAllReduceStrategy` for Ray Train's ``prepare_trainer``."""


class RayParameterServerStrategy(ParameterServerStrategy, RayDDPStrategy):
    """:class:`~lightning_dp.ParameterServerStrategy` for Ray Train's ``prepare_trainer``."""


class RayShardedParameterServerStrategy(ShardedParameterServerStrategy, RayDDPStrategy):
    """:class:`~lightning_dp.ShardedParameterServerStrategy` for Ray Train's ``prepare_trainer``."""


__all__ = ["RayParameterServerStrategy", "RayRingAllReduceStrategy", "RayShardedParameterServerStrategy"]
