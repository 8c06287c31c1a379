"""Train any LightningModule under any strategy, configured by Hydra.

python examples/train.py                                    # reference CNN, digits, 2 CPU processes, ring_allreduce
python examples/train.py strategy=sharded_ps trainer.devices=4
python examples/train.py strategy=parameter_server strategy.server_rank=1
python examples/train.py -m strategy=ring_allreduce,parameter_server,sharded_ps,ddp
python examples/train.py model=boring
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_dp import CommMonitor, hydra_support

log = logging.getLogger(__name__)


def world_size(cfg: DictConfig) -> int | None:
    """The number of processes the config asks for (``None`` for ``devices="auto"``: the cluster decides)."""
    devices = cfg.trainer.devices
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        count = len(devices)
    elif isinstance(devices, int) or str(devices).isdigit():
        count = int(devices)
    else:
        return None
    return count * int(cfg.trainer.get("num_nodes", 1))


def check_batch_size(global_batch_size: int, ranks: int) -> None:
    if global_batch_size % ranks:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be divisible by the number of processes ({ranks})"
        )


def check_config(cfg: DictConfig) -> None:
    """Fail before any process starts on values only the app can judge."""
    devices = cfg.trainer.devices
    if cfg.trainer.accelerator == "cpu" and isinstance(devices, int):
        cpus = os.cpu_count() or 1
        if devices < 1 or devices > cfg.max_processes_per_cpu * cpus:
            raise ValueError(
                f"trainer.devices={devices} is not possible with accelerator=cpu on this machine: allowed values are "
                f"1..{cfg.max_processes_per_cpu * cpus} ({cpus} CPUs x max_processes_per_cpu="
                f"{cfg.max_processes_per_cpu})"
            )
    ranks = world_size(cfg)
    if ranks is not None:
        check_batch_size(cfg.global_batch_size, ranks)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> dict:
    hydra_support.install()
    check_config(cfg)
    with hydra_support.job_scope():
        return train(cfg)


def train(cfg: DictConfig) -> dict:
    L.seed_everything(cfg.seed, workers=True)
    strategy = instantiate(cfg.strategy)  # options are validated here, before launching
    model = instantiate(cfg.model)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    if cfg.get("data") is None:  # a module with its own data may log no val_loss to monitor
        callbacks = [c for c in callbacks if not isinstance(c, L.pytorch.callbacks.ModelCheckpoint)] + [
            L.pytorch.callbacks.ModelCheckpoint(dirpath=Path(HydraConfig.get().runtime.output_dir) / "checkpoints")
        ]
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer = L.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), strategy=strategy,
                        callbacks=callbacks, logger=logger)  # fmt: skip
    check_batch_size(cfg.global_batch_size, trainer.world_size)  # known now also where the cluster decides it
    datamodule = None
    if cfg.get("data") is not None:
        datamodule = instantiate(cfg.data, batch_size=cfg.global_batch_size // trainer.world_size)
    if trainer.is_global_zero:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        log.info("%s ranks on %s node(s), started by %s, writing to %s", trainer.world_size, trainer.num_nodes,
                 type(environment).__name__ if environment else "this process",
                 HydraConfig.get().runtime.output_dir)  # fmt: skip

    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # the parameter servers' record of how stale each step's weights were (rank 0's, taken before testing)
    seen = getattr(trainer.strategy, "staleness_seen", None)
    staleness = (
        {"max": seen.max, "mean": seen.mean(), "histogram": dict(sorted(seen.histogram.items()))} if seen else None
    )
    # backup workers: the gradients dropped as late and the steps skipped, over every rank (collective)
    backup = None
    if getattr(trainer.strategy, "backup_workers", 0):
        counts = torch.tensor([trainer.strategy.late_gradients, trainer.strategy.skipped_steps], dtype=torch.float64)
        late, skipped = (int(v) for v in trainer.strategy.reduce(counts, reduce_op="sum").tolist())
        backup = {"backup_workers": trainer.strategy.backup_workers, "late_gradients": late, "skipped_steps": skipped}
    # on_rank_loss="continue": the ranks (and dedicated servers) the run went on without, the new processes it admitted,
    # when, and what that cost (the same on every rank)
    rank_loss = getattr(trainer.strategy, "rank_loss", None)
    lost = rank_loss.metrics() if rank_loss is not None else {}
    has_test = datamodule is not None or L.pytorch.utilities.model_helpers.is_overridden("test_step", model)
    if cfg.test and has_test:
        for result in trainer.test(model, datamodule=datamodule, ckpt_path=None, verbose=False):
            metrics.update({k: float(v) for k, v in result.items()})
    if trainer.is_global_zero:
        output = Path(HydraConfig.get().runtime.output_dir)
        summary = {"strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size,
                   "global_step": trainer.global_step, "metrics": metrics}  # fmt: skip
        if staleness is not None:
            summary["staleness_seen"] = staleness
        if backup is not None:
            summary["backup"] = backup
        if lost.get("lost_ranks") or lost.get("lost_servers") or lost.get("joined_ranks") or lost.get("left_ranks"):
            summary["rank_loss"] = lost
        monitor = next((c for c in trainer.callbacks if isinstance(c, CommMonitor)), None)
        if monitor is not None and monitor.summary is not None:  # means per step, measured and predicted
            summary["comm"] = dataclasses.asdict(monitor.summary)
        (output / "metrics.json").write_text(json.dumps(summary, indent=2))
        print("final metrics:", json.dumps(metrics, sort_keys=True))
    return metrics


if __name__ == "__main__":
    main()
