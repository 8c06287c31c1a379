"""Ray Train's documented recipe (``TorchTrainer``, ``RayLightningEnvironment``, ``devices="auto"``) on a local Ray
cluster of 2 CPU workers: ``RayDDPStrategy``, every strategy by name, and every Ray class through
``prepare_trainer``, one fit after another in the same workers. Every worker saves ``<out>/<variant>/rank<r>.pt``
(weights after every step)."""

import argparse
import os
import tempfile
from pathlib import Path

import lightning as L
import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer
from ray.train.torch import TorchTrainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        self.history: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.history.append(torch.cat([p.detach().flatten() for p in self.parameters()]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g))
        return DataLoader(data, batch_size=8, shuffle=True)


def variants():
    import lightning_dp  # noqa: F401 - registers the names
    from lightning_dp.ray import RayParameterServerStrategy, RayRingAllReduceStrategy, RayShardedParameterServerStrategy

    return [
        ("ray_ddp", RayDDPStrategy, True),
        ("ring_allreduce", lambda: "ring_allreduce", False),
        ("parameter_server", lambda: "parameter_server", False),
        ("sharded_ps", lambda: "sharded_ps", False),
        ("RayRingAllReduceStrategy", RayRingAllReduceStrategy, True),
        ("RayParameterServerStrategy", RayParameterServerStrategy, True),
        ("RayShardedParameterServerStrategy", RayShardedParameterServerStrategy, True),
    ]


def train_loop_per_worker(config):
    out = Path(config["out"])
    for name, make_strategy, prepare in variants():
        model = Model()
        trainer = L.Trainer(devices="auto", accelerator="cpu", strategy=make_strategy(), max_epochs=1,
                            plugins=[RayLightningEnvironment()], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        if prepare:
            trainer = prepare_trainer(trainer)
        trainer.fit(model)
        (out / name).mkdir(parents=True, exist_ok=True)
        result = {"history": model.history, "world_size": trainer.world_size,
                  "strategy": type(trainer.strategy).__name__}  # fmt: skip
        torch.save(result, out / name / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    with tempfile.TemporaryDirectory() as storage:
        TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"out": str(Path(args.out).resolve())},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage, name="lightning_dp"),
        ).fit()
    ray.shutdown()
    print("ray run done")
