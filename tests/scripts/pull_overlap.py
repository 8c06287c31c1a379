"""The servers' weight pull behind the next forward against the pull at the end of the step, in one launch.

The model has several buckets (``bucket_cap_mb`` of about 4 KB), a module whose weight and bias land in two buckets
(``head``), a parameter registered on two modules (``proj_a`` and ``proj_b`` share a weight), a frozen layer, a
module used twice in one forward (``block``), BatchNorm buffers and a parameter of the LightningModule itself that
``training_step`` reads (``scale``). Every fit trains the same batches with validation every third step, a
checkpoint every second step and Lightning's default callbacks (progress bar, model summary, checkpointing) plus
the learning-rate monitor. Fits, each rank saving what it saw to ``<out>/rank<r>.pt``:

- ``blocking``: ``overlap_pull=False``;
- ``overlapped``: the default;
- ``reader``: overlapped, plus a callback that reads ``param.data`` in ``on_train_batch_end`` without declaring
  ``reads_weights = False``;
- ``early`` / ``early_blocking``: a model whose forward reads ``head.weight`` before ``head`` runs, overlapped
  and not;
- ``planted``: overlapped with a planted bug: ``head``'s forward does not wait for the bucket of its bias.
"""

import argparse
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp  # noqa: F401 - registers the strategies
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
from lightning_dp.comm.weight_pull import OverlappedPull
from lightning_dp.strategies.weight_hooks import CompleteWeightsBefore
from tests.scripts import placement
from tests.scripts.models import flat_weights

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--intra-node", choices=["shm", "ring"], default="shm")
parser.add_argument("--server-rank", type=int, default=None)
parser.add_argument("--compression", default="none")
parser.add_argument("--steps", type=int, default=7)
parser.add_argument("--out", required=True)
args = parser.parse_args()

IN, HIDDEN, WIDE, OUT, BATCH = 8, 16, 64, 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class PullModel(L.LightningModule):
    def __init__(self, early_read: bool = False) -> None:
        super().__init__()
        self.early_read = early_read
        self.scale = nn.Parameter(torch.ones(1))  # registered first: in the last bucket, with the first layer
        self.embed = nn.Linear(IN, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.block = Block()
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.proj_a = nn.Linear(HIDDEN, HIDDEN)
        self.wide = nn.Linear(HIDDEN, WIDE)
        self.head = nn.Linear(WIDE, HIDDEN)
        self.proj_b = nn.Linear(HIDDEN, HIDDEN)
        self.proj_b.weight = self.proj_a.weight
        self.out = nn.Linear(HIDDEN, OUT, bias=False)
        #: the weights every forward read (flat), and the loss of every step
        self.seen: list[torch.Tensor] = []
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x))
        if self.early_read:  # reads head's weight before head's forward
            h = h + 1e-3 * self.head.weight.sum()
        h = self.block(self.block(h))
        h = h + self.frozen(h)
        h = F.relu(self.wide(self.proj_a(h)))
        return self.out(self.proj_b(self.head(h)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        scale = self.scale * 1.0  # the module's own parameter, read before any forward
        loss = F.mse_loss(self(x) * scale, y)
        self.seen.append(flat_weights(self))  # every module ran its forward: the weights this step uses
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x) * self.scale, y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


class WeightReader(Callback):
    """Reads the weights after every step (an EMA would), without declaring anything."""

    def __init__(self) -> None:
        self.after_step: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_step.append(flat_weights(pl_module))


class Watch(Callback):
    """What the strategy's pull did (read at the end of training, before the strategy closes it)."""

    reads_weights = False

    def __init__(self) -> None:
        self.report: dict = {}
        self.val_losses: list[float] = []

    def on_validation_end(self, trainer, pl_module):
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_end(self, trainer, pl_module):
        pull = trainer.strategy.engine.weights
        self.report = {
            "mode": type(pull).__name__,
            "waited_in_forward": getattr(pull, "waited_in_forward", 0),
            "completed_late": getattr(pull, "completed_late", 0),
            "reader_hooks": sorted(
                hook for c in trainer.callbacks if isinstance(c, CompleteWeightsBefore) for hook in c.reader_hooks
            ),
            "callbacks": sorted(type(c).__name__ for c in trainer.callbacks),
        }


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(3)
    n = BATCH * args.devices * args.steps
    train = TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))
    val = TensorDataset(torch.randn(BATCH * args.devices, IN, generator=g), torch.randn(BATCH * args.devices, OUT))
    return DataLoader(train, batch_size=BATCH), DataLoader(val, batch_size=BATCH)


