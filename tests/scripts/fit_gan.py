"""Train ``TwoOptimizerModel`` (manual optimization, two optimizers, two LR schedulers) under a strategy."""

import argparse
import os

import lightning as L
import torch

import lightning_dp  # noqa: F401 - registers the strategies
from tests.scripts.models import TwoOptimizerModel

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="ring_allreduce")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", required=True)
args = parser.parse_args()

model = TwoOptimizerModel()
trainer = L.Trainer(
    strategy=args.strategy, accelerator="cpu", devices=args.devices, max_steps=2 * args.steps, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)  # fmt: skip
trainer.fit(model)
os.makedirs(args.out, exist_ok=True)
torch.save({"weights": model.history, "lrs": model.lrs}, os.path.join(args.out, f"rank{trainer.global_rank}.pt"))
