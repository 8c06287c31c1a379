"""Train ``RegressionModel`` for whole epochs under a strategy, optionally resuming from a checkpoint."""

import argparse
import os

import lightning as L
import torch

import lightning_dp  # noqa: F401 - registers the strategies
from tests.scripts.models import RegressionModel

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="ring_allreduce")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--optimizer", default="adamw")
parser.add_argument("--max-epochs", type=int, default=1)
parser.add_argument("--resume-from", default=None)
parser.add_argument("--save-to", default=None)
parser.add_argument("--compression", default=None, help="strategy option (with intra_node='ring')")
parser.add_argument("--powersgd-rank", type=int, default=1)
parser.add_argument("--powersgd-warmup", type=int, default=2)
parser.add_argument("--out", required=True)
args = parser.parse_args()

strategy = args.strategy
if args.compression is not None:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[strategy]
    options = {"intra_node": "ring", "compression": args.compression, "powersgd_rank": args.powersgd_rank}
    strategy = entry["strategy"](**{**entry["init_params"], **options, "powersgd_warmup_steps": args.powersgd_warmup})

single = args.strategy == "single_device"
model = RegressionModel(args.batch_size, args.optimizer, explicit_sampler=single)
trainer = L.Trainer(
    strategy="auto" if single else strategy,
    accelerator="cpu",
    devices=1 if single else args.devices,
    max_epochs=args.max_epochs,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, ckpt_path=args.resume_from)
if args.save_to:
    trainer.save_checkpoint(args.save_to)
os.makedirs(args.out, exist_ok=True)
torch.save(
    {"weights": model.history, "global_step": trainer.global_step},
    os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
)
