"""Train ``RegressionModel`` for whole epochs under a strategy, optionally resuming from a checkpoint."""

import argparse
import os

import lightning as L
import torch

import lightning_dp  # noqa: F401 - registers the strategies
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
from tests.scripts.models import RegressionModel, flat_weights

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

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
parser.add_argument("--staleness", default=None, help="strategy option: an integer, or 'none' (asynchronous)")
parser.add_argument("--num-servers", type=int, default=None, help="strategy option: dedicated server processes")
parser.add_argument("--checkpoint-every", type=int, default=None, help="ModelCheckpoint every n steps into <out>/ckpt")
parser.add_argument("--out", required=True)
args = parser.parse_args()

strategy = args.strategy
if args.compression is not None:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[strategy]
    options = {"intra_node": "ring", "compression": args.compression, "powersgd_rank": args.powersgd_rank}
    strategy = entry["strategy"](**{**entry["init_params"], **options, "powersgd_warmup_steps": args.powersgd_warmup})

if args.staleness is not None:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[strategy]
    staleness = None if args.staleness == "none" else int(args.staleness)
    strategy = entry["strategy"](**{**entry["init_params"], "staleness": staleness})

if args.num_servers is not None:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[strategy]
    strategy = entry["strategy"](**{**entry["init_params"], "num_servers": args.num_servers})


class StartState(L.Callback):
    """The weights and the (consolidated) optimizer state every rank starts training from."""

    def on_train_start(self, trainer, pl_module):
        self.weights = flat_weights(pl_module)
        self.optimizer_state = trainer.strategy.optimizer_state(trainer.optimizers[0])  # collective


start_state = StartState()
callbacks = [start_state]
if args.checkpoint_every:
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks.append(ModelCheckpoint(os.path.join(args.out, "ckpt"), every_n_train_steps=args.checkpoint_every,
                                     save_top_k=-1, filename="{step}"))  # fmt: skip

single = args.strategy == "single_device"
model = RegressionModel(args.batch_size, args.optimizer, explicit_sampler=single)
trainer = L.Trainer(
    strategy="auto" if single else strategy,
    accelerator="cpu",
    devices=1 if single else args.devices,
    max_epochs=args.max_epochs,
    logger=False,
    enable_checkpointing=bool(args.checkpoint_every),
    callbacks=callbacks,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, ckpt_path=args.resume_from)
if args.save_to:
    trainer.save_checkpoint(args.save_to)
os.makedirs(args.out, exist_ok=True)
torch.save(
    {
        "weights": model.history,
        "global_step": trainer.global_step,
        "final": flat_weights(model),
        "start_weights": start_state.weights,
        "start_optimizer_state": start_state.optimizer_state,
        "staleness_seen": dict(getattr(trainer.strategy, "staleness_seen", None).histogram)
        if hasattr(trainer.strategy, "staleness_seen")
        else None,
    },  # fmt: skip
    os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
)
