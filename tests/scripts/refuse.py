"""Fit a small module with a given optimizer under a strategy (the tests expect some combinations to be refused)."""

import argparse

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_dp  # registers the strategies
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--optimizer", required=True)
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--sparse", action="store_true", help="add an nn.Embedding(sparse=True)")
parser.add_argument("--num-servers", type=int, default=0, help="strategy option: dedicated server processes")
parser.add_argument(
    "--halve-lr-in-hook", action="store_true", help="a callback declaring reads_gradients = False halves the lr"
)
args = parser.parse_args()


class HalvesLearningRate(L.Callback):
    """Breaks its promise: declares it reads no gradient, then changes the optimizer in a gradient hook."""

    reads_gradients = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for group in optimizer.param_groups:
            group["lr"] /= 2


class Model(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        if args.sparse:
            self.embedding = torch.nn.Embedding(10, 32, sparse=True)

    def forward(self, x):
        if args.sparse:
            x = x + self.embedding(torch.zeros(len(x), dtype=torch.long))
        return super().forward(x)

    def configure_optimizers(self):
        cls = getattr(torch.optim, args.optimizer)
        return cls(self.parameters(), lr=0.1)


strategy = args.strategy
if args.num_servers:
    servers = {
        "parameter_server": lightning_dp.ParameterServerStrategy,
        "sharded_ps": lightning_dp.ShardedParameterServerStrategy,
    }
    strategy = servers[args.strategy](num_servers=args.num_servers)
L.Trainer(
    strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=1, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    callbacks=[HalvesLearningRate()] if args.halve_lr_in_hook else [],
).fit(Model())  # fmt: skip
print("TRAINED")
