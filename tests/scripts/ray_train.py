"""Ray Train's documented recipe (``TorchTrainer``, ``RayLightningEnvironment``, ``devices="auto"``) on a local Ray
cluster of 2 CPU workers: ``RayDDPStrategy``, every strategy by name, and every Ray class through
``prepare_trainer``, one fit after another in the same workers. Every worker saves ``<out>/<variant>/rank<r>.pt``
(weights after every step).

Then Ray Train's restart: ``sharded_ps`` trains two epochs once without interruption (in the same workers) and once
under ``FailureConfig(max_failures=1)`` with ``RayTrainReportCallback`` (a checkpoint reported at every epoch's
end) and worker 1 SIGKILLed after step 6; Ray starts the workers again and the loop resumes from
``ray.train.get_checkpoint()``. Both save ``<out>/<uninterrupted|restarted>/<strategy>/rank<r>.pt`` (final weights,
weights after each step this process trained, the checkpoint's step). One strategy: the restart is Ray's and the
resume the one every strategy's torchrun restart checks (tests/strategies/test_clusters.py); and a worker's
``RayTrainReportCallback`` empties the checkpoint folder of the one before it, so each process reports one fit's."""

import argparse
import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path

import lightning as L
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()


#: trained to a restart: rank 1 is SIGKILLed after this step (epoch 1 of 2, after epoch 0's checkpoint)
RESTARTED = ["sharded_ps"]
KILL_AFTER_STEP = 6


class Model(L.LightningModule):
    def __init__(self, strategy: str = "") -> None:
        super().__init__()
        self.save_hyperparameters()  # the strategy: which run a reported checkpoint belongs to
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
    for strategy in RESTARTED:
        train_two_epochs(strategy, out / "uninterrupted" / strategy, report=False)


#: seconds worker 1 waits before it dies: Ray Train's controller collects reported checkpoints by polling the
#: workers, and a group that fails before the poll loses the report (it would restart from nothing)
REPORT_COLLECTED_SECONDS = 6.0


class KillOnce(L.Callback):
    """Worker 1 dies after :data:`KILL_AFTER_STEP`, the first time only (a marker file remembers), once the
    checkpoint reported before it has been collected."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == KILL_AFTER_STEP and trainer.global_rank == 1 and not self.marker.exists():
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()
            time.sleep(REPORT_COLLECTED_SECONDS)
            os.kill(os.getpid(), signal.SIGKILL)


def train_two_epochs(
    strategy: str, folder: Path, resume: str | None = None, kill_marker: Path | None = None, report: bool = True
):
    import lightning_dp  # noqa: F401 - registers the names (a restarted worker imports nothing else of ours)

    model = Model(strategy)
    callbacks = [*([RayTrainReportCallback()] if report else []), *([KillOnce(kill_marker)] if kill_marker else [])]
    trainer = L.Trainer(devices="auto", accelerator="cpu", strategy=strategy, max_epochs=2, callbacks=callbacks,
                        plugins=[RayLightningEnvironment()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, ckpt_path=resume)
    folder.mkdir(parents=True, exist_ok=True)
    resumed_step = torch.load(resume, weights_only=False)["global_step"] if resume else None
    result = {"weights": torch.cat([p.detach().flatten() for p in model.parameters()]), "history": model.history,
              "resumed_step": resumed_step}  # fmt: skip
    torch.save(result, folder / f"rank{trainer.global_rank}.pt")


def restarted_loop_per_worker(config):
    """Every strategy of :data:`RESTARTED` in turn, each killed once; after Ray's restart the strategy whose run
    was interrupted resumes from the newest reported checkpoint, the finished ones are not run again."""
    out = Path(config["out"])
    rank = ray.train.get_context().get_world_rank()
    for strategy in RESTARTED:
        folder = out / "restarted" / strategy
        if (folder / f"rank{rank}.pt").exists():
            continue
        checkpoint = ray.train.get_checkpoint()
        with checkpoint.as_directory() if checkpoint else contextlib.nullcontext() as directory:
            path = os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME) if directory else None
            ours = path is not None and torch.load(path, weights_only=False)["hyper_parameters"]["strategy"] == strategy
            train_two_epochs(strategy, folder, path if ours else None, out / "restarted" / f"killed-{strategy}")


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
        TorchTrainer(
            restarted_loop_per_worker,
            train_loop_config={"out": str(Path(args.out).resolve())},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage, name="lightning_dp_restarted",
                                 failure_config=FailureConfig(max_failures=len(RESTARTED))),
        ).fit()  # fmt: skip
    ray.shutdown()
    print("ray run done")
