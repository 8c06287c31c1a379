"""Train a small model with ``CommMonitor`` and a CSV logger; rank 0 saves, per step, the strategy's own byte
counters and the monitor's summary (run by tests/test_monitor.py as a subprocess)."""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

import lightning_dp
from lightning_dp import CommMonitor
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
from tests.scripts.models import RegressionModel

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="ring_allreduce")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--intra-node", choices=["shm", "ring"], default=None)
parser.add_argument("--staleness", type=int, default=None)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--two-steps-per-batch", action="store_true", help="manual optimization: two optimizer steps")
parser.add_argument("--out", required=True)
args = parser.parse_args()


class CounterRecord(L.Callback):
    """The strategy's counters after each optimizer step (after CommMonitor's hook: it comes later in the list),
    and the wall-clock seconds from the start of training (then from the previous batch's end) to each batch's end."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.batch_seconds: list[float] = []
        self._last = 0.0

    def on_train_start(self, trainer, pl_module):
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self.batch_seconds.append(now - self._last)
        self._last = now
        stats = getattr(trainer.strategy, "sync_stats", None)
        if stats is not None:
            self.steps.append(list(stats.last_step_bytes))


strategy = args.strategy
if strategy == "ddp":  # the model has a branch that only some batches use
    strategy = "ddp_find_unused_parameters_true"
options = {"intra_node": args.intra_node, "staleness": args.staleness}
options = {k: v for k, v in options.items() if v is not None}
if options:
    classes = {"ring_allreduce": lightning_dp.RingAllReduceStrategy,
               "parameter_server": lightning_dp.ParameterServerStrategy,
               "sharded_ps": lightning_dp.ShardedParameterServerStrategy}  # fmt: skip
    strategy = classes[strategy](**options)
monitor, record = CommMonitor(), CounterRecord()
torch.manual_seed(0)
trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                    logger=CSVLogger(args.out, name="csv"), callbacks=[monitor, record], log_every_n_steps=1,
                    enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                    limit_val_batches=0)  # fmt: skip


class TwoStepsPerBatch(RegressionModel):
    """Manual optimization: one backward, then two optimizer steps (the second one moves nothing for the ring)."""

    def __init__(self) -> None:
        super().__init__(8, "sgd")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.loss(batch))
        optimizer.step()
        optimizer.step()


trainer.fit(TwoStepsPerBatch() if args.two_steps_per_batch else RegressionModel(8, "sgd"))
if trainer.global_rank == 0:
    assert monitor.summary is not None
    summary = dataclasses.asdict(monitor.summary)
    Path(args.out, "result.json").write_text(json.dumps({
        "counters": record.steps, "batch_seconds": record.batch_seconds, "summary": summary,
        "log_dir": trainer.logger.log_dir,
        "full_gradients": getattr(trainer.strategy, "full_gradients", None),
        "steps_bytes": list(getattr(trainer.strategy, "sync_stats", None).steps_bytes)
        if hasattr(trainer.strategy, "sync_stats")
        else None,
    }))  # fmt: skip