def plant_skipped_wait(strategy) -> None:
    """The planted bug: ``head``'s forward waits for the bucket of its weight but not for the one of its bias (a
    bias is not saved for backward, so autograd cannot notice the late write either; ``out``'s forward, later, takes
    that bucket). That bucket's pull starts half a second late on every rank, so the forward surely reads the bias
    before it arrives."""
    pull = strategy.engine.weights
    assert isinstance(pull, OverlappedPull)
    head = strategy.lightning_module.head
    position = next(i for i, (module, _) in enumerate(pull.holders) if module is head)
    pull._hooks[position].remove()
    weight_bucket = pull.bucket_of[id(head.weight)]
    assert weight_bucket != pull.bucket_of[id(head.bias)]
    head.register_forward_pre_hook(lambda module, args: pull.wait_for([weight_bucket]))
    bias_bucket, exchange = pull.bucket_of[id(head.bias)], pull.exchange

    def late_exchange(bucket):
        if bucket.index == bias_bucket:
            time.sleep(0.5)
        exchange(bucket)

    pull.exchange = late_exchange


class Plant(Callback):
    reads_weights = False

    def on_train_start(self, trainer, pl_module):
        plant_skipped_wait(trainer.strategy)


def fit(name: str, overlap: bool, early_read: bool = False, extra: list | None = None) -> dict:
    L.seed_everything(0)
    model = PullModel(early_read=early_read)
    options = {"overlap_pull": overlap, "bucket_cap_mb": 4200 / 2**20, "intra_node": args.intra_node,
               "compression": args.compression, **placement.backend_options()}  # fmt: skip
    if args.server_rank is not None:
        options["server_rank"] = args.server_rank
    entry = StrategyRegistry[args.strategy]
    strategy = entry["strategy"](**{**entry["init_params"], **options})
    watch = Watch()
    checkpoints = Path(args.out) / f"checkpoints-{name}"
    trainer = L.Trainer(
        strategy=strategy, max_steps=args.steps, val_check_interval=3, limit_val_batches=1,
        logger=CSVLogger(args.out, name=name),
        callbacks=[LearningRateMonitor(), ModelCheckpoint(checkpoints, every_n_train_steps=2, save_top_k=-1),
                   watch, *(extra or [])],
        enable_progress_bar=True, num_sanity_val_steps=0, use_distributed_sampler=True,
        **placement.trainer_placement(args.devices),
    )  # fmt: skip
    train, val = loaders()
    trainer.fit(model, train, val)
    ranks.add(trainer.global_rank)
    saved = sorted(checkpoints.glob("*.ckpt")) if trainer.is_global_zero else []
    return {
        "seen": model.seen, "losses": model.losses, "final": flat_weights(model), "val_losses": watch.val_losses,
        "report": watch.report, "checkpoints": {p.name: torch.load(p)["state_dict"] for p in saved},
    }  # fmt: skip


ranks: set[int] = set()
reader = WeightReader()
runs = {
    "blocking": fit("blocking", overlap=False),
    "overlapped": fit("overlapped", overlap=True),
    "reader": fit("reader", overlap=True, extra=[reader]),
    "early": fit("early", overlap=True, early_read=True),
    "early_blocking": fit("early_blocking", overlap=False, early_read=True),
    "planted": fit("planted", overlap=True, extra=[Plant()]),
}
runs["reader"]["after_step"] = reader.after_step
(rank,) = ranks
torch.save(runs, Path(args.out) / f"rank{rank}.pt")
